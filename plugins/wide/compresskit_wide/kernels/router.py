"""The inference-time routing decision in one or two launches.

    x:      [M, D]      the raw residual of M tokens (any float dtype)
    w_down: [R, D]      b_down: [R]         the router's bottleneck (fp32)
    w_up:   [2G, R]     b_up:   [2G]        its logits, interleaved (row 2g: execute, 2g + 1: skip)
    out:    [M, G]      1.0 where group g executes for the token (skip logit <= execute logit), else 0.0
                        (fp32; or True / False with ``as_bool``, which the kernels downstream read as it is)

The reference is ``GroupRouter`` followed by the deterministic ``decide``: five or six small launches
per routed sublayer and token. The kernels compute the same fp32 products in two: the bottleneck over
shares of D (one program each, partial sums in a workspace), then one that sums them in a fixed order
and decides. That second launch takes one of two shapes (``finish``): a program a block of tokens
(``tile``: its shares summed one by one, then both logits as block products), or a program a token
(``token``: the launch that decides from shares, below), which spreads the shares' reads over many
programs where the token blocks are few and the shares many.
Beyond decode sizes the products run on the tensor cores in three TF32 passes (``tf32x3``: fp32-level
accuracy; a bf16 input is exact in TF32). Decisions equal the reference's except where a group's two
logits tie within fp32 rounding (another summation order), as between two GEMM libraries.

At decode the bottleneck may arrive as shares already (``router_decide_from_shares``): the reduction
kernel of the block before writes ``x[:, cols] @ w_down[:, cols].T`` for its output columns of the
next block's input (``gemm_reduce.py``), so that only the decision's launch is left: it sums the
shares and decides. That launch is a kernel of its own, not the two-launch router's second one:
those are 256 shares a token at Llama-3.1-8B's width (one a 16 columns), against that router's
32, which it sums one by one in a loop the compiler unrolls (at 256 shares: a large kernel, slow
to compile); this one loads a token's shares at once and sums them as a tree.

    shares: [S, M, R]   fp32 partial bottlenecks over S column slices of D (zero where a slice is empty)

A block whose shares were not handed on may write them itself (``router_shares``: the first launch alone,
on ``x + delta``, its add done on the fly), and then decide from them as one that was handed them does.

The decision from shares may also take over the block's residual add and RMSNorm
(``router_norm_from_shares``): programs beside the deciding ones add the block before's output to
the residual and normalise each token's row, so that the block runs one launch before its first
product where it ran the decision's and the fused add and norm's.

    x, delta: [M, D]    the residual and what the block before adds to it (the compute dtype)
    norm_w:   [D]       the RMSNorm's weight; eps its epsilon
    x_new:    [M, D]    x + delta, rounded to the dtype as the add rounds
    h:        [M, D]    norm_w * (x_new * rsqrt(mean(x_new ** 2) + eps)) as Llama's RMSNorm computes it
                        (fp32 statistics, rounded to the dtype, then times the weight)

Either launch that decides may also count its decision (``counts``: fp64 ``[2]``, the runtime block's
counters): it adds the tokens it decided for and the groups they execute, with atomic adds (whole
numbers in fp64: exact in any order), which saves the block its own counting launch.
"""

from __future__ import annotations

from math import gcd

import torch

from compresskit_wide.kernels import policy
from compresskit_wide.kernels.common import cdiv, check_blocks, interpreted, next_power_of_2, pdl_launch

try:
    import triton
    import triton.language as tl

    from compresskit_wide.kernels.common import count_decision, pdl_enter
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
    margin: bool = False,
) -> torch.Tensor:
    """Reference: exactly ``decide(GroupRouter(x), sample=False)`` for a 2-D ``x`` (as a bool mask
    with ``as_bool``; the margins with ``margin``)."""
    return _decide(torch.nn.functional.linear(x.float(), w_down, b_down), w_up, b_up, as_bool, margin)


