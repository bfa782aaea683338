"""The three plugin APIs: :class:`Pruner`, :class:`Trainer` and :class:`Executor`.

A plugin is a class that subclasses one of these, declares a pydantic ``Config`` (a
:class:`PluginConfig`) and is registered under an entry point of the group
``compresskit.pruners``, ``compresskit.trainers`` or ``compresskit.executors``::

    [project.entry-points."compresskit.pruners"]
    my-pruner = "my_package.pruner:MyPruner"

The core never imports a plugin by name; it looks the name up through the entry point
(:mod:`compresskit.plugins`), so adding a plugin needs no edit to ``compresskit/``.
"""

from __future__ import annotations

import abc
import contextlib
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from pydantic import BaseModel, ConfigDict
from torch import nn

# The ground floor of the core: this module imports no other module of compresskit. Where a signature
# takes one of theirs, it says which in a comment: ``data`` is a ``compresskit.data.DataModule``,
# ``progress`` a ``compresskit.progress.Progress`` and a sparsity report a
# ``compresskit.sparsity.SparsityReport``.


class PluginConfig(BaseModel):
    """Base of every plugin's configuration.

    Unknown keys are an error (a typo in a recipe fails loudly), instances are immutable and
    round-trip losslessly through JSON. Put cross-field rules in a
    ``@model_validator(mode="after")`` whose message names the fields and the accepted values.
    Bump ``schema_version`` when a saved config would be read differently.

    ``omitted_at_default``: fields added after runs were saved, left out of a saved recipe (and its hash)
    while they hold this default, so that those runs stay the same recipe's.
    """

    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True)
    omitted_at_default: ClassVar[dict[str, Any]] = {}

    schema_version: int = 1


@dataclass
class RunContext:
    """What a plugin may know about the run it is part of."""

    model_config: Any  # the HF PretrainedConfig of the model being compressed
    tokenizer: Any = None
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    dtype: torch.dtype = torch.float32
    seed: int = 0  # this phase's seed, derived from the recipe's (compresskit.seeding.phase_seed)
    progress: Any = None  # a compresskit.progress.Progress, or None
    work_dir: Any = None  # a pathlib.Path where a plugin may keep checkpoints (resume), or None
    teacher: Any = None  # the dense model kept for distillation where the pruner cannot show it (or None)
    ranks: Any = None  # compresskit.distributed.Ranks when training on several ranks (the model sharded), else None
    teacher_cache: Any = None  # a stage's cached top-k teacher logits (compresskit.distill), a Path, or None


