"""Reduction-width masked GEMM (o_proj, down_proj): the inputs of inactive groups contribute nothing.

    x:    [M, K]        tokens, flattened
    w:    [N, K]        as in nn.Linear
    mask: [M, K / G]    True = the token's group of K / G input features is active
    out:  [M, N]        the sum over active groups of x[:, group] @ w[:, group].T

The Triton kernel is the decode path. Program (block of output channels, tile of 16 tokens) reads
only the weight columns of groups some token of its tile needs, ``K_PACK`` groups a step in one
product whose rows are the weight rows once per group of the step and whose columns are the
tokens once per group (zero where the token does not need it); the blocks where the groups differ
are dropped (``packed_diagonal``). One program an output block: no partial sums leave it. It finds
the groups itself: by default it compacts them into a list first; for few, wide groups
(``direct``: o_proj's 8 of 512 inputs) it steps through all groups in order and predicates off the
weights of those no token needs, which saves the list's chain of dependent reads.

With ``shares`` the kernel also hands the next block its router's first product: the block's
caller adds the output to the residual, so each program, holding its output columns whole, adds
them to the residual itself (rounded as that add rounds) and writes that slice's share of the next
router's bottleneck, ``x_next[:, cols] @ w_down[:, cols].T`` in fp32, into slot
``program * BLOCK_N / SHARE_N`` of ``[S, M, R]`` (``S = N / SHARE_N``; zeros in the slots a wider
program spans beyond its first). The next router then needs only its decision's launch.

Rows that agree in tiles (a decode batch's shared set under consensus; a prefill tile under tile-coherent
routing) take ``triton_tile_reduce_gemm``: each tile's rows in one MMA tile by the union of their groups'
weight columns, each row's input read only in its own groups; the K steps of a tile's output block split
among ``SPLIT_K`` programs where few tiles would leave the weight streamed by too few (a decode batch), the
fp32 partial sums then added and rounded by a second launch.

At prefill sizes ``auto`` takes the dense fallback (``dense_masked_reduce_gemm``, cuBLAS): exact,
as inactive inputs are zero, and the plain dense product where the input already is (after the
fused SwiGLU kernel or the routed attention).
"""

from __future__ import annotations

import torch

from compresskit_wide.kernels import policy
from compresskit_wide.kernels.common import (
    cdiv,
    check_blocks,
    dot_precision,
    interpreted,
    mask_bytes,
    next_power_of_2,
    pdl_launch,
    zero_inactive_groups,
)

try:
    import triton
    import triton.language as tl

    from compresskit_wide.kernels.autotune import autotuned, packed_pruner
    from compresskit_wide.kernels.common import packed_diagonal, pdl_enter
except ImportError:
    triton = None


