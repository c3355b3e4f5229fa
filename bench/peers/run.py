"""`tune serve` against llama.cpp's `llama-server`: same GGUF, same client, same workloads.

One server at a time (never two: they would share the cores), each started, measured on every
workload point, and stopped. A point is (prompt length, concurrency): closed loop, fixed prompt
and output lengths, greedy, `ignore_eos`, token-id prompts to /v1/completions, all replayed by
`slotune/tuner/measure/http_replay.py:run_http_replay` with the same seed, so both servers see the same
requests. Each server is sized once for the largest point of the run, as a deployment is sized
for its peak: llama-server `-np SLOTS -c SLOTS*CTX` (it splits the context evenly over its
slots), and every slotune config gets `max_num_seqs = SLOTS` and KV blocks for SLOTS x CTX
tokens, CTX = prompt + output rounded up to 256. Everything else stays at each server's
defaults.

Servers are interleaved over `--repeats` rounds (order reversed every other round) and the
report gives medians across rounds. Beside batch-1 numbers it prints the memory-bandwidth
roofline: read bandwidth (bench/bandwidth.py: a float32 sum over 4x the last-level cache, best of
7, measured before every server start) / the bytes one decode step reads (llama-server: the GGUF's tensor
bytes; slotune: `LLMEngine.weight_bytes`).

Usage:
    bash bench/peers/build_llama_cpp.sh
    .venv/bin/python bench/peers/run.py [--repeats 3] [--concurrency 1,4,16,64] [--prompt short,long]
                                        [--configs fp32,bf16,int8,int4-g32] [--quick] [--model gemma3-270m]
Writes bench/peers/results-DATE-MACHINE.{json,md}.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import platform
import re
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from importlib.metadata import version
from pathlib import Path
from typing import Any

import gguf
import httpx
import torch
import yaml
from report import fmt_ms, medians, to_markdown  # bench/peers/report.py (this folder is sys.path[0])

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from bench.bandwidth import read_bandwidth_gbs  # noqa: E402
from slotune.engine import EngineConfig, LLMEngine
from slotune.engine.config import load_yaml
from slotune.engine.loader import resolve_model_path
from slotune.engine.tokenizer import Tokenizer
from slotune.tuner.measure import machine
from slotune.tuner.measure.http_replay import run_http_replay
from slotune.tuner.spec.workload_spec import WorkloadSpec

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
CONFIG_DIR = HERE / "configs"
DEFAULT_CONFIGS = ("fp32", "bf16", "int8", "int4-g32")
LLAMA_CACHE = Path(os.environ.get("SLOTUNE_PEERS_CACHE", Path.home() / ".cache" / "slotune"))
MODEL = "smollm2-135m"
PROMPT_LENS = {"short": 32, "long": 512}
OUTPUT_LEN = 64
CONCURRENCIES = (1, 4, 16, 64)
CTX_ROUND = 256
LLAMA = "llama-server"


@dataclass(frozen=True)
class Point:
    prompt: str  # a PROMPT_LENS key
    concurrency: int

    @property
    def key(self) -> str:
        return f"{self.prompt}-c{self.concurrency}"

    def seed(self, base: int) -> int:
        """Each point its own prompts, the same in any subset of points: a server's prompt cache
        (llama-server keeps one by default) must not meet a prompt it served at an earlier point."""
        return base * 100_000 + list(PROMPT_LENS).index(self.prompt) * 10_000 + self.concurrency

    def workload(self, num_requests: int | None, seed: int) -> dict[str, Any]:
        return {
            "name": f"peers-{self.key}",
            "arrivals": "closed_loop",
            "concurrency": self.concurrency,
            "num_requests": num_requests or max(2 * self.concurrency, 8),
            "warmup_requests": self.concurrency,  # one full batch: connections, first-call allocations
            "prompt_len": {"kind": "fixed", "value": PROMPT_LENS[self.prompt]},
            "output_len": {"kind": "fixed", "value": OUTPUT_LEN},
            "seed": self.seed(seed),
        }


@dataclass
class Server:
    """How to start one server under test, and what one decode step of it reads."""

    name: str
    argv: list[str]
    ready_path: str  # GET it until 200
    weight_bytes: int
    env: dict[str, str] = field(default_factory=dict)
    config: dict[str, Any] | None = None  # the EngineConfig fields given to tune serve (the rest: defaults)

    @property
    def command(self) -> str:
        env = " ".join(f"{k}={v}" for k, v in self.env.items())
        return (env + " " if env else "") + shlex.join(self.argv)


# --- servers ------------------------------------------------------------------------------
def sizing(points: list[Point]) -> tuple[int, int]:
    """(slots, tokens per slot) for the largest point: both servers get exactly this capacity."""
    slots = max(p.concurrency for p in points)
    longest = max(PROMPT_LENS[p.prompt] for p in points) + OUTPUT_LEN
    return slots, math.ceil(longest / CTX_ROUND) * CTX_ROUND


def llama_server(
    bin_dir: Path, model_path: Path, *, threads: int, slots: int, ctx_per_slot: int, port: int, extra: list[str]
) -> Server:
    exe = bin_dir / "llama-server"
    if not exe.exists():
        raise FileNotFoundError(f"{exe} not found: run `bash bench/peers/build_llama_cpp.sh` (or pass --llama-bin)")
    argv = [
        str(exe),
        "-m",
        str(model_path),
        "-t",
        str(threads),
        "-np",
        str(slots),
        "-c",
        str(slots * ctx_per_slot),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        *extra,
    ]
    return Server(LLAMA, argv, "/health", gguf_tensor_bytes(model_path), env={"LD_LIBRARY_PATH": str(bin_dir)})


def gguf_tensor_bytes(path: Path) -> int:
    """Bytes of every tensor as stored; SmolLM2 ties its head to token_embd, read once per step."""
    return sum(int(t.n_bytes) for t in gguf.GGUFReader(str(path)).tensors)


def slotune_config(path: Path, *, slots: int, ctx_per_slot: int, model: str = MODEL) -> dict[str, Any]:
    """The YAML's levers on `model` plus llama-server's capacity (a field the YAML sets wins)."""
    raw = load_yaml(path)
    if raw.get("model", model) != model:
        raise ValueError(f"{path}: model '{raw['model']}' is not {model}, the GGUF llama-server serves")
    cfg = EngineConfig.from_dict({**raw, "model": model})
    capacity = {
        "max_num_seqs": slots,
        "max_model_len": ctx_per_slot,
        "num_kv_blocks": slots * math.ceil(ctx_per_slot / cfg.block_size),
    }
    # Only the fields set, so the server fills in its own defaults (also unwraps a tuner best.yaml).
    given = cfg.model_dump(mode="json", exclude_unset=True)
    merged = {**capacity, **given}
    EngineConfig.from_dict(merged)  # fail here, not in the server's log
    return merged


def tune_serve(name: str, config: dict[str, Any], *, threads: int, port: int, workdir: Path) -> Server:
    path = workdir / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    argv = [
        sys.executable,
        "-m",
        "slotune.tuner.cli_main",
        "serve",
        str(path),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
    ]
    return Server(
        name, argv, "/ready", engine_weight_bytes(config), env={"OMP_NUM_THREADS": str(threads)}, config=config
    )


def engine_weight_bytes(config: dict[str, Any]) -> int:
    """`LLMEngine.weight_bytes` of this config, built here once (a tiny KV cache: bytes are the same)."""
    data = {**config, "num_kv_blocks": 2}
    if data.get("compile_decode"):
        data["compile_decode"] = False  # its warm-up compiles for minutes and changes no byte
    engine = LLMEngine(EngineConfig.from_dict(data))
    n = engine.weight_bytes
    del engine
    gc.collect()
    return n


def default_llama_bin() -> Path:
    """build_llama_cpp.sh's folder for this CPU: one build per instruction set (avx512 / avx2)."""
    flags = next((ln for ln in Path("/proc/cpuinfo").read_text().splitlines() if ln.startswith("flags")), "") + " "
    tag = "avx512" if all(f" {f} " in flags for f in ("avx512f", "avx512bw", "avx512vl", "avx512dq")) else "avx2"
    return LLAMA_CACHE / f"llama.cpp-build-{tag}" / "bin"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(server: Server, port: int, log_path: Path, timeout_s: float = 300) -> subprocess.Popen:
    # Own session: a Ctrl-C in the terminal reaches us, and we stop the server ourselves.
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            server.argv,
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, **server.env},
            cwd=REPO,
            start_new_session=True,
        )
    deadline = time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"{server.name} exited with {proc.returncode} before it was ready; see {log_path}")
            try:
                if httpx.get(f"http://127.0.0.1:{port}{server.ready_path}", timeout=2).status_code == 200:
                    return proc
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"{server.name} not ready after {timeout_s:.0f} s; see {log_path}")
    except BaseException:
        stop(proc)
        raise


