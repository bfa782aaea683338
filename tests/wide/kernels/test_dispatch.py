"""The backend dispatch (``kernels.ops``), the "auto" policy, the autotuner's wiring and capture in a
CUDA graph."""

import itertools
import warnings

import pytest
import torch

triton = pytest.importorskip("triton")

from kernel_helpers import DEVICE, prologue_inputs, random_mask  # noqa: E402

from compresskit_wide.kernels import autotune, ops, policy  # noqa: E402
from compresskit_wide.kernels.common import TritonUnavailableError, cdiv, next_power_of_2  # noqa: E402

pytestmark = pytest.mark.triton


def test_every_backend_gives_the_reference():
    x, w, mask = torch.randn(5, 32, device=DEVICE), torch.randn(64, 32, device=DEVICE), random_mask(5, 4, 0.5)
    ref = ops.torch_masked_out_gemm(x, w, mask)
    for backend in ("torch", "triton", "auto"):
        torch.testing.assert_close(ops.masked_out_gemm(x, w, mask, backend=backend), ref, rtol=1e-4, atol=1e-4)
        reduce_mask = random_mask(5, 4, 0.5, seed=1)
        got = ops.masked_reduce_gemm(x, w, reduce_mask, backend=backend)
        torch.testing.assert_close(got, ops.torch_masked_reduce_gemm(x, w, reduce_mask), rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="allowed: auto, torch, triton"):
        ops.masked_out_gemm(x, w, mask, backend="cuda")


def test_triton_backend_refuses_clearly_when_it_cannot_run(monkeypatch):
    monkeypatch.setattr(ops, "triton_available", lambda: "no CUDA device")
    x, w, mask = torch.randn(2, 8), torch.randn(4, 8), torch.ones(2, 2, dtype=torch.bool)
    with pytest.raises(TritonUnavailableError, match="backend 'triton': no CUDA device"):
        ops.masked_out_gemm(x, w, mask, backend="triton")
    torch.testing.assert_close(ops.masked_out_gemm(x, w, mask, backend="auto"), x @ w.T)


