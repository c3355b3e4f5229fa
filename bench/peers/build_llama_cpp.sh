#!/usr/bin/env bash
# Build llama.cpp's llama-server and llama-bench from the sdist that llama-cpp-python vendors,
# into a cache outside the repo (default ~/.cache/slotune/llama.cpp). Idempotent: a finished
# build is reused. About 15 min on 2 cores. Not part of CI.
#
# AMX is off on purpose: with GGML_NATIVE=ON the AMX path dies with SIGSEGV on `ldtilecfg`
# on these VMs; AVX-512 (VNNI/BF16) stays on, as a CPU user's build would have it.
set -euo pipefail
CACHE="${SLOTUNE_PEERS_CACHE:-$HOME/.cache/slotune}"
SRC="$CACHE/llama.cpp-src"
BUILD="$CACHE/llama.cpp-build"
if [ -x "$BUILD/bin/llama-server" ] && [ -x "$BUILD/bin/llama-bench" ]; then
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
  -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON \
  -DGGML_AVX512=ON -DGGML_AVX512_VBMI=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON \
  -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF -DLLAMA_CURL=OFF > "$CACHE/build.log" 2>&1
cmake --build "$BUILD" -j"$(nproc)" --target llama-server llama-bench > "$CACHE/build.log" 2>&1
echo "$BUILD/bin"