def stop(proc: subprocess.Popen, timeout_s: float = 30) -> int:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)  # tune serve drains (nothing is in flight), llama-server exits
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return proc.returncode


# --- measuring ----------------------------------------------------------------------------
def _is_exact(m: dict[str, Any], wl: WorkloadSpec, point: Point, bos: bool) -> bool:
    """Every request completed with exactly prompt_len tokens in (and BOS, where the vocabulary
    adds it: Gemma) and OUTPUT_LEN out."""
    done = m["num_completed"]
    return (
        m.get("num_failed", 0) == 0
        and done == wl.num_requests
        and m["output_tokens"] == done * OUTPUT_LEN
        and m["prompt_tokens"] == done * (PROMPT_LENS[point.prompt] + bos)
    )


def measure(url: str, point: Point, tokenizer, num_requests: int | None, seed: int) -> dict[str, Any]:
    wl = WorkloadSpec.load(point.workload(num_requests, seed))
    res = run_http_replay(url, wl, tokenizer=tokenizer, api="completions")
    m = res.metrics
    is_exact = _is_exact(m, wl, point, tokenizer.add_bos)  # what the servers' usage says they did
    cached = sum(r.cached_prompt_tokens for r in res.records)  # usage.prompt_tokens_details, where sent
    return {
        "point": point.key,
        "started_at": res.started_at,
        "model": res.config["model"],
        "is_exact": is_exact,
        "cached_prompt_tokens": cached,
        "workload": res.workload,
        "metrics": m,
    }


