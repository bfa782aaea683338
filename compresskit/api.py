"""``apply(recipe)``: the whole pipeline, as one verb.

load -> prepare -> calibrate -> train (each stage) -> finalize -> convert -> evaluate -> save -> report

Outputs are staged in ``<output.dir>.partial`` (where training stages keep checkpoints, so an
interrupted run resumes) and moved into ``output.dir`` only when everything succeeded.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import datetime as _dt
import functools
import hashlib
import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from compresskit import artifacts, crashpoints, distributed, files, locking
from compresskit.bench import measure_speed, unmeasured_reason
from compresskit.data import DataModule, check_source, held_out_documents, load_documents
from compresskit.distill import keeps_teacher_copy, teacher_cache_dir, write_teacher_cache
from compresskit.errors import CompressKitError, OutputExistsError, RecipeError
from compresskit.evaluate import EvalResult, evaluate, recovery, resolve_engine
from compresskit.generation import write_generated
from compresskit.interfaces import PruneSummary, RunContext, TrainSummary
from compresskit.interrupts import deferred
from compresskit.modeling import (
    cache_dir,
    count_parameters,
    load_model,
    local_model_dir,
    release_freed_memory,
    resolve_model_source,
)
from compresskit.options import configured_executor, trained_notice
from compresskit.pipeline import PipelineRecord, aimed, runtime_pruner
from compresskit.progress import Progress
from compresskit.recipe import DataSection, EvaluationSection, ResolvedRecipe, ResolvedStep, load_recipe
from compresskit.report import results_markdown
from compresskit.seeding import deterministic_algorithms, phase_seed, seed_everything
from compresskit.sparsity import SparsityReport
from compresskit.tasks import check_lm_eval_tasks, check_task_data

RESULTS_VERSION = 1
EVAL_FILES = ("results.json", "results.md")  # what eval --output writes


@dataclass
class RunResult:
    output_dir: Path
    results: dict[str, Any]
    prune_summary: PruneSummary | None = None
    train_summaries: list[TrainSummary] = field(default_factory=list)
    reused: bool = False  # output_dir already held the finished run of this recipe: nothing ran
    retimed: bool = False  # reused, with its speed measured again (``_retime``)
    rank: int = 0  # with several ranks, this process's: only rank 0's result holds the run's results


def check_output_dir(resolved: ResolvedRecipe) -> tuple[Path, dict[str, Any] | None]:
    """The output directory and, when it already holds the finished run of this very recipe, or of one
    that differs from it in ``evaluation.speed`` alone (and ``output.overwrite`` is off), that run's
    results. Raises when the directory cannot be created or holds something a run would silently destroy."""
    out = Path(resolved.recipe.output.dir)
    files.check_creatable(out, "output.dir")
    if out.is_dir() and any(out.iterdir()):
        results = out / "results.json"
        previous = None
        if results.is_file():
            try:
                previous = json.loads(results.read_text())
            except (json.JSONDecodeError, UnicodeDecodeError):
                previous = None
        same = isinstance(previous, dict) and _reusable(previous, resolved)
        if same and not resolved.recipe.output.overwrite:
            return out, previous
        if not same and not resolved.recipe.output.overwrite:
            what = "a run of a different recipe" if isinstance(previous, dict) else "files that are not a run"
            raise OutputExistsError(
                f"output.dir: {str(out)!r} already holds {what}; choose another output.dir, "
                "or set output.overwrite: true (--overwrite) to replace it"
            )
    return out, None


def _without_speed(recipe: dict[str, Any]) -> dict[str, Any]:
    """A recipe mapping without what decides none of a run's quality numbers (``output``, ``evaluation.speed``)."""
    data = {k: v for k, v in recipe.items() if k != "output"}
    if isinstance(data.get("evaluation"), dict):
        data["evaluation"] = {k: v for k, v in data["evaluation"].items() if k != "speed"}
    return data


def _reusable(results: dict[str, Any], resolved: ResolvedRecipe) -> bool:
    """Whether ``results`` are those of ``resolved``, or of a recipe that differs from it in
    ``evaluation.speed`` alone (then :func:`_retime` brings the speed up to date without rerunning)."""
    if results.get("recipe_hash") == resolved.hash():
        return True
    recipe = results.get("recipe")
    return isinstance(recipe, dict) and _without_speed(recipe) == _without_speed(resolved.to_dict())


def _needs_timing(results: dict[str, Any], resolved: ResolvedRecipe) -> bool:
    """Whether a finished run's speed is to be measured again: its ``evaluation.speed`` settings
    changed, or it could not be measured where the run ran and can be here. A speed measured at the
    settings asked for is kept where nothing is measured (``measure: false``, or ``auto`` on a CPU):
    timing a GPU run's model on a CPU, or not at all, must not wipe the GPU's numbers."""
    speed = results.get("speed")
    measured = bool(speed and speed.get("measured"))
    here = _timing_device(resolved)
    if results.get("recipe_hash") != resolved.hash():
        return not (measured and here is None and _same_speed_settings(results, resolved))
    return not measured and here is not None


