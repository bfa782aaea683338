"""Distillation from the dense model: the training stages' optional KL term.

Sample YAML (any training stage)::

    training:
      - {name: router, config: {steps: 200, distill: {weight: 0.5, temperature: 2.0}}}
      - {name: lora, config: {steps: 200, distill: {weight: 0.5, top_k: 64}}}

The stage's loss becomes ``(1 - weight) * LM loss + weight * T^2 * KL(teacher || student)`` per
real token, at temperature ``T``, plus the pruner's regularisation. The teacher is the dense model:

* the same model with the pruner switched off, where the method allows it (``Pruner.dense_view``:
  WIDE and dynamic depth run every group then), and any LoRA adapters switched off: no second copy
  in memory;
* otherwise a copy of the model taken before the pruner changed it (``RunContext.teacher``: the
  static pruners, which remove weights).

``top_k``: both distributions are taken on the teacher's ``top_k`` most likely tokens of each
position (renormalised there), for large vocabularies.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from pydantic import Field
from torch import nn

from compresskit.interfaces import PluginConfig, Pruner


class DistillConfig(PluginConfig):
    weight: float = Field(0.5, gt=0.0, le=1.0, description="Share of the KL term in the loss (1: KL only).")
    temperature: float = Field(1.0, gt=0.0, description="Softmax temperature of both distributions.")
    top_k: int | None = Field(None, ge=1, description="Keep the teacher's top-k tokens only (None: all).")


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
    s = student_logits.float() / temperature
    t = teacher_logits.float() / temperature
    if top_k is not None and top_k < t.shape[-1]:
        t, idx = t.topk(top_k, dim=-1)  # both distributions renormalised on the teacher's top-k
        s = s.gather(-1, idx)
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


def teacher_logits(model: nn.Module, pruner: Pruner | None, teacher: nn.Module | None, input_ids: torch.Tensor):
    """The dense model's logits for ``input_ids``, without gradients: ``teacher`` (a kept copy) where
    given, else ``model`` with the pruner and any LoRA adapters switched off."""
    with torch.no_grad():
        if teacher is not None:
            return teacher(input_ids=input_ids, use_cache=False).logits
        view = pruner.dense_view(model) if pruner is not None else contextlib.nullcontext()
        with view, lora_off(model):
            return model(input_ids=input_ids, use_cache=False).logits
