#!/usr/bin/env bash
# The speed side of the equal-speed comparison (docs/equal-speed.md) on a GPU host without registry access (an H200): each seed-0 run
# of recipes/compare-smollm2-budgets.yaml rebuilt at Llama-3.1-8B shapes (`compresskit bench --shape --run`:
# its method, its realised sparsity per layer), timed beside the dense model at batch 1 and 8, prompt 1024.
# Needs only the wheels (.whl, copied over); no model wheel (random weights).
#   bash tools/offline_gpu/device_equal_speed.sh [GROUP...]
# GROUP: comma-separated budgets benched together in one process, each its own output folder
# ($OUT/bench-25-50, ...); default "25,50 15 35". DEADLINE: seconds from the start by which every group has ended
# (default 560: a group still running then is stopped, and the groups that ended keep their output).
set -euo pipefail
source tools/offline_gpu/device_env.sh
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, '| triton', triton.__version__, '| transformers', transformers.__version__)"
R=docs/results/compare-smollm2-distill/runs/compare
groups=("$@")
[ ${#groups[@]} -gt 0 ] || groups=(25,50 15 35)
t0=$(date +%s)
for group in "${groups[@]}"; do
  runs=()
  for b in ${group//,/ }; do
    for m in static-width static-depth dynamic-depth wide; do runs+=(--run "$R/$m-$b-distill-seed0"); done
  done
  start=$(date +%s)
  left=$((${DEADLINE:-560} - (start - t0)))
  [ "$left" -gt 30 ] || { echo "group $group: not run (deadline)"; continue; }
  timeout "$left" python3 -m compresskit bench --shape llama-3.1-8b "${runs[@]}" --batch 1,8 --prompt 1024 \
    --new-tokens 32 --repeats 3 --transformers off --bounds off --prefill-graphs off --output "$OUT/bench-${group//,/-}" \
    2>&1 | tail -n 22 || echo "group $group: exit $?"
  echo "group $group: $(($(date +%s) - start)) s"
done