def torch_group_masked_input(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Reference masking: ``x: [..., K]``, ``mask: [..., G]`` (1 = active; may carry straight-through
    gradients) -> ``x`` with each inactive group of K / G features exactly zero."""
    groups = mask.shape[-1]
    if x.shape[-1] % groups:
        raise ValueError(f"last axis {x.shape[-1]} is not divisible into {groups} groups")
    return (x.unflatten(-1, (groups, x.shape[-1] // groups)) * mask.unsqueeze(-1).to(x.dtype)).flatten(-2)


def torch_masked_reduce_gemm(x: torch.Tensor, w: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Reference: zero the inactive input groups, then the dense product in fp32."""
    return (torch_group_masked_input(x.float(), mask) @ w.float().T).to(x.dtype)


def share_slots(n: int) -> int:
    """The shares of a bottleneck over ``n`` input columns: one a ``policy.SHARE_N`` columns."""
    return cdiv(n, policy.SHARE_N)


def torch_router_shares(x_next: torch.Tensor, w_down: torch.Tensor, columns: int | None = None) -> torch.Tensor:
    """Reference: the shares ``[S, M, R]`` of ``x_next @ w_down.T`` (``x_next: [M, N]``, ``w_down:
    [R, N]`` fp32) over slices of ``columns`` columns (default ``policy.SHARE_N``), in fp32."""
    m, n = x_next.shape
    columns = columns or policy.SHARE_N
    pad = cdiv(n, columns) * columns - n
    x = torch.nn.functional.pad(x_next.float(), (0, pad)).unflatten(-1, (-1, columns))  # [M, S, columns]
    w = torch.nn.functional.pad(w_down, (0, pad)).unflatten(-1, (-1, columns))  # [R, S, columns]
    return torch.einsum("msk,rsk->smr", x, w)


def dense_masked_reduce_gemm(
    x: torch.Tensor, w: torch.Tensor, mask: torch.Tensor, *, input_is_masked: bool = False
) -> torch.Tensor:
    """The dense fallback: one select (whatever the inactive inputs held), then cuBLAS in ``x.dtype``;
    with ``input_is_masked`` (the caller guarantees exact zeros there) the plain dense product."""
    return x @ w.T if input_is_masked else zero_inactive_groups(x, mask) @ w.T


if triton is not None:

    @triton.jit
    def tile_group_list(mask_ptr, list_ptr, tm, tn, rows, row_ok, G, stride_mm, BLOCK_G: tl.constexpr):
        """The groups some token of the tile ``rows`` needs (its mask rows ORed), compacted in order
        into program (tn, tm)'s slice of the scratch buffer ``list_ptr``, visible to all the
        program's threads on return. Returns ``(its list, their count)``."""
        gs = tl.arange(0, BLOCK_G)
        flags = tl.load(
            mask_ptr + rows[:, None] * stride_mm + gs[None, :], mask=row_ok[:, None] & (gs < G)[None, :], other=0
        )
        on = tl.max((flags != 0).to(tl.int32), axis=0)  # [BLOCK_G]: some token of the tile needs group g
        n_active = tl.sum(on, axis=0)
        my_list = list_ptr + (tm * tl.num_programs(0) + tn) * BLOCK_G
        tl.store(my_list + tl.cumsum(on, axis=0) - on, gs, mask=on != 0)
        tl.debug_barrier()  # the list is written by all the program's threads, read by each
        return my_list, n_active

    @triton.jit
    def packed_group_step(
        acc, x_ptr, w_ptr, tok, g_x, x_on, w_rows, g_w, w_on, k0, GW: tl.constexpr, stride_xm, stride_wn,
        DOT_PRECISION: tl.constexpr, BLOCK_K: tl.constexpr,
    ):  # fmt: skip
        """One K step of the packed reduction: ``acc`` [rows, columns] plus the weight rows ``w_rows``
        of groups ``g_w`` (read where ``w_on``) against the token columns ``tok`` of groups ``g_x``
        (read where ``x_on``, else zero), inputs ``k0`` to ``k0 + BLOCK_K`` of each group."""
        kk = tl.arange(0, BLOCK_K)
        k_ok = (k0 + kk) < GW
        a = tl.load(
            x_ptr + tok.to(tl.int64)[:, None] * stride_xm + (g_x * GW + k0)[:, None] + kk[None, :],
            mask=x_on[:, None] & k_ok[None, :],
            other=0.0,
        )
        b = tl.load(
            w_ptr + w_rows[:, None] * stride_wn + (g_w * GW + k0)[:, None] + kk[None, :],
            mask=w_on[:, None] & k_ok[None, :],
            other=0.0,
        )
        return tl.dot(b, tl.trans(a), acc, input_precision=DOT_PRECISION)

    @triton.jit
    def triton_masked_reduce_gemm_kernel(
        x_ptr, w_ptr, mask_ptr, out_ptr, list_ptr, res_ptr, sw_ptr, sh_ptr,
        M, N, GW: tl.constexpr, G, R,
        stride_xm, stride_wn, stride_mm, stride_om, stride_rm,
        DOT_PRECISION: tl.constexpr, BLOCK_G: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, K_PACK: tl.constexpr,
        DIRECT: tl.constexpr, SHARES: tl.constexpr, SHARE_N: tl.constexpr, BLOCK_R: tl.constexpr,
        PDL: tl.constexpr = False,
    ):  # fmt: skip
        # program (n-block tn, token tile tm). MMA row c * BLOCK_N + j: output channel j against the
        # step's c-th group; MMA column c * BLOCK_M + m: token m's inputs of that group (zero where
        # it does not need it). DIRECT: the step's groups are consecutive ones, one flat loop over
        # (group step, K step) that the compiler pipelines as one stream; else the list's groups,
        # a group's K steps unrolled (GW is a compile-time constant).
        pdl_enter(PDL)
        tn = tl.program_id(0)
        tm = tl.program_id(1)
        rows = tm * BLOCK_M + tl.arange(0, BLOCK_M)
        row_ok = rows < M
        r = tl.arange(0, K_PACK * BLOCK_N)
        w_rows = tn * BLOCK_N + r % BLOCK_N
        w_ok = w_rows < N
        c = tl.arange(0, K_PACK * BLOCK_M)
        tok = tm * BLOCK_M + c % BLOCK_M
        tok_ok = tok < M
        acc = tl.zeros((K_PACK * BLOCK_N, K_PACK * BLOCK_M), dtype=tl.float32)
        if DIRECT:
            STEPS: tl.constexpr = (GW + BLOCK_K - 1) // BLOCK_K  # K steps a group
            for t in range(0, tl.cdiv(G, K_PACK) * STEPS):
                i = (t // STEPS) * K_PACK
                g_w = i + r // BLOCK_N  # each weight row's group
                w_in = w_ok & (g_w < G)
                flags = tl.load(
                    mask_ptr + rows[None, :] * stride_mm + g_w[:, None], mask=row_ok[None, :] & w_in[:, None], other=0
                )
                w_on = w_in & (tl.max((flags != 0).to(tl.int32), axis=1) != 0)  # some token needs it
                g_x = i + c // BLOCK_M  # each token column's group
                x_in = tok_ok & (g_x < G)
                x_on = x_in & (tl.load(mask_ptr + tok * stride_mm + g_x, mask=x_in, other=0) != 0)
                acc = packed_group_step(
                    acc, x_ptr, w_ptr, tok, g_x, x_on, w_rows, g_w, w_on, (t % STEPS) * BLOCK_K, GW, stride_xm,
                    stride_wn, DOT_PRECISION, BLOCK_K,
                )  # fmt: skip
        else:
            my_list, n_active = tile_group_list(mask_ptr, list_ptr, tm, tn, rows, row_ok, G, stride_mm, BLOCK_G)
            for i in range(0, n_active, K_PACK):
                w_live = i + r // BLOCK_N < n_active
                g_w = tl.load(my_list + i + r // BLOCK_N, mask=w_live, other=0)  # each weight row's group
                x_live = i + c // BLOCK_M < n_active
                g_x = tl.load(my_list + i + c // BLOCK_M, mask=x_live, other=0)  # each token column's group
                need = tl.load(mask_ptr + tok * stride_mm + g_x, mask=tok_ok & x_live, other=0) != 0
                x_on = tok_ok & x_live & need
                for k0 in tl.static_range(0, GW, BLOCK_K):
                    acc = packed_group_step(
                        acc, x_ptr, w_ptr, tok, g_x, x_on, w_rows, g_w, w_ok & w_live, k0, GW, stride_xm, stride_wn,
                        DOT_PRECISION, BLOCK_K,
                    )  # fmt: skip
        out = tl.trans(packed_diagonal(acc, K_PACK, BLOCK_N, BLOCK_M))
        cols = tn * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = cols < N
        in_tile = row_ok[:, None] & col_ok[None, :]
        y = out.to(out_ptr.dtype.element_ty)
        rows64 = rows.to(tl.int64)  # the kernel runs at any M under backend "triton": M x N may pass 2**31
        tl.store(out_ptr + rows64[:, None] * stride_om + cols[None, :], y, mask=in_tile)
        if SHARES:
            store_next_shares(
                y, res_ptr, sw_ptr, sh_ptr, rows, rows64, row_ok, cols, col_ok, tn, M, N, R, stride_rm,
                BLOCK_M, BLOCK_N, SHARE_N, BLOCK_R,
            )  # fmt: skip

    @triton.jit
    def store_next_shares(
        y, res_ptr, sw_ptr, sh_ptr, rows, rows64, row_ok, cols, col_ok, tn, M, N, R, stride_rm,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SHARE_N: tl.constexpr, BLOCK_R: tl.constexpr,
    ):  # fmt: skip
        """The next router's shares of this program's output block ``y`` ([BLOCK_M, BLOCK_N], rounded):
        ``x_next = residual + y`` (rounded as the caller's add rounds), ``x_next @ w_down[:, cols].T`` in fp32
        into slot ``tn * BLOCK_N / SHARE_N`` of ``[S, M, R]``, zeros in the slots the block spans beyond it."""
        tl.static_assert(BLOCK_N % SHARE_N == 0, "a program's output block spans whole share slots")
        in_tile = row_ok[:, None] & col_ok[None, :]
        res = tl.load(res_ptr + rows64[:, None] * stride_rm + cols[None, :], mask=in_tile, other=0.0)
        x_next = (res.to(tl.float32) + y.to(tl.float32)).to(y.dtype).to(tl.float32)
        slot = tn * (BLOCK_N // SHARE_N)
        # R in chunks, so that the broadcast product stays within about 4k values a program
        R_STEP: tl.constexpr = min(BLOCK_R, max(1, 4096 // (BLOCK_M * BLOCK_N)))
        for r0 in tl.static_range(0, BLOCK_R, R_STEP):
            rs = r0 + tl.arange(0, R_STEP)
            r_ok = rs < R
            wr = tl.load(sw_ptr + rs[:, None] * N + cols[None, :], mask=r_ok[:, None] & col_ok[None, :], other=0.0)
            share = tl.sum(x_next[:, None, :] * wr[None, :, :], axis=2)  # [BLOCK_M, R_STEP]
            keep = row_ok[:, None] & r_ok[None, :]
            tl.store(sh_ptr + (slot * M + rows)[:, None] * R + rs[None, :], share, mask=keep)
            for j in tl.static_range(1, BLOCK_N // SHARE_N):  # the slots this program spans beyond its first
                in_n = (slot + j) * SHARE_N + 0 * rs < N  # (the last program's may lie past N: no such slot)
                zeros = tl.zeros_like(share)
                at = sh_ptr + ((slot + j) * M + rows)[:, None] * R + rs[None, :]
                tl.store(at, zeros, mask=keep & in_n[None, :])

    @triton.jit
    def triton_tile_reduce_kernel(
        x_ptr, w_ptr, mask_ptr, list_ptr, part_ptr, out_ptr, M, N, GW: tl.constexpr, G,
        stride_xm, stride_wn, stride_mm, SPLIT_K, SEQ, TILE, TILES_PER_SEQ,
        DOT_PRECISION: tl.constexpr, BLOCK_G: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, ONE_SPLIT: tl.constexpr,
        ROW_MASKS: tl.constexpr, WIDE_ROWS: tl.constexpr,
        PDL: tl.constexpr = False,
    ):  # fmt: skip
        # program (n-block tn, split sk, tile tt): the tile's rows (TILE consecutive rows of one sequence of SEQ)
        # by the union of their groups, each row's input read only in its own groups (ROW_MASKS; without, the
        # caller guarantees the rows agree); its share of the union's K steps. ONE_SPLIT: the sums go to out in
        # its dtype; else fp32 partial sums to slot sk of part [SPLIT_K, M, N]
        pdl_enter(PDL)
        tn = tl.program_id(0)
        sk = tl.program_id(1)
        tt = tl.program_id(2)
        i = tl.arange(0, BLOCK_M)
        first = (tt % TILES_PER_SEQ) * TILE
        rows = (tt // TILES_PER_SEQ) * SEQ + first + i
        row_ok = (i < TILE) & (first + i < SEQ)
        rows64 = rows
        if WIDE_ROWS:  # a prefill whose M x K or M x N passes 2**31: 64-bit row offsets
            rows64 = rows.to(tl.int64)
        my_list, n_active = tile_group_list(
            mask_ptr, list_ptr, tt * SPLIT_K + sk, tn, rows, row_ok, G, stride_mm, BLOCK_G
        )
        STEPS: tl.constexpr = (GW + BLOCK_K - 1) // BLOCK_K  # K steps a group
        total = n_active * STEPS
        per = tl.cdiv(total, SPLIT_K)
        cols = tn * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = cols < N
        kk = tl.arange(0, BLOCK_K)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for t in range(sk * per, tl.minimum(total, sk * per + per)):
            g = tl.load(my_list + t // STEPS)
            k_in = (t % STEPS) * BLOCK_K + kk
            k_ok = k_in < GW
            x_on = row_ok
            if ROW_MASKS:
                x_on = x_on & (tl.load(mask_ptr + rows * stride_mm + g, mask=row_ok, other=0) != 0)
            a = tl.load(
                x_ptr + rows64[:, None] * stride_xm + (g * GW + k_in)[None, :],
                mask=x_on[:, None] & k_ok[None, :],
                other=0.0,
            )
            b = tl.load(
                w_ptr + cols[:, None] * stride_wn + (g * GW + k_in)[None, :],
                mask=col_ok[:, None] & k_ok[None, :],
                other=0.0,
            )
            acc = tl.dot(a, tl.trans(b), acc, input_precision=DOT_PRECISION)
        keep = row_ok[:, None] & col_ok[None, :]
        if ONE_SPLIT:
            tl.store(out_ptr + rows64[:, None] * N + cols[None, :], acc.to(out_ptr.dtype.element_ty), mask=keep)
        else:
            tl.store(part_ptr + (sk * M + rows64)[:, None] * N + cols[None, :], acc, mask=keep)

    @triton.jit
    def triton_split_sum_kernel(part_ptr, out_ptr, SIZE, SPLIT_K, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
        """``out = sum(part, axis 0)`` rounded to the output's dtype; ``part: [SPLIT_K, SIZE]`` fp32."""
        pdl_enter(PDL)
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        ok = offs < SIZE
        acc = tl.zeros((BLOCK,), dtype=tl.float32)
        for sk in range(0, SPLIT_K):
            acc += tl.load(part_ptr + sk * SIZE + offs, mask=ok, other=0.0)
        tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=ok)

    @triton.jit
    def triton_split_sum_shares_kernel(
        part_ptr, out_ptr, res_ptr, sw_ptr, sh_ptr, M, N, R, SPLIT_K, stride_rm,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SHARE_N: tl.constexpr, BLOCK_R: tl.constexpr,
        PDL: tl.constexpr = False,
    ):  # fmt: skip
        # program (n-block tn, row block tm): the partial sums ``part: [SPLIT_K, M, N]`` fp32 of its block added
        # and rounded into out, then the next router's shares of that block (store_next_shares)
        pdl_enter(PDL)
        tn = tl.program_id(0)
        rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
        row_ok = rows < M
        rows64 = rows.to(tl.int64)
        cols = tn * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = cols < N
        in_tile = row_ok[:, None] & col_ok[None, :]
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for sk in range(0, SPLIT_K):
            acc += tl.load(part_ptr + (sk * M + rows64)[:, None] * N + cols[None, :], mask=in_tile, other=0.0)
        y = acc.to(out_ptr.dtype.element_ty)
        tl.store(out_ptr + rows64[:, None] * N + cols[None, :], y, mask=in_tile)
        store_next_shares(
            y, res_ptr, sw_ptr, sh_ptr, rows, rows64, row_ok, cols, col_ok, tn, M, N, R, stride_rm,
            BLOCK_M, BLOCK_N, SHARE_N, BLOCK_R,
        )  # fmt: skip

    _tuned = {
        (pack, direct): autotuned(
            triton_masked_reduce_gemm_kernel,
            policy.per_packing(policy.REDUCE_DECODE_ROWS, pack),
            ["M", "N", "GW", "G", "BLOCK_M"],
            decode=True,
            prune=packed_pruner("BLOCK_K", unrolled_group=not direct),  # the list's loop unrolls a group's K steps
        )
        for pack in (policy.REDUCE_K_PACK,)  # the packing ``auto`` takes
        for direct in (False, True)
    }


WIDE_OFFSETS = 2**31  # from this many elements a row offset needs 64 bits (the tile reduction's WIDE_ROWS)


def _checked_shapes(x: torch.Tensor, w: torch.Tensor, mask: torch.Tensor) -> tuple[int, int, int, int]:
    """``(M, K, N, G)`` of a reduction's operands; an error where Triton is missing or they do not fit."""
    if triton is None:
        raise RuntimeError("triton is not installed")
    m, k = x.shape
    n, groups = w.shape[0], mask.shape[-1]
    if w.shape[1] != k or k % groups or mask.shape[0] != m:
        raise ValueError(f"shapes do not fit: x {tuple(x.shape)}, w {tuple(w.shape)}, mask {tuple(mask.shape)}")
    return m, k, n, groups


def _hands_on(m: int, n: int, residual: torch.Tensor | None, share_w: torch.Tensor | None) -> bool:
    """Whether a reduction hands the next router its shares: both of ``residual`` ([M, N]) and ``share_w``
    ([R, N] fp32) given (neither: no); an error where one is missing or off."""
    if residual is None and share_w is None:
        return False
    if (
        residual is None
        or share_w is None
        or residual.shape != (m, n)
        or share_w.dim() != 2
        or share_w.shape[1] != n
        or share_w.dtype != torch.float32
    ):
        shapes = [None if t is None else (tuple(t.shape), t.dtype) for t in (residual, share_w)]
        raise ValueError(f"shares need residual [M, N] = [{m}, {n}] and share_w [R, {n}] fp32; got {shapes}")
    return True


def _share_operands(
    m: int, n: int, residual: torch.Tensor, share_w: torch.Tensor, shares: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(residual, share_w, shares)`` as the kernels read them: contiguous, and the shares' buffer
    ``[S, M, R]`` fp32 (a new one, or ``shares`` checked)."""
    r = share_w.shape[0]
    if shares is None:
        shares = torch.empty((share_slots(n), m, r), dtype=torch.float32, device=residual.device)
    elif shares.shape != (share_slots(n), m, r) or shares.dtype != torch.float32 or not shares.is_contiguous():
        raise ValueError(f"shares must be a contiguous fp32 [{share_slots(n)}, {m}, {r}], got {tuple(shares.shape)}")
    return residual.contiguous(), share_w.contiguous(), shares


def triton_masked_reduce_gemm(
    x: torch.Tensor,
    w: torch.Tensor,
    mask: torch.Tensor,
    *,
    out: torch.Tensor | None = None,
    block_n: int | None = None,
    block_k: int | None = None,
    k_pack: int = policy.REDUCE_K_PACK,
    direct: bool | None = None,
    residual: torch.Tensor | None = None,
    share_w: torch.Tensor | None = None,
    shares: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Triton version of :func:`torch_masked_reduce_gemm`, for any M (in tiles of 16 tokens; made for
    decode). ``k_pack``: active groups a product (a power of two; autotuned on a GPU at
    ``policy.REDUCE_K_PACK``, any with fixed tiles). ``direct``: step through every
    group instead of a list of the needed ones; default for ``policy.FEW_GROUPS`` groups or fewer.
    Tiles are autotuned on a GPU; ``block_n`` (output channels a program) and ``block_k`` fix them
    (and do in the CPU interpreter). With ``residual`` (``[M, N]``, what the output is added to) and
    ``share_w`` (the next router's ``w_down``, ``[R, N]`` fp32): ``(out, shares)``, the shares
    ``[S, M, R]`` of the next router's bottleneck (module docstring; ``shares``: a buffer for them)."""
    m, k, n, groups = _checked_shapes(x, w, mask)
    if k_pack < 1 or k_pack & (k_pack - 1):
        raise ValueError(f"k_pack must be a power of two, got {k_pack}")
    handing = _hands_on(m, n, residual, share_w)
    direct = groups <= policy.FEW_GROUPS if direct is None else direct
    x, w = x.contiguous(), w.contiguous()
    mask_u8 = mask_bytes(mask)
    out = torch.empty((m, n), dtype=x.dtype, device=x.device) if out is None else out
    gw = k // groups
    block_m = min(16, max(next_power_of_2(m), 16 // k_pack))  # >= 16 MMA columns
    block_g = max(16, next_power_of_2(groups))
    fixed = block_n is not None or interpreted()
    if fixed:
        bn = block_n or max(16 // k_pack, policy.SHARE_N if handing else 1)
        bk = block_k or min(32, max(16, next_power_of_2(gw)))
        if k_pack * bn < 16 or bk < 16:
            raise ValueError(f"block_n={bn} x k_pack={k_pack} and block_k={bk}: tl.dot needs 16 or more of each")
    elif (k_pack, direct) not in _tuned:
        raise ValueError(f"k_pack={k_pack} has no tile table on a GPU; tuned: {policy.REDUCE_K_PACK} (or fix block_n)")
    else:  # the narrowest tile of the table: the most programs, each with its own group list
        bn = min(meta["BLOCK_N"] for meta, _, _ in policy.per_packing(policy.REDUCE_DECODE_ROWS, k_pack))
    if handing and bn % policy.SHARE_N:
        raise ValueError(f"shares need output blocks of a multiple of {policy.SHARE_N} channels, got {bn}")
    lists = torch.empty(1 if direct else cdiv(n, bn) * cdiv(m, block_m) * block_g, dtype=torch.int32, device=x.device)
    r = share_w.shape[0] if handing else 1
    if handing:
        residual, share_w, shares = _share_operands(m, n, residual, share_w, shares)
    args = (x, w, mask_u8, out, lists, residual if handing else x, share_w if handing else x)
    args += (shares if handing else x, m, n, gw, groups, r, x.stride(0), w.stride(0), mask_u8.stride(0), out.stride(0))
    args += (residual.stride(0) if handing else 0,)
    common = {"DOT_PRECISION": dot_precision(x.dtype), "BLOCK_G": block_g, "BLOCK_M": block_m, "DIRECT": direct}
    common |= {
        "SHARES": handing,
        "SHARE_N": policy.SHARE_N,
        "BLOCK_R": next_power_of_2(r),
        **pdl_launch(triton_masked_reduce_gemm_kernel, x.device),
    }
    if fixed:
        grid = (cdiv(n, bn), cdiv(m, block_m))
        triton_masked_reduce_gemm_kernel[grid](*args, **common, BLOCK_N=bn, BLOCK_K=bk, K_PACK=k_pack)
    else:
        grid = lambda cfg: (cdiv(n, cfg["BLOCK_N"]), cdiv(m, block_m))  # noqa: E731
        _tuned[(k_pack, direct)][grid](*args, **common, K_PACK=k_pack)
    return (out, shares) if handing else out


def triton_tile_reduce_gemm(
    x: torch.Tensor,
    w: torch.Tensor,
    mask: torch.Tensor,
    *,
    tile: int | None = None,
    tokens: int | None = None,
    rows_agree: bool = False,
    split_k: int | None = None,
    block_n: int | None = None,
    block_k: int | None = None,
    warps: int | None = None,
    stages: int | None = None,
    residual: torch.Tensor | None = None,
    share_w: torch.Tensor | None = None,
    sum_tile: tuple[int, int, int] | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """:func:`torch_masked_reduce_gemm` for rows that agree in tiles: each tile of ``tile`` consecutive rows of
    a sequence of ``tokens`` rows (``x``'s rows are sequences of ``tokens`` one after another; the last tile of
    each may be short) reads the weight columns of the union of its rows' groups once, each row's input only in
    its own groups, so the result is exact for any mask and reads least where a tile's rows share one set: a
    decode batch's shared set (default: all rows one tile) or a prefill tile under tile-coherent routing;
    tiles of more than 128 rows run as tiles of 128. ``rows_agree``: the caller guarantees that every row of a
    tile has the same mask (a decode batch's shared set), so no row's own mask is read. ``split_k``: programs
    a tile's output block's K steps are split among (default ``policy.shared_reduce_splits``: few tiles,
    several; many, one); ``block_n``, ``block_k``, ``warps``, ``stages``: the launch (defaults
    ``policy.SHARED_REDUCE_TILE``; 16-wide in the CPU interpreter). With ``residual`` and ``share_w`` (as
    :func:`triton_masked_reduce_gemm`'s): ``(out, shares)``, the second launch adding the partial sums then
    writing the next router's shares of each output block (``triton_split_sum_shares_kernel``); ``sum_tile``:
    that launch's (rows, output columns, warps) a program (default ``policy.SHARED_SUM_TILE``, the rows at most
    the next power of two of ``M``; both powers of two, the columns at least ``policy.SHARE_N``)."""
    m, k, n, groups = _checked_shapes(x, w, mask)
    handing = _hands_on(m, n, residual, share_w)
    tokens = tokens or m
    if m % tokens or (tile is not None and tile < 1):
        raise ValueError(f"rows {m} are no whole sequences of {tokens}, or a tile of {tile} rows is none")
    tile = min(tile or tokens, 128)  # a larger tile in MMA tiles of 128 rows, each reading its own rows' union
    x, w = x.contiguous(), w.contiguous()
    mask_u8 = mask_bytes(mask)
    gw = k // groups
    tile_n, tile_k, tile_warps, tile_stages = policy.SHARED_REDUCE_TILE
    if interpreted():
        tile_n, tile_k = 16, min(32, max(16, next_power_of_2(gw)))
    bn, bk = block_n or tile_n, block_k or min(tile_k, max(16, next_power_of_2(gw)))
    if bn < 16 or bk < 16:
        raise ValueError(f"block_n={bn} and block_k={bk}: tl.dot needs 16 or more of each")
    n_blocks, per_seq = cdiv(n, bn), cdiv(tokens, tile)
    tiles = per_seq * (m // tokens)
    splits = split_k or policy.shared_reduce_splits(n_blocks * tiles, groups * cdiv(gw, bk))
    block_g = max(16, next_power_of_2(groups))
    lists = torch.empty(n_blocks * splits * tiles * block_g, dtype=torch.int32, device=x.device)
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    one_split = splits == 1 and not handing  # the shares come from the second launch: partial sums first
    part = out if one_split else torch.empty((splits, m, n), dtype=torch.float32, device=x.device)
    triton_tile_reduce_kernel[(n_blocks, splits, tiles)](
        x, w, mask_u8, lists, part, out, m, n, gw, groups, x.stride(0), w.stride(0), mask_u8.stride(0), splits,
        tokens, tile, per_seq, DOT_PRECISION=dot_precision(x.dtype), BLOCK_G=block_g,
        BLOCK_M=max(16, next_power_of_2(tile)), BLOCK_N=bn, BLOCK_K=bk, ONE_SPLIT=one_split, ROW_MASKS=not rows_agree,
        WIDE_ROWS=max(m * x.stride(0), splits * m * n) >= WIDE_OFFSETS,
        num_warps=warps or tile_warps, num_stages=stages or tile_stages,
        **pdl_launch(triton_tile_reduce_kernel, x.device),
    )  # fmt: skip
    if handing:
        residual, share_w, shares = _share_operands(m, n, residual, share_w, None)
        r = share_w.shape[0]
        sum_m, sum_n, sum_warps = sum_tile or policy.SHARED_SUM_TILE
        check_blocks(sum_tile_rows=(sum_m, 1), sum_tile_columns=(sum_n, policy.SHARE_N))  # whole share slots
        sum_m = min(sum_m, next_power_of_2(m))
        triton_split_sum_shares_kernel[(cdiv(n, sum_n), cdiv(m, sum_m))](
            part, out, residual, share_w, shares, m, n, r, splits, residual.stride(0),
            BLOCK_M=sum_m, BLOCK_N=sum_n, SHARE_N=policy.SHARE_N, BLOCK_R=next_power_of_2(r), num_warps=sum_warps,
            **pdl_launch(triton_split_sum_shares_kernel, x.device),
        )  # fmt: skip
        return out, shares
    if splits > 1:
        size, block = m * n, 1024
        triton_split_sum_kernel[(cdiv(size, block),)](
            part, out, size, splits, BLOCK=block, **pdl_launch(triton_split_sum_kernel, x.device)
        )
    return out