def run_round(
    server: Server,
    points: list[Point],
    *,
    port: int,
    tokenizer,
    num_requests: int | None,
    seed: int,
    log_path: Path,
    round_index: int,
) -> dict[str, Any]:
    """Start one server, measure every point, stop it. A server that fails is recorded, not raised."""
    bandwidth = read_bandwidth_gbs()
    entry: dict[str, Any] = {
        "server": server.name,
        "round": round_index,
        "read_bandwidth_gbs": bandwidth,
        "load_avg_before": os.getloadavg(),
        "log": str(log_path),
        "results": [],
    }
    t0 = time.perf_counter()
    proc = None
    try:
        proc = start(server, port, log_path)
        entry["startup_s"] = time.perf_counter() - t0
        for point in points:
            r = measure(f"http://127.0.0.1:{port}", point, tokenizer, num_requests, seed)
            entry["results"].append(r)
            m = r["metrics"]
            roof = f" (roofline {bandwidth * 1e9 / server.weight_bytes:.0f})" if point.concurrency == 1 else ""
            print(
                f"  [{round_index + 1}] {server.name:>12} {point.key:>9}: {m['output_tokens_per_s']:7.1f} tok/s"
                f"{roof}, TPOT p50 {fmt_ms(m.get('tpot_p50'))} ms, TTFT p50 {fmt_ms(m.get('ttft_p50'))} ms, "
                f"failed {m['num_failed']:.0f}, cached prompt tokens {r['cached_prompt_tokens']}"
                f"{'' if r['is_exact'] else ', NOT EXACT (see JSON)'}",
                flush=True,
            )
    except (RuntimeError, ValueError, OSError) as exc:  # start-up failure, unreachable server
        entry["error"] = f"{type(exc).__name__}: {exc}"
        print(f"  [{round_index + 1}] {server.name:>12} FAILED: {entry['error']}", flush=True)
    finally:
        if proc is not None:
            entry["exit_code"] = stop(proc)
    return entry


