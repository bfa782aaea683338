"""A WIDE model on the runtime: its routed modules run as they are (the masked dense reference), so
the runtime gives the model's own logits, and the realised sparsity is counted on real tokens only."""

import torch

from compresskit import plugins
from compresskit.interfaces import RunContext
from compresskit.modeling import load_model
from compresskit.routing import routed_projections
from compresskit.runtime import Runtime


def test_wide_model_on_the_runtime_gives_its_own_logits(tiny_model_dir):
    model, tok = load_model(str(tiny_model_dir), dtype="float32", device="cpu")
    cls = plugins.load("pruner", "wide")
    pruner = cls(cls.Config(ffn_group_size=16, router_rank=8))
    pruner.prepare(model, RunContext(model_config=model.config, tokenizer=tok, seed=0))
    model = pruner.finalize(model).eval()
    ids = torch.randint(2, 300, (2, 10), generator=torch.Generator().manual_seed(0))
    rt = Runtime(model)
    cache = rt.new_cache(2, 11)
    nxt = torch.full((2, 1), 9)
    with torch.no_grad():
        torch.testing.assert_close(rt.forward(ids, cache), model(ids).logits, rtol=1e-5, atol=1e-5)
        full = model(torch.cat([ids, nxt], dim=1)).logits[:, -1:]
        torch.testing.assert_close(rt.forward(nxt, cache), full, rtol=1e-5, atol=1e-5)
    # left padding: the padded slots are not counted as routed tokens
    pruner.reset_sparsity(model)
    res = rt.generate([[5, 6, 7, 8, 9], [5, 6]], max_new_tokens=3)
    deciders = [p for _, p in routed_projections(model) if p.router is not None]
    assert all(p.stat_tokens.item() == 5 + 2 + 2 * 2 for p in deciders)  # the prompts' 7, then 2 decode steps of 2
    assert [len(t) for t in res.tokens] == [3, 3]


def test_bench_of_a_saved_wide_run_reports_its_realised_sparsity(capsys, tiny_model_dir, tmp_path):
    import json

    from compresskit.api import apply
    from compresskit.cli import main

    run = tmp_path / "run"
    recipe = {
        "model": {"name_or_path": str(tiny_model_dir), "dtype": "float32", "device": "cpu"},
        "pruner": {"name": "wide", "config": {"ffn_group_size": 16, "router_rank": 8}},
        "evaluation": {"tasks": ["piqa"], "limit": 2, "batch_size": 2, "max_length": 512, "compare_dense": False},
        "output": {"dir": str(run)},
    }
    apply(recipe)
    argv = ["bench", str(run / "model"), "--prompt", "8", "--new-tokens", "3", "--repeats", "1", "--dtype", "float32"]
    code = main([*argv, "--output", str(tmp_path / "b")])
    assert code == 0, capsys.readouterr().err
    rows = json.loads((tmp_path / "b" / "bench.json").read_text())["results"]
    assert [r["model"] for r in rows] == ["compressed", "dense", "dense (transformers)"]
    assert 0.2 < rows[0]["sparsity_macs"] < 0.8 and rows[1]["sparsity_macs"] is None  # untrained routers: about half
