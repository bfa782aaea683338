"""Output-width masked GEMM (q projection; gate and up with a fused SwiGLU epilogue).

    x:    [M, K]        tokens, flattened
    w:    [N, K]        as in nn.Linear (w_up: the same, for the fused SwiGLU)
    mask: [M, N / G]    True = the token needs this group of G output channels
    out:  [M, N]        x @ w.T (or silu(x @ w.T) * (x @ w_up.T)) where active, exactly 0 elsewhere

Prefill: the kernel works on the routing layout (``layout.py``): program (g, tile, n-block) takes
the tile's tokens in group g's sorted order. A tile whose first sorted token is inactive only
writes zeros and never reads a weight (block-level skipping); in the one partial tile, loads of
inactive rows are predicated off (intra-block skipping). Every output element is written, so the
result needs no zero-filled buffer.

Decode (M <= 16): a GEMV-style kernel, program (g, n-block) with all tokens in one tile, reads
the mask column of its group itself (no layout prep at all); the weight blocks of groups no
token needs are never read. For q, chunks of K share one product (``packed_output_tile``), so that
a program holds few output channels and enough programs stream the weight without splitting K.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from compresskit_wide.kernels import tuning
from compresskit_wide.kernels.layout import mask_bytes, triton_routing_layout
from compresskit_wide.kernels.reference import zero_inactive_groups

try:
    import triton
    import triton.language as tl

    from compresskit_wide.kernels.gemm_reduce import (
        packed_diagonal,
        store_share,
        store_share_ticketed,
        tile_dot,
        triton_split_sum_kernel,
        zeroed_tickets,
    )
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
    return zero_inactive_groups(y, mask).to(x.dtype)


if triton is not None:

    @triton.jit
    def output_tile(
        x_ptr, w_ptr, wu_ptr, rows, row_on, cols, col_ok, k_start, k_end, stride_xm, stride_wn,
        FUSE_SWIGLU: tl.constexpr, DOT_PRECISION: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SWAP_AB: tl.constexpr,
    ):  # fmt: skip
        """``x[rows, k_start:k_end] @ w[cols, k_start:k_end].T`` in fp32 (with ``FUSE_SWIGLU``, gate and
        up against the same loaded ``x`` tile, then ``silu(gate) * up``). Rows not ``row_on`` are
        never read: their products come out zero (SiLU of zero times zero), the caller masks them.
        ``SWAP_AB``: the products are accumulated transposed (``tile_dot``), returned as [M, N]."""
        acc = tl.zeros((BLOCK_N, BLOCK_M) if SWAP_AB else (BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_up = tl.zeros((BLOCK_N, BLOCK_M) if SWAP_AB else (BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(k_start, k_end, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            k_ok = ks < k_end
            a = tl.load(
                x_ptr + rows[:, None] * stride_xm + ks[None, :], mask=row_on[:, None] & k_ok[None, :], other=0.0
            )
            w_mask = col_ok[:, None] & k_ok[None, :]
            b = tl.load(w_ptr + cols[:, None] * stride_wn + ks[None, :], mask=w_mask, other=0.0)
            acc = tile_dot(a, b, acc, DOT_PRECISION, SWAP_AB)
            if FUSE_SWIGLU:
                bu = tl.load(wu_ptr + cols[:, None] * stride_wn + ks[None, :], mask=w_mask, other=0.0)
                acc_up = tile_dot(a, bu, acc_up, DOT_PRECISION, SWAP_AB)
        if FUSE_SWIGLU:
            acc = acc * tl.sigmoid(acc) * acc_up
        if SWAP_AB:
            acc = tl.trans(acc)
        return acc

    @triton.jit
    def write_output_block(
        x_ptr, w_ptr, wu_ptr, out_ptr, rows, row_ok, row_on, any_on, cols, col_ok, K,
        stride_xm, stride_wn, stride_om,
        FUSE_SWIGLU: tl.constexpr, DOT_PRECISION: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SWAP_AB: tl.constexpr,
    ):  # fmt: skip
        """Write one output block: zeros without reading a weight when no row is on (``any_on``
        false: the skip), else the product (``output_tile``) with the rows not on zeroed."""
        out_ptrs = out_ptr + rows[:, None] * stride_om + cols[None, :]
        store_mask = row_ok[:, None] & col_ok[None, :]
        if any_on:
            acc = output_tile(
                x_ptr, w_ptr, wu_ptr, rows, row_on, cols, col_ok, 0, K, stride_xm, stride_wn,
                FUSE_SWIGLU, DOT_PRECISION, BLOCK_M, BLOCK_N, BLOCK_K, SWAP_AB,
            )  # fmt: skip
            tl.store(out_ptrs, tl.where(row_on[:, None], acc, 0.0).to(out_ptr.dtype.element_ty), mask=store_mask)
        else:
            tl.store(out_ptrs, tl.zeros((BLOCK_M, BLOCK_N), dtype=out_ptr.dtype.element_ty), mask=store_mask)

    @triton.jit
    def decode_tile(mask_ptr, M, GW, stride_mm, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
        """Program (g, n-block) of a decode kernel: every token in one tile, read straight from the
        mask. Returns ``(rows, row_ok, on, cols, col_ok)``."""
        g = tl.program_id(0)
        tn = tl.program_id(1)
        rows = tl.arange(0, BLOCK_M)
        row_ok = rows < M
        on = (tl.load(mask_ptr + rows * stride_mm + g, mask=row_ok, other=0) != 0) & row_ok
        cols = g * GW + tn * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = (tn * BLOCK_N + tl.arange(0, BLOCK_N)) < GW
        return rows, row_ok, on, cols, col_ok

    @triton.jit
    def packed_output_tile(
        x_ptr, w_ptr, wu_ptr, mask_ptr, g, M, K, col0, n_left, stride_xm, stride_wn, stride_mm,
        FUSE_SWIGLU: tl.constexpr, DOT_PRECISION: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, K_PACK: tl.constexpr,
    ):  # fmt: skip
        """``x[:M] @ w[col0 : col0 + BLOCK_N].T`` (the first ``n_left`` of those rows; with
        ``FUSE_SWIGLU`` the SwiGLU of gate and up) in fp32 as [BLOCK_M, BLOCK_N], for a decode
        product with few output rows a program: each step takes K_PACK chunks of BLOCK_K columns.
        The MMA's rows are the BLOCK_N weight rows once per chunk (row ``c * BLOCK_N + j``: row j's
        chunk c), its columns the tokens once per chunk (column ``c * BLOCK_M + m``: token m's chunk
        c), so one product of K_PACK * BLOCK_N rows (64 or more: Hopper's warp-group MMA) does the
        work of K_PACK programs splitting K, and the blocks where the chunks differ are dropped at the
        end (``packed_diagonal``): no partial sums leave the program, no second pass adds them.
        Tokens that do not need group ``g`` are never read (their columns load zeros)."""
        r = tl.arange(0, K_PACK * BLOCK_N)
        w_rows = col0 + r % BLOCK_N
        w_ok = (r % BLOCK_N) < n_left
        w_k = (r // BLOCK_N) * BLOCK_K  # the chunk's first column within a step
        c = tl.arange(0, K_PACK * BLOCK_M)
        tok = c % BLOCK_M
        tok_on = (tl.load(mask_ptr + tok * stride_mm + g, mask=tok < M, other=0) != 0) & (tok < M)
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
        out = packed_diagonal(acc, K_PACK, BLOCK_N, BLOCK_M)
        if FUSE_SWIGLU:
            out = out * tl.sigmoid(out) * packed_diagonal(acc_up, K_PACK, BLOCK_N, BLOCK_M)
        return tl.trans(out)

    @triton.jit
    def triton_masked_out_gemm_kernel(
        x_ptr, w_ptr, wu_ptr, out_ptr, order_ptr, counts_ptr,
        M, N, K, GW, M_BUCKET,
        stride_xm, stride_wn, stride_om,
        FUSE_SWIGLU: tl.constexpr, DOT_PRECISION: tl.constexpr, GROUP_TILES_TOGETHER: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    ):  # fmt: skip
        # prefill: M_BUCKET is only the autotuning key. With GROUP_TILES_TOGETHER (the default), program
        # (i, g): the tiles of one group are launched together (i = tm * tiles_n + tn, tn fastest), so
        # the programs running at once share a few groups' weight rows in L2. Else program (g, i): the
        # group fastest, every wave reads all groups' weights (the order of runs 1-19).
        tiles_n = tl.cdiv(GW, BLOCK_N)
        if GROUP_TILES_TOGETHER:
            g = tl.program_id(1)
            i = tl.program_id(0)
        else:
            g = tl.program_id(0)
            i = tl.program_id(1)
        tm = i // tiles_n  # tile of the group's sorted tokens
        tn = i % tiles_n  # block of the group's GW output channels
        count = tl.load(counts_ptr + g)
        slots = tm * BLOCK_M + tl.arange(0, BLOCK_M)
        in_range = slots < M
        rows = tl.load(order_ptr + g * M + slots, mask=in_range, other=0)  # token ids, active first
        active = slots < count
        cols = g * GW + tn * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = (tn * BLOCK_N + tl.arange(0, BLOCK_N)) < GW
        # a tile whose first sorted token is inactive has none active: it writes zeros (block skip)
        write_output_block(
            x_ptr, w_ptr, wu_ptr, out_ptr, rows, in_range, active, tm * BLOCK_M < count, cols, col_ok, K,
            stride_xm, stride_wn, stride_om, FUSE_SWIGLU, DOT_PRECISION, BLOCK_M, BLOCK_N, BLOCK_K, False,
        )  # fmt: skip

    @triton.jit
    def triton_masked_out_gemv_kernel(
        x_ptr, w_ptr, wu_ptr, out_ptr, mask_ptr,
        M, N, K, GW,
        stride_xm, stride_wn, stride_om, stride_mm,
        FUSE_SWIGLU: tl.constexpr, DOT_PRECISION: tl.constexpr, SWAP_AB: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    ):  # fmt: skip
        # decode (M <= BLOCK_M): a block of a group no token needs writes its zeros, reads no weight
        rows, row_ok, on, cols, col_ok = decode_tile(mask_ptr, M, GW, stride_mm, BLOCK_M, BLOCK_N)
        write_output_block(
            x_ptr, w_ptr, wu_ptr, out_ptr, rows, row_ok, on, tl.sum(on.to(tl.int32), axis=0) > 0, cols, col_ok, K,
            stride_xm, stride_wn, stride_om, FUSE_SWIGLU, DOT_PRECISION, BLOCK_M, BLOCK_N, BLOCK_K, SWAP_AB,
        )  # fmt: skip

    @triton.jit
    def triton_masked_out_gemv_packed_kernel(
        x_ptr, w_ptr, wu_ptr, out_ptr, mask_ptr,
        M, N, K, GW,
        stride_xm, stride_wn, stride_om, stride_mm,
        FUSE_SWIGLU: tl.constexpr, DOT_PRECISION: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, K_PACK: tl.constexpr,
    ):  # fmt: skip
        # decode with K packed into one product (``packed_output_tile``): program (g, n-block) of
        # BLOCK_N output channels; a block of a group no token needs writes its zeros, reads no weight
        rows, row_ok, on, cols, col_ok = decode_tile(mask_ptr, M, GW, stride_mm, BLOCK_M, BLOCK_N)
        out_ptrs = out_ptr + rows[:, None] * stride_om + cols[None, :]
        store_mask = row_ok[:, None] & col_ok[None, :]
        if tl.sum(on.to(tl.int32), axis=0) > 0:
            g = tl.program_id(0)
            tn = tl.program_id(1)
            acc = packed_output_tile(
                x_ptr, w_ptr, wu_ptr, mask_ptr, g, M, K, g * GW + tn * BLOCK_N, GW - tn * BLOCK_N,
                stride_xm, stride_wn, stride_mm, FUSE_SWIGLU, DOT_PRECISION, BLOCK_M, BLOCK_N, BLOCK_K, K_PACK,
            )  # fmt: skip
            tl.store(out_ptrs, tl.where(on[:, None], acc, 0.0).to(out_ptr.dtype.element_ty), mask=store_mask)
        else:
            tl.store(out_ptrs, tl.zeros((BLOCK_M, BLOCK_N), dtype=out_ptr.dtype.element_ty), mask=store_mask)

    @triton.jit
    def triton_masked_out_gemv_splitk_kernel(
        x_ptr, w_ptr, ws_ptr, mask_ptr, out_ptr, ticket_ptr,
        M, N, K, GW, SPLIT_K, K_CHUNK,
        stride_xm, stride_wn, stride_mm, stride_om,
        FOLD_SUM: tl.constexpr, DOT_PRECISION: tl.constexpr, SWAP_AB: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    ):  # fmt: skip
        # decode, plain (q): program (g, n-block, s) sums the s-th K_CHUNK of the product into the
        # fp32 workspace [SPLIT_K, M, N] (zeros for a group no token needs; no weight read then);
        # ``triton_split_sum_kernel`` adds the shares and casts, or with FOLD_SUM the last share of
        # each output block does (``store_share_ticketed``). More programs for a small GEMV.
        rows, row_ok, on, cols, col_ok = decode_tile(mask_ptr, M, GW, stride_mm, BLOCK_M, BLOCK_N)
        s = tl.program_id(2)
        k_end = tl.minimum(s * K_CHUNK + K_CHUNK, K)
        if tl.sum(on.to(tl.int32), axis=0) == 0:
            k_end = s * K_CHUNK  # an empty K range: the share is zero, no weight is read
        acc = output_tile(
            x_ptr, w_ptr, w_ptr, rows, on, cols, col_ok, s * K_CHUNK, k_end, stride_xm, stride_wn,
            False, DOT_PRECISION, BLOCK_M, BLOCK_N, BLOCK_K, SWAP_AB,
        )  # fmt: skip
        if FOLD_SUM:
            block = tl.program_id(0) * tl.num_programs(1) + tl.program_id(1)
            store_share_ticketed(
                acc, out_ptr, ws_ptr, ticket_ptr, block, rows, row_ok, cols, col_ok, s, M, N, stride_om, SPLIT_K
            )  # fmt: skip
        else:
            store_share(acc, ws_ptr, ws_ptr, rows, row_ok, cols, col_ok, s, M, N, N, SPLIT_K)  # SPLIT_K > 1: to ws

    _tuned_out_gemm = tuning.autotuned(
        triton_masked_out_gemm_kernel,
        tuning.OUT_PREFILL,
        ["M_BUCKET", "N", "K", "GW", "FUSE_SWIGLU", "GROUP_TILES_TOGETHER"],
        decode=False,
        prune="BLOCK_N",
    )
    # the decode kernels, per operand order (``tile_dot``: tokens or weights as the rows) or per
    # packing (its table's BLOCK_N: output channels a program), each with its own tile table
    _tuned_out_gemv_splitk = tuning.decode_autotuned(
        triton_masked_out_gemv_splitk_kernel,
        {False: tuning.OUT_DECODE_SPLITK, True: tuning.OUT_DECODE_SPLITK_SWAP},
        ["M", "N", "K", "GW", "SPLIT_K", "FOLD_SUM"],
        "BLOCK_N",
    )
    _tuned_out_gemv = tuning.decode_autotuned(
        triton_masked_out_gemv_kernel,
        {False: tuning.OUT_DECODE, True: tuning.OUT_DECODE_SWAP},
        ["M", "N", "K", "GW", "FUSE_SWIGLU"],
        "BLOCK_N",
    )
    _tuned_out_gemv_packed = tuning.decode_autotuned(
        triton_masked_out_gemv_packed_kernel,
        tuning.OUT_DECODE_PACKED,
        ["M", "N", "K", "GW", "FUSE_SWIGLU", "BLOCK_M"],
        tuning.packed_pruner("BLOCK_N"),
    )


def triton_masked_out_gemm(
    x: torch.Tensor,
    w: torch.Tensor,
    mask: torch.Tensor,
    w_up: torch.Tensor | None = None,
    *,
    layout: tuple[torch.Tensor, ...] | None = None,
    out: torch.Tensor | None = None,
    block_m: int | None = None,
    block_n: int | None = None,
    block_k: int | None = None,
    split_k: int | None = None,
    fold_sum: bool = True,
    tile_order: str = "group",
    swap_ab: bool | None = None,
    k_pack: int | None = None,
) -> torch.Tensor:
    """Triton version of :func:`torch_masked_out_gemm`.

    Up to ``DECODE_MAX_M`` tokens: the decode kernel, which reads the mask directly (``layout`` is
    not needed). More: the sorted-tile kernel on the routing layout of ``mask`` (computed here
    when not given; share it between projections of one block). Tiles are autotuned on a GPU;
    ``block_*`` fix them instead (tests use small ones). ``split_k`` > 1 (decode, plain q only):
    that many programs share each output block's K range (fp32 partials), default
    ``tuning.out_decode_split_k`` (4 for the plain decode product up to 2 tokens on a GPU, as measured). With
    ``fold_sum`` (the default) the last share of each output block adds the partials
    (``store_share_ticketed``; see ``zeroed_tickets`` for its one-stream limit), else a second
    launch does: on the H200 (runs 16-17, split 4, M = 1) folded measured 1.32x-1.62x of cuBLAS in
    GPU time and 1.16x-1.38x in a CUDA graph, the second launch 1.30x-1.50x and 1.20x-1.27x.

    ``tile_order`` (prefill): ``"group"`` (the default) launches each group's token tiles together,
    so the programs running at once read a few groups' weight rows and share them in L2;
    ``"interleaved"`` puts the group fastest (the order of runs 1-19, kept for the benchmark): every
    wave of programs then streams all of the weights from HBM.

    ``swap_ab`` (decode): the weight tile as the product's row operand (``tile_dot``), default
    ``tuning.decode_swap_ab``.

    ``k_pack`` (decode, a power of two): that many chunks of K share one product of the weight
    tile as its rows (``packed_output_tile``), so a program holds few output channels and no
    partial sums leave it; default ``tuning.decode_k_pack`` where ``split_k`` and ``swap_ab`` leave
    it free (then ``split_k`` defaults to 1). Not with ``split_k`` > 1 or ``swap_ab=False``."""
    if triton is None:
        raise RuntimeError("triton is not installed")
    m, k = x.shape
    n = w.shape[0]
    groups = mask.shape[-1]
    if w.shape[1] != k or n % groups or mask.shape[0] != m or (w_up is not None and w_up.shape != w.shape):
        raise ValueError(f"shapes do not fit: x {tuple(x.shape)}, w {tuple(w.shape)}, mask {tuple(mask.shape)}")
    gw = n // groups
    x, w = x.contiguous(), w.contiguous()
    fuse = w_up is not None  # (not "w_up is not w": the same tensor may serve as gate and up)
    w_up = w_up.contiguous() if fuse else w
    if out is None:
        out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    common = {"FUSE_SWIGLU": fuse, "DOT_PRECISION": tuning.dot_precision(x.dtype)}
    fixed = block_n is not None or tuning.interpreted()
    if swap_ab is None:
        swap_ab = tuning.decode_swap_ab("swiglu" if fuse else "out")
    if k_pack is None:  # the packed product by default only where nothing asked for another kernel
        packable = m <= tuning.DECODE_MAX_M and swap_ab and split_k in (None, 1)
        k_pack = tuning.decode_k_pack(m, fuse) if packable else 1
    if split_k is None:
        split_k = 1 if k_pack > 1 else tuning.out_decode_split_k(m, fuse)
    if split_k > 1 and (fuse or m > tuning.DECODE_MAX_M):
        raise ValueError("split_k is for the plain (non-SwiGLU) decode product only")
    if k_pack != 1:
        if k_pack < 1 or k_pack & (k_pack - 1) or m > tuning.DECODE_MAX_M or split_k > 1 or not swap_ab:
            raise ValueError(
                f"k_pack={k_pack}: a power of two, for the decode product (M <= {tuning.DECODE_MAX_M}) with "
                f"split_k=1 and swap_ab=True; got M={m}, split_k={split_k}, swap_ab={swap_ab}"
            )
        return _out_gemv_packed(x, w, w_up, mask, out, fuse, k_pack, gw, groups, block_n, block_k)
    if split_k > 1:
        return _out_gemv_split_k(x, w, mask, out, split_k, gw, groups, block_n, block_k, fold_sum, swap_ab)
    if m <= tuning.DECODE_MAX_M:
        mask_u8 = mask_bytes(mask)
        args = (x, w, w_up, out, mask_u8, m, n, k, gw, x.stride(0), w.stride(0), out.stride(0), mask_u8.stride(0))
        common["SWAP_AB"] = swap_ab
        if fixed:
            bn, bk = block_n or 16, block_k or 32
            grid = (groups, tuning.cdiv(gw, bn))
            triton_masked_out_gemv_kernel[grid](*args, **common, BLOCK_M=16, BLOCK_N=bn, BLOCK_K=bk)
        else:
            grid = lambda meta: (groups, tuning.cdiv(gw, meta["BLOCK_N"]))  # noqa: E731
            _tuned_out_gemv[swap_ab][grid](*args, **common, BLOCK_M=16)
        return out
    if tile_order not in ("group", "interleaved"):
        raise ValueError(f"tile_order must be 'group' or 'interleaved', got {tile_order!r}")
    together = tile_order == "group"
    order, counts = (layout if layout is not None and layout[0] is not None else triton_routing_layout(mask))[:2]
    if order.shape != (groups, m) or not order.is_contiguous():
        raise ValueError(f"layout order must be a contiguous [G, M] = [{groups}, {m}] tensor, got {tuple(order.shape)}")
    args = (x, w, w_up, out, order, counts, m, n, k, gw, tuning.m_bucket(m), x.stride(0), w.stride(0), out.stride(0))
    common["GROUP_TILES_TOGETHER"] = together
    if fixed:
        bm, bn, bk = block_m or 16, block_n or 32, block_k or 32
        tiles = tuning.cdiv(m, bm) * tuning.cdiv(gw, bn)
        grid = (tiles, groups) if together else (groups, tiles)
        triton_masked_out_gemm_kernel[grid](*args, **common, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk)
    else:

        def grid(meta):
            tiles = tuning.cdiv(m, meta["BLOCK_M"]) * tuning.cdiv(gw, meta["BLOCK_N"])
            return (tiles, groups) if together else (groups, tiles)

        _tuned_out_gemm[grid](*args, **common)
    return out


def _out_gemv_packed(x, w, w_up, mask, out, fuse, k_pack, gw, groups, block_n, block_k):
    m, k = x.shape
    n = w.shape[0]
    mask_u8 = mask_bytes(mask)
    args = (x, w, w_up, out, mask_u8, m, n, k, gw, x.stride(0), w.stride(0), out.stride(0), mask_u8.stride(0))
    common = {"FUSE_SWIGLU": fuse, "DOT_PRECISION": tuning.dot_precision(x.dtype)}
    common["BLOCK_M"] = tuning.packed_block_m(m, k_pack)
    if block_n is not None or tuning.interpreted():
        bn, bk = tuning.packed_fixed_tiles(block_n, block_k, k_pack, 32)
        grid = (groups, tuning.cdiv(gw, bn))
        triton_masked_out_gemv_packed_kernel[grid](*args, **common, BLOCK_N=bn, BLOCK_K=bk, K_PACK=k_pack)
    else:
        tuning.packed_table(tuning.OUT_DECODE_PACKED, k_pack)  # a clear error where the packing has no table
        grid = lambda meta: (groups, tuning.cdiv(gw, meta["BLOCK_N"]))  # noqa: E731
        _tuned_out_gemv_packed[k_pack][grid](*args, **common, K_PACK=k_pack)
    return out


def _out_gemv_split_k(x, w, mask, out, split_k, gw, groups, block_n, block_k, fold_sum, swap_ab):
    m, k = x.shape
    n = w.shape[0]
    mask_u8 = mask_bytes(mask)
    ws = torch.empty((split_k, m, n), dtype=torch.float32, device=x.device)
    chunk = tuning.cdiv(tuning.cdiv(k, split_k), 64) * 64  # whole 64-wide K steps per share
    # output blocks (tickets when the sum is folded in): at most one per 16 columns of a group
    tickets = zeroed_tickets(x.device, groups * tuning.cdiv(gw, min(block_n or 16, 16))) if fold_sum else ws
    args = (x, w, ws, mask_u8, out, tickets, m, n, k, gw, split_k, chunk)
    args += (x.stride(0), w.stride(0), mask_u8.stride(0), out.stride(0))
    common = {"FOLD_SUM": fold_sum, "DOT_PRECISION": tuning.dot_precision(x.dtype), "SWAP_AB": swap_ab, "BLOCK_M": 16}
    if block_n is not None or tuning.interpreted():
        bn, bk = block_n or 16, min(block_k or 32, chunk)
        grid = (groups, tuning.cdiv(gw, bn), split_k)
        triton_masked_out_gemv_splitk_kernel[grid](*args, **common, BLOCK_N=bn, BLOCK_K=bk)
    else:
        grid = lambda meta: (groups, tuning.cdiv(gw, meta["BLOCK_N"]), split_k)  # noqa: E731
        _tuned_out_gemv_splitk[swap_ab][grid](*args, **common)
    if not fold_sum:
        triton_split_sum_kernel[(tuning.cdiv(m * n, 1024),)](ws, out, m, n, split_k, out.stride(0), BLOCK=1024)
    return out