IN_PROCESS = "@in-process"  # suffix of a config's in-process rows


def measure_in_process(llm, point: Point, num_requests: int | None, seed: int, model: str = MODEL) -> dict[str, Any]:
    """`measure`'s row for one point replayed on `llm` in this process (`tune bench` without HTTP)."""
    from slotune.tuner.measure.in_process_replay import run_in_process_replay

    wl = WorkloadSpec.load(point.workload(num_requests, seed))
    res = run_in_process_replay(None, wl, llm=llm)
    return {
        "point": point.key,
        "started_at": res.started_at,
        "model": model,
        "is_exact": _is_exact(res.metrics, wl, point, llm.tokenizer.add_bos),
        "cached_prompt_tokens": 0,
        "workload": res.workload,
        "metrics": res.metrics,
    }


def run_in_process(
    server: Server, points: list[Point], *, num_requests: int | None, seed: int, round_index: int
) -> dict[str, Any]:
    """The same points replayed on the engine in this process (`tune bench` without HTTP): what the
    server costs is the served / in-process ratio."""
    from slotune.engine import LLM

    entry: dict[str, Any] = {
        "server": server.name + IN_PROCESS,
        "round": round_index,
        "read_bandwidth_gbs": read_bandwidth_gbs(),
        "load_avg_before": os.getloadavg(),
        "log": None,
        "results": [],
    }
    llm = LLM(EngineConfig.from_dict(server.config))
    for point in points:
        entry["results"].append(measure_in_process(llm, point, num_requests, seed, server.config["model"]))
        m = entry["results"][-1]["metrics"]
        print(
            f"  [{round_index + 1}] {entry['server']:>12} {point.key:>9}: {m['output_tokens_per_s']:7.1f} tok/s, "
            f"TPOT p50 {fmt_ms(m.get('tpot_p50'))} ms, TTFT p50 {fmt_ms(m.get('ttft_p50'))} ms",
            flush=True,
        )
    del llm
    gc.collect()
    return entry


# --- context ------------------------------------------------------------------------------
def machine_info() -> dict[str, Any]:
    info: dict[str, Any] = {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpu_count": os.cpu_count(),
    }
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        fields = dict(line.split(":", 1) for line in out.splitlines() if ":" in line)
        for key in ("Model name", "CPU(s)", "Core(s) per socket", "Socket(s)", "Thread(s) per core", "L3 cache"):
            if key in fields:
                info[key.lower().replace("(s)", "s").replace(" ", "_")] = fields[key].strip()
    except (OSError, subprocess.CalledProcessError):
        info["model_name"] = platform.processor() or "unknown"
    meminfo = Path("/proc/meminfo")
    if meminfo.exists():
        kib = int(re.search(r"MemTotal:\s+(\d+)", meminfo.read_text()).group(1))
        info["mem_total_gib"] = round(kib / 2**20, 1)
    return info


def machine_label(info: dict[str, Any]) -> str:
    """File-name slug, as slotune.tuner.measure.machine.label: 'intel-r-xeon-r-processor-2c'."""
    return machine.label({"cpu": info.get("model_name", "cpu"), "cpus": info["cpu_count"]})