def test_auto_takes_the_kernel_exactly_where_the_policy_says(monkeypatch):
    """On CUDA tensors "auto" runs an op's kernel where ``policy.use_kernel`` is true and its dense
    fallback elsewhere; "triton" always the kernel (recorded by spies, here on the CPU)."""
    calls = []
    monkeypatch.setattr(ops, "_use_triton", lambda backend, *t: backend != "torch")
    monkeypatch.setattr(policy, "check_gpu", lambda device: None)
    for impl in ("triton", "dense"):
        for op in ("masked_out_gemm", "masked_reduce_gemm", "routed_attention_decode", "routed_attention_prefill"):
            stub = lambda *a, impl=impl, **k: calls.append(impl) or torch.zeros(1, 1, 1, 1)  # noqa: E731
            monkeypatch.setattr(ops, f"{impl}_{op}", stub)

    monkeypatch.setattr(ops, "torch_router_shares", lambda *a: None)
    monkeypatch.setattr(ops, "triton_tile_reduce_gemm", lambda *a, **k: calls.append("triton"))

    def ran(op, *args, **kwargs):
        calls.clear()
        getattr(ops, op)(*args, **kwargs)
        return calls[0] == "triton"

    w = torch.zeros(8, 4)
    for m, shared in itertools.product((1, 2, 8, 9, 16, 17, 64, 65, 256, 1024, 4096), (False, True)):
        x, mask = torch.zeros(m, 4), torch.ones(m, 2, dtype=torch.bool)
        assert ran("masked_out_gemm", x, w, mask, shared=shared) == policy.use_kernel("out", m, shared=shared)
        swiglu = ran("masked_out_gemm", x, w, mask, w_up=w, shared=shared)
        assert swiglu == policy.use_kernel("swiglu", m, shared=shared)
        for groups in (2, 8, 16):
            x, wd, mask = torch.zeros(m, 16), torch.zeros(8, 16), torch.ones(m, groups, dtype=torch.bool)
            for zeroed in (False, True):
                got = ran("masked_reduce_gemm", x, wd, mask, input_is_masked=zeroed, shared=shared)
                assert got == policy.use_kernel("reduce", m, groups=groups, zeroed=zeroed, shared=shared)
                assert ran("masked_reduce_gemm", x, wd, mask, input_is_masked=zeroed, backend="triton")
                hand = {"residual": torch.zeros(m, 8), "share_w": torch.zeros(4, 8), "input_is_masked": zeroed}
                got = ran("masked_reduce_gemm_shares", x, wd, mask, **hand, shared=shared)
                assert got == policy.use_kernel("reduce_handoff", m, groups=groups, zeroed=zeroed, shared=shared)
    # a prefill whose weight rows a TMA descriptor cannot take (K x 4 bytes not a multiple of 16) runs dense
    for m in (16, 4096):
        x, mask, w3 = torch.zeros(m, 3), torch.ones(m, 2, dtype=torch.bool), torch.zeros(8, 3)
        assert ran("masked_out_gemm", x, w3, mask, w_up=w3) == (m <= policy.DECODE_MAX_M)
    for b, ctx in ((1, 8192), (4, 8192), (1, 32768)):
        q, kv, lens = torch.zeros(b, 8, 16), torch.zeros(b, 2, ctx, 16), torch.full((b,), ctx)
        got = ran("routed_attention_decode", q, kv, kv, lens, torch.ones(b, 2, dtype=torch.bool))
        assert got == policy.use_kernel("attn_decode", b, context=ctx)
    for t in (4, 1024):
        q, kv = torch.zeros(1, 8, t, 16), torch.zeros(1, 2, t, 16)
        got = ran("routed_attention_prefill", q, kv, kv, torch.ones(1, t, 2, dtype=torch.bool))
        assert got == policy.use_kernel("attn_prefill", t)
    # the policy is not trivially one way or the other
    assert not policy.use_kernel("out", 1024) and policy.use_kernel("out", 1)
    assert all(policy.use_kernel("swiglu", m) for m in (1, 16, 512, 8192))
    # the stacked fallback was as fast at 32-128 tokens, cuBLAS faster at 256; a shared set keeps the kernel
    assert not any(policy.use_kernel("swiglu", m) for m in (17, 64, 128, 129, 256, 511))
    assert policy.use_kernel("swiglu", 17, shared=True) and policy.use_kernel("swiglu", 64, shared=True)
    assert not policy.use_kernel("reduce", 2, groups=112) and policy.use_kernel("reduce", 1, groups=112)
    assert policy.use_kernel("reduce_handoff", 16, groups=112) and not policy.use_kernel("reduce_handoff", 17)
    # a batch's shared set keeps q's kernel and the split-K reduction up to SHARED_MAX_M tokens, where per-token
    # unions run dense; past 16 tokens only the shared set's split-K reduction hands the next router its shares
    assert policy.use_kernel("out", 64, shared=True) and not policy.use_kernel("out", 64)
    assert not policy.use_kernel("out", 65, shared=True)
    assert policy.use_kernel("reduce", 17, groups=112, shared=True) and policy.use_kernel("reduce", 64, shared=True)
    assert not policy.use_kernel("reduce", 17, groups=112) and not policy.use_kernel("reduce", 65, shared=True)
    assert policy.use_kernel("reduce_handoff", 17, groups=112, shared=True)
    assert policy.use_kernel("reduce_handoff", 64, shared=True) and not policy.use_kernel(
        "reduce_handoff", 65, shared=True
    )
    # the routed decode attention at every batch from 512 cached positions
    assert all(policy.use_kernel("attn_decode", b, context=512) for b in (1, 2, 64))
    assert not policy.use_kernel("attn_decode", 1, context=511)
    assert policy.decode_kernel(64, shared=True) and not policy.decode_kernel(17, shared=False)


