"""What the metering proxy of `tune serve BEST.yaml` costs a llama-server: one `tune serve` of a
llama-server launch, its server measured directly and through the proxy in turn (`tune bench --url`,
the same workload seed for both sides of each pair), medians and proxy/direct ratios.

    python bench/tuner/metered_proxy_cost.py [--repeats 3] [--workload chat-small]

Needs llama-server on PATH. Writes nothing; paste the table into the bench README with the machine.
"""

from __future__ import annotations

import argparse
import json
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

BIN = Path(sys.executable).parent
METRICS = {"ttft_p95": "p95 TTFT (s)", "tpot_p95": "p95 TPOT (s)", "output_tokens_per_s": "output tokens/s"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--workload", default="chat-small")
    ap.add_argument("--port", type=int, default=8931)
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="proxy-cost-"))
    best = tmp / "best.yaml"
    launch = {"engine": "llama-server", "knobs": {"threads": 2, "parallel": 2}, "model": "smollm2-135m"}
    best.write_text(yaml.safe_dump(launch))
    log = open(tmp / "serve.log", "w+")
    serve = subprocess.Popen([BIN / "tune", "serve", best, "--port", str(args.port)], stderr=log)
    try:
        upstream = _upstream(tmp / "serve.log")
        sides = {"direct": upstream, "proxy": f"http://127.0.0.1:{args.port}"}
        results: dict[str, list[dict]] = {side: [] for side in sides}
        for r in range(args.repeats):
            for side, url in sides.items() if r % 2 == 0 else reversed(sides.items()):
                out = tmp / f"{side}-{r}.json"
                cmd = [BIN / "tune", "bench", "--url", url, "--tokenizer", "smollm2-135m", "-w", args.workload]
                subprocess.run([*cmd, "--seed", str(100 + r), "--json", out], check=True, capture_output=True)
                results[side].append(json.loads(out.read_text())["metrics"])
    finally:
        serve.send_signal(signal.SIGTERM)
        serve.wait(timeout=60)
    print(f"{args.repeats} pairs, workload {args.workload}, launch {launch['knobs']} (medians)\n")
    print("| metric | llama-server direct | through the proxy | proxy / direct |\n|---|---|---|---|")
    for key, label in METRICS.items():
        d = statistics.median(m[key] for m in results["direct"])
        p = statistics.median(m[key] for m in results["proxy"])
        print(f"| {label} | {d:.4g} | {p:.4g} | {p / d:.3f} |")


def _upstream(log: Path, timeout_s: float = 180.0) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = re.search(r"llama-server at (http://\S+)\)", log.read_text())
        if found:
            return found.group(1)
        time.sleep(0.5)
    raise SystemExit(f"tune serve did not start: {log.read_text()[-2000:]}")


if __name__ == "__main__":
    main()