def versions(bin_dir: Path) -> dict[str, Any]:
    v: dict[str, Any] = {"torch": torch.__version__, "slotune": version("slotune"), "httpx": httpx.__version__}
    git = subprocess.run(["git", "-C", str(REPO), "describe", "--always", "--dirty"], capture_output=True, text=True)
    v["slotune_git"] = git.stdout.strip() or None
    try:
        out = subprocess.run(
            [str(bin_dir / "llama-server"), "--version"],
            capture_output=True,
            text=True,
            env={**os.environ, "LD_LIBRARY_PATH": str(bin_dir)},
        )
        v["llama_server_version"] = (out.stdout + out.stderr).strip()
    except OSError as exc:  # --no-llama without a build
        v["llama_server_version"] = f"not run ({exc})"
    pkg_info = LLAMA_CACHE / "llama.cpp-src" / "LLAMA_CPP_PYTHON_PKG_INFO"
    if pkg_info.exists():
        m = re.search(r"^Version: (\S+)", pkg_info.read_text(), re.M)
        v["llama_cpp_python_sdist"] = m.group(1) if m else None  # the llama.cpp it vendors was built
    libs = sorted(p.name for p in bin_dir.glob("libggml.so.*.*"))
    v["ggml_lib"] = libs[-1] if libs else None
    return v


