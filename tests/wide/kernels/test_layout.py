"""The routing layout against its reference: bit for bit."""

import pytest
import torch

pytest.importorskip("triton")

from kernel_helpers import DEVICE, SPARSITIES, random_mask  # noqa: E402

from compresskit_wide.kernels.layout import torch_routing_layout, triton_routing_layout  # noqa: E402

pytestmark = pytest.mark.triton


def assert_same(got, ref):
    for a, b in zip(got, ref, strict=True):
        assert a.dtype == b.dtype == torch.int32 and a.shape == b.shape and torch.equal(a.cpu(), b.cpu())


@pytest.mark.parametrize("m", [1, 2, 3, 5, 16, 17, 1000, 9000])  # 9000: over one block (two passes)
@pytest.mark.parametrize("sparsity", SPARSITIES)
def test_matches_reference_exactly(m, sparsity):
    mask = random_mask(m, 7, sparsity, seed=m)
    got = triton_routing_layout(mask)
    assert_same(got, torch_routing_layout(mask))
    order, counts = got
    assert order.is_contiguous() and order.shape == (7, m)
    for g in range(7):  # active tokens first, each partition in token order
        active = order[g, : counts[g]].cpu()
        assert bool(mask[active.long(), g].all())
        assert torch.equal(active, torch.sort(active).values)
        assert torch.equal(torch.sort(order[g].cpu()).values, torch.arange(m, dtype=torch.int32))


@pytest.mark.parametrize("m", [1000, 9000])  # one pass; two passes
def test_reads_any_nonzero_byte_as_active(m):
    mask = random_mask(m, 5, 0.5, seed=3)
    assert_same(triton_routing_layout(mask.to(torch.uint8) * 3), torch_routing_layout(mask))


@pytest.mark.parametrize(("b", "t", "g"), [(1, 1, 8), (2, 17, 3), (3, 40, 8), (2, 1100, 5)])
@pytest.mark.parametrize("sparsity", SPARSITIES)
def test_batched_is_each_sequences_layout(b, t, g, sparsity):
    """``[B, T, G]`` (the prefill attention's): sequences with different masks, T over one block, a
    non-contiguous mask."""
    mask = torch.stack([random_mask(t, g, sparsity, seed=t + i) for i in range(b)])
    if b == 3:
        mask = mask.transpose(1, 2).contiguous().transpose(1, 2)  # same values, other strides
    got = triton_routing_layout(mask)
    assert_same(got, torch_routing_layout(mask))
    for i in range(b):
        assert_same((got[0][i], got[1][i]), triton_routing_layout(mask[i]))
    with pytest.raises(ValueError, match=r"mask must be \[T, G\] or \[B, T, G\], got \(4,\)"):
        triton_routing_layout(torch.ones(4, dtype=torch.bool, device=DEVICE))
