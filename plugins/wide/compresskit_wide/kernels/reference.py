"""Pure-PyTorch references (masked dense): ground truth for tests, CPU path, autograd path.

The group masking semantics are the core's (``compresskit.routing.mask_input_groups``): every
fast kernel here must reproduce them.
"""

from __future__ import annotations

import torch

from compresskit.routing import mask_input_groups as torch_group_masked_input

__all__ = ["torch_group_masked_input", "zero_inactive_groups", "zero_inactive_heads"]


def zero_inactive_groups(y: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``y: [..., N]``, ``mask: [..., G]`` -> ``y`` with each inactive group of N/G outputs exactly 0.
    A select, not a product (unlike ``torch_group_masked_input`` on inputs): whatever the dense
    computation produced there, inf or NaN included, the routed operator's output is 0."""
    groups = mask.shape[-1]
    # one select over the [..., G, N/G] view, the mask broadcast along each group (no expanded copy)
    kept = torch.where(mask.bool().unsqueeze(-1), y.unflatten(-1, (groups, y.shape[-1] // groups)), 0.0)
    return kept.flatten(-2)


def zero_inactive_heads(out: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``out: [B, Hq, T, D]``, ``mask: [B, T, Hq / A]`` -> ``out`` exactly 0 for inactive (token, head)."""
    b, hq, t, d = out.shape
    rows = zero_inactive_groups(out.transpose(1, 2).reshape(b, t, hq * d), mask)  # [B, T, Hq * D]
    return rows.view(b, t, hq, d).transpose(1, 2)
