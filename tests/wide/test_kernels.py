"""WIDE kernels against their PyTorch references: odd shapes, all-off / all-on / ragged masks,
groups spanning several tiles, outputs poisoned first. On the CPU they run in Triton's
interpreter (TRITON_INTERPRET=1, set by conftest); on a GPU, natively (bf16 too)."""

import math
import os

import pytest
import torch

triton = pytest.importorskip("triton")

from compresskit.errors import KernelUnavailableError  # noqa: E402
from compresskit_wide import kernels  # noqa: E402
from compresskit_wide.kernels import tuning  # noqa: E402
from compresskit_wide.kernels.gemm_out import torch_masked_out_gemm, triton_masked_out_gemm  # noqa: E402
from compresskit_wide.kernels.layout import torch_routing_layout, triton_routing_layout  # noqa: E402

pytestmark = pytest.mark.triton
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SPARSITIES = [0.0, 0.5, 0.9, 1.0]


def random_mask(m, g, sparsity, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.rand(m, g, generator=gen) >= sparsity).to(DEVICE)


@pytest.mark.parametrize("m", [1, 2, 3, 5, 16, 17, 1000, 9000])  # 9000: over one block (two passes)
@pytest.mark.parametrize("sparsity", SPARSITIES)
def test_routing_layout_matches_reference_exactly(m, sparsity):
    mask = random_mask(m, 7, sparsity, seed=m)
    got = triton_routing_layout(mask)
    ref = torch_routing_layout(mask)
    for a, b in zip(got, ref, strict=True):
        assert a.dtype == b.dtype and torch.equal(a.cpu(), b.cpu())
    order, counts, groups, n_active = got
    assert order.is_contiguous() and order.shape == (7, m)
    for g in range(7):  # active tokens first, each partition in token order
        active = order[g, : counts[g]].cpu()
        assert bool(mask[active.long(), g].all())
        assert torch.equal(active, torch.sort(active).values)


def test_l2_flush_buffer_is_writable_after_a_first_call_in_inference_mode():
    """The autotuner's flush buffer, first made inside ``torch.inference_mode`` (a generation's
    first decode step), must stay writable in place outside it (a later shape's autotuning)."""

    tuning._FLUSH.pop("cpu", None)
    with torch.inference_mode():
        buf = tuning.l2_flush_buffer("cpu")
    assert not buf.is_inference()
    buf[:8].zero_()  # an inference tensor raises here
    with torch.inference_mode():
        tuning.l2_flush_buffer("cpu")[:8].bitwise_not_()
    assert tuning.l2_flush_buffer("cpu") is buf and int(buf[0]) == 255
    tuning._FLUSH.pop("cpu")


@pytest.mark.parametrize("m", [1000, 9000])  # one pass; two passes
def test_routing_layout_reads_any_nonzero_byte_as_active(m):
    """A byte mask (not bool) with other nonzero values than 1: the same layout as its bool mask."""
    mask = random_mask(m, 5, 0.5, seed=3)
    as_bytes = mask.to(torch.uint8) * 3
    for a, b in zip(triton_routing_layout(as_bytes), torch_routing_layout(mask), strict=True):
        assert torch.equal(a.cpu(), b.cpu())


@pytest.mark.parametrize(("b", "t", "g"), [(1, 1, 8), (2, 17, 3), (3, 40, 8), (2, 1100, 5)])
@pytest.mark.parametrize("sparsity", SPARSITIES)
def test_batched_layout_matches_reference_exactly(b, t, g, sparsity):
    """The prefill attention's layout (per sequence and head group) from the routing layout's
    kernel: bit for bit the reference's, for sequences with different masks, T over one block
    (1100 > 1024), a non-contiguous mask."""
    from compresskit_wide.kernels.layout import torch_batched_layout, triton_batched_layout

    mask = torch.stack([random_mask(t, g, sparsity, seed=t + i) for i in range(b)])  # [B, T, G]
    if b == 3:
        mask = mask.transpose(1, 2).contiguous().transpose(1, 2)  # same values, other strides
    got, ref = triton_batched_layout(mask), torch_batched_layout(mask)
    for x, y in zip(got, ref, strict=True):
        assert x.dtype == y.dtype and x.shape == y.shape and torch.equal(x.cpu(), y.cpu())
    for i in range(b):  # each sequence is its own routing layout
        assert torch.equal(got[0][i].cpu(), torch_routing_layout(mask[i])[0].cpu())
    with pytest.raises(ValueError, match=r"mask must be \[B, T, G\], got \(4, 2\)"):
        triton_batched_layout(torch.ones(4, 2, dtype=torch.bool, device=DEVICE))


@pytest.mark.parametrize("m", [1, 2, 3, 16, 17, 40])
@pytest.mark.parametrize("sparsity", SPARSITIES)
@pytest.mark.parametrize("g", [7, 112])
def test_decode_layout_matches_reference_exactly(m, sparsity, g):
    from compresskit_wide.kernels.layout import torch_decode_layout, triton_decode_layout

    mask = random_mask(m, g, sparsity, seed=m * g)
    got, ref = triton_decode_layout(mask), torch_decode_layout(mask)
    for a, b in zip(got, ref, strict=True):
        assert a.dtype == b.dtype and torch.equal(a.cpu(), b.cpu())
    # the same as the full layout's last two entries
    for a, b in zip(got, torch_routing_layout(mask)[2:], strict=True):
        assert torch.equal(a.cpu(), b.cpu())


