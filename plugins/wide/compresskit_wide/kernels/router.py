"""The inference-time routing decision in one launch.

    x:      [M, D]      the raw residual of M tokens (any float dtype)
    w_down: [R, D]      b_down: [R]         the router's bottleneck (fp32)
    w_up:   [2G, R]     b_up:   [2G]        its logits, interleaved (row 2g: execute, 2g + 1: skip)
    out:    [M, G]      1.0 where group g executes for the token (skip logit <= execute logit), else 0.0

The reference is ``GroupRouter`` followed by the deterministic ``decide`` (fp32 throughout); at
batch 1 it is five or six small launches (a cast, two products, a comparison, a cast) per routed
sublayer and token, which the end-to-end profile on the H200 showed eating most of the kernels'
decode gain (docs/wide-kernels-h200.md). The kernel computes the same fp32 products in one
program per block of tokens; decisions equal the reference's except where a group's two logits
tie to within fp32 rounding (a different summation order), as between any two GEMM libraries.
"""

from __future__ import annotations

import torch

from compresskit_wide.kernels import tuning

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = None


def torch_router_decide(
    x: torch.Tensor, w_down: torch.Tensor, b_down: torch.Tensor, w_up: torch.Tensor, b_up: torch.Tensor
) -> torch.Tensor:
    """Reference: exactly ``decide(GroupRouter(x), sample=False)`` for a 2-D ``x``."""
    z = torch.nn.functional.linear(x.float(), w_down, b_down)
    logits = torch.nn.functional.linear(z, w_up, b_up).unflatten(-1, (w_up.shape[0] // 2, 2))
    return (logits[..., 1] <= logits[..., 0]).to(logits.dtype)


if triton is not None:

    @triton.jit
    def triton_router_decide_kernel(
        x_ptr, wd_ptr, bd_ptr, wu_ptr, bu_ptr, out_ptr,
        M, D, R, G,
        stride_xm, stride_om,
        DOT_PRECISION: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_G: tl.constexpr,
    ):  # fmt: skip
        # program (token block, group block): z = x @ w_down.T + b_down over D in BLOCK_K steps,
        # then both logits of its groups from z, compared; every product in fp32
        tm = tl.program_id(0)
        tg = tl.program_id(1)
        rows = tm * BLOCK_M + tl.arange(0, BLOCK_M)
        row_ok = rows < M
        rs = tl.arange(0, BLOCK_R)
        r_ok = rs < R
        z = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
        for k0 in range(0, D, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            k_ok = ks < D
            x_mask = row_ok[:, None] & k_ok[None, :]
            a = tl.load(x_ptr + rows[:, None] * stride_xm + ks[None, :], mask=x_mask, other=0.0)
            w = tl.load(wd_ptr + rs[:, None] * D + ks[None, :], mask=r_ok[:, None] & k_ok[None, :], other=0.0)
            z = tl.dot(a.to(tl.float32), tl.trans(w), z, input_precision=DOT_PRECISION)
        z += tl.load(bd_ptr + rs, mask=r_ok, other=0.0)[None, :]
        gs = tg * BLOCK_G + tl.arange(0, BLOCK_G)
        g_ok = gs < G
        w_mask = g_ok[:, None] & r_ok[None, :]
        w_exec = tl.load(wu_ptr + (2 * gs)[:, None] * R + rs[None, :], mask=w_mask, other=0.0)
        w_skip = tl.load(wu_ptr + (2 * gs + 1)[:, None] * R + rs[None, :], mask=w_mask, other=0.0)
        l_exec = tl.dot(z, tl.trans(w_exec), input_precision=DOT_PRECISION)
        l_skip = tl.dot(z, tl.trans(w_skip), input_precision=DOT_PRECISION)
        l_exec += tl.load(bu_ptr + 2 * gs, mask=g_ok, other=0.0)[None, :]
        l_skip += tl.load(bu_ptr + 2 * gs + 1, mask=g_ok, other=0.0)[None, :]
        execute = tl.where(l_skip <= l_exec, 1.0, 0.0)
        tl.store(out_ptr + rows[:, None] * stride_om + gs[None, :], execute, mask=row_ok[:, None] & g_ok[None, :])


def triton_router_decide(
    x: torch.Tensor, w_down: torch.Tensor, b_down: torch.Tensor, w_up: torch.Tensor, b_up: torch.Tensor
) -> torch.Tensor:
    """Triton version of :func:`torch_router_decide`: one launch (per 128 groups) for any M."""
    if triton is None:
        raise RuntimeError("triton is not installed")
    m, d = x.shape
    r = w_down.shape[0]
    groups = w_up.shape[0] // 2
    fp32 = (w_down, b_down, w_up, b_up)
    if (
        w_down.shape != (r, d)
        or b_down.shape != (r,)
        or w_up.shape != (2 * groups, r)
        or b_up.shape != (2 * groups,)
        or any(t.dtype != torch.float32 for t in fp32)
    ):
        shapes = ", ".join(f"{tuple(t.shape)} {t.dtype}" for t in (x, *fp32))
        raise ValueError(f"router tensors do not fit (x, w_down, b_down, w_up, b_up): {shapes}")
    x = x.contiguous()
    w_down, b_down, w_up, b_up = (t.contiguous() for t in fp32)
    out = torch.empty((m, groups), dtype=torch.float32, device=x.device)
    block_m = 16 if m <= tuning.DECODE_MAX_M or tuning.interpreted() else 32
    block_g = min(128, max(16, triton.next_power_of_2(groups)))
    block_r = max(16, triton.next_power_of_2(r))
    block_k = 32 if tuning.interpreted() else 128
    grid = (triton.cdiv(m, block_m), triton.cdiv(groups, block_g))
    triton_router_decide_kernel[grid](
        x, w_down, b_down, w_up, b_up, out, m, d, r, groups, x.stride(0), out.stride(0),
        DOT_PRECISION="ieee", BLOCK_M=block_m, BLOCK_K=block_k, BLOCK_R=block_r, BLOCK_G=block_g,
    )  # fmt: skip
    return out
