"""`tune serve`: the bundled engine's server for an EngineConfig, or, for an external server's
best.yaml, that server as the study measured it behind a metering proxy on the host and port asked
for (slotune/tuner/metered_proxy.py: the same /health, /ready and latency histograms as the bundled one)."""

from __future__ import annotations

from pathlib import Path

from slotune.tuner.spec.server import ServerConfig, is_launch
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
    """Serve CONFIG (`--model` and `--set key=value` over it), or a server's best.yaml launch."""
    launch = server_launch(config)
    if launch is not None:
        options = {"--served-model-name": served_model_name, "--record-traffic": record_traffic}
        refuse_options(launch, {**options, "--model": model, "--set": overrides})
        from slotune.tuner.metered_proxy import serve_metered  # imports aiohttp

        serve_metered(launch, host, port, api_key)
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
    if is_launch(data):
        return ServerConfig.model_validate(data)
    return None


def refuse_options(cfg: ServerConfig, unused: dict[str, object]) -> None:
    """ValueError naming the options of `tune serve` given that only the bundled engine takes."""
    given = [flag for flag, value in unused.items() if value]
    if given:
        raise ValueError(
            f"{', '.join(given)}: options of the bundled engine's server; {cfg.engine} takes its own flags "
            "(add them to the best.yaml's knobs, or run its `# launch:` command yourself)"
        )
