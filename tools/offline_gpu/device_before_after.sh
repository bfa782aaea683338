#!/usr/bin/env bash
# The runtime's bench rows of two trees side by side on one machine (the GPU host, an H200): an earlier commit
# unpacked in BEFORE (`git archive COMMIT compresskit plugins pyproject.toml | tar -x -C DIR`, DIR copied beside the tree)
# and this tree, each case run before then after, each `compresskit bench` in its own process, then
# benchmarks/before_after.py's table. On the GPU host, from the root of a copy of this tree with .whl/ and DIR beside it:
#   BEFORE=.baseline bash tools/offline_gpu/device_before_after.sh
# CASES: bench arguments, one case a line (default: Llama-3.1-8B shapes at a 1k prompt, batch 1 and 8, and a 4k
# prompt at batch 1); CASE_TIMEOUT bounds each run (300 s). Results: $OUT/before_after.{md,json} and
# $OUT/cases.tar.gz, each case's {before,after}-N/bench.{json,md} (packed: a few files to copy back).
set -uo pipefail
: "${BEFORE:?BEFORE=DIR, the earlier tree}"
source "$(dirname "$0")/device_env.sh"   # the wheels into /tmp/site, this tree into /tmp/ck
python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --upgrade --target /tmp/ckb \
  "$BEFORE" "$BEFORE/plugins/wide" "$BEFORE/plugins/baselines" || exit 3
out=${OUT:-/tmp/out}
mkdir -p "$out"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
default_cases="--shape llama-3.1-8b --prompt 1024 --batch 1,8 --new-tokens 64 --repeats 5 --transformers off
--shape llama-3.1-8b --prompt 4096 --batch 1 --new-tokens 16 --repeats 3 --transformers off"
n=0
befores=() afters=()
while IFS= read -r case; do
  [ -z "$case" ] && continue
  n=$((n + 1))
  for side in before after; do
    site=/tmp/ck; [ "$side" = before ] && site=/tmp/ckb
    echo "== $side $n: compresskit bench $case"
    # (from /tmp: python -m puts the working folder first on sys.path, which would import this tree's core; each
    # side its own inductor and Triton caches: a graph compiled by one tree is never replayed by the other)
    (cd /tmp && PYTHONPATH=$site:/tmp/site TORCHINDUCTOR_CACHE_DIR=/tmp/inductor-$side \
      TRITON_CACHE_DIR=/tmp/triton-$side timeout "${CASE_TIMEOUT:-300}" python3 -m compresskit bench $case \
      --output "$out/$side-$n" 2>&1 | grep -E "^\| [a-z]|^results:|error|interrupted")  # every row, whatever comes after
  done
  befores+=("$out/before-$n") afters+=("$out/after-$n")
done <<< "${CASES:-$default_cases}"
python3 benchmarks/before_after.py --before "${befores[@]}" --after "${afters[@]}" --out "$out"
status=$?
(cd "$out" && tar -czf cases.tar.gz --exclude='*.png' before-* after-* && rm -rf before-* after-*)
exit $status
