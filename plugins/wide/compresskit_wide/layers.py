"""The routed layers of WIDE, as two small wrappers that leave the transformers layer code alone.

In a Llama-style decoder layer::

    residual = h;  h = input_layernorm(h);  h = self_attn(h) ... o_proj(heads);   h = residual + h
    residual = h;  h = post_attention_layernorm(h);  h = down_proj(silu(gate(h)) * up(h));  h = residual + h

* :class:`RouterTap` replaces a norm. The norm's input is exactly the raw residual stream the
  router reads (before ``input_layernorm`` for attention, after the attention add and before
  ``post_attention_layernorm`` for the FFN); it hands it to the routed projection, then returns
  ``norm(x)`` unchanged.
* :class:`RoutedProjection` replaces ``o_proj`` (input = per-head attention outputs, heads
  contiguous) or ``down_proj`` (input = the SwiGLU product). Zeroing a group of its input is
  zeroing those heads' attention output, or those channels' SwiGLU product. K and V are never
  touched, so the KV cache stays complete and cached decoding is exact.

Both keep the original module as ``base_layer``; :func:`unwrap` restores the dense model exactly.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import nn

from compresskit.tokens import mask_for
from compresskit_wide.kernels import group_masked_input
from compresskit_wide.router import GroupRouter, decide


class RoutedProjection(nn.Module):
    """A projection whose input features form ``G`` contiguous groups, each kept or zeroed per token.

    Args:
        base_layer: the original ``nn.Linear`` (o_proj or down_proj).
        router: the :class:`GroupRouter` with ``G`` groups.
        kind: "attention" or "ffn" (for statistics).
        layer_idx: decoder layer index.
        macs_per_group: multiply-adds per token that skipping one group saves.
        block_macs: multiply-adds per token of the whole block (attention q,k,v,o or FFN gate,up,down).
    """

    def __init__(
        self,
        base_layer: nn.Linear,
        router: GroupRouter,
        *,
        kind: Literal["attention", "ffn"],
        layer_idx: int,
        macs_per_group: int,
        block_macs: int,
    ) -> None:
        super().__init__()
        if base_layer.in_features % router.groups:
            raise ValueError(f"{base_layer.in_features} input features do not split into {router.groups} groups")
        self.base_layer = base_layer
        self.router = router
        self.kind = kind
        self.layer_idx = layer_idx
        self.macs_per_group = macs_per_group
        self.block_macs = block_macs
        self.tau = 1.0
        self.deterministic = False  # True after finalize: argmax even in train mode
        self.backend = "auto"
        self._mask: torch.Tensor | None = None  # execute mask of the pass in flight, [B, T, G]
        self.last_skip: torch.Tensor | None = None  # training: skip sample with ST gradient, [B, T, G]
        self.last_valid: torch.Tensor | None = None  # training: real-token mask, [B, T]
        self.reset_stats()

    @property
    def groups(self) -> int:
        return self.router.groups

    def reset_stats(self) -> None:
        dev = self.base_layer.weight.device
        self.stat_skipped = torch.zeros((), dtype=torch.float64, device=dev)  # skipped (token, group) pairs
        self.stat_tokens = torch.zeros((), dtype=torch.float64, device=dev)  # real tokens routed
        self.stat_group_skips = torch.zeros(self.groups, dtype=torch.float64, device=dev)

    def route(self, x_raw: torch.Tensor) -> None:
        """Decide for the tokens of ``x_raw: [B, T, D]`` (the raw residual stream)."""
        logits = self.router(x_raw)  # [B, T, G, 2]
        sample = self.training and not self.deterministic
        execute = decide(logits, sample=sample, tau=self.tau)  # [B, T, G]
        valid = mask_for(x_raw)  # [B, T]
        self._mask = execute
        if self.training:
            self.last_skip, self.last_valid = 1.0 - execute, valid
        else:
            with torch.no_grad():
                skipped = (1.0 - execute.double()) * valid.double().unsqueeze(-1)  # [B, T, G]
                self.stat_skipped += skipped.sum()
                self.stat_group_skips += skipped.sum(dim=(0, 1))
                self.stat_tokens += valid.double().sum()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mask = self._mask
        if mask is None or mask.shape[:2] != x.shape[:2]:
            raise RuntimeError(
                f"layer {self.layer_idx} {self.kind}: no routing decision for this input "
                f"({None if mask is None else tuple(mask.shape)} vs {tuple(x.shape)}); the router tap did not run"
            )
        self._mask = None
        return self.base_layer(group_masked_input(x, mask, backend=self.backend))

    def extra_repr(self) -> str:
        return f"kind={self.kind}, layer={self.layer_idx}, groups={self.groups}"


class RouterTap(nn.Module):
    """Replaces a norm: routes its input (the raw residual) for ``target``, returns ``norm(x)``."""

    def __init__(self, base_layer: nn.Module, target: RoutedProjection) -> None:
        super().__init__()
        self.base_layer = base_layer
        self.__dict__["target"] = target  # a reference, not a submodule (it lives in the attention/MLP)

    def forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        self.target.route(x)
        return self.base_layer(x, *args, **kwargs)


def routed_projections(model: nn.Module) -> list[tuple[str, RoutedProjection]]:
    return [(n, m) for n, m in model.named_modules() if isinstance(m, RoutedProjection)]


def unwrap(model: nn.Module) -> nn.Module:
    """Put every original module back (the dense model, exactly)."""
    from compresskit.modeling import replace_module

    for name, module in list(model.named_modules()):
        if isinstance(module, (RoutedProjection, RouterTap)):
            replace_module(model, name, module.base_layer)
    return model
