"""The reduction-width masked GEMM (o, down) and the input-group masking against their references."""

import pytest
import torch

pytest.importorskip("triton")

from kernel_helpers import DEVICE, NEEDS_GPU, SPARSITIES, poisoned, random_mask  # noqa: E402

from compresskit.routing import mask_input_groups  # noqa: E402
from compresskit_wide.kernels.gemm_reduce import (  # noqa: E402
    dense_masked_reduce_gemm,
    share_slots,
    torch_group_masked_input,
    torch_masked_reduce_gemm,
    torch_router_shares,
    triton_masked_reduce_gemm,
    triton_tile_reduce_gemm,
)
from compresskit_wide.kernels.policy import SHARE_N, SHARED_SUM_TILE  # noqa: E402

pytestmark = pytest.mark.triton


@pytest.mark.parametrize("m", [1, 2, 3, 17])
@pytest.mark.parametrize("sparsity", SPARSITIES)
@pytest.mark.parametrize(("k_pack", "block_n", "groups"), [(2, 8, 3), (4, 16, 5), (8, 2, 1), (4, None, 5), (1, 16, 2)])
@pytest.mark.parametrize("direct", [False, True])
def test_matches_reference(m, sparsity, k_pack, block_n, groups, direct):
    """From the program's list of needed groups and without it (``direct``): a count of groups that
    is no multiple of the packing, a group of 32 inputs over two K steps, two token tiles at M = 17;
    every output element written (zero where no group is active), nothing after it."""
    gen = torch.Generator().manual_seed(m * 13 + k_pack)
    x = torch.randn(m, 32 * groups, generator=gen).to(DEVICE)
    w = torch.randn(40, 32 * groups, generator=gen).to(DEVICE)
    mask = random_mask(m, groups, sparsity, seed=m + groups)
    buf = poisoned(m, 40)
    got = triton_masked_reduce_gemm(x, w, mask, out=buf[:m], block_n=block_n, block_k=16, k_pack=k_pack, direct=direct)
    torch.testing.assert_close(got, torch_masked_reduce_gemm(x, w, mask), rtol=1e-4, atol=1e-4)
    assert torch.isnan(buf[m:]).all()
    if sparsity == 1.0:
        assert torch.count_nonzero(got) == 0


