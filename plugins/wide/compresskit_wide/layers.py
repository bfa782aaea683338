"""WIDE's routed layers: the core routing primitives (``compresskit.routing``) with WIDE's group
masking dispatched to its kernels (``kernels.ops.group_masked_input``, ``backend="auto"``).

In a Llama-style decoder layer a :class:`~compresskit.routing.RouterTap` replaces
``input_layernorm`` (the attention router reads the residual entering the layer) and
``post_attention_layernorm`` (the FFN router reads the residual after the attention add); a
:class:`~compresskit.routing.RoutedProjection` replaces ``o_proj`` (zeroing the per-head attention
outputs of skipped head groups) and ``down_proj`` (zeroing the SwiGLU product of skipped channel
groups). The originals stay as ``base_layer``; :func:`unwrap` restores the dense model exactly.
"""

from __future__ import annotations

import functools

from compresskit.routing import RoutedProjection, RouterTap, route_sublayer, routed_projections, unwrap
from compresskit_wide.kernels.ops import group_masked_input

__all__ = ["RoutedProjection", "RouterTap", "kernel_masker", "route_sublayer", "routed_projections", "unwrap"]


def kernel_masker(backend: str = "auto"):
    """The ``masker`` WIDE's routed projections use: group masking through the kernel dispatch."""
    return functools.partial(group_masked_input, backend=backend)