def _same_speed_settings(results: dict[str, Any], resolved: ResolvedRecipe) -> bool:
    """Whether a finished run was timed with the ``evaluation.speed`` settings of ``resolved``, whether
    to measure apart."""
    recipe = results.get("recipe")
    old = recipe.get("evaluation", {}).get("speed") if isinstance(recipe, dict) else None
    new = resolved.to_dict()["evaluation"]["speed"]
    return isinstance(old, dict) and {**old, "measure": None} == {**new, "measure": None}


def _timing_device(resolved: ResolvedRecipe) -> str | None:
    """The device type a run's saved model would be timed on here, or None where speed is not measured."""
    rec = resolved.recipe
    cuda = torch.cuda.is_available() and rec.model.device != "cpu"
    device_type = "cuda" if cuda else "cpu"
    return None if unmeasured_reason(rec.evaluation.speed, device_type) else device_type


def _retime(resolved: ResolvedRecipe, out: Path, results: dict[str, Any], progress: Progress) -> dict[str, Any]:
    """``results`` of the finished run in ``out`` with its speed measured here and now: the saved model
    on the runtime beside its dense base, as ``apply`` measures it. What the run trained and evaluated
    stays as it was; ``results.json`` and ``results.md`` are rewritten atomically."""
    rec = resolved.recipe
    device_type = _timing_device(resolved)
    if device_type is None:  # the settings changed to ones that measure nothing here
        speed = {"measured": False, "reason": unmeasured_reason(rec.evaluation.speed, "cpu")}
    else:
        with progress.task(f"loading {out / 'model'} to time it"):
            model, _, pruner = artifacts.load(out / "model", device=rec.model.device, dtype=rec.model.dtype)
        speed = measure_speed(
            model,
            pruner,
            rec.evaluation.speed,
            load_dense=lambda: load_model(
                rec.model.name_or_path,
                dtype=rec.model.dtype,
                device=rec.model.device,
                allow_download=rec.model.allow_download,
            )[0],
            base=rec.model.name_or_path,
            progress=progress,
        )
    results = {
        **results,
        "speed": speed,
        "recipe_hash": resolved.hash(),
        "recipe": resolved.to_dict(),
        "overrides": resolved.overrides,
    }
    with files.staged_files(out) as tmp:
        files.write_json(tmp / "results.json", results)
        files.write_text(tmp / "results.md", results_markdown(results))
    return results


def _eval_summary(ev: EvalResult) -> dict[str, Any]:
    return {
        **ev.meta,
        "tasks": {
            name: {
                "n_items": t.n_items,
                "seconds": round(t.seconds, 2),
                "batch_size": t.batch_size,
                "peak_memory_bytes": t.peak_memory_bytes,
            }
            for name, t in ev.tasks.items()
        },
    }


def dense_reference(resolved: ResolvedRecipe, model, tokenizer, data: DataModule, progress: Progress) -> dict[str, Any]:
    """Metrics of the unpruned model under the same evaluation, cached by what decides them and nothing else:
    the model as loaded, the held-out text (the sources, their contents and split), the evaluation settings.
    Settings of the training and calibration text alone (``data.calibration``) and of how the model was
    found (``model.allow_download``) are left out, so that changing them reuses the reference."""
    rec = resolved.recipe
    key_src = {
        "model": rec.model.model_dump(mode="json", exclude={"allow_download"}),
        "data": rec.data.model_dump(mode="json", exclude={"calibration"}),
        # (speed decides no metric; the engine counts as what it resolved to, below)
        "evaluation": rec.evaluation.model_dump(mode="json", exclude={"speed", "engine"}),
        "data_files": data.files,  # the files' contents (sha256), not only their names
        "data_fingerprint": data.fingerprint(),  # every source's contents (a dataset's fingerprint too)
        "device": str(next(model.parameters()).device),
        "dtype": str(next(model.parameters()).dtype),
    }
    if resolve_engine(model, rec.evaluation) == "runtime":  # (references scored by transformers keep their keys)
        key_src["engine"] = "runtime"
    key = hashlib.sha256(json.dumps(key_src, sort_keys=True).encode()).hexdigest()[:16]
    path = cache_dir() / "dense" / f"{key}.json"
    if path.is_file():
        return json.loads(path.read_text())
    with progress.task("dense reference (cached after the first run)"):
        ev = evaluate(
            model, tokenizer, data, rec.evaluation, progress=progress, allow_download=rec.model.allow_download
        )
    out = {"metrics": ev.metrics(), "zero_shot_average": ev.zero_shot_average(), "key": key_src}
    files.write_json(path, out)
    return out


