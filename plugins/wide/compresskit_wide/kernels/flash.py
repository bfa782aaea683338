"""The online-softmax steps shared by the routed attention kernels (decode and prefill).

The scores are kept in base 2: the callers pass ``scale = log2(e) / sqrt(D)`` (``softmax_scale``),
so that each element costs one multiply and one ``exp2`` and the running maxima are in log2 units
(the decode merge weighs its splits with ``exp2`` too).
"""

from __future__ import annotations

import math

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = None


def softmax_scale(head_dim: int) -> float:
    """The base-2 scale of the scores: ``log2(e) / sqrt(head_dim)``."""
    return math.log2(math.e) / math.sqrt(head_dim)


if triton is not None:

    @triton.jit
    def online_softmax_step(q, kt, vt, allowed, m_i, l_i, acc, scale, PRECISION: tl.constexpr):
        """One key/value block of flash attention. ``q: [R, D]``, ``kt, vt: [N, D]``, ``allowed:
        [R, N]`` (or broadcastable); running max ``m_i: [R]`` (log2 units), denominator ``l_i: [R]``
        and numerator ``acc: [R, D]`` in fp32. Rows with nothing allowed yet keep ``m_i = -inf``.
        ``PRECISION``: ``tl.dot``'s input precision (``tuning.dot_precision``)."""
        s = tl.dot(q, tl.trans(kt), input_precision=PRECISION) * scale  # [R, N]
        s = tl.where(allowed, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(vt.dtype), vt, input_precision=PRECISION)
        return m_new, l_i, acc

    @triton.jit
    def online_softmax_step_all(q, kt, vt, m_i, l_i, acc, scale, PRECISION: tl.constexpr):
        """:func:`online_softmax_step` for a block every row sees whole: no mask, and no guard for
        rows with nothing allowed (the block's scores are finite, so the new maxima are)."""
        s = tl.dot(q, tl.trans(kt), input_precision=PRECISION) * scale
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        p = tl.exp2(s - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)  # exp2(-inf) = 0 on the first block
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(vt.dtype), vt, input_precision=PRECISION)
        return m_new, l_i, acc
