"""The WIDE router: a low-rank affine map from the raw residual stream to one
(execute, skip) logit pair per group, and the decision rule.

Pure PyTorch, no model knowledge.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class GroupRouter(nn.Module):
    """``x: [B, T, D] -> logits: [B, T, G, 2]`` (index 0 = execute, 1 = skip).

    ``Linear(D -> r)`` then ``Linear(r -> 2G)``, both with biases, no nonlinearity. Weights are
    Kaiming-uniform with the linear gain, biases zero. Parameters stay in fp32 and the router
    computes in fp32 whatever the model's dtype or autocast (the raw residual has outliers).
    """

    def __init__(self, hidden_size: int, groups: int, rank: int = 32) -> None:
        super().__init__()
        self.groups = groups
        self.down = nn.Linear(hidden_size, rank, bias=True, dtype=torch.float32)
        self.up = nn.Linear(rank, 2 * groups, bias=True, dtype=torch.float32)
        for lin in (self.down, self.up):
            nn.init.kaiming_uniform_(lin.weight, nonlinearity="linear")
            nn.init.zeros_(lin.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.autocast(device_type=x.device.type, enabled=False):
            z = self.down(x.float())  # [B, T, r]
            logits = self.up(z)  # [B, T, 2G]
        return logits.unflatten(-1, (self.groups, 2))  # [B, T, G, 2]


def decide(logits: torch.Tensor, *, sample: bool, tau: float) -> torch.Tensor:
    """Execute mask ``[B, T, G]`` from ``logits: [B, T, G, 2]``.

    sample=True (training): a hard two-way Gumbel-softmax sample with a straight-through
    gradient (exact 0/1 forward; the gradient of ``softmax((logits + g) / tau)``).
    sample=False (inference): deterministic; a group is skipped iff its skip logit is larger
    (a tie executes).
    """
    if sample:
        return F.gumbel_softmax(logits, tau=tau, hard=True, dim=-1)[..., 0]
    return (logits[..., 1] <= logits[..., 0]).to(logits.dtype)


def linear_tau(step: int, total_steps: int, tau_start: float, tau_end: float) -> float:
    """Temperature annealed linearly per optimiser step: ``tau_start`` at step 0, ``tau_end`` at
    the last step (``total_steps - 1``)."""
    if total_steps <= 1:
        return tau_end
    frac = min(max(step, 0), total_steps - 1) / (total_steps - 1)
    return tau_start + (tau_end - tau_start) * frac
