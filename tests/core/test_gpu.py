"""The pipeline on a CUDA device (skipped without one): the evaluator runs where the model is,
in bf16 by default, and agrees with the fp32 CPU reference."""

import pytest
import torch

pytestmark = pytest.mark.gpu


def test_apply_on_gpu_matches_cpu(tiny_recipe, tmp_path):
    from compresskit.api import apply

    recipe = dict(tiny_recipe)
    recipe["pruner"] = {"name": "toy-magnitude", "config": {"sparsity": 0.3}}
    recipe["evaluation"] = {**recipe["evaluation"], "compare_dense": False}
    cpu = apply({**recipe, "output": {"dir": str(tmp_path / "cpu")}}).results
    gpu_fp32 = apply(
        {**recipe, "model": {**recipe["model"], "device": "cuda"}, "output": {"dir": str(tmp_path / "gpu32")}}
    ).results
    gpu_auto = apply(
        {
            **recipe,
            "model": {**recipe["model"], "device": "auto", "dtype": "auto"},
            "output": {"dir": str(tmp_path / "gpu")},
        }
    ).results
    assert gpu_fp32["model"]["device"].startswith("cuda") and gpu_auto["model"]["dtype"] == "bfloat16"
    # evaluation.engine auto: the runtime on a GPU (the reference path, transformers, on the CPU)
    assert gpu_fp32["evaluation"]["engine"].startswith("runtime") and cpu["evaluation"]["engine"] == "transformers"
    assert gpu_fp32["metrics"]["perplexity"]["token_perplexity"] == pytest.approx(
        cpu["metrics"]["perplexity"]["token_perplexity"], rel=1e-3
    )
    assert gpu_auto["metrics"]["perplexity"]["token_perplexity"] == pytest.approx(
        cpu["metrics"]["perplexity"]["token_perplexity"], rel=0.05
    )
    assert gpu_fp32["sparsity"] == cpu["sparsity"]  # same fp32 weights: the same weights are masked
    # bf16 weights have ties at the magnitude threshold: a few more weights may fall under it
    assert gpu_auto["sparsity"]["ffn"] == pytest.approx(cpu["sparsity"]["ffn"], abs=0.005)


def test_saved_model_reloads_on_gpu(tiny_model_dir, tmp_path):
    from compresskit import artifacts, plugins
    from compresskit.interfaces import RunContext
    from compresskit.modeling import load_model

    model, tok = load_model(str(tiny_model_dir), dtype="bfloat16", device="cuda")
    cls = plugins.load("pruner", "toy-magnitude")
    pruner = cls(cls.Config(sparsity=0.5))
    pruner.prepare(model, RunContext(model_config=model.config, tokenizer=tok, device=torch.device("cuda")))
    model = pruner.finalize(model)
    out = artifacts.save(
        tmp_path / "m", model, tok, base_model=str(tiny_model_dir), pruner_name="toy-magnitude", pruner=pruner
    )
    model2, _, _ = artifacts.load(out, dtype="bfloat16", device="cuda")
    ids = torch.randint(2, 300, (2, 16), device="cuda")
    with torch.no_grad():
        assert torch.equal(model(ids).logits, model2(ids).logits)
