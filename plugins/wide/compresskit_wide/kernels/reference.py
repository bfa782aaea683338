"""Pure-PyTorch references (masked dense): ground truth for tests, CPU path, autograd path."""

from __future__ import annotations

import torch


def torch_group_masked_input(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``x: [B, T, K]``, ``mask: [B, T, K/G]`` (1 = active; may carry straight-through gradients)
    -> ``x`` with each inactive group of G contiguous features set to exactly zero."""
    groups = mask.shape[-1]
    if x.shape[-1] % groups:
        raise ValueError(f"last axis {x.shape[-1]} is not divisible into {groups} groups")
    xg = x.unflatten(-1, (groups, x.shape[-1] // groups))  # [B, T, G, K/G]
    return (xg * mask.unsqueeze(-1).to(x.dtype)).flatten(-2)  # [B, T, K]
