"""The inference-time routing decision in one or two launches.

    x:      [M, D]      the raw residual of M tokens (any float dtype)
    w_down: [R, D]      b_down: [R]         the router's bottleneck (fp32)
    w_up:   [2G, R]     b_up:   [2G]        its logits, interleaved (row 2g: execute, 2g + 1: skip)
    out:    [M, G]      1.0 where group g executes for the token (skip logit <= execute logit), else 0.0
                        (fp32; or True / False with ``as_bool``, which the kernels downstream read as it is)

The reference is ``GroupRouter`` followed by the deterministic ``decide`` (fp32 throughout); at
batch 1 it is five or six small launches (a cast, two products, a comparison, a cast) per routed
sublayer and token, which the end-to-end profile on the H200 showed eating most of the kernels'
decode gain (docs/wide-kernels-h200.md). The kernels compute the same fp32 products: for many
tokens one program per block of tokens does all of it; for few (decode) the bottleneck product is
spread over shares of D (one program each, partial sums in a workspace), which a second launch sums
in a fixed order before it decides, or, for a few groups at decode sizes, the last share of each
token block to finish, in the same launch (``router_fold``). Beyond decode sizes the products run on the tensor cores
in three TF32 passes (``tf32x3``: fp32-level accuracy; the bf16 input is exact in TF32), where the
plain fp32 ``tl.dot`` runs on the CUDA cores (44 us a call at M = 1024 on the H200, run 18, 8% of
a WIDE prefill's GPU time). Decisions equal the reference's except where a group's two logits tie
to within fp32 rounding (a different summation order), as between any two GEMM libraries.
"""

from __future__ import annotations

import torch

from compresskit_wide.kernels import tuning
from compresskit_wide.kernels.gemm_reduce import zeroed_tickets

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = None


