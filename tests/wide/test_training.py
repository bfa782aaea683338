"""The router and LoRA training stages with the WIDE pruner, end to end on a tiny model:
sparsity is driven to its target, stages resume bit-exactly after an interruption, and saved
models (routers, LoRA, merged LoRA) reload with identical logits."""

import copy
import json
from pathlib import Path

import pytest
import torch

import compresskit.api as api
from compresskit import artifacts, plugins
from compresskit.api import apply
from compresskit.data import DataModule
from compresskit.interfaces import RunContext
from compresskit.modeling import load_model
from compresskit.trainers import (
    FinetuneStageConfig,
    FinetuneTrainer,
    LoraStageConfig,
    LoraTrainer,
    RouterTrainer,
    TrainStageConfig,
    even_subsample,
    lr_schedule,
    projection_names,
)


def recipe(tiny_model_dir, tmp_path, stages, **pruner_kw):
    return {
        "name": "wide-tiny",
        "seed": 3,
        "model": {"name_or_path": str(tiny_model_dir), "dtype": "float32", "device": "cpu"},
        "pruner": {"name": "wide", "config": {"ffn_group_size": 16, "router_rank": 8, **pruner_kw}},
        "training": stages,
        "evaluation": {"tasks": ["piqa"], "limit": 4, "batch_size": 4, "max_length": 512, "compare_dense": False},
        "output": {"dir": str(tmp_path / "run")},
    }


def stage(name, **kw):
    base = {"steps": 8, "batch_size": 2, "seq_len": 32, "checkpoint_every": 2}
    return {"name": name, "config": {**base, **kw}}


def test_lr_schedule_warmup_then_cosine_to_the_floor():
    config = TrainStageConfig(steps=100, lr=1.0, min_lr=0.2, warmup_ratio=0.1)
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=config.lr)
    sched = lr_schedule(opt, config)
    lrs = []
    for _ in range(101):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert lrs[5] == pytest.approx(0.5)  # linear warm-up over 10 steps
    assert lrs[10] == pytest.approx(1.0)  # the peak
    assert lrs[55] == pytest.approx(0.2 + 0.8 * 0.5)  # half-way down the cosine
    assert lrs[100] == pytest.approx(0.2)  # the floor
    assert all(a >= b for a, b in zip(lrs[10:], lrs[11:], strict=False))
    with pytest.raises(ValueError, match="min_lr"):
        TrainStageConfig(lr=1e-3, min_lr=1e-2)


def test_history_is_subsampled_evenly_keeping_both_ends():
    assert even_subsample(list(range(10)), 20) == list(range(10))
    picked = even_subsample(list(range(2001)), 5)
    assert picked == [0, 500, 1000, 1500, 2000]


@pytest.mark.slow
def test_router_stage_drives_sparsity_to_the_target(tiny_model_dir):
    model, tok = load_model(str(tiny_model_dir), dtype="float32", device="cpu")
    cls = plugins.load("pruner", "wide")
    results = {}
    for target in (0.2, 0.8):
        m = copy.deepcopy(model)
        pruner = cls(cls.Config(ffn_group_size=16, router_rank=8, target_sparsity=target))
        ctx = RunContext(model_config=m.config, tokenizer=tok, seed=0)
        pruner.prepare(m, ctx)
        data = DataModule(tok)
        summary = RouterTrainer(TrainStageConfig(steps=60, batch_size=2, seq_len=32, lr=2e-2)).fit(m, pruner, data, ctx)
        assert len(summary.history) == 60  # every step's entry, not the last few
        last = summary.history[-5:]
        results[target] = sum((h["sparsity_attention"] + h["sparsity_ffn"]) / 2 for h in last) / len(last)
        assert not m.training and all(not p.requires_grad for p in m.parameters())
    assert results[0.2] == pytest.approx(0.2, abs=0.12)
    assert results[0.8] == pytest.approx(0.8, abs=0.12)