def apply(
    recipe: ResolvedRecipe | str | Path | dict,
    *,
    overrides: list[str] | dict[str, Any] | None = None,
    progress: Progress | None = None,
) -> RunResult:
    """Run a recipe end to end and write ``results.json``, ``results.md`` and ``model/``.

    Args:
        recipe: a resolved recipe, a YAML path or a mapping.
        overrides: ``["key.path=value", ...]`` or ``{"key.path": value}``; they win over the recipe.
        progress: where long steps report (the CLI passes a rich one).

    The run holds the lock of its ``output.dir`` (:mod:`compresskit.locking`) from before it reads the
    folder to the end: another run on the same folder stops at once with one line.
    """

    resolved = recipe if isinstance(recipe, ResolvedRecipe) else load_recipe(recipe, overrides)
    rec = resolved.recipe
    ranks = distributed.init(rec.distributed.timeout_s, rec.model.device) if distributed.launched() else None
    main = ranks is None or ranks.main
    progress = (progress or Progress()) if main else Progress()  # progress and logs from rank 0 only
    try:
        # Everything a user can get wrong is checked before anything is written.
        unshardable = [s.name for s in resolved.training if not getattr(s.cls, "shardable", False)]
        if ranks is not None and unshardable:
            raise RecipeError(f"training: stage(s) {', '.join(unshardable)} cannot train on several ranks; run on one")
        if ranks is not None and len(resolved.steps) > 1:
            raise RecipeError("steps: a pipeline of several steps trains in one process; run it without --nproc")
        out, finished = check_output_dir(resolved)
        if finished is None:
            _check_inputs(rec)
        lock = locking.hold(out, field="output.dir", progress=progress) if main else contextlib.nullcontext()
        with lock:
            return _apply_locked(resolved, out, progress, ranks, checked=finished is None)
    finally:
        if ranks is not None:
            distributed.close()


def _check_inputs(rec) -> None:
    """What a run reads, checked before it writes anything: the model, the data, the evaluation's tasks."""
    resolve_model_source(rec.model.name_or_path, allow_download=rec.model.allow_download)
    check_source(rec.data)
    check_lm_eval_tasks(rec.evaluation, allow_download=rec.model.allow_download)


def _apply_locked(resolved: ResolvedRecipe, out: Path, progress: Progress, ranks, checked: bool) -> RunResult:
    """:func:`apply` once it holds the lock of ``out``: finish or resume what an interrupted run of this
    recipe left, reuse a finished one, or run it (``checked``: its inputs were checked already)."""
    rec = resolved.recipe
    main = ranks is None or ranks.main
    rank = ranks.rank if ranks else 0
    staging = out.with_name(out.name + ".partial")
    recipe_hash = resolved.hash()
    if main:  # what killed runs left half-written: no other process writes here while the lock is held
        files.sweep(out)
        files.sweep(staging)
    out, finished = check_output_dir(resolved)  # (again: another run may have finished it meanwhile)
    complete = None if finished is not None else _complete_staging(staging, recipe_hash)
    distributed.barrier()  # (every rank has read the folders before rank 0 changes them)
    if finished is not None:  # reused whatever became of its data since (its speed timed again if need be)
        if staging.is_dir() and main:  # what an interrupted rerun of the finished recipe left behind
            shutil.rmtree(staging)
        retimed = main and _needs_timing(finished, resolved)
        if retimed:
            finished = _retime(resolved, out, finished, progress)
        return RunResult(out, finished, reused=True, retimed=retimed, rank=rank)
    if complete is not None:  # killed after it had written everything, before its outputs were in place
        if not main:
            return RunResult(out, {}, rank=rank)
        progress.log(f"the interrupted run in {staging} had finished; moving its outputs into place")
        return RunResult(out, _publish(staging, out, recipe_hash), rank=rank)
    if not checked:
        _check_inputs(rec)

    marker = staging / "recipe.json"
    if main:
        if staging.is_dir():
            try:
                same = json.loads(marker.read_text()).get("recipe_hash") == recipe_hash
            except (OSError, json.JSONDecodeError, UnicodeDecodeError):
                same = False
            if same:
                progress.log(f"resuming the interrupted run in {staging}")
            else:
                shutil.rmtree(staging)
        staging.mkdir(parents=True, exist_ok=True)
        files.write_json(marker, {"recipe_hash": recipe_hash, "recipe": resolved.to_dict()})
    distributed.barrier()

    try:
        with deterministic_algorithms(rec.deterministic):
            return _run_staged(resolved, staging, out, progress, ranks)
    except CompressKitError:
        if main and not (staging / "work").exists():  # nothing to resume: leave no partial output behind
            shutil.rmtree(staging, ignore_errors=True)
        raise


def _complete_staging(staging: Path, recipe_hash: str) -> dict[str, Any] | None:
    """The results of a run of ``recipe_hash`` that wrote everything into ``staging`` (its model, then its
    results: written in that order, each whole) and was stopped before its outputs were in place; None
    when ``staging`` holds no such run."""
    try:
        results = json.loads((staging / "results.json").read_text())
    except (OSError, json.JSONDecodeError, UnicodeDecodeError):
        return None
    if not isinstance(results, dict) or results.get("recipe_hash") != recipe_hash:
        return None
    return results if (staging / "model" / artifacts.MANIFEST).is_file() else None


