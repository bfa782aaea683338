"""Routed attention for decode: split-KV flash decoding that skips the KV reads of query-head
groups no token needs.

    q:        [B, Hq, D]         the new token's queries (after RoPE)
    k, v:     [B, Hkv, S, D]     the KV cache (transformers' layout); positions >= seq_lens[b] ignored
    seq_lens: [B]                valid cache length per sequence
    mask:     [B, Hq / A]        True = the group of A query heads runs (A = attention group size)
    out:      [B, Hq, D]         softmax(q k^T / sqrt(D)) v for active heads, exactly 0 for inactive

Query head h reads KV head h // (Hq / Hkv). One program handles all the query heads of one KV head
for one KV split: when none of them is active it returns before reading a byte of K or V. A
second kernel merges the splits (log-sum-exp) and writes zeros for inactive heads.
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
    mask_bytes,
    next_power_of_2,
    pdl_launch,
    softmax_scale,
    zero_inactive_groups,
)

try:
    import triton
    import triton.language as tl

    from compresskit_wide.kernels.common import online_softmax_step, pdl_enter
except ImportError:
    triton = None


def torch_routed_attention_decode(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seq_lens: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    """Reference (fp32 math, cast to ``q.dtype``)."""
    b, hq, d = q.shape
    hkv, s = k.shape[1], k.shape[2]
    rep = hq // hkv
    kk = k.float().repeat_interleave(rep, dim=1)  # [B, Hq, S, D]
    vv = v.float().repeat_interleave(rep, dim=1)
    scores = torch.einsum("bhd,bhsd->bhs", q.float(), kk) / math.sqrt(d)  # [B, Hq, S]
    valid = torch.arange(s, device=q.device)[None, :] < seq_lens[:, None].to(q.device)  # [B, S]
    scores = scores.masked_fill(~valid[:, None, :], float("-inf"))
    out = torch.einsum("bhs,bhsd->bhd", torch.softmax(scores, dim=-1), vv)
    return zero_inactive_groups(out.reshape(b, hq * d), mask).view(b, hq, d).to(q.dtype)


def dense_routed_attention_decode(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seq_lens: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    """The dense fallback: SDPA with native GQA over each sequence's valid cache (no host
    synchronisation), the inactive heads zeroed."""
    valid = torch.arange(k.shape[2], device=q.device)[None, :] < seq_lens.to(q.device)[:, None]  # [B, S]
    out = F.scaled_dot_product_attention(q[:, :, None, :], k, v, attn_mask=valid[:, None, None, :], enable_gqa=True)
    b, hq, d = q.shape
    return zero_inactive_groups(out.reshape(b, hq * d), mask).view(b, hq, d)


if triton is not None:

    @triton.jit
    def triton_attn_decode_split_kernel(
        q_ptr, k_ptr, v_ptr, lens_ptr, mask_ptr, m_ptr, l_ptr, acc_ptr,
        HQ, HKV, S, D, SPLITS, SPLIT_LEN, scale,
        stride_qb, stride_qh, stride_kb, stride_kh, stride_ks, stride_mb,
        HEADS_PER_GROUP, DOT_PRECISION: tl.constexpr,
        REP: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
        PDL: tl.constexpr = False,
    ):  # fmt: skip
        pdl_enter(PDL)
        b = tl.program_id(0).to(tl.int64)  # a batch's cache may pass 2**31 elements
        kvh = tl.program_id(1)
        sp = tl.program_id(2)
        hs = tl.arange(0, BLOCK_H)
        h_ok = hs < REP
        heads = kvh * REP + hs  # the query heads of this KV head
        on = tl.load(mask_ptr + b * stride_mb + heads // HEADS_PER_GROUP, mask=h_ok, other=0) != 0  # the group mask
        part = (b * HQ + heads) * SPLITS + sp  # workspace slot per (b, head, split)
        ds = tl.arange(0, BLOCK_D)
        d_ok = ds < D
        if tl.sum(on.to(tl.int32), axis=0) == 0:  # no active head here: read no K, no V
            tl.store(m_ptr + part, tl.full((BLOCK_H,), float("-inf"), tl.float32), mask=h_ok)
            tl.store(l_ptr + part, tl.zeros((BLOCK_H,), tl.float32), mask=h_ok)
            return
        seq_len = tl.load(lens_ptr + b)
        start = sp * SPLIT_LEN
        if start >= seq_len:  # a split past the sequence's end: nothing to read
            tl.store(m_ptr + part, tl.full((BLOCK_H,), float("-inf"), tl.float32), mask=h_ok)
            tl.store(l_ptr + part, tl.zeros((BLOCK_H,), tl.float32), mask=h_ok)
            return
        q = tl.load(
            q_ptr + b * stride_qb + heads[:, None] * stride_qh + ds[None, :],
            mask=(on & h_ok)[:, None] & d_ok[None, :],
            other=0.0,
        )
        m_i = tl.full((BLOCK_H,), float("-inf"), tl.float32)
        l_i = tl.zeros((BLOCK_H,), tl.float32)
        acc = tl.zeros((BLOCK_H, BLOCK_D), tl.float32)
        for n0 in range(start, start + SPLIT_LEN, BLOCK_N):
            ns = n0 + tl.arange(0, BLOCK_N)
            n_ok = (ns < seq_len) & (ns < start + SPLIT_LEN)
            kv_off = b * stride_kb + kvh * stride_kh + ns[:, None] * stride_ks + ds[None, :]
            kt = tl.load(k_ptr + kv_off, mask=n_ok[:, None] & d_ok[None, :], other=0.0)
            vt = tl.load(v_ptr + kv_off, mask=n_ok[:, None] & d_ok[None, :], other=0.0)
            m_i, l_i, acc = online_softmax_step(q, kt, vt, n_ok[None, :], m_i, l_i, acc, scale, DOT_PRECISION)
        tl.store(m_ptr + part, m_i, mask=h_ok)
        tl.store(l_ptr + part, l_i, mask=h_ok)
        tl.store(acc_ptr + part[:, None] * D + ds[None, :], acc, mask=h_ok[:, None] & d_ok[None, :])

    @triton.jit
    def triton_attn_decode_merge_kernel(
        m_ptr, l_ptr, acc_ptr, mask_ptr, out_ptr, HQ, D, SPLITS, stride_ob, stride_oh, stride_mb, HEADS_PER_GROUP,
        BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
        PDL: tl.constexpr = False,
    ):  # fmt: skip
        pdl_enter(PDL)
        b = tl.program_id(0)
        h = tl.program_id(1)
        ds = tl.arange(0, BLOCK_D)
        d_ok = ds < D
        out_ptrs = out_ptr + b * stride_ob + h * stride_oh + ds
        if tl.load(mask_ptr + b * stride_mb + h // HEADS_PER_GROUP) == 0:  # inactive head: exactly zero
            tl.store(out_ptrs, tl.zeros((BLOCK_D,), tl.float32).to(out_ptr.dtype.element_ty), mask=d_ok)
            return
        sps = tl.arange(0, BLOCK_S)
        s_ok = sps < SPLITS
        base = (b * HQ + h) * SPLITS + sps
        m = tl.load(m_ptr + base, mask=s_ok, other=float("-inf"))
        lse_l = tl.load(l_ptr + base, mask=s_ok, other=0.0)
        m_max = tl.max(m, axis=0)
        w = tl.where(s_ok & (m > float("-inf")), tl.exp2(m - m_max), 0.0)
        acc = tl.load(
            acc_ptr + base[:, None] * D + ds[None, :],
            mask=(s_ok & (m > float("-inf")))[:, None] & d_ok[None, :],
            other=0.0,
        )
        num = tl.sum(acc * w[:, None], axis=0)
        den = tl.sum(lse_l * w, axis=0)
        tl.store(out_ptrs, (num / den).to(out_ptr.dtype.element_ty), mask=d_ok)


def triton_routed_attention_decode(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    seq_lens: torch.Tensor,
    mask: torch.Tensor,
    *,
    splits: int | None = None,
    block_n: int | None = None,
    warps: int | None = None,
) -> torch.Tensor:
    """Triton version of :func:`torch_routed_attention_decode`. ``splits``: KV splits a (sequence,
    KV head), default ``policy.attention_decode_splits(S, B, Hkv)``; ``block_n``: KV positions a step,
    default ``policy.ATTN_DECODE_BLOCK`` (16 in the CPU interpreter); ``warps``: a program's warps,
    default ``policy.ATTN_DECODE_WARPS``."""
    if triton is None:
        raise RuntimeError("triton is not installed")
    b, hq, d = q.shape
    hkv, s = k.shape[1], k.shape[2]
    if hq % hkv or hq % mask.shape[-1] or k.shape != v.shape or k.stride(-1) != 1 or v.stride() != k.stride():
        raise ValueError(
            f"shapes do not fit: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}, mask {tuple(mask.shape)}"
        )
    rep = hq // hkv
    splits = splits or policy.attention_decode_splits(s, b, hkv)
    block_n = block_n or (16 if interpreted() else policy.ATTN_DECODE_BLOCK)
    mask_u8 = mask_bytes(mask.bool())  # [B, G], read by head // (Hq / G) in both kernels: no per-head copy
    q = q.contiguous()
    split_len = cdiv(max(s, 1), splits)
    split_len = cdiv(split_len, block_n) * block_n
    m_ws = torch.empty((b, hq, splits), dtype=torch.float32, device=q.device)
    l_ws = torch.empty_like(m_ws)
    acc_ws = torch.empty((b, hq, splits, d), dtype=torch.float32, device=q.device)
    out = torch.empty_like(q)
    block_h = max(16, next_power_of_2(rep))
    block_d = max(16, next_power_of_2(d))
    triton_attn_decode_split_kernel[(b, hkv, splits)](
        q, k, v, seq_lens.to(torch.int32).contiguous(), mask_u8, m_ws, l_ws, acc_ws,
        hq, hkv, s, d, splits, split_len, softmax_scale(d),
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), k.stride(2), mask_u8.stride(0), hq // mask.shape[-1],
        DOT_PRECISION=dot_precision(q.dtype), REP=rep, BLOCK_H=block_h, BLOCK_N=block_n, BLOCK_D=block_d,
        num_warps=warps or policy.ATTN_DECODE_WARPS, **pdl_launch(triton_attn_decode_split_kernel, q.device),
    )  # fmt: skip
    triton_attn_decode_merge_kernel[(b, hq)](
        m_ws, l_ws, acc_ws, mask_u8, out, hq, d, splits, out.stride(0), out.stride(1),
        mask_u8.stride(0), hq // mask.shape[-1],
        BLOCK_S=max(16, next_power_of_2(splits)), BLOCK_D=block_d,
        **pdl_launch(triton_attn_decode_merge_kernel, q.device),
    )  # fmt: skip
    return out