@pytest.mark.slow
def test_two_stages_save_and_reload_with_identical_logits(tiny_model_dir, tmp_path):
    res = apply(recipe(tiny_model_dir, tmp_path, [stage("router"), stage("lora", r=4, alpha=8)]))
    out = tmp_path / "run"
    manifest = json.loads((out / "model" / "compresskit.json").read_text())
    assert manifest["format"] == "pruner"
    assert [s["name"] for s in manifest["training"]] == ["lora"]
    from safetensors.torch import load_file

    lora = load_file(str(out / "model" / manifest["training"][0]["file"]))
    assert lora and all("lora_" in k for k in lora)
    assert [t["stage"] for t in res.results["training"]] == ["router", "lora"]
    # on the CPU each stage's and task's peak is the process's resident peak (Linux reports it; 30 MB is less
    # than torch alone takes), named as such in results.md
    peaks = [t["peak_memory_bytes"] for t in res.results["training"]]
    peaks += [t["peak_memory_bytes"] for t in res.results["evaluation"]["tasks"].values()]
    assert all(p > 30 * 2**20 for p in peaks) if Path("/proc/self/status").exists() else all(p is None for p in peaks)
    text = (out / "results.md").read_text()
    note = next(ln for ln in text.splitlines() if ln.startswith("Training: "))
    assert note.startswith("Training: router ") and "; lora " in note and "final loss" in note and "GPU" not in note
    assert ("peak resident memory" in note) == Path("/proc/self/status").exists()
    assert res.results["sparsity"]["dynamic"] and res.results["sparsity"]["tokens"] > 0
    # reload twice: deterministic and identical to the model that was evaluated
    m1, _, p1 = artifacts.load(out / "model", dtype="float32", device="cpu")
    m2, _, _ = artifacts.load(out / "model", dtype="float32", device="cpu")
    ids = torch.randint(2, 300, (2, 16))
    with torch.no_grad():
        assert torch.equal(m1(ids).logits, m2(ids).logits)
    assert p1.state == "finalized"
    # and `eval` on the saved model reproduces the run's numbers
    ev = api.eval_model(
        str(out / "model"),
        evaluation=api.EvaluationSection(tasks=["piqa"], limit=4, batch_size=4, max_length=512),
        dtype="float32",
        device="cpu",
    )
    assert ev["metrics"] == res.results["metrics"]
    assert ev["sparsity"]["macs"] == res.results["sparsity"]["macs"]


@pytest.mark.slow
def test_lora_merged_export_matches_unmerged(tiny_model_dir, tmp_path):
    model, tok = load_model(str(tiny_model_dir), dtype="float32", device="cpu")
    cls = plugins.load("pruner", "wide")
    pruner = cls(cls.Config(ffn_group_size=16, router_rank=8))
    ctx = RunContext(model_config=model.config, tokenizer=tok, seed=0)
    pruner.prepare(model, ctx)
    data = DataModule(tok)
    trainer = LoraTrainer(LoraStageConfig(steps=4, batch_size=2, seq_len=32, r=4, alpha=8, lr=1e-2))
    trainer.fit(model, pruner, data, ctx)
    ids = torch.randint(2, 300, (2, 16))
    merged = copy.deepcopy(model)
    from compresskit.modeling import merge_lora

    merge_lora(merged)
    assert not any("lora_" in n for n, _ in merged.named_parameters())
    with torch.no_grad():
        torch.testing.assert_close(merged(ids).logits, model(ids).logits, rtol=1e-4, atol=1e-4)
    # a run with merge: true saves the merged weights and reloads to identical logits
    res = apply(recipe(tiny_model_dir, tmp_path, [stage("router"), stage("lora", r=4, alpha=8, merge=True)]))
    out = tmp_path / "run" / "model"
    m1, _, _ = artifacts.load(out, dtype="float32", device="cpu")
    assert not any("lora_" in n for n, _ in m1.named_parameters())
    manifest = json.loads((out / "compresskit.json").read_text())
    from safetensors.torch import load_file

    assert all(k.startswith("merged.") for k in load_file(str(out / manifest["training"][0]["file"])))
    assert res.results["metrics"]["piqa"]["acc"] >= 0


