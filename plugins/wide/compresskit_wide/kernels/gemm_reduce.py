"""Reduction-width masked GEMM (o_proj, down_proj): the inputs of inactive groups contribute nothing.

    x:    [M, K]        tokens, flattened
    w:    [N, K]        as in nn.Linear
    mask: [M, K / G]    True = the token's group of G input features is active
    out:  [M, N]        sum over active groups of x[:, group] @ w[:, group].T

The Triton kernel is the decode path: each program owns a block of output channels and loops,
branch-free, over the compacted list of groups some token needs (``active_groups``, ``n_active``
from the routing layout, on the device: no host synchronisation), reading only those weight
columns; up to 4 tokens the "packed" variant builds that list in each program and takes 4 active
groups a step in one product (``triton_masked_reduce_gemm_packed_kernel``), and for few, wide groups
(o_proj's) the "direct" one takes 4 consecutive groups a step without a list, not reading the
weights of those no token needs. For prefill the
masked dense product on the zero-filled input is exact and uses cuBLAS (``dense_masked_reduce_gemm``;
on the output of the fused SwiGLU kernel, already zero where
inactive, it is the plain dense product); the dispatcher picks by the benchmark.
"""

from __future__ import annotations

import torch

from compresskit_wide.kernels import tuning
from compresskit_wide.kernels.layout import mask_bytes, triton_decode_layout
from compresskit_wide.kernels.reference import torch_group_masked_input, zero_inactive_groups

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = None

VARIANTS = ("loop", "unrolled", "fused", "packed", "direct")  # of ``triton_masked_reduce_gemm``