def test_the_decision_in_the_prologue_runs_where_asked(monkeypatch):
    """``router_norm_out_gemm`` runs its one launch under "triton" up to 16 tokens and under "auto" at one token
    of a width up to SmolLM2's (the measured range); elsewhere, and past 16 tokens under every backend, the
    decision's operator and then the product's. Every path gives the reference's decision, residual and
    product, counted once (spied here on the CPU, the kernels in the interpreter)."""
    from compresskit_wide.kernels.gemm_out import torch_router_norm_out_gemm

    fused = []
    real = ops.triton_router_norm_out_gemm
    monkeypatch.setattr(ops, "triton_router_norm_out_gemm", lambda *a, **k: fused.append(1) or real(*a, **k))
    monkeypatch.setattr(ops, "_use_triton", lambda backend, *t: backend != "torch")
    monkeypatch.setattr(policy, "check_gpu", lambda device: None)
    assert policy.use_kernel("router_out", 1, width=576)
    assert not any(policy.use_kernel("router_out", m, width=w) for m, w in ((2, 576), (1, 577), (1, 4096), (1, 0)))
    w = torch.randn(48 + 16, 40, generator=torch.Generator().manual_seed(0)).to(DEVICE)
    for m in (1, 3, 20):
        args = prologue_inputs(m, 40, 3, "ragged", seed=m)
        want, want_execute, want_x = torch_router_norm_out_gemm(*args, w, None, 16)
        want_counts = torch.zeros(2, dtype=torch.float64, device=DEVICE)
        ops.torch_count(want_execute, want_counts)
        for backend in ("torch", "auto", "triton"):
            fused.clear()
            counts = torch.zeros(2, dtype=torch.float64, device=DEVICE)
            route = dict(zip(("b_down", "w_route", "b_route", "x", "delta", "norm_w", "eps"), args[1:], strict=True))
            rows = {"w_up": None, "dense_rows": 16, "zero_inactive": True, "counts": counts, "count": True}
            got, execute, x_new = ops.router_norm_out_gemm(args[0], w, **route, **rows, backend=backend)
            taken = (backend == "triton" and m <= policy.DECODE_MAX_M) or (backend == "auto" and m == 1)
            assert fused == ([1] if taken else []), (m, backend)
            assert torch.equal(execute, want_execute) and torch.equal(x_new, want_x)
            assert torch.equal(counts, want_counts)
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_policy_is_data_with_a_reason_for_every_range():
    assert {r.op for r in policy.KERNEL_RANGES} == set(policy.OPS) - set(policy.UNMEASURED)
    assert all(len(r.why) > 20 for r in policy.KERNEL_RANGES)
    with pytest.raises(ValueError, match="unknown operator 'gemm'; known: swiglu, out, reduce"):
        policy.use_kernel("gemm", 1)


def test_auto_warns_once_on_a_gpu_it_was_not_measured_on(monkeypatch):
    monkeypatch.setattr(policy, "_CHECKED", set())
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100-SXM4-80GB")
    with pytest.warns(UserWarning, match="measured on an NVIDIA H200, not on this NVIDIA A100.*bench_wide_kernels"):
        policy.check_gpu(torch.device("cuda", 0))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        policy.check_gpu(torch.device("cuda", 0))  # once per device
    monkeypatch.setattr(policy, "_CHECKED", set())
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H200")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        policy.check_gpu(torch.device("cuda", 0))


def test_host_launch_arithmetic_equals_tritons():
    for n in range(1, 3000):
        assert next_power_of_2(n) == triton.next_power_of_2(n)
    for a in range(0, 200):
        for b in range(1, 70):
            assert cdiv(a, b) == triton.cdiv(a, b)