@pytest.mark.slow
def test_a_run_with_its_lora_apart_runs_merged_on_the_runtime(tiny_model_dir, tmp_path):
    """A run saved with its LoRA adapters apart (no ``merge: true``): the inference loader (``bench``,
    ``generate``) folds them into the weights, so that WIDE's blocks run every layer (unmerged, the runtime
    refuses them in one line), with the logits of the run as evaluation loads it; the saved files stay as they were."""
    from compresskit.errors import RuntimeUnsupportedError
    from compresskit.runtime import load_for_runtime, runtime_for

    apply(recipe(tiny_model_dir, tmp_path, [stage("lora", r=4, alpha=8, steps=4, lr=1e-2)]))
    out = tmp_path / "run" / "model"
    saved = {f.name: f.read_bytes() for f in out.iterdir() if f.is_file()}
    unmerged, _, unmerged_pruner = artifacts.load(out, dtype="float32", device="cpu")
    assert any(p.abs().sum() > 0 for n, p in unmerged.named_parameters() if "lora_B" in n)  # the adapters moved
    with pytest.raises(RuntimeUnsupportedError, match="layer 0 carries LoRA adapters that are not merged"):
        runtime_for(unmerged, unmerged_pruner)
    model, _, pruner, base = load_for_runtime(str(out), dtype="float32", device="cpu")
    assert base == str(tiny_model_dir) and not any("lora_" in n for n, _ in model.named_parameters())
    rt = runtime_for(model, pruner)
    assert all(type(m).__name__ == "WideMLP" for _, m in rt.blocks) and rt.eager_reason is None
    ids = torch.randint(2, 300, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        got = rt.forward(ids, rt.new_cache(1, 12))
        torch.testing.assert_close(got, unmerged(ids).logits, rtol=1e-4, atol=1e-4)
    assert {f.name: f.read_bytes() for f in out.iterdir() if f.is_file()} == saved


@pytest.mark.slow
def test_finetune_stage_trains_the_projections_and_reloads(tiny_model_dir, tmp_path):
    """``finetune`` trains the projections' weights in full: they move, the saved run holds them
    (``finetuned.<name>.weight``) and reloads to the logits the run evaluated."""
    res = apply(recipe(tiny_model_dir, tmp_path, [stage("router"), stage("finetune", lr=1e-3)]))
    out = tmp_path / "run" / "model"
    manifest = json.loads((out / "compresskit.json").read_text())
    assert [s["name"] for s in manifest["training"]] == ["finetune"]
    from safetensors.torch import load_file

    saved = load_file(str(out / manifest["training"][0]["file"]))
    names = {k.removeprefix("finetuned.").removesuffix(".weight") for k in saved}
    assert all(k.startswith("finetuned.") for k in saved) and len(saved) == 7 * 2  # 7 projections, 2 layers
    assert any(n.endswith("down_proj.base_layer") for n in names)  # the routed projections' own weights
    base, _ = load_model(str(tiny_model_dir), dtype="float32", device="cpu")
    q = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.equal(saved["finetuned." + q], base.get_parameter(q))
    m1, _, _ = artifacts.load(out, dtype="float32", device="cpu")
    m2, _, _ = artifacts.load(out, dtype="float32", device="cpu")
    ids = torch.randint(2, 300, (2, 16))
    with torch.no_grad():
        assert torch.equal(m1(ids).logits, m2(ids).logits)
    ev = api.eval_model(
        str(out),
        evaluation=api.EvaluationSection(tasks=["piqa"], limit=4, batch_size=4, max_length=512),
        dtype="float32",
        device="cpu",
    )
    assert ev["metrics"] == res.results["metrics"]


def test_finetune_holds_fp32_weights_under_autocast_and_gives_the_dtype_back(tiny_model_dir):
    """On a GPU with bf16 autocast the trained weights are fp32 during the stage (AdamW's small updates
    would vanish in bf16) and the model's dtype again after it; without autocast they keep their dtype."""
    model, tok = load_model(str(tiny_model_dir), dtype="bfloat16", device="cpu")
    cls = plugins.load("pruner", "wide")
    pruner = cls(cls.Config(ffn_group_size=16, router_rank=8))
    pruner.prepare(model, RunContext(model_config=model.config, tokenizer=tok, seed=0))
    trainer = FinetuneTrainer(FinetuneStageConfig(target_modules=["q_proj", "down_proj"]))
    gpu = RunContext(model_config=model.config, tokenizer=tok, device=torch.device("cuda"))
    params = trainer.setup(model, pruner, gpu)
    names = projection_names(model, ["q_proj", "down_proj"])
    weights = [model.get_submodule(n).weight for n in names]
    assert len(weights) == 4 and all(w.dtype == torch.float32 and any(w is p for p in params) for w in weights)
    assert len(params) == 4 + len(pruner.trainable_parameters(model))
    assert model.model.layers[0].self_attn.k_proj.weight.dtype == torch.bfloat16  # not a target
    trainer.finish(model, pruner, gpu)
    assert all(w.dtype == torch.bfloat16 for w in weights)
    cpu = RunContext(model_config=model.config, tokenizer=tok, device=torch.device("cpu"))
    assert all(p.dtype == torch.bfloat16 for p in trainer.setup(model, None, cpu))
    from compresskit.errors import RecipeError

    with pytest.raises(RecipeError, match=r"finetune target_modules \['nope'\] matched no linear layer"):
        FinetuneTrainer(FinetuneStageConfig(target_modules=["nope"])).setup(model, None, cpu)


@pytest.mark.slow
def test_distilling_with_finetune_keeps_a_dense_copy_as_teacher(tiny_model_dir, tmp_path, monkeypatch):
    """Once a stage has moved the model's own weights (``finetune``, during it; a merged LoRA, after it),
    the model with its pruner off is no longer the dense model: a stage that distils then distils from a
    kept copy, even for WIDE, which otherwise shows the dense model itself."""
    import compresskit.trainers as trainers

    seen = []
    real = trainers.teacher_logits

    def spy(model, pruner, teacher, input_ids):
        seen.append(teacher is not None and teacher is not model)
        return real(model, pruner, teacher, input_ids)

    monkeypatch.setattr(trainers, "teacher_logits", spy)
    distill = {"weight": 0.5}
    runs = {
        "finetune distils": (
            [stage("router", steps=2, distill=distill), stage("finetune", steps=2, distill=distill)],
            True,
        ),
        "only before finetune": ([stage("router", steps=2, distill=distill), stage("finetune", steps=2)], False),
        "after a merged LoRA": (
            [stage("lora", steps=2, r=4, merge=True), stage("router", steps=2, distill=distill)],
            True,
        ),
        "WIDE alone": ([stage("router", steps=2, distill=distill)], False),  # the dense view, no copy
    }
    for i, (name, (stages, copied)) in enumerate(runs.items()):
        seen.clear()
        apply(recipe(tiny_model_dir, tmp_path / str(i), stages))
        assert seen and all(s == copied for s in seen), name


@pytest.mark.slow
def test_interrupted_training_resumes_bit_exactly(tiny_model_dir, tmp_path, monkeypatch):
    stages = [stage("router", steps=6), stage("lora", steps=4, r=4, alpha=8)]
    full = apply(recipe(tiny_model_dir, tmp_path / "a", stages))
    ref_model, _, _ = artifacts.load(tmp_path / "a" / "run" / "model", dtype="float32", device="cpu")

    from compresskit_wide.pruner import WidePruner

    original = WidePruner.on_train_step
    calls = {"n": 0}

    def interrupt(self, step, total):
        calls["n"] += 1
        if calls["n"] == 9:  # step 2 of the LoRA stage, after the router stage finished
            raise KeyboardInterrupt
        return original(self, step, total)

    monkeypatch.setattr(WidePruner, "on_train_step", interrupt)
    with pytest.raises(KeyboardInterrupt):
        apply(recipe(tiny_model_dir, tmp_path / "b", stages))
    partial = tmp_path / "b" / "run.partial"
    assert (partial / "work" / "stage0-router" / "checkpoint.pt").is_file()
    assert (partial / "work" / "stage1-lora" / "checkpoint.pt").is_file()
    monkeypatch.setattr(WidePruner, "on_train_step", original)
    resumed = apply(recipe(tiny_model_dir, tmp_path / "b", stages))
    model, _, _ = artifacts.load(tmp_path / "b" / "run" / "model", dtype="float32", device="cpu")
    ids = torch.randint(2, 300, (2, 16))
    with torch.no_grad():
        assert torch.equal(model(ids).logits, ref_model(ids).logits)
    assert resumed.results["metrics"] == full.results["metrics"]
    # the summaries count the whole stages, the steps before the interruption included
    for before, after in zip(full.results["training"], resumed.results["training"], strict=True):
        assert after["tokens"] == before["tokens"] > 0
        assert after["final_loss"] == before["final_loss"]
    assert resumed.results["training"][0]["seconds"] > 0.0  # finished before the interruption
    assert not partial.exists()


def test_router_stage_needs_a_pruner_with_parameters(tiny_model_dir, tmp_path):
    from compresskit.errors import RecipeError

    r = recipe(tiny_model_dir, tmp_path, [stage("router")])
    r.pop("pruner")
    with pytest.raises(RecipeError, match="has no pruner"):
        apply(r)


def test_checkpoint_of_another_config_is_refused(tiny_model_dir, tmp_path):
    from compresskit.errors import ArtifactError

    model, tok = load_model(str(tiny_model_dir), dtype="float32", device="cpu")
    cls = plugins.load("pruner", "wide")
    pruner = cls(cls.Config(ffn_group_size=16, router_rank=8))
    ctx = RunContext(model_config=model.config, tokenizer=tok, work_dir=tmp_path / "w")
    pruner.prepare(model, ctx)
    data = DataModule(tok)
    RouterTrainer(TrainStageConfig(steps=2, batch_size=2, seq_len=32)).fit(model, pruner, data, ctx)
    with pytest.raises(ArtifactError, match="different 'router' configuration"):
        RouterTrainer(TrainStageConfig(steps=3, batch_size=2, seq_len=32)).fit(model, pruner, data, ctx)
    (tmp_path / "w" / "checkpoint.pt").write_bytes(b"torn")
    with pytest.raises(ArtifactError, match="corrupt training checkpoint"):
        RouterTrainer(TrainStageConfig(steps=2, batch_size=2, seq_len=32)).fit(model, pruner, data, ctx)


def _saved_tensors(model_dir):
    from safetensors.torch import load_file

    return {f.name: load_file(str(f)) for f in sorted(model_dir.glob("*.safetensors"))}


def _assert_same_tensors(a, b):
    assert a.keys() == b.keys() and a
    for name in a:
        assert a[name].keys() == b[name].keys(), name
        for key in a[name]:
            assert torch.equal(a[name][key], b[name][key]), (name, key)


@pytest.mark.slow
def test_cold_and_warm_dense_cache_give_identical_saved_tensors(tiny_model_dir, tmp_path, monkeypatch):
    """Every random draw depends on the recipe only, not on whether the dense reference was computed
    (lm-eval reseeds the global generators) or found in the cache."""
    monkeypatch.setattr(api, "cache_dir", lambda: tmp_path / "cache")
    stages = [stage("router", steps=4), stage("lora", steps=3, r=4, alpha=8)]
    runs = []
    for name in ("cold", "warm"):
        r = recipe(tiny_model_dir, tmp_path / name, stages)
        r["evaluation"]["compare_dense"] = True
        runs.append(apply(r))
        assert len(list((tmp_path / "cache" / "dense").glob("*.json"))) == 1
    _assert_same_tensors(*(_saved_tensors(tmp_path / n / "run" / "model") for n in ("cold", "warm")))
    assert runs[0].results["metrics"] == runs[1].results["metrics"]


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["torch", "auto"])
def test_a_wide_triton_run_saves_what_the_pruner_owns_and_reloads(tiny_model_dir, tmp_path, backend):
    """A run with the wide-triton executor saves what a torch-executor run saves: the pruner's own
    keys (no wrapper in their names), the same tensors, and the reloaded model scores exactly what
    the run reported."""
    stages = [stage("router", steps=4)]
    r = recipe(tiny_model_dir, tmp_path / "triton", stages)
    r["executor"] = {"name": "wide-triton", "config": {"backend": backend}}
    res = apply(r)
    ref = apply(recipe(tiny_model_dir, tmp_path / "torch", stages))
    saved = _saved_tensors(tmp_path / "triton" / "run" / "model")
    assert not any("base_layer" in k for k in saved["pruner.safetensors"])
    _assert_same_tensors(saved, _saved_tensors(tmp_path / "torch" / "run" / "model"))
    ev = api.eval_model(
        str(tmp_path / "triton" / "run" / "model"),
        evaluation=api.EvaluationSection(tasks=["piqa"], limit=4, batch_size=4, max_length=512),
        dtype="float32",
        device="cpu",
    )
    assert ev["metrics"] == res.results["metrics"] == ref.results["metrics"]