@pytest.mark.parametrize(
    ("m", "k", "n", "groups"),
    [(1, 40, 64, 2), (3, 64, 96, 3), (16, 48, 64, 4), (17, 48, 64, 4), (9, 72, 48, 1), (33, 32, 256, 2)],
)
@pytest.mark.parametrize("sparsity", SPARSITIES)
@pytest.mark.parametrize("fuse", [False, True])
@pytest.mark.parametrize("swap_ab", [False, True])  # decode sizes: the weight tile as the MMA's rows
def test_masked_out_gemm_matches_reference(m, k, n, groups, sparsity, fuse, swap_ab):
    if swap_ab and m > tuning.DECODE_MAX_M:
        pytest.skip("the operand order is a decode kernel's option")
    gen = torch.Generator().manual_seed(m * 7 + n)
    x = torch.randn(m, k, generator=gen).to(DEVICE)
    w = torch.randn(n, k, generator=gen).to(DEVICE)
    w_up = torch.randn(n, k, generator=gen).to(DEVICE) if fuse else None
    mask = random_mask(m, groups, sparsity, seed=m + groups)
    # poison the output and a guard region after it: every element of out must be written,
    # nothing beyond it
    buf = torch.full((m + 2, n), float("nan"), device=DEVICE)
    got = triton_masked_out_gemm(x, w, mask, w_up, out=buf[:m], block_m=16, block_n=16, block_k=16, swap_ab=swap_ab)
    ref = torch_masked_out_gemm(x, w, mask, w_up)
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)  # fp32 accumulation both sides
    inactive = ~mask.repeat_interleave(n // groups, dim=-1)
    assert torch.count_nonzero(got[inactive]) == 0  # inactive groups are exactly zero
    assert torch.isnan(buf[m:]).all()


@pytest.mark.parametrize("tile_order", ["group", "interleaved"])
@pytest.mark.parametrize("fuse", [False, True])
def test_masked_out_gemm_tile_orders_agree(tile_order, fuse):
    """Both launch orders of the prefill kernel (a group's tiles together, the default; the group
    fastest) write every element, the same values, on a group spanning several tiles, K not a
    multiple of the K step (40 of 16)."""
    m, k, n, groups = 45, 40, 96, 3
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(m, k, generator=gen).to(DEVICE)
    w = torch.randn(n, k, generator=gen).to(DEVICE)
    w_up = torch.randn(n, k, generator=gen).to(DEVICE) if fuse else None
    mask = random_mask(m, groups, 0.5, seed=11)
    buf = torch.full((m + 2, n), float("nan"), device=DEVICE)
    got = triton_masked_out_gemm(
        x, w, mask, w_up, out=buf[:m], block_m=16, block_n=16, block_k=16, tile_order=tile_order
    )
    torch.testing.assert_close(got, torch_masked_out_gemm(x, w, mask, w_up), rtol=1e-4, atol=1e-4)
    assert torch.isnan(buf[m:]).all()
    with pytest.raises(ValueError, match="tile_order"):
        triton_masked_out_gemm(x, w, mask, w_up, tile_order="random")


@pytest.mark.skipif(DEVICE != "cuda", reason="bf16 dot products need a GPU (the CPU interpreter computes in numpy)")
@pytest.mark.parametrize("fuse", [False, True])
@pytest.mark.parametrize("m", [1, 13, 300])
def test_masked_out_gemm_bf16_autotuned(fuse, m):
    """The autotuned tiles (decode and prefill kernels) on a GPU, in bf16; tolerance: bf16 output
    rounding of values of size ~sqrt(K)."""
    x = torch.randn(m, 256, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(512, 256, device="cuda", dtype=torch.bfloat16)
    w_up = torch.randn(512, 256, device="cuda", dtype=torch.bfloat16) if fuse else None
    mask = random_mask(m, 4, 0.5)
    buf = torch.full((m + 2, 512), float("nan"), device="cuda", dtype=torch.bfloat16)
    ref = torch_masked_out_gemm(x, w, mask, w_up)
    for swap_ab in (False, True) if m <= tuning.DECODE_MAX_M else (None,):
        buf.fill_(float("nan"))
        got = triton_masked_out_gemm(x, w, mask, w_up, out=buf[:m], swap_ab=swap_ab)
        torch.testing.assert_close(got.float(), ref.float(), rtol=2e-2, atol=2e-1 if fuse else 2e-2 * 16)
        assert torch.count_nonzero(got[~mask.repeat_interleave(128, dim=-1)]) == 0
        assert torch.isnan(buf[m:]).all()


@pytest.mark.skipif(DEVICE != "cuda", reason="bf16 dot products need a GPU (the CPU interpreter computes in numpy)")
@pytest.mark.parametrize("m", [1, 4, 16])
def test_masked_reduce_gemm_bf16_autotuned(m):
    from compresskit_wide.kernels.gemm_reduce import torch_masked_reduce_gemm, triton_masked_reduce_gemm

    x = torch.randn(m, 1024, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(384, 1024, device="cuda", dtype=torch.bfloat16) / 32
    mask = random_mask(m, 8, 0.5)
    ref = torch_masked_reduce_gemm(x, w, mask)
    for variant, swap_ab in (("loop", False), ("loop", True), ("unrolled", False), ("fused", False), ("fused", True)):
        got = triton_masked_reduce_gemm(x, w, mask, variant=variant, swap_ab=swap_ab)
        torch.testing.assert_close(got.float(), ref.float(), rtol=2e-2, atol=2e-2)
    with pytest.raises(
        ValueError, match="variant 'fast' is not available; allowed: loop, unrolled, fused, packed, direct"
    ):
        triton_masked_reduce_gemm(x, w, mask, variant="fast")
    from compresskit_wide.kernels.gemm_reduce import group_major

    wg = group_major(w, 8)
    got = triton_masked_reduce_gemm(x, w, mask, variant="unrolled", w_group_major=wg)
    torch.testing.assert_close(got.float(), ref.float(), rtol=2e-2, atol=2e-2)
    with pytest.raises(ValueError, match="w_group_major must be a contiguous"):
        triton_masked_reduce_gemm(x, w, mask, variant="unrolled", w_group_major=wg.transpose(1, 2))


def test_dispatch():
    x = torch.randn(5, 32, device=DEVICE)
    w = torch.randn(64, 32, device=DEVICE)
    mask = random_mask(5, 4, 0.5)
    ref = torch_masked_out_gemm(x, w, mask)
    for backend in ("torch", "triton", "auto"):
        torch.testing.assert_close(kernels.masked_out_gemm(x, w, mask, backend=backend), ref, rtol=1e-4, atol=1e-4)
    layout = kernels.routing_layout(mask, backend="triton")
    torch.testing.assert_close(
        kernels.masked_out_gemm(x, w, mask, layout=layout, backend="triton"), ref, rtol=1e-4, atol=1e-4
    )
    with pytest.raises(ValueError, match="allowed: auto, torch, triton"):
        kernels.masked_out_gemm(x, w, mask, backend="cuda")


def test_triton_backend_refuses_clearly_when_it_cannot_run(monkeypatch):
    monkeypatch.setattr(kernels, "triton_available", lambda: "no CUDA device")
    with pytest.raises(KernelUnavailableError, match="backend 'triton': no CUDA device"):
        kernels.routing_layout(torch.ones(2, 2, dtype=torch.bool), backend="triton")
    # auto falls back to the reference
    assert kernels.routing_layout(torch.ones(2, 2, dtype=torch.bool), backend="auto")[1].tolist() == [2, 2]


@pytest.mark.parametrize(
    ("m", "k", "n", "groups"),
    [(1, 64, 48, 4), (2, 96, 32, 3), (5, 128, 64, 2), (17, 64, 40, 4), (16, 256, 16, 8), (3, 72, 32, 3)],
)
@pytest.mark.parametrize("sparsity", SPARSITIES)
@pytest.mark.parametrize(
    ("split", "variant"),
    [(1, "loop"), (3, "loop"), (1, "unrolled"), (3, "unrolled"), (1, "fused"), (3, "fused")],
)
@pytest.mark.parametrize("swap_ab", [False, True])  # the weight tile as the MMA's rows
def test_masked_reduce_gemm_matches_reference(m, k, n, groups, sparsity, split, variant, swap_ab):
    if swap_ab and variant == "unrolled":
        pytest.skip("the unrolled variant has one operand order")
    from compresskit_wide.kernels.gemm_reduce import torch_masked_reduce_gemm, triton_masked_reduce_gemm

    gen = torch.Generator().manual_seed(m * 5 + k)
    x = torch.randn(m, k, generator=gen).to(DEVICE)
    w = torch.randn(n, k, generator=gen).to(DEVICE)
    mask = random_mask(m, groups, sparsity, seed=k + m)
    buf = torch.full((m + 2, n), float("nan"), device=DEVICE)
    # block_k 16 < group width: each group spans several K blocks of the loop; the unrolled variant
    # takes a group in one tile
    # split 3: three programs share each output block's active groups (some get none at all)
    got = triton_masked_reduce_gemm(
        x, w, mask, out=buf[:m], block_m=16, block_n=16, block_k=16, split=split, variant=variant, swap_ab=swap_ab
    )
    ref = torch_masked_reduce_gemm(x, w, mask)
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)
    if variant == "unrolled":  # the same from the group-major copy of the weight
        from compresskit_wide.kernels.gemm_reduce import group_major

        wg = group_major(w, groups)
        assert torch.equal(wg[1 % groups], w[:, (1 % groups) * (k // groups) : (1 % groups + 1) * (k // groups)])
        again = triton_masked_reduce_gemm(x, w, mask, block_n=16, split=split, variant=variant, w_group_major=wg)
        torch.testing.assert_close(again, ref, rtol=1e-4, atol=1e-4)
        with pytest.raises(ValueError, match="swap_ab is for the loop and fused variants only"):
            triton_masked_reduce_gemm(x, w, mask, block_n=16, variant=variant, swap_ab=True)
    if variant == "fused":  # its tickets are back at zero for the next call, which agrees
        from compresskit_wide.kernels.gemm_reduce import zeroed_tickets

        assert torch.count_nonzero(zeroed_tickets(x.device, 1)) == 0
        again = triton_masked_reduce_gemm(
            x, w, mask, block_m=16, block_n=16, block_k=16, split=split, variant=variant, swap_ab=swap_ab
        )
        torch.testing.assert_close(again, ref, rtol=1e-4, atol=1e-4)
    if sparsity == 1.0:
        assert torch.count_nonzero(got) == 0  # no active group: nothing contributes
    assert torch.isnan(buf[m:]).all()


def test_reduce_dispatch_prefill_uses_the_dense_product():
    x = torch.randn(40, 64, device=DEVICE)
    w = torch.randn(32, 64, device=DEVICE)
    mask = random_mask(40, 4, 0.5)
    ref = kernels.torch_masked_reduce_gemm(x, w, mask)
    for backend in ("auto", "torch", "triton"):
        torch.testing.assert_close(kernels.masked_reduce_gemm(x, w, mask, backend=backend), ref, rtol=1e-4, atol=1e-4)
    # the prefill path: masking then cuBLAS in the input dtype; with an input that is zero-filled
    # already (as the fused SwiGLU kernel leaves it), the plain dense product is the same
    torch.testing.assert_close(kernels.dense_masked_reduce_gemm(x, w, mask), ref, rtol=1e-4, atol=1e-4)
    zero_filled = kernels.torch_group_masked_input(x, mask)
    torch.testing.assert_close(
        kernels.dense_masked_reduce_gemm(zero_filled, w, mask, input_is_masked=True), ref, rtol=1e-4, atol=1e-4
    )
    # ... whereas trusting an input that is not zero-filled would be wrong: the flag matters
    assert not torch.allclose(kernels.dense_masked_reduce_gemm(x, w, mask, input_is_masked=True), ref)


def finalized_wide_model(tiny_model_dir):
    """The tiny model with WIDE's (untrained) routers attached and finalized, its tokenizer and the
    pruner."""
    from compresskit import plugins
    from compresskit.interfaces import RunContext
    from compresskit.modeling import load_model

    model, tok = load_model(str(tiny_model_dir), dtype="float32", device=DEVICE)
    cls = plugins.load("pruner", "wide")
    pruner = cls(cls.Config(ffn_group_size=16, router_rank=8))
    pruner.prepare(model, RunContext(model_config=model.config, device=torch.device(DEVICE)))
    return pruner.finalize(model), tok, pruner


def test_wide_triton_executor_matches_the_reference_path(tiny_model_dir, tmp_path, monkeypatch):
    import copy
    import json

    from compresskit import plugins
    from compresskit_wide.executor import KernelMLP, KernelQ, KernelReduce

    model, tok, _ = finalized_wide_model(tiny_model_dir)
    fast = copy.deepcopy(model)
    executor = plugins.load("executor", "wide-triton")(plugins.load("executor", "wide-triton").Config(backend="triton"))
    executor.check(fast)
    fast = executor.convert(fast)
    assert sum(isinstance(m, KernelMLP) for m in fast.modules()) == 2
    assert sum(isinstance(m, KernelQ) for m in fast.modules()) == 2
    assert fast.config._attn_implementation == "wide_routed"
    ids = torch.randint(2, 300, (3, 11), generator=torch.Generator().manual_seed(0)).to(DEVICE)
    calls = []
    real = kernels.triton_routed_attention_prefill
    monkeypatch.setattr(kernels, "triton_routed_attention_prefill", lambda *a, **k: calls.append(1) or real(*a, **k))
    # o_proj's product goes through the reduction's dispatch, told whether its input is zero in the
    # skipped heads already (after a routed attention) or not (after SDPA); its own masker never runs
    zeroed, maskings = [], []
    real_reduce = KernelReduce.forward
    monkeypatch.setattr(KernelReduce, "forward", lambda self, x, m, z: zeroed.append(z) or real_reduce(self, x, m, z))
    for layer in fast.model.layers:
        o_proj = layer.self_attn.o_proj
        assert isinstance(o_proj.fast_product, KernelReduce)
        o_proj.masker = lambda x, m, real_masker=o_proj.masker: maskings.append(1) or real_masker(x, m)
    with torch.no_grad():
        torch.testing.assert_close(fast(ids).logits, model(ids).logits, rtol=1e-4, atol=1e-4)
    assert len(calls) == 2  # the routed prefill attention ran in both layers
    assert zeroed == [True, True] and maskings == []
    # a padded batch needs an attention mask: the routed function hands it to SDPA, same result
    # (o_proj then zeroes the skipped heads itself)
    pad = torch.ones_like(ids)
    pad[1, :4] = 0
    with torch.no_grad():
        got, ref = fast(ids, attention_mask=pad).logits, model(ids, attention_mask=pad).logits
    torch.testing.assert_close(got[pad.bool()], ref[pad.bool()], rtol=1e-4, atol=1e-4)
    assert zeroed[2:] == [False, False] and maskings == []
    # the saved configuration names no attention implementation of ours
    assert "wide_routed" not in json.dumps(fast.config.to_dict())
    # cached decoding through the kernels (M = 1 per step) gives the same tokens
    decode_calls = []
    real_decode = kernels.triton_routed_attention_decode
    monkeypatch.setattr(
        kernels, "triton_routed_attention_decode", lambda *a, **k: decode_calls.append(1) or real_decode(*a, **k)
    )
    with torch.no_grad():
        a = fast.generate(ids[:1, :5], max_new_tokens=4, do_sample=False, pad_token_id=1)
        b = model.generate(ids[:1, :5], max_new_tokens=4, do_sample=False, pad_token_id=1)
    assert torch.equal(a, b)
    assert len(decode_calls) == 2 * 3  # the routed decode attention ran in both layers for each cached step


@pytest.mark.parametrize("attention", ["routed", "sdpa"])
def test_dense_q_leaves_inactive_heads_unzeroed_and_nothing_reads_them(tiny_model_dir, monkeypatch, attention):
    """Where the dense q product is the path taken (under "auto" on a GPU, 17 to 4,095 tokens), q's
    inactive heads keep their dense values: nothing reads them. The routed attention gathers the
    active heads' queries only ("routed": its kernels, after which o_proj skips its masking);
    after SDPA ("sdpa": a padded batch is not covered) the routed o_proj zeroes those heads' outputs.
    Poisoning the inactive heads' queries with large values leaves the logits those of the
    reference."""
    import copy

    from compresskit import plugins
    from compresskit_wide.executor import KernelQ

    model, _, _ = finalized_wide_model(tiny_model_dir)
    executor_cls = plugins.load("executor", "wide-triton")
    fast = executor_cls(executor_cls.Config(backend="triton")).convert(copy.deepcopy(model))
    real_choose = kernels._choose
    monkeypatch.setattr(  # q takes the dense path, as "auto" does on a GPU between decode and 4,096 tokens
        kernels, "_choose", lambda backend, op, *a, **k: "dense" if op == "out" else real_choose(backend, op, *a, **k)
    )
    seen = []
    for module in fast.modules():
        if isinstance(module, KernelQ):

            def poisoned(x, real=module.forward, q=module):
                y = real(x)
                heads_on = q.o_proj._mask.bool().repeat_interleave(y.shape[-1] // q.o_proj._mask.shape[-1], dim=-1)
                seen.append(bool((y[~heads_on] != 0).any()))  # the dense values were left there
                return torch.where(heads_on, y, torch.full_like(y, 1e4))

            module.forward = poisoned
    ids = torch.randint(2, 300, (3, 11), generator=torch.Generator().manual_seed(4)).to(DEVICE)
    pad = torch.ones_like(ids)
    pad[1, :4] = 0
    kwargs = {"attention_mask": pad} if attention == "sdpa" else {}
    with torch.no_grad():
        got, ref = fast(ids, **kwargs).logits, model(ids, **kwargs).logits
    rows = pad.bool() if attention == "sdpa" else slice(None)
    torch.testing.assert_close(got[rows], ref[rows], rtol=1e-4, atol=1e-4)
    assert seen and all(seen)


def test_wide_triton_executor_auto_keeps_sdpa_where_the_routed_attention_is_not_faster(tiny_model_dir, monkeypatch):
    """Under "auto" the routed attention runs only where the policy says so (on CUDA, decode with a
    batch >= 4 and a long context); elsewhere transformers' SDPA runs and o_proj zeroes the skipped
    heads, as in the reference path: the same logits, no routed attention call."""
    import copy

    from compresskit import plugins

    model, _, _ = finalized_wide_model(tiny_model_dir)
    executor_cls = plugins.load("executor", "wide-triton")
    fast = executor_cls(executor_cls.Config(backend="auto")).convert(copy.deepcopy(model))
    calls = []
    for name in ("routed_attention_decode", "routed_attention_prefill"):
        monkeypatch.setattr(kernels, name, lambda *a, **k: calls.append(1))
    ids = torch.randint(2, 300, (2, 9), generator=torch.Generator().manual_seed(1)).to(DEVICE)
    with torch.no_grad():
        torch.testing.assert_close(fast(ids).logits, model(ids).logits, rtol=1e-4, atol=1e-4)
    assert calls == []


def test_wide_triton_executor_without_stats_gives_the_same_logits_and_counts_nothing(tiny_model_dir):
    """``track_stats: false`` (serving) changes no output; the realised sparsity is then not
    counted, while the default keeps counting it."""
    import copy

    from compresskit import plugins
    from compresskit.routing import routed_projections

    model, _, pruner = finalized_wide_model(tiny_model_dir)
    executor_cls = plugins.load("executor", "wide-triton")
    counted = executor_cls(executor_cls.Config(backend="torch")).convert(copy.deepcopy(model))
    silent = executor_cls(executor_cls.Config(backend="torch", track_stats=False)).convert(copy.deepcopy(model))
    ids = torch.randint(2, 300, (1, 7), generator=torch.Generator().manual_seed(3)).to(DEVICE)
    with torch.no_grad():
        torch.testing.assert_close(silent(ids).logits, counted(ids).logits, rtol=0, atol=0)
    assert all(p.stat_tokens.item() == 7 for _, p in routed_projections(counted) if p.router is not None)
    assert all(p.stat_tokens.item() == 0 and p.stat_skipped.item() == 0 for _, p in routed_projections(silent))
    assert pruner.sparsity(silent) is None  # not measured, rather than a realised sparsity of 0
    assert pruner.sparsity(counted).tokens == 7


def test_wide_triton_executor_refuses_unmerged_lora_and_dense_models(tiny_model_dir):
    from compresskit import plugins
    from compresskit.interfaces import RunContext
    from compresskit.modeling import load_model
    from compresskit.trainers import LoraStageConfig, inject_lora

    exe = plugins.load("executor", "wide-triton")()
    model, _ = load_model(str(tiny_model_dir), dtype="float32", device=DEVICE)
    with pytest.raises(KernelUnavailableError, match="no WIDE-routed FFN"):
        exe.check(model)
    cls = plugins.load("pruner", "wide")
    pruner = cls(cls.Config(ffn_group_size=16, router_rank=8))
    pruner.prepare(model, RunContext(model_config=model.config, device=torch.device(DEVICE)))
    inject_lora(model, LoraStageConfig(r=2, alpha=4))
    with pytest.raises(KernelUnavailableError, match="merge LoRA first"):
        exe.check(model)


def test_recipe_with_the_wide_triton_executor(tiny_model_dir, tmp_path):
    from compresskit.api import apply

    def recipe(executor, out):
        return {
            "model": {"name_or_path": str(tiny_model_dir), "dtype": "float32", "device": DEVICE},
            "pruner": {"name": "wide", "config": {"ffn_group_size": 16, "router_rank": 8}},
            "executor": executor,
            "evaluation": {"tasks": ["piqa"], "limit": 4, "batch_size": 4, "max_length": 512, "compare_dense": False},
            "output": {"dir": str(tmp_path / out)},
        }

    ref = apply(recipe({"name": "torch"}, "ref")).results
    fast = apply(recipe({"name": "wide-triton", "config": {"backend": "triton"}}, "fast")).results
    assert fast["metrics"] == ref["metrics"]
    assert fast["sparsity"]["macs"] == ref["sparsity"]["macs"]
    assert fast["recipe"]["executor"]["name"] == "wide-triton"


@pytest.mark.slow
def test_benchmark_script_smoke(tmp_path):
    """The H200 benchmark script runs end to end on tiny shapes and checks every case; a case run
    alone draws what it draws among the others."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).parents[2] / "benchmarks" / "bench_wide_kernels.py"
    env = {**os.environ, "TRITON_INTERPRET": "1"} if DEVICE == "cpu" else dict(os.environ)
    proc = subprocess.run(
        [sys.executable, str(script), "--smoke", "--out", str(tmp_path)], capture_output=True, text=True, env=env
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    data = json.loads((tmp_path / "bench.json").read_text())
    assert data["results"] and all(r["correct"] for r in data["results"])
    assert (tmp_path / "bench.md").read_text().startswith("# WIDE kernels benchmark")
    # a case alone (--only) draws the same masks and inputs as among all the others (seeded by its
    # label): the same bound (the mask's) and, in the interpreter's fixed tiles, the same error (on a
    # GPU the two processes may autotune other tiles, which round differently)
    alone = tmp_path / "alone"
    proc = subprocess.run(
        [sys.executable, str(script), "--smoke", "--out", str(alone), "--only", r"^(q|gate\+up) M=3 iid"],
        capture_output=True,
        text=True,
        env=env,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    key = lambda r: (r["op"], r["M"], r["mask"])  # noqa: E731
    fields = ("bound", "max_abs_err") if DEVICE == "cpu" else ("bound",)
    full = {key(r): [r[f] for f in fields] for r in data["results"]}
    rows = json.loads((alone / "bench.json").read_text())["results"]
    assert rows and all(full[key(r)] == [r[f] for f in fields] for r in rows)


def test_packed_reduction_pruner_keeps_tiles_that_compile_within_shared_memory(tmp_path):
    """The listed packed reduction unrolls a group's K steps, each with its own buffers: every tile
    its autotuner hook keeps (bf16, 4 groups a step) compiles for sm_90 within the H200's shared
    memory at o_proj's 512 inputs a group and at down's 128, at 4 and 16 tokens (a tile of 256 KB
    got through at o's width and 16 tokens before the hook counted the steps, run 66), and at down's
    width with 4 tokens the whole table is kept (the tiles measured there). The direct variant's
    flat loop keeps its whole table at both widths. (``hopper_codegen.py --reduce-tiles``.)"""
    import json
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).parents[2] / "benchmarks" / "hopper_codegen.py"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # the compiler, not the interpreter
    out = tmp_path / "tiles.json"
    proc = subprocess.run(
        [sys.executable, str(script), "--reduce-tiles", "--json", str(out)], capture_output=True, text=True, env=env
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = json.loads(out.read_text())
    cases = {(r["variant"], r["group_width"], r["tokens"]) for r in rows}
    assert cases == {(v, gw, m) for v in ("listed", "direct") for gw in (512, 128) for m in (4, 16)}
    kept = [r for r in rows if r["kept"]]
    assert {(r["variant"], r["group_width"], r["tokens"]) for r in kept} == cases  # something kept everywhere
    assert all(r["shared"] <= 232448 for r in kept)
    assert all(r["kept"] for r in rows if (r["variant"], r["group_width"], r["tokens"]) == ("listed", 128, 4))
    assert all(r["kept"] for r in rows if r["variant"] == "direct")


def test_decode_kernels_compile_for_hopper(tmp_path):
    """benchmarks/hopper_codegen.py, on any machine: the decode defaults (q and down packed, gate+up,
    down fused, o with its group list and without) compiled for sm_90 at Llama-3.1-8B's shapes and
    the H200's tiles use the warp-group MMA (the decode attention's split kernel the older one),
    stream their operands through a software pipeline, fit the H200's shared memory and spill no
    registers. The check sees an unpipelined
    kernel (one stage) as one."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).parents[2] / "benchmarks" / "hopper_codegen.py"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # the compiler, not the interpreter
    out = tmp_path / "codegen.json"
    proc = subprocess.run([sys.executable, str(script), "--json", str(out)], capture_output=True, text=True, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = json.loads(out.read_text())
    assert [r["mma"] for r in rows] == ["wgmma"] * 6 + ["mma"]
    assert all(r["async_copies"] > 0 and not r["problems"] for r in rows)
    assert all(r["spill_bytes"] == 0 and 0 < r["registers"] <= 255 for r in rows)
    one_stage = (
        "import runpy, sys; g = runpy.run_path(sys.argv[1]); name, k, a, c, w, s, mma = g['cases']()[0]; "
        "print(g['compile_for_hopper'](k, a, c, w, 1)['async_copies'])"
    )
    proc = subprocess.run([sys.executable, "-c", one_stage, str(script)], capture_output=True, text=True, env=env)
    assert proc.returncode == 0 and proc.stdout.split()[-1] == "0", proc.stdout + proc.stderr
    proc = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, env={**env, "TRITON_INTERPRET": "1"}
    )
    assert proc.returncode == 2 and "replaces Triton's compiler" in proc.stderr


@pytest.mark.slow
def test_decode_sweep_script_smoke(tmp_path):
    """benchmarks/sweep_wide_decode.py runs on tiny shapes: both operand orders of every decode
    product, each checked against its reference; a clear error without a GPU and --smoke."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).parents[2] / "benchmarks" / "sweep_wide_decode.py"
    env = {**os.environ, "TRITON_INTERPRET": "1"} if DEVICE == "cpu" else dict(os.environ)
    proc = subprocess.run(
        [sys.executable, str(script), "--smoke", "--out", str(tmp_path)], capture_output=True, text=True, env=env
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = json.loads((tmp_path / "sweep.json").read_text())["rows"]
    assert {r["case"].split(" M=")[0] for r in rows} == {"gate+up", "q", "down", "o"}
    assert {r["variant"].split()[0] for r in rows} == {"swap_ab=False", "swap_ab=True"}
    packed = {(r["case"].split(" M=")[0], r["variant"]) for r in rows if "k_pack" in r["variant"]}
    want = {(op, f"swap_ab=True k_pack={p}") for op in ("gate+up", "q") for p in tuning.OUT_DECODE_PACKED}
    reduce = {
        (op, f"swap_ab=True k_pack={p}{s}")
        for op in ("down", "o")
        for s in ("", " direct")
        for p in tuning.REDUCE_DECODE_PACKED
    }
    assert packed == want | reduce
    assert all(r["correct"] for r in rows)
    if DEVICE == "cpu":
        proc = subprocess.run([sys.executable, str(script), "--out", str(tmp_path)], capture_output=True, text=True)
        assert proc.returncode == 2 and "no CUDA device here" in proc.stderr


@pytest.mark.slow
def test_host_overhead_script_runs():
    """benchmarks/bench_wide_host.py: the four rows, dense first, WIDE's routed modules running
    more operators per layer than dense."""
    import re
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).parents[2] / "benchmarks" / "bench_wide_host.py"
    cmd = [sys.executable, str(script), "--layers", "2", "--prompt", "5", "--repeats", "2"]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    extra = [float(x) for x in re.findall(r"\(\s*([+-][0-9.]+) a layer vs dense\)", proc.stdout)]
    assert len(extra) == 4 and extra[0] == 0.0 and all(x > 0 for x in extra[1:]), proc.stdout


def test_end_to_end_benchmark_script_smoke(tmp_path):
    """The end-to-end script runs on tiny shapes: dense, WIDE masked dense, wide-triton auto and
    triton (and auto without sparsity counting), each converted model checked layer by layer
    against the masked dense reference, realised sparsity reported where counted, and the
    static-cache decode steps and the prefill (eager on the CPU, CUDA graphs on a GPU) run without
    error."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).parents[2] / "benchmarks" / "bench_wide_e2e.py"
    env = {**os.environ, "TRITON_INTERPRET": "1"} if DEVICE == "cpu" else dict(os.environ)
    cmd = [sys.executable, str(script), "--smoke", "--out", str(tmp_path)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = json.loads((tmp_path / "e2e.json").read_text())["results"]
    assert [r["model"] for r in rows] == [
        "dense",
        "WIDE, torch (masked dense)",
        "WIDE, wide-triton auto",
        "WIDE, wide-triton triton",
        "WIDE, wide-triton auto, no stats",
    ]
    assert all(r["correct"] and r["graph_error"] is None and r["graph_prefill_error"] is None for r in rows)
    # the converted layers against the masked dense reference: fp32 on the CPU, bf16 on a GPU (the
    # script's own tolerances; a wiring error moves a layer by far more)
    assert all(r["layer_max_rel_err_vs_masked_dense"] < (1e-4 if DEVICE == "cpu" else 2e-2) for r in rows[2:])
    assert all(0.3 < r["sparsity"]["macs"] < 0.7 for r in rows[1:4])  # untrained routers: about half
    assert rows[4]["sparsity"] is None  # not counted
    # the prefill profile: wall time per prompt always; kernels only on a GPU
    assert all(r["prefill_profile"]["wall_ms_per_call"] > 0 for r in rows)
    assert all(r["prefill_profile"]["top_host_ops_self_us_per_call"] for r in rows)
    assert all((r["prefill_profile"]["kernels_per_call"] > 0) == (DEVICE == "cuda") for r in rows)


@pytest.mark.parametrize(
    ("b", "hq", "hkv", "d", "s", "groups"),
    [(2, 6, 2, 16, 7, 2), (2, 6, 2, 16, 33, 3), (1, 8, 2, 32, 100, 4), (3, 4, 4, 16, 1, 4), (2, 8, 2, 16, 64, 2)],
)
@pytest.mark.parametrize("sparsity", SPARSITIES)
@pytest.mark.parametrize("splits", [1, 3])
def test_routed_attention_decode_matches_reference(b, hq, hkv, d, s, groups, sparsity, splits):
    from compresskit_wide.kernels.attention_decode import torch_routed_attention_decode, triton_routed_attention_decode

    gen = torch.Generator().manual_seed(b * 100 + s)
    q = torch.randn(b, hq, d, generator=gen).to(DEVICE)
    k = torch.randn(b, hkv, s, d, generator=gen).to(DEVICE)
    v = torch.randn(b, hkv, s, d, generator=gen).to(DEVICE)
    lens = torch.randint(1, s + 1, (b,), generator=gen).to(DEVICE)  # ragged cache lengths
    mask = random_mask(b, groups, sparsity, seed=s + groups)  # B > 1 with different masks
    got = triton_routed_attention_decode(q, k, v, lens, mask, splits=splits)
    ref = torch_routed_attention_decode(q, k, v, lens, mask)
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)
    heads_off = ~mask.repeat_interleave(hq // groups, dim=-1)
    assert torch.count_nonzero(got[heads_off]) == 0


def test_attention_decode_reads_no_kv_for_inactive_groups():
    """With every group off, K and V may be garbage (NaN): nothing reads them."""
    from compresskit_wide.kernels.attention_decode import triton_routed_attention_decode

    q = torch.randn(2, 6, 16, device=DEVICE)
    k = torch.full((2, 2, 40, 16), float("nan"), device=DEVICE)
    v = torch.full((2, 2, 40, 16), float("nan"), device=DEVICE)
    mask = torch.zeros(2, 2, dtype=torch.bool, device=DEVICE)
    out = triton_routed_attention_decode(q, k, v, torch.tensor([40, 13], device=DEVICE), mask)
    assert torch.count_nonzero(out) == 0 and not torch.isnan(out).any()
    # one group on in sequence 0: only its KV head is read; the other KV head may stay NaN
    k[:, 0] = torch.randn(2, 40, 16, device=DEVICE)
    v[:, 0] = torch.randn(2, 40, 16, device=DEVICE)
    mask[0, 0] = True
    out = triton_routed_attention_decode(q, k, v, torch.tensor([40, 13], device=DEVICE), mask)
    assert not torch.isnan(out).any() and torch.count_nonzero(out[0, :3]) > 0 and torch.count_nonzero(out[:, 3:]) == 0


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
def test_routed_attention_prefill_matches_reference(b, hq, hkv, d, t, past, groups, sparsity):
    """Default tiles (autotuned on a GPU) and fixed ones, with one query head a program and, where
    the heads of a group share a KV head, 2 or 4 (rows = tokens x heads)."""
    from compresskit_wide.kernels.attention_prefill import (
        torch_routed_attention_prefill,
        triton_routed_attention_prefill,
    )

    gen = torch.Generator().manual_seed(t * 10 + past)
    q = torch.randn(b, hq, t, d, generator=gen).to(DEVICE)
    k = torch.randn(b, hkv, past + t, d, generator=gen).to(DEVICE)
    v = torch.randn(b, hkv, past + t, d, generator=gen).to(DEVICE)
    mask = (torch.rand(b, t, groups, generator=gen) >= sparsity).to(DEVICE)
    ref = torch_routed_attention_prefill(q, k, v, mask)
    heads_off = ~mask.repeat_interleave(hq // groups, dim=-1).permute(0, 2, 1)  # [B, Hq, T]
    # default tiles (autotuned on a GPU), and fixed ones: key blocks of 16 and 32 behind 16 rows
    tiles = [{}, {"block_m": 16, "block_n": 16}, {"block_m": 16, "block_n": 32}]
    shared = math.gcd(hq // hkv, hq // groups)  # heads of one group and one KV head
    tiles += [
        {"block_m": bm, "block_n": 16, "heads_per_program": hp} for hp in (2, 4) if shared % hp == 0 for bm in (16, 32)
    ]
    for tile in tiles:
        got = triton_routed_attention_prefill(q, k, v, mask, **tile)
        torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)
        assert torch.count_nonzero(got[heads_off]) == 0
    if shared % 2:
        with pytest.raises(ValueError, match="heads_per_program=2 must be 1, 2 or 4 and divide the heads of a group"):
            triton_routed_attention_prefill(q, k, v, mask, block_m=16, heads_per_program=2)


def test_prefill_reference_equals_sdpa_when_all_on():
    from compresskit_wide.kernels.attention_prefill import torch_routed_attention_prefill

    q = torch.randn(2, 6, 9, 16)
    k = torch.randn(2, 2, 9, 16)
    v = torch.randn(2, 2, 9, 16)
    ref = torch.nn.functional.scaled_dot_product_attention(
        q, k.repeat_interleave(3, dim=1), v.repeat_interleave(3, dim=1), is_causal=True
    )
    got = torch_routed_attention_prefill(q, k, v, torch.ones(2, 9, 2, dtype=torch.bool))
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


# --- dense fallbacks and the "auto" policy --------------------------------------------------------


@pytest.mark.parametrize("fuse", [False, True])
@pytest.mark.parametrize("sparsity", SPARSITIES)
def test_dense_out_gemm_fallback_equals_reference(fuse, sparsity):
    from compresskit_wide.kernels.dense import dense_masked_out_gemm

    gen = torch.Generator().manual_seed(3)
    x = torch.randn(9, 48, generator=gen).to(DEVICE)
    w = torch.randn(96, 48, generator=gen).to(DEVICE)
    w_up = torch.randn(96, 48, generator=gen).to(DEVICE) if fuse else None
    mask = random_mask(9, 3, sparsity, seed=4)
    got = dense_masked_out_gemm(x, w, mask, w_up)
    torch.testing.assert_close(got, torch_masked_out_gemm(x, w, mask, w_up), rtol=1e-4, atol=1e-4)
    inactive = ~mask.repeat_interleave(32, dim=-1)
    assert torch.count_nonzero(got[inactive]) == 0
    # zero_inactive=False (a caller that never reads them): the dense product is left in the inactive
    # groups, the active ones are the same
    raw = dense_masked_out_gemm(x, w, mask, w_up, zero_inactive=False)
    dense = x @ w.T if w_up is None else torch.nn.functional.silu(x @ w.T) * (x @ w_up.T)
    torch.testing.assert_close(raw, dense, rtol=0, atol=0)
    torch.testing.assert_close(raw[~inactive], got[~inactive], rtol=0, atol=0)


@pytest.mark.parametrize("sparsity", SPARSITIES)
def test_dense_attention_fallbacks_equal_references(sparsity):
    from compresskit_wide.kernels.attention_decode import torch_routed_attention_decode
    from compresskit_wide.kernels.attention_prefill import torch_routed_attention_prefill
    from compresskit_wide.kernels.dense import dense_routed_attention_decode, dense_routed_attention_prefill

    gen = torch.Generator().manual_seed(5)
    b, hq, hkv, d, s = 3, 8, 2, 16, 37
    q = torch.randn(b, hq, d, generator=gen).to(DEVICE)
    k = torch.randn(b, hkv, s, d, generator=gen).to(DEVICE)
    v = torch.randn(b, hkv, s, d, generator=gen).to(DEVICE)
    lens = torch.tensor([37, 1, 20], dtype=torch.int32, device=DEVICE)  # ragged cache lengths
    mask = random_mask(b, 4, sparsity, seed=6)
    got = dense_routed_attention_decode(q, k, v, lens, mask)
    torch.testing.assert_close(got, torch_routed_attention_decode(q, k, v, lens, mask), rtol=1e-4, atol=1e-4)
    for t in (s, 5):  # no past (is_causal) and 32 positions of past (the shifted diagonal)
        qp = torch.randn(b, hq, t, d, generator=gen).to(DEVICE)
        pmask = random_mask(b * t, 4, sparsity, seed=t).reshape(b, t, 4)
        got = dense_routed_attention_prefill(qp, k, v, pmask)
        ref = torch_routed_attention_prefill(qp, k, v, pmask)
        torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)


def test_use_kernel_policy_ranges():
    from compresskit_wide.kernels.tuning import use_kernel

    assert all(use_kernel("swiglu", m) for m in (1, 2, 16, 512, 4096))
    assert [use_kernel("out", m) for m in (1, 2, 4, 16, 17, 512, 2048, 4096)] == [1, 1, 1, 1, 0, 0, 0, 1]
    assert [use_kernel("reduce", m) for m in (1, 2, 16, 4096)] == [1, 0, 0, 0]
    got = [use_kernel("reduce", m, groups=g) for m, g in ((2, 8), (16, 8), (2, 9), (17, 8), (2, 112))]
    assert got == [1, 1, 0, 0, 0]
    got = [use_kernel("reduce", m, groups=g, zeroed=True) for m, g in ((1, 112), (2, 112), (8, 8), (9, 8), (16, 8))]
    assert got == [1, 0, 1, 0, 0]
    assert use_kernel("attn_decode", 4, context=8192) and use_kernel("attn_decode", 1, context=32768)
    assert not use_kernel("attn_decode", 1, context=8192) and not use_kernel("attn_decode", 2, context=16384)
    assert not use_kernel("attn_decode", 16, context=1024)
    assert [use_kernel("attn_prefill", t) for t in (1, 512, 1023, 1024, 4096)] == [0, 0, 0, 1, 1]
    with pytest.raises(ValueError, match="unknown operator 'gemm'; known: swiglu, out, reduce"):
        use_kernel("gemm", 1)


def test_decode_split_k_default(monkeypatch):
    """The plain decode product shares K over 4 programs on a GPU up to 2 tokens; from 3 tokens, the
    fused SwiGLU, prefill sizes and the interpreter use one."""

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert [tuning.out_decode_split_k(m, False) for m in (1, 2, 3, 16, 17)] == [4, 4, 1, 1, 1]
    assert tuning.out_decode_split_k(1, True) == 1
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert tuning.out_decode_split_k(1, False) == 1


def test_decode_k_pack_default(monkeypatch):
    """q's decode product packs 4 chunks of K into one product on a GPU up to 4 tokens, 2 up to 16;
    prefill sizes, the fused SwiGLU and the interpreter do not pack. A split or the tokens as the
    MMA's rows, when asked for, leave it unpacked."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert [tuning.decode_k_pack(m, False) for m in (1, 2, 4, 5, 16, 17)] == [4, 4, 4, 2, 2, 1]
    assert tuning.decode_k_pack(1, True) == 1
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert tuning.decode_k_pack(1, False) == 1
    calls = []
    monkeypatch.setattr(tuning, "decode_k_pack", lambda m, fused: 4)
    import compresskit_wide.kernels.gemm_out as gemm_out

    monkeypatch.setattr(gemm_out, "_out_gemv_packed", lambda *a: calls.append("packed") or a[4])
    monkeypatch.setattr(gemm_out, "_out_gemv_split_k", lambda *a: calls.append("split") or a[3])
    x, w, mask = torch.randn(1, 64), torch.randn(32, 64), torch.ones(1, 2, dtype=torch.bool)
    triton_masked_out_gemm(x, w, mask)
    triton_masked_out_gemm(x, w, mask, split_k=2)
    assert calls == ["packed", "split"]


def test_reduce_variant_default(monkeypatch):
    """The reduction packs 4 groups a step on a GPU up to 4 tokens (8 groups or fewer: without a
    list, at every decode size), the fused variant for the other decode sizes and in the
    interpreter, the loop beyond."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    got = [tuning.reduce_variant(m, 112) for m in (1, 4, 5, 16, 17)]
    assert got == ["packed", "packed", "fused", "fused", "loop"]
    assert [tuning.reduce_variant(m, g) for m, g in ((1, 8), (4, 2), (4, 9), (16, 8), (5, 9), (17, 8))] == [
        "direct", "direct", "packed", "direct", "fused", "loop"
    ]  # fmt: skip
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert tuning.reduce_variant(1, 8) == "fused"


def test_packed_pruner_keeps_tiles_that_fit_shared_memory():
    """The packed kernels' autotuner hook: bf16 q keeps its whole table; fp32 gate+up, whose tiles
    overflow shared memory, gets the tiles that fit, or the smallest one with fewer stages; the
    packed reduction's bf16 table is kept whole at groups of 128, its blocks of K no wider than a
    group; at groups of 512, where the listed variant unrolls 4 to 8 K steps, the tiles whose steps
    fit."""

    def stage_bytes(c, elem, weights, pack, block_m):
        return c.kwargs["BLOCK_K"] * elem * pack * (c.kwargs["BLOCK_N"] * weights + block_m)

    for pack, table in tuning.OUT_DECODE_PACKED.items():
        rows = tuning.configs(table)
        bf16 = {"GW": 128, "x_ptr": torch.empty(1, dtype=torch.bfloat16)}
        kept = tuning.packed_pruner("BLOCK_N")(rows, bf16, FUSE_SWIGLU=False, K_PACK=pack, BLOCK_M=16 // pack)
        assert len(kept) == len(rows)
        fp32 = {"GW": 32, "x_ptr": torch.empty(1)}
        kept = tuning.packed_pruner("BLOCK_N")(rows, fp32, FUSE_SWIGLU=True, K_PACK=pack, BLOCK_M=8)
        assert kept and all(c.kwargs["BLOCK_N"] <= 32 for c in kept)
        assert all(
            c.num_stages * stage_bytes(c, 4, 2, pack, 8) <= tuning.PACKED_SMEM_BUDGET or c.num_stages == 1 for c in kept
        )
        rows = tuning.configs(tuning.REDUCE_DECODE_PACKED[pack])
        for unrolled in (False, True):
            prune = tuning.packed_pruner("BLOCK_K", unrolled_group=unrolled)
            assert len(prune(rows, bf16, K_PACK=pack, BLOCK_M=16 // pack)) == len(rows)
            narrow = prune(rows, {**bf16, "GW": 64}, K_PACK=pack, BLOCK_M=16)
            assert narrow and all(c.kwargs["BLOCK_K"] <= 64 for c in narrow)
        # a group of 512 inputs unrolled in 4 or 8 K steps: the stages of every tile the hook keeps
        # fit with all the steps' buffers; the flat (direct) loop keeps more
        wide = {**bf16, "GW": 512}
        kept = tuning.packed_pruner("BLOCK_K", unrolled_group=True)(rows, wide, K_PACK=pack, BLOCK_M=16)
        assert kept and all(
            c.num_stages * (512 // c.kwargs["BLOCK_K"]) * stage_bytes(c, 2, 1, pack, 16) <= tuning.PACKED_SMEM_BUDGET
            or c.num_stages == 1
            for c in kept
        )
        flat = tuning.packed_pruner("BLOCK_K")(rows, wide, K_PACK=pack, BLOCK_M=16)
        assert len(flat) > len(kept) or len(kept) == len(rows)


def test_decode_swap_ab_default():
    """The weight tile is the MMA's row operand for every decode product (measured faster)."""
    assert all(tuning.decode_swap_ab(op) for op in ("swiglu", "out", "reduce"))
    with pytest.raises(ValueError, match="unknown decode product 'gemm'; known: swiglu, out, reduce"):
        tuning.decode_swap_ab("gemm")


def test_auto_dispatch_follows_the_policy(monkeypatch):
    """On a GPU, "auto" takes the kernel only where the policy says so, else the dense fallback;
    "triton" always takes the kernel. (Checked here by recording which function runs.)"""
    calls = []

    def spy(name):
        return lambda *a, **k: calls.append(name)

    monkeypatch.setattr(kernels, "_use_triton", lambda backend, *t: backend != "torch")
    for name in (
        "triton_masked_out_gemm",
        "dense_masked_out_gemm",
        "triton_masked_reduce_gemm",
        "dense_masked_reduce_gemm",
        "triton_routed_attention_decode",
        "dense_routed_attention_decode",
        "triton_routed_attention_prefill",
        "dense_routed_attention_prefill",
    ):
        monkeypatch.setattr(kernels, name, spy(name))
    w = torch.zeros(8, 4)

    def out(m, fuse, backend="auto"):
        calls.clear()
        kernels.masked_out_gemm(
            torch.zeros(m, 4), w, torch.ones(m, 2, dtype=torch.bool), w if fuse else None, backend=backend
        )
        return calls[0]

    assert out(1, True) == out(600, True) == "triton_masked_out_gemm"  # the fused SwiGLU: everywhere
    assert out(1, False) == out(16, False) == out(4096, False) == "triton_masked_out_gemm"
    assert out(17, False) == out(1024, False) == "dense_masked_out_gemm"
    assert out(1024, False, backend="triton") == "triton_masked_out_gemm"
    calls.clear()
    # 16 groups: the kernel at M = 1 only; 2 (8 or fewer, as o_proj's): at every decode size on an
    # input not zero-filled yet, up to 8 tokens on a zero-filled one (its fallback is the plain product)
    cases = (
        (1, 16, "auto", False),
        (2, 16, "auto", False),
        (2, 16, "triton", False),
        (16, 2, "auto", False),
        (17, 2, "auto", False),
        (8, 2, "auto", True),
        (9, 2, "auto", True),
        (9, 2, "triton", True),
        (1, 16, "auto", True),
    )
    for m, groups, backend, zeroed in cases:
        kernels.masked_reduce_gemm(
            torch.zeros(m, 16),
            torch.zeros(8, 16),
            torch.ones(m, groups, dtype=torch.bool),
            input_is_masked=zeroed,
            backend=backend,
        )
    kernel, dense = "triton_masked_reduce_gemm", "dense_masked_reduce_gemm"
    assert calls == [kernel, dense, kernel, kernel, dense, kernel, dense, kernel, kernel]
    calls.clear()
    q, kv = torch.zeros(4, 8, 16), torch.zeros(4, 2, 8192, 16)
    kernels.routed_attention_decode(q, kv, kv, torch.full((4,), 8192), torch.ones(4, 2, dtype=torch.bool))
    kernels.routed_attention_decode(q[:1], kv[:1], kv[:1], torch.full((1,), 8192), torch.ones(1, 2, dtype=torch.bool))
    kernels.routed_attention_prefill(
        torch.zeros(1, 8, 4, 16), kv[:1, :, :4], kv[:1, :, :4], torch.ones(1, 4, 2, dtype=torch.bool)
    )
    assert calls == [
        "triton_routed_attention_decode",
        "dense_routed_attention_decode",
        "dense_routed_attention_prefill",
    ]


@pytest.mark.gpu
@pytest.mark.skipif(DEVICE != "cuda", reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("backend", ["triton", "auto"])
@pytest.mark.parametrize("m", [1, 5, 300])
def test_routed_ffn_and_attention_capture_in_a_cuda_graph(backend, m):
    """Every operator runs inside a captured CUDA graph (no host synchronisation, fixed shapes):
    replaying it on new inputs and masks gives the references' results."""
    from compresskit_wide.kernels.gemm_reduce import triton_masked_reduce_gemm

    dt = torch.bfloat16
    x = torch.randn(m, 256, device="cuda", dtype=dt)
    wg, wu = (torch.randn(512, 256, device="cuda", dtype=dt) / 16 for _ in range(2))
    wd = torch.randn(256, 512, device="cuda", dtype=dt) / 16
    mask = random_mask(m, 4, 0.5, seed=1)
    q = torch.randn(2, 8, 64, device="cuda", dtype=dt)
    k, v = (torch.randn(2, 2, 300, 64, device="cuda", dtype=dt) for _ in range(2))
    lens = torch.tensor([300, 17], dtype=torch.int32, device="cuda")
    amask = random_mask(2, 4, 0.5, seed=2)

    router = [torch.randn(8, 256, device="cuda") / 16, torch.zeros(8, device="cuda")]
    router += [torch.randn(8, 8, device="cuda") / 3, torch.zeros(8, device="cuda")]  # 4 groups

    def step():
        h = kernels.masked_out_gemm(x, wg, mask, wu, backend=backend)
        y = kernels.masked_reduce_gemm(h, wd, mask, input_is_masked=True, backend=backend)
        decision = kernels.router_decide(x, *router, backend=backend)
        fused = triton_masked_reduce_gemm(h, wd, mask, split=3, variant="fused")  # tickets reset each replay
        return y, kernels.routed_attention_decode(q, k, v, lens, amask, backend=backend), decision, fused

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()  # autotuning and compilation happen before capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y, att, decision, fused = step()
    for seed in (3, 4):  # new inputs and masks, same buffers
        x.copy_(torch.randn_like(x))
        mask.copy_(random_mask(m, 4, 0.5 if seed == 3 else 1.0, seed=seed))
        amask.copy_(random_mask(2, 4, 0.5, seed=seed))
        lens.copy_(torch.tensor([seed * 50, 300], dtype=torch.int32))
        graph.replay()
        ref_y = kernels.torch_masked_reduce_gemm(torch_masked_out_gemm(x, wg, mask, wu), wd, mask)
        ref_att = kernels.torch_routed_attention_decode(q, k, v, lens, amask)
        torch.testing.assert_close(y.float(), ref_y.float(), rtol=3e-2, atol=3e-2)
        torch.testing.assert_close(att.float(), ref_att.float(), rtol=3e-2, atol=3e-2)
        assert torch.equal(decision, kernels.torch_router_decide(x, *router))
        torch.testing.assert_close(fused.float(), ref_y.float(), rtol=3e-2, atol=3e-2)


@pytest.mark.gpu
@pytest.mark.skipif(DEVICE != "cuda", reason="CUDA graphs need a GPU")
def test_flushed_graph_bench_times_the_gpu_work():
    """The decode autotuners' timing: positive, ordered quantiles in do_bench's format, and more
    for more work (8 products against 1: far apart, whatever the GPU)."""

    a = torch.randn(2048, 2048, device="cuda", dtype=torch.bfloat16)
    one = tuning.flushed_graph_bench(lambda: a @ a)
    q50, q20, q80 = tuning.flushed_graph_bench(lambda: a @ a, quantiles=(0.5, 0.2, 0.8))
    eight = tuning.flushed_graph_bench(lambda: [a @ a for _ in range(8)])
    assert 0 < q20 <= q50 <= q80 and one > 0
    assert eight > 3 * one


def test_autotune_configs_never_span_two_groups():
    """The autotuner's candidates are pruned to blocks no wider than a group (checked here without
    a GPU: the pruning hook alone)."""

    out = tuning.configs(tuning.OUT_DECODE)
    kept = tuning.prune_wider_than_group("BLOCK_N")(out, {"GW": 32})
    assert kept and all(c.kwargs["BLOCK_N"] <= 32 for c in kept) and len(kept) < len(out)
    assert tuning.prune_wider_than_group("BLOCK_N")(out, {"GW": 512}) == out
    red = tuning.configs(tuning.REDUCE_DECODE)
    assert all(c.kwargs["BLOCK_K"] <= 64 for c in tuning.prune_wider_than_group("BLOCK_K")(red, {"GW": 40}))
    # a group narrower than any candidate still leaves one configuration to run
    assert len(tuning.prune_wider_than_group("BLOCK_K")(red, {"GW": 8})) >= 1


@pytest.mark.parametrize("m", [1, 3, 16])
@pytest.mark.parametrize("sparsity", SPARSITIES)
@pytest.mark.parametrize("fold_sum", [False, True])
@pytest.mark.parametrize("swap_ab", [False, True])
def test_masked_out_gemv_split_k_matches_reference(m, sparsity, fold_sum, swap_ab):
    """The plain decode product with its K range shared by 3 programs (fp32 partials, then one
    summing kernel, or the last share of each block adding them up): the reference's values,
    exact zeros for inactive groups, nothing written beyond the output."""
    gen = torch.Generator().manual_seed(m + 11)
    x = torch.randn(m, 200, generator=gen).to(DEVICE)  # K not a multiple of the share or the block
    w = torch.randn(96, 200, generator=gen).to(DEVICE)
    mask = random_mask(m, 3, sparsity, seed=m)
    buf = torch.full((m + 2, 96), float("nan"), device=DEVICE)
    got = triton_masked_out_gemm(
        x, w, mask, out=buf[:m], block_n=16, block_k=32, split_k=3, fold_sum=fold_sum, swap_ab=swap_ab
    )
    torch.testing.assert_close(got, torch_masked_out_gemm(x, w, mask), rtol=1e-4, atol=1e-4)
    if fold_sum:  # the tickets are back at zero for the next call
        from compresskit_wide.kernels.gemm_reduce import zeroed_tickets

        assert torch.count_nonzero(zeroed_tickets(x.device, 1)) == 0
    assert torch.count_nonzero(got[~mask.repeat_interleave(32, dim=-1)]) == 0
    assert torch.isnan(buf[m:]).all()
    with pytest.raises(ValueError, match="split_k is for the plain"):
        triton_masked_out_gemm(x, w, mask, w, split_k=2)
    # one tensor as both gate and up is still the fused SwiGLU (it was once taken for "no up")
    torch.testing.assert_close(
        triton_masked_out_gemm(x, w, mask, w, block_n=16, block_k=32),
        torch_masked_out_gemm(x, w, mask, w),
        rtol=1e-4,
        atol=1e-4,
    )


@pytest.mark.parametrize("m", [1, 2, 3, 5, 16])
@pytest.mark.parametrize("sparsity", SPARSITIES)
@pytest.mark.parametrize("fuse", [False, True])
@pytest.mark.parametrize(("k_pack", "block_n"), [(2, 8), (4, 16), (8, None), (16, 1)])
def test_masked_out_gemv_k_packed_matches_reference(m, sparsity, fuse, k_pack, block_n):
    """The decode product with K chunks packed into one product (``packed_output_tile``): a K that
    is no multiple of a step, a group of 32 channels over 2-32 blocks (8, 16 or 1 a program, or the
    autotuned tiles on a GPU); the reference's values, exact zeros
    for inactive groups, nothing written beyond the output."""
    gen = torch.Generator().manual_seed(m * 5 + k_pack)
    x = torch.randn(m, 200, generator=gen).to(DEVICE)
    w = torch.randn(96, 200, generator=gen).to(DEVICE)
    w_up = torch.randn(96, 200, generator=gen).to(DEVICE) if fuse else None
    mask = random_mask(m, 3, sparsity, seed=m + 3)
    buf = torch.full((m + 2, 96), float("nan"), device=DEVICE)
    got = triton_masked_out_gemm(x, w, mask, w_up, out=buf[:m], block_n=block_n, block_k=16, k_pack=k_pack)
    torch.testing.assert_close(got, torch_masked_out_gemm(x, w, mask, w_up), rtol=1e-4, atol=1e-4)
    assert torch.count_nonzero(got[~mask.repeat_interleave(32, dim=-1)]) == 0
    assert torch.isnan(buf[m:]).all()


def test_masked_out_gemv_k_packed_refuses_what_it_cannot_do():
    x, w = torch.randn(2, 64, device=DEVICE), torch.randn(32, 64, device=DEVICE)
    mask = random_mask(2, 2, 0.5)
    for kwargs in ({"k_pack": 3}, {"k_pack": 2, "split_k": 2}, {"k_pack": 2, "swap_ab": False}):
        with pytest.raises(ValueError, match="k_pack=.*a power of two, for the decode product"):
            triton_masked_out_gemm(x, w, mask, **kwargs)
    with pytest.raises(ValueError, match="for the decode product"):
        triton_masked_out_gemm(torch.randn(17, 64, device=DEVICE), w, random_mask(17, 2, 0.5), k_pack=4)
    with pytest.raises(ValueError, match="tl.dot needs 16 or more"):
        triton_masked_out_gemm(x, w, mask, block_n=4, k_pack=2)
    if DEVICE == "cuda":
        with pytest.raises(ValueError, match=r"k_pack=16 has no tile table on a GPU; tuned: \[2, 4, 8\]"):
            triton_masked_out_gemm(x, w, mask, k_pack=16)


@pytest.mark.parametrize("m", [1, 2, 3, 17])
@pytest.mark.parametrize("sparsity", SPARSITIES)
@pytest.mark.parametrize(("k_pack", "block_n", "groups"), [(2, 8, 3), (4, 16, 5), (8, None, 1), (4, None, 5)])
@pytest.mark.parametrize("variant", ["packed", "direct"])
def test_masked_reduce_gemm_packed_matches_reference(m, sparsity, k_pack, block_n, groups, variant):
    """The packed reduction (``k_pack`` groups a step in one product), from its list of active
    groups ("packed") and without it ("direct": consecutive groups, the unneeded ones not read): a
    count of groups (active ones) that is no multiple of the packing, a group of 32 inputs over
    two steps, two token tiles at M = 17; the reference's values, nothing written beyond the output
    (every output element is written: zero where no group is active)."""
    from compresskit_wide.kernels.gemm_reduce import torch_masked_reduce_gemm, triton_masked_reduce_gemm

    gen = torch.Generator().manual_seed(m * 13 + k_pack)
    x = torch.randn(m, 32 * groups, generator=gen).to(DEVICE)
    w = torch.randn(40, 32 * groups, generator=gen).to(DEVICE)
    mask = random_mask(m, groups, sparsity, seed=m + groups)
    buf = torch.full((m + 2, 40), float("nan"), device=DEVICE)
    got = triton_masked_reduce_gemm(x, w, mask, out=buf[:m], block_n=block_n, block_k=16, variant=variant,
                                    k_pack=k_pack)  # fmt: skip
    torch.testing.assert_close(got, torch_masked_reduce_gemm(x, w, mask), rtol=1e-4, atol=1e-4)
    assert torch.isnan(buf[m:]).all()
    for kwargs in ({"k_pack": 3}, {"split": 2}, {"swap_ab": False}):
        with pytest.raises(ValueError, match="the packed variant takes k_pack a power of two"):
            triton_masked_reduce_gemm(x, w, mask, variant=variant, **kwargs)


@pytest.mark.skipif(DEVICE != "cuda", reason="bf16 dot products need a GPU (the CPU interpreter computes in numpy)")
@pytest.mark.parametrize("m", [1, 4, 16])
@pytest.mark.parametrize("k_pack", sorted(tuning.REDUCE_DECODE_PACKED))
@pytest.mark.parametrize(("variant", "groups"), [("packed", 8), ("direct", 8), ("direct", 2)])
def test_masked_reduce_gemm_packed_bf16_autotuned(m, k_pack, variant, groups):
    """The packed reduction with its autotuned tiles on a GPU, in bf16, groups of 128 (and, without
    the list, of 512: o_proj's width, several K steps a group)."""
    from compresskit_wide.kernels.gemm_reduce import torch_masked_reduce_gemm, triton_masked_reduce_gemm

    x = torch.randn(m, 1024, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(384, 1024, device="cuda", dtype=torch.bfloat16) / 4
    mask = random_mask(m, groups, 0.5)
    buf = torch.full((m + 2, 384), float("nan"), device="cuda", dtype=torch.bfloat16)
    got = triton_masked_reduce_gemm(x, w, mask, out=buf[:m], variant=variant, k_pack=k_pack)
    ref = torch_masked_reduce_gemm(x, w, mask)
    torch.testing.assert_close(got.float(), ref.float(), rtol=2e-2, atol=2e-2 * 16)
    assert torch.isnan(buf[m:]).all()


@pytest.mark.skipif(DEVICE != "cuda", reason="bf16 dot products need a GPU (the CPU interpreter computes in numpy)")
@pytest.mark.parametrize("fuse", [False, True])
@pytest.mark.parametrize("m", [1, 4, 16])
@pytest.mark.parametrize("k_pack", sorted(tuning.OUT_DECODE_PACKED))
def test_masked_out_gemv_k_packed_bf16_autotuned(fuse, m, k_pack):
    """The K-packed decode product with its autotuned tiles on a GPU, in bf16 (tolerance as
    ``test_masked_out_gemm_bf16_autotuned``), a K of several steps."""
    x = torch.randn(m, 1024, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(512, 1024, device="cuda", dtype=torch.bfloat16) / 4
    w_up = torch.randn(512, 1024, device="cuda", dtype=torch.bfloat16) / 4 if fuse else None
    mask = random_mask(m, 4, 0.5)
    buf = torch.full((m + 2, 512), float("nan"), device="cuda", dtype=torch.bfloat16)
    got = triton_masked_out_gemm(x, w, mask, w_up, out=buf[:m], k_pack=k_pack)
    ref = torch_masked_out_gemm(x, w, mask, w_up)
    torch.testing.assert_close(got.float(), ref.float(), rtol=2e-2, atol=2e-1 if fuse else 2e-2 * 16)
    assert torch.count_nonzero(got[~mask.repeat_interleave(128, dim=-1)]) == 0
    assert torch.isnan(buf[m:]).all()


@pytest.mark.parametrize("m", [1, 3, 17, 40])
@pytest.mark.parametrize(("d", "rank", "groups"), [(200, 8, 3), (96, 32, 8), (64, 5, 130)])
@pytest.mark.parametrize("bias", [0.0, 50.0, -50.0])
@pytest.mark.parametrize(("split", "block_g"), [(None, None), (1, None), (3, 16), (3, 128)])
def test_router_decide_matches_the_router_and_decide(m, d, rank, groups, bias, split, block_g):
    """The fused decision equals ``decide(GroupRouter(x))`` on odd shapes: D not a multiple of the
    K step, a rank below tl.dot's 16 and above it, more groups than one program's block; biases
    that make every group execute (+50), none (-50), or about half (0); in one launch (split 1),
    with D in three shares, and with the default split (many shares at these sizes); with groups
    spread over several programs (16 a program) and all in one (128)."""
    from compresskit.routing import GroupRouter, decide
    from compresskit_wide.kernels.router import torch_router_decide, triton_router_decide

    torch.manual_seed(m + d + groups)
    router = GroupRouter(d, groups, rank).to(DEVICE)
    with torch.no_grad():
        router.up.bias.view(groups, 2)[:, 0] = bias  # the execute logits
    x = torch.randn(2, m, d, device=DEVICE)
    ref = decide(router(x), sample=False, tau=1.0).reshape(2 * m, groups)
    args = (x.reshape(2 * m, d), router.down.weight, router.down.bias, router.up.weight, router.up.bias)
    assert torch.equal(torch_router_decide(*args), ref)
    got = triton_router_decide(*args, split=split, block_g=block_g)
    assert got.dtype == torch.float32 and torch.equal(got, ref)
    if split == 3:  # the partial sums added by the last share or by a second launch: the same decisions
        for fold in (True, False):
            assert torch.equal(triton_router_decide(*args, split=split, block_g=block_g, fold=fold), ref)
    if split is None:  # as a bool mask (what the executor asks for): the same decisions
        assert torch.equal(torch_router_decide(*args, as_bool=True), ref.bool())
        as_bool = triton_router_decide(*args, block_g=block_g, as_bool=True)
        assert as_bool.dtype == torch.bool and torch.equal(as_bool, ref.bool())
    if bias:
        assert torch.all(got == (1.0 if bias > 0 else 0.0))


def test_host_launch_arithmetic_equals_tritons():
    """The plain-Python ``cdiv`` / ``next_power_of_2`` the launches use (Triton's are constexpr
    functions, slow on the host) give Triton's values."""

    for n in range(1, 3000):
        assert tuning.next_power_of_2(n) == triton.next_power_of_2(n)
    for a in range(0, 200):
        for b in range(1, 70):
            assert tuning.cdiv(a, b) == triton.cdiv(a, b)


def test_folded_router_leaves_its_tickets_zeroed():
    """The folded decision's last share of each token block resets that block's ticket, so that
    the next call (or a CUDA-graph replay) starts from zero; calls in a row give the same result."""
    from compresskit.routing import GroupRouter, decide
    from compresskit_wide.kernels.gemm_reduce import zeroed_tickets
    from compresskit_wide.kernels.router import triton_router_decide

    torch.manual_seed(5)
    router = GroupRouter(96, 7, 8).to(DEVICE)
    x = torch.randn(20, 96, device=DEVICE)
    ref = decide(router(x), sample=False, tau=1.0)
    args = (x, router.down.weight, router.down.bias, router.up.weight, router.up.bias)
    for split in (2, 3, 3):
        assert torch.equal(triton_router_decide(*args, split=split, fold=True), ref)
        assert int(zeroed_tickets(x.device, 8)[:8].abs().sum()) == 0


def test_router_folds_the_sum_for_few_groups_at_decode_sizes():
    """One launch (the last share sums) for the attention router's few groups at decode sizes; a
    second launch for the FFN router's many groups and beyond decode sizes (as measured, run 35)."""
    from compresskit_wide.kernels.router import router_fold

    assert router_fold(1, 8) and router_fold(16, 32)
    assert not router_fold(1, 112) and not router_fold(17, 8) and not router_fold(1024, 8)


def test_router_precision_by_token_count():
    """fp32 products on the CUDA cores at decode sizes, three TF32 passes on the tensor cores beyond."""
    from compresskit_wide.kernels.router import router_precision

    assert [router_precision(m) for m in (1, 16, 17, 1024)] == ["ieee", "ieee", "tf32x3", "tf32x3"]


def test_router_split_keeps_the_gpu_busy():
    """Shares of D by token count (D = 4096, 128-wide K steps): up to 128 programs at decode and
    small prefill sizes, about 256 from 64 token blocks of 32 (one launch there left most SMs idle,
    run 19), one launch once the token blocks alone fill that."""
    from compresskit_wide.kernels.router import router_split

    assert router_split(1, 4096, 16, 128) == 32  # at most one share per K step
    assert [router_split(m, 4096, 32, 128) for m in (1024, 2048, 4096, 8192)] == [4, 4, 2, 1]


def test_router_decide_validates_its_tensors():
    from compresskit_wide.kernels.router import triton_router_decide

    x, wd, bd = torch.zeros(2, 8), torch.zeros(4, 8), torch.zeros(4)
    with pytest.raises(ValueError, match="router tensors do not fit"):
        triton_router_decide(x, wd, bd, torch.zeros(6, 4), torch.zeros(5))
    with pytest.raises(ValueError, match="router tensors do not fit"):
        triton_router_decide(x, wd.half(), bd, torch.zeros(6, 4), torch.zeros(6))
    with pytest.raises(ValueError, match="split must be >= 1, got 0"):
        triton_router_decide(x, wd, bd, torch.zeros(6, 4), torch.zeros(6), split=0)
    with pytest.raises(ValueError, match="block_g must be a power of two >= 16, got 24"):
        triton_router_decide(x, wd, bd, torch.zeros(6, 4), torch.zeros(6), block_g=24)


def test_executor_routes_through_the_fused_decision_only_off_the_reference_backend(tiny_model_dir):
    """``wide-triton`` gives each deciding projection the fused decision and each routed o_proj the
    reduction's dispatch (not with backend "torch"; under "auto" the decision's kernel at every
    token count on a GPU); no weight is saved twice."""
    import copy

    from compresskit import plugins
    from compresskit.routing import routed_projections
    from compresskit_wide.executor import KernelReduce, KernelRouter

    model, _, _ = finalized_wide_model(tiny_model_dir)
    executor_cls = plugins.load("executor", "wide-triton")
    for backend, expect in (("torch", False), ("auto", True), ("triton", True)):
        fast = executor_cls(executor_cls.Config(backend=backend)).convert(copy.deepcopy(model))
        deciders = [p for _, p in routed_projections(fast) if p.router is not None]
        assert deciders and all(isinstance(p.fast_decide, KernelRouter) == expect for p in deciders)
        # the router's weights are saved once, under the projection, not again under fast_decide;
        # o_proj's product (the reduction's dispatch) likewise, its weight under the projection only
        assert not any(".fast_decide." in k or ".fast_product." in k for k in fast.state_dict())
        o_projs = [layer.self_attn.o_proj for layer in fast.model.layers]
        assert all(isinstance(p.fast_product, KernelReduce) == expect for p in o_projs)
    assert all(tuning.use_kernel("router", m) for m in (1, 1024, 2048, 4096))
