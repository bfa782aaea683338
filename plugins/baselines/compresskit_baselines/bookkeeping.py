"""What a static pruner removed, recorded in the model's own config.

A statically pruned model is a plain transformers checkpoint. So that its realised sparsity can
be reported wherever it is loaded (``compresskit eval``, a comparison), the pruner writes the
original dimensions and what it removed into ``config.compresskit_pruning``; transformers keeps
unknown config keys through ``save_pretrained`` / ``from_pretrained``.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import torch
from torch import nn

from compresskit.errors import ArtifactError
from compresskit.interfaces import Batch, Pruner, RunContext
from compresskit.sparsity import (
    ATTENTION_PROJ,
    FFN_PROJ,
    SparsityProfile,
    SparsityReport,
    layer_linear_macs,
    macs_dims,
)

CALIBRATION_TOKENS = 64  # random tokens a speed shape is pruned on (speed_shape)


def record_pruning(config, method: str, original: dict[str, int], **info: Any) -> None:
    config.compresskit_pruning = {"method": method, "original": original, **info}


def static_report(config) -> SparsityReport | None:
    """Skipped fraction of the original model's projection MACs, per original layer."""
    info = getattr(config, "compresskit_pruning", None)
    if not info:
        return None
    orig = SimpleNamespace(**info["original"])
    rep = SparsityReport.dense(orig)
    full = layer_linear_macs(orig)
    now = layer_linear_macs(SimpleNamespace(**macs_dims(config)))
    removed = set(info.get("removed_layers", []))
    for i, layer in enumerate(rep.layers):
        for block, projs in (("attention", ATTENTION_PROJ), ("ffn", FFN_PROJ)):
            total = sum(full[p] for p in projs)
            layer[block].skipped = total if i in removed else total - sum(now[p] for p in projs)
    return rep


class StaticPruner(Pruner):
    """Base of the one-shot pruners that produce a plain, smaller transformers model: it is saved
    whole (``save_pretrained``), the pruner owns no separate tensors, and the realised sparsity is
    read from what ``record_pruning`` wrote into the model's config."""

    requires_calibration = True
    saves_full_model = True
    prunes_before_training = True  # recovery stages train the smaller model

    def state_dict(self, model: nn.Module) -> dict[str, torch.Tensor]:
        return {}

    def load_state_dict(self, model: nn.Module, state: dict[str, torch.Tensor]) -> None:
        if state:
            raise ArtifactError(f"{type(self).__name__} saves a full checkpoint and owns no separate tensors")

    def sparsity(self, model: nn.Module) -> SparsityReport | None:
        return static_report(model.config)

    def speed_shape(self, model: nn.Module, ctx: RunContext, profile: SparsityProfile) -> nn.Module:
        """The smaller model at the fraction ``profile`` removed (as near as this model's granularity
        allows), chosen on random calibration tokens: which units go does not change the speed."""
        self.config = self.with_budget(self.config, profile.macs)
        self.prepare(model, ctx)
        gen = torch.Generator().manual_seed(ctx.seed)
        ids = torch.randint(3, model.config.vocab_size, (1, CALIBRATION_TOKENS), generator=gen).to(ctx.device)
        self.calibrate(model, [Batch(ids, torch.ones_like(ids))])
        return self.finalize(model)
