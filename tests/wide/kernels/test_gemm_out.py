"""The output-width masked GEMM (q; gate and up with the SwiGLU fused in) against its reference."""

import pytest
import torch

pytest.importorskip("triton")

from kernel_helpers import DEVICE, NEEDS_GPU, SPARSITIES, poisoned, prologue_inputs, random_mask  # noqa: E402

from compresskit_wide.kernels.gemm_out import (  # noqa: E402
    dense_masked_out_gemm,
    out_kernel_takes,
    persistent_rounds,
    stacked_rows,
    swiglu_zero,
    torch_masked_out_gemm,
    torch_swiglu_zero,
    triton_masked_out_gemm,
    triton_persistent_out_gemm,
)

pytestmark = pytest.mark.triton


def split_tail_programs(items, split=2):
    """The programs for which the last round of ``items`` fills at most 1 / ``split`` of them, after a round of
    whole items (the most such; none where too few items are active: all off, or nearly)."""
    return [p for p in range(1, items) if 0 < (items % p) * split <= p]


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


@pytest.mark.parametrize(("m", "dense_rows"), [(17, 0), (45, 0), (45, 48), (70, 32)])
@pytest.mark.parametrize("sparsity", SPARSITIES)
@pytest.mark.parametrize("fuse", [False, True])
def test_prefill_over_several_token_tiles_with_dense_rows(m, dense_rows, sparsity, fuse):
    """The prefill kernel gives the reference's values with 3 routed groups over several token
    tiles and dense rows after them, and writes nothing past its rows."""
    if fuse and dense_rows:
        pytest.skip("dense rows are the plain product's")
    x, w, w_up = inputs(m, 40, 96 + dense_rows, fuse, seed=m + dense_rows)
    mask = random_mask(m, 3, sparsity, seed=m * 5)
    want = torch_masked_out_gemm(x, w, mask, w_up, dense_rows)
    buf = poisoned(m, 96 + dense_rows)
    got = triton_masked_out_gemm(
        x, w, mask, w_up, dense_rows=dense_rows, out=buf[:m], block_m=16, block_n=16, block_k=16
    )
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert torch.isnan(buf[m:]).all()


@pytest.mark.parametrize(
    ("m", "k", "dense_rows", "programs"), [(17, 40, 0, 1), (45, 72, 48, 3), (70, 32, 32, 7), (5, 48, 0, 2)]
)
@pytest.mark.parametrize("sparsity", SPARSITIES)
@pytest.mark.parametrize("fuse", [False, True])
def test_persistent_prefill_matches_reference(m, k, dense_rows, programs, sparsity, fuse):
    """The persistent prefill kernel (TMA weight tiles, programs over the active tiles, then the
    zero tiles; each product's split tail of the policy): the reference's values with 3 routed groups over
    several token and channel tiles, dense rows after them, K no multiple of the K step, fewer programs than
    tiles; every output element written, nothing after it."""
    if fuse and dense_rows:
        pytest.skip("dense rows are the plain product's")
    x, w, w_up = inputs(m, k, 96 + dense_rows, fuse, seed=m + k)
    mask = random_mask(m, 3, sparsity, seed=m * 3)
    buf = poisoned(m, 96 + dense_rows)
    got = triton_persistent_out_gemm(
        x, w, mask, w_up, dense_rows=dense_rows, out=buf[:m], block_m=16, block_n=16, block_k=16, programs=programs
    )
    torch.testing.assert_close(got, torch_masked_out_gemm(x, w, mask, w_up, dense_rows), rtol=1e-4, atol=1e-4)
    assert torch.count_nonzero(got[:, :96][~mask.repeat_interleave(32, dim=-1)]) == 0
    assert torch.isnan(buf[m:]).all()


