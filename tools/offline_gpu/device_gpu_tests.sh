#!/usr/bin/env bash
# benchmarks/gpu_suite.sh's tests on a GPU host without registry access: the wheels copied beside the tree (.whl/,
# from tools/offline_gpu/fetch_device_wheels.sh) and this tree installed into /tmp first (device_env.sh). From the
# root of a copy of this tree with .whl/ beside it:   bash tools/offline_gpu/device_gpu_tests.sh [tests|speed|all]
# Logs and results under $OUT (default /tmp/out); TEST_TIMEOUT bounds each suite (540 s).
set -uo pipefail
export OUT=${OUT:-/tmp/out}
source "$(dirname "$0")/device_env.sh"
exec bash benchmarks/gpu_suite.sh "${1:-tests}"