@pytest.mark.slow
def test_a_wide_run_scored_on_the_runtime_matches_the_reference(tiny_model_dir, tmp_path):
    """``evaluation.engine: runtime`` scores a WIDE model through its runtime blocks (the recipe's
    executor, here on the torch references): the metrics and the realised sparsity of the reference path
    (``engine: transformers``) up to rounding, the sparsity counted by the blocks over real tokens only,
    and ``results.json`` saying which engine ran. ``auto`` is the reference's on a CPU: the same hash as a
    recipe written before the field."""
    import math

    from compresskit.recipe import load_recipe

    stages = [stage("router", steps=4)]
    runs = {}
    for engine in ("transformers", "runtime"):
        r = recipe(tiny_model_dir, tmp_path / engine, stages)
        r["executor"] = {"name": "wide-triton", "config": {"backend": "torch"}}
        r["evaluation"] = {**r["evaluation"], "tasks": ["perplexity", "piqa"], "perplexity_docs": 2, "engine": engine}
        runs[engine] = apply(r).results
    ref, got = runs["transformers"], runs["runtime"]
    assert ref["evaluation"]["engine"] == "transformers" and got["evaluation"]["engine"] == "runtime (eager)"
    for task, metrics in ref["metrics"].items():
        for name, value in metrics.items():
            assert math.isclose(got["metrics"][task][name], value, rel_tol=1e-4), (task, name)
    assert got["sparsity"]["tokens"] == ref["sparsity"]["tokens"] > 0
    assert math.isclose(got["sparsity"]["macs"], ref["sparsity"]["macs"], rel_tol=1e-6)
    plain = recipe(tiny_model_dir, tmp_path / "auto", stages)
    assert (
        load_recipe(plain).hash()
        == load_recipe({**plain, "evaluation": {**plain["evaluation"], "engine": "auto"}}).hash()
    )
    assert "engine" not in load_recipe(plain).to_dict()["evaluation"]


