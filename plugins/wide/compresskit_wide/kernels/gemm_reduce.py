"""Reduction-width masked GEMM (o_proj, down_proj): the inputs of inactive groups contribute nothing.

    x:    [M, K]        tokens, flattened
    w:    [N, K]        as in nn.Linear
    mask: [M, K / G]    True = the token's group of G input features is active
    out:  [M, N]        sum over active groups of x[:, group] @ w[:, group].T

The Triton kernel is the decode path: each program owns a block of output channels and loops,
branch-free, over the compacted list of groups some token needs (``active_groups``, ``n_active``
from the routing layout, on the device: no host synchronisation), reading only those weight
columns. For prefill the masked dense product on the zero-filled input is exact and uses cuBLAS
(``dense_masked_reduce_gemm``; on the output of the fused SwiGLU kernel, already zero where
inactive, it is the plain dense product); the dispatcher picks by the benchmark.
"""

from __future__ import annotations

import torch

from compresskit_wide.kernels import tuning
from compresskit_wide.kernels.layout import decode_layout
from compresskit_wide.kernels.reference import torch_group_masked_input

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = None


def torch_masked_reduce_gemm(x: torch.Tensor, w: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Reference: zero the inactive input groups, then the dense product (fp32 accumulation)."""
    return (torch_group_masked_input(x.float(), mask) @ w.float().T).to(x.dtype)


def dense_masked_reduce_gemm(
    x: torch.Tensor, w: torch.Tensor, mask: torch.Tensor, *, input_is_masked: bool = False
) -> torch.Tensor:
    """The prefill path: the masked dense product in ``x.dtype`` through cuBLAS (its fp32
    accumulation). Exact, as the inactive groups' inputs are zero. ``input_is_masked``: the caller
    guarantees that already (the fused SwiGLU kernel writes exact zeros there), so the product is
    the plain dense one and costs nothing extra."""
    return x @ w.T if input_is_masked else torch_group_masked_input(x, mask) @ w.T


if triton is not None:

    @triton.jit
    def triton_masked_reduce_gemm_kernel(
        x_ptr, w_ptr, mask_ptr, out_ptr, groups_ptr, n_active_ptr,
        M, N, GW, G,
        stride_xm, stride_wn, stride_mm, stride_om,
        DOT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    ):  # fmt: skip
        tn = tl.program_id(0)
        tm = tl.program_id(1)
        rows = tm * BLOCK_M + tl.arange(0, BLOCK_M)
        row_ok = rows < M
        cols = tn * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = cols < N
        n_active = tl.load(n_active_ptr)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for i in range(0, n_active):  # only the groups some token needs
            g = tl.load(groups_ptr + i)
            on = tl.load(mask_ptr + rows * stride_mm + g, mask=row_ok, other=0) != 0  # [BLOCK_M]
            for k0 in range(0, GW, BLOCK_K):
                ks = g * GW + k0 + tl.arange(0, BLOCK_K)
                k_ok = (k0 + tl.arange(0, BLOCK_K)) < GW
                a = tl.load(
                    x_ptr + rows[:, None] * stride_xm + ks[None, :],
                    mask=(on & row_ok)[:, None] & k_ok[None, :],
                    other=0.0,
                )
                b = tl.load(
                    w_ptr + cols[:, None] * stride_wn + ks[None, :], mask=col_ok[:, None] & k_ok[None, :], other=0.0
                )
                acc = tl.dot(a, tl.trans(b), acc, input_precision=DOT_PRECISION)
        tl.store(
            out_ptr + rows[:, None] * stride_om + cols[None, :],
            acc.to(out_ptr.dtype.element_ty),
            mask=row_ok[:, None] & col_ok[None, :],
        )

    _tuned_reduce_gemm = triton.autotune(
        configs=tuning.configs(tuning.REDUCE_DECODE),
        key=["M", "N", "GW", "G"],
        prune_configs_by={"early_config_prune": tuning.prune_block_k("GW")},
    )(triton_masked_reduce_gemm_kernel)


def triton_masked_reduce_gemm(
    x: torch.Tensor,
    w: torch.Tensor,
    mask: torch.Tensor,
    *,
    layout: tuple[torch.Tensor, ...] | None = None,
    out: torch.Tensor | None = None,
    block_m: int | None = None,
    block_n: int | None = None,
    block_k: int | None = None,
) -> torch.Tensor:
    """Triton version of :func:`torch_masked_reduce_gemm` (the decode path). ``layout``: anything
    whose last two entries are ``(active_groups, n_active)`` (``decode_layout`` or the full
    routing layout); computed here when not given."""
    if triton is None:
        raise RuntimeError("triton is not installed")
    m, k = x.shape
    n = w.shape[0]
    groups = mask.shape[-1]
    if w.shape[1] != k or k % groups or mask.shape[0] != m:
        raise ValueError(f"shapes do not fit: x {tuple(x.shape)}, w {tuple(w.shape)}, mask {tuple(mask.shape)}")
    active_groups, n_active = (layout if layout is not None else decode_layout(mask))[-2:]
    x, w = x.contiguous(), w.contiguous()
    mask_u8 = mask.contiguous().view(torch.uint8) if mask.dtype == torch.bool else mask.contiguous()
    if out is None:
        out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    args = (x, w, mask_u8, out, active_groups, n_active, m, n, k // groups, groups)
    strides = (x.stride(0), w.stride(0), mask_u8.stride(0), out.stride(0))
    precision = tuning.dot_precision(x.dtype)
    if block_n is not None or tuning.interpreted():
        bm, bn, bk = block_m or 16, block_n or 32, block_k or 32
        grid = (triton.cdiv(n, bn), triton.cdiv(m, bm))
        triton_masked_reduce_gemm_kernel[grid](
            *args, *strides, DOT_PRECISION=precision, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk
        )
    else:
        grid = lambda meta: (triton.cdiv(n, meta["BLOCK_N"]), triton.cdiv(m, 16))  # noqa: E731
        _tuned_reduce_gemm[grid](*args, *strides, DOT_PRECISION=precision, BLOCK_M=16)
    return out
