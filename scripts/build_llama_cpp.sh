#!/usr/bin/env bash
# Build llama.cpp's two bench programs (llama-bench, llama-batched-bench) for `jaxserve bench
# llama-cpp`, from the source distribution of llama-cpp-python, which vendors llama.cpp. Not part
# of CI (about 15 minutes on 2 cores). Prints the folder to pass as --llama-cpp-dir.
#   scripts/build_llama_cpp.sh [DEST]      (default: ~/.cache/jaxserve/llama.cpp)
set -euo pipefail
VERSION=${LLAMA_CPP_PYTHON_VERSION:-0.3.36}
DEST=${1:-${XDG_CACHE_HOME:-$HOME/.cache}/jaxserve/llama.cpp}
PY=${PYTHON:-python3}
mkdir -p "$DEST"
if [ ! -x "$DEST/build/bin/llama-batched-bench" ]; then
  tmp=$(mktemp -d)
  "$PY" -m pip download --quiet --no-deps --no-binary :all: "llama-cpp-python==$VERSION" -d "$tmp"
  tar xzf "$tmp"/llama_cpp_python-*.tar.gz -C "$tmp"
  src=$(echo "$tmp"/llama_cpp_python-*/vendor/llama.cpp)
  cmake -S "$src" -B "$DEST/build" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DLLAMA_CURL=OFF \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF >/dev/null
  cmake --build "$DEST/build" -j"$(nproc)" --target llama-bench llama-batched-bench
  rm -rf "$tmp"
fi
echo "$DEST/build"