@pytest.mark.parametrize(("m", "dense_rows", "fuse"), [(70, 0, False), (61, 0, True), (45, 64, False), (33, 0, True)])
@pytest.mark.parametrize("sparsity", SPARSITIES)
@pytest.mark.parametrize("block_n", [32, 64])
def test_persistent_prefill_split_tail_matches_reference(m, dense_rows, fuse, sparsity, block_n):
    """A last round of active items that fills at most half the programs runs in two pieces of an item's
    channels (groups of 48 channels: in two channel tiles of 32, pieces of 16, or one of 64, pieces of 32; a
    piece, and the last dense group, partly or wholly past its channels): the reference's values, exact zeros
    in inactive groups, every output element written, nothing after it; the programs chosen on the host's
    item count."""
    split, gw = 2, 48
    x, w, w_up = inputs(m, 48, 3 * gw + dense_rows, fuse, seed=m + block_n)
    mask = random_mask(m, 3, sparsity, seed=m * 11)
    want = torch_masked_out_gemm(x, w, mask, w_up, dense_rows)
    items = persistent_rounds(mask, gw, dense_rows, 16, block_n, 1)["items"]
    tails = split_tail_programs(items, split)
    programs = max(tails, default=2)
    assert bool(persistent_rounds(mask, gw, dense_rows, 16, block_n, programs, split)["pieces"]) == bool(tails)
    assert tails or sparsity > 0
    buf = poisoned(m, 3 * gw + dense_rows)
    got = triton_persistent_out_gemm(
        x, w, mask, w_up, dense_rows=dense_rows, out=buf[:m], block_m=16, block_n=block_n, block_k=16,
        programs=programs, tail_split=split,
    )  # fmt: skip
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert torch.count_nonzero(got[:, : 3 * gw][~mask.repeat_interleave(gw, dim=-1)]) == 0
    assert torch.isnan(buf[m:]).all()


@pytest.mark.skipif(DEVICE == "cuda", reason="the interpreter's white-box check (on a GPU the tests above run)")
@pytest.mark.parametrize("fuse", [False, True])
def test_persistent_prefill_runs_exactly_the_last_rounds_items_in_pieces(fuse):
    """Which items the split tail runs: the kernel launched with its tail descriptors over a zero weight gives
    zeros in exactly the last round's items in the host's order (``persistent_order``) and the reference
    everywhere else."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    from compresskit_wide.kernels.gemm_out import persistent_order, triton_persistent_out_gemm_kernel
    from compresskit_wide.kernels.layout import torch_routing_layout

    m, k, gw, groups, bm, bn = 50, 32, 48, 3, 16, 32
    x, w, w_up = inputs(m, k, groups * gw, fuse, seed=9)
    w_up = w if w_up is None else w_up
    mask = random_mask(m, groups, 0.4, seed=4)
    order, counts = torch_routing_layout(mask)
    plan = persistent_rounds(mask, gw, 0, bm, bn, 1)
    programs = max(split_tail_programs(plan["items"]))
    plan = persistent_rounds(mask, gw, 0, bm, bn, programs, 2)
    zero = torch.zeros_like(w)
    descs = [TensorDescriptor.from_tensor(t, [rows, 16]) for rows, ts in ((bn, (w, w_up)), (bn // 2, (zero, zero)))
             for t in ts]  # fmt: skip
    out = torch.full((m, groups * gw), float("nan"))
    triton_persistent_out_gemm_kernel[(programs,)](
        x, *descs, out, order, counts, m, groups * gw, k, gw, groups, groups, 1, x.stride(0), out.stride(0),
        FUSE_SWIGLU=fuse, DOT_PRECISION="ieee", GROUPS_P2=4, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=16, PER_SM=1,
        TAIL_SPLIT=2,
    )  # fmt: skip
    want = torch_masked_out_gemm(x, w, mask, w_up if fuse else None)
    items = persistent_order(mask, gw, 0, bm, bn)
    tail = torch.zeros(m, groups * gw, dtype=torch.bool)
    for g, tm, tn in items[plan["whole"] :]:  # an item of the split tail: its active rows, its channels in the group
        rows = order[g, tm * bm : min((tm + 1) * bm, int(counts[g]))].long()
        tail[rows, g * gw + tn * bn : g * gw + min((tn + 1) * bn, gw)] = True
    assert len(items) == plan["items"] and plan["pieces"] == 2 * (len(items) - plan["whole"]) > 0
    assert torch.count_nonzero(out[tail]) == 0 and torch.count_nonzero(want[tail]) > 0
    torch.testing.assert_close(out[~tail], want[~tail], rtol=1e-4, atol=1e-4)


def test_persistent_order_group_after_group():
    """The items' order: 2 groups holding 3 and 1 token tiles (and a dense group of 3) over 2 channel tiles,
    group after group, each group's token tiles in turn, as many as the host counts."""
    from compresskit_wide.kernels.gemm_out import persistent_order

    mask = torch.zeros(40, 2, dtype=torch.bool)
    mask[:33, 0] = mask[5:9, 1] = True  # 33 active: 3 tiles of 16; 4 active: 1 tile
    by_group = persistent_order(mask, 32, 32, 16, 16)
    assert by_group == [(g, tm, tn) for g, n in ((0, 3), (1, 1), (2, 3)) for tm in range(n) for tn in (0, 1)]
    assert len(by_group) == persistent_rounds(mask, 32, 32, 16, 16, 1)["items"]


