#!/usr/bin/env bash
# Runs the core test suite on a GPU host without registry access (an H200): its own torch/transformers
# stack plus the packages copied over as wheels in .whl (tools/offline_gpu/fetch_device_wheels.sh). Usage, from the
# root of a copy of this tree with .whl/ beside it:   bash tools/offline_gpu/device_core_check.sh
# (TESTS="tests/core tests/wide/test_wide.py" picks the test paths; default: all of tests/)
set -euo pipefail
source "$(dirname "$0")/device_env.sh"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
python3 -c "import torch, transformers, lm_eval; print('torch', torch.__version__, 'cuda', torch.version.cuda, '| transformers', transformers.__version__, '| lm_eval', lm_eval.__version__)"
python3 -m compresskit plugins
python3 -m pytest -q -p no:cacheprovider -m "not slow" ${TESTS:-tests} "$@" 2>&1 | tee "${OUT:-/tmp}/core-tests.log"
