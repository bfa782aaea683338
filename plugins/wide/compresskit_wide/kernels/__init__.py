"""Operators of the routed layers, dispatched by backend.

Only the pure-PyTorch reference (``backend="torch"``) exists so far; it is the semantics every
fast kernel must reproduce, the CPU path and the autograd path for training.
"""

from __future__ import annotations

import torch

from compresskit_wide.kernels.reference import torch_group_masked_input

BACKENDS = ("torch", "auto")


def group_masked_input(x: torch.Tensor, mask: torch.Tensor, backend: str = "auto") -> torch.Tensor:
    """Zero the inactive groups of ``x``'s last axis: ``x: [B, T, K]``, ``mask: [B, T, K/G]``."""
    if backend not in BACKENDS:
        raise ValueError(f"backend {backend!r} is not available; allowed: {', '.join(BACKENDS)}")
    return torch_group_masked_input(x, mask)
