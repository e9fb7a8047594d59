#!/usr/bin/env bash
# make gpu-check: what one short lease on a lent H100/H200 must prove, in one call.
#
#   bash scripts/gpu_check.sh              on the GPU machine, from the repository root
#   bash scripts/gpu_check.sh --dry-run    the same steps on this CPU at toy sizes (tested)
#
# The lent machine has its own Python 3.12 with torch, triton and transformers and no package
# index: scripts/gpu_check_carry.sh fills the git-ignored .whl/ (the wheels it lacks) and
# .gpu-model/ (the default model's configuration and tokenizer, not its weights) here; the
# device call carries both. Every step runs under its own timeout inside one deadline
# (GPU_CHECK_DEADLINE_S); GPU_CHECK_STEPS picks steps by name. Output: $OUT/gpu_check.log
# (everything), $OUT/summary.txt (the PASS/FAIL/TIME lines and each step's exit status) and,
# from the bench-worker step, $OUT/benchmarks.md (docs/benchmarks.md with its generated
# `make bench-worker --device cuda` section filled in).
set -u
REPO=$(pwd)
DRY_RUN=""
[[ " $* " == *" --dry-run "* || -n "${GPU_CHECK_DRY_RUN:-}" ]] && DRY_RUN="--dry-run"
OUT=${OUT:-$(mktemp -d /tmp/pagoda-gpu-check-XXXXXX)}
mkdir -p "$OUT"
exec > >(tee -a "$OUT/gpu_check.log") 2>&1
DEADLINE_S=${GPU_CHECK_DEADLINE_S:-540}
STEPS=${GPU_CHECK_STEPS:-"pytest-cuda engine make-qwen3 bench-qwen3 bench-worker service kbench kernels make-llama bench-llama"}
export PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/pagoda-triton-cache}
MODELS=$(mktemp -d /tmp/pagoda-gpu-models-XXXXXX)
trap 'rm -rf "$MODELS"' EXIT

step() { # step NAME LIMIT_S CMD...: runs when selected, under min(LIMIT, time left)
  local name=$1 limit=$2
  shift 2
  [[ " $STEPS " == *" $name "* ]] || return 0
  local left=$((DEADLINE_S - SECONDS))
  if ((left < 15)); then
    echo "=== [$name] SKIPPED: the deadline is near"
    return 0
  fi
  ((limit > left)) && limit=$left
  echo "=== [$name] start t=${SECONDS}s limit=${limit}s"
  local t0=$SECONDS
  timeout -k 5 "$limit" "$@"
  local rc=$?
  echo # a step's output may end without a newline (pytest's dots under a timeout)
  echo "=== [$name] rc=$rc ($((SECONDS - t0))s)$([ $rc = 124 ] && echo ' TIMEOUT')"
}

if [[ -n $DRY_RUN ]]; then
  PY=${PY:-$REPO/.venv/bin/python}
  [[ -x $PY ]] || PY=python3
  export TRITON_INTERPRET=1 # the Triton kernels run under the interpreter on the CPU
  export PYTHONPATH=$REPO${PYTHONPATH:+:$PYTHONPATH} # benchmarks.*, as on the GPU machine
  echo "INFO dry run on the CPU: toy sizes, Triton interpreted, no graphs"
