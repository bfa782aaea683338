"""The ``wide-triton`` executor on the tiny model: the same results as the reference path, through
the kernels where they run (the CPU interpreter here, the GPU on the device)."""

import pytest
import torch

pytest.importorskip("triton")

from compresskit.errors import KernelUnavailableError  # noqa: E402
from compresskit_wide.kernels import ops, policy  # noqa: E402

pytestmark = pytest.mark.triton
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


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
    real = ops.triton_routed_attention_prefill
    monkeypatch.setattr(ops, "triton_routed_attention_prefill", lambda *a, **k: calls.append(1) or real(*a, **k))
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
    real_decode = ops.triton_routed_attention_decode
    monkeypatch.setattr(
        ops, "triton_routed_attention_decode", lambda *a, **k: decode_calls.append(1) or real_decode(*a, **k)
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
    real_choose = ops._choose
    monkeypatch.setattr(  # q takes the dense path, as "auto" does on a GPU between decode and 4,096 tokens
        ops, "_choose", lambda backend, op, *a, **k: "dense" if op == "out" else real_choose(backend, op, *a, **k)
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
        monkeypatch.setattr(ops, name, lambda *a, **k: calls.append(1))
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
    assert all(policy.use_kernel("router", m) for m in (1, 1024, 2048, 4096))