def _publish(staging: Path, out: Path, recipe_hash: str) -> dict[str, Any]:
    """Move a finished run from ``staging`` to ``out`` (what only resuming needed goes first), then check
    that what the command is about to print is there: ``out``'s results of ``recipe_hash`` and its model.
    Returns the results. Each step can be cut (a rerun finishes it); a signal waits until the move is done."""
    with deferred():
        shutil.rmtree(staging / "work", ignore_errors=True)
        crashpoints.point("publish: the checkpoints removed")
        (staging / "recipe.json").unlink(missing_ok=True)
        crashpoints.point("publish: the resume marker removed")
        files.replace_dir(staging, out)
        crashpoints.point("publish: moved into place")
    results = _complete_staging(out, recipe_hash)
    if results is None:
        raise RuntimeError(
            f"{out}: the run finished, but its results.json of recipe {recipe_hash} or its model/ is not there "
            "after the move (did another program change the folder?)"
        )
    return results


@dataclasses.dataclass
class _Run:
    """One ``apply`` between its phases: what the recipe asked, where it writes, and what the first phase
    prepared (the tokenizer, the data, the pruner's context)."""

    resolved: ResolvedRecipe
    staging: Path
    out: Path
    progress: Progress
    ranks: Any = None
    tokenizer: Any = None
    data: DataModule | None = None
    split: dict | None = None
    ctx: RunContext | None = None

    @property
    def rec(self):
        return self.resolved.recipe

    @property
    def main(self) -> bool:
        return self.ranks is None or self.ranks.main

    def load(self):
        """``(model, tokenizer)`` of the recipe's model, on this rank's device."""
        rec = self.rec
        device = rec.model.device if self.ranks is None else str(self.ranks.device)
        return load_model(
            rec.model.name_or_path,
            dtype=rec.model.dtype,
            device=device,
            allow_download=rec.model.allow_download,
            progress=self.progress,
        )

    def attach(self, model, step: ResolvedStep | None = None, config=None):
        """``(model, pruner)``: ``step``'s pruner (the first step's by default) attached to ``model`` with
        ``config`` (its own by default; a pipeline's later step: aimed at what the earlier ones left), calibrated,
        and finalized where it prunes before training; ``(model, None)`` without one."""
        rec, ctx, progress = self.rec, self.ctx, self.progress
        step = step if step is not None else self.resolved.steps[0]
        if step.pruner is None:
            return model, None
        pruner = step.pruner.cls(config if config is not None else step.pruner.config)
        seed_everything(self.seed(step, "prepare"))
        targeted = pruner.prepare(model, dataclasses.replace(ctx, seed=self.seed(step, "prepare")))
        progress.log(f"{step.pruner.name}: attached to {len(targeted)} modules")
        if pruner.requires_calibration:
            cal = rec.data.calibration
            cal_seed = self.seed(step, "calibration")
            batches = self.data.calibration_batches(cal.n_samples, cal.seq_len, cal.batch_size, seed=cal_seed)
            seed_everything(cal_seed)
            device = next(model.parameters()).device
            with progress.task("calibrating", total=len(batches)) as task:

                def counted(bs=batches, t=task):
                    for i, b in enumerate(bs):
                        crashpoints.point(f"calibration batch {i + 1} of {len(bs)}")
                        yield b.to(device)
                        t.advance(1)

                pruner.calibrate(model, counted())
        if pruner.prunes_before_training:  # what training recovers is the pruned model
            model = pruner.finalize(model)
        return model, pruner

    def seed(self, step: ResolvedStep, phase: str) -> int:
        """The seed of ``phase`` of ``step``: named after the step in a pipeline (``steps.1.calibration``), as a
        one-pruner recipe has always named it (``calibration``) otherwise."""
        return phase_seed(self.rec.seed, f"{step.path}.{phase}" if step.path else phase)

    def work_dir(self, step: ResolvedStep, k: int, name: str) -> Path:
        """Where ``name`` of step ``k`` keeps what an interrupted run resumes from."""
        return self.staging / "work" / (f"step{k}-{name}" if step.path else name)


def _run_staged(resolved: ResolvedRecipe, staging: Path, out: Path, progress: Progress, ranks=None) -> RunResult:
    """The pipeline proper, writing into ``staging`` and moving it to ``out`` at the end.

    Each phase that draws random numbers is seeded from the recipe's seed and its own name
    (:func:`compresskit.seeding.phase_seed`), so that nothing a phase draws depends on what ran
    before it (a dense reference computed here or found in the cache, for example).
    """
    run = _Run(resolved, staging, out, progress, ranks)
    model, dense, params_before = _start(run)
    trained = _train(run, model)
    if trained is None:  # a rank other than the first: rank 0 runs the rest alone
        return RunResult(out, {}, rank=ranks.rank)
    return _finish(run, *trained, dense=dense, params_before=params_before)