@pytest.mark.parametrize("m", [1, 3, 16, 17])
@pytest.mark.parametrize("sparsity", SPARSITIES)
@pytest.mark.parametrize(("n", "rank", "block_n"), [(40, 5, None), (72, 32, 32), (16, 3, 16)])
@pytest.mark.parametrize("direct", [False, True])
def test_hands_the_next_router_its_shares(m, sparsity, n, rank, block_n, direct):
    """With a residual and the next router's ``w_down``: the same output, and the shares of
    ``(residual + out) @ w_down.T`` (the sum rounded to the input's dtype, as the caller's add rounds)
    in their slots: summed they equal the reference's, every slot written (zeros where a program
    spans two), a ragged last slot and two token tiles at M = 17."""
    gen = torch.Generator().manual_seed(m * 7 + n)
    x = torch.randn(m, 32 * 3, generator=gen).to(DEVICE)
    w = torch.randn(n, 32 * 3, generator=gen).to(DEVICE)
    residual = torch.randn(m, n, generator=gen).to(DEVICE)
    share_w = torch.randn(rank, n, generator=gen).to(DEVICE)
    mask = random_mask(m, 3, sparsity, seed=m + n)
    shares = torch.full((share_slots(n), m, rank), float("nan"), device=DEVICE)
    got, got_shares = triton_masked_reduce_gemm(
        x, w, mask, block_n=block_n, block_k=16, direct=direct, residual=residual, share_w=share_w, shares=shares
    )
    want = torch_masked_reduce_gemm(x, w, mask)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert got_shares is shares and not torch.isnan(shares).any()
    want_shares = torch_router_shares(residual + want, share_w)
    assert want_shares.shape == (share_slots(n), m, rank) == (-(-n // SHARE_N), m, rank)
    torch.testing.assert_close(shares.sum(0), want_shares.sum(0), rtol=1e-4, atol=1e-3)
    torch.testing.assert_close(want_shares.sum(0), (residual + want) @ share_w.T, rtol=1e-4, atol=1e-3)
    if block_n in (None, 16):  # one slot a program: each slot is its columns' share
        torch.testing.assert_close(shares, want_shares, rtol=1e-4, atol=1e-3)


@pytest.mark.parametrize("m", [2, 17, 33, 64])
@pytest.mark.parametrize("sparsity", SPARSITIES)
@pytest.mark.parametrize(("groups", "width", "split_k"), [(5, 32, None), (3, 48, 2), (2, 16, 7), (6, 32, 1)])
def test_shared_set_matches_reference(m, sparsity, groups, width, split_k):
    """A batch's shared set (every row's mask the same, ``rows_agree``): all the tokens in one tile, the set's
    K steps split among programs (more splits than steps leaves some with none: their partial sums are
    zero), a group of 48 inputs over a ragged K step, 40 outputs over a ragged output block; all-on and
    all-off sets."""
    gen = torch.Generator().manual_seed(m * 11 + groups)
    x = torch.randn(m, width * groups, generator=gen).to(DEVICE)
    w = torch.randn(40, width * groups, generator=gen).to(DEVICE)
    mask = random_mask(1, groups, sparsity, seed=m + groups).expand(m, groups)
    got = triton_tile_reduce_gemm(x, w, mask, split_k=split_k, rows_agree=True)
    torch.testing.assert_close(got, torch_masked_reduce_gemm(x, w, mask), rtol=1e-4, atol=1e-4)
    if sparsity == 1.0:
        assert torch.count_nonzero(got) == 0
    torch.testing.assert_close(triton_tile_reduce_gemm(x, w, mask, split_k=split_k), got)  # rows read too


@pytest.mark.parametrize("m", [17, 40, 64])
@pytest.mark.parametrize("sparsity", SPARSITIES)
@pytest.mark.parametrize(
    ("n", "rank", "split_k", "sum_tile"),
    [(40, 5, None, None), (72, 33, 1, (16, 16, 1)), (130, 3, 3, (8, 32, 2)), (128, 8, 2, (16, 64, 4))],
)
def test_shared_set_hands_the_next_router_its_shares(m, sparsity, n, rank, split_k, sum_tile):
    """The shared set's split-K reduction with a residual and the next router's ``w_down``: the same output,
    and from its second launch every share slot of ``(residual + out) @ w_down.T`` (its programs' blocks of
    columns span whole slots, one by default; a wider block's first slot holds its share and the others zeros;
    the last block is ragged past N), one split too (partial sums first), with any tile of that launch."""
    gen = torch.Generator().manual_seed(m * 13 + n)
    x = torch.randn(m, 32 * 3, generator=gen).to(DEVICE)
    w = torch.randn(n, 32 * 3, generator=gen).to(DEVICE)
    residual = torch.randn(m, n, generator=gen).to(DEVICE)
    share_w = torch.randn(rank, n, generator=gen).to(DEVICE)
    mask = random_mask(1, 3, sparsity, seed=m + n).expand(m, 3)
    got, shares = triton_tile_reduce_gemm(
        x, w, mask, split_k=split_k, rows_agree=True, residual=residual, share_w=share_w, sum_tile=sum_tile
    )
    want = torch_masked_reduce_gemm(x, w, mask)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert shares.shape == (share_slots(n), m, rank) and not torch.isnan(shares).any()
    torch.testing.assert_close(shares.sum(0), (residual + want) @ share_w.T, rtol=1e-4, atol=1e-3)
    x_next = residual + want
    width = (sum_tile or SHARED_SUM_TILE)[1]
    span = width // SHARE_N  # slots a program's block spans
    for b in range(-(-n // width)):  # each program's block: its share in its first slot, zeros after
        cols = slice(width * b, width * b + width)
        torch.testing.assert_close(shares[span * b], x_next[:, cols] @ share_w[:, cols].T, rtol=1e-4, atol=1e-3)
        assert torch.count_nonzero(shares[span * b + 1 : span * b + span]) == 0
    with pytest.raises(ValueError, match="shares need residual"):
        triton_tile_reduce_gemm(x, w, mask, rows_agree=True, residual=residual)
    with pytest.raises(ValueError, match="sum_tile_columns must be a power of two >= 16, got 24"):
        triton_tile_reduce_gemm(x, w, mask, rows_agree=True, residual=residual, share_w=share_w, sum_tile=(16, 24, 4))
    with pytest.raises(ValueError, match="sum_tile_rows must be a power of two >= 1, got 0"):
        triton_tile_reduce_gemm(x, w, mask, rows_agree=True, residual=residual, share_w=share_w, sum_tile=(0, 16, 4))


@pytest.mark.parametrize(("batch", "tokens", "tile"), [(1, 16, 16), (2, 40, 16), (3, 33, 32), (1, 300, 256)])
@pytest.mark.parametrize("sparsity", SPARSITIES)
@pytest.mark.parametrize("agree", [True, False])
def test_tiles_read_their_union_exactly(batch, tokens, tile, sparsity, agree):
    """Tiles of each sequence (a short last tile; sequences not a whole number of tiles, so a tile never spans
    two; a tile of 256 run as MMA tiles of 128): rows that agree in a tile (tile-coherent routing) and rows
    that do not (each reads only its own groups of the tile's union; the inputs of the others are not zero,
    as after a dense attention): the reference either way."""
    groups = 4
    m = batch * tokens
    gen = torch.Generator().manual_seed(tokens + tile)
    x = torch.randn(m, 16 * groups, generator=gen).to(DEVICE)
    w = torch.randn(24, 16 * groups, generator=gen).to(DEVICE)
    mask = random_mask(m, groups, sparsity, seed=tokens)
    if agree:  # one set a tile: its first row's
        starts = (torch.arange(m, device=mask.device) % tokens) // tile * tile + torch.arange(
            m, device=mask.device
        ) // tokens * tokens
        mask = mask[starts]
    got = triton_tile_reduce_gemm(x, w, mask, tile=tile, tokens=tokens)
    torch.testing.assert_close(got, torch_masked_reduce_gemm(x, w, mask), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("split_k", [1, 3])
def test_tiles_with_64_bit_row_offsets(monkeypatch, split_k):
    """Past 2**31 elements (a prefill of half a million tokens) the tile reduction computes its row offsets in
    64 bits: the same results, here with the threshold lowered to every size."""
    from compresskit_wide.kernels import gemm_reduce

    monkeypatch.setattr(gemm_reduce, "WIDE_OFFSETS", 0)
    gen = torch.Generator().manual_seed(7)
    x, w = torch.randn(40, 64, generator=gen).to(DEVICE), torch.randn(24, 64, generator=gen).to(DEVICE)
    mask = random_mask(40, 4, 0.5, seed=8)
    got = triton_tile_reduce_gemm(x, w, mask, tile=16, tokens=20, split_k=split_k)
    torch.testing.assert_close(got, torch_masked_reduce_gemm(x, w, mask), rtol=1e-4, atol=1e-4)


@pytest.mark.skipif(DEVICE != "cuda", reason="needs a GPU: 4 GB inputs")
def test_bf16_tiles_past_32_bit_offsets():
    """A prefill tile reduction whose input passes 2**31 elements (132k tokens x 16,384 inputs) reads and writes
    its last rows right."""
    m, k, n, groups = 2**31 // 16384 + 1000, 16384, 64, 128
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / 64
    mask = random_mask(m, groups, 0.5, seed=9)
    got = triton_tile_reduce_gemm(x, w, mask, tile=64, tokens=m)
    tail = slice(m - 300, m)
    want = torch_masked_reduce_gemm(x[tail], w, mask[tail])
    torch.testing.assert_close(got[tail].float(), want.float(), rtol=2e-2, atol=2e-2)


def test_tiles_need_whole_sequences():
    x, w = torch.randn(10, 64, device=DEVICE), torch.randn(32, 64, device=DEVICE)
    with pytest.raises(ValueError, match="rows 10 are no whole sequences of 4"):
        triton_tile_reduce_gemm(x, w, random_mask(10, 4, 0.5), tile=2, tokens=4)


def test_shares_need_what_they_read():
    x, w, mask = torch.randn(2, 64, device=DEVICE), torch.randn(32, 64, device=DEVICE), random_mask(2, 4, 0.5)
    res, sw = torch.randn(2, 32, device=DEVICE), torch.randn(4, 32, device=DEVICE)
    with pytest.raises(ValueError, match=r"shares need residual \[M, N\] = \[2, 32\]"):
        triton_masked_reduce_gemm(x, w, mask, residual=res)
    with pytest.raises(ValueError, match="shares need residual"):
        triton_masked_reduce_gemm(x, w, mask, residual=res, share_w=sw.double())
    with pytest.raises(ValueError, match=f"output blocks of a multiple of {SHARE_N} channels, got 8"):
        triton_masked_reduce_gemm(x, w, mask, residual=res, share_w=sw, block_n=8)
    with pytest.raises(ValueError, match=r"shares must be a contiguous fp32 \[2, 2, 4\], got \(2, 2, 3\)"):
        triton_masked_reduce_gemm(x, w, mask, residual=res, share_w=sw, shares=torch.empty(2, 2, 3, device=DEVICE))


def test_inactive_inputs_are_never_read():
    """NaN in the inactive groups' inputs does not reach the output (a product would spread it)."""
    x = torch.randn(3, 64, device=DEVICE)
    w = torch.randn(16, 64, device=DEVICE)
    mask = random_mask(3, 4, 0.5, seed=9)
    x_nan = torch.where(mask.repeat_interleave(16, dim=-1), x, float("nan"))
    for direct in (False, True):
        got = triton_masked_reduce_gemm(x_nan, w, mask, block_n=16, block_k=16, direct=direct)
        torch.testing.assert_close(got, torch_masked_reduce_gemm(x, w, mask), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(dense_masked_reduce_gemm(x_nan, w, mask), torch_masked_reduce_gemm(x, w, mask))


def test_refuses_what_it_cannot_do():
    x, w, mask = torch.randn(2, 64, device=DEVICE), torch.randn(16, 64, device=DEVICE), random_mask(2, 4, 0.5)
    with pytest.raises(ValueError, match="k_pack must be a power of two, got 3"):
        triton_masked_reduce_gemm(x, w, mask, k_pack=3)
    with pytest.raises(ValueError, match="tl.dot needs 16 or more"):
        triton_masked_reduce_gemm(x, w, mask, block_n=4, k_pack=2)
    with pytest.raises(ValueError, match="shapes do not fit"):
        triton_masked_reduce_gemm(x, w, random_mask(2, 5, 0.5))
    if DEVICE == "cuda":  # the autotuned tiles exist for the packing ``auto`` takes
        with pytest.raises(ValueError, match="k_pack=2 has no tile table on a GPU; tuned: 4"):
            triton_masked_reduce_gemm(x, w, mask, k_pack=2)


@pytest.mark.skipif(DEVICE != "cuda", reason=NEEDS_GPU)
@pytest.mark.parametrize("m", [1, 4, 16])
@pytest.mark.parametrize(("direct", "groups"), [(False, 8), (True, 8), (True, 2), (None, 8)])
def test_bf16_with_autotuned_tiles(m, direct, groups):
    """Groups of 128 inputs, and of 512 without the list (o_proj's width: several K steps a group)."""
    x = torch.randn(m, 1024, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(384, 1024, device="cuda", dtype=torch.bfloat16) / 4
    mask = random_mask(m, groups, 0.5)
    buf = poisoned(m, 384, torch.bfloat16)
    got = triton_masked_reduce_gemm(x, w, mask, out=buf[:m], direct=direct)
    torch.testing.assert_close(got.float(), torch_masked_reduce_gemm(x, w, mask).float(), rtol=2e-2, atol=2e-2 * 16)
    assert torch.isnan(buf[m:]).all()


def test_dense_fallback_and_the_zero_filled_input():
    """The fallback masks then multiplies; on an input that is zero-filled already, the plain dense
    product is the same, and on one that is not, trusting it would be wrong."""
    x, w, mask = torch.randn(40, 64, device=DEVICE), torch.randn(32, 64, device=DEVICE), random_mask(40, 4, 0.5)
    ref = torch_masked_reduce_gemm(x, w, mask)
    torch.testing.assert_close(dense_masked_reduce_gemm(x, w, mask), ref, rtol=1e-4, atol=1e-4)
    zero_filled = torch_group_masked_input(x, mask)
    torch.testing.assert_close(dense_masked_reduce_gemm(zero_filled, w, mask, input_is_masked=True), ref)
    assert not torch.allclose(dense_masked_reduce_gemm(x, w, mask, input_is_masked=True), ref)


def test_input_masking_is_the_cores_and_passes_gradients():
    """The kernels' own reference masking equals the core's (what training runs), gradients included."""
    x = torch.randn(2, 5, 24, requires_grad=True)
    mask = (torch.rand(2, 5, 3) > 0.5).float().requires_grad_()
    ours = torch_group_masked_input(x, mask)
    torch.testing.assert_close(ours, mask_input_groups(x, mask), rtol=0, atol=0)
    ours.sum().backward()
    assert x.grad is not None and mask.grad is not None
    with pytest.raises(ValueError, match="not divisible into 5 groups"):
        torch_group_masked_input(x, torch.ones(2, 5, 5))
