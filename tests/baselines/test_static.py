"""Static baselines on a tiny Llama: the right layers / heads / channel groups are removed, the
saved models load with stock transformers and give identical logits."""

import copy

import pytest
import torch
from transformers import AutoModelForCausalLM

from compresskit import artifacts
from compresskit.interfaces import RunContext
from compresskit.modeling import load_model
from compresskit.testing import random_batches, tiny_llama
from compresskit_baselines.static_depth import StaticDepthConfig, StaticDepthPruner
from compresskit_baselines.static_width import StaticWidthConfig, StaticWidthPruner, choose_counts


def run(pruner, model):
    pruner.prepare(model, RunContext(model_config=model.config))
    pruner.calibrate(model, random_batches(model.config.vocab_size, n=3, batch=2, seq_len=16))
    return pruner.finalize(model)


def ids():
    return torch.randint(2, 300, (2, 12), generator=torch.Generator().manual_seed(1))


# -- static depth ---------------------------------------------------------------------------------


def test_static_depth_removes_the_least_influential_layer():
    model = tiny_llama(num_hidden_layers=4)
    with torch.no_grad():  # layer 2 adds nothing to the residual: block influence 0
        model.model.layers[2].self_attn.o_proj.weight.zero_()
        model.model.layers[2].mlp.down_proj.weight.zero_()
    reference = copy.deepcopy(model)
    pruner = StaticDepthPruner(StaticDepthConfig(n_layers=1, keep_first=0, keep_last=0))
    model = run(pruner, model)
    assert pruner.summary(model).details["removed_layers"] == [2]
    assert model.config.num_hidden_layers == 3 and len(model.model.layers) == 3
    assert [layer.self_attn.layer_idx for layer in model.model.layers] == [0, 1, 2]
    with torch.no_grad():  # removing a layer that adds nothing changes nothing
        torch.testing.assert_close(model(ids()).logits, reference(ids()).logits)
    rep = pruner.sparsity(model)
    assert rep.macs == pytest.approx(0.25) and rep.to_dict()["per_layer"][2] == {"attention": 1.0, "ffn": 1.0}


def test_static_depth_keeps_first_and_last_and_validates_counts():
    from compresskit.errors import RecipeError

    with pytest.raises(ValueError, match="not both"):
        StaticDepthConfig(target_sparsity=0.5, n_layers=2)
    model = tiny_llama(num_hidden_layers=3)
    with pytest.raises(RecipeError, match="removing 2 of 3 layers is not possible"):
        StaticDepthPruner(StaticDepthConfig(n_layers=2)).prepare(model, RunContext(model_config=model.config))


def test_static_depth_saves_a_stock_model(tmp_path, tiny_model_dir):
    model, tok = load_model(str(tiny_model_dir), dtype="float32", device="cpu")
    pruner = StaticDepthPruner(StaticDepthConfig(n_layers=1, keep_first=0, keep_last=0))
    model = run(pruner, model)
    out = artifacts.save(
        tmp_path / "m", model, tok, base_model=str(tiny_model_dir), pruner_name="static-depth", pruner=pruner
    )
    stock = AutoModelForCausalLM.from_pretrained(out).eval()  # no compresskit code involved
    with torch.no_grad():
        assert torch.equal(stock(ids()).logits, model(ids()).logits)
        cached = stock.generate(ids()[:1, :5], max_new_tokens=5, do_sample=False, use_cache=True, pad_token_id=1)
        plain = stock.generate(ids()[:1, :5], max_new_tokens=5, do_sample=False, use_cache=False, pad_token_id=1)
    assert torch.equal(cached, plain)
    assert stock.config.num_hidden_layers == 1
    # the realised sparsity travels with the checkpoint
    _, _, loaded = artifacts.load(out, dtype="float32", device="cpu")
    assert loaded.sparsity(stock).macs == pytest.approx(0.5)


# -- static width ---------------------------------------------------------------------------------


def test_counts_match_the_mac_target():
    cfg = {
        "hidden_size": 576,
        "num_hidden_layers": 30,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "head_dim": 64,
        "intermediate_size": 1536,
    }  # SmolLM2-135M
    for target in (0.25, 0.5):
        a, f, frac = choose_counts(cfg, StaticWidthConfig(target_sparsity=target))
        assert abs(frac - target) < 0.05, (target, a, f, frac)


