#!/usr/bin/env bash
# Every GPU test of the tree and the headline speed table, on a machine with an NVIDIA GPU, from the root of this
# tree installed with its test tools (`make test-setup`, then `source .venv/bin/activate`):
#   bash benchmarks/gpu_suite.sh [tests|speed|all]      (default: all)
# tests: the kernels' own suite (tests/wide/kernels, native Triton on the GPU; 8 workers) and, at the same time,
#        every `gpu`-marked test outside it (the runtime, WIDE's blocks and consensus on the kernels, training, the
#        baselines; 4 workers); logs $OUT/kernel-tests.log and $OUT/gpu-tests.log, each ending with its exit status
#        and seconds (about 8 minutes on an H200). SmolLM2's parity test skips unless its model package is installed.
# speed: `compresskit bench --shape llama-3.1-8b` (random weights) at a 1k prompt, batch 1 and 8: dense, WIDE at
#        25% and 50% (routers calibrated) and the ideal half-width models, side by side in one process; results in
#        $OUT/speed/bench.{json,md} (SPEED="bench arguments" runs another case).
# OUT: where results go (default gpu-suite-out); TEST_TIMEOUT bounds each test suite (540 s). Exit 0: all passed.
set -uo pipefail
step=${1:-all}
case $step in tests|speed|all) ;; *) echo "usage: gpu_suite.sh [tests|speed|all]" >&2; exit 2 ;; esac
out=${OUT:-gpu-suite-out}
mkdir -p "$out"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader || { echo "gpu_suite.sh: no NVIDIA GPU here" >&2; exit 2; }
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, '| triton', triton.__version__, \
'| transformers', transformers.__version__)"
status=0
if [ "$step" != speed ]; then
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
  for log in "$out/kernel-tests.log" "$out/gpu-tests.log"; do
    echo "== $(basename "$log")"
    grep -E "^(FAILED|ERROR)" "$log" | head -n 20
    tail -n 2 "$log"
    tail -n 1 "$log" | grep -q "^exit 0 " || status=1
  done
fi
if [ "$step" != tests ]; then
  speed=${SPEED:---shape llama-3.1-8b --prompt 1024 --batch 1,8 --sparsity 0.25,0.5 --new-tokens 64 --repeats 5}
  echo "== compresskit bench $speed"
  python3 -m compresskit bench $speed --output "$out/speed" || status=1
fi
exit $status
