"""The online-softmax step shared by the routed attention kernels (decode and prefill)."""

from __future__ import annotations

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = None


if triton is not None:

    @triton.jit
    def online_softmax_step(q, kt, vt, allowed, m_i, l_i, acc, scale, PRECISION: tl.constexpr):
        """One key/value block of flash attention. ``q: [R, D]``, ``kt, vt: [N, D]``, ``allowed:
        [R, N]`` (or broadcastable); running max ``m_i: [R]``, denominator ``l_i: [R]`` and
        numerator ``acc: [R, D]`` in fp32. Rows with nothing allowed yet keep ``m_i = -inf``.
        ``PRECISION``: ``tl.dot``'s input precision (``tuning.dot_precision``)."""
        s = tl.dot(q, tl.trans(kt), input_precision=PRECISION) * scale  # [R, N]
        s = tl.where(allowed, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp(s - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(vt.dtype), vt, input_precision=PRECISION)
        return m_new, l_i, acc