def test_sparsity_not_counted_is_reported_as_not_measured(tiny_model_dir, tmp_path):
    """Scored on the runtime by blocks that do not count (``track_stats: false``, for serving): the
    sparsity is reported as not measured (None), never as 0."""
    from compresskit.report import compare_markdown, results_markdown

    r = recipe(tiny_model_dir, tmp_path, [stage("router", steps=2)])
    r["executor"] = {"name": "wide-triton", "config": {"backend": "torch", "track_stats": False}}
    r["evaluation"] = {**r["evaluation"], "engine": "runtime"}
    res = apply(r)
    saved = json.loads((tmp_path / "run" / "results.json").read_text())
    assert res.results["sparsity"] is None and saved["sparsity"] is None
    md = results_markdown(saved)
    assert "not measured" in md and "sparsity MACs" in md
    assert "not measured" in compare_markdown([saved])


@pytest.mark.slow
@pytest.mark.parametrize(("signame", "code"), [("SIGTERM", 143), ("SIGINT", 130)])
def test_a_signal_checkpoints_the_last_finished_step_and_the_rerun_resumes(
    tiny_model_dir, tmp_path, monkeypatch, signame, code
):
    """A SIGTERM (a scheduler's, a container's), or a SIGINT to a process that inherited SIGINT as
    ignored (a background job), stops a run as Ctrl-C does: exit 128 + the signal, a checkpoint at the
    last finished step, the staging directory kept; the same command then ends with exactly the weights
    of an uninterrupted run."""
    import os
    import signal

    import yaml

    signum = getattr(signal, signame)
    if signame == "SIGINT":  # as a shell starts a background job
        previous = signal.signal(signal.SIGINT, signal.SIG_IGN)

    from compresskit.cli import main
    from compresskit_wide.pruner import WidePruner

    stages = [stage("router", steps=7, checkpoint_every=50)]
    apply(recipe(tiny_model_dir, tmp_path / "a", stages))
    path = tmp_path / "b.yaml"
    path.write_text(yaml.safe_dump(recipe(tiny_model_dir, tmp_path / "b", stages)))
    original = WidePruner.on_train_step

    def signal_at_step_3(self, step, total):
        if step == 3:
            os.kill(os.getpid(), signum)
        return original(self, step, total)

    monkeypatch.setattr(WidePruner, "on_train_step", signal_at_step_3)
    try:
        assert main(["apply", str(path)]) == code
        # the CLI put the previous handler back
        assert signal.getsignal(signum) is (signal.SIG_IGN if signame == "SIGINT" else signal.SIG_DFL)
    finally:
        if signame == "SIGINT":
            signal.signal(signal.SIGINT, previous)
    ckpt = torch.load(tmp_path / "b" / "run.partial" / "work" / "stage0-router" / "checkpoint.pt", weights_only=False)
    assert ckpt["step"] == 3 and not ckpt["done"]  # steps 0-2 finished; checkpoint_every alone saves none
    monkeypatch.setattr(WidePruner, "on_train_step", original)
    assert main(["apply", str(path)]) == 0
    _assert_same_tensors(
        _saved_tensors(tmp_path / "a" / "run" / "model"), _saved_tensors(tmp_path / "b" / "run" / "model")
    )


