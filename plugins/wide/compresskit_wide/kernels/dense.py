"""Dense fallbacks: the routed operators computed densely through the library paths (cuBLAS,
SDPA) in the input dtype, then the inactive outputs zeroed. Exactly the references' semantics,
at dense speed; ``backend="auto"`` takes them wherever the benchmark shows the Triton kernel
would be slower (``tuning.use_kernel``)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from compresskit_wide.kernels.reference import zero_inactive_groups, zero_inactive_heads


def dense_masked_out_gemm(
    x: torch.Tensor,
    w: torch.Tensor,
    mask: torch.Tensor,
    w_up: torch.Tensor | None = None,
    *,
    zero_inactive: bool = True,
) -> torch.Tensor:
    """``x @ w.T`` (or ``silu(x @ w.T) * (x @ w_up.T)``), zero where the group is inactive (left as
    computed with ``zero_inactive=False``, for a caller that never reads those outputs)."""
    y = x @ w.T
    if w_up is not None:
        y = F.silu(y) * (x @ w_up.T)
    return zero_inactive_groups(y, mask) if zero_inactive else y


def dense_routed_attention_decode(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seq_lens: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    """SDPA with native GQA over each sequence's valid cache (no host synchronisation), inactive
    heads zeroed. Shapes as in ``attention_decode``."""
    s = k.shape[2]
    valid = torch.arange(s, device=q.device)[None, :] < seq_lens.to(q.device)[:, None]  # [B, S]
    out = F.scaled_dot_product_attention(q[:, :, None, :], k, v, attn_mask=valid[:, None, None, :], enable_gqa=True)
    b, hq, d = q.shape
    return zero_inactive_groups(out.reshape(b, hq * d), mask).view(b, hq, d)


def dense_routed_attention_prefill(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    """Causal SDPA with native GQA (query t at position past + t), inactive (token, head) zeroed.
    Shapes as in ``attention_prefill``."""
    t, s = q.shape[2], k.shape[2]
    if s == t:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    else:  # the causal diagonal shifted by the past length (SDPA's is_causal aligns top-left)
        allowed = torch.arange(s, device=q.device)[None, :] <= (s - t + torch.arange(t, device=q.device))[:, None]
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, enable_gqa=True)
    return zero_inactive_heads(out, mask)
