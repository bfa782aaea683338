"""Pure tensor scoring functions: no modules, no hooks."""

from __future__ import annotations

import torch


def block_influence(x_in: torch.Tensor, x_out: torch.Tensor, valid: torch.Tensor | None = None) -> tuple[float, int]:
    """Sum over tokens of ``1 - cos(x_in, x_out)`` and the token count (``x: [B, T, D]``).

    A layer whose output points where its input did changes the residual stream little
    (ShortGPT's block influence); the lowest-scoring layers are removed first.
    """
    cos = torch.nn.functional.cosine_similarity(x_in.float(), x_out.float(), dim=-1)  # [B, T]
    score = 1.0 - cos
    if valid is not None:
        score = score * valid
        return float(score.sum()), int(valid.sum())
    return float(score.sum()), score.numel()


def wanda_rows(weight: torch.Tensor, in_norm: torch.Tensor | None) -> torch.Tensor:
    """Per output row: ``sum_j |W_ij| * ||X_j||`` (``weight: [N, K]``, ``in_norm: [K]``); magnitude
    ``sum_j |W_ij|`` when ``in_norm`` is None."""
    w = weight.detach().float().abs()
    return (w * in_norm.float()).sum(dim=1) if in_norm is not None else w.sum(dim=1)


def wanda_cols(weight: torch.Tensor, in_norm: torch.Tensor | None) -> torch.Tensor:
    """Per input column: ``||X_j|| * sum_i |W_ij|``; magnitude without the norm."""
    w = weight.detach().float().abs().sum(dim=0)
    return w * in_norm.float() if in_norm is not None else w


def group_sum(scores: torch.Tensor, group: int) -> torch.Tensor:
    """Sum contiguous groups of ``group`` entries: ``[N] -> [N / group]``."""
    return scores.view(-1, group).sum(dim=1)