def _start(run: _Run):
    """The first phase: the text checked and prepared, the model loaded and checked, the dense reference found or
    computed. ``(model, dense reference or None, parameters before pruning)``; sets ``run``'s tokenizer, data and
    pruner context."""
    resolved, rec, progress, ranks = run.resolved, run.rec, run.progress, run.ranks
    # a bad file, a dataset that is not here, or text a task cannot build its items from, is found before the
    # model is loaded
    documents = load_documents(rec.data, allow_download=rec.model.allow_download)
    check_task_data(rec.evaluation, held_out_documents(rec.data, documents), seed=rec.data.split_seed)
    if ranks is not None:  # a built-in model is converted into the cache once, by rank 0, before the others read it
        if run.main:
            local_model_dir(resolve_model_source(rec.model.name_or_path, allow_download=rec.model.allow_download))
        distributed.barrier()
    model, tokenizer = run.load()
    param = next(model.parameters())
    params_before = count_parameters(model)
    if resolved.pruner is not None:  # what only the model can tell, before any expensive step
        resolved.pruner.cls(resolved.pruner.config).check(model.config)
    resolve_engine(model, rec.evaluation)  # (evaluation.engine: runtime for a model the runtime does not run)
    for turn in (True, False):  # rank 0 writes the generated text's cache, then the others read it
        if turn == run.main:
            write_generated(documents, model, tokenizer, model_id=rec.model.name_or_path, progress=progress)
        distributed.barrier()
    with progress.task("preparing the text"):
        run.data = DataModule.from_section(tokenizer, rec.data, documents)
        run.split = run.data.split_info()
    run.tokenizer = tokenizer
    dense = None
    if resolved.pruner is not None and rec.evaluation.compare_dense and run.main:
        dense = dense_reference(resolved, model, tokenizer, run.data, progress)
    run.ctx = RunContext(
        model_config=model.config,
        tokenizer=tokenizer,
        device=param.device,
        dtype=param.dtype,
        seed=phase_seed(rec.seed, "prepare"),
        progress=progress,
        work_dir=run.staging / "work",
    )
    return model, dense, params_before


def _train(run: _Run, model):
    """Each step's pruner attached and its training stages run, in turn (sharded over the ranks where there are
    several: a one-step run): ``(model, pruner, [(stage name, trainer)], [TrainSummary])``, the pruner finalized
    (a pipeline's: its :class:`~compresskit.pipeline.Pipeline`); None on a rank other than the first, once the
    trained state is handed over."""
    resolved, rec, ctx = run.resolved, run.rec, run.ctx
    plans = []  # each step's [(trainer, stage context)], the cached teacher logits taken before any pruner attaches
    for k, step in enumerate(resolved.steps):
        plan = []
        for i, stage in enumerate(step.training):
            stage_ctx = dataclasses.replace(
                ctx,
                seed=run.seed(step, f"training.{i}.{stage.name}"),
                work_dir=run.work_dir(step, k, f"stage{i}-{stage.name}"),
                ranks=run.ranks,
            )
            distill = getattr(stage.config, "distill", None)
            if distill is not None and distill.cache:
                stage_ctx.teacher_cache = _teacher_cache(
                    rec, model, run.data, stage.config, stage_ctx, run.ranks, run.progress
                )
            plan.append((stage.cls(stage.config), stage_ctx))
        plans.append(plan)
    first = resolved.steps[0].pruner
    planned = first.cls(first.config) if first is not None else None
    if keeps_teacher_copy(resolved.training, planned, steps=len(resolved.steps)):
        # a pruner or a stage changes weights, so the model cannot show the dense one: distill from a copy
        ctx.teacher = copy.deepcopy(model).eval().requires_grad_(False)
        plans = [[(t, dataclasses.replace(c, teacher=ctx.teacher)) for t, c in plan] for plan in plans]
    if not resolved.pipeline:
        trained = _train_step(run, model, resolved.steps[0], plans[0])
    else:
        trained = _train_pipeline(run, model, plans)
    ctx.teacher = None  # a dense copy kept for distillation is not needed past training
    return trained


def _train_step(run: _Run, model, step: ResolvedStep, plan: list, config=None):
    """One step: its pruner attached (with ``config``, where given), its stages run with their contexts
    (``plan``) and the pruner finalized. ``(model, pruner, [(stage name, trainer)], [TrainSummary])``; None on a
    rank other than the first."""
    ranks = run.ranks
    model, pruner = run.attach(model, step, config)
    if ranks is not None and step.training:
        for trainer, stage_ctx in plan:
            trainer.prepare_for_sharding(model, pruner, stage_ctx)
        distributed.shard(model, ranks)  # the backbone over the ranks, one unit per decoder layer
    stages, summaries = [], []
    for stage, (trainer, stage_ctx) in zip(step.training, plan, strict=True):
        summary = trainer.fit(model, pruner, run.data, stage_ctx)
        release_freed_memory()  # (what the stage's steps freed: the next phase starts from the live memory)
        summary.stage = stage.name
        summaries.append(summary)
        stages.append((stage.name, trainer, stage_ctx))
    if ranks is not None:
        # the trained state to rank 0, which rebuilds the model whole and runs the rest alone
        state = distributed.full_state_dict(model) if distributed.is_sharded(model) else None
        distributed.close()
        if not run.main:
            return None
        if state is not None:
            model, pruner = _rebuild(run.load()[0], run.attach, state, stages)
    if pruner is not None and pruner.state != "finalized":
        model = pruner.finalize(model)
    return model, pruner, [(name, trainer) for name, trainer, _ in stages], summaries


