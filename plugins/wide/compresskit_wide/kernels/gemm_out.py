"""Output-width masked GEMM (q; gate and up with the SwiGLU fused in).

    x:    [M, K]        tokens, flattened
    w:    [N, K]        as in nn.Linear (w_up: the same, for the fused SwiGLU)
    mask: [M, G]        True = the token needs this group of GW = (N - dense_rows) / G output channels
    out:  [M, N]        x @ w.T (or silu(x @ w.T) * (x @ w_up.T)) where active, exactly 0 elsewhere

``dense_rows``: the last rows of ``w`` are not routed but run for every token, in groups of GW
after the G routed ones (k and v stacked under q: one product instead of two).

Prefill (M > 16): persistent programs (``PER_SM`` an SM) take the items (tile of a group's tokens
in the routing layout's sorted order, active first x block of its channels) in turn: first every
item with an active token, group after group (so that the programs running at once share a group's
weight rows in L2: gate+up's weights are five times the L2), then the items whose tokens are all
inactive, which write zeros without reading a weight. In the one partial tile of a group the
inactive rows are not read. The weight tiles come through TMA descriptors (Hopper's bulk copy
engine; a row of K must be a multiple of 16 bytes), the tokens, gathered by the layout, through
asynchronous copies.

Decode (M <= 16, or up to 64 tokens that all run one set of groups: a batch's consensus set): program
(group, block of output channels) takes every token in one tile, reads the mask column itself (no
layout) and skips the weights of a group no token needs. The weight tile is the MMA's row operand
(64 or more rows: Hopper's warp-group MMA; 16 token rows could not use it), and ``K_PACK`` chunks
of K share one product: weight row ``c * BLOCK_N + j`` is channel j's chunk c, token column
``c * BLOCK_M + m`` token m's chunk c, and the diagonal blocks are kept (``packed_diagonal``). A
program then holds few output channels, so enough programs stream the weight without splitting K.

The decision in the decode product's prologue (``router_norm_out_gemm``): where the block before handed
on the router's shares (``gemm_reduce.py``), the decode kernel may take the router's decision, the
residual add and the RMSNorm over too (what ``router.triton_router_norm_from_shares`` does in a launch of
its own), so that a block runs its first product with no launch before it:

    shares: [S, M, R]  the router's bottleneck in shares; b_down [R], route_w [2G, R], route_b [2G] (fp32)
    x, delta: [M, K]   the residual and what the block before adds; norm_w [K] and eps: the RMSNorm
    ->  out [M, N] (the product of the normalised rows), execute [M, G] (bool), x + delta [M, K]

Each program decides its own group for every token (its reads of the shares are the serial part it
adds), and normalises the rows as it loads them.
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
    pdl_launch,
    zero_inactive_groups,
)
from compresskit_wide.kernels.layout import triton_routing_layout
from compresskit_wide.kernels.router import check_norm_operands, checked_shares, torch_router_norm_from_shares

try:
    import triton
    import triton.language as tl
    from triton.tools.tensor_descriptor import TensorDescriptor

    from compresskit_wide.kernels.autotune import (
        autotuned,
        descriptor_blocks,
        packed_pruner,
        prune_staged_tiles,
        prune_wider_than_group,
    )
    from compresskit_wide.kernels.common import count_decision, packed_diagonal, pdl_enter
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


def stacked_rows(w: torch.Tensor, w_up: torch.Tensor) -> torch.Tensor | None:
    """``[w; w_up]`` as one ``[2N, K]`` view where ``w_up``'s rows follow ``w``'s in memory (the runtime
    stacks gate and up so: ``stacked_linear``), so that one product computes both; else None. (The same
    test as ``stacked_linear``'s: the kernels import nothing of compresskit's core, tests/test_layers.py.)"""
    if (
        w.shape != w_up.shape
        or w.dtype != w_up.dtype
        or not (w.is_contiguous() and w_up.is_contiguous())
        or w.untyped_storage().data_ptr() != w_up.untyped_storage().data_ptr()
        or w_up.storage_offset() != w.storage_offset() + w.numel()
    ):
        return None
    return w.as_strided((2 * w.shape[0], w.shape[1]), w.stride(), w.storage_offset())


def torch_swiglu_zero(gate: torch.Tensor, up: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Reference: ``silu(gate) * up`` in fp32 (``gate, up: [M, N]``), cast to their dtype, exactly 0 in
    the inactive groups of ``mask: [M, G]``."""
    return zero_inactive_groups(F.silu(gate.float()) * up.float(), mask).to(gate.dtype)


