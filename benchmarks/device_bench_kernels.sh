#!/usr/bin/env bash
# The WIDE kernels on the device machine (H200): their GPU tests (tests/wide/test_kernels.py, native
# Triton, fp32 and bf16, autotuned tiles), then benchmarks/bench_wide_kernels.py, leaving
# kernel-tests.log, bench.json, bench.md and bench.log in $OUT. Through the device tool, from the
# repo root, carrying [".whl"] (the Python packages the device lacks; see
# benchmarks/fetch_device_wheels.sh):   bash benchmarks/device_bench_kernels.sh [--only REGEX]
# Environment: TESTS_K="expr" selects tests (pytest -k; TESTS_K=none skips them), SHARDS=N runs them as
# N processes side by side (pytest-xdist's -n, carried in .whl: compiling is the slow part), BENCH=0 skips the
# kernel benchmark, E2E="args" also runs benchmarks/bench_wide_e2e.py with those arguments (e.g.
# E2E="--layers 8"; "-" for its defaults), leaving e2e.json / e2e.md / e2e.log in $OUT; SWEEP="args" also runs
# benchmarks/sweep_wide_decode.py with those arguments ("-" for none), leaving sweep.json / sweep.md / sweep.log.
set -uo pipefail
OUT=${OUT:-/tmp/bench}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 3
python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --upgrade --target /tmp/ck . plugins/wide || exit 3
export PYTHONPATH=/tmp/ck:/tmp/site PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
if [ "${TESTS_K:-}" != none ]; then
  workers=()
  [ "${SHARDS:-1}" -gt 1 ] && workers=(-n "$SHARDS")
  python3 -m pytest -q -p no:cacheprovider -rfEs "${workers[@]}" tests/wide/test_kernels.py ${TESTS_K:+-k "$TESTS_K"} 2>&1 |
    tee "$OUT/kernel-tests.log" | tail -n 15
fi
if [ "${BENCH:-1}" != 0 ]; then
  python3 benchmarks/bench_wide_kernels.py --out "$OUT" "$@" 2>&1 | tee "$OUT/bench.log"
fi
if [ -n "${E2E:-}" ]; then
  [ "$E2E" = - ] && E2E=""
  python3 benchmarks/bench_wide_e2e.py --out "$OUT" $E2E 2>&1 | tee "$OUT/e2e.log"
fi
if [ -n "${SWEEP:-}" ]; then
  [ "$SWEEP" = - ] && SWEEP=""
  python3 benchmarks/sweep_wide_decode.py --out "$OUT" $SWEEP 2>&1 | tee "$OUT/sweep.log"
fi
