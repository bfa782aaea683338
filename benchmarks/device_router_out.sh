#!/usr/bin/env bash
# The decision in the first product's prologue (router_norm_out_gemm; policy.UNMEASURED) measured on the device:
# its GPU tests, its kernel rows (bench_wide_kernels.py --only prologue), then end to end side by side: this tree as
# it is ("before": auto runs the decision's launch, then the product) against the same tree with a range for
# router_out up to 16 tokens ("after": the one launch; benchmarks/policy_range.py edits the device's copy only).
# Through the device tool, from the repo root, carrying [".whl"]; all of it takes more than one call's 10 minutes,
# so in two calls on the warm machine:
#   STEPS="tests kernels attention" bash benchmarks/device_router_out.sh   # kernel-tests.log, bench.{json,md},
#                                                                         # attention-smollm2/
#   STEPS=e2e bash benchmarks/device_router_out.sh     # before_after.{md,json} (and each case's bench output)
# CASES: as device_before_after.sh's; default SmolLM2-135M's shape at batch 1, 4 and 16 (512-token prompt) and
# Llama-3.1-8B's at batch 1 and 8 (1k). STEPS: any of tests, kernels, attention, e2e (default all four); attention:
# the routed decode attention against the runtime's at SmolLM2's attention shapes (its range was measured at 8B's),
# into $OUT/attention-smollm2.
set -uo pipefail
out=${OUT:-/tmp/out}
mkdir -p "$out"
steps=${STEPS:-"tests kernels attention e2e"}
source "$(dirname "$0")/device_env.sh"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
if [[ " $steps " == *" tests "* ]]; then
  python3 -m pytest -q -p no:cacheprovider -rfEs tests/wide/kernels/test_gemm_out.py tests/wide/kernels/test_dispatch.py \
    -k "prologue or cuda_graph" 2>&1 | tee "$out/kernel-tests.log" | tail -n 5
fi
if [[ " $steps " == *" kernels "* ]]; then
  python3 benchmarks/bench_wide_kernels.py --only prologue --out "$out" 2>&1 | tail -n 30
fi
if [[ " $steps " == *" attention "* ]]; then
  python3 benchmarks/bench_attention_matrix.py --shape smollm2-135m --contexts 512,2048 --batches 1,4,16 \
    --out "$out/attention-smollm2" 2>&1 | tail -n 8
fi
if [[ " $steps " == *" e2e "* ]]; then
  before=/tmp/router-out-before
  rm -rf "$before" && mkdir -p "$before" && cp -r compresskit plugins pyproject.toml README.md "$before" || exit 3
  python3 benchmarks/policy_range.py plugins/wide/compresskit_wide/kernels/policy.py router_out --max-m 16 || exit 3
  default="--shape smollm2-135m --prompt 512 --batch 1,4,16 --new-tokens 32 --repeats 5 --transformers off
--shape llama-3.1-8b --prompt 1024 --batch 1,8 --new-tokens 64 --repeats 5 --transformers off"
  BEFORE=$before CASES="${CASES:-$default}" OUT=$out bash benchmarks/device_before_after.sh
fi
