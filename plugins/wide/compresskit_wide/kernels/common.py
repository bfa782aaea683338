"""Helpers the WIDE kernels share: their error type, host arithmetic for launches, output masking, the
programmatic dependent launch every kernel takes, and the ``tl.jit`` building blocks used by more than one op (the
K-packed product's diagonal, the online-softmax step of the routed attention, the counting of a decision)."""

from __future__ import annotations

import math
import os

import torch

from compresskit_wide.kernels import policy

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = None


class TritonUnavailableError(RuntimeError):
    """A Triton kernel was asked for (``backend="triton"``) where it cannot run; the message says why.
    The kernels' own error type (they import nothing of ``compresskit``), raised only when an op is called
    directly: the ``wide-triton`` executor's ``check`` finds the same reason first and raises compresskit's one
    ``KernelUnavailableError``."""


def interpreted() -> bool:
    """Whether Triton runs in its CPU interpreter (``TRITON_INTERPRET=1``: the CI path)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` on the host (``triton.cdiv`` is a constexpr function whose host calls cost
    microseconds each; a prompt makes hundreds)."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= ``n`` (1 for ``n`` <= 1), as ``triton.next_power_of_2``."""
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def check_blocks(**blocks: tuple[int | None, int]) -> None:
    """Each given block size (``name=(value, smallest)``; None: the default) a power of two, at least its smallest."""
    for name, (value, smallest) in blocks.items():
        if value is not None and (value < smallest or value & (value - 1)):
            raise ValueError(f"{name} must be a power of two >= {smallest}, got {value}")


def m_bucket(m: int) -> int:
    """The autotuning key of a token count: its power-of-two bucket (a new prompt length in the
    same bucket does not retune)."""
    return max(1, int(m - 1).bit_length())


def dot_precision(dtype: torch.dtype) -> str:
    """``tl.dot``'s input precision: fp32 inputs get full-precision products (as ``torch.matmul``
    does by default), not TF32."""
    return "ieee" if dtype == torch.float32 else "tf32"


def softmax_scale(head_dim: int) -> float:
    """The attention scores' scale in base 2, ``log2(e) / sqrt(head_dim)``: each score then costs
    one multiply and one ``exp2``, and the running maxima are in log2 units."""
    return math.log2(math.e) / math.sqrt(head_dim)


def mask_bytes(mask: torch.Tensor) -> torch.Tensor:
    """The mask as the kernels read it: one byte per entry, contiguous (a bool mask is viewed,
    not copied). Any nonzero byte is active."""
    mask = mask.contiguous()
    return mask.view(torch.uint8) if mask.dtype == torch.bool else mask


def zero_inactive_groups(y: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``y: [..., N]``, ``mask: [..., G]`` -> ``y`` with each inactive group of N/G entries exactly 0.
    A select, not a product: whatever was computed there, inf or NaN included, comes out 0."""
    groups = mask.shape[-1]
    kept = torch.where(mask.bool().unsqueeze(-1), y.unflatten(-1, (groups, y.shape[-1] // groups)), 0.0)
    return kept.flatten(-2)


def zero_inactive_heads(out: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``out: [B, Hq, T, D]``, ``mask: [B, T, Hq / A]`` -> ``out`` exactly 0 for inactive (token, head)."""
    b, hq, t, d = out.shape
    rows = zero_inactive_groups(out.transpose(1, 2).reshape(b, t, hq * d), mask)
    return rows.view(b, t, hq, d).transpose(1, 2)


def pdl_launch(kernel, device: torch.device) -> dict:
    """The launch arguments of ``kernel`` (a ``triton.jit`` function) for programmatic dependent launch, where
    ``policy.PDL_KERNELS`` names it (or holds "*") and ``device`` is a GPU of sm_90 or later (not in the
    interpreter): ``PDL`` (the kernel's constexpr: :func:`pdl_enter` first) and Triton's ``launch_pdl`` (the launch
    lets the kernel start before the kernel before it ends); else none."""
    if not policy.PDL_KERNELS or device.type != "cuda" or interpreted():
        return {}
    if "*" not in policy.PDL_KERNELS and kernel.__name__ not in policy.PDL_KERNELS:
        return {}
    if torch.cuda.get_device_capability(device)[0] < 9:
        return {}
    return {"PDL": True, "launch_pdl": True}


if triton is not None:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

    @triton.jit
    def pdl_enter(PDL: tl.constexpr):
        """A kernel's first step under programmatic dependent launch (``PDL``): wait until the kernel before it
        has finished and its writes are visible (before any load or store of this one), then let the kernel
        after it launch, so that its start overlaps this one's end. Without ``PDL``: nothing."""
        if PDL:
            gdc_wait()
            gdc_launch_dependents()

    @triton.jit
    def packed_diagonal(acc, K_PACK: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr):
        """The sums of a K-packed product. ``acc`` is [K_PACK * BLOCK_N, K_PACK * BLOCK_M]: weight row
        ``c * BLOCK_N + j`` holds row j's chunk c of K, token column ``c * BLOCK_M + m`` token m's chunk
        c. The blocks where the chunks agree are kept and added over the chunks: [BLOCK_N, BLOCK_M]."""
        if K_PACK == 1:
            out = acc
        else:
            row_chunk = tl.arange(0, K_PACK * BLOCK_N) // BLOCK_N
            col_chunk = tl.arange(0, K_PACK * BLOCK_M) // BLOCK_M
            acc = tl.where(row_chunk[:, None] == col_chunk[None, :], acc, 0.0)
            out = tl.sum(tl.sum(tl.reshape(acc, (K_PACK, BLOCK_N, K_PACK, BLOCK_M)), axis=2), axis=0)
        return out

    @triton.jit
    def count_decision(cnt_ptr, tokens, executed, first):
        """Add a program's part of a decision to the counters (fp64 ``[2]``, atomically: whole numbers, exact
        in any order): ``executed`` groups by every program, its ``tokens`` where ``first`` (one program of
        each token block)."""
        tl.atomic_add(cnt_ptr + 1, executed.to(tl.float64))
        tl.atomic_add(cnt_ptr, tokens.to(tl.float64), mask=first)

    @triton.jit
    def online_softmax_step(q, kt, vt, allowed, m_i, l_i, acc, scale, PRECISION: tl.constexpr):
        """One key/value block of flash attention. ``q: [R, D]``, ``kt, vt: [N, D]``, ``allowed:
        [R, N]`` (or broadcastable); running max ``m_i: [R]`` (log2 units), denominator ``l_i`` and
        numerator ``acc: [R, D]`` in fp32. Rows with nothing allowed yet keep ``m_i = -inf``."""
        s = tl.dot(q, tl.trans(kt), input_precision=PRECISION) * scale
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
        """:func:`online_softmax_step` for a block every row sees whole: no mask and no guard (the
        block's scores are finite, so the new maxima are)."""
        s = tl.dot(q, tl.trans(kt), input_precision=PRECISION) * scale
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        p = tl.exp2(s - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(vt.dtype), vt, input_precision=PRECISION)
        return m_new, l_i, acc