# --- main ---------------------------------------------------------------------------------
def _csv(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=1, help="rounds over all servers, order reversed each round")
    ap.add_argument("--concurrency", type=str, default=None, help="e.g. 1,16 (default 1,4,16,64)")
    ap.add_argument("--prompt", type=str, default=None, help="short, long or short,long (default both)")
    ap.add_argument(
        "--configs",
        type=str,
        default=None,
        help=f"slotune configs: names in {CONFIG_DIR.relative_to(REPO)}/ or YAML paths "
        f"(default {','.join(DEFAULT_CONFIGS)}; --quick: fp32)",
    )
    ap.add_argument("--num-requests", type=int, default=None, help="per point (default max(2 x concurrency, 8))")
    ap.add_argument("--quick", action="store_true", help="smoke run: concurrency 1,4, short prompts, 8 requests, fp32")
    ap.add_argument("--no-llama", action="store_true", help="measure only the slotune configs")
    ap.add_argument(
        "--in-process",
        action="store_true",
        help="after each config's served round, replay the same points on its engine in-process "
        "(the server's overhead: served / in-process)",
    )
    ap.add_argument(
        "--threads",
        type=int,
        default=os.cpu_count(),
        help="llama-server -t, and OMP_NUM_THREADS for tune serve (default: every CPU)",
    )
    ap.add_argument(
        "--llama-bin",
        type=Path,
        default=default_llama_bin(),
        help="llama-server's folder (default: where build_llama_cpp.sh builds for this CPU)",
    )
    ap.add_argument("--llama-extra", type=str, default="", help="more llama-server flags, e.g. '--cache-ram 0'")
    ap.add_argument(
        "--amx-off-too",
        action="store_true",
        help="also serve each slotune config with its AMX kernels off (SLOTUNE_AMX=0, as `NAME-no-amx`)",
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--model", type=str, default=MODEL, help=f"a bundled model both servers serve (default {MODEL})")
    ap.add_argument("--machine", type=str, default=None, help="label in the file names (default from lscpu)")
    ap.add_argument("--out", type=Path, default=HERE)
    args = ap.parse_args(argv)
    if args.quick:
        args.concurrency = args.concurrency or "1,4"
        args.prompt = args.prompt or "short"
        args.num_requests = args.num_requests or 8
        args.configs = args.configs or "fp32"
    args.concurrency = [int(c) for c in _csv(args.concurrency or ",".join(map(str, CONCURRENCIES)))]
    args.prompt = _csv(args.prompt or ",".join(PROMPT_LENS))
    for p in args.prompt:
        if p not in PROMPT_LENS:
            ap.error(f"--prompt: '{p}' is not one of {', '.join(PROMPT_LENS)}")
    if any(c < 1 for c in args.concurrency) or args.repeats < 1:
        ap.error("--concurrency and --repeats must be >= 1")
    args.configs = [
        Path(c) if c.endswith((".yaml", ".yml")) else CONFIG_DIR / f"{c}.yaml"
        for c in _csv(args.configs or ",".join(DEFAULT_CONFIGS))
    ]
    for c in args.configs:
        if not c.exists():
            names = ", ".join(sorted(p.stem for p in CONFIG_DIR.glob("*.yaml")))
            ap.error(f"--configs: {c} not found (names: {names})")
    return args


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt  # SIGTERM (e.g. `timeout`) unwinds like Ctrl-C, so every server started is stopped


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, _interrupt)
    model_path = resolve_model_path(args.model)
    tokenizer = Tokenizer.from_model_path(model_path)
    points = [Point(p, c) for p in args.prompt for c in sorted(set(args.concurrency))]
    slots, ctx = sizing(points)
    port = free_port()
    workdir = Path(tempfile.mkdtemp(prefix="slotune-peers-"))
    servers = (
        []
        if args.no_llama
        else [
            llama_server(
                args.llama_bin,
                model_path,
                threads=args.threads,
                slots=slots,
                ctx_per_slot=ctx,
                port=port,
                extra=shlex.split(args.llama_extra),
            )
        ]
    )
    for path in args.configs:
        cfg = slotune_config(path, model=args.model, slots=slots, ctx_per_slot=ctx)
        servers.append(tune_serve(path.stem, cfg, threads=args.threads, port=port, workdir=workdir))
        if args.amx_off_too:
            off = tune_serve(f"{path.stem}-no-amx", cfg, threads=args.threads, port=port, workdir=workdir)
            off.env["SLOTUNE_AMX"] = "0"
            servers.append(off)
    info = machine_info()
    date = datetime.now(timezone.utc).strftime("%Y-%m-%d")
    label = args.machine or machine_label(info)
    print(f"{len(servers)} servers x {len(points)} points x {args.repeats} rounds; logs in {workdir}", flush=True)
    rounds = []
    try:
        for i in range(args.repeats):
            for server in servers if i % 2 == 0 else servers[::-1]:
                rounds.append(
                    run_round(
                        server,
                        points,
                        port=port,
                        tokenizer=tokenizer,
                        num_requests=args.num_requests,
                        seed=args.seed,
                        log_path=workdir / f"{server.name}-{i}.log",
                        round_index=i,
                    )
                )
                if args.in_process and server.config is not None and "SLOTUNE_AMX" not in server.env:
                    rounds.append(
                        run_in_process(server, points, num_requests=args.num_requests, seed=args.seed, round_index=i)
                    )
    except KeyboardInterrupt:
        print("interrupted: every server started is stopped; nothing written", file=sys.stderr)
        return 130
    rep = {
        "date": date,
        "machine_label": label,
        "machine": info,
        "versions": versions(args.llama_bin),
        "command": shlex.join(["python", "bench/peers/run.py", *(argv if argv is not None else sys.argv[1:])]),
        "gguf": str(model_path),
        "repeats": args.repeats,
        "slots": slots,
        "ctx_per_slot": ctx,
        "threads": args.threads,
        "llama_extra": args.llama_extra,
        "model": args.model,
        "output_len": OUTPUT_LEN,
        "reference": LLAMA,
        "servers": [s.name for s in servers],
        "points": [
            {
                "key": p.key,
                "prompt": p.prompt,
                "prompt_len": PROMPT_LENS[p.prompt],
                "concurrency": p.concurrency,
                "seed": p.seed(args.seed),
            }
            for p in points
        ],
        "server_commands": {s.name: s.command for s in servers},
        "slotune_configs": {s.name: s.config for s in servers if s.config is not None},
        "weight_bytes": {s.name: s.weight_bytes for s in servers},
        "logs": str(workdir),
        "rounds": rounds,
        "in_process": [s.name for s in servers if args.in_process and s.config is not None],
    }
    rep["medians"] = medians(rounds)
    args.out.mkdir(parents=True, exist_ok=True)
    json_path, md_path = args.out / f"results-{date}-{label}.json", args.out / f"results-{date}-{label}.md"
    json_path.write_text(json.dumps(rep, indent=1) + "\n")
    md = to_markdown(rep)
    md_path.write_text(md)
    print(md)
    print(f"wrote {json_path} and {md_path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