def torch_router_decide(
    x: torch.Tensor,
    w_down: torch.Tensor,
    b_down: torch.Tensor,
    w_up: torch.Tensor,
    b_up: torch.Tensor,
    *,
    as_bool: bool = False,
) -> torch.Tensor:
    """Reference: exactly ``decide(GroupRouter(x), sample=False)`` for a 2-D ``x`` (as a bool mask
    with ``as_bool``)."""
    z = torch.nn.functional.linear(x.float(), w_down, b_down)
    logits = torch.nn.functional.linear(z, w_up, b_up).unflatten(-1, (w_up.shape[0] // 2, 2))
    execute = logits[..., 1] <= logits[..., 0]
    return execute if as_bool else execute.to(logits.dtype)


if triton is not None:

    @triton.jit
    def _router_tile(M, R, BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr):
        """This program's token rows and the bottleneck's columns: ``(rows, row_ok, rs, r_ok)``."""
        rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        rs = tl.arange(0, BLOCK_R)
        return rows, rows < M, rs, rs < R

    @triton.jit
    def _router_z(
        x_ptr, wd_ptr, rows, row_ok, rs, r_ok, k_begin, k_end, D, stride_xm,
        DOT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr,
    ):  # fmt: skip
        # x[rows, k_begin:k_end] @ w_down[:, k_begin:k_end].T in fp32, BLOCK_K columns a step
        z = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
        for k0 in range(k_begin, k_end, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            k_ok = (ks < k_end) & (ks < D)
            x_mask = row_ok[:, None] & k_ok[None, :]
            a = tl.load(x_ptr + rows[:, None] * stride_xm + ks[None, :], mask=x_mask, other=0.0)
            w = tl.load(wd_ptr + rs[:, None] * D + ks[None, :], mask=r_ok[:, None] & k_ok[None, :], other=0.0)
            z = tl.dot(a.to(tl.float32), tl.trans(w), z, input_precision=DOT_PRECISION)
        return z

    @triton.jit
    def _router_decide_store(
        z, bd_ptr, wu_ptr, bu_ptr, out_ptr, rows, row_ok, rs, r_ok, R, G, stride_om, group_block,
        DOT_PRECISION: tl.constexpr, BLOCK_G: tl.constexpr,
    ):  # fmt: skip
        # both logits of the groups of ``group_block`` from the bottleneck z (its bias added here), compared
        z += tl.load(bd_ptr + rs, mask=r_ok, other=0.0)[None, :]
        gs = group_block * BLOCK_G + tl.arange(0, BLOCK_G)
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

    @triton.jit
    def triton_router_decide_kernel(
        x_ptr, wd_ptr, bd_ptr, wu_ptr, bu_ptr, out_ptr,
        M, D, R, G,
        stride_xm, stride_om,
        DOT_PRECISION: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_G: tl.constexpr,
    ):  # fmt: skip
        # program (token block, group block), many tokens: the whole bottleneck, then the decision
        rows, row_ok, rs, r_ok = _router_tile(M, R, BLOCK_M, BLOCK_R)
        z = _router_z(
            x_ptr, wd_ptr, rows, row_ok, rs, r_ok, 0, D, D, stride_xm, DOT_PRECISION, BLOCK_M, BLOCK_K, BLOCK_R
        )  # fmt: skip
        _router_decide_store(
            z, bd_ptr, wu_ptr, bu_ptr, out_ptr, rows, row_ok, rs, r_ok, R, G, stride_om, tl.program_id(1),
            DOT_PRECISION, BLOCK_G,
        )  # fmt: skip

    @triton.jit
    def _router_store_share(
        x_ptr, wd_ptr, ws_ptr, M, D, R, CHUNK, stride_xm,
        DOT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr,
    ):  # fmt: skip
        # program (token block, share s of D): its partial bottleneck into ws[s]
        rows, row_ok, rs, r_ok = _router_tile(M, R, BLOCK_M, BLOCK_R)
        s = tl.program_id(1)
        z = _router_z(
            x_ptr, wd_ptr, rows, row_ok, rs, r_ok, s * CHUNK, s * CHUNK + CHUNK, D, stride_xm,
            DOT_PRECISION, BLOCK_M, BLOCK_K, BLOCK_R,
        )  # fmt: skip
        tl.store(ws_ptr + (s * M + rows)[:, None] * R + rs[None, :], z, mask=row_ok[:, None] & r_ok[None, :])

    @triton.jit
    def _router_sum_shares(
        ws_ptr, M, R, SPLIT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, CACHE: tl.constexpr
    ):  # fmt: skip
        # this token block's partial bottlenecks summed in share order (unrolled: the loads are
        # independent and issued together)
        rows, row_ok, rs, r_ok = _router_tile(M, R, BLOCK_M, BLOCK_R)
        z = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
        z_mask = row_ok[:, None] & r_ok[None, :]
        for s in tl.static_range(SPLIT):
            share = ws_ptr + (s * M + rows)[:, None] * R + rs[None, :]
            z += tl.load(share, mask=z_mask, other=0.0, cache_modifier=CACHE)
        return z

    @triton.jit
    def triton_router_partial_kernel(
        x_ptr, wd_ptr, ws_ptr, M, D, R, CHUNK, stride_xm,
        DOT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr,
    ):  # fmt: skip
        # program (token block, share s of D), few tokens: its partial bottleneck into ws[s]
        _router_store_share(
            x_ptr, wd_ptr, ws_ptr, M, D, R, CHUNK, stride_xm, DOT_PRECISION, BLOCK_M, BLOCK_K, BLOCK_R
        )  # fmt: skip

    @triton.jit
    def triton_router_finish_kernel(
        ws_ptr, bd_ptr, wu_ptr, bu_ptr, out_ptr, M, R, G, stride_om, SPLIT: tl.constexpr,
        DOT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_G: tl.constexpr,
    ):  # fmt: skip
        # program (token block, group block): the partial bottlenecks summed in share order, the decision
        rows, row_ok, rs, r_ok = _router_tile(M, R, BLOCK_M, BLOCK_R)
        z = _router_sum_shares(ws_ptr, M, R, SPLIT, BLOCK_M, BLOCK_R, "")
        _router_decide_store(
            z, bd_ptr, wu_ptr, bu_ptr, out_ptr, rows, row_ok, rs, r_ok, R, G, stride_om, tl.program_id(1),
            DOT_PRECISION, BLOCK_G,
        )  # fmt: skip

    @triton.jit
    def triton_router_folded_kernel(
        x_ptr, wd_ptr, bd_ptr, wu_ptr, bu_ptr, out_ptr, ws_ptr, ticket_ptr,
        M, D, R, G, CHUNK, stride_xm, stride_om, SPLIT: tl.constexpr,
        DOT_PRECISION: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_G: tl.constexpr,
    ):  # fmt: skip
        # program (token block, share s of D): its partial bottleneck into ws[s], then a ticket for its
        # token block; the share that draws the last one sums the partials in share order (as the
        # finish kernel does), decides every group of the block and resets the ticket: one launch
        _router_store_share(
            x_ptr, wd_ptr, ws_ptr, M, D, R, CHUNK, stride_xm, DOT_PRECISION, BLOCK_M, BLOCK_K, BLOCK_R
        )  # fmt: skip
        tl.debug_barrier()  # every thread's partial is stored before the ticket releases it
        block = tl.program_id(0)
        ticket = tl.atomic_add(ticket_ptr + block, 1, sem="acq_rel", scope="gpu")
        if ticket == SPLIT - 1:  # the last share of this token block: the others' partials are visible
            tl.debug_barrier()
            rows, row_ok, rs, r_ok = _router_tile(M, R, BLOCK_M, BLOCK_R)
            total = _router_sum_shares(ws_ptr, M, R, SPLIT, BLOCK_M, BLOCK_R, ".cg")  # (from L2, not L1)
            for group_block in range(0, tl.cdiv(G, BLOCK_G)):
                _router_decide_store(
                    total, bd_ptr, wu_ptr, bu_ptr, out_ptr, rows, row_ok, rs, r_ok, R, G, stride_om, group_block,
                    DOT_PRECISION, BLOCK_G,
                )  # fmt: skip
            tl.atomic_xchg(ticket_ptr + block, 0)


def router_split(m: int, d: int, block_m: int, block_k: int) -> int:
    """Shares of D the bottleneck product is split into: at decode sizes one token block is one
    program, which alone streams the whole fp32 ``w_down`` (measured 155 us at M = 1 on the H200,
    run 11, against 13 us for the reference's launches), so D is spread over up to 128 programs and
    a second launch sums the shares (run 13: 1.2x-4.9x of the reference's GPU time at M = 1..1024);
    with 64 token blocks or more, shares enough for about 256 programs (2 shares at M = 4096, 4 at
    2048; one launch there measured 98 us at both sizes on the tensor cores, run 19: 64-128 programs,
    each streaming its rows' whole D), one launch from 256 token blocks."""
    m_blocks = tuning.cdiv(m, block_m)
    programs = 128 if m_blocks < 64 else 256
    return max(1, min(tuning.cdiv(d, block_k), programs // m_blocks))


def router_fold(m: int, groups: int) -> bool:
    """Whether the shares of D are summed by the last share of each token block (one launch, the
    folded kernel) rather than by a second launch: at decode sizes for up to 32 groups, where run 35
    measured it at par or ahead (the attention router's 8 groups: 9.7 us against 10.0 at M = 1, 10.0
    against 10.6 at 16). That last program decides every group alone, so with many groups it is the
    slower one: the FFN router's 112 took 18.8 us against 10.3 at M = 1 and 43 against 29 at 1,024;
    and from 1,024 tokens 8 groups too were slower folded (28.9 against 28.2 us, 77 against 72)."""
    return m <= tuning.DECODE_MAX_M and groups <= 32


def router_precision(m: int) -> str:
    """``tl.dot``'s input precision for the router's fp32 products: "ieee" (CUDA cores) for decode
    sizes, where the products are too small for the tensor cores to matter (as measured, runs
    11-13), "tf32x3" (tensor cores, fp32-level accuracy) for more tokens."""
    return "ieee" if m <= tuning.DECODE_MAX_M else "tf32x3"


def triton_router_decide(
    x: torch.Tensor,
    w_down: torch.Tensor,
    b_down: torch.Tensor,
    w_up: torch.Tensor,
    b_up: torch.Tensor,
    *,
    split: int | None = None,
    block_g: int | None = None,
    as_bool: bool = False,
    fold: bool | None = None,
) -> torch.Tensor:
    """Triton version of :func:`torch_router_decide` for any M: one launch for many tokens; for few,
    the bottleneck split over ``split`` shares of D (default: ``router_split``), whose partial sums
    are added in a fixed order before the decision: with ``fold`` by the last share of each token
    block to finish, in the same launch (``triton_router_folded_kernel``; tickets as in
    ``zeroed_tickets``, one stream at a time), else by a second launch; default: ``router_fold``.
    ``block_g`` groups a program (a power of two, at least 16; default 32 for the second launch,
    up to 128 otherwise).
    ``as_bool``: the decision stored as bytes and returned as a bool mask (what the routed operators
    read; no cast launch after it)."""
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
    if split is not None and split < 1:
        raise ValueError(f"split must be >= 1, got {split}")
    if block_g is not None and (block_g < 16 or block_g & (block_g - 1)):
        raise ValueError(f"block_g must be a power of two >= 16, got {block_g}")
    x = x.contiguous()
    w_down, b_down, w_up, b_up = (t.contiguous() for t in fp32)
    out = torch.empty((m, groups), dtype=torch.uint8 if as_bool else torch.float32, device=x.device)
    block_m = 16 if m <= tuning.DECODE_MAX_M or tuning.interpreted() else 32
    block_r = max(16, tuning.next_power_of_2(r))
    block_k = 32 if tuning.interpreted() else 128
    splits = router_split(m, d, block_m, block_k) if split is None else split
    chunk = tuning.cdiv(tuning.cdiv(d, splits), block_k) * block_k  # whole K steps per share
    splits = tuning.cdiv(d, chunk)  # no empty share
    fold = router_fold(m, groups) if fold is None else fold
    # groups a program: 32 for the second launch (run 13, D in 32 shares: 1.23x / 1.94x of the
    # reference at M = 1 / 16, against 0.95x / 1.52x with 128); in one launch every group block
    # recomputes the bottleneck, and the folded sum's last share steps through all of them: up to 128
    block_g = block_g or min(32 if splits > 1 and not fold else 128, max(16, tuning.next_power_of_2(groups)))
    m_blocks = tuning.cdiv(m, block_m)
    grid = (m_blocks, tuning.cdiv(groups, block_g))
    precision = router_precision(m)
    if splits == 1:
        triton_router_decide_kernel[grid](
            x, w_down, b_down, w_up, b_up, out, m, d, r, groups, x.stride(0), out.stride(0),
            DOT_PRECISION=precision, BLOCK_M=block_m, BLOCK_K=block_k, BLOCK_R=block_r, BLOCK_G=block_g,
        )  # fmt: skip
        return out.view(torch.bool) if as_bool else out
    ws = torch.empty((splits, m, r), dtype=torch.float32, device=x.device)
    if fold:
        triton_router_folded_kernel[(m_blocks, splits)](
            x, w_down, b_down, w_up, b_up, out, ws, zeroed_tickets(x.device, m_blocks),
            m, d, r, groups, chunk, x.stride(0), out.stride(0), splits,
            DOT_PRECISION=precision, BLOCK_M=block_m, BLOCK_K=block_k, BLOCK_R=block_r, BLOCK_G=block_g,
        )  # fmt: skip
        return out.view(torch.bool) if as_bool else out
    triton_router_partial_kernel[(m_blocks, splits)](
        x, w_down, ws, m, d, r, chunk, x.stride(0),
        DOT_PRECISION=precision, BLOCK_M=block_m, BLOCK_K=block_k, BLOCK_R=block_r,
    )  # fmt: skip
    triton_router_finish_kernel[grid](
        ws, b_down, w_up, b_up, out, m, r, groups, out.stride(0), splits,
        DOT_PRECISION=precision, BLOCK_M=block_m, BLOCK_R=block_r, BLOCK_G=block_g,
    )  # fmt: skip
    return out.view(torch.bool) if as_bool else out
