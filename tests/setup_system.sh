#!/usr/bin/env bash
# System packages the tests use: PostgreSQL (distributed-study test), Chromium (the HTML report
# drawn in a headless browser, tests/tuner_tests/test_report_html.py), a C++ compiler (llama-server,
# built by bench/peers/build_llama_cpp.sh for the external-engine tests). Idempotent; root only.
set -euo pipefail
need=()
command -v pg_ctl >/dev/null 2>&1 || ls /usr/lib/postgresql/*/bin/pg_ctl >/dev/null 2>&1 || need+=(postgresql)
command -v chromium >/dev/null 2>&1 || need+=(chromium)
command -v g++ >/dev/null 2>&1 || need+=(g++)
if [ ${#need[@]} -gt 0 ]; then
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}" >/dev/null
fi