def _train_pipeline(run: _Run, model, plans: list):
    """A pipeline's steps in turn, each aimed at its share of the original model's MACs. After each step that
    leaves a plain model (and the plain ones before it) the model is checkpointed with what the step measured, so
    that an interrupted run resumes after it; the last such checkpoint is the saved model's base."""
    steps, rec = run.resolved.steps, run.rec
    record = PipelineRecord.start(run.resolved.pruner.config, model, run.staging / "work")

    def load(folder):
        return load_model(str(folder), dtype=rec.model.dtype, device=rec.model.device, progress=run.progress)[0]

    resumed = record.resume(load)
    if resumed is not None:
        run.progress.log(
            f"resuming after step {record.done - 1} ({steps[record.done - 1].pruner.name}) of the pipeline"
        )
        model = resumed
    stages = []
    for k in range(record.done, len(steps)):
        step = steps[k]
        config = aimed(step.pruner.cls, step.pruner.config, record.skipped(), step.path)
        model, pruner, step_stages, trained = _train_step(run, model, step, plans[k], config)
        stages += step_stages
        with run.progress.task(f"checkpointing step {k} ({step.pruner.name})"):
            record.add(model, pruner, step_stages, trained, save_model=functools.partial(_save_plain, run.tokenizer))
    return model, record.pipeline, stages, record.train_summaries


def _save_plain(tokenizer, model, folder: Path) -> None:
    """A plain transformers checkpoint of ``model`` with ``tokenizer``, written whole or not at all."""
    with files.staged_dir(folder) as tmp:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)


def _finish(run: _Run, model, pruner, stages, summaries, *, dense, params_before: int) -> RunResult:
    """The last phase: the model saved, its speed measured, its executor's form evaluated, the results written
    and the staged run moved to its folder."""
    resolved, rec, progress, out = run.resolved, run.rec, run.progress, run.out
    prune_summary = pruner.summary(model) if pruner is not None else None
    # What the pruner and the training stages own is saved before the executor rewires the model
    # for speed: the saved model never depends on the executor that evaluated it.
    with progress.task("saving the model"):
        artifacts.save(
            run.staging / "model",
            model,
            run.tokenizer,
            base_model=rec.model.name_or_path,
            pruner_name=resolved.pruner.name if resolved.pruner else None,
            pruner=pruner,
            stages=stages,
            recipe=resolved.to_dict(),
        )
    params_after = count_parameters(model)
    speed = measure_speed(
        model,
        pruner,
        rec.evaluation.speed,
        load_dense=lambda: run.load()[0],
        base=rec.model.name_or_path,
        progress=progress,
    )  # on the runtime, with the pruner's own blocks: before the executor rewires the model for evaluation
    executor = resolved.executor.cls(resolved.executor.config)
    executor.check(model)
    model = executor.convert(model)
    notice = trained_notice(f"run {out}", resolved.pruner and resolved.pruner.cls, resolved.to_dict(), executor.config)
    if notice:
        progress.log(notice)
    seed_everything(phase_seed(rec.seed, "evaluation"))
    where = {"pruner": pruner, "executor": executor, "progress": progress, "allow_download": rec.model.allow_download}
    ev = evaluate(model, run.tokenizer, run.data, rec.evaluation, **where)
    param = next(model.parameters())
    results = build_results(
        name=rec.name or out.name,
        recipe_hash=resolved.hash(),
        model_info={
            "name_or_path": rec.model.name_or_path,
            "dtype": str(param.dtype).removeprefix("torch."),
            "device": str(param.device),
            "params_before": params_before,
            "params_after": params_after,
        },
        pruner_name=resolved.pruner.name if resolved.pruner else None,
        ev=ev,
        sparsity=run_sparsity(ev, pruner, model.config),
        dense=dense,
        split=run.split,
        seeds={"recipe": rec.seed, "evaluation": rec.evaluation.seed, "split": rec.data.split_seed},
        recipe=resolved.to_dict(),
        overrides=resolved.overrides,
        training=[vars(s) for s in summaries],
        prune_summary=vars(prune_summary) if prune_summary else None,
        speed=speed,
    )
    with progress.task("saving the results"):
        files.write_text(run.staging / "results.md", results_markdown(results))
        files.write_json(run.staging / "results.json", results)  # (last: it marks the staged run complete)
        results = _publish(run.staging, out, resolved.hash())
    return RunResult(out, results, prune_summary, summaries)