@dataclass
class Batch:
    """A batch of token ids, ``input_ids: [B, T]`` and ``attention_mask: [B, T]`` (1 = real token)."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor

    def to(self, device: torch.device | str) -> Batch:
        return Batch(self.input_ids.to(device), self.attention_mask.to(device))


@dataclass
class PruneSummary:
    """What a pruner reports after ``finalize``: plain data, rendered by the CLI."""

    method: str
    targeted: list[str]
    params_before: int
    params_after: int
    details: dict[str, Any] = field(default_factory=dict)


@dataclass
class TrainSummary:
    """What a training stage reports."""

    stage: str
    steps: int = 0
    tokens: int = 0
    final_loss: float | None = None
    seconds: float = 0.0
    history: list[dict[str, float]] = field(default_factory=list)
    # the stage's peak memory (compresskit.modeling.peak_memory): on a GPU the most it allocated, on its busiest
    # rank, which ``compresskit apply --dry-run`` estimates less the CUDA context; on the CPU the process's peak
    # resident memory, which it estimates whole; None where the system does not report it.
    peak_memory_bytes: int | None = None


class Pruner(abc.ABC):
    """A compression method.

    Lifecycle (guarded; calling out of order raises ``RuntimeError``)::

        prepare(model, ctx) -> targeted FQNs       # in-place surgery; TargetNotFoundError on zero hits
        calibrate(model, batches)                   # if requires_calibration
        trainable_parameters(model) / regularization(model) / on_train_step(step, total)
                                                    # handed to each training stage
        finalize(model) -> model                    # bake decisions, remove hooks (before the
                                                    # training stages if prunes_before_training)
        state_dict(model) / load_state_dict(model, sd)   # plugin-owned tensors only
        summary(model) -> PruneSummary
        reset_sparsity(model) / sparsity(model) -> SparsityReport  # measured while evaluating
        speed_shape(model, ctx, profile) -> model   # optional: the structure at another shape (bench)

    Class attributes:
        Config: the pydantic config class.
        requires_calibration: whether ``calibrate`` must see data before ``finalize``.
        saves_full_model: True when the finalized model is a plain (smaller) transformers model,
            saved with ``save_pretrained`` and loadable with no compresskit code; False when the
            pruner saves its own tensors and is re-applied to the base model on load.
        prunes_before_training: finalize right after calibration, so that the training stages
            (LoRA recovery, distillation) train the pruned model (the static pruners).
        can_view_dense: ``dense_view`` shows the unpruned model (the distillation teacher).
        contract_config: config kwargs that suit the tiny test model of
            :func:`compresskit.testing.tiny_llama` (used by ``compresskit plugins check``).
        runtime_executor: the executor (by plugin name) whose blocks run this pruner's models on the
            inference runtime, or None for the runtime's own blocks.
        TrainingOptions: a config class whose fields every training stage that trains the model
            (``Trainer.takes_pruner_options``) also accepts in a recipe with this pruner, beside its own
            (its ``training_scope`` reads them), or None.
    """

    Config: ClassVar[type[PluginConfig]] = PluginConfig
    requires_calibration: ClassVar[bool] = False
    saves_full_model: ClassVar[bool] = False
    contract_config: ClassVar[dict[str, Any]] = {}
    runtime_executor: ClassVar[str | None] = None
    TrainingOptions: ClassVar[type[PluginConfig] | None] = None

    def __init__(self, config: PluginConfig | None = None) -> None:
        self.config = config if config is not None else self.Config()
        if not isinstance(self.config, self.Config):
            raise TypeError(f"{type(self).__name__} expects a {self.Config.__name__}, got {type(self.config).__name__}")
        self._state = "new"

    # -- lifecycle guards ------------------------------------------------------------------
    def _require(self, *states: str, action: str) -> None:
        if self._state not in states:
            raise RuntimeError(
                f"{type(self).__name__}.{action}() called in state {self._state!r}; allowed in: {', '.join(states)}"
            )

    def prepare(self, model: nn.Module, ctx: RunContext) -> list[str]:
        """Attach to ``model`` in place; returns the targeted module names."""
        self._require("new", action="prepare")
        targeted = self._prepare(model, ctx)
        self._state = "prepared"
        return targeted

    def finalize(self, model: nn.Module) -> nn.Module:
        """Bake the decisions into the model; returns the model to use from now on."""
        self._require("prepared", action="finalize")
        model = self._finalize(model)
        self._state = "finalized"
        return model

    @property
    def state(self) -> str:
        return self._state

    # -- to implement ------------------------------------------------------------------------
    @abc.abstractmethod
    def _prepare(self, model: nn.Module, ctx: RunContext) -> list[str]: ...

    @abc.abstractmethod
    def _finalize(self, model: nn.Module) -> nn.Module: ...

    @abc.abstractmethod
    def state_dict(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """Plugin-owned tensors only, each key under the plugin's own prefix."""

    @abc.abstractmethod
    def load_state_dict(self, model: nn.Module, state: dict[str, torch.Tensor]) -> None:
        """Load what :meth:`state_dict` returned into a prepared model. Missing or unexpected keys
        must raise :class:`compresskit.errors.ArtifactError`, never leave a silent default."""

    # -- optional ----------------------------------------------------------------------------
    def check(self, model_config: Any) -> None:  # noqa: B027 - optional hook
        """Raise a :class:`compresskit.errors.RecipeError` when this config cannot apply to a model
        with this HF config (e.g. a group size that does not divide the FFN width). Called before
        any expensive step; ``prepare`` must still be safe without it."""

    def calibrate(self, model: nn.Module, batches: Iterable[Batch]) -> None:  # noqa: B027 - optional hook
        """Observe calibration data (tracked hooks only). Default: nothing to calibrate."""
        self._require("prepared", action="calibrate")

    def trainable_parameters(self, model: nn.Module) -> list[nn.Parameter]:
        """Parameters a training stage should optimise. Default: none."""
        return []

    can_view_dense: ClassVar[bool] = False
    prunes_before_training: ClassVar[bool] = False

    def dense_view(self, model: nn.Module) -> contextlib.AbstractContextManager:
        """A context in which ``model`` computes what the unpruned model does (the distillation
        teacher, with no second copy in memory). Pruners that remove weights cannot: they leave
        ``can_view_dense`` False and the run keeps a copy instead."""
        raise RuntimeError(f"{type(self).__name__} cannot show the dense model (can_view_dense is False): keep a copy")

    def training_scope(self, model: nn.Module, config: PluginConfig) -> contextlib.AbstractContextManager:
        """The context a training stage trains ``model`` in: its config ``config`` holds the fields of
        ``TrainingOptions`` (with the stage's own), which this reads, or only the stage's own (built by hand in
        library use: the options' defaults); whatever it sets up is undone at its exit. Default: nothing."""
        return contextlib.nullcontext()

    # -- the pipeline contract (a recipe's ``steps``: compresskit.pipeline) -----------------------
    @classmethod
    def followed_by_problem(cls, later: type[Pruner]) -> str | None:
        """Before any model loads: why a step of ``later`` cannot prune the model a step of this pruner leaves
        (words for the recipe's author, this pruner the subject: "leaves ..."), or None where it can. Default: a
        plain, smaller transformers model (``saves_full_model``) can be pruned further; a model that keeps this
        pruner's modules on the weights it was given cannot (it ends the pipeline)."""
        if cls.saves_full_model:
            return None
        return "leaves its own modules on the model's projections, which a later step cannot prune; put it last"

    @classmethod
    def follows_problem(cls, earlier: type[Pruner]) -> str | None:
        """Before any model loads: why this pruner cannot prune the model a step of ``earlier`` leaves (this pruner
        the subject: "saves ..."), or None.
        Default: a pruner that saves a plain transformers model (``saves_full_model``) prunes only a plain one
        (what a step that saves none leaves keeps that step's modules, which a plain checkpoint cannot hold)."""
        if cls.saves_full_model and not earlier.saves_full_model:
            return "saves a plain transformers model, which cannot hold the earlier step's modules; put it first"
        return None

    @classmethod
    def budget(cls, config: PluginConfig) -> float | None:
        """The fraction of the projection MACs ``config`` aims to skip, where it names one as a number (a pipeline
        reads each step's as its share of the original model's MACs), else None. Default: ``target_sparsity``."""
        value = getattr(config, "target_sparsity", None)
        return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None

    @classmethod
    def with_budget(cls, config: PluginConfig, fraction: float) -> PluginConfig:
        """``config`` aimed at skipping ``fraction`` of the MACs of the model it is given (a later step of a
        pipeline, whose share of the original model is a larger share of what the earlier steps left).
        Default: ``target_sparsity`` set to ``fraction`` (validated: a ``ValidationError`` where it is out of range)."""
        return type(config).model_validate({**config.model_dump(), "target_sparsity": fraction})

    @classmethod
    def trained_options(cls, recipe: dict[str, Any]) -> dict[str, Any]:
        """The settings of the ``runtime_executor``'s config (its fields, as a recipe's executor section gives
        them) under which a model trained by ``recipe`` (a resolved recipe's dict) runs as its training ran it,
        where its training options changed that; evaluated without them, the run is told so. Default: none."""
        return {}

    def regularization(self, model: nn.Module) -> torch.Tensor | None:
        """A loss term added to the LM loss during training (e.g. a sparsity budget). Default: none."""
        return None

    def on_train_step(self, step: int, total_steps: int) -> dict[str, float]:
        """Called by a training stage before each optimiser step (schedules such as a temperature
        anneal). Returns values worth logging. Default: nothing."""
        return {}

    def train_metrics(self, model: nn.Module) -> dict[str, float | torch.Tensor]:
        """Values worth logging after a training step (e.g. the realised sparsity of the batch): floats,
        or 0-d tensors, which the trainer reads back from the device with the other logs of a few
        steps at once (a float read on the device makes the host wait for it)."""
        return {}

    def reset_sparsity(self, model: nn.Module) -> None:  # noqa: B027 - optional hook
        """Start measuring the realised sparsity afresh (dynamic methods)."""

    def sparsity(self, model: nn.Module) -> Any:  # a compresskit.sparsity.SparsityReport, or None
        """The realised sparsity since the last :meth:`reset_sparsity`. None means *not measured*:
        results then say so (``sparsity: null``), never 0. A pruner that skips nothing returns a
        report with nothing skipped."""
        return None

    def sparsity_of(self, model: nn.Module, counted: Any) -> Any:
        """The realised sparsity of ``model`` where the runtime's blocks counted what they skipped (``counted``, a
        sparsity report of ``model``'s layers) instead of the pruner's modules. Default: that count (a pipeline
        puts it beside what its earlier steps removed)."""
        return counted

    def summary(self, model: nn.Module) -> PruneSummary:
        n = sum(p.numel() for p in model.parameters())
        return PruneSummary(method=type(self).__name__, targeted=[], params_before=n, params_after=n)

    # Optional: ``speed_shape(self, model, ctx, profile) -> nn.Module`` gives ``model``, random weights of a
    # known configuration (``compresskit bench --shape``), the structure a run of this method realised, for a
    # speed-only benchmark; ``profile`` (a ``compresskit.sparsity.SparsityProfile``) is what that run skipped,
    # overall and per layer, on a model that may have another size. It returns the model to time, finalized,
    # so that ``compresskit.runtime.runtime_for(model, self)`` runs it. ``RoutedPruner`` and the static
    # baselines' base define it; a method that leaves it None has no speed shape.
    speed_shape: ClassVar[Any] = None

    @classmethod
    def has_speed_shape(cls) -> bool:
        """Whether the method defines ``speed_shape``: ``compresskit bench --shape`` can time it."""
        return callable(cls.speed_shape)