def test_persistent_rounds_counts_the_items_and_the_split_tail():
    """The host's count of the kernel's items: 512 tokens over 112 groups of 128 channels in tiles of 128 x 128
    (the tile the H200's autotuner chose for gate+up at 512 tokens), 132 programs. With 402 of each group's
    tokens active (the realised 21.5% of the bench's 25% row) every group holds 4 tiles: 448 items, 4 rounds;
    with 341 (37.5%) 3 tiles, 336 items, 3 rounds. Split in two, the 52 items of the fourth round take half a
    round; a tail that fills more than half of the programs is not split, nor a tile narrower than 32
    channels."""
    groups = 112

    def mask_with(active):
        return torch.arange(512)[:, None].expand(512, groups) < active

    assert persistent_rounds(mask_with(402), 128, 0, 128, 128, 132) == {
        "items": 448, "whole": 448, "pieces": 0, "rounds": 4
    }  # fmt: skip
    assert persistent_rounds(mask_with(341), 128, 0, 128, 128, 132)["rounds"] == 3
    assert persistent_rounds(mask_with(402), 128, 0, 128, 128, 132, 2) == {
        "items": 448, "whole": 396, "pieces": 104, "rounds": 3.5
    }  # fmt: skip
    # 100 items of a last round over 132 programs: more than half, whole
    assert persistent_rounds(mask_with(480), 128, 0, 128, 128, 116, 2)["pieces"] == 0
    assert persistent_rounds(mask_with(402), 128, 0, 128, 16, 132, 2)["pieces"] == 0
    with pytest.raises(ValueError, match="tail_split=4: 1 or 2"):
        triton_persistent_out_gemm(*inputs(20, 32, 32, False, seed=1)[:2], random_mask(20, 2, 0.5), tail_split=4)


def test_persistent_prefill_reads_a_weight_that_starts_unaligned():
    """A weight whose start is not 16-byte aligned (a view one element in, as a tensor mapped from a file
    may be) gives the reference's values, and ``auto`` would send it to cuBLAS."""
    x, w, _ = inputs(30, 64, 96, False, seed=5)
    view = torch.cat([w.new_zeros(1), w.flatten()])[1:].view(96, 64)  # the same values, 4 bytes in
    assert view.data_ptr() % 16 and not out_kernel_takes(x, view)
    mask = random_mask(30, 3, 0.5, seed=6)
    got = triton_persistent_out_gemm(x, view, mask, block_m=16, block_n=16, block_k=16)
    torch.testing.assert_close(got, torch_masked_out_gemm(x, view, mask), rtol=1e-4, atol=1e-4)
    assert out_kernel_takes(x, w) and out_kernel_takes(x[:16], view)  # aligned; decode sizes take any


def test_persistent_prefill_refuses_rows_a_descriptor_cannot_take():
    x, w, _ = inputs(20, 36, 32, False, seed=3)  # 36 bf16 = 72 bytes a row
    with pytest.raises(ValueError, match="K=36: a TMA descriptor needs rows of a multiple of 16 bytes"):
        triton_persistent_out_gemm(x.bfloat16(), w.bfloat16(), random_mask(20, 2, 0.5))


