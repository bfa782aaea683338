"""WIDE on a CUDA device (skipped without one): bf16 model with fp32 routers under autocast,
training steps, cached decoding and save/load on the GPU."""

import pytest
import torch

pytestmark = pytest.mark.gpu


def test_router_stage_on_gpu_bf16(tiny_model_dir, tmp_path):
    from compresskit import artifacts
    from compresskit.api import apply

    recipe = {
        "model": {"name_or_path": str(tiny_model_dir), "dtype": "auto", "device": "auto"},
        "pruner": {"name": "wide", "config": {"ffn_group_size": 16, "router_rank": 8}},
        "training": [
            {"name": "router", "config": {"steps": 20, "batch_size": 4, "seq_len": 64, "lr": 1e-2}},
            {"name": "lora", "config": {"steps": 5, "batch_size": 4, "seq_len": 64, "r": 4, "alpha": 8}},
        ],
        "evaluation": {"tasks": ["piqa"], "limit": 8, "batch_size": 8, "max_length": 512, "compare_dense": False},
        "output": {"dir": str(tmp_path / "run")},
    }
    res = apply(recipe).results
    assert res["model"]["dtype"] == "bfloat16" and res["model"]["device"].startswith("cuda")
    assert all(t["final_loss"] == t["final_loss"] for t in res["training"])  # finite, not NaN
    assert all(t["peak_memory_bytes"] > 0 for t in res["training"])
    assert "peak GPU memory" in (tmp_path / "run" / "results.md").read_text()
    assert 0.0 < res["sparsity"]["groups"]["mean"] < 1.0
    model, _, pruner = artifacts.load(tmp_path / "run" / "model")
    assert all(p.dtype == torch.float32 and p.is_cuda for p in pruner.trainable_parameters(model))
    model2, _, _ = artifacts.load(tmp_path / "run" / "model")
    ids = torch.randint(2, 300, (2, 16), device="cuda")
    with torch.no_grad():
        assert torch.equal(model(ids).logits, model2(ids).logits)
        out = model.generate(ids[:1, :6], max_new_tokens=6, do_sample=False, use_cache=True, pad_token_id=1)
        ref = model.generate(ids[:1, :6], max_new_tokens=6, do_sample=False, use_cache=False, pad_token_id=1)
    assert torch.equal(out, ref)
