#!/usr/bin/env bash
# A change to `auto` measured on the GPU host (an H200) before it lands: an op of policy.UNMEASURED (OP, given a range
# up to MAX_M tokens), or a launch setting of the policy given another value (SET=NAME=VALUE). Its tests on the
# GPU, its kernel rows, then end to end side by side: this tree as it is ("before": auto runs the op's fallback,
# or the setting's value) against the same tree with the change ("after"; benchmarks/policy_range.py edits a copy
# in /tmp, never this checkout). From the root of a copy of this tree with .whl/ beside it; on a host that bounds each
# command to 10 minutes the steps may take longer, so split them over commands on the same host:
#   OP=NAME MAX_M=64 STEPS="tests kernels" bash tools/offline_gpu/device_policy_trial.sh  # kernel-tests.log, bench.{json,md}
#   OP=NAME MAX_M=64 STEPS=e2e bash tools/offline_gpu/device_policy_trial.sh              # before_after.{md,json}
#   SET='OUT_TAIL_SPLIT={"plain": 2, "swiglu": 2}' STEPS="tests kernels" bash tools/offline_gpu/device_policy_trial.sh
#   SET='OUT_TAIL_SPLIT={"plain": 1, "swiglu": 1}' STEPS=e2e bash tools/offline_gpu/device_policy_trial.sh  # after: whole
#   SET='PDL_KERNELS=()' STEPS="tests e2e" bash tools/offline_gpu/device_policy_trial.sh  # SmolLM2's, 8B's shapes
# OP or SET (one of them), MAX_M (default 16); STEPS: any of tests, kernels, e2e (default all three).
# TESTS: the test files, TESTS_K their -k (defaults: for OUT_TAIL_SPLIT the persistent product's tests; for
# PDL_KERNELS the runtime's decode with it on and off; else tests/wide/kernels, every test).
# ONLY: bench_wide_kernels.py's --only (default: OP).
# KERNELS: the kernel step's command instead (default for OUT_TAIL_SPLIT: bench_out_prefill.py with whole items
# and with pieces, 512-4k tokens, with the masks of the end-to-end rows).
# CASES: as device_before_after.sh's (defaults: for OUT_TAIL_SPLIT the TTFT at 512 and 1k tokens at 25-50%; for
# PDL_KERNELS SmolLM2's shape at batch 1, 4, 16 and 8B's at 1, 8; else 8B at batch 1 and 8, 1k; where the cases
# pass one command's time limit, give each command some of them; a consensus rule goes in as `compresskit bench` takes it,
# --option consensus.quorum=0,consensus.follow=1.25).
set -uo pipefail
if { [ -n "${OP:-}" ] && [ -n "${SET:-}" ]; } || { [ -z "${OP:-}" ] && [ -z "${SET:-}" ]; }; then
  echo "give OP=NAME (an op of policy.UNMEASURED) or SET=NAME=VALUE (a setting of the policy), one of them" >&2
  exit 2
fi
OP=${OP:-} SET=${SET:-}
out=${OUT:-/tmp/out}
mkdir -p "$out" && out=$(cd "$out" && pwd)  # (absolute: the end-to-end step runs in a copy of the tree)
steps=${STEPS:-"tests kernels e2e"}
if [[ "$SET" == OUT_TAIL_SPLIT=* ]]; then
  tests_default="tests/wide/kernels/test_gemm_out.py"
  k_default="persistent"
  kernels_default="python3 benchmarks/bench_out_prefill.py --tail-split 1,2 --tokens 512,1024,2048,4096
    --masks all,iid50,iid25,keep78.5"
  ttft="--shape llama-3.1-8b --batch 1 --sparsity 0.25,0.375,0.5 --new-tokens 16 --repeats 3 --ttft-repeats 3"
  cases_default="$ttft --prompt 512 --bounds off --transformers off
$ttft --prompt 1024 --bounds off --transformers off"
elif [[ "$SET" == PDL_KERNELS=* ]]; then
  tests_default="tests/wide/test_runtime_wide.py"
  k_default="programmatic or cuda_graph_decode"
  no_rows="programmatic dependent launch acts between kernels: no kernel rows (the e2e step measures it)"
  cases_default="--shape smollm2-135m --prompt 512 --batch 1,4,16 --new-tokens 32 --repeats 3 --transformers off
--shape llama-3.1-8b --prompt 1024 --batch 1,8 --new-tokens 32 --repeats 3 --transformers off"
else
  tests_default="tests/wide/kernels"
  k_default=""
  only_default="${OP:-$SET}"
  cases_default="--shape llama-3.1-8b --prompt 1024 --batch 1,8 --new-tokens 64 --repeats 5 --transformers off"
fi
if [[ " $steps " == *" e2e "* ]]; then
  # both trees are copies (this checkout stays as it is): the "after" one with the change, made first so that an
  # OP the policy does not list as unmeasured, or a SET that is no setting of it, stops here
  before=/tmp/policy-trial-before after=/tmp/policy-trial-after
  for tree in "$before" "$after"; do
    rm -rf "$tree" && mkdir -p "$tree" && cp -r compresskit plugins benchmarks pyproject.toml README.md "$tree" || exit 3
  done
  if [ -n "$SET" ]; then
    python3 benchmarks/policy_range.py "$after/plugins/wide/compresskit_wide/kernels/policy.py" --set "$SET" || exit 2
  else
    python3 benchmarks/policy_range.py "$after/plugins/wide/compresskit_wide/kernels/policy.py" "$OP" \
      --max-m "${MAX_M:-16}" || exit 2
  fi
fi
source "$(dirname "$0")/device_env.sh"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
if [[ " $steps " == *" tests "* ]]; then
  read -r -a tests <<<"${TESTS:-$tests_default}"
  k=${TESTS_K-$k_default}
  python3 -m pytest -q -p no:cacheprovider -rfEs "${tests[@]}" ${k:+-k "$k"} 2>&1 | tee "$out/kernel-tests.log" |
    tail -n 5
fi
if [[ " $steps " == *" kernels "* ]]; then
  kernels=${KERNELS:-${kernels_default:-}}
  if [ -z "${KERNELS:-}" ] && [ -n "${no_rows:-}" ]; then
    echo "$no_rows"
  elif [ -n "$kernels" ]; then
    $kernels --out "$out" 2>&1 | tail -n 40
  else
    python3 benchmarks/bench_wide_kernels.py --only "${ONLY:-$only_default}" --out "$out" 2>&1 | tail -n 30
  fi
fi
if [[ " $steps " == *" e2e "* ]]; then
  (cd "$after" && BEFORE=$before CASES="${CASES:-$cases_default}" OUT=$out bash tools/offline_gpu/device_before_after.sh)
fi
