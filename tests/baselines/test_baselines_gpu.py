"""Baselines on a CUDA device (skipped without one): bf16 runs end to end and reload."""

import pytest
import torch

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize(
    ("name", "config", "training"),
    [
        ("static-width", {"target_sparsity": 0.3, "ffn_group_size": 16}, []),
        ("static-depth", {"n_layers": 1, "keep_first": 0, "keep_last": 0}, []),
        (
            "dynamic-depth",
            {"target_sparsity": 0.3, "router_rank": 8},
            [{"name": "router", "config": {"steps": 10, "batch_size": 4, "seq_len": 64}}],
        ),
    ],
)
def test_baseline_on_gpu(name, config, training, tiny_model_dir, tmp_path):
    from compresskit import artifacts
    from compresskit.api import apply

    recipe = {
        "model": {"name_or_path": str(tiny_model_dir), "dtype": "auto", "device": "auto"},
        "data": {"calibration": {"n_samples": 4, "seq_len": 32, "batch_size": 2}},
        "pruner": {"name": name, "config": config},
        "training": training,
        "evaluation": {"tasks": ["piqa"], "limit": 8, "batch_size": 8, "max_length": 512, "compare_dense": False},
        "output": {"dir": str(tmp_path / "run")},
    }
    res = apply(recipe).results
    assert res["model"]["dtype"] == "bfloat16" and res["model"]["device"].startswith("cuda")
    assert 0.0 <= res["sparsity"]["macs"] < 1.0
    assert res["sparsity"]["dynamic"] == (name == "dynamic-depth")
    if name != "dynamic-depth":  # static: exactly what was planned; dynamic: whatever argmax realises
        assert res["sparsity"]["macs"] > 0.0
    model, _, _ = artifacts.load(tmp_path / "run" / "model")
    model2, _, _ = artifacts.load(tmp_path / "run" / "model")
    ids = torch.randint(2, 300, (2, 16), device="cuda")
    with torch.no_grad():
        assert torch.equal(model(ids).logits, model2(ids).logits)
