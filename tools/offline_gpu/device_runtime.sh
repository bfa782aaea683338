#!/usr/bin/env bash
# The runtime on a GPU host without registry access (an H200), in one command: its GPU tests (CUDA-graph decode against
# eager, dense and WIDE), then `compresskit bench --shape` rows (dense, WIDE, the ideal half-width
# model, dense through transformers) with the results under $OUT. Usage, from the root of a copy of this
# tree with .whl/ beside it:
#   bash tools/offline_gpu/device_runtime.sh                      # tests, then the default bench cases
#   TESTS=tests bash tools/offline_gpu/device_runtime.sh tests    # every gpu-marked test, no bench
#   BENCH="--shape llama-3.1-8b --prompt 4096 --batch 1" bash tools/offline_gpu/device_runtime.sh bench
#   BENCH="--shape llama-3.1-8b --prompt 1024 --new-tokens 64 --transformers static" CASE_TIMEOUT=560 \
#     bash tools/offline_gpu/device_runtime.sh bench     # with transformers' static-cache, compiled generate (slow to compile)
#   bash tools/offline_gpu/device_runtime.sh memory               # the dry run's estimate against measured training peaks
#   MEMORY="--shapes smollm2-135m --batch 8,32 --steps 30 --distill" bash tools/offline_gpu/device_runtime.sh memory
#                                                          # and training throughput by batch size
#   bash tools/offline_gpu/device_runtime.sh profile              # where a decode step's GPU time goes (profile_runtime.py)
set -uo pipefail
source "$(dirname "$0")/device_env.sh"
out=${OUT:-/tmp/out}
mkdir -p "$out"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
python3 -c "import torch, transformers, triton; print('torch', torch.__version__, '| transformers', transformers.__version__, '| triton', triton.__version__)"
if [ "${1:-all}" = profile ]; then
  timeout "${CASE_TIMEOUT:-500}" python3 benchmarks/profile_runtime.py --out "$out/profile" ${PROFILE:-}
  exit $?
fi
if [ "${1:-all}" = memory ]; then
  timeout "${CASE_TIMEOUT:-500}" python3 benchmarks/bench_train_memory.py --out "$out/train-memory" ${MEMORY:-}
  exit $?
fi
if [ "${1:-all}" != bench ]; then
  timeout "${TEST_TIMEOUT:-240}" python3 -m pytest -q -p no:cacheprovider -m gpu --durations=8 \
    ${TESTS:-tests/wide/test_runtime_wide.py tests/core/test_runtime.py} 2>&1 \
    | tee "$out/runtime-gpu-tests.log" | tail -40
  [ "${1:-all}" = tests ] && exit 0
fi
run() {  # one bench case: its arguments; results in $out/bench-N
  local n=$1; shift
  echo "== compresskit bench $*"
  timeout "${CASE_TIMEOUT:-240}" python3 -m compresskit bench "$@" --output "$out/bench-$n" 2>&1 | tail -30
}
if [ -n "${BENCH:-}" ]; then
  run custom $BENCH
else
  run 8b-decode --shape llama-3.1-8b --prompt 1024 --batch 1 --new-tokens 64 --repeats 5 --transformers off
  run 8b-prefill --shape llama-3.1-8b --prompt 4096 --batch 1 --new-tokens 16 --repeats 3
fi
