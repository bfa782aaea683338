#!/usr/bin/env bash
# The serving matrix on a GPU host without registry access (an H200): `compresskit bench --shape llama-3.1-8b` over batch 1-64 at
# each prompt length, one process a prompt length (dense and the routed rows side by side in it), run in a new
# process session that outlives the command, so that the matrix may take longer than one command's time limit. Each cell runs one
# whole generation (its TTFT) and times the other two TPOT repeats from the prompt's cache (--ttft-repeats 1),
# which spares two long prefills a cell.
# From the root of a copy of this tree with .whl/ beside it:
#   bash tools/offline_gpu/device_serving_matrix.sh start [ARGS...]   # ARGS: more `compresskit bench` arguments
#   bash tools/offline_gpu/device_serving_matrix.sh wait [SECONDS]    # up to SECONDS (540); the results to $OUT
# Environment: PROMPTS (default "512 2048 8192 16384"), BATCHES (default 1,2,4,8,16,32,64).
# `wait` merges the prompts finished so far there (benchmarks/merge_bench.py: $OUT/bench.{json,md},
# bench-heatmap.png) and packs each prompt's own files into $OUT/parts.tar.gz (a few files to copy back).
set -uo pipefail
SM=${SM:-/tmp/sm}  # the job's folder
step=${1:?usage: device_serving_matrix.sh start [ARGS...]|wait [SECONDS]}
shift
if [ "$step" = wait ]; then
  for ((t = 0; t < ${1:-540}; t += 10)); do
    [ -f "$SM/rc" ] && break
    sleep 10
  done
  tail -n 30 "$SM/log"
  mkdir -p "$OUT" && cp "$SM/log" "$OUT/log" 2>/dev/null
  parts=$(find "$SM/out" -mindepth 2 -maxdepth 2 -name bench.json -printf '%h\n' 2>/dev/null | sort -V)
  if [ -n "$parts" ]; then
    tar czf "$OUT/parts.tar.gz" -C "$SM/out" . && echo "prompts done: $(basename -a $parts | tr '\n' ' ')"
    # shellcheck disable=SC2086
    PYTHONPATH=/tmp/ck:/tmp/site python3 benchmarks/merge_bench.py "$SM/merged" $parts >/dev/null &&
      cp "$SM/merged/"* "$OUT/" && tail -n +3 "$OUT/bench.md" | head -n 40
  fi
  [ -f "$SM/rc" ] && { echo "matrix ended: exit $(cat "$SM/rc")"; exit 0; }
  echo "matrix still running"
  exit 4
fi
source tools/offline_gpu/device_env.sh
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
rm -rf "$SM" && mkdir -p "$SM/out"
# shellcheck disable=SC2016
setsid bash -c '
  for p in ${PROMPTS:-512 2048 8192 16384}; do
    compresskit bench --shape llama-3.1-8b --batch "${BATCHES:-1,2,4,8,16,32,64}" --prompt "$p" \
      --transformers off --prefill-graphs off --new-tokens 32 --repeats 3 --ttft-repeats 1 "$@" --output "'"$SM"'/out/p$p" || echo "prompt $p: exit $?"
  done
  echo 0 > "'"$SM"'/rc"' _ "$@" > "$SM/log" 2>&1 < /dev/null &
sleep 5 && tail -n 5 "$SM/log"
echo "started: bash tools/offline_gpu/device_serving_matrix.sh wait"
