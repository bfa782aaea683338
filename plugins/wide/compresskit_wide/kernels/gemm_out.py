"""Output-width masked GEMM (q; gate and up with the SwiGLU fused in).

    x:    [M, K]        tokens, flattened
    w:    [N, K]        as in nn.Linear (w_up: the same, for the fused SwiGLU)
    mask: [M, G]        True = the token needs this group of GW = (N - dense_rows) / G output channels
    out:  [M, N]        x @ w.T (or silu(x @ w.T) * (x @ w_up.T)) where active, exactly 0 elsewhere

``dense_rows``: the last rows of ``w`` are not routed but run for every token, in groups of GW
after the G routed ones (k and v stacked under q: one product instead of two).

Prefill (M > 16): program (tile, group) takes one tile of the group's tokens in the routing
layout's sorted order, active first. A tile with no active token writes zeros without reading a
weight; in the one partial tile the inactive rows are not read. A group's tiles launch together, so
that the programs running at once share its weight rows in L2 (gate+up's weights are five times the
L2).

Decode (M <= 16): program (group, block of output channels) reads the mask column itself (no
layout) and skips the weights of a group no token needs. The weight tile is the MMA's row operand
(64 or more rows: Hopper's warp-group MMA; 16 token rows could not use it), and ``K_PACK`` chunks
of K share one product: weight row ``c * BLOCK_N + j`` is channel j's chunk c, token column
``c * BLOCK_M + m`` token m's chunk c, and the diagonal blocks are kept (``packed_diagonal``). A
program then holds few output channels, so enough programs stream the weight without splitting K.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from compresskit_wide.kernels import policy
from compresskit_wide.kernels.common import (
    cdiv,
    dot_precision,
    interpreted,
    m_bucket,
    mask_bytes,
    next_power_of_2,
    zero_inactive_groups,
)
from compresskit_wide.kernels.layout import triton_routing_layout

try:
    import triton
    import triton.language as tl

    from compresskit_wide.kernels.autotune import autotuned, packed_pruner, prune_wider_than_group
    from compresskit_wide.kernels.common import packed_diagonal
except ImportError:
    triton = None


def routed_rows(w: torch.Tensor, mask: torch.Tensor, w_up: torch.Tensor | None, dense_rows: int) -> int:
    """The rows of ``w`` the mask routes (``N - dense_rows``), checked: they split into the mask's
    groups, and only the plain product takes dense rows."""
    routed = w.shape[0] - dense_rows
    if dense_rows < 0 or routed <= 0 or routed % mask.shape[-1]:
        rows = f"N={w.shape[0]}" + (f" less dense_rows={dense_rows}" if dense_rows else "")
        raise ValueError(f"{rows} does not split into {mask.shape[-1]} groups")
    if dense_rows and w_up is not None:
        raise ValueError("dense_rows is for the plain product, not the fused SwiGLU")
    return routed


def _zero_routed(y: torch.Tensor, mask: torch.Tensor, routed: int) -> torch.Tensor:
    """``y`` with the inactive groups of its first ``routed`` columns exactly 0, the rest as they are."""
    if routed == y.shape[-1]:
        return zero_inactive_groups(y, mask)
    return torch.cat([zero_inactive_groups(y[:, :routed], mask), y[:, routed:]], dim=-1)


def torch_masked_out_gemm(
    x: torch.Tensor, w: torch.Tensor, mask: torch.Tensor, w_up: torch.Tensor | None = None, dense_rows: int = 0
) -> torch.Tensor:
    """Reference: the masked dense product in fp32, cast to ``x.dtype``."""
    routed = routed_rows(w, mask, w_up, dense_rows)
    y = x.float() @ w.float().T
    if w_up is not None:
        y = F.silu(y) * (x.float() @ w_up.float().T)
    return _zero_routed(y, mask, routed).to(x.dtype)


def dense_masked_out_gemm(
    x: torch.Tensor,
    w: torch.Tensor,
    mask: torch.Tensor,
    w_up: torch.Tensor | None = None,
    *,
    zero_inactive=True,
    dense_rows: int = 0,
) -> torch.Tensor:
    """The dense fallback: cuBLAS in ``x.dtype``, then the inactive groups zeroed (left as computed
    with ``zero_inactive=False``, for a caller that never reads them)."""
    routed = routed_rows(w, mask, w_up, dense_rows)
    y = x @ w.T
    if w_up is not None:
        y = F.silu(y) * (x @ w_up.T)
    return _zero_routed(y, mask, routed) if zero_inactive else y


if triton is not None:

    @triton.jit
    def triton_masked_out_gemm_kernel(
        x_ptr, w_ptr, wu_ptr, out_ptr, order_ptr, counts_ptr,
        M, N, K, GW, G, LAUNCHED, M_BUCKET,
        stride_xm, stride_wn, stride_om,
        FUSE_SWIGLU: tl.constexpr, DOT_PRECISION: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    ):  # fmt: skip
        # prefill, program (i, g): i = tile of group g's sorted tokens x block of its channels (the
        # channel block fastest), g = one of the LAUNCHED groups (slowest); a group past the G routed
        # ones (dense rows) takes every token in order. M_BUCKET is only the autotuning key.
        tiles_n = tl.cdiv(GW, BLOCK_N)
        g = tl.program_id(0) // (tl.cdiv(M, BLOCK_M) * tiles_n)
        i = tl.program_id(0) % (tl.cdiv(M, BLOCK_M) * tiles_n)
        routed = g < G
        tm = i // tiles_n
        tn = i % tiles_n
        g_routed = tl.minimum(g, G - 1)  # where a dense-rows group reads (and then ignores) the layout
        count = tl.where(routed, tl.load(counts_ptr + g_routed), M)
        slots = tm * BLOCK_M + tl.arange(0, BLOCK_M)
        in_range = slots < M
        rows = tl.load(order_ptr + g_routed * M + slots, mask=in_range, other=0)  # token ids, active first
        rows = tl.where(routed, rows, slots)
        active = slots < count
        cols = g * GW + tn * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = ((tn * BLOCK_N + tl.arange(0, BLOCK_N)) < GW) & (cols < N)
        out_ptrs = out_ptr + rows[:, None] * stride_om + cols[None, :]
        store_mask = in_range[:, None] & col_ok[None, :]
        if tm * BLOCK_M >= count:  # the tile's first sorted token is inactive: so are the others
            tl.store(out_ptrs, tl.zeros((BLOCK_M, BLOCK_N), dtype=out_ptr.dtype.element_ty), mask=store_mask)
        else:
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for k0 in range(0, K, BLOCK_K):
                ks = k0 + tl.arange(0, BLOCK_K)
                k_ok = ks < K
                a = tl.load(
                    x_ptr + rows[:, None] * stride_xm + ks[None, :], mask=active[:, None] & k_ok[None, :], other=0.0
                )
                w_mask = col_ok[:, None] & k_ok[None, :]
                b = tl.load(w_ptr + cols[:, None] * stride_wn + ks[None, :], mask=w_mask, other=0.0)
                acc = tl.dot(a, tl.trans(b), acc, input_precision=DOT_PRECISION)
                if FUSE_SWIGLU:
                    bu = tl.load(wu_ptr + cols[:, None] * stride_wn + ks[None, :], mask=w_mask, other=0.0)
                    acc_up = tl.dot(a, tl.trans(bu), acc_up, input_precision=DOT_PRECISION)
            if FUSE_SWIGLU:
                acc = acc * tl.sigmoid(acc) * acc_up
            acc = tl.where(active[:, None], acc, 0.0)
            tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=store_mask)

    @triton.jit
    def triton_masked_out_gemv_kernel(
        x_ptr, w_ptr, wu_ptr, out_ptr, mask_ptr,
        M, N, K, GW, G,
        stride_xm, stride_wn, stride_om, stride_mm,
        FUSE_SWIGLU: tl.constexpr, DOT_PRECISION: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, K_PACK: tl.constexpr,
    ):  # fmt: skip
        # decode, program (g, n-block): BLOCK_N output channels of group g for every token (past the
        # G routed groups, dense rows: every token)
        g = tl.program_id(0)
        g_routed = tl.minimum(g, G - 1)  # where a dense-rows group reads (and then ignores) the mask
        col0 = tl.program_id(1) * BLOCK_N
        rows = tl.arange(0, BLOCK_M)
        flags = tl.load(mask_ptr + rows * stride_mm + g_routed, mask=rows < M, other=0)
        on = (tl.where(g < G, flags, 1) != 0) & (rows < M)
        cols = g * GW + col0 + tl.arange(0, BLOCK_N)
        out_ptrs = out_ptr + rows[:, None] * stride_om + cols[None, :]
        store_mask = (rows < M)[:, None] & (((col0 + tl.arange(0, BLOCK_N)) < GW) & (cols < N))[None, :]
        if tl.sum(on.to(tl.int32), axis=0) == 0:  # no token needs the group: zeros, no weight read
            tl.store(out_ptrs, tl.zeros((BLOCK_M, BLOCK_N), dtype=out_ptr.dtype.element_ty), mask=store_mask)
        else:
            r = tl.arange(0, K_PACK * BLOCK_N)  # MMA row: channel r % BLOCK_N, chunk r // BLOCK_N
            w_rows = g * GW + col0 + r % BLOCK_N
            w_ok = ((col0 + r % BLOCK_N) < GW) & (w_rows < N)
            w_k = (r // BLOCK_N) * BLOCK_K
            c = tl.arange(0, K_PACK * BLOCK_M)  # MMA column: token c % BLOCK_M, chunk c // BLOCK_M
            tok = c % BLOCK_M
            tok_flags = tl.load(mask_ptr + tok * stride_mm + g_routed, mask=tok < M, other=0)
            tok_on = (tl.where(g < G, tok_flags, 1) != 0) & (tok < M)
            x_k = (c // BLOCK_M) * BLOCK_K
            kk = tl.arange(0, BLOCK_K)
            acc = tl.zeros((K_PACK * BLOCK_N, K_PACK * BLOCK_M), dtype=tl.float32)
            acc_up = tl.zeros((K_PACK * BLOCK_N, K_PACK * BLOCK_M), dtype=tl.float32)
            for k0 in range(0, K, K_PACK * BLOCK_K):
                kx = k0 + x_k[:, None] + kk[None, :]
                a = tl.load(x_ptr + tok[:, None] * stride_xm + kx, mask=tok_on[:, None] & (kx < K), other=0.0)
                kw = k0 + w_k[:, None] + kk[None, :]
                w_mask = w_ok[:, None] & (kw < K)
                b = tl.load(w_ptr + w_rows[:, None] * stride_wn + kw, mask=w_mask, other=0.0)
                acc = tl.dot(b, tl.trans(a), acc, input_precision=DOT_PRECISION)
                if FUSE_SWIGLU:
                    bu = tl.load(wu_ptr + w_rows[:, None] * stride_wn + kw, mask=w_mask, other=0.0)
                    acc_up = tl.dot(bu, tl.trans(a), acc_up, input_precision=DOT_PRECISION)
            y = packed_diagonal(acc, K_PACK, BLOCK_N, BLOCK_M)
            if FUSE_SWIGLU:
                y = y * tl.sigmoid(y) * packed_diagonal(acc_up, K_PACK, BLOCK_N, BLOCK_M)
            y = tl.where(on[:, None], tl.trans(y), 0.0)
            tl.store(out_ptrs, y.to(out_ptr.dtype.element_ty), mask=store_mask)

    @triton.jit
    def _tile_rows(order_ptr, tile, cnt, ends, per_g, gs, M, G, BLOCK_M: tl.constexpr, TILES_N):
        """Tile ``tile`` of the active-tile list (group-major, channel block fastest): its group, its
        token slots' rows (the layout's order; a dense-rows group: in order), which of them are
        active and in range, and its channel block."""
        g = tl.sum((ends <= tile).to(tl.int32), axis=0)
        local = tile - tl.sum(tl.where(gs == g, ends - per_g, 0), axis=0)
        count = tl.sum(tl.where(gs == g, cnt, 0), axis=0)
        slots = (local // TILES_N) * BLOCK_M + tl.arange(0, BLOCK_M)
        in_range = slots < M
        rows = tl.load(
            order_ptr + tl.minimum(g, G - 1) * M + slots, mask=in_range, other=0
        )  # (read, unused, by dense rows)
        rows = tl.where(g < G, rows, slots)
        return g, rows, in_range, slots < count, local % TILES_N

    @triton.jit
    def _tile_product(
        x_ptr, w_ptr, rows, active, g, tn, k_begin, k_end, K, GW, N, stride_xm, stride_wn,
        DOT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    ):  # fmt: skip
        """K steps ``k_begin`` to ``k_end`` of the tile's product, fp32: ``(acc, cols, col_ok)``."""
        cols = g * GW + tn * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = ((tn * BLOCK_N + tl.arange(0, BLOCK_N)) < GW) & (cols < N)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for kb in range(k_begin, k_end):
            ks = kb * BLOCK_K + tl.arange(0, BLOCK_K)
            k_ok = ks < K
            a = tl.load(
                x_ptr + rows[:, None] * stride_xm + ks[None, :], mask=active[:, None] & k_ok[None, :], other=0.0
            )
            b = tl.load(
                w_ptr + cols[:, None] * stride_wn + ks[None, :], mask=col_ok[:, None] & k_ok[None, :], other=0.0
            )
            acc = tl.dot(a, tl.trans(b), acc, input_precision=DOT_PRECISION)
        return acc, cols, col_ok

    @triton.jit
    def triton_masked_out_gemm_streamk_kernel(
        x_ptr, w_ptr, out_ptr, order_ptr, counts_ptr, ws_ptr, flag_ptr,
        M, N, K, GW, G, LAUNCHED, PROGRAMS,
        stride_xm, stride_wn, stride_om,
        DOT_PRECISION: tl.constexpr, BLOCK_G: tl.constexpr, SK_ROUNDS: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    ):  # fmt: skip
        # prefill, data-parallel rounds then stream-K: the active tiles (those with an active token), in
        # a list, go whole to the programs, one a program a round, for as many full rounds of PROGRAMS
        # tiles as there are less SK_ROUNDS; the K steps of the tiles left over are split evenly over the
        # programs, so that no round runs on a few SMs while the others idle. A tile split between
        # programs is finished by the one that holds its last K steps: the others each write their fp32
        # part to their workspace slot first thing and raise their flag; it adds them last, after its
        # whole tiles. It waits only on lower programs, which start before it and wait on nobody before
        # writing.
        pid = tl.program_id(0)
        gs = tl.arange(0, BLOCK_G)
        cnt = tl.load(counts_ptr + gs, mask=gs < G, other=0)
        cnt = tl.where(gs < G, cnt, tl.where(gs < LAUNCHED, M, 0))  # dense-rows groups: every token
        tiles_n = tl.cdiv(GW, BLOCK_N)
        per_g = tl.cdiv(cnt, BLOCK_M) * tiles_n
        ends = tl.cumsum(per_g, axis=0)
        iters = tl.cdiv(K, BLOCK_K)
        n_tiles = tl.sum(per_g, axis=0)
        dp = tl.maximum(n_tiles // PROGRAMS - SK_ROUNDS, 0) * PROGRAMS  # tiles run whole, in rounds
        total = (n_tiles - dp) * iters  # the K steps split over the programs
        start = (pid * total) // PROGRAMS
        stop = ((pid + 1) * total) // PROGRAMS
        first, k_first = dp + start // iters, start % iters
        last = dp + tl.maximum(stop - 1, 0) // iters
        k_last = stop - (last - dp) * iters  # K steps of `last` held
        ws = (
            ws_ptr + pid * BLOCK_M * BLOCK_N + tl.arange(0, BLOCK_M)[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
        )
        full_begin = first + (k_first > 0)
        full_end = tl.where(stop > start, last + (k_last == iters), full_begin)
        if stop > start:
            # 1. the leading K steps of a tile another program finishes: this program's part, out first
            if (k_last < iters) & ((first < last) | (k_first == 0)):
                g, rows, in_range, active, tn = _tile_rows(
                    order_ptr, last, cnt, ends, per_g, gs, M, G, BLOCK_M, tiles_n
                )
                acc, cols, col_ok = _tile_product(
                    x_ptr, w_ptr, rows, active, g, tn, 0, k_last, K, GW, N, stride_xm, stride_wn,
                    DOT_PRECISION, BLOCK_M, BLOCK_N, BLOCK_K,
                )  # fmt: skip
                tl.store(ws, acc)
                tl.atomic_xchg(flag_ptr + pid, 1)
                full_end = last
            elif (first == last) & (k_first > 0) & (k_last < iters):  # steps inside one tile: a middle part
                g, rows, in_range, active, tn = _tile_rows(
                    order_ptr, first, cnt, ends, per_g, gs, M, G, BLOCK_M, tiles_n
                )
                acc, cols, col_ok = _tile_product(
                    x_ptr, w_ptr, rows, active, g, tn, k_first, k_last, K, GW, N, stride_xm, stride_wn,
                    DOT_PRECISION, BLOCK_M, BLOCK_N, BLOCK_K,
                )  # fmt: skip
                tl.store(ws, acc)
                tl.atomic_xchg(flag_ptr + pid, 1)
                full_end = full_begin
        # 2. this program's share of the tiles no token of which is active: zeros, no weight read
        zero_g = (tl.cdiv(tl.where(gs < LAUNCHED, M, 0), BLOCK_M) - tl.cdiv(cnt, BLOCK_M)) * tiles_n
        zero_ends = tl.cumsum(zero_g, axis=0)
        for z in range(pid, tl.sum(zero_g, axis=0), PROGRAMS):
            g = tl.sum((zero_ends <= z).to(tl.int32), axis=0)
            local = z - tl.sum(tl.where(gs == g, zero_ends - zero_g, 0), axis=0)
            count = tl.sum(tl.where(gs == g, cnt, 0), axis=0)
            slots = tl.cdiv(count, BLOCK_M) * BLOCK_M + (local // tiles_n) * BLOCK_M + tl.arange(0, BLOCK_M)
            in_range = slots < M
            rows = tl.load(order_ptr + tl.minimum(g, G - 1) * M + slots, mask=in_range, other=0)
            tn = local % tiles_n
            cols = g * GW + tn * BLOCK_N + tl.arange(0, BLOCK_N)
            col_ok = ((tn * BLOCK_N + tl.arange(0, BLOCK_N)) < GW) & (cols < N)
            zeros = tl.zeros((BLOCK_M, BLOCK_N), dtype=out_ptr.dtype.element_ty)
            tl.store(
                out_ptr + rows[:, None] * stride_om + cols[None, :], zeros, mask=in_range[:, None] & col_ok[None, :]
            )
        # 3. whole tiles: this program's one a data-parallel round, then those inside its K steps
        for j in range(0, dp // PROGRAMS + tl.maximum(full_end - full_begin, 0)):
            t = tl.where(j < dp // PROGRAMS, pid + j * PROGRAMS, full_begin + j - dp // PROGRAMS)
            g, rows, in_range, active, tn = _tile_rows(order_ptr, t, cnt, ends, per_g, gs, M, G, BLOCK_M, tiles_n)
            acc, cols, col_ok = _tile_product(
                x_ptr, w_ptr, rows, active, g, tn, 0, iters, K, GW, N, stride_xm, stride_wn,
                DOT_PRECISION, BLOCK_M, BLOCK_N, BLOCK_K,
            )  # fmt: skip
            acc = tl.where(active[:, None], acc, 0.0)
            tl.store(out_ptr + rows[:, None] * stride_om + cols[None, :], acc.to(out_ptr.dtype.element_ty),
                     mask=in_range[:, None] & col_ok[None, :])  # fmt: skip
        # 4. the trailing K steps of a tile begun by lower programs: their parts added, the tile finished
        if (stop > start) & (k_first > 0) & ((first < last) | (k_last == iters)):
            g, rows, in_range, active, tn = _tile_rows(order_ptr, first, cnt, ends, per_g, gs, M, G, BLOCK_M, tiles_n)
            acc, cols, col_ok = _tile_product(
                x_ptr, w_ptr, rows, active, g, tn, k_first, iters, K, GW, N, stride_xm, stride_wn,
                DOT_PRECISION, BLOCK_M, BLOCK_N, BLOCK_K,
            )  # fmt: skip
            # the program holding the tile's first K step, then each after it up to this one
            q = (((first - dp) * iters + 1) * PROGRAMS - 1) // total
            while q < pid:
                if ((q + 1) * total) // PROGRAMS > (q * total) // PROGRAMS:  # (some programs hold no step)
                    while tl.atomic_cas(flag_ptr + q, 1, 0) != 1:  # taken, and lowered for the next call
                        pass
                    part = ws_ptr + q * BLOCK_M * BLOCK_N + tl.arange(0, BLOCK_M)[:, None] * BLOCK_N
                    acc += tl.load(part + tl.arange(0, BLOCK_N)[None, :], cache_modifier=".cg")
                q += 1
            acc = tl.where(active[:, None], acc, 0.0)
            tl.store(out_ptr + rows[:, None] * stride_om + cols[None, :], acc.to(out_ptr.dtype.element_ty),
                     mask=in_range[:, None] & col_ok[None, :])  # fmt: skip

    _tuned_prefill = autotuned(
        triton_masked_out_gemm_kernel,
        policy.OUT_PREFILL,
        ["M_BUCKET", "N", "K", "GW", "FUSE_SWIGLU"],
        decode=False,
        prune=prune_wider_than_group("BLOCK_N"),
    )
    _decode_key = ["M", "N", "K", "GW", "FUSE_SWIGLU", "BLOCK_M"]
    _tuned_decode = {
        pack: autotuned(
            triton_masked_out_gemv_kernel,
            policy.per_packing(policy.PACKED_DECODE_ROWS, pack),
            _decode_key,
            decode=True,
            prune=packed_pruner("BLOCK_N"),
        )
        for pack in (2, 4, 8)
    }
    _tuned_decode[1] = autotuned(
        triton_masked_out_gemv_kernel,
        policy.SWIGLU_DECODE,
        _decode_key,
        decode=True,
        prune=prune_wider_than_group("BLOCK_N"),
    )


def triton_masked_out_gemm(
    x: torch.Tensor,
    w: torch.Tensor,
    mask: torch.Tensor,
    w_up: torch.Tensor | None = None,
    *,
    dense_rows: int = 0,
    layout: tuple[torch.Tensor, torch.Tensor] | None = None,
    out: torch.Tensor | None = None,
    block_m: int | None = None,
    block_n: int | None = None,
    block_k: int | None = None,
    k_pack: int | None = None,
    stream_k: bool = False,
    programs: int | None = None,
    sk_rounds: int = 0,
) -> torch.Tensor:
    """Triton version of :func:`torch_masked_out_gemm`. Up to ``policy.DECODE_MAX_M`` tokens the
    decode kernel (``k_pack``: K chunks a product, a power of two; default ``policy.out_k_pack``);
    more, the sorted-tile kernel on the routing layout of ``mask`` (``layout``: computed here when
    not given; share it between the projections of a block). ``dense_rows``: the last rows of ``w``
    run for every token. Tiles are autotuned on a GPU; ``block_*`` fix them (and do in the CPU
    interpreter). ``stream_k`` (prefill, the plain product): the active tiles run whole in rounds of
    ``programs`` (default: one an SM; tile ``policy.OUT_STREAM_K`` on a GPU), one a program, and the
    K steps of the tiles left over (those of the last ``sk_rounds`` full rounds too) are split evenly
    over the programs, for token counts whose active tiles fill the SMs unevenly; calls on one device
    must not overlap (they share a workspace)."""
    if triton is None:
        raise RuntimeError("triton is not installed")
    m, k = x.shape
    n = w.shape[0]
    groups = mask.shape[-1]
    if w.shape[1] != k or mask.shape[0] != m or (w_up is not None and w_up.shape != w.shape):
        raise ValueError(f"shapes do not fit: x {tuple(x.shape)}, w {tuple(w.shape)}, mask {tuple(mask.shape)}")
    gw = routed_rows(w, mask, w_up, dense_rows) // groups
    launched = groups + cdiv(dense_rows, gw)  # the routed groups, then the dense rows in groups of gw
    fuse = w_up is not None
    x, w = x.contiguous(), w.contiguous()
    w_up = w_up.contiguous() if fuse else w
    out = torch.empty((m, n), dtype=x.dtype, device=x.device) if out is None else out
    common = {"FUSE_SWIGLU": fuse, "DOT_PRECISION": dot_precision(x.dtype)}
    fixed = block_n is not None or interpreted()
    if m <= policy.DECODE_MAX_M:
        k_pack = policy.out_k_pack(m, fuse) if k_pack is None else k_pack
        if k_pack < 1 or k_pack & (k_pack - 1):
            raise ValueError(f"k_pack must be a power of two, got {k_pack}")
        mask_u8 = mask_bytes(mask)
        args = (x, w, w_up, out, mask_u8, m, n, k, gw, groups)
        args += (x.stride(0), w.stride(0), out.stride(0), mask_u8.stride(0))
        common["BLOCK_M"] = min(16, max(next_power_of_2(m), 16 // k_pack))  # >= 16 MMA columns
        if fixed:
            bn, bk = block_n or max(16 // k_pack, 1), block_k or 32
            if k_pack * bn < 16 or bk < 16:
                raise ValueError(f"block_n={bn} x k_pack={k_pack} and block_k={bk}: tl.dot needs 16 or more of each")
            grid = (launched, cdiv(gw, bn))
            triton_masked_out_gemv_kernel[grid](*args, **common, BLOCK_N=bn, BLOCK_K=bk, K_PACK=k_pack)
        else:
            if k_pack not in _tuned_decode:
                raise ValueError(f"k_pack={k_pack} has no tile table on a GPU; tuned: {sorted(_tuned_decode)}")
            grid = lambda meta: (launched, cdiv(gw, meta["BLOCK_N"]))  # noqa: E731
            _tuned_decode[k_pack][grid](*args, **common, K_PACK=k_pack)
        return out
    if k_pack not in (None, 1):
        raise ValueError(f"k_pack is for the decode kernel (M <= {policy.DECODE_MAX_M}); got M={m}")
    order, counts = layout if layout is not None else triton_routing_layout(mask)
    if order.shape != (groups, m) or not order.is_contiguous():
        raise ValueError(f"layout order must be a contiguous [G, M] = [{groups}, {m}] tensor, got {tuple(order.shape)}")
    if stream_k:
        if fuse:
            raise ValueError("stream_k is for the plain product, not the fused SwiGLU")
        meta, warps, stages = policy.OUT_STREAM_K
        bm, bn, bk = (
            (block_m or 16, block_n or 16, block_k or 16)
            if fixed
            else (meta["BLOCK_M"], meta["BLOCK_N"], meta["BLOCK_K"])
        )
        if programs is None:
            programs = 3 if interpreted() else torch.cuda.get_device_properties(x.device).multi_processor_count
        if programs < 1 or sk_rounds < 0:
            raise ValueError(f"stream_k needs programs >= 1 and sk_rounds >= 0, got {programs} and {sk_rounds}")
        ws, flags = _stream_k_buffers(x.device, programs, bm, bn)
        triton_masked_out_gemm_streamk_kernel[(programs,)](
            x, w, out, order, counts, ws, flags, m, n, k, gw, groups, launched, programs,
            x.stride(0), w.stride(0), out.stride(0),
            DOT_PRECISION=common["DOT_PRECISION"], BLOCK_G=max(16, next_power_of_2(launched)), SK_ROUNDS=sk_rounds,
            BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, **({} if fixed else {"num_warps": warps, "num_stages": stages}),
        )  # fmt: skip
        return out
    args = (x, w, w_up, out, order, counts, m, n, k, gw, groups, launched, m_bucket(m))
    args += (x.stride(0), w.stride(0), out.stride(0))
    if fixed:
        bm, bn, bk = block_m or 16, block_n or 32, block_k or 32
        grid = (cdiv(m, bm) * cdiv(gw, bn) * launched,)
        triton_masked_out_gemm_kernel[grid](*args, **common, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk)
    else:
        grid = lambda meta: (cdiv(m, meta["BLOCK_M"]) * cdiv(gw, meta["BLOCK_N"]) * launched,)  # noqa: E731
        _tuned_prefill[grid](*args, **common)
    return out


_STREAM_K: dict = {}


def _stream_k_buffers(device: torch.device, programs: int, bm: int, bn: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The stream-K kernel's workspace (an fp32 tile a program) and flags (zero between calls: each
    raised flag is lowered by the program that takes its part), allocated once per device and size."""
    key = (str(device), programs, bm, bn)
    if key not in _STREAM_K:
        with torch.inference_mode(False):
            _STREAM_K[key] = (
                torch.empty(programs * bm * bn, dtype=torch.float32, device=device),
                torch.zeros(programs, dtype=torch.int32, device=device),
            )
    return _STREAM_K[key]