def _teacher_cache(rec, model, data, config, stage_ctx, ranks, progress) -> Path:
    """Compute (or find) a distilling stage's cached top-k teacher logits with the dense ``model``: each
    rank its share of the micro-batches, then all wait for the rest."""
    param = next(model.parameters())
    seed = stage_ctx.seed if config.seed is None else config.seed
    model_key = {"name_or_path": rec.model.name_or_path, "dtype": str(param.dtype), "device": param.device.type}
    directory = teacher_cache_dir(model_key, data, config, seed)
    world, rank = (ranks.world, ranks.rank) if ranks is not None else (1, 0)
    micro_batches = config.steps * config.grad_accum * world
    model.eval()
    write_teacher_cache(model, data, config, seed, micro_batches, directory, rank=rank, world=world, progress=progress)
    distributed.barrier()
    return directory


def _rebuild(model, attach, state: dict, stages: list):
    """Rank 0 after sharded training, on ``model`` loaded whole again: the pruner attached as before,
    each stage's structure set up (LoRA adapters), the trained ``state`` loaded, and each stage
    finished (LoRA merged where asked). Returns ``(model, pruner)``."""
    model, pruner = attach(model)
    for _, trainer, stage_ctx in stages:
        trainer.setup(model, pruner, stage_ctx)
    missing, unexpected = model.load_state_dict(state, strict=False)
    tensors = model.state_dict()
    stored = {t.data_ptr() for n, t in tensors.items() if n in state}
    missing = [n for n in missing if tensors[n].data_ptr() not in stored]  # tied weights are there
    if missing or unexpected:
        raise RuntimeError(f"the sharded model's state does not fit the rebuilt one: {missing[:3]} {unexpected[:3]}")
    model.requires_grad_(False)
    for _, trainer, stage_ctx in stages:
        trainer.finish(model, pruner, stage_ctx)
    return model.eval(), pruner


def run_sparsity(ev: EvalResult, pruner, model_config) -> SparsityReport | None:
    """The sparsity a run reports: the dense model's (nothing skipped, by construction, for every
    task) without a pruner; otherwise what the evaluator measured, None when the pruner or its
    executor did not measure it."""
    if pruner is not None:
        return ev.sparsity
    dense = SparsityReport.dense(model_config)
    for task in ev.tasks.values():
        task.sparsity = dense
    return dense


