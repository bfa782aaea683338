"""Output-width masked GEMM (q projection; gate and up with a fused SwiGLU epilogue).

    x:    [M, K]        tokens, flattened
    w:    [N, K]        as in nn.Linear (w_up: the same, for the fused SwiGLU)
    mask: [M, N / G]    True = the token needs this group of G output channels
    out:  [M, N]        x @ w.T (or silu(x @ w.T) * (x @ w_up.T)) where active, exactly 0 elsewhere

The Triton kernel works on the routing layout (``layout.py``): program (g, tile, n-block) takes
the tile's tokens in group g's sorted order. A tile whose first sorted token is inactive only
writes zeros and never reads a weight (block-level skipping); in the one partial tile, loads of
inactive rows are predicated off (intra-block skipping). Every output element is written, so the
result needs no zero-filled buffer. Decode (small M) is the same kernel with one tile per group:
weight blocks of groups no token needs are never read.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from compresskit_wide.kernels.layout import torch_routing_layout

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = None


def torch_masked_out_gemm(
    x: torch.Tensor, w: torch.Tensor, mask: torch.Tensor, w_up: torch.Tensor | None = None
) -> torch.Tensor:
    """Reference: masked dense, in fp32 accumulation, cast to ``x.dtype``."""
    n = w.shape[0]
    groups = mask.shape[-1]
    if n % groups:
        raise ValueError(f"N={n} does not split into {groups} groups")
    y = x.float() @ w.float().T  # [M, N]
    if w_up is not None:
        y = F.silu(y) * (x.float() @ w_up.float().T)
    keep = mask.bool().repeat_interleave(n // groups, dim=-1)  # [M, N]
    return torch.where(keep, y, torch.zeros((), dtype=y.dtype)).to(x.dtype)


if triton is not None:

    @triton.jit
    def triton_masked_out_gemm_kernel(
        x_ptr, w_ptr, wu_ptr, out_ptr, order_ptr, counts_ptr,
        M, N, K, GW,
        stride_xm, stride_wn, stride_om,
        FUSE_SWIGLU: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    ):  # fmt: skip
        g = tl.program_id(0)  # group
        tm = tl.program_id(1)  # tile of the group's sorted tokens
        tn = tl.program_id(2)  # block of the group's GW output channels
        count = tl.load(counts_ptr + g)
        slots = tm * BLOCK_M + tl.arange(0, BLOCK_M)
        in_range = slots < M
        rows = tl.load(order_ptr + g * M + slots, mask=in_range, other=0)  # token ids, active first
        active = slots < count
        cols = g * GW + tn * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = (tn * BLOCK_N + tl.arange(0, BLOCK_N)) < GW
        out_ptrs = out_ptr + rows[:, None] * stride_om + cols[None, :]
        store_mask = in_range[:, None] & col_ok[None, :]
        if tm * BLOCK_M >= count:  # block-level skip: no active token in this tile
            tl.store(out_ptrs, tl.zeros((BLOCK_M, BLOCK_N), dtype=out_ptr.dtype.element_ty), mask=store_mask)
            return
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            k_ok = ks < K
            a = tl.load(
                x_ptr + rows[:, None] * stride_xm + ks[None, :], mask=active[:, None] & k_ok[None, :], other=0.0
            )
            b = tl.load(
                w_ptr + cols[:, None] * stride_wn + ks[None, :], mask=col_ok[:, None] & k_ok[None, :], other=0.0
            )
            acc = tl.dot(a, tl.trans(b), acc)
            if FUSE_SWIGLU:
                bu = tl.load(
                    wu_ptr + cols[:, None] * stride_wn + ks[None, :], mask=col_ok[:, None] & k_ok[None, :], other=0.0
                )
                acc_up = tl.dot(a, tl.trans(bu), acc_up)
        if FUSE_SWIGLU:
            acc = acc * tl.sigmoid(acc) * acc_up
        acc = tl.where(active[:, None], acc, 0.0)
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=store_mask)


def triton_masked_out_gemm(
    x: torch.Tensor,
    w: torch.Tensor,
    mask: torch.Tensor,
    w_up: torch.Tensor | None = None,
    *,
    layout: tuple[torch.Tensor, ...] | None = None,
    out: torch.Tensor | None = None,
    block_m: int = 16,
    block_n: int = 32,
    block_k: int = 32,
) -> torch.Tensor:
    """Triton version of :func:`torch_masked_out_gemm`. ``layout`` is the routing layout of
    ``mask`` (computed here when not given; share it between projections of one block)."""
    if triton is None:
        raise RuntimeError("triton is not installed")
    m, k = x.shape
    n = w.shape[0]
    groups = mask.shape[-1]
    if w.shape[1] != k or n % groups or (w_up is not None and w_up.shape != w.shape):
        raise ValueError(f"shapes do not fit: x {tuple(x.shape)}, w {tuple(w.shape)}, mask {tuple(mask.shape)}")
    gw = n // groups
    order, counts = (layout if layout is not None else torch_routing_layout(mask))[:2]
    if order.shape != (groups, m) or not order.is_contiguous():
        raise ValueError(f"layout order must be a contiguous [G, M] = [{groups}, {m}] tensor, got {tuple(order.shape)}")
    x, w = x.contiguous(), w.contiguous()
    w_up = w_up.contiguous() if w_up is not None else w
    if out is None:
        out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    grid = (groups, triton.cdiv(m, block_m), triton.cdiv(gw, block_n))
    triton_masked_out_gemm_kernel[grid](
        x, w, w_up, out, order, counts, m, n, k, gw, x.stride(0), w.stride(0), out.stride(0),
        FUSE_SWIGLU=w_up is not w, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
    )  # fmt: skip
    return out