def test_static_width_removes_the_lowest_scoring_units_exactly():
    model = tiny_llama()  # 6 query heads in 2 KV groups of 3, FFN 96 = 6 groups of 16
    with torch.no_grad():
        for layer in model.model.layers:
            layer.mlp.gate_proj.weight[32:48].mul_(1e-3)  # FFN group 2: tiny weights
            layer.self_attn.q_proj.weight[8:16].mul_(1e-3)  # head 1 (KV group 0)
            layer.self_attn.q_proj.weight[32:40].mul_(1e-3)  # head 4 (KV group 1)
    config = StaticWidthConfig(target_sparsity=0.3, ffn_group_size=16)
    a, f, _ = choose_counts(
        {
            "hidden_size": 48,
            "num_hidden_layers": 2,
            "num_attention_heads": 6,
            "num_key_value_heads": 2,
            "head_dim": 8,
            "intermediate_size": 96,
        },
        config,
    )
    assert (a, f) == (1, 2)
    dense = copy.deepcopy(model)
    pruner = StaticWidthPruner(config)
    model = run(pruner, model)
    removed = pruner._removed
    assert removed["heads"] == [[1, 4], [1, 4]]
    assert all(2 in groups for groups in removed["ffn_groups"])
    assert model.config.num_attention_heads == 4 and model.config.num_key_value_heads == 2
    assert model.config.intermediate_size == 64 and model.config.head_dim == 8
    # the smaller model computes exactly what the dense one does with those units zeroed
    with torch.no_grad():
        for i, layer in enumerate(dense.model.layers):
            for h in removed["heads"][i]:
                layer.self_attn.o_proj.weight[:, h * 8 : (h + 1) * 8] = 0
            for g in removed["ffn_groups"][i]:
                layer.mlp.down_proj.weight[:, g * 16 : (g + 1) * 16] = 0
        torch.testing.assert_close(model(ids()).logits, dense(ids()).logits, rtol=1e-5, atol=1e-5)
    rep = pruner.sparsity(model)
    assert rep.macs == pytest.approx(pruner.summary(model).details["planned_mac_fraction"], abs=1e-6)


@pytest.mark.parametrize(
    ("attention", "score"), [("kv_groups", "wanda"), ("per_kv_group", "magnitude"), ("none", "wanda")]
)
def test_static_width_modes_save_stock_models(attention, score, tmp_path, tiny_model_dir):
    model, tok = load_model(str(tiny_model_dir), dtype="float32", device="cpu")
    pruner = StaticWidthPruner(
        StaticWidthConfig(target_sparsity=0.4, ffn_group_size=16, attention=attention, score=score)
    )
    model = run(pruner, model)
    if attention == "kv_groups":
        assert model.config.num_key_value_heads == 1 and model.config.num_attention_heads == 3
    out = artifacts.save(
        tmp_path / "m", model, tok, base_model=str(tiny_model_dir), pruner_name="static-width", pruner=pruner
    )
    stock = AutoModelForCausalLM.from_pretrained(out).eval()
    with torch.no_grad():
        assert torch.equal(stock(ids()).logits, model(ids()).logits)
    assert sum(p.numel() for p in stock.parameters()) < sum(
        p.numel() for p in tiny_llama(vocab_size=len(tok)).parameters()
    )
    assert stock.config.compresskit_pruning["method"] == "static-width"


def test_static_width_target_too_small_is_a_clear_error():
    from compresskit.errors import RecipeError

    model = tiny_llama()
    with pytest.raises(RecipeError, match="rounds to removing nothing"):
        StaticWidthPruner(StaticWidthConfig(target_sparsity=0.01, ffn_group_size=48)).prepare(
            model, RunContext(model_config=model.config)
        )


