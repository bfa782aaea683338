"""Pipelines: several pruners applied in turn (a recipe's ``steps``), seen as one pruner by the rest.

Sample YAML (docs/pipelines.md has the shipped pruners' names)::

    steps:
      - {pruner: A, config: {target_sparsity: 0.15}}          # a pruner that saves a plain, smaller model
      - pruner: B                                              # then one that keeps its modules on it
        config: {target_sparsity: 0.25}
        training: [{name: router, config: {steps: 200}}, {name: lora, config: {steps: 200, merge: true}}]

Each step prunes the model the step before left, then its own training stages train that model; the next step
starts from the result. A step's ``target_sparsity`` (``Pruner.budget``) is its share of the *original*
model's projection MACs: the run aims it at that share of what the earlier steps left (``Pruner.with_budget``),
so that the shares add up. Which orders work is the pruners' own answer (``Pruner.followed_by_problem`` /
``follows_problem``, ``Trainer.followed_problem``): by default the steps that save a plain transformers model
come first and a step that keeps its own modules on the model (a router) comes last; a recipe that breaks this
is refused before any model loads.

:class:`Pipeline` is what evaluation, saving, the runtime and ``bench`` see once the steps ran: a pruner whose
sparsity is of the original model (:func:`compresskit.sparsity.compose`, with each step's share), whose
runtime blocks are its routed step's and whose speed shape applies each step's in turn.
"""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
from pydantic import Field
from torch import nn

from compresskit import files, plugins
from compresskit.errors import CompressKitError, RecipeError
from compresskit.interfaces import PluginConfig, Pruner, PruneSummary, RunContext, TrainSummary
from compresskit.sparsity import SparsityProfile, SparsityReport, compose, macs_dims

NAME = "pipeline"  # what results.json and a saved model's manifest call a run of several steps


class StepSpec(PluginConfig):
    """One step as a saved pipeline records it: its pruner's name and its config as the recipe gave it."""

    name: str
    config: dict[str, Any] = Field(default_factory=dict)


class PipelineConfig(PluginConfig):
    steps: list[StepSpec] = Field(min_length=1)

    @classmethod
    def of_recipe(cls, recipe: dict[str, Any]) -> PipelineConfig:
        """The pipeline of a resolved recipe's dict (what ``results.json`` keeps): its steps' pruners and configs."""
        return cls(steps=[{"name": s["pruner"], "config": s.get("config") or {}} for s in recipe["steps"]])


def runtime_pruner(manifest: dict[str, Any]) -> type[Pruner] | None:
    """The pruner class whose runtime executor runs a saved model (its manifest): its method's, or a pipeline's
    last step that has one (None: the runtime's own blocks, or no method)."""
    name = (manifest.get("pruner") or {}).get("name")
    if name != NAME:
        return plugins.load("pruner", name) if name else None
    classes = [plugins.load("pruner", step["name"]) for step in manifest.get("steps") or []]
    return next((cls for cls in reversed(classes) if cls.runtime_executor), Pipeline)


def aimed(cls: type[Pruner], config: PluginConfig, done: float, where: str) -> PluginConfig:
    """``config`` of a step of ``cls`` whose budget is a share of the original model's MACs, aimed at the model
    the earlier steps left, which skip ``done`` of those MACs already (a ``RecipeError`` naming ``where`` when
    nothing is left to skip that share of)."""
    share = cls.budget(config)
    if share is None or done <= 0.0:
        return config
    left = 1.0 - done
    if share >= left:
        raise RecipeError(
            f"{where}.config.target_sparsity: {share:g} of the original MACs, but the earlier steps left only "
            f"{left:.4g} of them; give this step less"
        )
    try:
        return cls.with_budget(config, share / left)
    except ValueError as exc:
        raise RecipeError(f"{where}.config: aimed at {share / left:.4g} of the MACs it is given: {exc}") from None


def _runtime_executor(steps: list[Pruner]) -> str | None:
    """The executor whose blocks run a pipeline's model on the runtime: its last routed step's."""
    routed = [type(s).runtime_executor for s in steps if type(s).runtime_executor]
    return routed[-1] if routed else None