def _decide(
    z: torch.Tensor, w_up: torch.Tensor, b_up: torch.Tensor, as_bool: bool, margin: bool = False
) -> torch.Tensor:
    """The references' second step: the bottleneck ``z: [M, R]`` -> both logits of each group,
    compared (1.0 / True where the group executes), or (``margin``) their difference (fp32)."""
    logits = torch.nn.functional.linear(z, w_up, b_up).unflatten(-1, (w_up.shape[0] // 2, 2))
    if margin:
        return logits[..., 0] - logits[..., 1]
    execute = logits[..., 1] <= logits[..., 0]
    return execute if as_bool else execute.to(logits.dtype)


def torch_count(execute: torch.Tensor, counts: torch.Tensor | None, valid: torch.Tensor | None = None) -> None:
    """Reference counting: add ``execute: [M, G]``'s tokens and executed groups to ``counts``
    (fp64 ``[2]``; nothing where None), only the real tokens ``valid: [M]`` (bool) where given."""
    if counts is None:
        return
    if valid is None:
        counts[0].add_(execute.shape[0])
        counts[1].add_(execute.sum(dtype=torch.float64))
    else:
        counts[0].add_(valid.sum(dtype=torch.float64))
        counts[1].add_((execute & valid[:, None]).sum(dtype=torch.float64))


def torch_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Reference: Llama's RMSNorm of ``x: [..., D]``."""
    xf = x.float()
    return weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def torch_router_norm_from_shares(
    shares: torch.Tensor,
    b_down: torch.Tensor,
    w_up: torch.Tensor,
    b_up: torch.Tensor,
    x: torch.Tensor,
    delta: torch.Tensor,
    norm_w: torch.Tensor,
    eps: float,
    *,
    margin: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Reference: ``(execute [M, G] bool, x_new, h)`` (module docstring; the margins with ``margin``)."""
    x_new = x + delta
    return (
        torch_router_decide_from_shares(shares, b_down, w_up, b_up, as_bool=not margin, margin=margin),
        x_new,
        torch_rms_norm(x_new, norm_w, eps),
    )


def torch_router_decide_from_shares(
    shares: torch.Tensor,
    b_down: torch.Tensor,
    w_up: torch.Tensor,
    b_up: torch.Tensor,
    *,
    as_bool: bool = False,
    margin: bool = False,
) -> torch.Tensor:
    """Reference: the decision from the bottleneck's shares ``[S, M, R]`` (summed, then as
    :func:`torch_router_decide` from its bottleneck on)."""
    return _decide(shares.sum(0) + b_down, w_up, b_up, as_bool, margin)


if triton is not None:

    @triton.jit
    def _router_tile(M, R, BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr):
        """This program's token rows and the bottleneck's columns: ``(rows, row_ok, rs, r_ok)``."""
        rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        rs = tl.arange(0, BLOCK_R)
        return rows, rows < M, rs, rs < R

    @triton.jit
    def _router_z(
        x_ptr, dx_ptr, wd_ptr, rows, row_ok, rs, r_ok, k_begin, k_end, D, stride_xm,
        DOT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr,
        HAS_DELTA: tl.constexpr,
    ):  # fmt: skip
        # x[rows, k_begin:k_end] @ w_down[:, k_begin:k_end].T in fp32, BLOCK_K columns a step (HAS_DELTA:
        # of x + delta, the sum rounded to x's dtype as the residual add rounds it)
        z = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
        for k0 in range(k_begin, k_end, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            k_ok = (ks < k_end) & (ks < D)
            x_mask = row_ok[:, None] & k_ok[None, :]
            at = rows.to(tl.int64)[:, None] * stride_xm + ks[None, :]
            a = tl.load(x_ptr + at, mask=x_mask, other=0.0)
            if HAS_DELTA:
                da = tl.load(dx_ptr + at, mask=x_mask, other=0.0)
                a = (a.to(tl.float32) + da.to(tl.float32)).to(x_ptr.dtype.element_ty)
            w = tl.load(wd_ptr + rs[:, None] * D + ks[None, :], mask=r_ok[:, None] & k_ok[None, :], other=0.0)
            z = tl.dot(a.to(tl.float32), tl.trans(w), z, input_precision=DOT_PRECISION)
        return z

    @triton.jit
    def _router_decide_store(
        z, bd_ptr, wu_ptr, bu_ptr, out_ptr, cnt_ptr, rows, row_ok, rs, r_ok, R, G, stride_om, group_block,
        DOT_PRECISION: tl.constexpr, BLOCK_G: tl.constexpr, COUNT: tl.constexpr, MARGIN: tl.constexpr,
    ):  # fmt: skip
        # both logits of the groups of ``group_block`` from the bottleneck z (its bias added here), compared
        # (MARGIN: their difference stored instead, execute minus skip)
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
        in_tile = row_ok[:, None] & g_ok[None, :]
        tl.store(
            out_ptr + rows[:, None] * stride_om + gs[None, :], l_exec - l_skip if MARGIN else execute, mask=in_tile
        )
        if COUNT:
            executed = tl.sum(tl.sum(tl.where(in_tile, execute, 0.0), axis=1), axis=0)
            count_decision(cnt_ptr, tl.sum(row_ok.to(tl.float32), axis=0), executed, group_block == 0)

    @triton.jit
    def triton_router_partial_kernel(
        x_ptr, dx_ptr, wd_ptr, ws_ptr, M, D, R, CHUNK, stride_xm,
        DOT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr,
        HAS_DELTA: tl.constexpr = False,
        PDL: tl.constexpr = False,
    ):  # fmt: skip
        # program (token block, share s of D): its partial bottleneck (of x + delta with HAS_DELTA) into ws[s]
        pdl_enter(PDL)
        rows, row_ok, rs, r_ok = _router_tile(M, R, BLOCK_M, BLOCK_R)
        s = tl.program_id(1)
        z = _router_z(
            x_ptr, dx_ptr, wd_ptr, rows, row_ok, rs, r_ok, s * CHUNK, s * CHUNK + CHUNK, D, stride_xm,
            DOT_PRECISION, BLOCK_M, BLOCK_K, BLOCK_R, HAS_DELTA,
        )  # fmt: skip
        tl.store(ws_ptr + (s * M + rows)[:, None] * R + rs[None, :], z, mask=row_ok[:, None] & r_ok[None, :])

    @triton.jit
    def triton_router_finish_kernel(
        ws_ptr, bd_ptr, wu_ptr, bu_ptr, out_ptr, cnt_ptr, M, R, G, stride_om, SPLIT: tl.constexpr,
        DOT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_G: tl.constexpr,
        COUNT: tl.constexpr, MARGIN: tl.constexpr,
        PDL: tl.constexpr = False,
    ):  # fmt: skip
        # program (token block, group block): the partial bottlenecks summed in share order (unrolled:
        # the loads are independent and issued together), then the decision
        pdl_enter(PDL)
        rows, row_ok, rs, r_ok = _router_tile(M, R, BLOCK_M, BLOCK_R)
        z = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
        for s in tl.static_range(SPLIT):
            share = ws_ptr + (s * M + rows)[:, None] * R + rs[None, :]
            z += tl.load(share, mask=row_ok[:, None] & r_ok[None, :], other=0.0)
        _router_decide_store(
            z, bd_ptr, wu_ptr, bu_ptr, out_ptr, cnt_ptr, rows, row_ok, rs, r_ok, R, G, stride_om, tl.program_id(1),
            DOT_PRECISION, BLOCK_G, COUNT, MARGIN,
        )  # fmt: skip

    @triton.jit
    def triton_router_shares_kernel(
        sh_ptr, bd_ptr, wu_ptr, bu_ptr, out_ptr, cnt_ptr, S, M, R, G, stride_om,
        BLOCK_S: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_G: tl.constexpr, COUNT: tl.constexpr,
        MARGIN: tl.constexpr,
        PDL: tl.constexpr = False,
    ):  # fmt: skip
        # program (token m, group block): the token's shares summed in one load (a tree over S), the
        # bottleneck's bias added, both logits of the block's groups on the CUDA cores in fp32, compared
        pdl_enter(PDL)
        m = tl.program_id(0)
        ss = tl.arange(0, BLOCK_S)
        rs = tl.arange(0, BLOCK_R)
        r_ok = rs < R
        part = tl.load(
            sh_ptr + (ss[:, None] * M + m) * R + rs[None, :], mask=(ss < S)[:, None] & r_ok[None, :], other=0.0
        )
        z = tl.sum(part, axis=0) + tl.load(bd_ptr + rs, mask=r_ok, other=0.0)  # [BLOCK_R]
        gs = tl.program_id(1) * BLOCK_G + tl.arange(0, BLOCK_G)
        g_ok = gs < G
        w_mask = g_ok[:, None] & r_ok[None, :]
        w_exec = tl.load(wu_ptr + (2 * gs)[:, None] * R + rs[None, :], mask=w_mask, other=0.0)
        w_skip = tl.load(wu_ptr + (2 * gs + 1)[:, None] * R + rs[None, :], mask=w_mask, other=0.0)
        l_exec = tl.sum(w_exec * z[None, :], axis=1) + tl.load(bu_ptr + 2 * gs, mask=g_ok, other=0.0)
        l_skip = tl.sum(w_skip * z[None, :], axis=1) + tl.load(bu_ptr + 2 * gs + 1, mask=g_ok, other=0.0)
        execute = tl.where(l_skip <= l_exec, 1.0, 0.0)
        tl.store(out_ptr + m * stride_om + gs, l_exec - l_skip if MARGIN else execute, mask=g_ok)
        if COUNT:
            one = tl.full([], 1.0, tl.float32)
            count_decision(cnt_ptr, one, tl.sum(tl.where(g_ok, execute, 0.0), axis=0), tl.program_id(1) == 0)

    @triton.jit
    def triton_router_norm_shares_kernel(
        sh_ptr, bd_ptr, wu_ptr, bu_ptr, out_ptr, cnt_ptr, x_ptr, dx_ptr, nw_ptr, xn_ptr, h_ptr,
        S, M, R, G, D, stride_om, eps,
        BLOCK_S: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr,
        COUNT: tl.constexpr, MARGIN: tl.constexpr,
        PDL: tl.constexpr = False,
    ):  # fmt: skip
        # program (token m, j): j below the group blocks decides as triton_router_shares_kernel does;
        # the last j adds the token's row to the residual and normalises it
        pdl_enter(PDL)
        m = tl.program_id(0)
        if tl.program_id(1) < tl.cdiv(G, BLOCK_G):
            triton_router_shares_kernel(
                sh_ptr, bd_ptr, wu_ptr, bu_ptr, out_ptr, cnt_ptr, S, M, R, G, stride_om, BLOCK_S, BLOCK_R, BLOCK_G,
                COUNT, MARGIN,
            )  # fmt: skip
        else:
            # token m's row: x + delta into xn, its RMSNorm times the weight into h
            ds = tl.arange(0, BLOCK_D)
            d_ok = ds < D
            a = tl.load(x_ptr + m * D + ds, mask=d_ok, other=0.0).to(tl.float32)
            b = tl.load(dx_ptr + m * D + ds, mask=d_ok, other=0.0).to(tl.float32)
            x_new = (a + b).to(xn_ptr.dtype.element_ty)
            tl.store(xn_ptr + m * D + ds, x_new, mask=d_ok)
            xf = x_new.to(tl.float32)
            rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / D + eps)
            w = tl.load(nw_ptr + ds, mask=d_ok, other=0.0).to(tl.float32)
            normed = (xf * rstd).to(h_ptr.dtype.element_ty).to(tl.float32)
            tl.store(h_ptr + m * D + ds, (w * normed).to(h_ptr.dtype.element_ty), mask=d_ok)


def check_counts(counts: torch.Tensor | None, device: torch.device) -> None:
    """``counts`` None, or a contiguous fp64 ``[2]`` on ``device``."""
    if counts is not None and (
        counts.shape != (2,) or counts.dtype != torch.float64 or not counts.is_contiguous() or counts.device != device
    ):
        raise ValueError(
            f"counts must be a contiguous float64 [2] on {device}, got {tuple(counts.shape)} {counts.dtype} "
            f"on {counts.device}"
        )


def _check_margin(margin: bool, counts: torch.Tensor | None) -> None:
    """Margins are fp32 and not a decision: neither a bool mask nor counted."""
    if margin and counts is not None:
        raise ValueError("margins are not a decision: counts must be None with margin=True")


def router_split(m: int, d: int, block_m: int, block_k: int) -> int:
    """Shares of D for the bottleneck product: at decode sizes one token block is one program,
    which alone would stream all of the fp32 ``w_down``, so D is spread over
    ``policy.ROUTER_DECODE_PROGRAMS``; from 64 token blocks, shares enough for about
    ``policy.ROUTER_PREFILL_PROGRAMS`` programs; from that many token blocks, one share."""
    m_blocks = cdiv(m, block_m)
    programs = policy.ROUTER_DECODE_PROGRAMS if m_blocks < 64 else policy.ROUTER_PREFILL_PROGRAMS
    return max(1, min(cdiv(d, block_k), programs // m_blocks))


FINISHES = ("tile", "token")


def router_finish(m: int) -> str:
    """The deciding launch's shape for ``m`` tokens: "token" (a program a token and group block) up to
    ``policy.ROUTER_TOKEN_FINISH_MAX_M`` tokens, where a token block's program would read many shares;
    "tile" (a program a token block and group block) beyond, where the shares are few."""
    return "token" if m <= policy.ROUTER_TOKEN_FINISH_MAX_M else "tile"


def router_precision(m: int) -> str:
    """``tl.dot``'s precision for the fp32 products: "ieee" (CUDA cores) at decode sizes, too small
    for the tensor cores to matter; "tf32x3" (tensor cores, fp32-level accuracy) beyond."""
    return "ieee" if m <= policy.DECODE_MAX_M else "tf32x3"


def _partial_tile(m: int, block_m: int | None, block_k: int | None) -> tuple[int, int]:
    """``(block_m, block_k)`` of the bottleneck's launch for ``m`` tokens, where not given: 16 and 128 at
    decode sizes, else ``policy.ROUTER_PREFILL_TILE`` (16 and 32 in the interpreter)."""
    if interpreted():
        tile_m, tile_k = 16, 32
    else:
        tile_m, tile_k = (16, 128) if m <= policy.DECODE_MAX_M else policy.ROUTER_PREFILL_TILE
    return block_m or tile_m, block_k or tile_k


def _launch_partial(
    x: torch.Tensor, delta: torch.Tensor | None, w_down: torch.Tensor, chunk: int, block_m: int, block_k: int
) -> torch.Tensor:
    """The bottleneck's launch: ``[cdiv(D, chunk), M, R]`` fp32 shares of ``(x + delta) @ w_down.T`` (``x``
    alone where ``delta`` is None; contiguous operands), a program a ``block_m`` tokens and ``chunk`` columns."""
    m, d = x.shape
    r = w_down.shape[0]
    splits = cdiv(d, chunk)
    ws = torch.empty((splits, m, r), dtype=torch.float32, device=x.device)
    if m:
        triton_router_partial_kernel[(cdiv(m, block_m), splits)](
            x, x if delta is None else delta, w_down, ws, m, d, r, chunk, x.stride(0),
            DOT_PRECISION=router_precision(m), BLOCK_M=block_m, BLOCK_K=block_k,
            BLOCK_R=max(16, next_power_of_2(r)), HAS_DELTA=delta is not None,
            **pdl_launch(triton_router_partial_kernel, x.device),
        )  # fmt: skip
    return ws


def triton_router_shares(
    x: torch.Tensor,
    w_down: torch.Tensor,
    delta: torch.Tensor | None = None,
    *,
    columns: int | None = None,
    block_m: int | None = None,
    block_k: int | None = None,
) -> torch.Tensor:
    """The router's first launch on its own: the shares ``[cdiv(D, columns), M, R]`` (fp32) of
    ``(x + delta) @ w_down.T`` (``x: [M, D]``; ``delta`` as ``x`` or None; the sum rounded to the dtype as
    the residual add rounds it), a share a ``columns`` columns of D (default ``policy.ROUTER_SHARE_COLUMNS``;
    a multiple of 16), what :func:`triton_router_norm_from_shares` decides from while it adds and
    normalises, so that a block with no shares handed on runs two launches before its first product (this,
    then the decision with the add and the norm) where it ran three (the add and norm, and the router's
    two). ``block_m`` / ``block_k``: as :func:`triton_router_decide`'s (``block_k`` dividing ``columns``)."""
    if triton is None:
        raise RuntimeError("triton is not installed")
    m, d = x.shape if x.dim() == 2 else (0, 0)
    if (
        x.dim() != 2
        or w_down.dim() != 2
        or w_down.shape[1] != d
        or w_down.dtype != torch.float32
        or (delta is not None and (delta.shape != x.shape or delta.dtype != x.dtype))
    ):
        shapes = ", ".join(f"{tuple(t.shape)} {t.dtype}" for t in (x, w_down, *([] if delta is None else [delta])))
        raise ValueError(f"router shares' tensors do not fit (x, w_down[, delta]): {shapes}")
    check_blocks(block_m=(block_m, 16), block_k=(block_k, 16))
    chunk = policy.ROUTER_SHARE_COLUMNS if columns is None else columns
    if chunk < 16 or chunk % 16:
        raise ValueError(f"columns must be a positive multiple of 16, got {chunk}")
    if block_k is not None and chunk % block_k:
        raise ValueError(f"block_k must divide the share's {chunk} columns, got {block_k}")
    block_m, tile_k = _partial_tile(m, block_m, block_k)
    return _launch_partial(
        x.contiguous(),
        None if delta is None else delta.contiguous(),
        w_down.contiguous(),
        chunk,
        block_m,
        gcd(tile_k, chunk),  # a power of two dividing the share: a step never straddles two shares
    )


def triton_router_decide(
    x: torch.Tensor,
    w_down: torch.Tensor,
    b_down: torch.Tensor,
    w_up: torch.Tensor,
    b_up: torch.Tensor,
    *,
    split: int | None = None,
    block_g: int | None = None,
    block_m: int | None = None,
    block_k: int | None = None,
    finish: str | None = None,
    as_bool: bool = False,
    margin: bool = False,
    counts: torch.Tensor | None = None,
) -> torch.Tensor:
    """Triton version of :func:`torch_router_decide` for any M: the bottleneck over ``split`` shares of
    D (default ``router_split``), then the launch that adds them in a fixed order and decides, with
    ``block_g`` groups a program (a power of two, at least 16; default up to 32). ``block_m`` tokens
    and ``block_k`` columns of D a step (powers of two, at least 16; default 16 and 128 at decode
    sizes, else ``policy.ROUTER_PREFILL_TILE``). ``finish``: the deciding launch's shape, "tile" or
    "token" (module docstring; default ``router_finish``). ``as_bool``: the decision stored as bytes and
    returned as a bool mask (what the routed operators read as it is). ``counts``: fp64 ``[2]`` the
    decision is counted into (module docstring)."""
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
    if finish not in (None, *FINISHES):
        raise ValueError(f"finish must be one of {', '.join(FINISHES)}, got {finish!r}")
    check_blocks(block_g=(block_g, 16), block_m=(block_m, 16), block_k=(block_k, 16))
    check_counts(counts, x.device)
    _check_margin(margin, counts)
    as_bool = as_bool and not margin  # (the margins are fp32)
    w_down, b_down, w_up, b_up = (t.contiguous() for t in fp32)
    block_m, block_k = _partial_tile(m, block_m, block_k)
    splits = router_split(m, d, block_m, block_k) if split is None else split
    chunk = cdiv(cdiv(d, splits), block_k) * block_k  # whole K steps per share
    splits = cdiv(d, chunk)  # no empty share
    block_g = block_g or min(32, max(16, next_power_of_2(groups)))
    grid = (cdiv(m, block_m), cdiv(groups, block_g))
    precision = router_precision(m)
    ws = _launch_partial(x.contiguous(), None, w_down, chunk, block_m, block_k)
    if (finish or router_finish(m)) == "token":  # the decision from the workspace's shares, a program a token
        return triton_router_decide_from_shares(
            ws, b_down, w_up, b_up, block_g=block_g, as_bool=as_bool, margin=margin, counts=counts
        )
    out = torch.empty((m, groups), dtype=torch.uint8 if as_bool else torch.float32, device=x.device)
    triton_router_finish_kernel[grid](
        ws, b_down, w_up, b_up, out, out if counts is None else counts, m, r, groups, out.stride(0), splits,
        DOT_PRECISION=precision, BLOCK_M=block_m, BLOCK_R=max(16, next_power_of_2(r)), BLOCK_G=block_g,
        COUNT=counts is not None, MARGIN=margin, **pdl_launch(triton_router_finish_kernel, x.device),
    )  # fmt: skip
    return out.view(torch.bool) if as_bool else out


def checked_shares(shares, b_down, w_up, b_up, block_g: int, counts) -> tuple[int, int, int, int]:
    """``(S, M, R, G)`` of a decision from shares; an error where Triton is missing or they do not fit."""
    if triton is None:
        raise RuntimeError("triton is not installed")
    s, m, r = shares.shape
    groups = w_up.shape[0] // 2
    fp32 = (shares, b_down, w_up, b_up)
    if (
        b_down.shape != (r,)
        or w_up.shape != (2 * groups, r)
        or b_up.shape != (2 * groups,)
        or any(t.dtype != torch.float32 for t in fp32)
    ):
        shapes = ", ".join(f"{tuple(t.shape)} {t.dtype}" for t in fp32)
        raise ValueError(f"router tensors do not fit (shares, b_down, w_up, b_up): {shapes}")
    check_blocks(block_g=(block_g, 1))
    check_counts(counts, shares.device)
    return s, m, r, groups


def check_norm_operands(m: int, x: torch.Tensor, delta: torch.Tensor, norm_w: torch.Tensor) -> None:
    """The residual add and norm's operands fit ``m`` tokens: ``x, delta: [M, D]`` of one dtype, ``norm_w: [D]``."""
    if (
        x.dim() != 2
        or x.shape[0] != m
        or delta.shape != x.shape
        or delta.dtype != x.dtype
        or norm_w.shape != x.shape[1:]
    ):
        shapes = ", ".join(f"{tuple(t.shape)} {t.dtype}" for t in (x, delta, norm_w))
        raise ValueError(f"norm tensors do not fit {m} tokens' shares (x, delta, norm_w): {shapes}")


def triton_router_decide_from_shares(
    shares: torch.Tensor,
    b_down: torch.Tensor,
    w_up: torch.Tensor,
    b_up: torch.Tensor,
    *,
    block_g: int = 32,
    as_bool: bool = False,
    margin: bool = False,
    counts: torch.Tensor | None = None,
) -> torch.Tensor:
    """Triton version of :func:`torch_router_decide_from_shares`, in one launch: program (token,
    ``block_g`` groups; a power of two). Made for decode sizes (each program reads all S shares of
    its token). ``margin`` and ``counts``: as :func:`triton_router_decide`'s."""
    s, m, r, groups = checked_shares(shares, b_down, w_up, b_up, block_g, counts)
    _check_margin(margin, counts)
    as_bool = as_bool and not margin  # (the margins are fp32)
    shares, b_down, w_up, b_up = (t.contiguous() for t in (shares, b_down, w_up, b_up))
    out = torch.empty((m, groups), dtype=torch.uint8 if as_bool else torch.float32, device=shares.device)
    if m:
        triton_router_shares_kernel[(m, cdiv(groups, block_g))](
            shares, b_down, w_up, b_up, out, out if counts is None else counts, s, m, r, groups, out.stride(0),
            BLOCK_S=next_power_of_2(s), BLOCK_R=next_power_of_2(r), BLOCK_G=block_g, COUNT=counts is not None,
            MARGIN=margin, **pdl_launch(triton_router_shares_kernel, shares.device),
        )  # fmt: skip
    return out.view(torch.bool) if as_bool else out


def triton_router_norm_from_shares(
    shares: torch.Tensor,
    b_down: torch.Tensor,
    w_up: torch.Tensor,
    b_up: torch.Tensor,
    x: torch.Tensor,
    delta: torch.Tensor,
    norm_w: torch.Tensor,
    eps: float,
    *,
    block_g: int = 32,
    margin: bool = False,
    counts: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Triton version of :func:`torch_router_norm_from_shares`, in one launch: program (token, ``block_g``
    groups) decides as :func:`triton_router_decide_from_shares` does (and counts into ``counts``; or
    stores the margins, fp32, with ``margin``), one program a token adds and normalises its row. Made
    for decode sizes, and run up to ``policy.ROUTER_TOKEN_FINISH_MAX_M`` tokens on a router's own shares
    (:func:`triton_router_shares`), where a program a token is the faster deciding shape."""
    s, m, r, groups = checked_shares(shares, b_down, w_up, b_up, block_g, counts)
    _check_margin(margin, counts)
    check_norm_operands(m, x, delta, norm_w)
    shares, b_down, w_up, b_up = (t.contiguous() for t in (shares, b_down, w_up, b_up))
    x, delta, norm_w = x.contiguous(), delta.contiguous(), norm_w.contiguous()
    d = x.shape[1]
    out = torch.empty((m, groups), dtype=torch.float32 if margin else torch.uint8, device=shares.device)
    x_new, h = torch.empty_like(x), torch.empty_like(x)
    if m:
        triton_router_norm_shares_kernel[(m, cdiv(groups, block_g) + 1)](
            shares, b_down, w_up, b_up, out, out if counts is None else counts, x, delta, norm_w, x_new, h,
            s, m, r, groups, d, out.stride(0), eps,
            BLOCK_S=next_power_of_2(s), BLOCK_R=next_power_of_2(r), BLOCK_G=block_g, BLOCK_D=next_power_of_2(d),
            COUNT=counts is not None, MARGIN=margin, **pdl_launch(triton_router_norm_shares_kernel, x.device),
        )  # fmt: skip
    return (out if margin else out.view(torch.bool)), x_new, h
