#!/usr/bin/env bash
# Build llama.cpp's llama-server, llama-bench and llama-quantize from the sdist that llama-cpp-python vendors,
# into a cache outside the repo (default ~/.cache/slotune/llama.cpp). Idempotent: a finished
# build is reused. About 15 min on 2 cores; .ci/run builds it for the external-engine tests.
#
# AMX is off on purpose: with GGML_NATIVE=ON the AMX path dies with SIGSEGV on `ldtilecfg`
# on these VMs. Every other instruction set the CPU has (/proc/cpuinfo) is on, as a CPU user's
# native build would have it: AVX-512 with VNNI/VBMI/BF16 where present, AVX2 + FMA otherwise.
# The build folder is named after that set, so machines with different CPUs sharing a cache
# never run a build their CPU lacks.
set -euo pipefail
CACHE="${SLOTUNE_PEERS_CACHE:-$HOME/.cache/slotune}"
SRC="$CACHE/llama.cpp-src"
flags=" $(grep -m1 '^flags' /proc/cpuinfo | cut -d: -f2) "
has() { case "$flags" in *" $1 "*) echo ON;; *) echo OFF;; esac; }
AVX512=$( [ "$(has avx512f)$(has avx512bw)$(has avx512vl)$(has avx512dq)" = ONONONON ] && echo ON || echo OFF )
ISA=(-DGGML_AVX=$(has avx) -DGGML_AVX2=$(has avx2) -DGGML_FMA=$(has fma) -DGGML_F16C=$(has f16c) -DGGML_BMI2=$(has bmi2)
     -DGGML_AVX512=$AVX512 -DGGML_AVX512_VBMI=$(has avx512vbmi) -DGGML_AVX512_VNNI=$(has avx512_vnni)
     -DGGML_AVX512_BF16=$(has avx512_bf16))
if [ "$AVX512" = ON ]; then TAG=avx512; else TAG=avx2; fi
BUILD="$CACHE/llama.cpp-build-$TAG"
if [ -x "$BUILD/bin/llama-server" ] && [ -x "$BUILD/bin/llama-bench" ] && [ -x "$BUILD/bin/llama-quantize" ]; then
  echo "$BUILD/bin"; exit 0
fi
mkdir -p "$CACHE"
if [ ! -d "$SRC" ]; then
  tmp="$(mktemp -d)"
  pip download -q --no-deps --no-binary :all: -d "$tmp" llama-cpp-python
  tar -xzf "$tmp"/llama_cpp_python-*.tar.gz -C "$tmp"
  mv "$tmp"/llama_cpp_python-*/vendor/llama.cpp "$SRC"
  cp "$tmp"/llama_cpp_python-*/PKG-INFO "$SRC/LLAMA_CPP_PYTHON_PKG_INFO"
  rm -rf "$tmp"
fi
command -v cmake >/dev/null || pip install -q cmake
cmake -S "$SRC" -B "$BUILD" -DCMAKE_BUILD_TYPE=Release \
  -DGGML_NATIVE=OFF "${ISA[@]}" \
  -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF -DLLAMA_CURL=OFF > "$CACHE/build.log" 2>&1
cmake --build "$BUILD" -j"$(nproc)" --target llama-server llama-bench llama-quantize > "$CACHE/build.log" 2>&1
echo "$BUILD/bin"