class Pipeline(Pruner):
    """The finalized steps of a pipeline, as one pruner.

    ``steps``: the step pruners in order (finalized, or for a step that saves a plain model and ran before this
    process, a fresh instance of its config); ``reports``: for each, its sparsity as taken when it finished (what
    :meth:`Pruner.sparsity` said then, of the model it was given) or None for a step measured live (one that keeps
    its modules on the model); ``summaries``: each step's ``PruneSummary`` fields; ``original``: the dimensions of the
    model the first step was given (``compresskit.sparsity.macs_dims``); ``stages``: each live step's training
    stages as ``(name, trainer)``; ``checkpoint``: the plain model the live steps were attached to, where saved."""

    Config = PipelineConfig

    def __init__(
        self,
        config: PipelineConfig | None = None,
        *,
        steps: list[Pruner] | None = None,
        reports: list[dict[str, Any] | None] | None = None,
        summaries: list[dict[str, Any] | None] | None = None,
        original: dict[str, int] | None = None,
        stages: list[list[tuple[str, Any]]] | None = None,
        checkpoint: Path | None = None,
    ) -> None:
        super().__init__(config)
        self.steps = list(steps or [])
        self.reports = list(reports or [None] * len(self.steps))
        self.summaries = list(summaries or [None] * len(self.steps))
        self.original = original  # (macs_dims of the model the first step was given)
        self.stages = list(stages or [[] for _ in self.steps])  # each live step's (stage name, trainer), as it ran
        self.checkpoint = checkpoint  # the plain model the live steps were attached to, where one was saved
        if self.steps:
            self._state = "finalized"
        self.runtime_executor = _runtime_executor(self.steps)

    @property
    def names(self) -> list[str]:
        return [s.name for s in self.config.steps]

    @property
    def plain(self) -> bool:
        """Whether every step so far left a plain model (each has its report)."""
        return all(r is not None for r in self.reports)

    def add(self, step: Pruner, model: nn.Module, stages: list[tuple[str, Any]] | None = None, *, record=None) -> None:
        """``step``, finished on ``model`` after its training ``stages``, as the next one. Where it and every step
        before it left a plain model, its sparsity and summary are taken now (or read from ``record``, what a
        finished step's folder kept); otherwise it is measured live from here on."""
        plain = self.plain and step.saves_full_model
        if record is not None:
            report, summary = record["report"], record["summary"]
        elif plain:
            measured = step.sparsity(model)
            report = measured.to_dict() if measured is not None else None
            summary = vars(step.summary(model))
        else:
            report = summary = None
        self.steps.append(step)
        self.reports.append(report)
        self.summaries.append(summary)
        self.stages.append([] if report is not None else list(stages or []))
        self._state = "finalized"
        self.runtime_executor = _runtime_executor(self.steps)

    # a pipeline is assembled by the run from its steps, each attached, trained and finalized in turn
    def _prepare(self, model: nn.Module, ctx: RunContext) -> list[str]:
        raise RuntimeError("a pipeline's steps attach one at a time (compresskit.api); a Pipeline is built from them")

    def _finalize(self, model: nn.Module) -> nn.Module:
        raise RuntimeError("a pipeline's steps finalize one at a time (compresskit.api)")

    def state_dict(self, model: nn.Module) -> dict[str, torch.Tensor]:
        raise RuntimeError("a pipeline saves each step's tensors apart (compresskit.artifacts)")

    def load_state_dict(self, model: nn.Module, state: dict[str, torch.Tensor]) -> None:
        raise RuntimeError("a pipeline loads each step's tensors apart (compresskit.artifacts)")

    def live(self, index: int) -> bool:
        """Whether step ``index`` is measured on the model now (its modules are on it), not from its report."""
        return self.reports[index] is None

    def reset_sparsity(self, model: nn.Module) -> None:
        for i, step in enumerate(self.steps):
            if self.live(i):
                step.reset_sparsity(model)

    def sparsity(self, model: nn.Module) -> SparsityReport | None:
        """Of the original model: every step's report composed (:func:`compose`); None where a step measured
        nothing."""
        reports = []
        for i, step in enumerate(self.steps):
            rep = step.sparsity(model) if self.live(i) else SparsityReport.from_dict(self.reports[i])
            if rep is None:
                return None
            reports.append(rep)
        return compose(SimpleNamespace(**self.original), reports, self.names)

    def sparsity_of(self, model: nn.Module, counted: SparsityReport) -> SparsityReport:
        """What the runtime's blocks ``counted`` (every live step's skipping at once) after the reports of the
        steps before them, of the original model."""
        fixed = [i for i in range(len(self.steps)) if not self.live(i)]
        live = [n for i, n in enumerate(self.names) if self.live(i)]
        reports = [SparsityReport.from_dict(self.reports[i]) for i in fixed]
        names = [self.names[i] for i in fixed] + ["+".join(live)]
        return compose(SimpleNamespace(**self.original), [*reports, counted], names)

    def summary(self, model: nn.Module) -> PruneSummary:
        self.summaries = [s or vars(step.summary(model)) for s, step in zip(self.summaries, self.steps, strict=True)]
        first = next((s for s in self.summaries if s), None)
        before = first["params_before"] if first else sum(p.numel() for p in model.parameters())
        return PruneSummary(
            method=" -> ".join(self.names),
            targeted=[t for s in self.summaries if s for t in s.get("targeted", [])],
            params_before=before,
            params_after=sum(p.numel() for p in model.parameters()),
            details={"steps": [{"name": n, **(s or {})} for n, s in zip(self.names, self.summaries, strict=True)]},
        )

    @classmethod
    def trained_options(cls, recipe: dict[str, Any]) -> dict[str, Any]:
        """The last routed step's: its training stages as a one-pruner recipe of it would hold them."""
        for step in reversed(recipe.get("steps") or []):
            step_cls = plugins.load("pruner", step["pruner"])
            if step_cls.runtime_executor:
                return step_cls.trained_options({**recipe, "training": step.get("training") or []})
        return {}

    def speed_shape(self, model: nn.Module, ctx: RunContext, profile: SparsityProfile) -> nn.Module:
        """Each step's structure in turn: the step's share of what it was given (``profile.steps``, a run's
        ``sparsity.steps``), uniform over the layers it was given."""
        if not profile.steps or len(profile.steps) != len(self.config.steps):
            raise CompressKitError(
                f"a pipeline's structure needs each of its {len(self.config.steps)} steps' realised sparsity "
                "(a run's sparsity.steps); time a run of it with --run"
            )
        self.steps, self.reports, self.summaries, self.stages = [], [], [], []
        self.original = macs_dims(model.config)
        for spec, share in zip(self.config.steps, profile.steps, strict=True):
            cls = plugins.load("pruner", spec.name)
            if not cls.has_speed_shape():
                raise CompressKitError(f"its step {spec.name} has no speed shape (Pruner.speed_shape)")
            step = cls(cls.Config.model_validate(spec.config))
            part = SparsityProfile(float(share["of_input"]), source=f"{profile.source} ({spec.name})")
            model = step.speed_shape(model, ctx, part)
            self.add(step, model)
        return model

    @classmethod
    def has_speed_shape(cls) -> bool:
        return True


