"""The output-width masked GEMM (q; gate and up with the SwiGLU fused in) against its reference."""

import pytest
import torch

pytest.importorskip("triton")

from kernel_helpers import DEVICE, NEEDS_GPU, SPARSITIES, poisoned, random_mask  # noqa: E402

from compresskit_wide.kernels.gemm_out import (  # noqa: E402
    dense_masked_out_gemm,
    torch_masked_out_gemm,
    triton_masked_out_gemm,
)

pytestmark = pytest.mark.triton


def inputs(m, k, n, fuse, seed):
    gen = torch.Generator().manual_seed(seed)
    x, w = torch.randn(m, k, generator=gen).to(DEVICE), torch.randn(n, k, generator=gen).to(DEVICE)
    return x, w, torch.randn(n, k, generator=gen).to(DEVICE) if fuse else None


@pytest.mark.parametrize(
    ("m", "k", "n", "groups"),
    [(1, 40, 64, 2), (3, 64, 96, 3), (16, 48, 64, 4), (17, 48, 64, 4), (9, 72, 48, 1), (45, 40, 96, 3)],
)
@pytest.mark.parametrize("sparsity", SPARSITIES)
@pytest.mark.parametrize("fuse", [False, True])
def test_matches_reference_with_fixed_tiles(m, k, n, groups, sparsity, fuse):
    """Decode (M <= 16) and prefill sizes; K no multiple of the K step; a group over several tiles
    of tokens and of channels: the reference's values, exact zeros in inactive groups, every
    output element written and nothing after it."""
    x, w, w_up = inputs(m, k, n, fuse, seed=m * 7 + n)
    mask = random_mask(m, groups, sparsity, seed=m + groups)
    buf = poisoned(m, n)
    got = triton_masked_out_gemm(x, w, mask, w_up, out=buf[:m], block_m=16, block_n=16, block_k=16)
    torch.testing.assert_close(got, torch_masked_out_gemm(x, w, mask, w_up), rtol=1e-4, atol=1e-4)
    assert torch.count_nonzero(got[~mask.repeat_interleave(n // groups, dim=-1)]) == 0
    assert torch.isnan(buf[m:]).all()


@pytest.mark.parametrize("m", [1, 2, 3, 5, 16])
@pytest.mark.parametrize("sparsity", SPARSITIES)
@pytest.mark.parametrize("fuse", [False, True])
@pytest.mark.parametrize(("k_pack", "block_n"), [(1, 16), (2, 8), (4, 16), (8, None), (16, 1)])
def test_decode_packs_k_chunks_into_one_product(m, sparsity, fuse, k_pack, block_n):
    """The decode kernel with ``k_pack`` chunks of K in one product: a K of no whole number of
    steps, a group of 32 channels over 1-32 programs."""
    x, w, w_up = inputs(m, 200, 96, fuse, seed=m * 5 + k_pack)
    mask = random_mask(m, 3, sparsity, seed=m + 3)
    buf = poisoned(m, 96)
    got = triton_masked_out_gemm(x, w, mask, w_up, out=buf[:m], block_n=block_n, block_k=16, k_pack=k_pack)
    torch.testing.assert_close(got, torch_masked_out_gemm(x, w, mask, w_up), rtol=1e-4, atol=1e-4)
    assert torch.count_nonzero(got[~mask.repeat_interleave(32, dim=-1)]) == 0
    assert torch.isnan(buf[m:]).all()


def test_one_tensor_as_gate_and_up_is_still_the_fused_swiglu():
    x, w, _ = inputs(3, 64, 32, False, seed=1)
    mask = random_mask(3, 2, 0.5)
    got = triton_masked_out_gemm(x, w, mask, w, block_n=16, block_k=16)
    torch.testing.assert_close(got, torch_masked_out_gemm(x, w, mask, w), rtol=1e-4, atol=1e-4)


def test_refuses_what_it_cannot_do():
    x, w, _ = inputs(2, 64, 32, False, seed=2)
    mask = random_mask(2, 2, 0.5)
    with pytest.raises(ValueError, match="k_pack must be a power of two, got 3"):
        triton_masked_out_gemm(x, w, mask, k_pack=3)
    with pytest.raises(ValueError, match=r"k_pack is for the decode kernel \(M <= 16\); got M=17"):
        triton_masked_out_gemm(torch.randn(17, 64, device=DEVICE), w, random_mask(17, 2, 0.5), k_pack=4)
    with pytest.raises(ValueError, match="tl.dot needs 16 or more"):
        triton_masked_out_gemm(x, w, mask, block_n=4, k_pack=2)
    with pytest.raises(ValueError, match="shapes do not fit"):
        triton_masked_out_gemm(x, w[:, :60], mask)
    if DEVICE == "cuda":
        with pytest.raises(ValueError, match=r"k_pack=16 has no tile table on a GPU; tuned: \[1, 2, 4, 8\]"):
            triton_masked_out_gemm(x, w, mask, k_pack=16)


@pytest.mark.skipif(DEVICE != "cuda", reason=NEEDS_GPU)
@pytest.mark.parametrize("fuse", [False, True])
@pytest.mark.parametrize(
    ("m", "k_pack"), [(1, None), (1, 1), (1, 2), (1, 8), (4, None), (13, None), (16, 4), (300, None)]
)
def test_bf16_with_autotuned_tiles(fuse, m, k_pack):
    """The autotuned tiles on a GPU in bf16, a K of several steps; tolerance: bf16 rounding of the
    output (values of size ~sqrt(K) / 4)."""
    x = torch.randn(m, 1024, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(512, 1024, device="cuda", dtype=torch.bfloat16) / 4
    w_up = torch.randn(512, 1024, device="cuda", dtype=torch.bfloat16) / 4 if fuse else None
    mask = random_mask(m, 4, 0.5)
    buf = poisoned(m, 512, torch.bfloat16)
    got = triton_masked_out_gemm(x, w, mask, w_up, out=buf[:m], k_pack=k_pack)
    ref = torch_masked_out_gemm(x, w, mask, w_up)
    torch.testing.assert_close(got.float(), ref.float(), rtol=2e-2, atol=2e-1 if fuse else 2e-2 * 16)
    assert torch.count_nonzero(got[~mask.repeat_interleave(128, dim=-1)]) == 0
    assert torch.isnan(buf[m:]).all()


@pytest.mark.parametrize("fuse", [False, True])
@pytest.mark.parametrize("sparsity", SPARSITIES)
def test_dense_fallback_equals_reference(fuse, sparsity):
    """The dense fallback zeroes the inactive groups; with ``zero_inactive=False`` it leaves the dense
    product there and the active groups are the same."""
    x, w, w_up = inputs(9, 48, 96, fuse, seed=3)
    mask = random_mask(9, 3, sparsity, seed=4)
    got = dense_masked_out_gemm(x, w, mask, w_up)
    torch.testing.assert_close(got, torch_masked_out_gemm(x, w, mask, w_up), rtol=1e-4, atol=1e-4)
    inactive = ~mask.repeat_interleave(32, dim=-1)
    assert torch.count_nonzero(got[inactive]) == 0
    raw = dense_masked_out_gemm(x, w, mask, w_up, zero_inactive=False)
    dense = x @ w.T if w_up is None else torch.nn.functional.silu(x @ w.T) * (x @ w_up.T)
    torch.testing.assert_close(raw, dense, rtol=0, atol=0)
    torch.testing.assert_close(raw[~inactive], got[~inactive], rtol=0, atol=0)
