"""Write the sample traces in this folder: one synthetic trace, written in every format slotune/tuner/spec/traces.py reads.

Nothing here comes from a public dataset: arrivals, lengths and prompts are drawn from a seeded
generator below. The traffic it makes: Poisson arrivals; 60% of requests start with system prompt A
(1024 tokens), 20% with B (1536 tokens), the rest with none; a lognormal user message; some requests
continue an earlier conversation (its prompt, its answer, a new message); lognormal answers capped
by max_tokens. Prompts are random token ids, so hash ids are real chained block hashes.

Files (the same 120 requests in each of the first five):
  recorded.jsonl          our recording (lines in finish order, hash ids of full 512-token blocks)
  recorded_rotated/       the same lines split over three rotated files
  mooncake.jsonl          Mooncake: ms timestamps from 0, small ints as hash ids (last, partial block too)
  azure.csv               Azure LLM inference trace columns, datetimes with 7 fraction digits
  burstgpt.csv            BurstGPT columns, seconds with 3 decimals
  mooncake_fit.jsonl      400 other requests, for fitting a WorkloadSpec

Run `python tests/data/traces/make_samples.py` to rewrite them; tests check they are up to date.
"""

from __future__ import annotations

import json
import sys
from datetime import datetime, timedelta
from pathlib import Path

import numpy as np

from slotune.tuner.spec.traces import block_hash_ids

HERE = Path(__file__).resolve().parent
BLOCK_SIZE = 512
SAMPLE_KEY = b"slotune-sample-traces"  # the recorder's hash key
BASE_UNIX = 1_763_316_946.0  # the recording's first arrival, unix seconds (2025-11-16 18:15:46 UTC)
BASE_AZURE = datetime(2023, 11, 16, 18, 15, 46)
BASE_BURSTGPT_S = 7200.0  # BurstGPT counts seconds from its own origin
VOCAB = 50_000
NUM_ROTATED = 3


def make_trace(num_requests: int, *, rate: float, seed: int) -> list[dict]:
    """Synthetic requests in arrival order: arrival_ms, tokens (the prompt's ids), output_tokens, max_tokens,
    is_chat, e2e_s, model."""
    rng = np.random.default_rng(seed)
    system = {"A": rng.integers(0, VOCAB, 1024).tolist(), "B": rng.integers(0, VOCAB, 1536).tolist()}
    out: list[dict] = []
    t_ms = 0
    for _ in range(num_requests):
        user = rng.integers(0, VOCAB, int(np.clip(rng.lognormal(np.log(300), 0.6), 8, 4000))).tolist()
        coin = rng.random()
        if out and coin < 0.15:  # a follow-up: an earlier conversation, its answer, a new message
            prev = out[int(rng.integers(max(0, len(out) - 20), len(out)))]
            answer = rng.integers(0, VOCAB, prev["output_tokens"]).tolist()
            tokens = prev["tokens"] + answer + user
        elif coin < 0.75:
            tokens = system["A"] + user
        elif coin < 0.95:
            tokens = system["B"] + user
        else:
            tokens = user
        max_tokens = [256, 512, 1024, None][int(rng.integers(0, 4))]
        output = int(np.clip(rng.lognormal(np.log(180), 0.7), 1, 2000))
        if max_tokens is not None:
            output = min(output, max_tokens)
        out.append(
            {
                "arrival_ms": t_ms,
                "tokens": tokens,
                "output_tokens": output,
                "max_tokens": max_tokens,
                "is_chat": bool(rng.random() < 0.7),
                "e2e_s": round(0.2 + len(tokens) / 5000 + output * 0.03, 3),
                "model": "GPT-4" if rng.random() < 0.2 else "ChatGPT",
            }
        )
        t_ms += max(1, int(round(rng.exponential(1000.0 / rate))))
    return out


def recorded_lines(trace: list[dict]) -> list[str]:
    """Our recording: one line per finished request, in finish order."""
    seen: set[int] = set()
    lines = []
    for r in trace:
        ids = block_hash_ids(r["tokens"], BLOCK_SIZE, key=SAMPLE_KEY)
        cached = sum(BLOCK_SIZE for h in ids if h in seen)
        seen.update(ids)
        arrival = BASE_UNIX + r["arrival_ms"] / 1000
        reason = "length" if r["output_tokens"] == r["max_tokens"] else "stop"
        lines.append(
            (
                arrival + r["e2e_s"],
                json.dumps(
                    {
                        "arrival": arrival,
                        "finish": round(arrival + r["e2e_s"], 6),
                        "prompt_tokens": len(r["tokens"]),
                        "max_tokens": r["max_tokens"],
                        "output_tokens": r["output_tokens"],
                        "finish_reason": reason,
                        "chat": r["is_chat"],
                        "cached_tokens": cached,
                        "block_size": BLOCK_SIZE,
                        "hash_ids": ids,
                    }
                ),
            )
        )
    return [line for _, line in sorted(lines, key=lambda x: x[0])]


def mooncake_lines(trace: list[dict]) -> list[str]:
    """Mooncake: small ints numbered in first-seen order; the last, partial block gets a fresh one."""
    number: dict[int, int] = {}
    lines = []
    for r in trace:
        ids = [number.setdefault(h, len(number)) for h in block_hash_ids(r["tokens"], BLOCK_SIZE)]
        if len(r["tokens"]) % BLOCK_SIZE:
            ids.append(number.setdefault(-len(number) - 1, len(number)))  # a key no real block has
        lines.append(
            json.dumps(
                {
                    "timestamp": r["arrival_ms"],
                    "input_length": len(r["tokens"]),
                    "output_length": r["output_tokens"],
                    "hash_ids": ids,
                }
            )
        )
    return lines


def azure_lines(trace: list[dict]) -> list[str]:
    rows = ["TIMESTAMP,ContextTokens,GeneratedTokens"]
    for r in trace:
        t = BASE_AZURE + timedelta(milliseconds=r["arrival_ms"])
        rows.append(f"{t:%Y-%m-%d %H:%M:%S}.{t.microsecond:06d}0,{len(r['tokens'])},{r['output_tokens']}")
    return rows


def burstgpt_lines(trace: list[dict]) -> list[str]:
    rows = ["Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type"]
    for r in trace:
        n_in, n_out = len(r["tokens"]), r["output_tokens"]
        log_type = "Conversation log" if r["is_chat"] else "API log"
        rows.append(
            f"{BASE_BURSTGPT_S + r['arrival_ms'] / 1000:.3f},{r['model']},{n_in},{n_out},{n_in + n_out},{log_type}"
        )
    return rows


def sample_files() -> dict[str, str]:
    """Relative path -> file text."""
    trace = make_trace(120, rate=2.0, seed=1)
    recorded = recorded_lines(trace)
    files = {
        "recorded.jsonl": recorded,
        "mooncake.jsonl": mooncake_lines(trace),
        "azure.csv": azure_lines(trace),
        "burstgpt.csv": burstgpt_lines(trace),
        "mooncake_fit.jsonl": mooncake_lines(make_trace(400, rate=3.0, seed=2)),
    }
    size = -(-len(recorded) // NUM_ROTATED)
    for k in range(NUM_ROTATED):  # oldest first by finish time, as a recorder rotates
        files[f"recorded_rotated/requests-{k:03d}.jsonl"] = recorded[k * size : (k + 1) * size]
    return {name: "\n".join(lines) + "\n" for name, lines in files.items()}


def main(out: Path = HERE) -> None:
    for name, text in sample_files().items():
        path = out / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else HERE)
