"""Generic training stages, shared by every pruner (no plugin imports another).

* ``router``: optimises what the pruner hands over (``pruner.trainable_parameters``, e.g. a routing
  pruner's routers) on the next-token LM loss plus ``pruner.regularization``; the backbone is frozen but
  gradients flow through it.
* ``router-fit``: fits a routing pruner's routers to the groups the dense model's own activations rank
  lowest, within the pruner's budget (a few dense forward passes, no backward pass through the model): a
  warm start that makes a short recovery stage enough.
* ``lora``: adds LoRA adapters (peft) to the model's projections and trains them together with
  the pruner's parameters (a recovery stage). ``merge: true`` folds them into the weights at the
  end of the stage.

Either may also distill the dense model (``distill:``, :mod:`compresskit.distill`). Both run on
CPU or GPU (bf16 autocast on GPU), report progress (loss, realised sparsity,
tokens/s), checkpoint every ``checkpoint_every`` steps into the run's staging directory and
resume from there after an interruption, seeing the same data and random numbers as an
uninterrupted run.

Sample YAML::

    training:
      - {name: router-fit, config: {tokens: 8192}}      # or, trained on the LM loss:
      - {name: router, config: {steps: 200, batch_size: 4, seq_len: 512, lr: 2.0e-3}}
      - {name: lora, config: {steps: 200, lr: 2.0e-4, r: 16, alpha: 32}}
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import time
from pathlib import Path
from typing import Any

import torch
from pydantic import Field, model_validator
from torch import nn

from compresskit import crashpoints, distributed, files, plugins
from compresskit.data import DataModule
from compresskit.distill import DistillConfig, kl_loss, kl_loss_on, read_teacher_cache, teacher_logits
from compresskit.errors import ArtifactError, RecipeError
from compresskit.interfaces import PluginConfig, Pruner, RunContext, Trainer, TrainSummary
from compresskit.interrupts import deferred
from compresskit.modeling import memory_kind, merge_lora, peak_memory, reset_peak_memory
from compresskit.routing import fit_routers
from compresskit.seeding import phase_seed, seed_everything
from compresskit.tokens import token_mask

# Imported inside the functions that use them: peft and transformers; so importing this module, and running the
# commands that do not need them (`--help` and `validate` first), stays fast.

CHECKPOINT = "checkpoint.pt"
CHECKPOINT_DIR = "checkpoint"  # a sharded checkpoint (torch.distributed.checkpoint), with several ranks
HISTORY_POINTS = 1000  # entries of a stage's loss history kept in results.json (evenly spaced)
# steps whose logged values stay on the device and are read back together: one wait for the device per this
# many steps instead of several per micro-batch, so that the host queues the next step's work while the GPU runs
LOG_EVERY = 10


class TrainStageConfig(PluginConfig):
    steps: int = Field(200, ge=1, description="Optimiser steps.")
    batch_size: int = Field(4, ge=1, description="Sequences per micro-batch.")
    grad_accum: int = Field(1, ge=1, description="Micro-batches per optimiser step.")
    seq_len: int = Field(512, ge=8, description="Tokens per training sequence (packed, no padding).")
    lr: float = Field(2e-3, gt=0.0, description="Peak learning rate (AdamW).")
    min_lr: float = Field(0.0, ge=0.0, description="Learning rate at the end of the cosine decay.")
    warmup_ratio: float = Field(0.1, ge=0.0, lt=1.0, description="Share of steps with linear warm-up.")
    weight_decay: float = Field(0.01, ge=0.0)
    grad_clip: float | None = Field(1.0, gt=0.0, description="Max gradient norm (None: no clipping).")
    autocast_bf16: bool = Field(True, description="bf16 autocast on a GPU (ignored on the CPU).")
    checkpoint_every: int = Field(50, ge=1, description="Steps between resumable checkpoints.")
    seed: int | None = Field(
        None,
        description="Seed of this stage's initialisation, data order and noise (None: derived from the recipe's "
        "seed and the stage's place and name).",
    )
    distill: DistillConfig | None = Field(
        None, description="Also learn the dense model's next-token distributions (KL; see compresskit.distill)."
    )

    @model_validator(mode="after")
    def _lr_range(self):
        if self.min_lr > self.lr:
            raise ValueError(f"min_lr ({self.min_lr}) must not exceed lr ({self.lr})")
        return self


def lr_schedule(optimizer: torch.optim.Optimizer, config: TrainStageConfig) -> torch.optim.lr_scheduler.LambdaLR:
    """Linear warm-up over ``int(steps * warmup_ratio)`` steps, then a cosine decay to ``min_lr``
    (transformers' ``get_cosine_with_min_lr_schedule_with_warmup``)."""
    from transformers import get_cosine_with_min_lr_schedule_with_warmup

    return get_cosine_with_min_lr_schedule_with_warmup(
        optimizer,
        num_warmup_steps=int(config.steps * config.warmup_ratio),
        num_training_steps=config.steps,
        min_lr_rate=config.min_lr / config.lr,
    )


def even_subsample(items: list, n: int) -> list:
    """At most ``n`` items, evenly spaced, the first and the last included."""
    if len(items) <= n:
        return list(items)
    if n == 1:
        return [items[-1]]
    return [items[round(i * (len(items) - 1) / (n - 1))] for i in range(n)]


class RouterTrainer(Trainer):
    """``router``: train the pruner's own parameters (routers) on LM loss + its regularisation."""

    Config = TrainStageConfig
    stage_name = "router"
    shardable = True
    takes_pruner_options = True

    # -- what is trained ----------------------------------------------------------------------
    def setup(self, model: nn.Module, pruner: Pruner | None, ctx: RunContext) -> list[nn.Parameter]:
        if pruner is None:
            raise RecipeError(
                f"training: the {self.stage_name!r} stage trains a pruner's parameters; the recipe has no pruner"
            )
        params = pruner.trainable_parameters(model)
        if not params:
            raise RecipeError(
                f"training: pruner {type(pruner).__name__} hands no trainable parameters "
                f"to the {self.stage_name!r} stage"
            )
        return params

    # -- the loop ------------------------------------------------------------------------------
    def fit(self, model: nn.Module, pruner: Pruner | None, data: DataModule, ctx: RunContext) -> TrainSummary:
        """Train in place inside the pruner's ``training_scope`` (what the recipe's pruner options set up)."""
        with pruner.training_scope(model, self.config) if pruner is not None else contextlib.nullcontext():
            return self._fit(model, pruner, data, ctx)

    def _fit(self, model: nn.Module, pruner: Pruner | None, data: DataModule, ctx: RunContext) -> TrainSummary:
        c = self.config
        seed = ctx.seed if c.seed is None else c.seed
        seed_everything(seed)  # before setup: LoRA's initialisation is drawn there
        loop = self._open_loop(model, pruner, ctx)
        reset_peak_memory(loop.device)
        per_step = c.grad_accum * loop.world  # micro-batches of one optimiser step, over all ranks
        batches = data.training_batches(c.seq_len, c.batch_size, seed=seed, start_step=loop.start * per_step)
        loop.t0 = time.perf_counter()  # (the stage's seconds count its steps, not its setup)
        progress = ctx.progress
        model.train()
        task_cm = progress.task(f"training: {self.stage_name}", total=c.steps) if progress else contextlib.nullcontext()
        try:
            with task_cm as task:
                if task is not None and loop.start:
                    task.advance(loop.start)
                for step in range(loop.start, c.steps if not loop.done else loop.start):
                    logs = dict(pruner.on_train_step(step, c.steps)) if pruner is not None else {}
                    loop.optimizer.zero_grad(set_to_none=True)
                    total_loss = 0.0
                    for k in range(per_step):  # this rank's micro-batches: k = rank, rank + world, ...
                        batch = next(batches)
                        if k % loop.world != loop.rank:
                            continue
                        loop.tokens += int(batch.attention_mask.sum())  # (counted on the host, before the copy)
                        # each micro-batch's own noise (Gumbel, dropout): the same whatever the rank count
                        seed_everything(phase_seed(seed, f"step {step} micro-batch {k}"))
                        loss = self._micro_batch_loss(
                            model, pruner, batch.to(loop.device), ctx, step * per_step + k, logs
                        )
                        (loss / c.grad_accum).backward()
                        total_loss = total_loss + loss.detach() / c.grad_accum
                    if loop.ranks is not None:  # the step's loss over all ranks (each rank's is a mean of its share)
                        total_loss = distributed.mean(float(total_loss))
                    with deferred():  # a signal waits until the step and its bookkeeping are whole
                        self._end_step(model, pruner, loop, step, total_loss, logs)
                    crashpoints.point(f"{self.stage_name} step {loop.completed} of {c.steps}: finished")
                    if task is not None:
                        task.advance(1)
                        if not loop.pending and loop.history:  # just read back: show the latest step's values
                            task.update(**loop.shown())
        except KeyboardInterrupt:  # Ctrl-C or SIGTERM: keep every finished step for the resumed run
            # (one process only: with several ranks the periodic checkpoints are what a resumed run finds)
            loop.read_back(self.stage_name)
            if loop.ckpt is not None and loop.completed > loop.saved and loop.ranks is None:
                self._save(loop, False, rng=loop.rng)
                if progress is not None:
                    progress.log(f"{self.stage_name}: interrupted; checkpoint at step {loop.completed} of {c.steps}")
            raise
        finally:
            model.eval()
        return self._close_loop(model, pruner, ctx, loop)

    def _open_loop(self, model: nn.Module, pruner: Pruner | None, ctx: RunContext) -> _Loop:
        """What the stage trains, its optimiser and schedule, and where its checkpoint left it (a resumed stage)."""
        c = self.config
        params = self.setup(model, pruner, ctx)
        trainable = {id(p) for p in params}
        for p in model.parameters():
            p.requires_grad_(id(p) in trainable)
        names = {id(p): n for n, p in model.named_parameters(remove_duplicate=False)}
        named = {names[id(p)]: p for p in params}
        optimizer = torch.optim.AdamW(params, lr=c.lr, weight_decay=c.weight_decay)
        scheduler = lr_schedule(optimizer, c)
        work = Path(ctx.work_dir) if ctx.work_dir is not None else None
        ranks = ctx.ranks  # several ranks: the model is sharded (compresskit.distributed)
        ckpt = (work / (CHECKPOINT_DIR if ranks else CHECKPOINT)) if work else None
        loop = _Loop(params, named, optimizer, scheduler, ctx.device, ranks, ckpt)
        if ckpt is not None and ckpt.exists():
            loop.start, loop.history, loop.done, loop.before = self._load_checkpoint(
                ckpt, named, optimizer, scheduler, model, ranks
            )
            if ctx.progress is not None:
                ctx.progress.log(f"{self.stage_name}: resuming at step {loop.start} of {c.steps}")
        loop.completed = loop.saved = loop.start  # steps finished, and the last step a checkpoint holds
        loop.rng = _rng_state()  # the random state at the start of step `completed`
        return loop

    def _micro_batch_loss(self, model, pruner, batch, ctx: RunContext, index: int, logs: dict) -> torch.Tensor:
        """One micro-batch's loss (``index``: its place in the stage, for a cached teacher): the LM loss, with the
        distillation term and the pruner's regularisation where they apply; its parts go into ``logs``."""
        c, device = self.config, batch.input_ids.device
        use_autocast = c.autocast_bf16 and device.type == "cuda"
        with (
            token_mask(batch.attention_mask),
            torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=use_autocast),
        ):
            out = model(input_ids=batch.input_ids, labels=batch.input_ids, use_cache=False)
            loss = out.loss
            reg = pruner.regularization(model) if pruner is not None else None
            if c.distill is not None:  # after reg: the teacher's pass changes no routing state
                d, mask = c.distill, batch.attention_mask
                if ctx.teacher_cache is not None:  # the dense model's top-k, computed before pruning
                    values, idx = read_teacher_cache(ctx.teacher_cache, index, device)
                    kl = kl_loss_on(out.logits, values, idx, mask, temperature=d.temperature)
                else:
                    target = teacher_logits(model, pruner, ctx.teacher, batch.input_ids)
                    kl = kl_loss(out.logits, target, mask, temperature=d.temperature, top_k=d.top_k)
                loss = (1.0 - d.weight) * loss + d.weight * kl
                logs["kl"] = kl.detach()
            if reg is not None:
                loss = loss + reg
        logs["lm_loss"] = out.loss.detach()
        return loss

    def _end_step(self, model, pruner, loop: _Loop, step: int, total_loss, logs: dict) -> None:
        """The optimiser's step and its bookkeeping: the logs kept, read back every few steps, and a checkpoint
        where one is due."""
        c = self.config
        if c.grad_clip is not None:
            torch.nn.utils.clip_grad_norm_(loop.params, c.grad_clip)
        loop.optimizer.step()
        loop.scheduler.step()
        if pruner is not None:
            logs.update(pruner.train_metrics(model))
        logs.update(step=step, loss=total_loss, lr=loop.scheduler.get_last_lr()[0])
        loop.pending.append(logs)
        loop.completed, loop.rng = step + 1, _rng_state()
        saving = loop.ckpt is not None and (loop.completed % c.checkpoint_every == 0 or loop.completed == c.steps)
        if saving or loop.completed % LOG_EVERY == 0 or loop.completed == c.steps:
            loop.read_back(self.stage_name)  # (a checkpoint never holds a step whose loss was not finite)
        if saving:
            if loop.ranks is not None:
                meta = self._checkpoint_meta(
                    loop.completed, loop.scheduler, loop.history, loop.completed == c.steps, loop.totals()
                )
                distributed.save_checkpoint(loop.ckpt, model, loop.optimizer, meta, loop.ranks)
            else:
                self._save(loop, loop.completed == c.steps)
            loop.saved = loop.completed

    def _save(self, loop: _Loop, last: bool, rng=None) -> None:
        """This process's checkpoint of ``loop`` at its last finished step."""
        state = (loop.named, loop.optimizer, loop.scheduler, loop.history, last, loop.totals())
        self._save_checkpoint(loop.ckpt, loop.completed, *state, rng=rng)

    def _close_loop(self, model, pruner, ctx: RunContext, loop: _Loop) -> TrainSummary:
        """The stage's summary, its parameters frozen and (one process) the stage finished."""
        c, progress = self.config, ctx.progress
        spent = loop.totals()
        if spent.peak_memory_bytes is not None and progress is not None:
            peak_gib = spent.peak_memory_bytes / 2**30
            what = memory_kind(loop.device)
            progress.log(f"{self.stage_name}: {what} {peak_gib:.2f} GiB (the dry run estimates it)")
        for p in loop.params:
            p.requires_grad_(False)
        if loop.ranks is None:  # sharded: the run finishes the stage on the rebuilt, whole model
            self.finish(model, pruner, ctx)
        return TrainSummary(
            stage=self.stage_name,
            steps=c.steps,
            tokens=spent.tokens,
            final_loss=loop.history[-1]["loss"] if loop.history else None,
            seconds=spent.seconds,
            history=even_subsample(loop.history, HISTORY_POINTS),
            peak_memory_bytes=spent.peak_memory_bytes,
        )

    def finish(self, model: nn.Module, pruner: Pruner | None, ctx: RunContext) -> None:
        """Called after the last step (LoRA merges here)."""

    # -- checkpoints ---------------------------------------------------------------------------
    def _save_checkpoint(
        self, path: Path, step, named, optimizer, scheduler, history, done, spent: Totals, rng=None
    ) -> None:
        """The stage after ``step`` finished steps, which cost ``spent``. ``rng``: the random state to
        resume from (by default the current one, which is the next step's when saved at a step's end)."""
        rng = rng or _rng_state()
        state = {
            "step": step,
            "done": done,
            "totals": dataclasses.asdict(spent),
            "params": {k: v.detach().cpu() for k, v in named.items()},
            "optimizer": optimizer.state_dict(),
            "scheduler": scheduler.state_dict(),
            "history": history,
            "rng": rng[0],
            "cuda_rng": rng[1],
            "config": self.config.model_dump(mode="json"),
        }
        tensors = [*state["params"].values(), *(v for s in state["optimizer"]["state"].values() for v in s.values())]
        what = f"the {self.stage_name} stage's checkpoint at step {step}"
        files.write_file(path, lambda tmp: torch.save(state, tmp), needed=files.tensor_bytes(tensors), what=what)

    def _checkpoint_meta(self, step, scheduler, history, done, spent: Totals) -> dict:
        return {
            "step": step,
            "done": done,
            "totals": dataclasses.asdict(spent),
            "scheduler": scheduler.state_dict(),
            "history": history,
            "config": self.config.model_dump(mode="json"),
        }

    def _load_checkpoint(self, path: Path, named, optimizer, scheduler, model=None, ranks=None):
        if ranks is not None:
            meta = distributed.load_checkpoint(path, model, optimizer, ranks)
            if meta.get("config") != self.config.model_dump(mode="json"):
                raise ArtifactError(
                    f"{path}: checkpoint of a different {self.stage_name!r} configuration; delete it to restart"
                )
            scheduler.load_state_dict(meta["scheduler"])
            return meta["step"], meta["history"], meta["done"], Totals(**meta.get("totals", {}))
        try:
            state = torch.load(path, map_location="cpu", weights_only=False)
        except Exception as exc:  # a torn or foreign file: say which and why
            raise ArtifactError(
                f"{path}: corrupt training checkpoint ({type(exc).__name__}: {exc}); delete it to restart"
            ) from None
        if state.get("config") != self.config.model_dump(mode="json"):
            raise ArtifactError(
                f"{path}: checkpoint of a different {self.stage_name!r} configuration; delete it to restart"
            )
        missing = sorted(set(named) - set(state["params"]))
        unexpected = sorted(set(state["params"]) - set(named))
        if missing or unexpected:
            raise ArtifactError(
                f"{path}: checkpoint does not match the model: missing {missing[:2]} ({len(missing)}), "
                f"unexpected {unexpected[:2]} ({len(unexpected)})"
            )
        with torch.no_grad():
            for k, p in named.items():
                p.copy_(state["params"][k].to(p.device, p.dtype))
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        torch.set_rng_state(state["rng"])
        if state.get("cuda_rng") is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(state["cuda_rng"])
        return state["step"], state["history"], state["done"], Totals(**state.get("totals", {}))


