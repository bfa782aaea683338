"""WIDE's routed layers: the core routing primitives (``compresskit.routing``) with WIDE's group
masking dispatched to its kernels (``kernels.group_masked_input``, ``backend="auto"``).

In a Llama-style decoder layer a :class:`~compresskit.routing.RouterTap` replaces
``input_layernorm`` (the attention router reads the residual entering the layer) and
``post_attention_layernorm`` (the FFN router reads the residual after the attention add); a
:class:`~compresskit.routing.RoutedProjection` replaces ``o_proj`` (zeroing the per-head attention
outputs of skipped head groups) and ``down_proj`` (zeroing the SwiGLU product of skipped channel
groups). The originals stay as ``base_layer``; :func:`unwrap` restores the dense model exactly.
"""

from __future__ import annotations

import functools

from torch import nn

from compresskit.routing import GroupRouter, RoutedProjection, RouterTap, routed_projections, unwrap
from compresskit_wide.kernels import group_masked_input

__all__ = ["RoutedProjection", "RouterTap", "routed_projections", "unwrap", "wide_projection"]


def wide_projection(
    base_layer: nn.Linear, router: GroupRouter, *, kind: str, layer_idx: int, macs_per_group: int, backend: str = "auto"
) -> RoutedProjection:
    """A routed o_proj/down_proj whose masking goes through WIDE's kernel dispatch."""
    return RoutedProjection(
        base_layer,
        router,
        kind=kind,
        layer_idx=layer_idx,
        macs_per_group=macs_per_group,
        masker=functools.partial(group_masked_input, backend=backend),
    )
