"""`tune serve`: the bundled engine's server for an EngineConfig, or, for an external server's
best.yaml, that server as the study measured it (its launch command, on the host and port asked
for), in place of this process."""

from __future__ import annotations

import os
import shlex
import sys
from pathlib import Path

from slotune.tuner.spec.server import ServerConfig
from slotune.tuner.spec.yaml_reader import load_yaml_mapping


def serve_command(
    config: Path | None,
    *,
    host: str,
    port: int,
    api_key: str | None,
    served_model_name: str | None,
    record_traffic: Path | None,
    record_traffic_max_mib: float,
    model: str | None,
    overrides: list[str],
) -> None:
    """Serve CONFIG (`--model` and `--set key=value` over it), or exec a server's best.yaml launch."""
    launch = server_launch(config)
    if launch is not None:
        options = {"--api-key": api_key, "--served-model-name": served_model_name, "--record-traffic": record_traffic}
        exec_launch(launch, host, port, {**options, "--model": model, "--set": overrides})
    from slotune.engine.serving import server  # imports torch, FastAPI
    from slotune.tuner.commands import parse_overrides

    server.serve_command(
        config=config,
        overrides={**parse_overrides(overrides), **({"model": model} if model else {})},
        host=host,
        port=port,
        api_key=api_key,
        served_model_name=served_model_name,
        record_traffic=record_traffic,
        record_traffic_max_mib=record_traffic_max_mib,
    )


def server_launch(config: Path | None) -> ServerConfig | None:
    """The launch a best.yaml of a spec with `server:` holds; None for a bundled engine's config."""
    if config is None:
        return None
    data = load_yaml_mapping(config, "config file")
    if isinstance(data.get("engine"), str) and "knobs" in data:
        return ServerConfig.model_validate(data)
    return None


def exec_launch(cfg: ServerConfig, host: str, port: int, unused: dict[str, object]) -> None:
    """Replace this process with the server. `unused`: options of `tune serve` given that only the
    bundled engine takes (ValueError naming them)."""
    given = [flag for flag, value in unused.items() if value]
    if given:
        raise ValueError(
            f"{', '.join(given)}: options of the bundled engine's server; {cfg.engine} takes its own flags "
            "(add them to the best.yaml's knobs, or run its `# launch:` command yourself)"
        )
    if cfg.resolved_binary() is None:
        raise ValueError(
            f"`{cfg.binary or cfg.description().binary}` is not on PATH; install {cfg.engine} or set binary"
        )
    argv = cfg.argv(port=port, host=host)
    print(f"launching: {shlex.join(argv)}", file=sys.stderr, flush=True)
    os.execv(argv[0], argv)
