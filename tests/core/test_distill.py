"""The distillation term: KL of the next-token distributions, the LoRA-free view of a model."""

import pytest
import torch

from compresskit.distill import DistillConfig, kl_loss, lora_off


def test_kl_is_zero_when_student_equals_teacher_and_positive_otherwise():
    gen = torch.Generator().manual_seed(0)
    t = torch.randn(2, 5, 50, generator=gen)
    s = torch.randn(2, 5, 50, generator=gen)
    for kw in ({}, {"temperature": 2.0}, {"top_k": 7}):
        assert kl_loss(t, t, **kw).item() == pytest.approx(0.0, abs=1e-6)
        assert kl_loss(s, t, **kw).item() > 0.05
    # T^2 scaling; the mask averages over the real tokens only (whatever the padded positions hold)
    mask = torch.ones(2, 5)
    mask[1, 3:] = 0
    garbage = s.clone()
    garbage[1, 3:] = 1e4
    assert kl_loss(garbage, t, mask).item() == pytest.approx(kl_loss(s, t, mask).item())
    full = kl_loss(s, t, mask)
    by_hand = sum(kl_loss(s[b, :n][None], t[b, :n][None]) * n for b, n in ((0, 5), (1, 3))) / 8
    assert full.item() == pytest.approx(by_hand.item(), rel=1e-5)


def test_kl_with_top_k_of_the_whole_vocabulary_is_the_full_kl():
    gen = torch.Generator().manual_seed(1)
    s, t = torch.randn(1, 4, 30, generator=gen), torch.randn(1, 4, 30, generator=gen)
    assert kl_loss(s, t, top_k=30).item() == pytest.approx(kl_loss(s, t).item(), rel=1e-5)


def test_config_bounds():
    with pytest.raises(ValueError):
        DistillConfig(weight=0.0)
    with pytest.raises(ValueError):
        DistillConfig(temperature=0)
    assert DistillConfig().weight == 0.5


def test_lora_off_gives_the_base_model_and_leaves_training_flags(tiny_model_dir):
    from compresskit.modeling import load_model
    from compresskit.trainers import LoraStageConfig, inject_lora, lora_parameters

    model, _ = load_model(str(tiny_model_dir), dtype="float32", device="cpu")
    ids = torch.randint(2, 300, (1, 9))
    with torch.no_grad():
        base = model(ids).logits
    inject_lora(model, LoraStageConfig(r=2, alpha=4))
    model.eval()  # the new adapters' dropout too
    params = lora_parameters(model)
    with torch.no_grad():
        for p in params:
            p.add_(0.5)  # adapters that change the output
        adapted = model(ids).logits
        with lora_off(model):
            off = model(ids).logits
    assert not torch.allclose(adapted, base)
    torch.testing.assert_close(off, base)
    flags = [p.requires_grad for p in params]
    with lora_off(model):
        pass
    assert [p.requires_grad for p in params] == flags
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, adapted)


def test_cache_needs_top_k():
    with pytest.raises(ValueError, match="cache: true keeps the teacher's top-k logits: set top_k"):
        DistillConfig(cache=True)
    assert DistillConfig(cache=True, top_k=8).cache


def test_kl_on_given_top_k_is_the_top_k_kl():
    from compresskit.distill import kl_loss_on

    gen = torch.Generator().manual_seed(2)
    s, t = torch.randn(2, 4, 30, generator=gen), torch.randn(2, 4, 30, generator=gen)
    values, idx = t.topk(5, dim=-1)
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]])
    want = kl_loss(s, t, mask, temperature=2.0, top_k=5)
    assert kl_loss_on(s, values, idx.int(), mask, temperature=2.0).item() == pytest.approx(want.item())


@pytest.mark.slow
@pytest.mark.parametrize("pruner", ["toy-router", "static-width"])
def test_cached_top_k_teacher_trains_what_the_live_teacher_trains(pruner, tiny_model_dir, tmp_path, monkeypatch):
    """``cache: true``: the dense model's top-k logits of every micro-batch are written once before the
    pruner attaches; the stages then read them (no teacher pass, no copy of the dense model for a
    static pruner) and train exactly what the live teacher trains; a second run reuses the files."""
    import copy

    from compresskit.api import apply

    monkeypatch.setenv("COMPRESSKIT_CACHE", str(tmp_path / "cache"))
    configs = {
        "toy-router": {"groups": 6, "rank": 8},
        "static-width": {"target_sparsity": 0.3, "ffn_group_size": 16},
    }
    distill = {"weight": 0.5, "temperature": 2.0, "top_k": 8}
    lora = {"steps": 3, "batch_size": 2, "seq_len": 32, "r": 2, "grad_accum": 2}
    training = [{"name": "lora", "config": {**lora, "distill": distill}}]
    if pruner == "toy-router":
        training.insert(
            0, {"name": "router", "config": {"steps": 2, "batch_size": 2, "seq_len": 32, "distill": distill}}
        )
    base = {
        "model": {"name_or_path": str(tiny_model_dir), "dtype": "float32", "device": "cpu"},
        "data": {"calibration": {"n_samples": 4, "seq_len": 32, "batch_size": 2}},
        "pruner": {"name": pruner, "config": configs[pruner]},
        "training": training,
        "evaluation": {"tasks": ["perplexity"], "perplexity_docs": 1, "compare_dense": False, "max_length": 128},
    }
    live = apply({**base, "output": {"dir": str(tmp_path / "live")}}).results
    cached_recipe = copy.deepcopy(base)
    for stage in cached_recipe["training"]:
        stage["config"]["distill"]["cache"] = True
    copies = []
    real_deepcopy = copy.deepcopy
    monkeypatch.setattr(copy, "deepcopy", lambda obj, *a: copies.append(type(obj).__name__) or real_deepcopy(obj, *a))
    cached = apply({**cached_recipe, "output": {"dir": str(tmp_path / "cached")}}).results
    assert not any("ForCausalLM" in name for name in copies)  # no copy of the dense model was kept
    for a, b in zip(live["training"], cached["training"], strict=True):
        for x, y in zip(a["history"], b["history"], strict=True):
            assert x["kl"] == pytest.approx(y["kl"], rel=1e-5) and x["loss"] == pytest.approx(y["loss"], rel=1e-5)
    files = sorted((tmp_path / "cache" / "teacher").rglob("mb*.safetensors"))
    assert len(files) == sum(s["config"]["steps"] * s["config"].get("grad_accum", 1) for s in training)
    stamps = [f.stat().st_mtime_ns for f in files]
    again = apply({**cached_recipe, "output": {"dir": str(tmp_path / "again")}}).results  # the same batches
    assert sorted((tmp_path / "cache" / "teacher").rglob("mb*.safetensors")) == files
    assert [f.stat().st_mtime_ns for f in files] == stamps  # read, not rewritten
    assert again["training"][-1]["history"] == cached["training"][-1]["history"]
