"""The routed attention (decode and prefill) against its references and the dense fallbacks."""

import math

import pytest
import torch

pytest.importorskip("triton")

from kernel_helpers import DEVICE, SPARSITIES, random_mask  # noqa: E402

from compresskit_wide.kernels.attention_decode import (  # noqa: E402
    dense_routed_attention_decode,
    torch_routed_attention_decode,
    triton_routed_attention_decode,
)
from compresskit_wide.kernels.attention_prefill import (  # noqa: E402
    dense_routed_attention_prefill,
    torch_routed_attention_prefill,
    triton_routed_attention_prefill,
)

pytestmark = pytest.mark.triton


@pytest.mark.parametrize(
    ("b", "hq", "hkv", "d", "s", "groups"),
    [(2, 6, 2, 16, 7, 2), (2, 6, 2, 16, 33, 3), (1, 8, 2, 32, 100, 4), (3, 4, 4, 16, 1, 4), (2, 8, 2, 16, 64, 2)],
)
@pytest.mark.parametrize("sparsity", SPARSITIES)
@pytest.mark.parametrize("splits", [1, 3])
def test_decode_matches_reference(b, hq, hkv, d, s, groups, sparsity, splits):
    """Ragged cache lengths, sequences with different masks, one KV split or three."""
    gen = torch.Generator().manual_seed(b * 100 + s)
    q = torch.randn(b, hq, d, generator=gen).to(DEVICE)
    k = torch.randn(b, hkv, s, d, generator=gen).to(DEVICE)
    v = torch.randn(b, hkv, s, d, generator=gen).to(DEVICE)
    lens = torch.randint(1, s + 1, (b,), generator=gen).to(DEVICE)
    mask = random_mask(b, groups, sparsity, seed=s + groups)
    got = triton_routed_attention_decode(q, k, v, lens, mask, splits=splits)
    torch.testing.assert_close(got, torch_routed_attention_decode(q, k, v, lens, mask), rtol=1e-4, atol=1e-4)
    assert torch.count_nonzero(got[~mask.repeat_interleave(hq // groups, dim=-1)]) == 0


def test_decode_reads_no_kv_for_inactive_groups():
    """With every group off, K and V may be NaN: nothing reads them; with one group on, only its KV
    head is read."""
    q = torch.randn(2, 6, 16, device=DEVICE)
    k = torch.full((2, 2, 40, 16), float("nan"), device=DEVICE)
    v = torch.full((2, 2, 40, 16), float("nan"), device=DEVICE)
    lens = torch.tensor([40, 13], device=DEVICE)
    mask = torch.zeros(2, 2, dtype=torch.bool, device=DEVICE)
    out = triton_routed_attention_decode(q, k, v, lens, mask)
    assert torch.count_nonzero(out) == 0 and not torch.isnan(out).any()
    k[:, 0] = torch.randn(2, 40, 16, device=DEVICE)
    v[:, 0] = torch.randn(2, 40, 16, device=DEVICE)
    mask[0, 0] = True
    out = triton_routed_attention_decode(q, k, v, lens, mask)
    assert not torch.isnan(out).any() and torch.count_nonzero(out[0, :3]) > 0 and torch.count_nonzero(out[:, 3:]) == 0


@pytest.mark.parametrize("splits", [4, 8])
def test_decode_reads_nothing_past_a_sequence_end(splits):
    """The cache's slots past each sequence's length may hold anything (NaN here): no split reads
    them, including the splits that start past the end (which return at once)."""
    gen = torch.Generator().manual_seed(splits)
    q = torch.randn(3, 8, 16, generator=gen).to(DEVICE)
    k = torch.randn(3, 2, 128, 16, generator=gen).to(DEVICE)
    v = torch.randn(3, 2, 128, 16, generator=gen).to(DEVICE)
    lens = torch.tensor([5, 70, 128], device=DEVICE)
    mask = torch.tensor([[True, True], [True, False], [False, True]], device=DEVICE)
    want = torch_routed_attention_decode(q, k, v, lens, mask)
    for b, n in enumerate(lens.tolist()):
        k[b, :, n:] = float("nan")
        v[b, :, n:] = float("nan")
    got = triton_routed_attention_decode(q, k, v, lens, mask, splits=splits)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_decode_splits_fill_the_gpu_within_bounds():
    """The split count: the programs the policy aims for over the batch's (sequence, KV head) pairs,
    never a split shorter than the policy's minimum, 1 to the maximum."""
    from compresskit_wide.kernels import policy

    per, most, aim = policy.ATTN_DECODE_POSITIONS_PER_SPLIT, policy.ATTN_DECODE_MAX_SPLITS, policy.ATTN_DECODE_PROGRAMS
    for context in (1, per - 1, per, 8 * per, 10**6):
        for batch, kv_heads in ((1, 1), (1, 8), (64, 8)):
            splits = policy.attention_decode_splits(context, batch, kv_heads)
            assert 1 <= splits <= most
            assert splits == 1 or context // splits >= per
            pairs, cap = batch * kv_heads, max(1, min(most, context // per))
            assert splits == cap or pairs * splits >= aim  # enough programs, unless the cache caps them
            assert splits == 1 or pairs * (splits - 1) < aim  # and no more than needed


@pytest.mark.parametrize(
    ("b", "hq", "hkv", "d", "t", "past", "groups"),
    [
        (2, 6, 2, 16, 5, 0, 2),
        (2, 6, 2, 16, 17, 7, 3),
        (1, 8, 2, 32, 40, 0, 4),
        (1, 4, 4, 16, 33, 0, 4),
        (1, 6, 2, 16, 1, 9, 2),
        (1, 4, 2, 16, 20, 50, 2),  # a long past: several key blocks before any query, unmasked
        (2, 8, 2, 16, 37, 5, 2),  # 4 heads a group and a KV head: up to 4 heads a program
    ],
)
@pytest.mark.parametrize("sparsity", SPARSITIES)
def test_prefill_matches_reference(b, hq, hkv, d, t, past, groups, sparsity):
    """The default tiles (autotuned on a GPU) and fixed ones, one query head a program and, where the
    heads of a group share a KV head, 2 or 4 (rows = tokens x heads)."""
    gen = torch.Generator().manual_seed(t * 10 + past)
    q = torch.randn(b, hq, t, d, generator=gen).to(DEVICE)
    k = torch.randn(b, hkv, past + t, d, generator=gen).to(DEVICE)
    v = torch.randn(b, hkv, past + t, d, generator=gen).to(DEVICE)
    mask = (torch.rand(b, t, groups, generator=gen) >= sparsity).to(DEVICE)
    ref = torch_routed_attention_prefill(q, k, v, mask)
    heads_off = ~mask.repeat_interleave(hq // groups, dim=-1).permute(0, 2, 1)  # [B, Hq, T]
    shared = math.gcd(hq // hkv, hq // groups)
    tiles = [{}, {"block_m": 16, "block_n": 16}, {"block_m": 16, "block_n": 32}]
    tiles += [
        {"block_m": bm, "block_n": 16, "heads_per_program": hp} for hp in (2, 4) if shared % hp == 0 for bm in (16, 32)
    ]
    for tile in tiles:
        got = triton_routed_attention_prefill(q, k, v, mask, **tile)
        torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)
        assert torch.count_nonzero(got[heads_off]) == 0
        assert got.transpose(1, 2).is_contiguous()  # stored as [B, T, Hq, D], the layout o reads: no copy after
    strided_q = q.transpose(1, 2).contiguous().transpose(1, 2)  # the runtime's q: [B, T, Hq, D] seen as [B, Hq, T, D]
    torch.testing.assert_close(triton_routed_attention_prefill(strided_q, k, v, mask), ref, rtol=1e-4, atol=1e-4)
    if shared % 2:
        with pytest.raises(ValueError, match="heads_per_program=2 must be 1, 2 or 4 and divide the heads of a group"):
            triton_routed_attention_prefill(q, k, v, mask, block_m=16, heads_per_program=2)


def test_prefill_reference_equals_sdpa_when_all_on():
    q, k, v = torch.randn(2, 6, 9, 16), torch.randn(2, 2, 9, 16), torch.randn(2, 2, 9, 16)
    ref = torch.nn.functional.scaled_dot_product_attention(
        q, k.repeat_interleave(3, dim=1), v.repeat_interleave(3, dim=1), is_causal=True
    )
    got = torch_routed_attention_prefill(q, k, v, torch.ones(2, 9, 2, dtype=torch.bool))
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("sparsity", SPARSITIES)
def test_dense_fallbacks_equal_references(sparsity):
    gen = torch.Generator().manual_seed(5)
    b, hq, hkv, d, s = 3, 8, 2, 16, 37
    q = torch.randn(b, hq, d, generator=gen).to(DEVICE)
    k = torch.randn(b, hkv, s, d, generator=gen).to(DEVICE)
    v = torch.randn(b, hkv, s, d, generator=gen).to(DEVICE)
    lens = torch.tensor([37, 1, 20], dtype=torch.int32, device=DEVICE)
    mask = random_mask(b, 4, sparsity, seed=6)
    got = dense_routed_attention_decode(q, k, v, lens, mask)
    torch.testing.assert_close(got, torch_routed_attention_decode(q, k, v, lens, mask), rtol=1e-4, atol=1e-4)
    for t in (s, 5):  # no past (is_causal) and 32 positions of past (the shifted diagonal)
        qp = torch.randn(b, hq, t, d, generator=gen).to(DEVICE)
        pmask = random_mask(b * t, 4, sparsity, seed=t).reshape(b, t, 4)
        got = dense_routed_attention_prefill(qp, k, v, pmask)
        torch.testing.assert_close(got, torch_routed_attention_prefill(qp, k, v, pmask), rtol=1e-4, atol=1e-4)
