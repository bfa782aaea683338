"""Routing-layout prep ("mask reordering"): from a token x group mask, a stable per-group
partition of the tokens, active first, and the list of groups any token needs.

Computed once per routed block and shared by its projections (gate, up and down; q and o).
No host synchronisation: counts stay on the device.

    mask:          [M, G] bool, True = active
    order:         [G, M] int32, per group: active tokens (ascending), then inactive (ascending)
    counts:        [G]    int32, active tokens per group
    active_groups: [G]    int32, groups with any active token (ascending), then the others
    n_active:      [1]    int32, how many groups are active

Decode needs only the last two (``decode_layout``: one single-program kernel, a few microseconds);
the decode output-width kernel reads the mask itself and needs nothing.
"""

from __future__ import annotations

import torch

from compresskit_wide.kernels import tuning

try:
    import triton
    import triton.language as tl
except ImportError:  # the reference path needs no Triton
    triton = None


def torch_routing_layout(mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Reference: ``(order, counts, active_groups, n_active)`` for ``mask: [M, G]``."""
    mask = mask.bool()
    # stable sort on "inactive" (0 before 1) keeps each partition in token order
    order = torch.argsort((~mask).T.contiguous().to(torch.int8), dim=1, stable=True).to(torch.int32).contiguous()
    counts = mask.sum(dim=0, dtype=torch.int32)  # [G]
    any_active = mask.any(dim=0)  # [G]
    active_groups = torch.argsort((~any_active).to(torch.int8), stable=True).to(torch.int32)
    n_active = any_active.sum(dtype=torch.int32).reshape(1)
    return order, counts, active_groups, n_active


def mask_bytes(mask: torch.Tensor) -> torch.Tensor:
    """The mask as the kernels read it: one byte per entry, contiguous (a bool mask is viewed,
    not copied)."""
    mask = mask.contiguous()
    return mask.view(torch.uint8) if mask.dtype == torch.bool else mask


def torch_decode_layout(mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference: ``(active_groups, n_active)`` for ``mask: [M, G]`` (as in the full layout)."""
    any_active = mask.bool().any(dim=0)
    active_groups = torch.argsort((~any_active).to(torch.int8), stable=True).to(torch.int32)
    return active_groups, any_active.sum(dtype=torch.int32).reshape(1)


if triton is not None:

    @triton.jit
    def triton_routing_layout_kernel(
        mask_ptr, order_ptr, counts_ptr, M, G, stride_b, stride_m, BLOCK_M: tl.constexpr
    ):  # fmt: skip
        # one program per group g (and sequence b of a batched mask). A token's slot: among the
        # active, the active tokens before it; else the group's count plus the inactive tokens before
        # it (its index minus the active ones before it). With every token in one block (M <=
        # BLOCK_M) one pass; else a first pass counts and a second places each block.
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

    @triton.jit
    def triton_active_groups_kernel(counts_ptr, groups_ptr, n_active_ptr, G, BLOCK_G: tl.constexpr):
        # one program: compact the groups with a nonzero count, in ascending order
        seen = tl.zeros((), dtype=tl.int32)
        n_total = tl.zeros((), dtype=tl.int32)
        for start in range(0, G, BLOCK_G):
            gs = start + tl.arange(0, BLOCK_G)
            n_total += tl.sum(
                tl.where(gs < G, (tl.load(counts_ptr + gs, mask=gs < G, other=0) > 0).to(tl.int32), 0), axis=0
            )
        seen_off = tl.zeros((), dtype=tl.int32)
        for start in range(0, G, BLOCK_G):
            gs = start + tl.arange(0, BLOCK_G)
            valid = gs < G
            on = tl.where(valid, (tl.load(counts_ptr + gs, mask=valid, other=0) > 0).to(tl.int32), 0)
            off = tl.where(valid, 1 - on, 0)
            pos_on = seen + tl.cumsum(on, axis=0) - on
            pos_off = n_total + seen_off + tl.cumsum(off, axis=0) - off
            tl.store(groups_ptr + tl.where(on == 1, pos_on, pos_off), gs.to(tl.int32), mask=valid)
            seen += tl.sum(on, axis=0)
            seen_off += tl.sum(off, axis=0)
        tl.store(n_active_ptr, n_total)

    @triton.jit
    def triton_decode_layout_kernel(
        mask_ptr, groups_ptr, n_active_ptr, M, G, stride_m, BLOCK_M: tl.constexpr, BLOCK_G: tl.constexpr
    ):
        # one program: OR over the tokens, then compact the active groups (ascending), the rest after
        gs = tl.arange(0, BLOCK_G)
        valid = gs < G
        on = tl.zeros((BLOCK_G,), dtype=tl.int32)
        for start in range(0, M, BLOCK_M):
            rows = start + tl.arange(0, BLOCK_M)
            block = tl.load(
                mask_ptr + rows[:, None] * stride_m + gs[None, :], mask=(rows < M)[:, None] & valid[None, :], other=0
            )
            on = tl.maximum(on, tl.max((block != 0).to(tl.int32), axis=0))
        off = tl.where(valid, 1 - on, 0)
        n_on = tl.sum(on, axis=0)
        pos = tl.where(on == 1, tl.cumsum(on, axis=0) - on, n_on + tl.cumsum(off, axis=0) - off)
        tl.store(groups_ptr + pos, gs.to(tl.int32), mask=valid)
        tl.store(n_active_ptr, n_on)


def _kernel_mask(mask: torch.Tensor) -> tuple[int, int, torch.Tensor]:
    """``(M, G, the mask as bytes)`` for a layout kernel; the errors both layouts give."""
    if triton is None:
        raise RuntimeError("triton is not installed")
    if mask.dim() != 2:
        raise ValueError(f"mask must be [M, G], got {tuple(mask.shape)}")
    return *mask.shape, mask_bytes(mask)


def layout_block(m: int) -> tuple[int, int]:
    """``(BLOCK_M, num_warps)`` of the routing layout's kernel for ``m`` tokens: every token in one
    block up to 8,192 (one pass over the mask; 4 warps up to 2,048 tokens, then one more warp per
    512), blocks of 1,024 beyond (two passes)."""
    if m > 8192:
        return 1024, 4
    block = max(16, tuning.next_power_of_2(m))
    return block, max(4, block // 512)


def triton_decode_layout(mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton version of :func:`torch_decode_layout` (same outputs, bit for bit; one launch)."""
    m, g, mask_u8 = _kernel_mask(mask)
    groups = torch.empty(g, dtype=torch.int32, device=mask.device)
    n_active = torch.empty(1, dtype=torch.int32, device=mask.device)
    block_g = max(16, tuning.next_power_of_2(g))
    block_m = max(1, min(16, 4096 // block_g))
    triton_decode_layout_kernel[(1,)](
        mask_u8, groups, n_active, m, g, mask_u8.stride(0), BLOCK_M=block_m, BLOCK_G=block_g
    )
    return groups, n_active


def triton_routing_layout(mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Triton version of :func:`torch_routing_layout` (same outputs, bit for bit)."""
    m, g, mask_u8 = _kernel_mask(mask)
    order = torch.empty((g, m), dtype=torch.int32, device=mask.device)
    counts = torch.empty(g, dtype=torch.int32, device=mask.device)
    groups = torch.empty(g, dtype=torch.int32, device=mask.device)
    n_active = torch.empty(1, dtype=torch.int32, device=mask.device)
    block_m, warps = layout_block(m)
    triton_routing_layout_kernel[(g, 1)](
        mask_u8, order, counts, m, g, 0, mask_u8.stride(0), BLOCK_M=block_m, num_warps=warps
    )
    triton_active_groups_kernel[(1,)](
        counts, groups, n_active, g, BLOCK_G=min(1024, max(16, tuning.next_power_of_2(g)))
    )
    return order, counts, groups, n_active


def torch_batched_layout(mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference: for ``mask: [B, T, G]`` each sequence's ``order`` and ``counts`` as in the
    routing layout: ``order: [B, G, T]`` (per sequence and group: active tokens, then inactive, each
    ascending), ``counts: [B, G]`` (what the routed prefill attention runs on)."""
    per_sequence = [torch_routing_layout(m)[:2] for m in mask]
    return torch.stack([o for o, _ in per_sequence]), torch.stack([c for _, c in per_sequence])


def triton_batched_layout(mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton version of :func:`torch_batched_layout` (same outputs, bit for bit): the routing
    layout's kernel, one program per (group, sequence), in one launch where the reference's sort
    and sum take seven small kernels."""
    if triton is None:
        raise RuntimeError("triton is not installed")
    if mask.dim() != 3:
        raise ValueError(f"mask must be [B, T, G], got {tuple(mask.shape)}")
    b, t, g = mask.shape
    mask_u8 = mask_bytes(mask)
    order = torch.empty((b, g, t), dtype=torch.int32, device=mask.device)
    counts = torch.empty((b, g), dtype=torch.int32, device=mask.device)
    block_m, warps = layout_block(t)
    triton_routing_layout_kernel[(g, b)](
        mask_u8, order, counts, t, g, mask_u8.stride(0), mask_u8.stride(1), BLOCK_M=block_m, num_warps=warps
    )
    return order, counts