def test_static_width_with_lora_recovery_saves_a_stock_model(tmp_path, tiny_model_dir):
    """Static width, then the LoRA recovery stage merged into the weights, through ``apply``: the
    saved model is still a plain (smaller) Llama that stock transformers loads, and its weights are
    the recovered ones (they differ from the one-shot run's, same shapes)."""
    import yaml

    from compresskit.api import apply
    from compresskit.recipe import load_recipe

    def run_recipe(name, training):
        recipe = {
            "name": name,
            "seed": 0,
            "model": {"name_or_path": str(tiny_model_dir), "dtype": "float32", "device": "cpu"},
            "data": {"calibration": {"n_samples": 4, "seq_len": 32, "batch_size": 2}},
            "pruner": {"name": "static-width", "config": {"target_sparsity": 0.4, "ffn_group_size": 16}},
            "training": training,
            "evaluation": {"tasks": ["piqa"], "limit": 4, "batch_size": 4, "max_length": 512, "compare_dense": False},
            "output": {"dir": str(tmp_path / name)},
        }
        (tmp_path / f"{name}.yaml").write_text(yaml.safe_dump(recipe))
        apply(load_recipe(tmp_path / f"{name}.yaml"))
        return AutoModelForCausalLM.from_pretrained(tmp_path / name / "model").eval()  # no compresskit code

    lora = {"steps": 3, "batch_size": 2, "seq_len": 32, "lr": 1e-2, "r": 4, "merge": True}
    recovered = run_recipe("lora", [{"name": "lora", "config": lora}])
    one_shot = run_recipe("one-shot", [{"name": "none"}])
    assert not any("lora" in name for name, _ in recovered.named_parameters())
    assert recovered.config.intermediate_size == one_shot.config.intermediate_size < 96  # still the pruned width
    a, b = recovered.state_dict(), one_shot.state_dict()
    assert a.keys() == b.keys() and all(a[k].shape == b[k].shape for k in a)
    changed = [k for k in a if not torch.equal(a[k], b[k])]
    assert any(k.endswith("down_proj.weight") for k in changed)  # the adapters were folded in
    with torch.no_grad():
        assert torch.isfinite(recovered(ids()).logits).all()


def test_static_width_distills_from_a_kept_copy(tmp_path, tiny_model_dir, monkeypatch):
    """A static pruner removes weights, so it cannot show the dense model: ``apply`` keeps a copy of
    the model from before the pruner for a distilling stage, and the stage reports its KL."""
    import copy as copy_module

    from compresskit import distill
    from compresskit.api import apply

    assert distill.needs_copy(StaticWidthPruner(StaticWidthConfig(target_sparsity=0.4)))
    from compresskit.trainers import LoraTrainer

    widths = []  # the FFN width the LoRA stage trains: the pruned one
    real_setup = LoraTrainer.setup
    monkeypatch.setattr(
        LoraTrainer, "setup", lambda self, m, *a: widths.append(m.config.intermediate_size) or real_setup(self, m, *a)
    )
    copies = []
    real = copy_module.deepcopy
    monkeypatch.setattr(copy_module, "deepcopy", lambda m, *a: copies.append(type(m).__name__) or real(m, *a))
    lora = {"steps": 4, "batch_size": 2, "seq_len": 32, "lr": 1e-2, "r": 4, "distill": {"weight": 0.5, "top_k": 20}}
    recipe = {
        "name": "distilled",
        "model": {"name_or_path": str(tiny_model_dir), "dtype": "float32", "device": "cpu"},
        "data": {"calibration": {"n_samples": 4, "seq_len": 32, "batch_size": 2}},
        "pruner": {"name": "static-width", "config": {"target_sparsity": 0.4, "ffn_group_size": 16}},
        "training": [{"name": "lora", "config": lora}],
        "evaluation": {"tasks": ["piqa"], "limit": 4, "batch_size": 4, "max_length": 512, "compare_dense": False},
        "output": {"dir": str(tmp_path / "run")},
    }
    res = apply(recipe).results
    assert "LlamaForCausalLM" in copies  # the teacher, taken before the pruner
    assert len(widths) == 1 and widths[0] < 96  # the tiny model's FFN is 96 wide: LoRA trained the pruned one
    history = res["training"][0]["history"]
    # the pruner prunes before training, so the student starts pruned and the teacher dense
    assert len(history) == 4 and all(h["kl"] > 0 for h in history), history


@pytest.mark.parametrize("kind", ["depth", "width"])
def test_static_models_run_unchanged_on_the_runtime(kind):
    """A static-depth model (fewer layers) and a static-width one (fewer heads and FFN channels)
    give the runtime transformers' logits, prefill and decode."""
    from compresskit.runtime import Runtime

    model = tiny_llama(num_hidden_layers=4).eval()
    if kind == "depth":
        pruner = StaticDepthPruner(StaticDepthConfig(n_layers=1, keep_first=0, keep_last=0))
    else:
        pruner = StaticWidthPruner(StaticWidthConfig(target_sparsity=0.4, ffn_group_size=16))
    model = run(pruner, model)
    rt = Runtime(model)
    x = ids()
    cache = rt.new_cache(x.shape[0], x.shape[1] + 1)
    nxt = torch.full((x.shape[0], 1), 7)
    with torch.no_grad():
        torch.testing.assert_close(rt.forward(x, cache), model(x).logits, rtol=1e-5, atol=1e-5)
        full = model(torch.cat([x, nxt], dim=1)).logits[:, -1:]
        torch.testing.assert_close(rt.forward(nxt, cache), full, rtol=1e-5, atol=1e-5)
