"""Dynamic depth on a tiny Llama: skipped sublayers contribute exactly nothing, one decision per
layer gates both sublayers, cached decoding is exact, and the router stage meets the budget."""

import pytest
import torch

from compresskit.data import DataModule
from compresskit.interfaces import RunContext
from compresskit.modeling import load_model
from compresskit.routing import routed_projections
from compresskit.testing import ModulesExecutor, tiny_llama
from compresskit.trainers import RouterTrainer, TrainStageConfig
from compresskit_baselines.dynamic_depth import DynamicDepthConfig, DynamicDepthPruner


def attach(model, **kw):
    pruner = DynamicDepthPruner(DynamicDepthConfig(router_rank=8, **kw))
    pruner.prepare(model, RunContext(model_config=model.config))
    return pruner


def ids():
    return torch.randint(2, 300, (2, 16), generator=torch.Generator().manual_seed(2))


def capture_outputs(model):
    """(decision, sublayer output) per routed projection, for the next forward pass."""
    seen = {}
    for name, proj in routed_projections(model):

        def hook(module, args, out, name=name, proj=proj):
            seen[name] = out.detach().clone()

        proj.register_forward_hook(hook)
    return seen


@pytest.mark.parametrize("granularity", ["sublayer", "layer"])
def test_skipped_sublayers_contribute_exactly_nothing(granularity):
    model = tiny_llama(num_hidden_layers=3)
    pruner = attach(model, granularity=granularity)
    decisions = {}
    for name, proj in routed_projections(model):
        if proj.router is not None:
            proj.router.register_forward_hook(
                lambda m, a, o, name=name: decisions.__setitem__(name, (o[..., 1] <= o[..., 0]).squeeze(-1))
            )
    outputs = capture_outputs(model)
    with torch.no_grad():
        model(ids())
    for i in range(3):
        att, ffn = f"model.layers.{i}.self_attn.o_proj", f"model.layers.{i}.mlp.down_proj"
        run_att = decisions[att]
        run_ffn = decisions[ffn] if granularity == "sublayer" else run_att  # one decision per layer
        assert torch.count_nonzero(outputs[att][~run_att]) == 0
        assert torch.count_nonzero(outputs[ffn][~run_ffn]) == 0
        assert (outputs[att][run_att].abs().sum(-1) > 0).all()
    rep = pruner.sparsity(model)
    assert 0 < rep.macs < 1 and rep.tokens == 32
    if granularity == "layer":
        g = rep.to_dict()["groups"]
        assert g["attention"] == g["ffn"]  # the FFN follows the attention decision


def test_cached_decoding_is_exact_with_skipped_attention():
    model = tiny_llama()
    pruner = attach(model)
    pruner.finalize(model)
    prompt = ids()[:1, :6]
    with torch.no_grad():
        cached = model.generate(prompt, max_new_tokens=8, do_sample=False, use_cache=True, pad_token_id=1)
        plain = model.generate(prompt, max_new_tokens=8, do_sample=False, use_cache=False, pad_token_id=1)
    assert torch.equal(cached, plain)


@pytest.mark.slow
def test_router_stage_meets_the_mac_budget(tiny_model_dir):
    model, tok = load_model(str(tiny_model_dir), dtype="float32", device="cpu")
    pruner = attach(model, target_sparsity=0.4)
    ctx = RunContext(model_config=model.config, tokenizer=tok, seed=0)
    summary = RouterTrainer(TrainStageConfig(steps=60, batch_size=2, seq_len=32, lr=2e-2)).fit(
        model, pruner, DataModule(tok), ctx
    )
    last = summary.history[-5:]
    assert sum(h["sparsity_macs"] for h in last) / len(last) == pytest.approx(0.4, abs=0.12)


def test_ignore_layers_and_errors():
    from compresskit.errors import RecipeError

    model = tiny_llama(num_hidden_layers=3)
    attach(model, ignore_layers=[0])
    assert [p.layer_idx for _, p in routed_projections(model)] == [1, 1, 2, 2]
    with pytest.raises(RecipeError, match=r"ignore_layers: \[7\] out of range"):
        attach(tiny_llama(), ignore_layers=[7])