def swiglu_zero(gate: torch.Tensor, up: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """:func:`torch_swiglu_zero` in one pass (one launch where eager PyTorch made three: the SiLU, the
    product and the select): the Triton kernel on a GPU and in the interpreter, else the reference.
    ``gate`` and ``up`` may be column slices of one product's output (unit column stride)."""
    m, n = gate.shape
    groups = mask.shape[-1]
    if up.shape != gate.shape or mask.shape[0] != m or n % groups:
        shapes = f"gate {tuple(gate.shape)}, up {tuple(up.shape)}, mask {tuple(mask.shape)}"
        raise ValueError(f"{shapes}: gate and up must be [M, N] and the mask [M, G] with G dividing N")
    if triton is None or not (gate.is_cuda or interpreted()) or m == 0:
        return torch_swiglu_zero(gate, up, mask)
    if gate.stride(1) != 1 or up.stride(1) != 1:
        gate, up = gate.contiguous(), up.contiguous()
    mask_u8 = mask_bytes(mask)
    out = torch.empty((m, n), dtype=gate.dtype, device=gate.device)
    block_n = min(1024, next_power_of_2(n))  # a program's channels, across groups (each reads its group's flag)
    grid = (m, cdiv(n, block_n))
    triton_swiglu_zero_kernel[grid](
        gate, up, mask_u8, out, n, n // groups, gate.stride(0), up.stride(0), mask_u8.stride(0), out.stride(0),
        BLOCK_N=block_n, **pdl_launch(triton_swiglu_zero_kernel, gate.device),
    )  # fmt: skip
    return out


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
    with ``zero_inactive=False``, for a caller that never reads them). The SwiGLU: gate and up in one
    product where their rows are stacked in memory (:func:`stacked_rows`), then :func:`swiglu_zero`
    (zeroed whatever ``zero_inactive`` says: the select costs nothing in that pass)."""
    routed = routed_rows(w, mask, w_up, dense_rows)
    if w_up is None:
        y = x @ w.T
        return _zero_routed(y, mask, routed) if zero_inactive else y
    both = stacked_rows(w, w_up)
    if both is None:
        return swiglu_zero(x @ w.T, x @ w_up.T, mask)
    gate, up = (x @ both.T).split(w.shape[0], dim=-1)
    return swiglu_zero(gate, up, mask)


def _live_tiles(mask: torch.Tensor, gw: int, dense_rows: int, block_m: int) -> list[int]:
    """Each launched group's token tiles holding an active token (the routed groups', then the dense rows' in
    groups of ``gw``, every token active), as the kernel counts them from the routing layout."""
    m = mask.shape[0]
    return [cdiv(c, block_m) for c in mask.sum(0).tolist() + [m] * cdiv(dense_rows, gw)]


def persistent_rounds(
    mask: torch.Tensor, gw: int, dense_rows: int, block_m: int, block_n: int, programs: int, tail_split: int = 1
) -> dict:
    """What the persistent prefill product's programs run for ``mask`` (``[M, G]``): its active items (every
    group's tiles holding an active token x blocks of ``block_n`` of its ``gw`` channels; ``dense_rows`` in
    groups of ``gw`` after them, every token active), the whole items and tail pieces a ``tail_split`` makes,
    and the rounds over ``programs`` programs (the launcher's: SMs x ``PER_SM``, capped as its grid caps them),
    counted in items' time (a piece takes 1 / ``tail_split`` of one). The kernel's time follows the rounds, not
    its multiply-adds (docs/wide-kernels-h200.md, "Rounds"). Computed on the host as the kernel computes it from
    the routing layout's counts."""
    live_tiles, tiles_n = _live_tiles(mask, gw, dense_rows, block_m), cdiv(gw, block_n)
    programs = min(programs, cdiv(mask.shape[0], block_m) * tiles_n * len(live_tiles))  # as the grid caps them
    live = sum(live_tiles) * tiles_n
    whole, pieces = live, 0
    split = block_n // _tail_width({"BLOCK_N": block_n, "TAIL_SPLIT": tail_split})
    if split > 1 and (live % programs) * split <= programs:
        whole = live // programs * programs
        pieces = (live - whole) * split
    rounds = cdiv(whole, programs) + (1 / split if pieces else 0)
    return {"items": live, "whole": whole, "pieces": pieces, "rounds": rounds}


def persistent_order(
    mask: torch.Tensor, gw: int, dense_rows: int, block_m: int, block_n: int
) -> list[tuple[int, int, int]]:
    """The persistent prefill product's active items for ``mask`` (``[M, G]``; ``dense_rows`` in groups of ``gw``
    after the routed ones, every token active) in the order its programs take them, each as (group, tile of the
    group's sorted tokens, tile of its channels): group after group, each group's token tiles in turn."""
    tiles_n = cdiv(gw, block_n)
    live = _live_tiles(mask, gw, dense_rows, block_m)
    return [(g, tm, tn) for g, n in enumerate(live) for tm in range(n) for tn in range(tiles_n)]


def _tail_width(meta: dict) -> int:
    """The channels of a piece of the persistent prefill product's split tail (its tail descriptors' block rows):
    ``BLOCK_N / TAIL_SPLIT`` where that is at least 16, else the item's whole ``BLOCK_N`` (not split)."""
    split = meta["TAIL_SPLIT"]
    return meta["BLOCK_N"] // split if meta["BLOCK_N"] >= 16 * split else meta["BLOCK_N"]


if triton is not None:

    @triton.jit
    def triton_swiglu_zero_kernel(
        g_ptr, u_ptr, mask_ptr, out_ptr, N, GW, stride_gm, stride_um, stride_mm, stride_om,
        BLOCK_N: tl.constexpr,
        PDL: tl.constexpr = False,
    ):  # fmt: skip
        # program (token m, block of channels): silu(gate) * up in fp32 where the channel's group is active
        pdl_enter(PDL)
        m = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        ok = cols < N
        on = tl.load(mask_ptr + m * stride_mm + cols // GW, mask=ok, other=0) != 0
        g = tl.load(g_ptr + m * stride_gm + cols, mask=ok & on, other=0.0).to(tl.float32)
        u = tl.load(u_ptr + m * stride_um + cols, mask=ok & on, other=0.0).to(tl.float32)
        y = g / (1.0 + tl.exp(-g)) * u
        tl.store(out_ptr + m * stride_om + cols, tl.where(on, y, 0.0).to(out_ptr.dtype.element_ty), mask=ok)

    @triton.jit
    def _decide_group(
        sh_ptr, bd_ptr, rw_ptr, rb_ptr, g, rows, S, M, R,
        BLOCK_M: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_R: tl.constexpr,
    ):  # fmt: skip
        # group g's decision for each of the M tokens (False on the rows past them) from the router's shares
        # ``[S, M, R]``: a token's shares summed (BLOCK_S at once: all of them at decode widths, as the decision's
        # own launch sums them), the bottleneck's bias added, both logits on the CUDA cores in fp32, compared
        rs = tl.arange(0, BLOCK_R)
        r_ok = rs < R
        bias = tl.load(bd_ptr + rs, mask=r_ok, other=0.0)
        w_exec = tl.load(rw_ptr + 2 * g * R + rs, mask=r_ok, other=0.0)
        w_skip = tl.load(rw_ptr + (2 * g + 1) * R + rs, mask=r_ok, other=0.0)
        b_exec, b_skip = tl.load(rb_ptr + 2 * g), tl.load(rb_ptr + 2 * g + 1)
        on = tl.zeros((BLOCK_M,), dtype=tl.int32)
        for m in range(0, M):
            z = tl.zeros((BLOCK_R,), dtype=tl.float32)
            for s0 in range(0, S, BLOCK_S):
                ss = s0 + tl.arange(0, BLOCK_S)
                part = tl.load(
                    sh_ptr + (ss[:, None] * M + m) * R + rs[None, :], mask=(ss < S)[:, None] & r_ok[None, :], other=0.0
                )
                z += tl.sum(part, axis=0)
            z += bias
            l_exec = tl.sum(w_exec * z, axis=0) + b_exec
            l_skip = tl.sum(w_skip * z, axis=0) + b_skip
            on = tl.where(rows == m, (l_skip <= l_exec).to(tl.int32), on)
        return on != 0

    @triton.jit
    def _packed(v, K_PACK: tl.constexpr, BLOCK_M: tl.constexpr):
        # a per-token vector ``[BLOCK_M]`` at the K-packed product's token columns: column c is token c % BLOCK_M
        return tl.reshape(tl.broadcast_to(v[None, :], (K_PACK, BLOCK_M)), (K_PACK * BLOCK_M,))

    @triton.jit
    def triton_masked_out_gemv_kernel(
        x_ptr, w_ptr, wu_ptr, out_ptr, mask_ptr,
        M, N, K, GW, G,
        stride_xm, stride_wn, stride_om, stride_mm,
        sh_ptr, bd_ptr, rw_ptr, rb_ptr, dx_ptr, nw_ptr, xn_ptr, cnt_ptr, S, R, eps,
        FUSE_SWIGLU: tl.constexpr, DOT_PRECISION: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, K_PACK: tl.constexpr,
        DECIDE: tl.constexpr = False, COUNT: tl.constexpr = False, BLOCK_S: tl.constexpr = 1,
        BLOCK_R: tl.constexpr = 16, ROW_K: tl.constexpr = 16,
        PDL: tl.constexpr = False,
    ):  # fmt: skip
        # decode, program (g, n-block): BLOCK_N output channels of group g for every token (past the
        # G routed groups, dense rows: every token). DECIDE: the mask is not read but decided here from the
        # router's shares (each group's first program stores its column of it, and counts it with COUNT), the
        # input is the RMSNorm (weight nw, eps) of x + dx, and the first program stores x + dx into xn (ROW_K
        # columns of every token a step: a row's statistics in few steps, not BLOCK_K's many)
        pdl_enter(PDL)
        g = tl.program_id(0)
        g_routed = tl.minimum(g, G - 1)  # where a dense-rows group reads (and then ignores) the mask
        col0 = tl.program_id(1) * BLOCK_N
        rows = tl.arange(0, BLOCK_M)
        row_ok = rows < M
        if DECIDE:
            if g < G:
                on = _decide_group(sh_ptr, bd_ptr, rw_ptr, rb_ptr, g, rows, S, M, R, BLOCK_M, BLOCK_S, BLOCK_R)
                if tl.program_id(1) == 0:
                    tl.store(mask_ptr + rows * stride_mm + g, on.to(tl.uint8), mask=row_ok)
                    if COUNT:
                        executed = tl.sum(on.to(tl.float32), axis=0)
                        count_decision(cnt_ptr, tl.sum(row_ok.to(tl.float32), axis=0), executed, g == 0)
            else:
                on = row_ok
            if g == 0 and tl.program_id(1) == 0:  # the residual, x + dx, rounded as the add rounds
                for k0 in range(0, K, ROW_K):
                    ks = k0 + tl.arange(0, ROW_K)
                    offs = rows[:, None] * stride_xm + ks[None, :]
                    ok = row_ok[:, None] & (ks < K)[None, :]
                    xa = tl.load(x_ptr + offs, mask=ok, other=0.0).to(tl.float32)
                    xb = tl.load(dx_ptr + offs, mask=ok, other=0.0).to(tl.float32)
                    tl.store(xn_ptr + offs, (xa + xb).to(xn_ptr.dtype.element_ty), mask=ok)
        else:
            flags = tl.load(mask_ptr + rows * stride_mm + g_routed, mask=row_ok, other=0)
            on = (tl.where(g < G, flags, 1) != 0) & row_ok
        cols = g * GW + col0 + tl.arange(0, BLOCK_N)
        out_ptrs = out_ptr + rows[:, None] * stride_om + cols[None, :]
        store_mask = row_ok[:, None] & (((col0 + tl.arange(0, BLOCK_N)) < GW) & (cols < N))[None, :]
        if tl.sum(on.to(tl.int32), axis=0) == 0:  # no token needs the group: zeros, no weight read
            tl.store(out_ptrs, tl.zeros((BLOCK_M, BLOCK_N), dtype=out_ptr.dtype.element_ty), mask=store_mask)
        else:
            r = tl.arange(0, K_PACK * BLOCK_N)  # MMA row: channel r % BLOCK_N, chunk r // BLOCK_N
            w_rows = g * GW + col0 + r % BLOCK_N
            w_ok = ((col0 + r % BLOCK_N) < GW) & (w_rows < N)
            w_k = (r // BLOCK_N) * BLOCK_K
            c = tl.arange(0, K_PACK * BLOCK_M)  # MMA column: token c % BLOCK_M, chunk c // BLOCK_M
            tok = c % BLOCK_M
            if DECIDE:
                tok_on = _packed(on, K_PACK, BLOCK_M)
                # each token's 1 / rms of x + dx (rounded as the add rounds), in fp32
                squares = tl.zeros((BLOCK_M,), dtype=tl.float32)
                for k0 in range(0, K, ROW_K):
                    ks = k0 + tl.arange(0, ROW_K)
                    offs = rows[:, None] * stride_xm + ks[None, :]
                    ok = on[:, None] & (ks < K)[None, :]
                    xa = tl.load(x_ptr + offs, mask=ok, other=0.0).to(tl.float32)
                    xb = tl.load(dx_ptr + offs, mask=ok, other=0.0).to(tl.float32)
                    xs = (xa + xb).to(x_ptr.dtype.element_ty).to(tl.float32)
                    squares += tl.sum(xs * xs, axis=1)
                tok_rstd = _packed(1.0 / tl.sqrt(squares / K + eps), K_PACK, BLOCK_M)
            else:
                tok_flags = tl.load(mask_ptr + tok * stride_mm + g_routed, mask=tok < M, other=0)
                tok_on = (tl.where(g < G, tok_flags, 1) != 0) & (tok < M)
            x_k = (c // BLOCK_M) * BLOCK_K
            kk = tl.arange(0, BLOCK_K)
            acc = tl.zeros((K_PACK * BLOCK_N, K_PACK * BLOCK_M), dtype=tl.float32)
            acc_up = tl.zeros((K_PACK * BLOCK_N, K_PACK * BLOCK_M), dtype=tl.float32)
            for k0 in range(0, K, K_PACK * BLOCK_K):
                kx = k0 + x_k[:, None] + kk[None, :]
                x_mask = tok_on[:, None] & (kx < K)
                a = tl.load(x_ptr + tok[:, None] * stride_xm + kx, mask=x_mask, other=0.0)
                if DECIDE:  # Llama's RMSNorm of x + dx: normalised in fp32, rounded, times the weight, rounded
                    xb = tl.load(dx_ptr + tok[:, None] * stride_xm + kx, mask=x_mask, other=0.0)
                    xs = (a.to(tl.float32) + xb.to(tl.float32)).to(a.dtype).to(tl.float32)
                    normed = (xs * tok_rstd[:, None]).to(a.dtype).to(tl.float32)
                    nw = tl.load(nw_ptr + kx, mask=kx < K, other=0.0).to(tl.float32)
                    a = (nw * normed).to(a.dtype)
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
    def _group_of(item, cum, lanes):
        # the group whose items (inclusive prefix sums ``cum`` over the groups' lanes) hold ``item``,
        # and its first item
        g = tl.sum((cum <= item).to(tl.int32), axis=0)
        first = tl.sum(tl.where(lanes == g - 1, cum, 0), axis=0)
        return g, first

    @triton.jit
    def _live_item(
        x_ptr, w_desc, wu_desc, out_ptr, order_ptr, counts_ptr, item, part, cum_live, lanes, tiles_n,
        M, N, K, GW, G, stride_xm, stride_om,
        FUSE_SWIGLU: tl.constexpr, DOT_PRECISION: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, WIDTH: tl.constexpr, BLOCK_K: tl.constexpr,
    ):  # fmt: skip
        # one active item (tile of a group's sorted tokens x block of BLOCK_N of its channels), or its
        # ``part``-th piece of WIDTH channels (the descriptors' block WIDTH x BLOCK_K)
        g, first = _group_of(item, cum_live, lanes)  # (group after group, each group's token tiles in turn)
        tm = (item - first) // tiles_n
        tn = (item - first) % tiles_n
        routed = g < G
        g_routed = tl.minimum(g, G - 1)
        count = tl.where(routed, tl.load(counts_ptr + g_routed), M)
        slots = tm * BLOCK_M + tl.arange(0, BLOCK_M)
        in_range = slots < M
        rows = tl.load(order_ptr + g_routed * M + slots, mask=in_range, other=0)
        rows = tl.where(routed, rows, slots).to(tl.int64)  # a prefill's M x N may pass 2**31
        active = slots < count
        c0 = tn * BLOCK_N + part * WIDTH  # the piece's first channel within its group
        n0 = g * GW + c0
        acc = tl.zeros((BLOCK_M, WIDTH), dtype=tl.float32)
        acc_up = tl.zeros((BLOCK_M, WIDTH), dtype=tl.float32)
        x_rows = x_ptr + rows[:, None] * stride_xm
        for k0 in range(0, K, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            a = tl.load(x_rows + ks[None, :], mask=active[:, None] & (ks < K)[None, :], other=0.0)
            acc = tl.dot(a, tl.trans(w_desc.load([n0, k0])), acc, input_precision=DOT_PRECISION)
            if FUSE_SWIGLU:
                acc_up = tl.dot(a, tl.trans(wu_desc.load([n0, k0])), acc_up, input_precision=DOT_PRECISION)
        if FUSE_SWIGLU:
            acc = acc * tl.sigmoid(acc) * acc_up
        acc = tl.where(active[:, None], acc, 0.0)
        cols_in = tl.arange(0, WIDTH)
        cols = n0 + cols_in
        col_ok = ((c0 + cols_in) < GW) & (cols < N)
        tl.store(
            out_ptr + rows[:, None] * stride_om + cols[None, :],
            acc.to(out_ptr.dtype.element_ty),
            mask=in_range[:, None] & col_ok[None, :],
        )

    @triton.jit
    def triton_persistent_out_gemm_kernel(
        x_ptr, w_desc, wu_desc, w_tail_desc, wu_tail_desc, out_ptr, order_ptr, counts_ptr,
        M, N, K, GW, G, LAUNCHED, M_BUCKET,
        stride_xm, stride_om,
        FUSE_SWIGLU: tl.constexpr, DOT_PRECISION: tl.constexpr, GROUPS_P2: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PER_SM: tl.constexpr,
        TAIL_SPLIT: tl.constexpr,
        PDL: tl.constexpr = False,
    ):  # fmt: skip
        # prefill, persistent (PER_SM programs an SM: read by the launcher's grid): the programs take
        # the active items (tile of a group's sorted tokens x block of its channels) in turn, every
        # group's, then the items whose tokens are all inactive (zeros, no weight read). The weight
        # tiles come through TMA descriptors; the tokens, gathered by the routing layout, through
        # asynchronous copies. A group past the G routed ones (dense rows) takes every token in order.
        # TAIL_SPLIT > 1: where the last round of active items fills at most 1 / TAIL_SPLIT of the
        # programs, its items run in TAIL_SPLIT pieces of BLOCK_N / TAIL_SPLIT channels each (the tail
        # descriptors' block; at least 16), a piece a program, so that the round takes a piece's time.
        # M_BUCKET is only the autotuning key.
        pdl_enter(PDL)
        tiles_m = tl.cdiv(M, BLOCK_M)
        tiles_n = tl.cdiv(GW, BLOCK_N)
        lanes = tl.arange(0, GROUPS_P2)
        counts = tl.load(counts_ptr + lanes, mask=lanes < G, other=0)
        counts = tl.where(lanes < G, counts, tl.where(lanes < LAUNCHED, M, 0))
        live = tl.cdiv(counts, BLOCK_M)  # a group's tiles holding an active token
        cum_live = tl.cumsum(live * tiles_n, axis=0)
        cum_zero = tl.cumsum(tl.where(lanes < LAUNCHED, tiles_m - live, 0) * tiles_n, axis=0)
        n_live = tl.max(cum_live, axis=0)
        n_zero = tl.max(cum_zero, axis=0)
        programs = tl.num_programs(0)
        whole = n_live  # the active items run whole
        if TAIL_SPLIT > 1 and BLOCK_N >= 16 * TAIL_SPLIT:
            rounds = n_live // programs * programs
            whole = tl.where((n_live - rounds) * TAIL_SPLIT <= programs, rounds, n_live)
        for item in tl.range(tl.program_id(0), whole, programs):
            _live_item(
                x_ptr, w_desc, wu_desc, out_ptr, order_ptr, counts_ptr, item, 0, cum_live, lanes, tiles_n,
                M, N, K, GW, G, stride_xm, stride_om, FUSE_SWIGLU, DOT_PRECISION, BLOCK_M, BLOCK_N, BLOCK_N, BLOCK_K,
            )  # fmt: skip
        if TAIL_SPLIT > 1 and BLOCK_N >= 16 * TAIL_SPLIT:
            for piece in tl.range(tl.program_id(0), (n_live - whole) * TAIL_SPLIT, programs):
                _live_item(
                    x_ptr, w_tail_desc, wu_tail_desc, out_ptr, order_ptr, counts_ptr, whole + piece // TAIL_SPLIT,
                    piece % TAIL_SPLIT, cum_live, lanes, tiles_n, M, N, K, GW, G, stride_xm, stride_om,
                    FUSE_SWIGLU, DOT_PRECISION, BLOCK_M, BLOCK_N, BLOCK_N // TAIL_SPLIT, BLOCK_K,
                )  # fmt: skip
        cols_in = tl.arange(0, BLOCK_N)
        for item in tl.range(tl.program_id(0), n_zero, tl.num_programs(0)):
            g, first = _group_of(item, cum_zero, lanes)
            live_g = tl.sum(tl.where(lanes == g, live, 0), axis=0)
            tm = live_g + (item - first) // tiles_n
            tn = (item - first) % tiles_n
            slots = tm * BLOCK_M + tl.arange(0, BLOCK_M)
            in_range = slots < M
            rows = tl.load(order_ptr + g * M + slots, mask=in_range, other=0).to(tl.int64)  # routed groups only
            cols = g * GW + tn * BLOCK_N + cols_in
            col_ok = ((tn * BLOCK_N + cols_in) < GW) & (cols < N)
            tl.store(
                out_ptr + rows[:, None] * stride_om + cols[None, :],
                tl.zeros((BLOCK_M, BLOCK_N), dtype=out_ptr.dtype.element_ty),
                mask=in_range[:, None] & col_ok[None, :],
            )

    _tuned_prefill = autotuned(
        triton_persistent_out_gemm_kernel,
        policy.OUT_PERSISTENT,
        ["M_BUCKET", "N", "K", "GW", "FUSE_SWIGLU", "TAIL_SPLIT"],  # (each TAIL_SPLIT its own tile)
        decode=False,
        prune=prune_staged_tiles("BLOCK_N"),
        pre_hook=descriptor_blocks(
            w_desc=("BLOCK_N", "BLOCK_K"),
            wu_desc=("BLOCK_N", "BLOCK_K"),
            w_tail_desc=(_tail_width, "BLOCK_K"),
            wu_tail_desc=(_tail_width, "BLOCK_K"),
        ),
    )
    _decode_key = ["M", "N", "K", "GW", "FUSE_SWIGLU", "BLOCK_M"]

    def _decode_tables(restore: tuple[str, ...] = ()) -> dict:
        """The decode kernel autotuned for each packing ``auto`` takes (``policy.out_k_pack``): K-packed
        tables, and gate+up's at ``policy.SWIGLU_K_PACK``; ``restore``: as ``autotuned``'s."""
        tables = {
            pack: autotuned(
                triton_masked_out_gemv_kernel,
                policy.per_packing(policy.PACKED_DECODE_ROWS, pack),
                _decode_key,
                decode=True,
                prune=packed_pruner("BLOCK_N"),
                restore=restore,
            )
            for pack in sorted({pack for _, pack in policy.OUT_K_PACK})
        }
        tables[policy.SWIGLU_K_PACK] = autotuned(
            triton_masked_out_gemv_kernel,
            policy.SWIGLU_DECODE,
            _decode_key,
            decode=True,
            prune=prune_wider_than_group("BLOCK_N"),
            restore=restore,
        )
        return tables

    _tuned_decode = _decode_tables()
    _tuned_decide = _decode_tables(restore=("cnt_ptr",))  # (the decision's counters: a timed call adds to them)


def _operands(x, w, mask, w_up, dense_rows) -> tuple[int, int, int, int, int, int]:
    """(M, K, N, G, the group width, the groups launched: the routed ones, then the dense rows in groups of
    that width), the shapes checked."""
    if triton is None:
        raise RuntimeError("triton is not installed")
    m, k = x.shape
    n, groups = w.shape[0], mask.shape[-1]
    if w.shape[1] != k or mask.shape[0] != m or (w_up is not None and w_up.shape != w.shape):
        raise ValueError(f"shapes do not fit: x {tuple(x.shape)}, w {tuple(w.shape)}, mask {tuple(mask.shape)}")
    gw = routed_rows(w, mask, w_up, dense_rows) // groups
    return m, k, n, groups, gw, groups + cdiv(dense_rows, gw)


def triton_masked_out_gemm(
    x: torch.Tensor,
    w: torch.Tensor,
    mask: torch.Tensor,
    w_up: torch.Tensor | None = None,
    *,
    dense_rows: int = 0,
    out: torch.Tensor | None = None,
    block_m: int | None = None,
    block_n: int | None = None,
    block_k: int | None = None,
    k_pack: int | None = None,
    shared: bool = False,
) -> torch.Tensor:
    """Triton version of :func:`torch_masked_out_gemm`. Up to ``policy.DECODE_MAX_M`` tokens (or
    ``policy.SHARED_MAX_M`` where they all run one set of groups, ``shared``) the decode kernel (``k_pack``:
    K chunks a product, a power of two; default ``policy.out_k_pack``); more, the persistent prefill kernel
    (:func:`triton_persistent_out_gemm`) on the routing layout of ``mask``. ``dense_rows``: the last rows of
    ``w`` run for every token. Tiles are autotuned on a GPU (for the packings ``policy.out_k_pack`` gives);
    ``block_*`` fix them, for any packing (and do in the CPU interpreter)."""
    m, k, n, groups, gw, launched = _operands(x, w, mask, w_up, dense_rows)
    fuse = w_up is not None
    x, w = x.contiguous(), w.contiguous()
    w_up = w_up.contiguous() if fuse else w
    out = torch.empty((m, n), dtype=x.dtype, device=x.device) if out is None else out
    common = {"FUSE_SWIGLU": fuse, "DOT_PRECISION": dot_precision(x.dtype)}
    fixed = block_n is not None or interpreted()
    if policy.decode_kernel(m, shared):
        mask_u8 = mask_bytes(mask)
        args = (x, w, w_up, out, mask_u8, m, n, k, gw, groups, x.stride(0), w.stride(0), out.stride(0))
        args += (mask_u8.stride(0), x, x, x, x, x, x, x, x, 1, 1, 0.0)  # (no decision: its operands unread)
        _decode_launch(args, common, m, launched, gw, fuse, k_pack, block_n, block_k, None if fixed else _tuned_decode)
        return out
    if k_pack not in (None, 1):
        raise ValueError(f"k_pack is for the decode kernel (M <= {policy.DECODE_MAX_M}, or shared); got M={m}")
    return triton_persistent_out_gemm(
        x, w, mask, w_up if fuse else None, dense_rows=dense_rows, out=out, block_m=block_m, block_n=block_n,
        block_k=block_k,
    )  # fmt: skip


# values the prologue's decision loads at once: a token's shares (all of them at Llama-3.1-8B's width), and a
# step of its rows for the norm's statistics (all of K at SmolLM2's width and M <= 4)
VALUES_AT_ONCE = 8192


def _k_pack(m: int, fuse: bool, k_pack: int | None) -> int:
    """The decode kernel's K chunks a product for ``m`` tokens: ``k_pack``, checked, or ``policy.out_k_pack``'s."""
    k_pack = policy.out_k_pack(m, fuse) if k_pack is None else k_pack
    if k_pack < 1 or k_pack & (k_pack - 1):
        raise ValueError(f"k_pack must be a power of two, got {k_pack}")
    if m > policy.DECODE_MAX_M and k_pack != 1:
        raise ValueError(f"k_pack={k_pack}: past {policy.DECODE_MAX_M} tokens the decode kernel does not pack K")
    return k_pack


def _decode_block_m(m: int, k_pack: int) -> int:
    """The decode kernel's token tile: every token, and 16 or more MMA columns over the K chunks."""
    return max(next_power_of_2(m), 16 // k_pack)


def _decode_launch(args, common, m, launched, gw, fuse, k_pack, block_n, block_k, tuned) -> None:
    """Launch the decode kernel on ``args`` for ``m`` tokens: ``k_pack`` K chunks a product (default
    ``policy.out_k_pack``), the tile fixed (``block_n`` / ``block_k``, or small defaults) where ``tuned``
    (the autotuned kernels by packing) is None."""
    k_pack = _k_pack(m, fuse, k_pack)
    common["BLOCK_M"] = _decode_block_m(m, k_pack)
    common |= pdl_launch(triton_masked_out_gemv_kernel, args[0].device)
    if tuned is None:
        bn, bk = block_n or max(16 // k_pack, 1), block_k or 32
        if k_pack * bn < 16 or bk < 16:
            raise ValueError(f"block_n={bn} x k_pack={k_pack} and block_k={bk}: tl.dot needs 16 or more of each")
        triton_masked_out_gemv_kernel[(launched, cdiv(gw, bn))](*args, **common, BLOCK_N=bn, BLOCK_K=bk, K_PACK=k_pack)
        return
    if k_pack not in tuned:
        raise ValueError(f"k_pack={k_pack} has no tile table on a GPU; tuned: {sorted(tuned)} (or fix block_n)")
    grid = lambda meta: (launched, cdiv(gw, meta["BLOCK_N"]))  # noqa: E731
    tuned[k_pack][grid](*args, **common, K_PACK=k_pack)


def torch_router_norm_out_gemm(
    shares: torch.Tensor,
    b_down: torch.Tensor,
    route_w: torch.Tensor,
    route_b: torch.Tensor,
    x: torch.Tensor,
    delta: torch.Tensor,
    norm_w: torch.Tensor,
    eps: float,
    w: torch.Tensor,
    w_up: torch.Tensor | None = None,
    dense_rows: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Reference of the decision in the product's prologue: ``(out, execute, x + delta)``, the router's
    decision from its shares with the residual add and the RMSNorm (``router.torch_router_norm_from_shares``),
    then :func:`torch_masked_out_gemm` of the normalised rows over the kept groups."""
    execute, x_new, h = torch_router_norm_from_shares(shares, b_down, route_w, route_b, x, delta, norm_w, eps)
    return torch_masked_out_gemm(h, w, execute, w_up, dense_rows), execute, x_new


def triton_router_norm_out_gemm(
    shares: torch.Tensor,
    b_down: torch.Tensor,
    route_w: torch.Tensor,
    route_b: torch.Tensor,
    x: torch.Tensor,
    delta: torch.Tensor,
    norm_w: torch.Tensor,
    eps: float,
    w: torch.Tensor,
    w_up: torch.Tensor | None = None,
    *,
    dense_rows: int = 0,
    counts: torch.Tensor | None = None,
    block_n: int | None = None,
    block_k: int | None = None,
    k_pack: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`torch_router_norm_out_gemm` in one launch, for decode sizes (up to ``policy.DECODE_MAX_M``
    tokens): the decode kernel's program of group g decides g from the shares ``[S, M, R]`` itself (as
    ``router.triton_router_decide_from_shares`` does; each group's first program stores its column of the
    decision and, with ``counts``, counts it), normalises ``x + delta`` (weight ``norm_w``, ``eps``: Llama's
    RMSNorm, as ``router.triton_router_norm_from_shares`` rounds it) as it loads it, and runs the product
    of :func:`triton_masked_out_gemm` (``w_up``: the fused SwiGLU; ``dense_rows``: the last rows of ``w``
    for every token); its first program stores ``x + delta``. Tiles as the decode kernel's."""
    s, m, r, groups = checked_shares(shares, b_down, route_w, route_b, 1, counts)
    if m > policy.DECODE_MAX_M:
        raise ValueError(f"the decision in the product's prologue is for decode sizes: M={m} > {policy.DECODE_MAX_M}")
    check_norm_operands(m, x, delta, norm_w)
    execute = torch.empty((m, groups), dtype=torch.uint8, device=x.device)
    _, k, n, groups, gw, launched = _operands(x, w, execute, w_up, dense_rows)
    fuse = w_up is not None
    x, delta, norm_w, w = x.contiguous(), delta.contiguous(), norm_w.contiguous(), w.contiguous()
    w_up = w_up.contiguous() if fuse else w
    shares, b_down, route_w, route_b = (t.contiguous() for t in (shares, b_down, route_w, route_b))
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    x_new = torch.empty_like(x)
    if m == 0:
        return out, execute.view(torch.bool), x_new
    block_r = max(16, next_power_of_2(r))
    k_pack = _k_pack(m, fuse, k_pack)
    common = {
        "FUSE_SWIGLU": fuse,
        "DOT_PRECISION": dot_precision(x.dtype),
        "DECIDE": True,
        "COUNT": counts is not None,
        "BLOCK_S": min(next_power_of_2(s), VALUES_AT_ONCE // block_r),  # a token's shares a load
        "BLOCK_R": block_r,
        # the rows' columns a step of the norm's statistics: as many values at once as the shares
        "ROW_K": max(16, min(next_power_of_2(k), VALUES_AT_ONCE // _decode_block_m(m, k_pack))),
    }
    args = (x, w, w_up, out, execute, m, n, k, gw, groups, x.stride(0), w.stride(0), out.stride(0), execute.stride(0))
    args += (shares, b_down, route_w, route_b, delta, norm_w, x_new, execute if counts is None else counts, s, r, eps)
    fixed = block_n is not None or interpreted()
    _decode_launch(args, common, m, launched, gw, fuse, k_pack, block_n, block_k, None if fixed else _tuned_decide)
    return out, execute.view(torch.bool), x_new


def _tma_ready(w: torch.Tensor) -> bool:
    """A TMA descriptor can read ``w`` with no extra copy: rows of a multiple of 16 bytes, and a 16-byte
    aligned start (a weight not contiguous is copied to a fresh, aligned tensor by any kernel)."""
    return (w.shape[1] * w.element_size()) % 16 == 0 and (w.data_ptr() % 16 == 0 or not w.is_contiguous())


def out_kernel_takes(x: torch.Tensor, w: torch.Tensor, shared: bool = False, w_up: torch.Tensor | None = None) -> bool:
    """Whether ``auto`` runs :func:`triton_masked_out_gemm` on these operands at no extra cost: the prefill
    kernel reads the weights through TMA descriptors, which need them 16-byte aligned (a weight mapped from
    a file may start anywhere; the decode kernel takes any)."""
    if policy.decode_kernel(x.shape[0], shared):
        return True
    return all(_tma_ready(t) for t in (w, w_up) if t is not None)


def _aligned(w: torch.Tensor) -> torch.Tensor:
    return w if w.data_ptr() % 16 == 0 else w.clone()


def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def triton_persistent_out_gemm(
    x: torch.Tensor,
    w: torch.Tensor,
    mask: torch.Tensor,
    w_up: torch.Tensor | None = None,
    *,
    dense_rows: int = 0,
    out: torch.Tensor | None = None,
    block_m: int | None = None,
    block_n: int | None = None,
    block_k: int | None = None,
    warps: int = 4,
    stages: int = 3,
    per_sm: int = 1,
    programs: int | None = None,
    tail_split: int | None = None,
) -> torch.Tensor:
    """The prefill product of :func:`triton_masked_out_gemm`: persistent programs (the tile's
    ``PER_SM`` an SM on a GPU; ``programs`` fixes their number) over the active tiles first, the weight
    through TMA descriptors (``K`` x the element size must be a multiple of 16 bytes). Tiles are autotuned
    on a GPU (``policy.OUT_PERSISTENT``); ``block_*`` fix them (and do in the CPU interpreter), with
    ``warps``, ``stages`` and ``per_sm``. ``tail_split`` (default the product's, ``policy.out_tail_split``):
    2, a last round of active items that fills at most half the programs runs in two pieces of each item's
    channels (where a piece has at least 16); 1, whole items."""
    m, k, n, groups, gw, launched = _operands(x, w, mask, w_up, dense_rows)
    if (k * w.element_size()) % 16:
        raise ValueError(f"K={k}: a TMA descriptor needs rows of a multiple of 16 bytes ({w.dtype})")
    fuse = w_up is not None
    # a weight whose start is not 16-byte aligned (mapped from a file) is read from an aligned copy
    x, w = x.contiguous(), _aligned(w.contiguous())
    w_up = _aligned(w_up.contiguous()) if fuse else w
    out = torch.empty((m, n), dtype=x.dtype, device=x.device) if out is None else out
    order, counts = triton_routing_layout(mask)
    tail_split = policy.out_tail_split(fuse) if tail_split is None else tail_split
    if tail_split not in (1, 2):
        raise ValueError(f"tail_split={tail_split}: 1 or 2 pieces an item")
    fixed = block_n is not None or interpreted()
    bm, bn, bk = block_m or 16, block_n or 32, block_k or 32
    tail = _tail_width({"BLOCK_N": bn, "TAIL_SPLIT": tail_split})
    descs = [TensorDescriptor.from_tensor(t, [rows, bk]) for rows in (bn, tail) for t in (w, w_up)]
    sms = 3 if interpreted() else _sm_count(x.device)
    args = (x, *descs, out, order, counts, m, n, k, gw, groups, launched, m_bucket(m))
    args += (x.stride(0), out.stride(0))
    common = {
        "FUSE_SWIGLU": fuse,
        "DOT_PRECISION": dot_precision(x.dtype),
        "GROUPS_P2": max(2, next_power_of_2(launched)),
        "TAIL_SPLIT": tail_split,
        **pdl_launch(triton_persistent_out_gemm_kernel, x.device),
    }

    def grid(meta):
        most = cdiv(m, meta["BLOCK_M"]) * cdiv(gw, meta["BLOCK_N"]) * launched
        return (min(programs or sms * meta["PER_SM"], most),)

    if fixed:
        meta = {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "PER_SM": per_sm}
        triton_persistent_out_gemm_kernel[grid(meta)](*args, **common, **meta, num_warps=warps, num_stages=stages)
    else:
        _tuned_prefill[grid](*args, **common)
    return out
