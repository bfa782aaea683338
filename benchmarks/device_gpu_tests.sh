#!/usr/bin/env bash
# Every GPU test of the tree on a GPU host without registry access, in one command of about 8 minutes: the kernels' own suite
# (tests/wide/kernels, native Triton on the GPU; 8 workers) and, at the same time, every `gpu`-marked test outside
# it (the runtime, WIDE's blocks and consensus on the kernels, training, the baselines; 4 workers). From the root of a
# copy of this tree with .whl/ beside it:   bash benchmarks/device_gpu_tests.sh
# Logs: $OUT/kernel-tests.log and $OUT/gpu-tests.log, each ending with its exit status and seconds. SmolLM2's
# parity test skips unless the model's package is installed (benchmarks/device_wide_smollm2.sh installs it).
# TEST_TIMEOUT bounds each suite (default 540 s).
set -uo pipefail
out=${OUT:-/tmp/out}
mkdir -p "$out"
source "$(dirname "$0")/device_env.sh"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, '| triton', triton.__version__, \
'| transformers', transformers.__version__)"
start=$(date +%s)
suite() {  # LOG ARGS...: one suite, its status and seconds at the end of its log
  local log=$1
  shift
  timeout "${TEST_TIMEOUT:-540}" python3 -m pytest -q -p no:cacheprovider -rfEs "$@" >"$log" 2>&1
  printf "\nexit %s after %s s\n" $? $(($(date +%s) - start)) >>"$log"
}
suite "$out/gpu-tests.log" -m gpu -n 4 --durations=8 tests --ignore=tests/wide/kernels &
suite "$out/kernel-tests.log" -n 8 tests/wide/kernels
wait
status=0
for log in "$out/kernel-tests.log" "$out/gpu-tests.log"; do
  echo "== $(basename "$log")"
  grep -E "^(FAILED|ERROR)" "$log" | head -n 20
  tail -n 2 "$log"
  tail -n 1 "$log" | grep -q "^exit 0 " || status=1
done
exit $status