@dataclasses.dataclass(frozen=True)
class Totals:
    """What a training stage has cost so far, kept in its checkpoints so that a resumed stage reports
    the whole stage: tokens trained on (over all ranks), seconds of training, peak GPU memory (bytes;
    None off the GPU). A checkpoint written before these were kept reads as zero."""

    tokens: int = 0
    seconds: float = 0.0
    peak_memory_bytes: int | None = None

    def plus(self, tokens: int, seconds: float, peak: int | None) -> Totals:
        peaks = [p for p in (self.peak_memory_bytes, peak) if p is not None]
        return Totals(self.tokens + tokens, self.seconds + seconds, max(peaks) if peaks else None)


@dataclasses.dataclass
class _Loop:
    """A training stage's loop between its steps: what it trains and with what, where it checkpoints, how far it
    got (``start``: where it resumed; ``completed``: steps finished; ``saved``: the last a checkpoint holds; ``rng``:
    the random state at the start of step ``completed``), what it logged (``pending``: the steps not yet read back
    from the device) and what it cost (``before``: the steps before a resume)."""

    params: list
    named: dict
    optimizer: Any
    scheduler: Any
    device: torch.device
    ranks: Any
    ckpt: Path | None
    start: int = 0
    done: bool = False
    history: list = dataclasses.field(default_factory=list)
    pending: list = dataclasses.field(default_factory=list)
    before: Totals = dataclasses.field(default_factory=lambda: Totals())
    tokens: int = 0
    t0: float = dataclasses.field(default_factory=time.perf_counter)
    completed: int = 0
    saved: int = 0
    rng: Any = None

    @property
    def world(self) -> int:
        return self.ranks.world if self.ranks is not None else 1

    @property
    def rank(self) -> int:
        return self.ranks.rank if self.ranks is not None else 0

    def totals(self) -> Totals:
        """The stage's cost so far, the steps before a resume included (with several ranks, summed / maximised
        over them: every rank must call it)."""
        peak, spent = peak_memory(self.device), self.tokens
        if self.ranks is not None:
            spent = round(distributed.mean(self.tokens) * self.world)
            peak = distributed.maximum(peak) if peak is not None else None
        return self.before.plus(spent, time.perf_counter() - self.t0, peak)

    def read_back(self, stage: str) -> None:
        """The pending steps' logs into ``history`` as floats (one transfer), and a non-finite loss an error naming
        its step."""
        tensors = [v for logs in self.pending for v in logs.values() if isinstance(v, torch.Tensor)]
        stacked = torch.stack([t.detach().float().reshape(()).to(self.device) for t in tensors]) if tensors else None
        values = iter(stacked.tolist() if stacked is not None else [])
        for logs in self.pending:
            row = {k: next(values) if isinstance(v, torch.Tensor) else float(v) for k, v in logs.items()}
            if not math.isfinite(row["loss"]):
                raise FloatingPointError(f"{stage}: loss became {row['loss']} at step {int(row['step'])}")
            self.history.append(row)
        self.pending.clear()

    def shown(self) -> dict:
        """What the progress bar shows of the latest step read back."""
        last = self.history[-1]
        shown = {k: last[k] for k in ("loss", "lm_loss", "kl") if k in last}
        shown.update({k: v for k, v in last.items() if k.startswith("sparsity")})
        shown["tok/s"] = int(self.tokens / max(1e-9, time.perf_counter() - self.t0))
        return shown


