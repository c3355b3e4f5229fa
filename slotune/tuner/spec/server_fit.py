"""What a spec that launches servers (`server:`, or a shoot-out's `servers:`) must fit: each search
space tunes its server's engine, each gate is one every listed engine serves through its API, and
the study's stages are ones a server study runs. The checks of TuningSpec's validation."""

from __future__ import annotations

from slotune.evals.tasks import generation_tasks, task_output_type
from slotune.search_spaces.schema import Knob, SearchSpace
from slotune.tuner.spec.engines import EngineDescription
from slotune.tuner.spec.server import MODEL_KNOB


def check(spec) -> None:
    """ValueError naming the first thing in `spec` (a TuningSpec being validated) that does not fit
    what it launches."""
    if spec.servers:
        if spec.server is not None:
            raise ValueError("server and servers: a study launches one server or a shoot-out of several; keep one")
        for s in spec.servers:
            _check_gates(spec, s.description())
        _check_stages(spec, "servers")
        return
    engine = spec.server.engine if spec.server else None
    if spec.search_space.engine != engine:
        space = f"search_space '{spec.search_space.name}'"
        if engine is None:
            raise ValueError(
                f"{space} names {spec.search_space.engine} knobs; add `server: {{engine: "
                f"{spec.search_space.engine}}}` or use a space of the bundled engine (latency, throughput)"
            )
        tunes = f"tunes {spec.search_space.engine}" if spec.search_space.engine else "tunes the bundled engine"
        raise ValueError(f"{space} {tunes}, not {engine}; use a space for {engine}, e.g. {engine}-cpu")
    if engine is None:
        for i, g in enumerate(spec.quality_gates):
            if g.kind == "greedy_match":
                raise ValueError(
                    f"quality_gates[{i}] '{g.name}': greedy_match judges an external server (`server:`); "
                    "the bundled engine's logits are judged by kind agreement"
                )
        return
    _check_gates(spec, spec.server.description())
    _check_stages(spec, f"server.engine {engine}")
    if spec.server.models:
        spec.search_space = _with_model_knob(spec.search_space, [spec.model, *spec.server.models])


def _check_gates(spec, engine: EngineDescription) -> None:
    served = engine.gates
    for i, g in enumerate(spec.quality_gates):
        if g.kind not in served:
            raise ValueError(
                f"quality_gates[{i}] '{g.name}': kind {g.kind} needs the bundled engine; {engine.name} is judged "
                f"through its API by {', '.join(served) or 'no gate kind'}"
            )
        if g.task and (scored := task_output_type(g.task)) != "generate_until":
            raise ValueError(
                f"quality_gates[{i}] '{g.name}': task {g.task} is scored by {scored}, which needs the model's "
                f"log-probabilities; {engine.name} is judged through its API on generation tasks "
                f"({', '.join(generation_tasks())})"
            )


def _check_stages(spec, what: str) -> None:
    for field, wrong, fix in (
        ("engine", bool(spec.engine), "the bundled engine's fields; set server.knobs instead"),
        ("budget.measure", spec.budget.measure != "served", "in_process drives the bundled engine; use served"),
    ):
        if wrong:
            raise ValueError(f"{field} with {what}: {fix}")


def _with_model_knob(space: SearchSpace, models: list[str]) -> SearchSpace:
    """server.models as the space's `model` knob: the spec's model (the default's) and those."""
    knob = Knob(name=MODEL_KNOB, type="categorical", choices=list(dict.fromkeys(models)))
    if knob in space.knobs:  # added already: this spec was dumped and read again
        return space
    if any(k.name == MODEL_KNOB for k in space.knobs):
        raise ValueError(
            f"server.models and search_space knob '{MODEL_KNOB}' both list the weights to choose among; keep one"
        )
    data = space.model_dump(exclude_none=True)
    return SearchSpace.model_validate({**data, "knobs": [knob.model_dump(), *data["knobs"]]})