STEP_RECORD = "step.json"  # written last into a finished step's folder: what a resumed run reads of the step


@dataclasses.dataclass
class PipelineRecord:
    """A running pipeline (``pipeline``, its finished steps so far), and of each step that leaves a plain model
    (with every step before it), a checkpoint under ``work`` (``step<k>-<name>/``) that an interrupted run resumes
    from."""

    pipeline: Pipeline
    work: Path
    train_summaries: list[TrainSummary] = dataclasses.field(default_factory=list)

    @classmethod
    def start(cls, config: PipelineConfig, model: nn.Module, work: Path) -> PipelineRecord:
        return cls(Pipeline(config, original=macs_dims(model.config)), Path(work))

    @property
    def done(self) -> int:
        """How many steps have finished."""
        return len(self.pipeline.steps)

    def folder(self, k: int) -> Path:
        return self.work / f"step{k}-{self.pipeline.config.steps[k].name}"

    def skipped(self) -> float:
        """The share of the original model's MACs the finished steps skip: their reports composed, and for a step
        measured only live, its budget."""
        pipe = self.pipeline
        known = [SparsityReport.from_dict(r) for r in pipe.reports if r is not None]
        share = compose(SimpleNamespace(**pipe.original), known, pipe.names[: len(known)]).macs if known else 0.0
        live = [type(s).budget(s.config) or 0.0 for s, r in zip(pipe.steps, pipe.reports, strict=True) if r is None]
        return share + sum(live)

    def add(
        self,
        model: nn.Module,
        pruner: Pruner,
        stages: list[tuple[str, Any]],
        trained: list[TrainSummary],
        *,
        save_model,
    ) -> None:
        """Step ``done`` finished: ``pruner`` finalized on ``model`` after its ``stages`` (``trained``). Where it
        left a plain model after plain ones and a step follows, the model goes to its folder
        (``save_model(model, folder)``) and then its record, the mark of a finished step."""
        k = self.done
        self.pipeline.add(pruner, model, stages)
        self.train_summaries += trained
        if self.pipeline.reports[k] is None or k + 1 == len(self.pipeline.config.steps):
            return
        folder = self.folder(k)
        if folder.exists():
            shutil.rmtree(folder)
        save_model(model, folder / "model")
        record = {
            "config": pruner.config.model_dump(mode="json"),
            "report": self.pipeline.reports[k],
            "summary": self.pipeline.summaries[k],
            "training": [vars(t) for t in trained],
        }
        files.write_json(folder / STEP_RECORD, record)
        self.pipeline.checkpoint = folder / "model"

    def resume(self, load_model) -> Any:
        """After an interrupted run: the steps whose folders hold their record taken as finished (in order, from
        the first), and the model of the last of them loaded (``load_model(folder)``); None where none finished."""
        last = None
        for k, spec in enumerate(self.pipeline.config.steps[:-1]):
            try:
                record = files.read_json(self.folder(k) / STEP_RECORD, what="a finished step's record")
            except CompressKitError:
                break
            cls = plugins.load("pruner", spec.name)
            self.pipeline.add(cls(cls.Config.model_validate(record["config"])), None, record=record)
            self.train_summaries += [TrainSummary(**t) for t in record["training"]]
            last = self.folder(k) / "model"
        if last is None:
            return None
        self.pipeline.checkpoint = last
        return load_model(last)