class Trainer(abc.ABC):
    """A training stage: optimises what the pruner hands it, on the LM loss plus the pruner's
    regularisation. A recipe may chain several stages.

    The trainer never reaches into a pruner's modules: it gets parameters from
    ``pruner.trainable_parameters``, the extra loss from ``pruner.regularization`` and calls
    ``pruner.on_train_step`` for schedules.
    """

    Config: ClassVar[type[PluginConfig]] = PluginConfig
    # trains a model sharded over several ranks (``ctx.ranks``): its ``fit`` splits the micro-batches
    # and leaves ``finish`` to the run, and ``setup(model, pruner, ctx)`` rebuilds its structure
    shardable: ClassVar[bool] = False
    # trains the model's own weights, so that they no longer show the dense model: a stage that distils during
    # or after it gets a kept copy of the dense model as its teacher (distill.keeps_teacher_copy)
    changes_weights: ClassVar[bool] = False
    # trains the model with the recipe's pruner: its config also takes the pruner's ``TrainingOptions``, and its
    # ``fit`` trains inside ``pruner.training_scope(model, self.config)``
    takes_pruner_options: ClassVar[bool] = False

    def __init__(self, config: PluginConfig | None = None) -> None:
        self.config = config if config is not None else self.Config()

    @abc.abstractmethod
    def fit(self, model: nn.Module, pruner: Pruner | None, data: Any, ctx: RunContext) -> TrainSummary:
        """Train in place and report."""

    @classmethod
    def pruner_problem(cls, pruner_cls: type | None) -> str | None:
        """Before any model loads: why this stage cannot train with a pruner of class ``pruner_cls`` (None: the
        recipe has no pruner), in words for the recipe's author, or None when it can."""
        return None

    @classmethod
    def followed_problem(cls, config: PluginConfig) -> str | None:
        """Before any model loads: why a later step of a pipeline cannot prune the model a stage of this trainer
        (configured ``config``) leaves, or None where it can. Default: None (it leaves the model's modules as they
        were)."""
        return None

    def setup(self, model: nn.Module, pruner: Pruner | None, ctx: RunContext) -> list[nn.Parameter]:
        """Add what this stage trains to ``model`` (e.g. adapters) and return the parameters it trains."""
        return []

    def prepare_for_sharding(self, model: nn.Module, pruner: Pruner | None, ctx: RunContext) -> None:  # noqa: B027
        """Before a model is sharded (all stages, before the first trains): add, switched off, what
        ``setup`` would add, since a sharded model takes no new parameters."""

    def finish(self, model: nn.Module, pruner: Pruner | None, ctx: RunContext) -> None:  # noqa: B027
        """Called after the last step (e.g. merge adapters)."""


