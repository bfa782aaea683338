#!/usr/bin/env bash
# Runs benchmarks/bench_wide_kernels.py on the device machine (H200) and leaves bench.json /
# bench.md in $OUT. Through the device tool, from the repo root, carrying [".whl"] (the Python
# packages the device lacks; see benchmarks/device_core_check.sh): bash benchmarks/device_bench_kernels.sh
set -euo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --upgrade --target /tmp/ck . plugins/wide
export PYTHONPATH=/tmp/ck:/tmp/site PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python3 benchmarks/bench_wide_kernels.py --out "${OUT:-/tmp/bench}" "$@"