else
  PY=${PY:-python3}
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv
  if ls .whl/*.whl >/dev/null 2>&1; then
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target /tmp/pagoda-site .whl/*.whl && export PYTHONPATH=/tmp/pagoda-site${PYTHONPATH:+:$PYTHONPATH}
  fi
  # The image cannot pip-install the project (its pins name other versions and there is no
  # index): a path finder maps the folders onto pagoda.* as pyproject's package-dir does.
  mkdir -p /tmp/pagoda-shim
  PAGODA_REPO=$REPO $PY scripts/pagoda_paths.py /tmp/pagoda-shim
  export PYTHONPATH=/tmp/pagoda-shim:$REPO${PYTHONPATH:+:$PYTHONPATH}
fi
$PY - <<'PYEOF'
import sys, torch, transformers, google.protobuf as pb
import pagoda.gpu_worker.attention as attention
try:
    import triton
    triton_version = triton.__version__
except ImportError:
    triton_version = "absent"
print("INFO python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda,
      "triton", triton_version, "transformers", transformers.__version__, "protobuf", pb.__version__)
if torch.cuda.is_available():
    print("INFO device", torch.cuda.get_device_name(), "sm", torch.cuda.get_device_capability(),
          "multiprocessors", torch.cuda.get_device_properties(0).multi_processor_count)
print("INFO pagoda from", attention.__file__)
PYEOF
CHECK="$PY scripts/gpu_check.py $DRY_RUN"

# 1. The project's CUDA tests, natively (no "needs CUDA" skips on the lent machine).
# The kernel file last: it compiles a Triton variant per shape and can take the longest.
CUDA_TESTS=(tests/worker/test_kv_sizing.py tests/worker/test_attention_backends.py
  tests/worker/test_cuda_graphs.py tests/worker/test_cuda_graphs_padding.py
  tests/worker/test_block_tables.py tests/worker/test_triton_attention.py
  tests/worker/test_fused_ops.py tests/worker/test_piecewise_graphs.py)
# GPU_CHECK_CUDA_TESTS="file ..." runs only those (a short lease re-checks what changed).
[[ -n ${GPU_CHECK_CUDA_TESTS:-} ]] && read -ra CUDA_TESTS <<<"$GPU_CHECK_CUDA_TESTS"
step pytest-cuda 180 $PY -m pytest -q -p no:cacheprovider -rs --timeout 60 --durations=8 "${CUDA_TESTS[@]}"
# 2. Engine (triton + captured graphs) vs generate(): fp32 exact, bf16 first tokens; graph
#    replay vs eager logits, for a decode step and for a mixed step through the pieces;
#    260 sequences (past the largest bucket, block-table growth).
step engine 100 $CHECK engine
# 3. The production start path (KV sizing, pool, graph capture) on a Qwen3-0.6B-shaped
#    model, then decode and prefill step timings with the roofline beside them.
step make-qwen3 40 $CHECK make-model qwen3-0.6b "$MODELS/qwen3-0.6b"
step bench-qwen3 100 $CHECK startup-bench "$MODELS/qwen3-0.6b"
# 3b. `make bench-worker --device cuda` on the same model: the engine beside transformers'
#     forward per step shape, its table written into a copy of docs/benchmarks.md in $OUT.
WORKER_CASES=(--device cuda --decode-batches 1,64,256 --contexts 1024 --prefill-lengths 512,2048)
[[ -n $DRY_RUN ]] && WORKER_CASES=(--device cpu --decode-batches 1,4 --contexts 48
  --prefill-lengths 32 --no-mixed)
[[ " $STEPS " == *" bench-worker "* ]] && cp docs/benchmarks.md "$OUT/benchmarks.md"
step bench-worker 120 $PY -m benchmarks.worker_step --model "$MODELS/qwen3-0.6b" \
  "${WORKER_CASES[@]}" --repeats 3 --write-docs "$OUT/benchmarks.md"
rm -rf "$MODELS/qwen3-0.6b"
# 4. The service end to end: worker + scheduler processes on the default model's shape,
#    greedy gRPC text vs generate(), then two make bench workloads against it.
step service 110 $CHECK service "$MODELS/default-shaped"
# 5. The attention kernel alone against torch SDPA: decode GB/s, prefill TFLOP/s.
step kbench 50 $CHECK kbench
# 5b. Only when named in GPU_CHECK_STEPS: the decode launch's tile and pipelining swept.
step tune 120 $CHECK tune
# 6. The kernels at real shapes and block sizes in bf16/fp16/fp32 vs an fp32 reference.
step kernels 60 $CHECK kernels
# 7. If time is left: the start path and timings on a Llama-3.2-1B-shaped model.
step make-llama 40 $CHECK make-model llama-3.2-1b "$MODELS/llama-3.2-1b"
step bench-llama 90 $CHECK startup-bench "$MODELS/llama-3.2-1b"

grep -E '^(PASS|FAIL|TIME|DONE|SKIP)|^=== |^INFO (python|device|load_engine|captured|model info|service|kernels per|sync-debug|log pagoda.worker.(warm_up|engine): (warm-up|fused))| passed| failed|error' \
  "$OUT/gpu_check.log" >"$OUT/summary.txt"
echo "---- summary: $(grep -c '^PASS' "$OUT/summary.txt") PASS, $(grep -c '^FAIL' "$OUT/summary.txt") FAIL," \
  "$(grep -c 'rc=[1-9]' "$OUT/summary.txt") steps failed, t=${SECONDS}s" | tee -a "$OUT/summary.txt"
! grep -qE '^FAIL|rc=[1-9]' "$OUT/summary.txt"