class NoopTrainer(Trainer):
    """The ``none`` training stage: trains nothing (one-shot methods)."""

    shardable = True

    def fit(self, model: nn.Module, pruner: Pruner | None, data: Any, ctx: RunContext) -> TrainSummary:
        return TrainSummary(stage="none")


class Executor(abc.ABC):
    """Turns a finalized model into the form that runs fast on this machine."""

    Config: ClassVar[type[PluginConfig]] = PluginConfig

    def __init__(self, config: PluginConfig | None = None) -> None:
        self.config = config if config is not None else self.Config()

    def check(self, model: nn.Module) -> None:  # noqa: B027 - optional hook
        """Raise :class:`compresskit.errors.KernelUnavailableError` with the reason when this
        executor cannot run ``model`` here (no CUDA, no Triton, unsupported dtype or shape)."""

    @abc.abstractmethod
    def convert(self, model: nn.Module) -> nn.Module:
        """Cheap structural runtime swap; returns the model to evaluate."""

    def runtime_blocks(self, model: nn.Module, head_dim: int) -> list[tuple[nn.Module | None, nn.Module | None]] | None:
        """The ``(attention, mlp)`` blocks the inference runtime (``compresskit.runtime``) runs each
        decoder layer of ``model`` with, one pair a layer in order; None for a block (or for the whole
        list) to take the runtime's dense block. A block keeps the contract of
        ``compresskit.runtime.blocks.Block``: ``block(x, delta, carry, step, *cache) -> (x + delta, out,
        carry)``, reading the residual stream ``x: [B, T, hidden]`` with the previous block's output
        ``delta`` still to add, and what the block before handed on (``carry``, or None); every
        decision is a tensor made in the forward (so the block compiles and replays in a CUDA graph).
        All blocks come at once so that a plugin may link its own blocks to each other (what one
        carries to the next). Blocks that count what they skip expose ``stat_tokens`` /
        ``stat_skipped`` (``compresskit.routing.Counting``)."""
        return None
