#!/usr/bin/env bash
# The WIDE kernels on a GPU host without registry access (an H200): their tests on the GPU (tests/wide/kernels, native
# Triton, fp32 and bf16, autotuned tiles), then benchmarks/bench_wide_kernels.py, leaving
# kernel-tests.log, bench.json, bench.md and bench.log in $OUT.
# On that host, from the root of a copy of this tree with .whl/ beside it (the Python packages the host
# lacks; see tools/offline_gpu/fetch_device_wheels.sh):   bash tools/offline_gpu/device_bench_kernels.sh [--only REGEX]
# Environment: TESTS_K="expr" selects tests (pytest -k; TESTS_K=none skips them), SHARDS=N runs them as
# N processes side by side (pytest-xdist's -n, from .whl), BENCH=0 skips the kernel benchmark,
# BEFORE=DIR first runs DIR's own copy of the benchmark on DIR's kernels (an earlier commit, unpacked
# with `git archive COMMIT compresskit plugins/wide benchmarks | tar -x -C DIR`, DIR copied there too), so
# that before and after are measured side by side on one machine: $OUT/before/ and $OUT/ hold the two.
set -uo pipefail
OUT=${OUT:-/tmp/bench}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 3
python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --upgrade --target /tmp/ck . plugins/wide || exit 3
export PYTHONPATH=/tmp/ck:/tmp/site PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
if [ "${TESTS_K:-}" != none ]; then
  workers=()
  [ "${SHARDS:-1}" -gt 1 ] && workers=(-n "$SHARDS")
  python3 -m pytest -v -p no:cacheprovider -rfEs "${workers[@]}" tests/wide/kernels \
    ${TESTS_K:+-k "$TESTS_K"} 2>&1 | tee "$OUT/kernel-tests.log" | tail -n 15
fi
if [ -n "${BEFORE:-}" ]; then
  mkdir -p "$OUT/before"
  if [ "${BENCH:-1}" != 0 ]; then
    python3 "$BEFORE/benchmarks/bench_wide_kernels.py" --out "$OUT/before" "$@" 2>&1 | tee "$OUT/before/bench.log"
  fi
fi
if [ "${BENCH:-1}" != 0 ]; then
  python3 benchmarks/bench_wide_kernels.py --out "$OUT" "$@" 2>&1 | tee "$OUT/bench.log"
fi
