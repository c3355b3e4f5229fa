#!/bin/bash
# The device tool's command for the GPU check (carry .whl and .gpu; see README.md):
#   bash bench/gpu/device_run.sh [seconds [part,part,...]]
# installs the carried wheels, puts the repo (its slotune/) on the path, runs
# run_all.py under a time limit and leaves its results in $OUT.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
timeout "${1:-520}" python3 bench/gpu/run_all.py run .gpu/smollm2 /tmp/gpu-out ${2:-} 2>&1 | tee "$OUT/log.txt"
cp /tmp/gpu-out/results.json /tmp/gpu-out/tune-log.txt /tmp/gpu-out/tune/best.yaml /tmp/gpu-out/tune/report.md "$OUT/"
python3 bench/gpu/run_all.py report /tmp/gpu-out/results.json > "$OUT/results.md"
