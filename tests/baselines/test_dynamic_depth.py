"""Dynamic depth on a tiny Llama: skipped sublayers contribute exactly nothing, one decision per
layer gates both sublayers, cached decoding is exact, and the router stage meets the budget."""

import pytest
import torch

from compresskit.data import DataModule
from compresskit.interfaces import RunContext
from compresskit.modeling import load_model
from compresskit.routing import routed_projections
from compresskit.testing import tiny_llama
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