def build_results(
    *,
    name: str,
    recipe_hash: str,
    model_info: dict[str, Any],
    pruner_name: str | None,
    ev: EvalResult,
    sparsity: SparsityReport | None,
    dense: dict[str, Any] | None,
    split: dict[str, Any],
    seeds: dict[str, int],
    recipe: dict[str, Any],
    overrides: list[str],
    training: list[dict[str, Any]] | None = None,
    prune_summary: dict[str, Any] | None = None,
    speed: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The ``results.json`` document (docs/outputs.md lists its fields)."""
    return {
        "schema_version": RESULTS_VERSION,
        "name": name,
        "recipe_hash": recipe_hash,
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "model": model_info,
        "pruner": pruner_name,
        "metrics": ev.metrics(),
        "zero_shot_average": ev.zero_shot_average(),
        # None: not measured (a pruner or executor that does not count it), never a made-up 0
        "sparsity": None
        if sparsity is None
        else {
            **sparsity.to_dict(),
            "per_task": {task: t.sparsity.to_dict(per_layer=False) for task, t in ev.tasks.items() if t.sparsity},
        },
        "dense": dense,
        "recovery": recovery(ev.metrics(), dense["metrics"], ev.higher_is_better) if dense else None,
        # TTFT / TPOT on the runtime against the dense base, or {"measured": false, "reason": ...}
        "speed": speed,
        "training": training or [],
        "prune_summary": prune_summary,
        "evaluation": _eval_summary(ev),
        "data": split,
        "seeds": seeds,
        "versions": artifacts.versions(),
        "recipe": recipe,
        "overrides": overrides,
    }


def eval_model(
    model_ref: str,
    *,
    evaluation: EvaluationSection | None = None,
    data: DataSection | None = None,
    dtype: str = "auto",
    device: str = "auto",
    output_dir: str | Path | None = None,
    progress: Progress | None = None,
    field: str = "model_ref",
    options: dict[str, Any] | None = None,
    allow_download: bool = False,
    data_field: str = "data.source.files",
) -> dict[str, Any]:
    """Evaluate a saved compresskit model directory, an HF directory or a built-in alias with the
    shared evaluator; optionally write ``results.json``/``results.md`` to ``output_dir``. Errors
    about ``model_ref`` name it as ``field`` (the CLI passes its argument's name). ``options``: score a
    saved run under these settings of its method's runtime executor (``--option``, :mod:`compresskit.options`),
    through the executor's ``convert``: the reference path then decides as the runtime's blocks would, each
    evaluation batch of ``evaluation.batch_size`` sequences as a served batch. ``allow_download``: a hub model
    or an lm-eval task's data not in the local caches may be downloaded (``--allow-download``). ``data_field``:
    how errors about ``data``'s files name them (the CLI: ``--data``)."""
    progress = progress or Progress()
    evaluation = evaluation or EvaluationSection()
    data_section = data or DataSection()
    if output_dir is not None:
        files.check_creatable(Path(output_dir), "output directory (--output)")
        files.check_replaceable(Path(output_dir), "output directory (--output)", EVAL_FILES)
    check_source(
        data_section, data_field
    )  # your files exist, and the tasks find their items in them: said before the model loads
    check_lm_eval_tasks(evaluation, allow_download=allow_download, download_flag="give --allow-download")
    documents = load_documents(data_section)
    held_out = held_out_documents(data_section, documents)
    check_task_data(evaluation, held_out, seed=data_section.split_seed, test_fraction="--test-fraction")
    lock = (
        locking.hold(Path(output_dir), field="output directory (--output)", progress=progress)
        if output_dir is not None
        else contextlib.nullcontext()
    )
    with lock:
        return _eval_locked(
            model_ref,
            evaluation=evaluation,
            data_section=data_section,
            documents=documents,
            dtype=dtype,
            device=device,
            output_dir=output_dir,
            progress=progress,
            field=field,
            options=options,
            allow_download=allow_download,
        )


def _eval_locked(
    model_ref: str,
    *,
    evaluation: EvaluationSection,
    data_section: DataSection,
    documents,
    dtype: str,
    device: str,
    output_dir: str | Path | None,
    progress: Progress,
    field: str,
    options: dict[str, Any] | None,
    allow_download: bool,
) -> dict[str, Any]:
    """:func:`eval_model` once its inputs are checked (and it holds its output folder's lock)."""
    path = artifacts.saved_dir(model_ref)  # a saved model, or the run folder that holds one
    saved = path is not None
    executor = None
    if options is not None:  # (checked before the model loads)
        method = runtime_pruner(artifacts.read_manifest(path)) if saved else None
        if method is None:
            raise CompressKitError(f"--option: {model_ref} is no saved run of a method, so it has no settings of one")
        executor = configured_executor(method, options)
    if saved:
        model, tokenizer, pruner = artifacts.load(path, dtype=dtype, device=device, progress=progress)
        manifest = artifacts.read_manifest(path)
        base = manifest["base_model"]
        pruner_name = (manifest.get("pruner") or {}).get("name")
        scored = executor.config if executor is not None else None  # (None: its executor's defaults)
        notice = trained_notice(model_ref, type(pruner) if pruner else None, manifest.get("recipe"), scored)
        if notice:
            progress.log(notice)
    else:
        resolve_model_source(model_ref, allow_download=allow_download, field=field)
        model, tokenizer = load_model(
            model_ref, dtype=dtype, device=device, allow_download=allow_download, progress=progress, field=field
        )
        pruner, pruner_name, base = None, None, model_ref
    resolve_engine(model, evaluation)
    if executor is not None:
        executor.convert(model)  # the reference path decides as the runtime's blocks would under the setting
    write_generated(documents, model, tokenizer, model_id=model_ref, progress=progress)
    seed_everything(evaluation.seed)
    with progress.task("preparing the text"):
        dm = DataModule.from_section(tokenizer, data_section, documents)
        split = dm.split_info()
    ev = evaluate(
        model,
        tokenizer,
        dm,
        evaluation,
        pruner=pruner,
        executor=executor,
        progress=progress,
        allow_download=allow_download,
    )
    param = next(model.parameters())
    recipe = {
        "eval": model_ref,
        "evaluation": evaluation.model_dump(mode="json"),
        "data": data_section.model_dump(mode="json"),
    }
    if options is not None:
        recipe["options"] = options
    key = hashlib.sha256(json.dumps(recipe, sort_keys=True).encode()).hexdigest()[:16]
    n_params = count_parameters(model)
    results = build_results(
        name=artifacts.run_name(path or model_ref),
        recipe_hash=key,
        model_info={
            "name_or_path": model_ref,
            "base_model": base,
            "dtype": str(param.dtype).removeprefix("torch."),
            "device": str(param.device),
            "params_before": n_params,
            "params_after": n_params,
        },
        pruner_name=pruner_name,
        ev=ev,
        sparsity=run_sparsity(ev, pruner, model.config),
        dense=None,
        split=split,
        seeds={"evaluation": evaluation.seed, "split": data_section.split_seed},
        recipe=recipe,
        overrides=[],
    )
    if output_dir is not None:
        files.sweep(Path(output_dir))
        with files.staged_dir(Path(output_dir)) as tmp:
            files.write_json(tmp / "results.json", results)
            files.write_text(tmp / "results.md", results_markdown(results))
    return results