def test_autotune_hooks_keep_tiles_that_fit():
    """No block wider than a group (one candidate always left); the K-packed kernels' tiles fit
    shared memory with all their stages (fp32 gate+up overflows: the tiles that fit, or the smallest
    with fewer stages); a listed reduction over groups of 512 counts every unrolled K step."""
    decode = autotune.configs(policy.SWIGLU_DECODE)
    kept = autotune.prune_wider_than_group("BLOCK_N")(decode, {"GW": 32})
    assert kept and all(c.kwargs["BLOCK_N"] <= 32 for c in kept) and len(kept) < len(decode)
    assert autotune.prune_wider_than_group("BLOCK_N")(decode, {"GW": 512}) == decode
    narrow = autotune.prune_wider_than_group("BLOCK_N")(decode, {"GW": 4})  # every tile wider: narrowed
    assert narrow and all(c.kwargs["BLOCK_N"] == 16 for c in narrow)

    def fits(c, elem, weights, pack, block_m, steps=1):
        stage = steps * c.kwargs["BLOCK_K"] * elem * pack * (c.kwargs["BLOCK_N"] * weights + block_m)
        return c.num_stages * stage <= policy.PACKED_SMEM_BUDGET or c.num_stages == 1

    bf16 = {"GW": 128, "x_ptr": torch.empty(1, dtype=torch.bfloat16)}
    for pack in sorted({p for _, p in policy.OUT_K_PACK}):  # the packings ``auto`` takes
        rows = autotune.configs(policy.per_packing(policy.PACKED_DECODE_ROWS, pack))
        assert len(
            autotune.packed_pruner("BLOCK_N")(rows, bf16, FUSE_SWIGLU=False, K_PACK=pack, BLOCK_M=16 // pack)
        ) == len(rows)
        fp32 = {"GW": 32, "x_ptr": torch.empty(1)}
        kept = autotune.packed_pruner("BLOCK_N")(rows, fp32, FUSE_SWIGLU=True, K_PACK=pack, BLOCK_M=8)
        assert kept and all(c.kwargs["BLOCK_N"] <= 32 and fits(c, 4, 2, pack, 8) for c in kept)
    pack = policy.REDUCE_K_PACK
    rows = autotune.configs(policy.per_packing(policy.REDUCE_DECODE_ROWS, pack))
    wide = {**bf16, "GW": 512}
    listed = autotune.packed_pruner("BLOCK_K", unrolled_group=True)(rows, wide, K_PACK=pack, BLOCK_M=16)
    assert listed and all(fits(c, 2, 1, pack, 16, steps=512 // c.kwargs["BLOCK_K"]) for c in listed)
    flat = autotune.packed_pruner("BLOCK_K")(rows, wide, K_PACK=pack, BLOCK_M=16)
    assert len(flat) >= len(listed)
    # the persistent prefill product: every tile for q (groups of 512); the fused SwiGLU stages two weight
    # tiles, so its widest tile no longer fits; groups of 128 drop the 256-wide tiles
    persistent = autotune.configs(policy.OUT_PERSISTENT)
    prune = autotune.prune_staged_tiles("BLOCK_N")
    assert prune(persistent, {**bf16, "GW": 512}, FUSE_SWIGLU=False) == persistent
    fused = prune(persistent, {**bf16, "GW": 512}, FUSE_SWIGLU=True)
    assert fused and len(fused) < len(persistent)
    assert all(c.num_stages * c.kwargs["BLOCK_K"] * 2 * (c.kwargs["BLOCK_M"] + 2 * c.kwargs["BLOCK_N"])
               <= policy.PACKED_SMEM_BUDGET for c in fused)  # fmt: skip
    assert all(c.kwargs["BLOCK_N"] <= 128 for c in prune(persistent, bf16, FUSE_SWIGLU=True))
    # groups narrower than every tile (32 channels): the tiles narrowed to the group, each fitting, each
    # still setting its descriptors' blocks; where even the smallest does not fit, it with fewer stages
    hook = autotune.descriptor_blocks(w_desc=("BLOCK_N", "BLOCK_K"))
    narrow = prune(autotune.configs(policy.OUT_PERSISTENT, hook), {**bf16, "GW": 32}, FUSE_SWIGLU=True)
    assert narrow and all(c.kwargs["BLOCK_N"] == 32 and c.pre_hook is hook for c in narrow)
    assert all(autotune.staged_tile_bytes(c.kwargs, c.num_stages, 2, True) <= policy.PACKED_SMEM_BUDGET
               for c in narrow)  # fmt: skip
    big = autotune.configs([({"BLOCK_M": 256, "BLOCK_N": 256, "BLOCK_K": 128, "PER_SM": 1}, 8, 4)], hook)
    (one,) = prune(big, {"GW": 512, "x_ptr": torch.empty(1)}, FUSE_SWIGLU=True)
    assert one.num_stages == 1 and one.pre_hook is hook
    # the TMA descriptors' blocks follow the tile the autotuner launches
    from triton.tools.tensor_descriptor import TensorDescriptor

    w = torch.zeros(64, 64)
    nargs = {"w_desc": TensorDescriptor.from_tensor(w, [16, 16]), "wu_desc": TensorDescriptor.from_tensor(w, [16, 16])}
    autotune.descriptor_blocks(w_desc=("BLOCK_N", "BLOCK_K"), wu_desc=("BLOCK_N", "BLOCK_K"))(
        {**nargs, "BLOCK_N": 128, "BLOCK_K": 64}
    )
    assert nargs["w_desc"].block_shape == [128, 64] and nargs["wu_desc"].block_shape == [128, 64]
    # the split tail's descriptors: pieces of half the tile's channels where they hold 16 or more, else the tile's
    from compresskit_wide.kernels import gemm_out

    hook = gemm_out._tuned_prefill.configs[0].pre_hook
    for block_n, split, rows in ((128, 2, 64), (32, 2, 16), (16, 2, 16), (128, 1, 128)):
        tail = {name: TensorDescriptor.from_tensor(w, [16, 16]) for name in ("w_tail_desc", "wu_tail_desc")}
        hook({**nargs, **tail, "BLOCK_N": block_n, "BLOCK_K": 64, "TAIL_SPLIT": split})
        assert tail["w_tail_desc"].block_shape == tail["wu_tail_desc"].block_shape == [rows, 64]
        assert nargs["w_desc"].block_shape == [block_n, 64]


def test_l2_flush_buffer_is_writable_after_a_first_call_in_inference_mode():
    """First made inside ``torch.inference_mode`` (a generation's first step), the flush buffer must
    stay writable in place outside it (a later shape's autotuning)."""
    autotune._FLUSH.pop("cpu", None)
    with torch.inference_mode():
        buf = autotune.l2_flush_buffer("cpu")
    assert not buf.is_inference()
    buf[:8].zero_()
    with torch.inference_mode():
        autotune.l2_flush_buffer("cpu")[:8].bitwise_not_()
    assert autotune.l2_flush_buffer("cpu") is buf and int(buf[0]) == 255
    autotune._FLUSH.pop("cpu")


@pytest.mark.gpu
@pytest.mark.skipif(DEVICE != "cuda", reason="CUDA graphs need a GPU")
def test_flushed_graph_bench_times_the_gpu_work():
    a = torch.randn(2048, 2048, device="cuda", dtype=torch.bfloat16)
    one = autotune.flushed_graph_bench(lambda: a @ a)
    q50, q20, q80 = autotune.flushed_graph_bench(lambda: a @ a, quantiles=(0.5, 0.2, 0.8))
    eight = autotune.flushed_graph_bench(lambda: [a @ a for _ in range(8)])
    assert 0 < q20 <= q50 <= q80 and one > 0 and eight > 3 * one


@pytest.mark.gpu
@pytest.mark.skipif(DEVICE != "cuda", reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("backend", ["triton", "auto"])
@pytest.mark.parametrize("m", [1, 5, 300])
def test_routed_ffn_attention_and_router_capture_in_a_cuda_graph(backend, m):
    """Every op runs inside a captured CUDA graph (no host synchronisation): replays on new inputs
    and masks give the references' results (a block's start from shares too: the decision in gate+up's
    prologue under "triton" up to 16 tokens)."""
    from compresskit_wide.kernels.gemm_out import torch_router_norm_out_gemm

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
    # a block's start from the shares the block before handed on: the decision, the add, the norm, gate+up
    delta, norm_w = torch.randn_like(x), torch.ones(256, device="cuda", dtype=dt)
    shares = ops.torch_router_shares(x + delta, router[0])
    started = torch.zeros(2, dtype=torch.float64, device="cuda")
    route = {"b_down": router[1], "w_route": router[2], "b_route": router[3]}
    norm = {"x": x, "delta": delta, "norm_w": norm_w, "eps": 1e-5}
    gate_up = {"w_up": wu, "dense_rows": 0, "zero_inactive": True}

    def step():
        h = ops.masked_out_gemm(x, wg, mask, w_up=wu, backend=backend)
        y = ops.masked_reduce_gemm(h, wd, mask, input_is_masked=True, backend=backend)
        o = ops.masked_reduce_gemm(h, wd, mask, backend="triton")  # the kernel at every M
        return (
            y,
            o,
            ops.routed_attention_decode(q, k, v, lens, amask, backend=backend),
            ops.router_decide(x, router[0], **route, counts=counts, count=True, backend=backend),
            ops.router_norm_out_gemm(
                shares, wg, **route, **norm, **gate_up, counts=started, count=True, backend=backend
            ),
        )

    counts = torch.zeros(2, dtype=torch.float64, device="cuda")

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()  # autotuning and compilation before the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y, o, att, decision, (gate_up, start_decision, x_new) = step()
    counts.zero_()  # (the warm-up calls counted)
    started.zero_()
    want, want_started = torch.zeros_like(counts), torch.zeros_like(started)
    for seed in (3, 4):  # new inputs and masks, same buffers
        x.copy_(torch.randn_like(x))
        mask.copy_(random_mask(m, 4, 0.5 if seed == 3 else 1.0, seed=seed))
        amask.copy_(random_mask(2, 4, 0.5, seed=seed))
        lens.copy_(torch.tensor([seed * 50, 300], dtype=torch.int32))
        shares.copy_(ops.torch_router_shares(x + delta, router[0]))
        graph.replay()
        ref_y = ops.torch_masked_reduce_gemm(ops.torch_masked_out_gemm(x, wg, mask, wu), wd, mask)
        torch.testing.assert_close(y.float(), ref_y.float(), rtol=3e-2, atol=3e-2)
        torch.testing.assert_close(o.float(), ref_y.float(), rtol=3e-2, atol=3e-2)
        ref_att = ops.torch_routed_attention_decode(q, k, v, lens, amask)
        torch.testing.assert_close(att.float(), ref_att.float(), rtol=3e-2, atol=3e-2)
        assert torch.equal(decision, ops.torch_router_decide(x, *router, as_bool=True))
        ops.torch_count(decision, want)
        assert torch.equal(counts, want)  # each replay counts its decision
        ref_gu, ref_start, ref_x = torch_router_norm_out_gemm(shares, *router[1:], x, delta, norm_w, 1e-5, wg, wu)
        assert torch.equal(start_decision, ref_start) and torch.equal(x_new, ref_x)
        torch.testing.assert_close(gate_up.float(), ref_gu.float(), rtol=3e-2, atol=3e-2)
        ops.torch_count(start_decision, want_started)
        assert torch.equal(started, want_started)


def test_a_block_s_questions_take_the_kernel_only_where_the_op_would(monkeypatch):
    """The questions a block asks ``ops`` (its structure) answer as the op itself would under "auto": the kernel
    where Triton runs and the policy takes it, else none (no Triton on a GPU is the dense structure, never a forced
    kernel that cannot run); a backend asked for by name is passed on as it is."""
    x = torch.zeros(1, 8)
    where = {"groups": 112, "zeroed": False, "shared": False, "tiled": False}
    monkeypatch.setattr(policy, "check_gpu", lambda device: None)
    monkeypatch.setattr(ops, "_use_triton", lambda backend, *t: False)  # no Triton here
    assert ops.handoff_backend("auto", 1, **where, x=x) is None
    assert ops.own_shares_backend("auto", 1, x) is None
    assert ops.routed_attention_backend("auto", 1, 1, 8192, x) is None
    assert ops.handoff_backend("torch", 1, **where, x=x) == "torch"
    monkeypatch.setattr(ops, "_use_triton", lambda backend, *t: backend != "torch")  # Triton on a GPU
    assert policy.use_kernel("reduce_handoff", 16, groups=112)
    assert ops.handoff_backend("auto", 16, **where, x=x) == "triton"
    assert ops.handoff_backend("auto", 17, **{**where, "tiled": True}, x=x) is None  # a prefill's tiles hand nothing