def _rng_state() -> tuple[torch.Tensor, list[torch.Tensor] | None]:
    return torch.get_rng_state(), torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None


# router fit: a warm start from the dense model's own activations


class RouterFitStageConfig(PluginConfig):
    tokens: int = Field(8192, ge=64, description="Training-text tokens the dense model is run on (the fit's data).")
    seq_len: int = Field(256, ge=8, description="Tokens per sequence of that text.")
    batch_size: int = Field(4, ge=1, description="Sequences per dense forward pass.")
    steps: int = Field(200, ge=1, description="Optimiser steps of each router's fit (Adam, no model pass).")
    lr: float = Field(1e-2, gt=0.0, description="Learning rate of the fit.")
    seed: int | None = Field(None, description="Seed of the text's choice and the fit; default: the run's.")


class RouterFitTrainer(Trainer):
    """``router-fit``: each router learns to skip, per token, the groups whose output matters least to the dense
    model (:func:`compresskit.routing.fit_routers`), within the pruner's budget. A few dense forward passes and a
    small fit a router, no backward pass through the model: minutes on a CPU where the LM-loss ``router`` stage
    needs hours to get as far. Follow it with ``lora`` (or ``router``) to recover what the skipped groups cost."""

    Config = RouterFitStageConfig
    stage_name = "router-fit"

    @classmethod
    def pruner_problem(cls, pruner_cls: type | None) -> str | None:
        if pruner_cls is not None and callable(getattr(pruner_cls, "skip_budget", None)):
            return None
        what = f"pruner {pruner_cls.__name__}" if pruner_cls is not None else "the recipe has no pruner, so it"
        routing = plugins.names_where("pruner", lambda cls: callable(getattr(cls, "skip_budget", None)))
        return (
            f"the 'router-fit' stage fits a routing pruner's routers to its budget; {what} has none "
            f"(routing pruners installed: {', '.join(routing) or 'none'})"
        )

    def fit(self, model: nn.Module, pruner: Pruner | None, data: DataModule, ctx: RunContext) -> TrainSummary:
        c = self.config
        problem = self.pruner_problem(type(pruner) if pruner is not None else None)
        if problem:
            raise RecipeError(f"training: {problem}")
        budget = pruner.skip_budget
        seed = ctx.seed if c.seed is None else c.seed
        seed_everything(seed)
        n = max(1, c.tokens // c.seq_len)
        batches = [b.to(ctx.device) for b in data.calibration_batches(n, c.seq_len, c.batch_size, seed=seed)]
        t0 = time.perf_counter()
        reset_peak_memory(ctx.device)
        task_cm = ctx.progress.task("training: router-fit") if ctx.progress else contextlib.nullcontext()
        with task_cm:
            measures = fit_routers(
                model,
                batches,
                budget(),
                total_macs=pruner.total_macs,
                steps=c.steps,
                lr=c.lr,
                seed=seed,
            )
        crashpoints.point("router-fit: finished")
        if ctx.progress is not None:
            ctx.progress.log(
                f"router-fit: {measures['tokens']} tokens; the routers agree with the dense model's ranking on "
                f"{measures['agreement']:.1%} of the decisions and skip {measures['fit_macs']:.1%} of the MACs there"
            )
        model.eval()
        return TrainSummary(
            stage=self.stage_name,
            steps=c.steps,
            tokens=measures["tokens"],
            seconds=time.perf_counter() - t0,
            history=[{"step": c.steps, **{k: float(v) for k, v in measures.items()}}],
            peak_memory_bytes=peak_memory(ctx.device),
        )


# ---------------------------------------------------------------------------------------------
# LoRA recovery


LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


class RecoveryStageConfig(TrainStageConfig):
    """What the recovery stages (``lora``, ``finetune``) share: whether the pruner's parameters train with them."""

    train_pruner_params: bool = Field(
        True,
        description="Also train the pruner's parameters (e.g. routers). false: they stay as they are; the pruner's "
        "regularisation stays in the loss, and holds the sparsity through what the routers read (without it the "
        "stage's weights learn to make frozen routers run more groups).",
    )


class LoraStageConfig(RecoveryStageConfig):
    lr: float = Field(2e-4, gt=0.0, description="Peak learning rate (AdamW).")
    r: int = Field(16, ge=1, description="LoRA rank.")
    alpha: float = Field(32.0, gt=0.0, description="LoRA alpha (scale alpha / r).")
    dropout: float = Field(0.1, ge=0.0, lt=1.0)
    target_modules: list[str] = Field(default_factory=lambda: list(LORA_TARGETS))
    merge: bool = Field(False, description="Fold the adapters into the weights at the end of the stage.")


def projection_names(model: nn.Module, targets: list[str], stage: str = "lora") -> list[str]:
    """FQNs of the ``nn.Linear`` modules for each target name: ``<...>.<target>`` itself, or
    ``<...>.<target>.base_layer`` where a pruner wrapped it (what a ``stage``'s ``target_modules`` name)."""
    hits = []
    for name, module in model.named_modules():
        if not isinstance(module, nn.Linear):
            continue
        parts = name.split(".")
        if parts[-1] in targets or (parts[-1] == "base_layer" and len(parts) > 1 and parts[-2] in targets):
            hits.append(name)
    if not hits:
        raise RecipeError(f"training: {stage} target_modules {targets} matched no linear layer of the model")
    return hits


class LoraTrainer(RouterTrainer):
    """``lora``: LoRA adapters (peft) on the projections, trained with the pruner's parameters."""

    Config = LoraStageConfig
    stage_name = "lora"

    def setup(self, model: nn.Module, pruner: Pruner | None, ctx: RunContext) -> list[nn.Parameter]:
        if not lora_parameters(model):  # (added already, inactive, before the model was sharded)
            inject_lora(model, self.config)
        _enable_adapters(model, True)
        params = lora_parameters(model)
        if pruner is not None and self.config.train_pruner_params:
            params += pruner.trainable_parameters(model)
        return params

    @classmethod
    def followed_problem(cls, config) -> str | None:
        if config.merge:
            return None
        return "merge: false leaves LoRA adapters on the projections, which a later step cannot prune; set merge: true"

    def prepare_for_sharding(self, model: nn.Module, pruner: Pruner | None, ctx: RunContext) -> None:
        """The adapters, drawn as this stage draws them, switched off until the stage starts (so that
        the earlier stages compute what they compute in one process)."""
        seed_everything(ctx.seed if self.config.seed is None else self.config.seed)
        inject_lora(model, self.config)
        _enable_adapters(model, False)

    def finish(self, model: nn.Module, pruner: Pruner | None, ctx: RunContext) -> None:
        if self.config.merge:
            merge_lora(model)
            model.__dict__.pop("peft_config", None)  # (no adapter left: a later stage's start afresh)

    def state_dict(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """What a saved model needs to reproduce this stage: the adapter tensors (peft's
        ``get_peft_model_state_dict``), or after a merge, the merged weights of the adapted layers."""
        if self.config.merge:
            return projection_weights(model, self.config.target_modules, "merged", "lora")
        from peft import get_peft_model_state_dict

        return {k: v.detach().cpu() for k, v in get_peft_model_state_dict(model).items()}

    def restore(self, model: nn.Module, state: dict[str, torch.Tensor]) -> None:
        """Re-apply a saved stage to a freshly prepared model."""
        if self.config.merge:
            load_projection_weights(model, self.config.target_modules, state, "merged", "lora")
            return
        from peft import get_peft_model_state_dict, set_peft_model_state_dict

        inject_lora(model, self.config)
        # files written before the adapter name was left out of the keys carry ".default."
        state = {k.replace(".default.", "."): v for k, v in state.items()}
        _check_keys(set(get_peft_model_state_dict(model)), state)
        set_peft_model_state_dict(model, state)


class FinetuneStageConfig(RecoveryStageConfig):
    lr: float = Field(2e-5, gt=0.0, description="Peak learning rate (AdamW).")
    target_modules: list[str] = Field(
        default_factory=lambda: list(LORA_TARGETS), description="Projections whose weights are trained in full."
    )


class FinetuneTrainer(RouterTrainer):
    """``finetune``: the projections' own weights trained in full (with the pruner's parameters), where a
    LoRA adapter's rank limits what recovery can reach. On a GPU under bf16 autocast the trained weights
    are held in fp32 during the stage (AdamW's updates would vanish in bf16) and go back to the model's
    dtype at its end. A distilling stage then needs the dense model as a kept copy (``changes_weights``):
    the model's own weights are no longer the dense ones."""

    Config = FinetuneStageConfig
    stage_name = "finetune"
    shardable = False
    changes_weights = True

    def setup(self, model: nn.Module, pruner: Pruner | None, ctx: RunContext) -> list[nn.Parameter]:
        c = self.config
        names = projection_names(model, c.target_modules, "finetune")
        master = c.autocast_bf16 and ctx.device.type == "cuda"  # (without autocast the inputs keep the dtype)
        self._dtypes = {}
        params = []
        for name in names:
            w = model.get_submodule(name).weight
            self._dtypes[name] = w.dtype
            if master and w.dtype != torch.float32:
                w.data = w.data.float()
            params.append(w)
        if pruner is not None and c.train_pruner_params:
            params += pruner.trainable_parameters(model)
        return params

    def finish(self, model: nn.Module, pruner: Pruner | None, ctx: RunContext) -> None:
        for name, dtype in self._dtypes.items():
            w = model.get_submodule(name).weight
            w.data = w.data.to(dtype)

    def state_dict(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """The trained projections' weights, as LoRA's merged ones are saved."""
        return projection_weights(model, self.config.target_modules, "finetuned", "finetune")

    def restore(self, model: nn.Module, state: dict[str, torch.Tensor]) -> None:
        load_projection_weights(model, self.config.target_modules, state, "finetuned", "finetune")


def projection_weights(model: nn.Module, targets: list[str], prefix: str, stage: str) -> dict[str, torch.Tensor]:
    """The weights of the projections ``targets`` name, on the CPU, as ``<prefix>.<module>.weight``."""
    names = projection_names(model, targets, stage)
    return {f"{prefix}.{n}.weight": model.get_submodule(n).weight.detach().cpu() for n in names}


def load_projection_weights(
    model: nn.Module, targets: list[str], state: dict[str, torch.Tensor], prefix: str, stage: str
) -> None:
    """Copy what :func:`projection_weights` saved into the model (its keys checked first)."""
    names = projection_names(model, targets, stage)
    _check_keys({f"{prefix}.{n}.weight" for n in names}, state, stage)
    with torch.no_grad():
        for key, value in state.items():
            w = model.get_submodule(key[len(prefix) + 1 : -len(".weight")]).weight
            w.copy_(value.to(w.device, w.dtype))


def _check_keys(expected: set[str], state: dict[str, torch.Tensor], stage: str = "lora") -> None:
    missing, unexpected = sorted(expected - set(state)), sorted(set(state) - expected)
    if missing or unexpected:
        raise ArtifactError(
            f"{stage}: saved tensors do not match the model: missing {missing[:2]} ({len(missing)}), "
            f"unexpected {unexpected[:2]} ({len(unexpected)})"
        )


def lora_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The adapter parameters of every LoRA layer in ``model``."""
    from peft.tuners.lora import LoraLayer

    return [
        p
        for m in model.modules()
        if isinstance(m, LoraLayer)
        for name in LoraLayer.adapter_layer_names
        for p in getattr(m, name).parameters()
    ]


def inject_lora(model: nn.Module, config: LoraStageConfig) -> None:
    from peft import LoraConfig, inject_adapter_in_model

    names = projection_names(model, config.target_modules)
    lora = LoraConfig(
        r=config.r, lora_alpha=config.alpha, lora_dropout=config.dropout, bias="none", target_modules=names
    )
    inject_adapter_in_model(lora, model)
    for p in lora_parameters(model):
        p.data = p.data.float()  # fp32 adapters whatever the model dtype


def _enable_adapters(model: nn.Module, enabled: bool) -> None:
    from peft.tuners.lora import LoraLayer

    for module in model.modules():
        if isinstance(module, LoraLayer):
            module.enable_adapters(enabled)