def test_distillation_from_the_dense_view_reduces_the_kl(tiny_model_dir):
    """WIDE shows the dense model without a copy (``dense_view``: every group runs, nothing is
    counted); a LoRA stage distills from it, and steps on the KL bring it down."""
    from compresskit.routing import routed_projections

    model, tok = load_model(str(tiny_model_dir), dtype="float32", device="cpu")
    ids = torch.randint(2, 300, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        dense = model(ids).logits
    cls = plugins.load("pruner", "wide")
    pruner = cls(cls.Config(ffn_group_size=16, router_rank=8))
    ctx = RunContext(model_config=model.config, tokenizer=tok, seed=0)
    pruner.prepare(model, ctx)
    model.eval()
    with torch.no_grad():
        routed = model(ids).logits
        pruner.reset_sparsity(model)
        with pruner.dense_view(model):
            viewed = model(ids).logits
    assert pruner.can_view_dense and not torch.allclose(routed, dense)
    assert torch.equal(viewed, dense)
    assert all(p.stat_tokens.item() == 0 for _, p in routed_projections(model) if p.router is not None)
    # a stage that distills logs its KL
    config = {"steps": 4, "batch_size": 2, "seq_len": 32, "r": 4, "alpha": 8, "lr": 1e-2}
    summary = LoraTrainer(LoraStageConfig(**config, distill={"weight": 0.5})).fit(model, pruner, DataModule(tok), ctx)
    assert len(summary.history) == 4 and all(h["kl"] > 0 for h in summary.history)
    # the machinery on one batch: the teacher is the dense model (pruner and LoRA off), the KL's
    # gradient reaches the student, and steps on it bring it down
    from compresskit.distill import kl_loss, teacher_logits
    from compresskit.trainers import lora_parameters

    pruner.finalize(model)
    model.eval()
    target = teacher_logits(model, pruner, None, ids)
    assert torch.equal(target, dense)
    params = lora_parameters(model)
    for p in params:
        p.requires_grad_(True)
    opt = torch.optim.Adam(params, lr=1e-2)
    kls = []
    for _ in range(10):
        loss = kl_loss(model(ids).logits, target)
        kls.append(loss.item())
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert kls[-1] < 0.5 * kls[0], kls


def test_recipe_with_generated_text_and_distillation_end_to_end(tiny_model_dir, tmp_path, monkeypatch):
    """Files plus text the dense model writes, mixed; WIDE's router and LoRA stages distilling from the
    dense view; the run records its sources (none of the generated text held out) and each step's KL."""
    (tmp_path / "docs.jsonl").write_text(
        "".join(json.dumps({"text": f"Plain document {i}. " * 40}) + "\n" for i in range(6))
    )
    monkeypatch.chdir(tmp_path)
    distill = {"weight": 0.5, "temperature": 2.0}
    rec = recipe(
        tiny_model_dir,
        tmp_path,
        [stage("router", steps=3, distill=distill), stage("lora", steps=3, r=4, alpha=8, distill=distill)],
    )
    generated = {"documents": 6, "max_new_tokens": 16, "batch_size": 3}
    rec["data"] = {
        "source": [
            {"source": {"files": ["docs.jsonl"]}, "weight": 1},
            {"source": {"generated": generated}, "weight": 2},
        ]
    }
    res = apply(rec).results
    kinds = [s["kind"] for s in res["data"]["sources"]]
    assert kinds == ["files", "generated"] and res["data"]["source"] == "mixture"
    generated_share = res["data"]["sources"][1]
    assert generated_share["test"] == 0 and generated_share["train"] == 2 * generated_share["documents"]  # trains only
    assert all("kl" in h for t in res["training"] for h in t["history"])


def test_a_loss_that_is_not_finite_stops_the_stage_at_its_step(tiny_model_dir, tmp_path, monkeypatch):
    """The logs of a few steps are read back from the device together (``LOG_EVERY``): a loss that
    turns NaN at step 13 stops the stage naming step 13, and the checkpoint left behind is of a step
    before it (here step 12, saved every 4), whose history holds every step up to it."""
    import compresskit.trainers as trainers

    monkeypatch.setattr(trainers, "LOG_EVERY", 5)
    model, tok = load_model(str(tiny_model_dir), dtype="float32", device="cpu")
    cls = plugins.load("pruner", "wide")
    pruner = cls(cls.Config(ffn_group_size=16, router_rank=8))
    ctx = RunContext(model_config=model.config, tokenizer=tok, seed=0, work_dir=tmp_path / "w")
    pruner.prepare(model, ctx)
    real_regularization, calls = pruner.regularization, []

    def regularization(m):
        calls.append(1)
        reg = real_regularization(m)
        return reg * float("nan") if len(calls) == 14 else reg  # the 14th step: step 13

    monkeypatch.setattr(pruner, "regularization", regularization)
    config = TrainStageConfig(steps=20, batch_size=2, seq_len=32, checkpoint_every=4)
    with pytest.raises(FloatingPointError, match="router: loss became nan at step 13"):
        RouterTrainer(config).fit(model, pruner, DataModule(tok), ctx)
    saved = torch.load(tmp_path / "w" / "checkpoint.pt", weights_only=False)
    assert saved["step"] == 12 and [int(h["step"]) for h in saved["history"]] == list(range(12))
    assert all(isinstance(v, float) and v == v for h in saved["history"] for v in h.values())


def test_deterministic_mode_changes_no_number_on_the_cpu_and_restores_torch(tiny_model_dir, tmp_path):
    """``deterministic: true`` runs the same pipeline with torch's deterministic algorithms (a CPU's
    are deterministic already: the same tensors and metrics), puts torch's settings back after the
    run, and is part of the recipe's hash only when on (runs saved before the field stay reusable)."""
    from compresskit.recipe import load_recipe

    stages = [stage("router", steps=3), stage("lora", steps=2, r=4, alpha=8)]
    plain = recipe(tiny_model_dir, tmp_path / "plain", stages)
    strict = {**recipe(tiny_model_dir, tmp_path / "strict", stages), "deterministic": True}
    assert "deterministic" not in load_recipe(plain).to_dict()
    assert load_recipe(strict).to_dict()["deterministic"] is True
    assert load_recipe(strict).hash() != load_recipe(plain).hash()
    before = torch.are_deterministic_algorithms_enabled()
    runs = [apply(plain), apply(strict)]
    assert torch.are_deterministic_algorithms_enabled() == before
    _assert_same_tensors(*(_saved_tensors(tmp_path / n / "run" / "model") for n in ("plain", "strict")))
    assert runs[0].results["metrics"] == runs[1].results["metrics"]
    assert runs[1].results["recipe"]["deterministic"] is True
    assert "Deterministic algorithms only" in (tmp_path / "strict" / "run" / "results.md").read_text()
    assert "Deterministic" not in (tmp_path / "plain" / "run" / "results.md").read_text()


def test_an_op_without_a_deterministic_form_is_one_error_naming_the_field():
    from compresskit.errors import RecipeError
    from compresskit.seeding import deterministic_algorithms

    with pytest.raises(
        RecipeError, match=r"deterministic: true, but put_ \(run by this pipeline.*deterministic: false"
    ):
        with deterministic_algorithms(True):
            torch.zeros(5).put_(torch.tensor([0, 0]), torch.tensor([1.0, 2.0]))
    assert not torch.are_deterministic_algorithms_enabled()
    with deterministic_algorithms(True), pytest.raises(RuntimeError, match="not about determinism"):
        raise RuntimeError("not about determinism")  # other errors pass through unchanged


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_deterministic_runs_on_a_gpu_repeat_bit_for_bit(tiny_model_dir, tmp_path):
    """Two processes running one recipe with ``deterministic: true`` on a GPU train the same routers
    and LoRA bit for bit and report the same numbers (each process starts its cuBLAS with the fixed
    workspace)."""
    import subprocess
    import sys

    stages = [stage("router", steps=6), stage("lora", steps=4, r=4, alpha=8)]
    for name in ("a", "b"):
        r = {**recipe(tiny_model_dir, tmp_path / name, stages), "deterministic": True}
        r["model"] = {**r["model"], "device": "cuda", "dtype": "bfloat16"}
        r["evaluation"] = {**r["evaluation"], "tasks": ["perplexity", "piqa"], "perplexity_docs": 1}
        path = tmp_path / f"{name}.yaml"
        path.write_text(json.dumps(r))
        done = subprocess.run([sys.executable, "-m", "compresskit", "apply", str(path)], capture_output=True, text=True)
        assert done.returncode == 0, done.stderr[-3000:]
    _assert_same_tensors(*(_saved_tensors(tmp_path / n / "run" / "model") for n in ("a", "b")))
    a, b = (json.loads((tmp_path / n / "run" / "results.json").read_text()) for n in ("a", "b"))
    assert a["metrics"] == b["metrics"] and a["sparsity"] == b["sparsity"]
    assert [t["history"] for t in a["training"]] == [t["history"] for t in b["training"]]


def _routed_tiny(tiny_model_dir, **config):
    model, tok = load_model(str(tiny_model_dir), dtype="float32", device="cpu")
    cls = plugins.load("pruner", "wide")
    pruner = cls(cls.Config(**{"ffn_group_size": 16, "attn_group_size": 1, "router_rank": 8, **config}))
    pruner.prepare(model, RunContext(model_config=model.config, tokenizer=tok))
    return model, tok, pruner


def _text_batches(n=4, seq=32, seed=0):
    from compresskit.interfaces import Batch

    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 384, (n, 2, seq), generator=gen)
    return [Batch(b, torch.ones_like(b)) for b in ids]


