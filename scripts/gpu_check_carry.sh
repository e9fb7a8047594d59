#!/usr/bin/env bash
# Fill what `make gpu-check` carries to the lent GPU machine (both folders are git-ignored):
#   .whl/        wheels its image lacks, for its CPython 3.12 (about 25 MB)
#   .gpu-model/  the default model's config.json and tokenizer (its weights do not fit the
#                64 MiB that travels: the check builds random weights in this configuration)
# Then: run(carry=[".whl", ".gpu-model"], command="make gpu-check", timeout_s=590).
set -euo pipefail
PY=${1:-.venv/bin/python}
mkdir -p .whl .gpu-model
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d .whl pyzmq==27.3.0 grpcio==1.85.3 grpcio-health-checking==1.85.1 grpcio-reflection==1.85.1 \
  protobuf==7.36.2 transformers==5.23.0
# The scheduler's grammar matcher (structured output) is a Rust wheel built for glibc 2.31.
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_31_x86_64 -d .whl llguidance==1.9.1
model=$($PY -c 'from pagoda.gpu_worker.model_loader import resolve_model_dir; print(resolve_model_dir("default").path)')
find "$model" -maxdepth 1 -type f ! -name '*.safetensors' -exec cp {} .gpu-model/ \;
du -sh .whl .gpu-model