@pytest.mark.skipif(DEVICE != "cuda", reason=NEEDS_GPU)
@pytest.mark.parametrize("fuse", [False, True])
@pytest.mark.parametrize("m", [17, 300, 1100])
def test_bf16_persistent_prefill_with_autotuned_tiles(fuse, m):
    """The persistent kernel on its autotuned tiles in bf16: q with dense rows, gate+up fused."""
    dense_rows = 0 if fuse else 1024
    x = torch.randn(m, 1024, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(2048 + dense_rows, 1024, device="cuda", dtype=torch.bfloat16) / 4
    w_up = torch.randn(2048, 1024, device="cuda", dtype=torch.bfloat16) / 4 if fuse else None
    mask = random_mask(m, 8, 0.5, seed=m)
    buf = poisoned(m, 2048 + dense_rows, torch.bfloat16)
    got = triton_persistent_out_gemm(x, w, mask, w_up, dense_rows=dense_rows, out=buf[:m])
    ref = torch_masked_out_gemm(x, w, mask, w_up, dense_rows)
    torch.testing.assert_close(got.float(), ref.float(), rtol=2e-2, atol=2e-1 if fuse else 2e-2 * 16)
    assert torch.count_nonzero(got[:, :2048][~mask.repeat_interleave(256, dim=-1)]) == 0
    assert torch.isnan(buf[m:]).all()


@pytest.mark.skipif(DEVICE != "cuda", reason=NEEDS_GPU)
@pytest.mark.parametrize("fuse", [False, True])
def test_bf16_persistent_prefill_split_tail_on_the_h200s_tiles(fuse):
    """The split tail in bf16 on the tiles the H200's autotuner chose (q: 64 x 256, its pieces 128 channels;
    gate+up: 128 x 128, pieces of 64), the programs chosen so that the last round fills at most half of them:
    the reference's values, zeros where inactive, nothing written past the rows."""
    m, groups, gw = 600, 8 if not fuse else 28, 512 if not fuse else 128
    dense_rows = 0 if fuse else 1024
    bm, bn, warps, stages = (128, 128, 8, 4) if fuse else (64, 256, 8, 4)
    x = torch.randn(m, 1024, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(groups * gw + dense_rows, 1024, device="cuda", dtype=torch.bfloat16) / 4
    w_up = torch.randn(groups * gw, 1024, device="cuda", dtype=torch.bfloat16) / 4 if fuse else None
    mask = random_mask(m, groups, 0.25, seed=m)
    items = persistent_rounds(mask, gw, dense_rows, bm, bn, 1)["items"]
    programs = max(split_tail_programs(items))
    assert persistent_rounds(mask, gw, dense_rows, bm, bn, programs, 2)["pieces"] > 0
    buf = poisoned(m, groups * gw + dense_rows, torch.bfloat16)
    got = triton_persistent_out_gemm(
        x, w, mask, w_up, dense_rows=dense_rows, out=buf[:m], block_m=bm, block_n=bn, block_k=64, warps=warps,
        stages=stages, programs=programs, tail_split=2,
    )  # fmt: skip
    ref = torch_masked_out_gemm(x, w, mask, w_up, dense_rows)
    torch.testing.assert_close(got.float(), ref.float(), rtol=2e-2, atol=2e-1 if fuse else 2e-2 * 16)
    assert torch.count_nonzero(got[:, : groups * gw][~mask.repeat_interleave(gw, dim=-1)]) == 0
    assert torch.isnan(buf[m:]).all()


@pytest.mark.skipif(DEVICE != "cuda", reason=NEEDS_GPU)
def test_bf16_prefill_past_32_bit_offsets():
    """A prefill whose output passes 2**31 elements (here 132k tokens x 16,384 channels; at Llama-3.1-8B's
    gate+up, from 150k tokens: batch 32 x 8k) addresses its rows in 64 bits: the last rows are right."""
    m, k, n = 2**31 // 16384 + 1000, 64, 16384
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / 4
    mask = random_mask(m, 8, 0.5, seed=3)
    got = triton_masked_out_gemm(x, w, mask)
    tail = slice(m - 300, m)
    want = torch_masked_out_gemm(x[tail], w, mask[tail])
    torch.testing.assert_close(got[tail].float(), want.float(), rtol=2e-2, atol=2e-2 * 4)


@pytest.mark.parametrize("m", [1, 2, 3, 5, 16])
@pytest.mark.parametrize("sparsity", SPARSITIES)
@pytest.mark.parametrize("fuse", [False, True])
@pytest.mark.parametrize(("k_pack", "block_n"), [(1, 16), (2, 8), (4, None), (8, 2), (16, 1)])
def test_decode_packs_k_chunks_into_one_product(m, sparsity, fuse, k_pack, block_n):
    """The decode kernel with ``k_pack`` chunks of K in one product (any power of two with fixed tiles;
    on a GPU the autotuned tiles of the packings ``auto`` takes): a K of no whole number of steps, a
    group of 32 channels over 1-32 programs."""
    x, w, w_up = inputs(m, 200, 96, fuse, seed=m * 5 + k_pack)
    mask = random_mask(m, 3, sparsity, seed=m + 3)
    buf = poisoned(m, 96)
    got = triton_masked_out_gemm(x, w, mask, w_up, out=buf[:m], block_n=block_n, block_k=16, k_pack=k_pack)
    torch.testing.assert_close(got, torch_masked_out_gemm(x, w, mask, w_up), rtol=1e-4, atol=1e-4)
    assert torch.count_nonzero(got[~mask.repeat_interleave(32, dim=-1)]) == 0
    assert torch.isnan(buf[m:]).all()


@pytest.mark.parametrize("m", [17, 33, 64])
@pytest.mark.parametrize("sparsity", SPARSITIES)
@pytest.mark.parametrize(("fuse", "dense_rows"), [(False, 0), (True, 0), (False, 48)])
@pytest.mark.parametrize("same_set", [True, False])
def test_a_shared_set_takes_the_decode_kernel_up_to_64_tokens(m, sparsity, fuse, dense_rows, same_set):
    """17-64 tokens that run one set of groups (a batch's consensus set) in the decode kernel's one tile: the
    reference's values, dense rows for every token, exact zeros in the groups off; a mask that is not one set
    (``shared`` is a hint of speed) is still computed exactly."""
    x, w, w_up = inputs(m, 72, 96 + dense_rows, fuse, seed=m + dense_rows)
    mask = random_mask(1 if same_set else m, 3, sparsity, seed=m * 3).expand(m, 3).contiguous()
    buf = poisoned(m, 96 + dense_rows)
    got = triton_masked_out_gemm(
        x, w, mask, w_up, dense_rows=dense_rows, out=buf[:m], block_n=16, block_k=16, shared=True
    )
    torch.testing.assert_close(got, torch_masked_out_gemm(x, w, mask, w_up, dense_rows), rtol=1e-4, atol=1e-4)
    assert torch.count_nonzero(got[:, :96][~mask.repeat_interleave(32, dim=-1)]) == 0
    assert torch.isnan(buf[m:]).all()
    with pytest.raises(ValueError, match="past 16 tokens the decode kernel does not pack K"):
        triton_masked_out_gemm(x, w, mask, w_up, dense_rows=dense_rows, block_n=16, shared=True, k_pack=2)


@pytest.mark.parametrize("m", [1, 5, 16, 17, 45])
@pytest.mark.parametrize("dense_rows", [32, 48, 80])
@pytest.mark.parametrize("sparsity", SPARSITIES)
@pytest.mark.parametrize("k_pack", [None, 1, 4])
def test_dense_rows_run_for_every_token(m, dense_rows, sparsity, k_pack):
    """q over 3 routed groups of 32 with k and v stacked under it as dense rows (a whole group, one
    and a half, two and a half): the dense rows equal the plain product for every token, the
    mask all off included; the routed rows are the masked reference's."""
    if k_pack is not None and m > 16:
        pytest.skip("k_pack is the decode kernel's")
    x, w, _ = inputs(m, 72, 96 + dense_rows, False, seed=m + dense_rows)
    mask = random_mask(m, 3, sparsity, seed=m * 3 + 1)
    buf = poisoned(m, 96 + dense_rows)
    got = triton_masked_out_gemm(
        x, w, mask, dense_rows=dense_rows, out=buf[:m], block_m=16, block_n=16, block_k=16, k_pack=k_pack
    )
    want = torch_masked_out_gemm(x, w, mask, None, dense_rows)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(want[:, 96:], x @ w[96:].T, rtol=1e-4, atol=1e-4)
    assert torch.count_nonzero(got[:, :96][~mask.repeat_interleave(32, dim=-1)]) == 0
    assert torch.isnan(buf[m:]).all()


@pytest.mark.parametrize("zero_inactive", [True, False])
def test_dense_fallback_with_dense_rows(zero_inactive):
    x, w, _ = inputs(9, 48, 96 + 40, False, seed=5)
    mask = random_mask(9, 3, 0.5, seed=6)
    got = dense_masked_out_gemm(x, w, mask, zero_inactive=zero_inactive, dense_rows=40)
    want = torch_masked_out_gemm(x, w, mask, None, 40) if zero_inactive else x @ w.T
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_refuses_dense_rows_it_cannot_split():
    x, w, _ = inputs(2, 64, 96, False, seed=7)
    mask = random_mask(2, 3, 0.5)
    with pytest.raises(ValueError, match="N=96 less dense_rows=16 does not split into 3 groups"):
        triton_masked_out_gemm(x, w, mask, dense_rows=16)
    with pytest.raises(ValueError, match="N=96 less dense_rows=96 does not split"):
        torch_masked_out_gemm(x, w, mask, None, 96)
    with pytest.raises(ValueError, match="dense_rows is for the plain product"):
        dense_masked_out_gemm(x, w[:48], random_mask(2, 1, 0.5), w[48:], dense_rows=24)


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
    with pytest.raises(ValueError, match=r"k_pack is for the decode kernel \(M <= 16, or shared\); got M=17"):
        triton_masked_out_gemm(torch.randn(17, 64, device=DEVICE), w, random_mask(17, 2, 0.5), k_pack=4)
    with pytest.raises(ValueError, match="tl.dot needs 16 or more"):
        triton_masked_out_gemm(x, w, mask, block_n=4, k_pack=2)
    with pytest.raises(ValueError, match="shapes do not fit"):
        triton_masked_out_gemm(x, w[:, :60], mask)
    if DEVICE == "cuda":
        with pytest.raises(ValueError, match=r"k_pack=8 has no tile table on a GPU; tuned: \[1, 2, 4\]"):
            triton_masked_out_gemm(x, w, mask, k_pack=8)


@pytest.mark.skipif(DEVICE != "cuda", reason=NEEDS_GPU)
@pytest.mark.parametrize("fuse", [False, True])
@pytest.mark.parametrize(("m", "k_pack"), [(1, None), (1, 1), (1, 2), (4, None), (13, None), (16, 4), (300, None)])
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


@pytest.mark.skipif(DEVICE != "cuda", reason=NEEDS_GPU)
@pytest.mark.parametrize("fuse", [False, True])
@pytest.mark.parametrize("m", [17, 32, 64])
def test_bf16_shared_set_with_autotuned_tiles(fuse, m):
    """A batch's shared set at 17-64 tokens on the autotuned decode tiles (8B-like groups: 512 rows of q,
    128 FFN channels)."""
    k, n, groups = 1024, 1024 if not fuse else 2048, 2 if not fuse else 16
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / 8
    w_up = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / 8 if fuse else None
    mask = random_mask(1, groups, 0.5, seed=m).expand(m, groups).contiguous()
    got = triton_masked_out_gemm(x, w, mask, w_up, shared=True)
    want = torch_masked_out_gemm(x, w, mask, w_up)
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2 * 8)


@pytest.mark.skipif(DEVICE != "cuda", reason=NEEDS_GPU)
@pytest.mark.parametrize("m", [1, 4, 16, 300])
def test_bf16_dense_rows_with_autotuned_tiles(m):
    """q / k / v stacked at Llama-3.1-8B's proportions (8 groups of 4 heads, 8 KV heads; here head
    dim 64): the dense rows for every token, in bf16 with the autotuned tiles."""
    x = torch.randn(m, 1024, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(2048 + 1024, 1024, device="cuda", dtype=torch.bfloat16) / 4
    mask = random_mask(m, 8, 0.5)
    buf = poisoned(m, 3072, torch.bfloat16)
    got = triton_masked_out_gemm(x, w, mask, dense_rows=1024, out=buf[:m])
    ref = torch_masked_out_gemm(x, w, mask, None, 1024)
    torch.testing.assert_close(got.float(), ref.float(), rtol=2e-2, atol=2e-2 * 16)
    assert torch.count_nonzero(got[:, :2048][~mask.repeat_interleave(256, dim=-1)]) == 0
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
    if w_up is None:  # the plain product left as computed
        torch.testing.assert_close(raw, x @ w.T, rtol=0, atol=0)
    else:  # the SwiGLU's one pass zeroes anyway
        torch.testing.assert_close(raw, got, rtol=0, atol=0)
    torch.testing.assert_close(raw[~inactive], got[~inactive], rtol=0, atol=0)


@pytest.mark.parametrize(("m", "n", "groups"), [(1, 48, 3), (5, 60, 3), (33, 96, 1), (7, 2400, 2), (0, 64, 2)])
@pytest.mark.parametrize("sparsity", SPARSITIES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_swiglu_zero_matches_reference(m, n, groups, sparsity, dtype):
    """The fallback's one pass: silu(gate) * up in fp32 where active, exactly 0 elsewhere, even where
    gate and up hold NaN; gate and up as the two halves of one product's output (a row stride of 2N),
    groups of a width no power of two, channels past one program's block, no token."""
    if dtype == torch.bfloat16 and DEVICE == "cpu":
        pytest.skip(NEEDS_GPU)
    gen = torch.Generator().manual_seed(m * 31 + n)
    gu = torch.randn(m, 2 * n, generator=gen).to(DEVICE, dtype)
    gate, up = gu.split(n, dim=-1)
    mask = random_mask(m, groups, sparsity, seed=m + n)
    inactive = ~mask.repeat_interleave(n // groups, dim=-1)
    gate[inactive], up[inactive] = float("nan"), float("nan")
    got = swiglu_zero(gate, up, mask)
    ref = torch_swiglu_zero(gate, up, mask)
    assert got.shape == (m, n) and got.dtype == dtype and torch.count_nonzero(got[inactive]) == 0
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got.float(), ref.float(), rtol=tol, atol=tol)
    with pytest.raises(ValueError, match="G dividing N"):
        swiglu_zero(gate, up, random_mask(m, 7, 0.5))


def test_stacked_rows_finds_gate_and_up_stacked_by_the_runtime():
    """Gate and up stacked by ``stacked_linear`` (the modules' weights re-pointed at one tensor) are one
    ``[2N, K]`` view; weights apart, or in the other order, are not."""
    from compresskit.runtime.blocks import stacked_linear

    gate, up = torch.nn.Linear(40, 24, bias=False), torch.nn.Linear(40, 24, bias=False)
    assert stacked_rows(gate.weight, up.weight) is None
    ref = torch.cat([gate.weight, up.weight]).detach().clone()
    stacked_linear([gate, up])
    both = stacked_rows(gate.weight, up.weight)
    assert both is not None and both.data_ptr() == gate.weight.data_ptr() and torch.equal(both, ref)
    assert stacked_rows(up.weight, gate.weight) is None


def test_dense_fallback_runs_stacked_gate_and_up_as_one_product():
    """With gate and up stacked, the fallback's SwiGLU is one product and one pass, equal to the reference."""
    from compresskit.runtime.blocks import stacked_linear

    gen = torch.Generator().manual_seed(5)
    gate, up = torch.nn.Linear(48, 96, bias=False), torch.nn.Linear(48, 96, bias=False)
    stacked_linear([gate, up])
    x = torch.randn(6, 48, generator=gen)
    mask = random_mask(6, 3, 0.5, seed=2).cpu()
    products = []

    class Count(torch.overrides.TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            if getattr(func, "__name__", "") in ("matmul", "__matmul__", "mm"):
                products.append(func)
            return func(*args, **(kwargs or {}))

    with torch.no_grad(), Count():
        got = dense_masked_out_gemm(x, gate.weight, mask, up.weight)
    assert len(products) == 1
    ref = torch_masked_out_gemm(x, gate.weight.detach(), mask, up.weight.detach())
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    ("m", "k", "n", "groups", "dense_rows", "fuse", "k_pack"),
    [
        (1, 40, 64, 2, 0, False, 4),  # K no multiple of the K step, packed 4
        (3, 64, 96, 3, 32, False, 2),  # k and v rows under q
        (16, 48, 64, 4, 0, True, 1),  # the fused SwiGLU, a full tile of tokens
        (5, 72, 64, 4, 16, False, 1),
        (7, 100, 48, 3, 0, True, 1),
        (13, 1100, 32, 2, 16, False, 1),  # a row's statistics in several steps (ROW_K columns each)
    ],
)
@pytest.mark.parametrize(
    ("decided", "dtype"),
    [("ragged", torch.float32), ("all on", torch.float32), ("all off", torch.float32), ("ragged", torch.float16)],
)
def test_the_decision_in_the_decode_products_prologue(m, k, n, groups, dense_rows, fuse, k_pack, decided, dtype):
    """``router_norm_out_gemm`` in one launch: the decision of every group from the shares, ``x + delta``
    as the add rounds it and the product of its RMSNorm, as the reference's decision, add, norm and masked
    product give them; exact zeros in the skipped groups (dense rows computed for every token even where
    every group is off), and the counts. (fp16: the norm rounded as Llama's rounds it; bf16 on the GPU only,
    below: the interpreter rounds it by truncation.)"""
    from compresskit_wide.kernels.gemm_out import torch_router_norm_out_gemm, triton_router_norm_out_gemm
    from compresskit_wide.kernels.router import torch_count

    args = prologue_inputs(m, k, groups, decided, dtype=dtype, seed=m + k)
    gen = torch.Generator().manual_seed(n)
    w = (torch.randn(n + dense_rows, k, generator=gen) / k**0.5).to(DEVICE, dtype)
    w_up = (torch.randn(n, k, generator=gen) / k**0.5).to(DEVICE, dtype) if fuse else None
    want, want_execute, want_x = torch_router_norm_out_gemm(*args, w, w_up, dense_rows)
    counts, want_counts = (torch.full((2,), 2.0, dtype=torch.float64, device=DEVICE) for _ in range(2))
    got, execute, x_new = triton_router_norm_out_gemm(
        *args, w, w_up, dense_rows=dense_rows, counts=counts, block_n=16, block_k=16, k_pack=k_pack
    )
    torch_count(want_execute, want_counts)
    assert execute.dtype == torch.bool and torch.equal(execute, want_execute)
    assert {"all on": want_execute.all(), "all off": not want_execute.any()}.get(decided, True)
    assert torch.equal(x_new, want_x) and torch.equal(counts, want_counts)
    tolerance = 1e-4 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(got, want, rtol=tolerance, atol=tolerance)
    assert torch.count_nonzero(got[:, :n][~execute.repeat_interleave(n // groups, dim=-1)]) == 0
    if dense_rows:
        assert torch.count_nonzero(got[:, n:]) == m * dense_rows
    not_counting = triton_router_norm_out_gemm(*args, w, w_up, dense_rows=dense_rows, block_n=16, block_k=16)
    assert torch.equal(not_counting[1], want_execute)


def test_the_decision_in_the_prologue_validates_its_tensors():
    from compresskit_wide.kernels.gemm_out import triton_router_norm_out_gemm

    args = prologue_inputs(17, 32, 2, "ragged")
    w = torch.zeros(64, 32, device=DEVICE)
    with pytest.raises(ValueError, match="for decode sizes: M=17 > 16"):
        triton_router_norm_out_gemm(*args, w)
    shares, bd, rw, rb, x, delta, norm_w, eps = prologue_inputs(3, 32, 2, "ragged")
    with pytest.raises(ValueError, match="norm tensors do not fit 3 tokens' shares"):
        triton_router_norm_out_gemm(shares, bd, rw, rb, x, delta[:, :16], norm_w, eps, w)
    with pytest.raises(ValueError, match="does not split into 2 groups"):
        triton_router_norm_out_gemm(shares, bd, rw, rb, x, delta, norm_w, eps, w[:63])
    with pytest.raises(ValueError, match="router tensors do not fit"):
        triton_router_norm_out_gemm(shares, bd[:4], rw, rb, x, delta, norm_w, eps, w)


@pytest.mark.skipif(DEVICE != "cuda", reason=NEEDS_GPU)
@pytest.mark.parametrize("fuse", [False, True])
@pytest.mark.parametrize("m", [1, 4, 16])
def test_bf16_decision_in_the_prologue_with_autotuned_tiles(fuse, m):
    """bf16 at Llama-3.1-8B's widths (D 4,096, 256 shares), tiles autotuned: the reference's decision, add and
    product, and the counts of one call (the autotuner's timed calls give the counters back)."""
    from compresskit_wide.kernels.gemm_out import torch_router_norm_out_gemm, triton_router_norm_out_gemm
    from compresskit_wide.kernels.router import torch_count

    groups, n = (112, 14336) if fuse else (8, 4096)
    args = prologue_inputs(m, 4096, groups, "ragged", dtype=torch.bfloat16, seed=m)
    w = (torch.randn(n + (0 if fuse else 2048), 4096, device=DEVICE) / 64).to(torch.bfloat16)
    w_up = (torch.randn(n, 4096, device=DEVICE) / 64).to(torch.bfloat16) if fuse else None
    dense_rows = 0 if fuse else 2048
    want, want_execute, want_x = torch_router_norm_out_gemm(*args, w, w_up, dense_rows)
    counts, want_counts = (torch.zeros(2, dtype=torch.float64, device=DEVICE) for _ in range(2))
    got, execute, x_new = triton_router_norm_out_gemm(*args, w, w_up, dense_rows=dense_rows, counts=counts)
    torch_count(want_execute, want_counts)
    sure = (execute == want_execute).float().mean().item()
    assert sure >= 0.99 and torch.equal(x_new, want_x) and torch.equal(counts[0], want_counts[0])
    assert counts[1].item() == execute.sum().item()  # one call's decision, counted once
    same = (execute == want_execute).all(dim=-1)  # (a near-tie may fall the other way: another summation order)
    torch.testing.assert_close(got[same].float(), want[same].float(), rtol=5e-2, atol=2e-1 if fuse else 1e-1)