def torch_masked_reduce_gemm(x: torch.Tensor, w: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Reference: zero the inactive input groups, then the dense product (fp32 accumulation)."""
    return (torch_group_masked_input(x.float(), mask) @ w.float().T).to(x.dtype)


def dense_masked_reduce_gemm(
    x: torch.Tensor, w: torch.Tensor, mask: torch.Tensor, *, input_is_masked: bool = False
) -> torch.Tensor:
    """The prefill path: the masked dense product in ``x.dtype`` through cuBLAS (its fp32
    accumulation). Exact, as the inactive groups' inputs are zero: one select (``zero_inactive_groups``:
    one launch, where the reference's cast and product take two; and, as the kernel, which never
    reads them, whatever those inputs held). ``input_is_masked``: the caller guarantees that already
    (the fused SwiGLU kernel and the routed attention write exact zeros there), so the product is
    the plain dense one and costs nothing extra."""
    return x @ w.T if input_is_masked else zero_inactive_groups(x, mask) @ w.T


if triton is not None:

    @triton.jit
    def reduce_share(n_active_ptr, M, N, SPLIT, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
        """Program (n-block, m-tile, split s) of a reduction kernel: its rows and columns and its share
        of the active-group list, ``[first, first + count)``. Returns
        ``(rows, row_ok, cols, col_ok, s, first, count)``."""
        tn = tl.program_id(0)
        tm = tl.program_id(1)
        s = tl.program_id(2)
        rows = tm * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = tn * BLOCK_N + tl.arange(0, BLOCK_N)
        n_active = tl.load(n_active_ptr)
        chunk = tl.cdiv(n_active, SPLIT)
        first = s * chunk
        count = tl.maximum(tl.minimum(chunk, n_active - first), 0)
        return rows, rows < M, cols, cols < N, s, first, count

    @triton.jit
    def store_share(acc, out_ptr, ws_ptr, rows, row_ok, cols, col_ok, s, M, N, stride_om, SPLIT):
        """The share's fp32 sum: straight to ``out`` (cast) when it is the only one, else to the
        workspace ``[SPLIT, M, N]`` that ``triton_split_sum_kernel`` adds up."""
        tile = row_ok[:, None] & col_ok[None, :]
        if SPLIT == 1:
            tl.store(out_ptr + rows[:, None] * stride_om + cols[None, :], acc.to(out_ptr.dtype.element_ty), mask=tile)
        else:
            tl.store(ws_ptr + (s * M + rows[:, None]) * N + cols[None, :], acc, mask=tile)

    @triton.jit
    def store_share_ticketed(
        acc, out_ptr, ws_ptr, ticket_ptr, block, rows, row_ok, cols, col_ok, s, M, N, stride_om, SPLIT
    ):  # fmt: skip
        """``store_share`` with the sum folded in: with SPLIT > 1 the share stores its fp32 partial
        to the workspace ``[SPLIT, M, N]`` and takes a ticket for its output ``block``; the share that
        draws the last one adds all partials in share order (deterministic), writes ``out`` and resets
        the ticket to 0 for the next call (tickets start zeroed: ``zeroed_tickets``). No summing launch."""
        tile = row_ok[:, None] & col_ok[None, :]
        out_ptrs = out_ptr + rows[:, None] * stride_om + cols[None, :]
        if SPLIT == 1:
            tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=tile)
        else:
            tl.store(ws_ptr + (s * M + rows[:, None]) * N + cols[None, :], acc, mask=tile)
            tl.debug_barrier()  # every thread's partial is stored before the ticket releases it
            ticket = tl.atomic_add(ticket_ptr + block, 1, sem="acq_rel", scope="gpu")
            if ticket == SPLIT - 1:  # the last share of this block: the others' partials are visible
                tl.debug_barrier()
                total = tl.zeros(acc.shape, dtype=tl.float32)
                for j in range(0, SPLIT):
                    total += tl.load(
                        ws_ptr + (j * M + rows[:, None]) * N + cols[None, :], mask=tile, other=0.0, cache_modifier=".cg"
                    )
                tl.store(out_ptrs, total.to(out_ptr.dtype.element_ty), mask=tile)
                tl.atomic_xchg(ticket_ptr + block, 0)

    @triton.jit
    def packed_diagonal(acc, K_PACK: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr):
        """The sums a K-packed product wants (``gemm_out.packed_output_tile``,
        ``triton_masked_reduce_gemm_packed_kernel``): of ``acc`` [K_PACK * BLOCK_N, K_PACK * BLOCK_M],
        the blocks where the weight rows' chunk is the token columns' chunk, added over the chunks:
        [BLOCK_N, BLOCK_M]."""
        row_chunk = tl.arange(0, K_PACK * BLOCK_N) // BLOCK_N
        col_chunk = tl.arange(0, K_PACK * BLOCK_M) // BLOCK_M
        acc = tl.where(row_chunk[:, None] == col_chunk[None, :], acc, 0.0)
        acc = tl.reshape(acc, (K_PACK, BLOCK_N, K_PACK, BLOCK_M))
        return tl.sum(tl.sum(acc, axis=2), axis=0)

    @triton.jit
    def tile_dot(a, b, acc, DOT_PRECISION: tl.constexpr, SWAP_AB: tl.constexpr):
        """``acc + a @ b.T`` for a token tile ``a`` [BLOCK_M, K] and a weight tile ``b`` [BLOCK_N, K].
        ``SWAP_AB``: ``acc`` is kept transposed, [BLOCK_N, BLOCK_M], and gets ``b @ a.T``: the weight
        tile is the product's row operand, so a tile of 64 or more weight rows is eligible for
        Hopper's warp-group MMA (64 rows per 4 warps), which 16 token rows are not (the compiled
        kernels' TTGIR, run 50: ``warp_group_dot`` with it, ``mma`` without). The same sums either
        way; which one is faster is measured (``tuning.decode_swap_ab``)."""
        if SWAP_AB:  # (an if / else: Triton's compiler also compiles a return after a static if's)
            acc = tl.dot(b, tl.trans(a), acc, input_precision=DOT_PRECISION)
        else:
            acc = tl.dot(a, tl.trans(b), acc, input_precision=DOT_PRECISION)
        return acc

    @triton.jit
    def add_group(
        acc, x_ptr, w_ptr, mask_ptr, g, rows, row_ok, cols, col_ok, stride_xm, stride_wn, stride_mm,
        GW: tl.constexpr, DOT_PRECISION: tl.constexpr, BLOCK_K: tl.constexpr, SWAP_AB: tl.constexpr,
    ):  # fmt: skip
        """``acc`` plus input group ``g``'s product for the tile: the rows of the tokens that need g
        (the others load zeros) against g's weight columns, BLOCK_K of them a step (unrolled);
        ``acc`` transposed with ``SWAP_AB`` (``tile_dot``)."""
        on = tl.load(mask_ptr + rows * stride_mm + g, mask=row_ok, other=0) != 0  # [BLOCK_M]
        for k0 in tl.static_range(0, GW, BLOCK_K):
            ks = g * GW + k0 + tl.arange(0, BLOCK_K)
            k_ok = (k0 + tl.arange(0, BLOCK_K)) < GW
            a = tl.load(
                x_ptr + rows[:, None] * stride_xm + ks[None, :], mask=(on & row_ok)[:, None] & k_ok[None, :], other=0.0
            )
            w_mask = col_ok[:, None] & k_ok[None, :]
            b = tl.load(w_ptr + cols[:, None] * stride_wn + ks[None, :], mask=w_mask, other=0.0)
            acc = tile_dot(a, b, acc, DOT_PRECISION, SWAP_AB)
        return acc

    @triton.jit
    def triton_masked_reduce_gemm_kernel(
        x_ptr, w_ptr, mask_ptr, out_ptr, ws_ptr, groups_ptr, n_active_ptr,
        M, N, GW: tl.constexpr, G, SPLIT,
        stride_xm, stride_wn, stride_mm, stride_om,
        DOT_PRECISION: tl.constexpr, SWAP_AB: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    ):  # fmt: skip
        # program (n-block, m-tile, split s) sums the s-th share of the active groups; with SPLIT > 1
        # its fp32 partial goes to the workspace [SPLIT, M, N] and a second kernel adds them up.
        # GW is a compile-time constant so that the steps through one group unroll: the loop over
        # the active groups is then the innermost one, the one Triton software-pipelines (a runtime
        # inner loop left the outer loop's loads waiting on each other, one group at a time).
        rows, row_ok, cols, col_ok, s, first, count = reduce_share(n_active_ptr, M, N, SPLIT, BLOCK_M, BLOCK_N)
        acc = tl.zeros((BLOCK_N, BLOCK_M) if SWAP_AB else (BLOCK_M, BLOCK_N), dtype=tl.float32)
        for i in range(first, first + count):  # only the groups some token needs
            g = tl.load(groups_ptr + i)
            acc = add_group(
                acc, x_ptr, w_ptr, mask_ptr, g, rows, row_ok, cols, col_ok, stride_xm, stride_wn, stride_mm,
                GW, DOT_PRECISION, BLOCK_K, SWAP_AB,
            )  # fmt: skip
        if SWAP_AB:
            acc = tl.trans(acc)
        store_share(acc, out_ptr, ws_ptr, rows, row_ok, cols, col_ok, s, M, N, stride_om, SPLIT)

    @triton.jit
    def triton_split_sum_kernel(ws_ptr, out_ptr, M, N, SPLIT, stride_om, BLOCK: tl.constexpr):
        # out[m, n] = sum over s of ws[s, m, n], in fp32, cast once
        idx = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        ok = idx < M * N
        acc = tl.zeros((BLOCK,), dtype=tl.float32)
        for s in range(0, SPLIT):
            acc += tl.load(ws_ptr + s * M * N + idx, mask=ok, other=0.0)
        tl.store(out_ptr + (idx // N) * stride_om + idx % N, acc.to(out_ptr.dtype.element_ty), mask=ok)

    @triton.jit
    def triton_masked_reduce_gemm_unrolled_kernel(
        x_ptr, w_ptr, mask_ptr, out_ptr, ws_ptr, groups_ptr, n_active_ptr,
        M, N, GW, G, SPLIT,
        stride_xm, stride_wn, stride_mm, stride_om, stride_wg,
        DOT_PRECISION: tl.constexpr, CHUNK: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    ):  # fmt: skip
        # The same sum as the loop kernel, with no load depending on a load of the step before:
        # the program's share of the active-group list is read at once (one vector load), then an
        # unrolled sequence of whole-group tiles (BLOCK_K >= GW), each predicated on being in the
        # share, so that all of them can be in flight together. Group g's weight columns start at
        # w_ptr + g * stride_wg: GW for the nn.Linear layout [N, K], N * GW for the group-major
        # layout [G, N, GW] (``group_major``), where a tile is one contiguous block.
        rows, row_ok, cols, col_ok, s, first, count = reduce_share(n_active_ptr, M, N, SPLIT, BLOCK_M, BLOCK_N)
        js = tl.arange(0, CHUNK)
        gids = tl.load(groups_ptr + first + js, mask=js < count, other=0)
        kk = tl.arange(0, BLOCK_K)
        k_ok = kk < GW
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for j in tl.static_range(CHUNK):
            # "in the share" as vectors: a scalar in a load mask breaks Triton 3.9's interpreter
            live_m = (tl.zeros((BLOCK_M,), dtype=tl.int32) + j) < count
            live_n = (tl.zeros((BLOCK_N,), dtype=tl.int32) + j) < count
            g = tl.sum(tl.where(js == j, gids, 0), axis=0)
            on = tl.load(mask_ptr + rows * stride_mm + g, mask=row_ok & live_m, other=0) != 0
            a = tl.load(
                x_ptr + rows[:, None] * stride_xm + (g * GW + kk)[None, :],
                mask=(on & row_ok)[:, None] & k_ok[None, :],
                other=0.0,
            )
            b = tl.load(
                w_ptr + g * stride_wg + cols[:, None] * stride_wn + kk[None, :],
                mask=(col_ok & live_n)[:, None] & k_ok[None, :],
                other=0.0,
            )
            acc = tl.dot(a, tl.trans(b), acc, input_precision=DOT_PRECISION)
        store_share(acc, out_ptr, ws_ptr, rows, row_ok, cols, col_ok, s, M, N, stride_om, SPLIT)

    @triton.jit
    def tile_group_list(mask_ptr, list_ptr, s, tm, tn, rows, row_ok, G, stride_mm, BLOCK_G: tl.constexpr):
        """The fused and packed kernels' own prep: the groups some token of the tile ``rows`` needs
        (its mask rows ORed), compacted in order into program (tn, tm, s)'s slice of the scratch
        buffer ``list_ptr`` and visible to all the program's threads on return. Returns ``(its
        list, their count)``."""
        gs = tl.arange(0, BLOCK_G)
        flags = tl.load(
            mask_ptr + rows[:, None] * stride_mm + gs[None, :], mask=row_ok[:, None] & (gs < G)[None, :], other=0
        )
        on = tl.max((flags != 0).to(tl.int32), axis=0)  # [BLOCK_G]: some token of the tile needs group g
        n_active = tl.sum(on, axis=0)
        my_list = list_ptr + ((s * tl.num_programs(1) + tm) * tl.num_programs(0) + tn) * BLOCK_G
        tl.store(my_list + tl.cumsum(on, axis=0) - on, gs, mask=on != 0)
        tl.debug_barrier()  # the list is written by all the program's threads, read by each
        return my_list, n_active

    @triton.jit
    def triton_masked_reduce_gemm_fused_kernel(
        x_ptr, w_ptr, mask_ptr, out_ptr, ws_ptr, list_ptr, ticket_ptr,
        M, N, GW: tl.constexpr, G, SPLIT,
        stride_xm, stride_wn, stride_mm, stride_om,
        DOT_PRECISION: tl.constexpr, BLOCK_G: tl.constexpr, SWAP_AB: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    ):  # fmt: skip
        # The loop kernel with its two helpers folded in. (1) No layout launch: each program reads its
        # token tile's mask rows, ORs them and writes the compacted list of the groups they need to its
        # own slice of a scratch buffer (read back after a CTA barrier). (2) No summing launch: the
        # shares of an output block add up through tickets (``store_share_ticketed``).
        tn = tl.program_id(0)
        tm = tl.program_id(1)
        s = tl.program_id(2)
        rows = tm * BLOCK_M + tl.arange(0, BLOCK_M)
        row_ok = rows < M
        cols = tn * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = cols < N
        my_list, n_active = tile_group_list(mask_ptr, list_ptr, s, tm, tn, rows, row_ok, G, stride_mm, BLOCK_G)
        chunk = tl.cdiv(n_active, SPLIT)
        first = s * chunk
        count = tl.maximum(tl.minimum(chunk, n_active - first), 0)
        acc = tl.zeros((BLOCK_N, BLOCK_M) if SWAP_AB else (BLOCK_M, BLOCK_N), dtype=tl.float32)
        for i in range(first, first + count):
            acc = add_group(
                acc, x_ptr, w_ptr, mask_ptr, tl.load(my_list + i), rows, row_ok, cols, col_ok,
                stride_xm, stride_wn, stride_mm, GW, DOT_PRECISION, BLOCK_K, SWAP_AB,
            )  # fmt: skip
        if SWAP_AB:
            acc = tl.trans(acc)
        store_share_ticketed(
            acc, out_ptr, ws_ptr, ticket_ptr, tm * tl.num_programs(0) + tn, rows, row_ok, cols, col_ok, s, M, N,
            stride_om, SPLIT,
        )  # fmt: skip

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
            x_ptr + tok[:, None] * stride_xm + (g_x * GW + k0)[:, None] + kk[None, :],
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
    def triton_masked_reduce_gemm_packed_kernel(
        x_ptr, w_ptr, mask_ptr, out_ptr, list_ptr,
        M, N, GW: tl.constexpr, G,
        stride_xm, stride_wn, stride_mm, stride_om,
        DOT_PRECISION: tl.constexpr, BLOCK_G: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, K_PACK: tl.constexpr,
        DIRECT: tl.constexpr,
    ):  # fmt: skip
        # The fused kernel's own group list, then K_PACK active groups a step packed into one
        # product (as ``gemm_out.packed_output_tile`` packs chunks of K): the MMA's rows are the
        # BLOCK_N weight rows once per group of the step (row c * BLOCK_N + j: output channel j
        # against the step's c-th group), its columns the tokens once per group (column c * BLOCK_M +
        # m: token m's inputs of that group, zero where it does not need it); the blocks where the
        # groups differ are dropped at the end (``packed_diagonal``). One program an output block,
        # so no partial sums, tickets or summing launch: a program holds few output channels instead.
        # DIRECT: no list; a step's K_PACK groups are consecutive ones, and the weight rows of a group
        # no token of the tile needs are not read (their loads predicated off); one flat loop over
        # (groups, K step), so that the compiler pipelines it as one stream. For few groups (o_proj's
        # 8: with K_PACK = 8, one group step), where the list's chain of dependent reads (mask,
        # list, weights) is not hidden behind a long loop, and where unrolling a wide group's K
        # steps (512 inputs) multiplies the pipeline's shared memory by their count.
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
            my_list, n_active = tile_group_list(mask_ptr, list_ptr, 0, tm, tn, rows, row_ok, G, stride_mm, BLOCK_G)
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
        tl.store(
            out_ptr + rows[:, None] * stride_om + cols[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=row_ok[:, None] & (cols < N)[None, :],
        )

    _tuned_reduce_unrolled = tuning.autotuned(
        triton_masked_reduce_gemm_unrolled_kernel, tuning.REDUCE_UNROLLED, ["M", "N", "GW", "G", "SPLIT"], decode=True
    )
    # per operand order (``tile_dot``), each with its own tile table
    _tuned_reduce_gemm, _tuned_reduce_fused = (
        tuning.decode_autotuned(
            kernel,
            {False: tuning.REDUCE_DECODE, True: tuning.REDUCE_DECODE_SWAP},
            ["M", "N", "GW", "G", "SPLIT"],
            "BLOCK_K",
        )
        for kernel in (triton_masked_reduce_gemm_kernel, triton_masked_reduce_gemm_fused_kernel)
    )
    # the packed variant, per packing (its table's BLOCK_N: output channels a program), with its
    # group list and without (``direct``): each its own autotuners
    _tuned_reduce_packed, _tuned_reduce_direct = (
        tuning.decode_autotuned(
            triton_masked_reduce_gemm_packed_kernel,
            tuning.REDUCE_DECODE_PACKED,
            ["M", "N", "GW", "G", "BLOCK_M"],
            tuning.packed_pruner("BLOCK_K", unrolled_group=unrolled),
        )
        for unrolled in (True, False)  # the list's loop unrolls a group's K steps; the direct one is flat
    )


def _reduce_packed(x, w, mask, out, k_pack, block_n, block_k, direct):
    m, k = x.shape
    n = w.shape[0]
    groups = mask.shape[-1]
    x, w = x.contiguous(), w.contiguous()
    mask_u8 = mask_bytes(mask)
    if out is None:
        out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    gw = k // groups
    block_m = tuning.packed_block_m(m, k_pack)  # a token tile of up to 16
    block_g = max(16, tuning.next_power_of_2(groups))
    fixed = block_n is not None or tuning.interpreted()
    if fixed:
        bn, bk = tuning.packed_fixed_tiles(block_n, block_k, k_pack, min(32, max(16, tuning.next_power_of_2(gw))))
    else:  # the narrowest tile of the table
        bn = min(meta["BLOCK_N"] for meta, _, _ in tuning.packed_table(tuning.REDUCE_DECODE_PACKED, k_pack))
    # one group list per program: as many as the narrowest tile makes (none read without the lists)
    count = 1 if direct else tuning.cdiv(n, bn) * tuning.cdiv(m, block_m) * block_g
    lists = torch.empty(count, dtype=torch.int32, device=x.device)
    args = (x, w, mask_u8, out, lists, m, n, gw, groups, x.stride(0), w.stride(0), mask_u8.stride(0))
    common = {"DOT_PRECISION": tuning.dot_precision(x.dtype), "BLOCK_G": block_g, "BLOCK_M": block_m, "DIRECT": direct}
    if fixed:
        grid = (tuning.cdiv(n, bn), tuning.cdiv(m, block_m))
        triton_masked_reduce_gemm_packed_kernel[grid](
            *args, out.stride(0), **common, BLOCK_N=bn, BLOCK_K=bk, K_PACK=k_pack
        )  # fmt: skip
    else:
        grid = lambda cfg: (tuning.cdiv(n, cfg["BLOCK_N"]), tuning.cdiv(m, block_m))  # noqa: E731
        tuned = _tuned_reduce_direct if direct else _tuned_reduce_packed
        tuned[k_pack][grid](*args, out.stride(0), **common, K_PACK=k_pack)
    return out


def group_major(w: torch.Tensor, groups: int) -> torch.Tensor:
    """``w: [N, K]`` (nn.Linear) -> ``[G, N, K / G]``, contiguous: each input group's columns as one
    block, so that a [rows, group] tile is a single contiguous read."""
    n, k = w.shape
    return w.view(n, groups, k // groups).permute(1, 0, 2).contiguous()


def split_count(groups: int, split: int | None = None) -> int:
    """How many programs share one output block's active groups: one per 8 groups, at most 4 (fixed
    by the shapes: graph-safe). On the H200 at M = 1 (down, 112 groups; run 11, GPU time with the
    L2 flushed) 4 measured 1.43x-1.48x of cuBLAS, the earlier default 14 1.24x-1.32x, 1 0.97x-1.01x:
    beyond 4 the summing kernel's extra reads cost more than the shorter loops save."""
    return split if split is not None else min(4, max(1, groups // 8))


_ZEROED_TICKETS: dict = {}


def zeroed_tickets(device: torch.device, count: int) -> torch.Tensor:
    """The fused variant's tickets: ``count`` (or more) zeroed int32 counters on ``device``, one per
    output block, kept between calls (each call leaves them at zero again). Allocated or grown on a
    call outside a CUDA-graph capture (the first call, which autotunes, is one). Shared by every
    call on the device: two fused reductions running at the same time on different streams would
    share them too, so the variant is for one stream at a time."""
    key = (device.type, device.index)
    tickets = _ZEROED_TICKETS.get(key)
    if tickets is None or tickets.numel() < count:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                "the fused reduction allocates its tickets on its first call with these shapes: "
                "call it once before capturing a CUDA graph"
            )
        tickets = torch.zeros(max(count, 1024), dtype=torch.int32, device=device)
        _ZEROED_TICKETS[key] = tickets
    return tickets


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
    split: int | None = None,
    variant: str | None = None,
    w_group_major: torch.Tensor | None = None,
    swap_ab: bool | None = None,
    k_pack: int = 4,
) -> torch.Tensor:
    """Triton version of :func:`torch_masked_reduce_gemm` (the decode path). ``layout``: anything
    whose last two entries are ``(active_groups, n_active)`` (``decode_layout`` or the full
    routing layout); computed here when not given. ``split``: programs per output block, each
    summing a share of the active groups (default: ``split_count``). ``variant``: "loop" (a
    runtime loop over the share), "unrolled" (the share's group ids read at once, whole-group
    tiles unrolled; slower on the H200) or "fused" (the loop with the layout and the split sum
    folded in: one launch, ``layout`` unused; see ``zeroed_tickets`` for its one-stream limit);
    default ``tuning.reduce_variant`` (direct for few groups; else packed up to 4 tokens, fused for
    the other decode sizes, as measured; "unrolled" where
    ``w_group_major`` is given). ``w_group_major``: ``w`` in the layout ``group_major(w, G)`` (kept
    beside ``w``), read by the unrolled variant instead. ``swap_ab`` (loop and fused variants): the
    weight tile as the product's row operand (``tile_dot``), default ``tuning.decode_swap_ab``.
    "packed": the fused kernel's own group list, then ``k_pack`` (a power of two) active groups a
    step packed into one product of the weight tile as its rows
    (``triton_masked_reduce_gemm_packed_kernel``): one program an output block, no shares to add
    (``layout`` unused, ``split`` and ``swap_ab`` do not apply). "direct": the same product without
    the list, ``k_pack`` consecutive groups a step, the weights of groups no token needs not read
    (for few, wide groups: o_proj's)."""
    if variant is None:
        variant = "unrolled" if w_group_major is not None else tuning.reduce_variant(x.shape[0], mask.shape[-1])
    if variant not in VARIANTS:
        raise ValueError(f"variant {variant!r} is not available; allowed: {', '.join(VARIANTS)}")
    if w_group_major is not None and variant != "unrolled":
        raise ValueError("w_group_major is read by the unrolled variant only")
    if swap_ab and variant == "unrolled":
        raise ValueError("swap_ab is for the loop and fused variants only")
    if triton is None:
        raise RuntimeError("triton is not installed")
    if swap_ab is None:
        swap_ab = variant != "unrolled" and tuning.decode_swap_ab("reduce")
    m, k = x.shape
    n = w.shape[0]
    groups = mask.shape[-1]
    if w.shape[1] != k or k % groups or mask.shape[0] != m:
        raise ValueError(f"shapes do not fit: x {tuple(x.shape)}, w {tuple(w.shape)}, mask {tuple(mask.shape)}")
    if variant in ("packed", "direct"):
        if split not in (None, 1) or swap_ab is False or k_pack < 1 or k_pack & (k_pack - 1):
            raise ValueError(
                f"the packed variant takes k_pack a power of two, no split and the weight tile as the MMA's "
                f"rows; got k_pack={k_pack}, split={split}, swap_ab={swap_ab}"
            )
        return _reduce_packed(x, w, mask, out, k_pack, block_n, block_k, variant == "direct")
    if variant == "fused":
        active_groups = n_active = None  # each program finds its tile's groups itself
    else:
        active_groups, n_active = (layout if layout is not None else triton_decode_layout(mask))[-2:]
    x, w = x.contiguous(), w.contiguous()
    mask_u8 = mask_bytes(mask)
    if out is None:
        out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    splits = split_count(groups, split)
    ws = torch.empty((splits, m, n) if splits > 1 else (1,), dtype=torch.float32, device=x.device)
    gw = k // groups
    weights, stride_wn, stride_wg = w, w.stride(0), gw  # nn.Linear layout: group g at column g * GW
    if w_group_major is not None:
        if tuple(w_group_major.shape) != (groups, n, gw) or not w_group_major.is_contiguous():
            raise ValueError(f"w_group_major must be a contiguous [G, N, GW] = [{groups}, {n}, {gw}] tensor")
        weights, stride_wn, stride_wg = w_group_major, gw, n * gw
    args = (x, weights, mask_u8, out, ws, active_groups, n_active, m, n, gw, groups, splits)
    strides = (x.stride(0), stride_wn, mask_u8.stride(0), out.stride(0))
    precision = tuning.dot_precision(x.dtype)
    if variant == "fused":  # its own group list (a scratch slice per program) and tickets
        # output blocks: at most one per 16 columns (the narrowest tile) and token tile
        blocks = tuning.cdiv(n, min(block_n or 16, 16)) * tuning.cdiv(m, block_m or 16)
        block_g = max(16, tuning.next_power_of_2(groups))
        group_lists = torch.empty(blocks * splits * block_g, dtype=torch.int32, device=x.device)
        args = (x, weights, mask_u8, out, ws, group_lists, zeroed_tickets(x.device, blocks), m, n, gw, groups, splits)
        fixed_kernel, tuned_kernel = triton_masked_reduce_gemm_fused_kernel, _tuned_reduce_fused[swap_ab]
        meta = {"BLOCK_G": block_g, "SWAP_AB": swap_ab}
        fixed = {"BLOCK_N": block_n or 32, "BLOCK_K": block_k or 32}
    elif variant == "unrolled":  # whole-group K tiles, the share's group ids read at once
        fixed_kernel, tuned_kernel = triton_masked_reduce_gemm_unrolled_kernel, _tuned_reduce_unrolled
        strides = (*strides, stride_wg)
        meta = {
            "CHUNK": tuning.next_power_of_2(tuning.cdiv(groups, splits)),
            "BLOCK_K": max(16, tuning.next_power_of_2(k // groups)),
        }
        fixed = {"BLOCK_N": block_n or 16}
    else:
        fixed_kernel, tuned_kernel = triton_masked_reduce_gemm_kernel, _tuned_reduce_gemm[swap_ab]
        meta = {"SWAP_AB": swap_ab}
        fixed = {"BLOCK_N": block_n or 32, "BLOCK_K": block_k or 32}
    if block_n is not None or tuning.interpreted():
        bm = block_m or 16
        grid = (tuning.cdiv(n, fixed["BLOCK_N"]), tuning.cdiv(m, bm), splits)
        fixed_kernel[grid](*args, *strides, DOT_PRECISION=precision, **meta, **fixed, BLOCK_M=bm)
    else:
        grid = lambda cfg: (tuning.cdiv(n, cfg["BLOCK_N"]), tuning.cdiv(m, 16), splits)  # noqa: E731
        tuned_kernel[grid](*args, *strides, DOT_PRECISION=precision, **meta, BLOCK_M=16)
    if splits > 1 and variant != "fused":
        block = 1024
        triton_split_sum_kernel[(tuning.cdiv(m * n, block),)](ws, out, m, n, splits, out.stride(0), BLOCK=block)
    return out
