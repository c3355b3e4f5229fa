"""An engine shoot-out: several servers searched in one study, under one SLO and one set of gates.

The spec's `servers:` lists them, the first being the default launch (what you run today). The
study's space is one categorical `server` over their names, then each server's own space under its
name (`llama-server.parallel`), sampled only when that server is chosen (Optuna's conditional
parameters). Every other server's default launch is enqueued (tagged `default <name>`), then each
space's starts. A trial's config is one server's launch (a `ServerConfig` with its `name`), so the
measurement, the gates, the confirmation and best.yaml handle it as in a study of one server.
"""

from __future__ import annotations

from typing import Any

from pydantic import Field

from slotune.search_spaces.schema import Knob, SearchSpace, Start
from slotune.tuner.spec.server import SERVER_KNOB, Launch, ServerConfig

DEFAULT_PREFIX = "default "  # the tag of another server's default launch: "default llama-server"


class ShootoutServer(Launch):
    """One of a spec's `servers:`: an engine's launch as the spec fixes it, and the space searched on it."""

    name: str | None = Field(
        None, pattern=r"^[a-z][a-z0-9_-]*$", description="its name in the study; default: the engine's name"
    )
    search_space: SearchSpace = Field(description="the knobs searched on this server (a space for its engine)")

    @property
    def label(self) -> str:
        return self.name or self.description().name

    def launch(self, model: str) -> ServerConfig:
        return ServerConfig(engine=self.engine, binary=self.binary, knobs=self.knobs, model=model, name=self.label)


class Shootout:
    """The search's base in a shoot-out: each server's launch as the spec fixes it, by name."""

    def __init__(self, servers: list[ShootoutServer], model: str) -> None:
        self.launches = {s.label: s.launch(model) for s in servers}
        self.default = next(iter(self.launches.values()))

    def with_updates(self, updates: dict[str, Any]) -> ServerConfig:
        """The launch a trial's params make: the chosen server's, with its own knobs on top."""
        name = updates.get(SERVER_KNOB, self.default.name)
        if name not in self.launches:
            raise ValueError(f"{SERVER_KNOB}: {name!r} is not one of the servers ({', '.join(self.launches)})")
        prefix = f"{name}."
        return self.launches[name].with_updates(
            {k[len(prefix) :]: v for k, v in updates.items() if k.startswith(prefix)}
        )

    def value_at(self, name: str) -> Any:
        return self.default.value_at(name)


def check_servers(servers: list[ShootoutServer]) -> None:
    """ValueError unless the servers make a shoot-out: two or more, each name once, each space for its engine."""
    if len(servers) < 2:
        raise ValueError("servers: a shoot-out lists two or more servers; for one, use `server:`")
    labels = [s.label for s in servers]
    twice = sorted({n for n in labels if labels.count(n) > 1})
    if twice:
        raise ValueError(f"servers: {', '.join(twice)} named twice; give each a `name:`")
    for i, s in enumerate(servers):
        if s.search_space.engine != s.description().name:
            raise ValueError(
                f"servers[{i}] '{s.label}': search_space '{s.search_space.name}' tunes "
                f"{s.search_space.engine or 'the bundled engine'}, not {s.description().name}"
            )


def shootout_space(servers: list[ShootoutServer]) -> SearchSpace:
    """One space over the servers: `server`, then each server's knobs, forbidden rules and starts under
    its name. Each server's space was validated on its own; this one is assembled from them."""
    labels = [s.label for s in servers]
    knobs = [Knob(name=SERVER_KNOB, type="categorical", choices=labels)]
    forbidden: list[dict[str, Any]] = []
    starts: list[Start] = []
    for s in servers:
        p = f"{s.label}."
        for k in s.search_space.knobs:
            when = {SERVER_KNOB: [s.label], **{p + c: v for c, v in k.when.items()}}
            knobs.append(k.model_copy(update={"name": p + k.name, "when": when}))
        for rule in s.search_space.forbidden:
            forbidden.append({SERVER_KNOB: [s.label], **{p + k: v for k, v in rule.items()}})
        for st in s.search_space.starts:
            params = {SERVER_KNOB: s.label, **{p + k: v for k, v in st.params.items()}}
            then = [{p + k: v for k, v in t.items()} for t in st.then]
            starts.append(st.model_copy(update={"name": f"{s.label}: {st.name}", "params": params, "then": then}))
    return SearchSpace.model_construct(
        name=" vs ".join(labels),
        description=f"shoot-out of {', '.join(labels)}",
        engine=None,
        knobs=knobs,
        forbidden=forbidden,
        starts=starts,
    )


def default_tag(label: str) -> str:
    return DEFAULT_PREFIX + label


def server_of_tag(tag: str | None) -> str | None:
    """The server whose default launch a trial tagged `tag` measures (None: not such a trial)."""
    return tag[len(DEFAULT_PREFIX) :] if tag and tag.startswith(DEFAULT_PREFIX) else None
