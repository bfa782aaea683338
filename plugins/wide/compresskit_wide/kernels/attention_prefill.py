"""Routed attention for prefill: flash attention over each head group's active queries only.

    q:    [B, Hq, T, D]      the new tokens' queries (after RoPE)
    k, v: [B, Hkv, S, D]     keys and values of the cache plus the new tokens (S = past + T)
    mask: [B, T, Hq / A]     True = token t runs group g (A query heads)
    out:  [B, Hq, T, D]      causal attention (query t at position past + t) for active (t, head),
                             exactly 0 for inactive; the kernel stores it as [B, T, Hq, D] (a transposed
                             view is returned), the layout o reads, so that no copy follows

Per sequence and head group the tokens are sorted active-first (the routing layout); program
(b, heads, tile) takes one tile of the sorted tokens for one or more query heads of a group that
share a KV head (the rows: tokens x heads), gathers their queries, runs causal flash attention with
their original positions and scatters the result back. Tiles with no active token
only write zeros and read neither Q, K nor V; the key loop stops at the last active token's position,
and the key blocks at or before the tile's first active position (every active query sees all of
them) run without the causal mask (nor its guards). The programs of a head take its busy tiles
longest first (the last one first: the causal work grows with position), which keeps the GPU full
to the end; the softmax is in base 2 (``common.softmax_scale``). Tiles are autotuned on a GPU
(``policy.ATTN_PREFILL``, keyed on the power-of-two bucket of T).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from compresskit_wide.kernels import policy
from compresskit_wide.kernels.common import (
    cdiv,
    dot_precision,
    interpreted,
    m_bucket,
    next_power_of_2,
    pdl_launch,
    softmax_scale,
    zero_inactive_heads,
)
from compresskit_wide.kernels.layout import triton_routing_layout

try:
    import triton
    import triton.language as tl

    from compresskit_wide.kernels.autotune import autotuned, prune_heads_per_program
    from compresskit_wide.kernels.common import online_softmax_step, online_softmax_step_all, pdl_enter
except ImportError:
    triton = None


def torch_routed_attention_prefill(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    """Reference (fp32 math, cast to ``q.dtype``)."""
    b, hq, t, d = q.shape
    hkv, s = k.shape[1], k.shape[2]
    past = s - t
    kk = k.float().repeat_interleave(hq // hkv, dim=1)
    vv = v.float().repeat_interleave(hq // hkv, dim=1)
    scores = q.float() @ kk.transpose(-1, -2) / math.sqrt(d)  # [B, Hq, T, S]
    causal = torch.arange(s, device=q.device)[None, :] <= (past + torch.arange(t, device=q.device))[:, None]
    scores = scores.masked_fill(~causal, float("-inf"))
    out = torch.softmax(scores, dim=-1) @ vv  # [B, Hq, T, D]
    return zero_inactive_heads(out, mask).to(q.dtype)


def dense_routed_attention_prefill(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    """The dense fallback: causal SDPA with native GQA (query t at position past + t), the inactive
    (token, head) zeroed."""
    t, s = q.shape[2], k.shape[2]
    if s == t:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    else:  # SDPA's is_causal aligns top-left: the diagonal shifted by the past length
        allowed = torch.arange(s, device=q.device)[None, :] <= (s - t + torch.arange(t, device=q.device))[:, None]
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, enable_gqa=True)
    return zero_inactive_heads(out, mask)


if triton is not None:

    @triton.jit
    def triton_attn_prefill_kernel(
        q_ptr,
        k_ptr,
        v_ptr,
        out_ptr,
        order_ptr,
        counts_ptr,
        HQ,
        T,
        S,
        D,
        G,
        T_BUCKET,
        scale,
        stride_qb,
        stride_qh,
        stride_qt,
        stride_kb,
        stride_kh,
        stride_ks,
        stride_ob,
        stride_oh,
        stride_ot,
        DOT_PRECISION: tl.constexpr,
        REP: tl.constexpr,
        A: tl.constexpr,
        HP: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_D: tl.constexpr,
        PDL: tl.constexpr = False,
    ):
        # program (b, head block, tile): HP query heads of one group and one KV head (they share the
        # token order and the keys) x BLOCK_M // HP of their sorted tokens, row r = (token r // HP,
        # head r % HP): the BLOCK_M rows span HP times fewer positions than one head's BLOCK_M
        # tokens, so fewer key blocks straddle the tile's causal diagonal
        pdl_enter(PDL)
        b = tl.program_id(0).to(tl.int64)  # a batch's q, k, v may pass 2**31 elements
        h0 = tl.program_id(1) * HP
        g = h0 // A
        kvh = h0 // REP
        past = S - T
        count = tl.load(counts_ptr + b * G + g)
        # longest first: the tiles with active tokens in reverse (a later tile reaches later
        # positions, so it has more keys), then the empty ones, which only write zeros
        TOKENS: tl.constexpr = BLOCK_M // HP
        n_busy = tl.cdiv(count, TOKENS)
        tm = tl.program_id(2)
        tm = tl.where(tm < n_busy, n_busy - 1 - tm, tm)
        rs = tl.arange(0, BLOCK_M)
        h = h0 + rs % HP  # [BLOCK_M] query head of each row
        slots = tm * TOKENS + rs // HP
        in_range = slots < T
        rows = tl.load(order_ptr + (b * G + g) * T + slots, mask=in_range, other=0)  # token indices
        active = slots < count
        ds = tl.arange(0, BLOCK_D)
        d_ok = ds < D
        out_ptrs = out_ptr + b * stride_ob + h[:, None] * stride_oh + rows[:, None] * stride_ot + ds[None, :]
        store_mask = in_range[:, None] & d_ok[None, :]
        if tm * TOKENS >= count:  # no active token in this tile
            tl.store(out_ptrs, tl.zeros((BLOCK_M, BLOCK_D), tl.float32).to(out_ptr.dtype.element_ty), mask=store_mask)
            return
        q = tl.load(
            q_ptr + b * stride_qb + h[:, None] * stride_qh + rows[:, None] * stride_qt + ds[None, :],
            mask=active[:, None] & d_ok[None, :],
            other=0.0,
        )
        qpos = past + rows  # original positions
        last = tl.max(tl.where(active, qpos, 0), axis=0)
        first = tl.min(tl.where(active, qpos, S), axis=0)
        m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
        l_i = tl.zeros((BLOCK_M,), tl.float32)
        acc = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)
        kv_base = b * stride_kb + kvh * stride_kh + ds[None, :]
        full_end = ((first + 1) // BLOCK_N) * BLOCK_N  # keys [0, full_end): seen by every active query
        for n0 in range(0, full_end, BLOCK_N):  # no causal mask (inactive rows: zeroed at the end)
            ns = n0 + tl.arange(0, BLOCK_N)
            kt = tl.load(k_ptr + kv_base + ns[:, None] * stride_ks, mask=d_ok[None, :], other=0.0)
            vt = tl.load(v_ptr + kv_base + ns[:, None] * stride_ks, mask=d_ok[None, :], other=0.0)
            m_i, l_i, acc = online_softmax_step_all(q, kt, vt, m_i, l_i, acc, scale, DOT_PRECISION)
        for n0 in range(full_end, last + 1, BLOCK_N):  # the diagonal blocks: causal mask
            ns = n0 + tl.arange(0, BLOCK_N)
            n_ok = ns < S
            kv_mask = n_ok[:, None] & d_ok[None, :]
            kt = tl.load(k_ptr + kv_base + ns[:, None] * stride_ks, mask=kv_mask, other=0.0)
            vt = tl.load(v_ptr + kv_base + ns[:, None] * stride_ks, mask=kv_mask, other=0.0)
            allowed = (ns[None, :] <= qpos[:, None]) & n_ok[None, :] & active[:, None]  # causal, real keys
            m_i, l_i, acc = online_softmax_step(q, kt, vt, allowed, m_i, l_i, acc, scale, DOT_PRECISION)
        res = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        res = tl.where(active[:, None], res, 0.0)
        tl.store(out_ptrs, res.to(out_ptr.dtype.element_ty), mask=store_mask)

    _tuned = autotuned(
        triton_attn_prefill_kernel,
        policy.ATTN_PREFILL,
        ["T_BUCKET", "D", "REP", "A"],
        decode=False,
        prune=prune_heads_per_program,
    )


def triton_routed_attention_prefill(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor,
    *,
    block_m: int | None = None,
    block_n: int | None = None,
    heads_per_program: int | None = None,
) -> torch.Tensor:
    """Triton version of :func:`torch_routed_attention_prefill`, over the routing layout of
    ``mask``. Tiles are autotuned on a GPU over
    ``policy.ATTN_PREFILL``; ``block_m`` rows (``heads_per_program`` query heads of one group and
    KV head x ``block_m / heads_per_program`` tokens) x ``block_n`` keys fix them (64, or 16 in the
    CPU interpreter; one head a program unless given)."""
    if triton is None:
        raise RuntimeError("triton is not installed")
    b, hq, t, d = q.shape
    hkv, s = k.shape[1], k.shape[2]
    groups = mask.shape[-1]
    if hq % hkv or hq % groups or s < t or k.shape != v.shape or k.stride(-1) != 1 or v.stride() != k.stride():
        raise ValueError(f"shapes do not fit: q {tuple(q.shape)}, k {tuple(k.shape)}, mask {tuple(mask.shape)}")
    order, counts = triton_routing_layout(mask)
    if q.stride(-1) != 1:  # the kernel reads any other strides as they are
        q = q.contiguous()
    out = torch.empty((b, t, hq, d), dtype=q.dtype, device=q.device).transpose(1, 2)  # [B, Hq, T, D]
    args = (
        q,
        k,
        v,
        out,
        order,
        counts,
        hq,
        t,
        s,
        d,
        groups,
        m_bucket(t),
        softmax_scale(d),
        q.stride(0),
        q.stride(1),
        q.stride(2),
        k.stride(0),
        k.stride(1),
        k.stride(2),
        out.stride(0),
        out.stride(1),
        out.stride(2),
    )
    common = dict(
        DOT_PRECISION=dot_precision(q.dtype),
        REP=hq // hkv,
        A=hq // groups,
        BLOCK_D=max(16, next_power_of_2(d)),
        **pdl_launch(triton_attn_prefill_kernel, q.device),
    )
    hp = heads_per_program
    if hp is not None and (math.gcd(common["REP"], common["A"]) % hp or hp not in (1, 2, 4)):
        raise ValueError(
            f"heads_per_program={hp} must be 1, 2 or 4 and divide the heads of a group ({common['A']}) "
            f"and of a KV head ({common['REP']})"
        )
    if block_m is not None or block_n is not None or interpreted():
        bm, bn = block_m or (16 if interpreted() else 64), block_n or (16 if interpreted() else 64)
        hp = hp or 1
        if bm % hp:
            raise ValueError(f"heads_per_program={hp} must divide block_m ({bm})")
        grid = (b, hq // hp, cdiv(t, bm // hp))
        triton_attn_prefill_kernel[grid](*args, **common, HP=hp, BLOCK_M=bm, BLOCK_N=bn)
    else:
        grid = lambda meta: (b, hq // meta["HP"], cdiv(t, meta["BLOCK_M"] // meta["HP"]))  # noqa: E731
        if hp is not None:
            raise ValueError("heads_per_program is for fixed tiles; the autotuner picks it on a GPU")
        _tuned[grid](*args, **common)
    return out