@pytest.mark.parametrize("budget", [{"macs": 0.3}, {"attention": 0.5, "ffn": 0.2}, {"macs": 0.0}])
def test_fit_routers_learns_the_dense_models_ranking_within_the_budget(tiny_model_dir, budget):
    """Fitted to the groups whose contribution is smallest: the labels spend exactly the budget, the routers
    agree with them far above chance, and on the fit's text they skip what the labels skip (each group as
    often); the model's weights are untouched and routing then skips the same on that text."""
    from compresskit.routing import fit_routers, group_contributions, routed_projections

    model, _, pruner = _routed_tiny(tiny_model_dir, target_sparsity=0.3, budget="macs")
    before = {k: v.clone() for k, v in model.state_dict().items() if "router" not in k}
    batches = _text_batches()
    info = fit_routers(model, batches, budget, total_macs=pruner.total_macs, steps=150, lr=2e-2, seed=0)
    assert info["tokens"] == 4 * 2 * 32
    if "macs" in budget:
        assert info["label_macs"] == pytest.approx(budget["macs"], abs=0.01)
        assert info["fit_macs"] == pytest.approx(budget["macs"], abs=0.02)
    assert info["agreement"] > (0.99 if budget.get("macs") == 0.0 else 0.75)
    after = {k: v for k, v in model.state_dict().items() if "router" not in k}
    assert all(torch.equal(before[k], after[k]) for k in before)
    model = pruner.finalize(model)
    pruner.reset_sparsity(model)
    with torch.no_grad():
        for b in batches:
            model(input_ids=b.input_ids)
    report = pruner.sparsity(model)
    if "macs" in budget:
        assert report.macs == pytest.approx(budget["macs"], abs=0.03)
    else:
        assert report.groups["attention"].fraction == pytest.approx(0.5, abs=0.05)
        assert report.groups["ffn"].fraction == pytest.approx(0.2, abs=0.05)
    proj = routed_projections(model)[0][1]
    x = torch.randn(5, proj.base_layer.in_features)
    manual = torch.stack([(proj.base_layer.weight[:, g * 8 : (g + 1) * 8] @ x[:, g * 8 : (g + 1) * 8].T).norm(dim=0)
                          for g in range(proj.groups)], dim=1)  # fmt: skip
    assert torch.allclose(group_contributions(proj, x, chunk=2), manual, atol=1e-5)


def test_router_fit_stage_needs_a_routing_pruner(tiny_model_dir, tmp_path, capsys):
    """Without a pruner, or with one that has no routers, the stage says what it needs in one line."""
    from compresskit.errors import RecipeError

    rec = recipe(tiny_model_dir, tmp_path, [{"name": "router-fit", "config": {"tokens": 64, "seq_len": 32}}])
    rec["pruner"] = {"name": "static-width", "config": {"target_sparsity": 0.25}}
    with pytest.raises(RecipeError, match="training.0.name: the 'router-fit' stage fits a routing pruner's routers"):
        apply(rec)  # (refused before the model loads: the recipe's validation)
    del rec["pruner"]
    with pytest.raises(RecipeError, match="the recipe has no pruner, so it has none"):
        apply(rec)
