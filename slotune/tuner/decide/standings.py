"""A shoot-out's standings: each server's best candidate as the confirmation measured it, beside the
others on the same seeds, and how far it is from the winner."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from slotune.tuner.decide.confirm import Confirmation


@dataclass(frozen=True)
class Standing:
    server: str
    trial: int | None  # its best candidate; None: no trial of it met the SLO and the gates
    value: float | None  # that candidate's median of the objective on the confirmation's seeds
    held: bool  # it held the SLO on every seed
    vs_winner: float | None  # how many times better the winner is (>= 1 when the winner is better)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def standings(servers: list[str], c: Confirmation, configs: dict[int, dict[str, Any]]) -> list[Standing]:
    """One Standing per server, best first; `configs`: each candidate's stored config (its `name`)."""
    best = (c.median(c.winner) or {}).get(c.key)
    sign = 1 if c.direction == "minimize" else -1
    out = []
    for server in servers:
        n = next((n for n in c.candidates if configs[n].get("name") == server), None)
        if n is None:
            out.append(Standing(server, None, None, False, None))
            continue
        value = (c.median(n) or {}).get(c.key) if c.seeds else None
        ratio = None
        if value and best:
            ratio = value / best if c.direction == "minimize" else best / value
        out.append(Standing(server, n, value, c.held(n), ratio))
    return sorted(out, key=lambda s: (s.value is None, not s.held, sign * (s.value or 0)))
