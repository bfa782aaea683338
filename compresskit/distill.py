"""Distillation from the dense model: the training stages' optional KL term.

Sample YAML (any training stage)::

    training:
      - {name: router, config: {steps: 200, distill: {weight: 0.5, temperature: 2.0}}}
      - {name: lora, config: {steps: 200, distill: {weight: 0.5, top_k: 64}}}

The stage's loss becomes ``(1 - weight) * LM loss + weight * T^2 * KL(teacher || student)`` per
real token, at temperature ``T``, plus the pruner's regularisation. The teacher is the dense model:

* the same model with the pruner switched off, where the method allows it (``Pruner.dense_view``:
  a routing pruner runs every group then), and any LoRA adapters switched off: no second copy
  in memory;
* otherwise a copy of the model taken before the pruner changed it (``RunContext.teacher``: the
  static pruners, which remove weights).

``top_k``: both distributions are taken on the teacher's ``top_k`` most likely tokens of each
position (renormalised there), for large vocabularies. ``cache: true`` (with ``top_k``) computes the
teacher's top-k logits of every micro-batch the stage will train on once, with the dense model
before the pruner attaches, and keeps them on disk (``<cache>/teacher/<key>/``, keyed by everything
that decides them): the stage then runs no teacher pass, no copy of the dense model is kept for it,
and a rerun (another seed of the pruner, another method on the same data) reuses them.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.nn.functional as F
from pydantic import Field, model_validator
from torch import nn

from compresskit.errors import ArtifactError
from compresskit.files import tensor_bytes, write_file
from compresskit.interfaces import PluginConfig, Pruner
from compresskit.modeling import cache_dir

# Imported inside the functions that use them: peft and safetensors; so importing this module, and running the
# commands that do not need them (`--help` and `validate` first), stays fast.


class DistillConfig(PluginConfig):
    weight: float = Field(0.5, gt=0.0, le=1.0, description="Share of the KL term in the loss (1: KL only).")
    temperature: float = Field(1.0, gt=0.0, description="Softmax temperature of both distributions.")
    top_k: int | None = Field(None, ge=1, description="Keep the teacher's top-k tokens only (None: all).")
    cache: bool = Field(
        False,
        description="Compute the teacher's top-k logits of every training micro-batch once, before pruning, "
        "and keep them on disk: no teacher pass while training, no copy of the dense model. Needs top_k.",
    )

    @model_validator(mode="after")
    def _cache_needs_top_k(self) -> DistillConfig:
        if self.cache and self.top_k is None:
            raise ValueError("cache: true keeps the teacher's top-k logits: set top_k (e.g. 64)")
        return self


def kl_loss(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    mask: torch.Tensor | None = None,
    *,
    temperature: float = 1.0,
    top_k: int | None = None,
) -> torch.Tensor:
    """``T^2 * KL(teacher || student)`` of the next-token distributions ``[B, T, V]``, averaged over
    the positions where ``mask`` (``[B, T]``, 1 = real token) is set; computed in fp32."""
    if top_k is not None and top_k < teacher_logits.shape[-1]:
        values, idx = teacher_logits.topk(top_k, dim=-1)  # both distributions renormalised on the teacher's top-k
        return kl_loss_on(student_logits, values, idx, mask, temperature=temperature)
    s = student_logits.float() / temperature
    t = teacher_logits.float() / temperature
    return _kl(t, s, mask, temperature)


def kl_loss_on(
    student_logits: torch.Tensor,
    values: torch.Tensor,
    indices: torch.Tensor,
    mask: torch.Tensor | None = None,
    *,
    temperature: float = 1.0,
) -> torch.Tensor:
    """:func:`kl_loss` on the teacher's top-k tokens given as ``values, indices: [B, T, k]`` (its
    logits there and their token ids, e.g. from the cache)."""
    s = student_logits.float().gather(-1, indices.long()) / temperature
    return _kl(values.float() / temperature, s, mask, temperature)


def _kl(t: torch.Tensor, s: torch.Tensor, mask: torch.Tensor | None, temperature: float) -> torch.Tensor:
    log_p, log_q = F.log_softmax(t, dim=-1), F.log_softmax(s, dim=-1)
    per_token = (log_p.exp() * (log_p - log_q)).sum(-1)
    if mask is None:
        return per_token.mean() * temperature**2
    m = mask.to(per_token.dtype)
    return (per_token * m).sum() / m.sum().clamp_min(1.0) * temperature**2


@contextlib.contextmanager
def lora_off(model: nn.Module) -> Iterator[None]:
    """The model without its LoRA adapters (peft's layers pass their base layer's output through)."""
    try:
        from peft.tuners.lora import LoraLayer
    except ImportError:  # no peft: no adapters
        yield
        return
    layers = [m for m in model.modules() if isinstance(m, LoraLayer)]
    saved = [m._disable_adapters for m in layers]
    for m in layers:  # the flag alone: enable_adapters() would also change requires_grad
        m._disable_adapters = True
    try:
        yield
    finally:
        for m, s in zip(layers, saved, strict=True):
            m._disable_adapters = s


def needs_copy(pruner: Pruner | None) -> bool:
    """Whether a teacher must be a copy of the dense model taken before ``pruner`` prepares it."""
    return pruner is not None and not pruner.can_view_dense


def keeps_teacher_copy(stages, pruner: Pruner | None, *, steps: int = 1) -> bool:
    """Whether a run with these training stages (resolved, in order) keeps a copy of the dense model
    as its teacher: some stage distils live (not from cached logits) and either ``pruner`` (the first
    step's) cannot show the dense model (:func:`needs_copy`), or the run has several ``steps`` (a later
    step's pruner shows the model the earlier ones left), or the model's own weights moved before or
    during such a stage: a stage whose trainer ``changes_weights`` (``finetune``) up to and including
    it, or a LoRA stage that merged its adapters before it."""
    live = [getattr(s.config, "distill", None) is not None and not s.config.distill.cache for s in stages]
    if not any(live):
        return False
    if needs_copy(pruner) or steps > 1:
        return True
    moved = False
    for stage, distils in zip(stages, live, strict=True):
        moved = moved or getattr(stage.cls, "changes_weights", False)
        if moved and distils:
            return True
        moved = moved or bool(getattr(stage.config, "merge", False))
    return False


def teacher_logits(model: nn.Module, pruner: Pruner | None, teacher: nn.Module | None, input_ids: torch.Tensor):
    """The dense model's logits for ``input_ids``, without gradients: ``teacher`` (a kept copy) where
    given, else ``model`` with the pruner and any LoRA adapters switched off."""
    with torch.no_grad():
        if teacher is not None:
            return teacher(input_ids=input_ids, use_cache=False).logits
        view = pruner.dense_view(model) if pruner is not None else contextlib.nullcontext()
        with view, lora_off(model):
            return model(input_ids=input_ids, use_cache=False).logits


def teacher_cache_dir(model_key: dict, data, config, seed: int) -> Path:
    """Where the top-k logits of a stage's micro-batches live: keyed by the model (name, dtype, device
    type), the text (contents, split), the stage's batches (sequence length, batch size, seed), top-k
    and the autocast the stage computes under."""
    key_src = {
        "model": model_key,
        "data": data.fingerprint(),
        "split": [data.split_seed, data.test_fraction],
        "batches": [config.seq_len, config.batch_size, seed],
        "top_k": config.distill.top_k,
        "autocast_bf16": config.autocast_bf16,
    }
    key = hashlib.sha256(json.dumps(key_src, sort_keys=True, default=str).encode()).hexdigest()[:16]
    return cache_dir() / "teacher" / key


def write_teacher_cache(
    model: nn.Module, data, config, seed: int, micro_batches: int, directory: Path, *, rank=0, world=1, progress=None
) -> None:
    """The dense ``model``'s top-k logits of the first ``micro_batches`` micro-batches the stage of
    ``config`` draws (``data.training_batches`` with ``seed``), one file each in ``directory``
    (``mb<k>.safetensors``: ``values`` in the logits' dtype, ``indices`` int32); those already there are
    kept. With several ranks, rank ``r`` computes micro-batches ``r, r + world, ...``."""
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    device = next(model.parameters()).device
    autocast = config.autocast_bf16 and device.type == "cuda"
    batches = data.training_batches(config.seq_len, config.batch_size, seed=seed)
    todo = [k for k in range(micro_batches) if k % world == rank and not (directory / f"mb{k}.safetensors").is_file()]
    task_cm = progress.task("teacher top-k logits (cached)", total=len(todo)) if progress else contextlib.nullcontext()
    with task_cm as task, torch.no_grad():
        wanted = set(todo)
        for k in range(max(todo, default=-1) + 1):
            batch = next(batches)
            if k not in wanted:
                continue
            with torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=autocast):
                logits = model(input_ids=batch.input_ids.to(device), use_cache=False).logits
            values, idx = logits.topk(config.distill.top_k, dim=-1)
            tensors = {"values": values.contiguous().cpu(), "indices": idx.to(torch.int32).cpu()}
            write_file(
                directory / f"mb{k}.safetensors",
                lambda tmp, t=tensors: save_file(t, str(tmp)),
                needed=tensor_bytes(tensors.values()),
                what=f"the teacher's cached logits of micro-batch {k}",
            )
            if task is not None:
                task.advance(1)


def read_teacher_cache(directory: Path, k: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """``(values, indices)`` of micro-batch ``k`` from :func:`write_teacher_cache`'s ``directory``."""
    from safetensors.torch import load_file

    path = directory / f"mb{k}.safetensors"
    try:
        t = load_file(str(path), device=str(device))
    except Exception as exc:
        raise ArtifactError(
            f"{path}: unreadable cached teacher logits ({type(exc).__name__}: {exc}); delete it"
        ) from None
    return t["values"], t["indices"]
