"""The routing layout the prefill kernels read: per group, the tokens sorted active-first.

    mask:   [T, G] or [B, T, G]     nonzero = active
    order:  [G, T] or [B, G, T]     int32, per (sequence and) group: active tokens (ascending), then
                                    the inactive ones (ascending)
    counts: [G] or [B, G]           int32, active tokens per (sequence and) group

Computed once per routed block and shared by its projections (gate and up; q) or per sequence (the
routed prefill attention). No host synchronisation: the counts stay on the device. The decode
kernels read the mask directly and need no layout.
"""

from __future__ import annotations

import torch

from compresskit_wide.kernels.common import mask_bytes, next_power_of_2, pdl_launch

try:
    import triton
    import triton.language as tl

    from compresskit_wide.kernels.common import pdl_enter
except ImportError:
    triton = None


def torch_routing_layout(mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference: ``(order, counts)`` for ``mask: [T, G]`` or ``[B, T, G]``."""
    if mask.dim() == 3:
        per_sequence = [torch_routing_layout(m) for m in mask]
        return torch.stack([o for o, _ in per_sequence]), torch.stack([c for _, c in per_sequence])
    mask = mask.bool()
    # a stable sort on "inactive" (0 before 1) keeps each partition in token order
    order = torch.argsort((~mask).T.contiguous().to(torch.int8), dim=1, stable=True).to(torch.int32)
    return order.contiguous(), mask.sum(dim=0, dtype=torch.int32)


if triton is not None:

    @triton.jit
    def triton_routing_layout_kernel(
        mask_ptr, order_ptr, counts_ptr, M, G, stride_b, stride_m, BLOCK_M: tl.constexpr,
        PDL: tl.constexpr = False,
    ):  # fmt: skip
        # program (group g, sequence b). A token's slot: among the active, the active tokens before
        # it; else the group's count plus the inactive tokens before it. Every token in one block
        # (M <= BLOCK_M): one pass; else a first pass counts and a second places each block.
        pdl_enter(PDL)
        g = tl.program_id(0)
        b = tl.program_id(1)
        mask_ptr += b * stride_b
        order_ptr += b * G * M
        counts_ptr += b * G
        total = tl.zeros((), dtype=tl.int32)
        if M > BLOCK_M:
            for start in range(0, M, BLOCK_M):
                rows = start + tl.arange(0, BLOCK_M)
                act = (tl.load(mask_ptr + rows * stride_m + g, mask=rows < M, other=0) != 0).to(tl.int32)
                total += tl.sum(act, axis=0)
        seen_act = tl.zeros((), dtype=tl.int32)
        for start in range(0, M, BLOCK_M):
            rows = start + tl.arange(0, BLOCK_M)
            valid = rows < M
            act = (tl.load(mask_ptr + rows * stride_m + g, mask=valid, other=0) != 0).to(tl.int32)
            if M <= BLOCK_M:
                total = tl.sum(act, axis=0)
            before = seen_act + tl.cumsum(act, axis=0) - act  # active tokens before each (exclusive)
            pos = tl.where(act == 1, before, total + rows - before)
            tl.store(order_ptr + g * M + pos, rows.to(tl.int32), mask=valid)
            seen_act += tl.sum(act, axis=0)
        tl.store(counts_ptr + g, total)


def triton_routing_layout(mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton version of :func:`torch_routing_layout` (the same outputs, bit for bit), one launch:
    one program per (group, sequence). Every token in one block up to 8,192 (4 warps up to 2,048
    tokens, then one more per 512), blocks of 1,024 beyond (two passes)."""
    if triton is None:
        raise RuntimeError("triton is not installed")
    if mask.dim() not in (2, 3):
        raise ValueError(f"mask must be [T, G] or [B, T, G], got {tuple(mask.shape)}")
    batched = mask.dim() == 3
    mask_u8 = mask_bytes(mask if batched else mask[None])
    b, t, g = mask_u8.shape
    order = torch.empty((b, g, t), dtype=torch.int32, device=mask.device)
    counts = torch.empty((b, g), dtype=torch.int32, device=mask.device)
    block_m, warps = (1024, 4) if t > 8192 else (max(16, next_power_of_2(t)), max(4, next_power_of_2(t) // 512))
    triton_routing_layout_kernel[(g, b)](
        mask_u8,
        order,
        counts,
        t,
        g,
        mask_u8.stride(0),
        mask_u8.stride(1),
        BLOCK_M=block_m,
        num_warps=warps,
        **pdl_launch(triton_routing_layout_kernel, mask.device),
    )
    return (order, counts) if batched else (order[0], counts[0])