@pytest.mark.slow
@pytest.mark.parametrize("granularity", ["sublayer", "layer"])
def test_runtime_blocks_skip_and_give_the_routed_modules_logits(granularity):
    """On the runtime, dynamic depth's blocks (executor depth-skip) decide per token; at batch 1 decode
    a skipped sublayer launches nothing but the attention's K and V (the cache stays whole). The
    logits and the counts equal the routed modules' (the reference); with one decision a layer the attention's
    block carries its decision to the FFN's."""
    from compresskit.runtime import Runtime, runtime_for
    from compresskit_baselines.depth_blocks import FollowingSkipMLP, SkipAttention, SkipMLP

    model = tiny_llama(num_hidden_layers=4)
    pruner = attach(model, granularity=granularity)
    pruner.finalize(model)
    model.eval()
    with torch.no_grad():
        for _, proj in routed_projections(model):  # routers that skip about half the tokens
            if proj.router is not None:
                proj.router.up.bias.copy_(torch.tensor([0.0, 0.0]))
    fast, ref = runtime_for(model, pruner), Runtime(model, executor=ModulesExecutor())
    blocks = [b for pair in fast.blocks for b in pair]
    skipping = [b for b in blocks if isinstance(b, (SkipAttention, SkipMLP, FollowingSkipMLP))]
    assert len(skipping) == 8 and fast.mode == "eager"
    prompts = [[5, 6, 7, 8, 9, 10], [7, 8, 9]]
    for batch in (prompts[:1], prompts):
        fast.reset_counts(pruner)
        got = fast.generate(batch, max_new_tokens=6)
        counted = fast.counted_sparsity(pruner)  # the skipping blocks', else the pruner's modules'
        pruner.reset_sparsity(model)
        want = ref.generate(batch, max_new_tokens=6)
        assert got.tokens == want.tokens
        assert counted.macs == pytest.approx(pruner.sparsity(model).macs) and 0 < counted.macs < 1
    if skipping:  # batch 1 decode: a skipped attention never computes its queries
        calls = []
        for a, _ in fast.blocks:  # the queries' heads are made once per attention that runs
            a.heads = lambda *args, heads=a.heads: calls.append(1) or heads(*args)
        fast.generate(prompts[:1], max_new_tokens=6)
        for a, _ in fast.blocks:
            del a.heads
        assert 4 <= len(calls) < 4 * 6  # the prompt's pass in every layer, then only the kept decode steps
    if skipping:  # compiled (a GPU also replays it as a CUDA graph): every sublayer runs, skipped ones zeroed
        compiled = runtime_for(model, pruner, compile=True)
        assert compiled.mode == "compiled"
        pruner.reset_sparsity(model)
        want = ref.generate(prompts[:1], max_new_tokens=6).tokens
        assert compiled.generate(prompts[:1], max_new_tokens=6).tokens == want
    cache = [rt.new_cache(1, 12) for rt in (fast, ref)]
    prompt = torch.tensor([[5, 6, 7, 8]])
    with torch.no_grad():
        for rt, c in zip((fast, ref), cache, strict=True):
            rt.forward(prompt, c)
        for token in (9, 10, 11, 12, 13):
            a, b = (rt.decode(torch.tensor([token]), c) for rt, c in zip((fast, ref), cache, strict=True))
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
        for i in range(4):  # the caches hold the same keys and values, skipped or not
            torch.testing.assert_close(cache[0].keys[i][:, :, :9], cache[1].keys[i][:, :, :9])


@pytest.mark.slow
def test_distilled_lora_recovery_merges_and_reloads(tiny_model_dir, tmp_path):
    """The distillation recipes' recovery for dynamic depth, small: the router stage, then LoRA with
    distillation merged at the end, through ``apply``. The saved model reloads without adapters, with
    the logits of the model the run evaluated, and the runtime can compile and graph it (nothing in it
    keeps state between calls)."""
    from compresskit import artifacts
    from compresskit.api import apply
    from compresskit.evaluate import evaluate
    from compresskit.recipe import load_recipe
    from compresskit.runtime import runtime_for

    distill = {"weight": 0.5, "temperature": 2.0}
    stage = {"batch_size": 2, "seq_len": 32, "distill": distill}
    recipe = {
        "name": "dd-distill",
        "model": {"name_or_path": str(tiny_model_dir), "dtype": "float32", "device": "cpu"},
        "data": {"calibration": {"n_samples": 4, "seq_len": 32, "batch_size": 2}},
        "pruner": {"name": "dynamic-depth", "config": {"target_sparsity": 0.5, "router_rank": 4}},
        "training": [
            {"name": "router", "config": {"steps": 2, "lr": 1e-2, **stage}},
            {"name": "lora", "config": {"steps": 2, "lr": 1e-2, "r": 4, "merge": True, **stage}},
        ],
        "evaluation": {"tasks": ["perplexity"], "perplexity_docs": 1, "max_length": 256, "compare_dense": False},
        "output": {"dir": str(tmp_path / "run")},
    }
    result = apply(recipe)
    model, tok, pruner = artifacts.load(tmp_path / "run" / "model", device="cpu", dtype="float32")
    assert not any("lora_" in name for name, _ in model.named_parameters())
    assert runtime_for(model, pruner).eager_reason is None
    rec = load_recipe(recipe).recipe
    again = evaluate(model.eval(), tok, DataModule.from_section(tok, rec.data), rec.evaluation)
    want = result.results["metrics"]["perplexity"]["token_perplexity"]
    assert again.tasks["perplexity"].metrics["token_perplexity"] == pytest.approx(want, rel=1e-5)
    assert [st["stage"] for st in result.results["training"]] == ["router", "lora"]
