"""Pipelines (a recipe's ``steps``): the composition contract and the orders it refuses before any model loads,
the accounting of each step against the original model's MACs, the composed model saved and loaded with identical
logits (and run by the runtime), a run resumed after its finished steps, a third-party pruner in a pipeline, and a
pipeline run's structure rebuilt by ``bench --shape --run``."""

import json
from types import SimpleNamespace

import pytest
import torch

from compresskit import artifacts
from compresskit.api import apply
from compresskit.cli import main
from compresskit.errors import RecipeProblems
from compresskit.pipeline import Pipeline
from compresskit.recipe import load_recipe
from compresskit.sparsity import BlockCount, SparsityReport, compose, layer_linear_macs, macs_dims
from compresskit.testing import save_tiny_model


@pytest.fixture(scope="module")
def tiny4(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("tiny4") / "tiny-llama-4", num_hidden_layers=4)


def stage(name, **kw):
    return {"name": name, "config": {"steps": 4, "batch_size": 2, "seq_len": 32, "checkpoint_every": 2, **kw}}


DEPTH = {"target_sparsity": 0.25, "keep_first": 0, "keep_last": 0}
WIDE = {"ffn_group_size": 16, "router_rank": 8, "target_sparsity": 0.3}
WIDE_45 = {**WIDE, "target_sparsity": 0.45}


def recipe(model_dir, out, steps):
    return {
        "name": "pipe",
        "seed": 3,
        "model": {"name_or_path": str(model_dir), "dtype": "float32", "device": "cpu"},
        "data": {"calibration": {"n_samples": 4, "seq_len": 32, "batch_size": 2}},
        "steps": steps,
        "evaluation": {
            "tasks": ["perplexity", "piqa"],
            "limit": 4,
            "perplexity_docs": 1,
            "batch_size": 4,
            "max_length": 512,
            "compare_dense": False,
        },
        "output": {"dir": str(out)},
    }


def depth_then_wide(wide_stages=None):
    return [
        {"pruner": "static-depth", "config": DEPTH, "training": [stage("lora", r=4, alpha=8, merge=True)]},
        {"pruner": "wide", "config": WIDE, "training": wide_stages or [stage("router")]},
    ]


# ---------------------------------------------------------------------------------------------
# the recipe and the contract


def test_a_one_pruner_recipe_keeps_its_form_and_its_hash(tmp_path):
    """``pruner`` + ``training`` is one step; its resolved recipe (and hash) has no ``steps`` key."""
    raw = {
        "model": {"name_or_path": "smollm2-135m"},
        "pruner": {"name": "wide", "config": {"target_sparsity": 0.5}},
        "training": [{"name": "router"}],
        "output": {"dir": str(tmp_path / "o")},
    }
    resolved = load_recipe(raw)
    assert "steps" not in resolved.to_dict() and not resolved.pipeline
    assert len(resolved.steps) == 1 and resolved.steps[0].pruner.name == "wide" and resolved.steps[0].path == ""
    assert [s.name for s in resolved.steps[0].training] == ["router"]


def test_a_pipeline_resolves_each_step_with_its_own_stages(tmp_path):
    steps = depth_then_wide([stage("router", consensus={"quorum": 0.5})])
    resolved = load_recipe(recipe("smollm2-135m", tmp_path / "o", steps))
    assert resolved.pipeline and resolved.pruner.cls is Pipeline and resolved.pruner.name == "pipeline"
    assert [s.pruner.name for s in resolved.steps] == ["static-depth", "wide"]
    assert [s.path for s in resolved.training] == ["steps.0.training.0", "steps.1.training.0"]
    assert resolved.training[1].config.consensus.quorum == 0.5  # the WIDE step's stage takes WIDE's options
    data = resolved.to_dict()
    assert "pruner" not in data and "training" not in data
    assert data["steps"][1]["config"]["target_sparsity"] == 0.3 and data["steps"][1]["config"]["router_rank"] == 8
    # --set reaches every step's fields
    other = load_recipe(recipe("smollm2-135m", tmp_path / "o", steps), ["steps.1.config.target_sparsity=0.2"])
    assert other.steps[1].pruner.config.target_sparsity == 0.2 and other.hash() != resolved.hash()


@pytest.mark.parametrize(
    ("steps", "said"),
    [
        (  # a routed model cannot be pruned further
            [{"pruner": "wide", "config": WIDE}, {"pruner": "static-depth", "config": DEPTH}],
            "steps.1.pruner: static-depth cannot follow wide (steps.0): wide leaves its own modules on the "
            "model's projections, which a later step cannot prune; put it last",
        ),
        (  # two routing pruners on the same projections
            [{"pruner": "toy-router"}, {"pruner": "wide", "config": WIDE}],
            "steps.1.pruner: wide cannot follow toy-router (steps.0): toy-router leaves its own modules",
        ),
        (  # a stage that leaves adapters before a later step
            [{"pruner": "static-depth", "config": DEPTH, "training": [stage("lora")]}, {"pruner": "wide"}],
            "steps.0.training.0: merge: false leaves LoRA adapters on the projections, which a later step cannot "
            "prune; set merge: true (steps.1, wide, prunes the model after it)",
        ),
        (  # shares of the original MACs past the whole
            [{"pruner": "static-depth", "config": {"target_sparsity": 0.6}}, {"pruner": "wide", "config": WIDE_45}],
            "steps: the steps' target_sparsity are shares of the original model's MACs and sum to 1.05 = 0.6 "
            "(steps.0, static-depth) + 0.45 (steps.1, wide); together they must stay below 1",
        ),
        (
            [
                {"pruner": "static-depth", "config": {"target_sparsity": 0.6}},
                {"pruner": "static-width", "config": {"target_sparsity": 0.4}},
            ],
            "sum to 1 = 0.6 (steps.0, static-depth) + 0.4 (steps.1, static-width)",  # (the whole: refused too)
        ),
        ([{"pruner": "static-dpth"}], "steps.0.pruner: unknown pruner 'static-dpth'. Did you mean: static-depth"),
        ([{"pruner": "wide", "confg": {}}], "steps.0.confg: unknown key 'confg'. Did you mean: config"),
        ([{"pruner": "wide", "config": {"target_sparsity": 1.5}}], "steps.0.config.target_sparsity"),
        ([{"pruner": "pipeline"}], "steps.0.pruner: pipeline is what a recipe's steps make"),
        ([], "steps: List should have at least 1 item"),
    ],
)
def test_refused_pipelines_say_so_in_one_line_naming_the_steps(tmp_path, steps, said):
    raw = recipe("smollm2-135m", tmp_path / "o", steps)
    with pytest.raises(RecipeProblems) as exc:
        load_recipe(raw)
    assert any(said in p for p in exc.value.problems), exc.value.problems


def test_a_pipeline_and_a_pruner_together_are_refused(tmp_path):
    raw = recipe("smollm2-135m", tmp_path / "o", depth_then_wide())
    raw["pruner"] = {"name": "wide"}
    with pytest.raises(RecipeProblems, match="gives its pruners as steps or as one pruner with training, not both"):
        load_recipe(raw)


@pytest.mark.parametrize(
    ("steps", "said"),
    [
        ([{"pruner": "wide", "config": WIDE}, {"pruner": "static-width"}], "static-width cannot follow wide (steps.0)"),
        ([{"pruner": "static-depth", "config": DEPTH, "trainig": []}], "steps.0.trainig: unknown key 'trainig'"),
        (
            [{"pruner": "static-depth", "config": {"target_sparsity": 0.6}}, {"pruner": "wide", "config": WIDE_45}],
            "sum to 1.05",
        ),
    ],
)
def test_the_cli_refuses_a_bad_pipeline_in_one_line_and_writes_nothing(tmp_path, capsys, steps, said):
    """An unknown step key, a refused order, shares past the whole: one line, exit 2, nothing written."""
    import yaml

    out = tmp_path / "run"
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(recipe("smollm2-135m", out, steps)))
    assert main(["apply", str(path)]) == 2
    err = capsys.readouterr().err
    assert said in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1
    assert not out.exists() and not (tmp_path / "run.partial").exists()


def test_validate_takes_a_pipeline_set_right_by_overrides(tmp_path):
    import yaml

    path = tmp_path / "r.yaml"
    path.write_text(
        yaml.safe_dump(recipe("smollm2-135m", tmp_path / "run", [{"pruner": "wide"}, {"pruner": "static-width"}]))
    )
    assert (
        main(["validate", str(path), "--set", "steps.0={pruner: static-width}", "--set", "steps.1={pruner: wide}"]) == 0
    )


# ---------------------------------------------------------------------------------------------
# accounting


def _static(fractions):
    rep = SparsityReport.empty(len(fractions))
    for layer, (a, f) in zip(rep.layers, fractions, strict=True):
        layer["attention"], layer["ffn"] = BlockCount(a, 1.0), BlockCount(f, 1.0)
    return rep


def test_compose_counts_each_step_against_the_original_model():
    config = SimpleNamespace(**macs_dims(SimpleNamespace(hidden_size=8, num_attention_heads=2,
                                                         num_key_value_heads=2, intermediate_size=24,
                                                         num_hidden_layers=4)))  # fmt: skip
    macs = layer_linear_macs(config)
    attn, ffn = sum(macs[p] for p in "qkvo"), sum(macs[p] for p in ("gate", "up", "down"))
    depth = _static([(0, 0), (1, 1), (0, 0), (0, 0)])  # layer 1 removed
    width = _static([(0.5, 0.25)] * 3)  # of the 3 layers left
    routed = _static([(0.0, 0.5), (0.2, 0.0), (0.0, 0.0)])
    routed.dynamic, routed.tokens = True, 10
    routed.groups = {"ffn": BlockCount(3, 10)}
    rep = compose(config, [depth, width, routed], ["static-depth", "static-width", "wide"])
    layer = [{b: round(x[b].fraction, 6) for b in ("attention", "ffn")} for x in rep.layers]
    assert layer[1] == {"attention": 1.0, "ffn": 1.0}
    assert layer[0] == {"attention": 0.5, "ffn": round(1 - 0.75 * 0.5, 6)}  # the routed step's layer 0
    assert layer[2] == {"attention": round(1 - 0.5 * 0.8, 6), "ffn": 0.25}  # its layer 1 is the original 2
    assert layer[3] == {"attention": 0.5, "ffn": 0.25}
    total = 4 * (attn + ffn)
    shares = rep.to_dict()["steps"]
    assert [s["name"] for s in shares] == ["static-depth", "static-width", "wide"]
    assert shares[0]["macs"] == pytest.approx((attn + ffn) / total) == 0.25
    assert shares[1]["macs"] == pytest.approx(3 * (0.5 * attn + 0.25 * ffn) / total, abs=1e-6)
    assert shares[2]["macs"] == pytest.approx((0.75 * 0.5 * ffn + 0.5 * 0.2 * attn) / total, abs=1e-6)
    assert sum(s["macs"] for s in shares) == pytest.approx(rep.macs, abs=1e-5)
    assert shares[1]["of_input"] == pytest.approx(shares[1]["macs"] / 0.75, abs=1e-5)
    assert rep.dynamic and rep.tokens == 10 and rep.groups["ffn"].fraction == 0.3
    # reports over tasks add up, their step shares too
    both = rep.merge(rep)
    assert both.to_dict()["steps"] == shares
    with pytest.raises(ValueError, match=r"step 1 \(static-width\) reports 4 layers; the model it was given has 3"):
        compose(config, [depth, _static([(0, 0)] * 4)], ["static-depth", "static-width"])
    assert SparsityReport.from_dict(width.to_dict()).to_dict() == width.to_dict()


# ---------------------------------------------------------------------------------------------
# end to end on a tiny model


def _logits(model, ids):
    with torch.no_grad():
        return model(ids).logits


@pytest.mark.slow
def test_depth_then_wide_runs_saves_loads_and_runs_on_the_runtime(tiny4, tmp_path):
    from compresskit.api import eval_model
    from compresskit.recipe import DataSection, EvaluationSection
    from compresskit.runtime import runtime_for

    steps = depth_then_wide([stage("router"), stage("lora", r=4, alpha=8, merge=True)])
    raw = recipe(tiny4, tmp_path / "run", steps)
    res = apply(raw)
    sp = res.results["sparsity"]
    assert [s["name"] for s in sp["steps"]] == ["static-depth", "wide"]
    assert sp["steps"][0]["macs"] == 0.25  # one of the 4 layers
    assert 0 < sp["steps"][1]["macs"] and sp["macs"] == pytest.approx(sum(s["macs"] for s in sp["steps"]), abs=1e-5)
    assert len(sp["per_layer"]) == 4 and sum(layer == {"attention": 1.0, "ffn": 1.0} for layer in sp["per_layer"]) == 1
    assert res.results["pruner"] == "pipeline" and res.results["model"]["params_after"] < res.results["model"][
        "params_before"]  # fmt: skip
    summary = res.results["prune_summary"]
    assert summary["method"] == "static-depth -> wide" and len(summary["details"]["steps"]) == 2
    model_dir = tmp_path / "run" / "model"
    manifest = json.loads((model_dir / "compresskit.json").read_text())
    assert manifest["format"] == "pipeline" and manifest["checkpoint"] == "base"
    assert manifest["steps"][1]["config"]["target_sparsity"] == pytest.approx(0.4)  # 0.3 of the whole, of 0.75
    assert (model_dir / "base" / "config.json").is_file()

    model, _, pruner = artifacts.load(model_dir, dtype="float32", device="cpu")
    again, _, _ = artifacts.load(model_dir, dtype="float32", device="cpu")
    assert isinstance(pruner, Pipeline) and pruner.runtime_executor == "wide-triton"
    assert model.config.num_hidden_layers == 3
    ids = torch.randint(2, 300, (2, 12), generator=torch.Generator().manual_seed(1))
    assert torch.equal(_logits(model, ids), _logits(again, ids))
    # the runtime runs the composed model (WIDE's blocks on the 3 layers left) with the model's own logits
    rt = runtime_for(model, pruner)
    cache = rt.new_cache(2, 12)
    with torch.no_grad():
        torch.testing.assert_close(rt.forward(ids, cache), _logits(model, ids), rtol=1e-4, atol=1e-4)
    # the saved model scores what the run scored
    sections = {"evaluation": EvaluationSection(**raw["evaluation"]), "data": DataSection(**raw["data"])}
    scored = eval_model(str(tmp_path / "run"), **sections, dtype="float32", device="cpu")
    assert scored["metrics"] == res.results["metrics"] and scored["pruner"] == "pipeline"
    assert scored["sparsity"]["steps"][0] == res.results["sparsity"]["steps"][0]
    # evaluating the saved model counts the same steps
    pruner.reset_sparsity(model)
    _logits(model, ids)
    shares = pruner.sparsity(model).to_dict()["steps"]
    assert shares[0]["macs"] == 0.25 and shares[1]["macs"] > 0


@pytest.mark.slow
def test_an_interrupted_pipeline_resumes_after_its_finished_steps(tiny4, tmp_path, monkeypatch):
    from compresskit_baselines.static_depth import StaticDepthPruner
    from compresskit_wide.pruner import WidePruner

    steps = depth_then_wide([stage("router", steps=6)])
    full = apply(recipe(tiny4, tmp_path / "a", steps))
    calibrated = {"n": 0}
    original_calibrate, original_step = StaticDepthPruner.calibrate, WidePruner.on_train_step

    def counting(self, model, batches):
        calibrated["n"] += 1
        return original_calibrate(self, model, batches)

    def interrupt(self, step, total):
        if step == 3:
            raise KeyboardInterrupt
        return original_step(self, step, total)

    monkeypatch.setattr(StaticDepthPruner, "calibrate", counting)
    monkeypatch.setattr(WidePruner, "on_train_step", interrupt)
    with pytest.raises(KeyboardInterrupt):
        apply(recipe(tiny4, tmp_path / "b", steps))
    partial = tmp_path / "b.partial"
    assert (partial / "work" / "step0-static-depth" / "step.json").is_file()
    assert (partial / "work" / "step0-static-depth" / "model" / "config.json").is_file()
    assert (partial / "work" / "step1-stage0-router" / "checkpoint.pt").is_file()
    monkeypatch.setattr(WidePruner, "on_train_step", original_step)
    resumed = apply(recipe(tiny4, tmp_path / "b", steps))
    assert calibrated["n"] == 1  # the depth step ran once: the resumed run started after it
    ids = torch.randint(2, 300, (2, 12), generator=torch.Generator().manual_seed(2))
    a = artifacts.load(tmp_path / "a", dtype="float32", device="cpu").model
    b = artifacts.load(tmp_path / "b", dtype="float32", device="cpu").model
    assert torch.equal(_logits(a, ids), _logits(b, ids))
    assert resumed.results["metrics"] == full.results["metrics"]
    assert resumed.results["sparsity"]["steps"] == full.results["sparsity"]["steps"]
    assert [t["stage"] for t in resumed.results["training"]] == ["lora", "router"]


@pytest.mark.slow
def test_a_third_party_pruner_composes_through_the_same_contract(tiny4, tmp_path, capsys):
    """The fixture plugin's per-token router after static depth: run, saved, loaded with identical logits; its
    run's structure rebuilt at a known shape by ``bench --shape --run``."""
    steps = [
        {"pruner": "static-depth", "config": {**DEPTH, "target_sparsity": 0.5}},
        {"pruner": "toy-router", "config": {"groups": 4, "target_sparsity": 0.3}, "training": [stage("router")]},
    ]
    res = apply(recipe(tiny4, tmp_path / "run", steps))
    assert [s["name"] for s in res.results["sparsity"]["steps"]] == ["static-depth", "toy-router"]
    model, _, pruner = artifacts.load(tmp_path / "run", dtype="float32", device="cpu")
    again = artifacts.load(tmp_path / "run", dtype="float32", device="cpu").model
    assert pruner.runtime_executor == "toy-router-blocks"
    ids = torch.randint(2, 300, (2, 12), generator=torch.Generator().manual_seed(3))
    assert torch.equal(_logits(model, ids), _logits(again, ids))

    argv = ["bench", "--shape", "tiny", "--prompt", "16", "--new-tokens", "3", "--repeats", "1", "--batch", "1"]
    out = tmp_path / "bench"
    argv += ["--run", str(tmp_path / "run"), "--transformers", "off", "--bounds", "off", "--output", str(out)]
    assert main(argv) == 0, capsys.readouterr().err
    rows = {r["model"]: r for r in json.loads((out / "bench.json").read_text())["results"]}
    assert rows["pipe"]["method"] == "pipeline"
    assert rows["pipe"]["sparsity_macs"] > 0.5  # one of tiny's 2 layers, then the router in the other


def test_each_kind_of_hybrid_is_a_method_of_its_own_on_the_equal_speed_table():
    from compresskit.comparison import method_of

    run = {"pruner": "pipeline", "recipe": {"steps": [{"pruner": "static-depth"}, {"pruner": "wide"}]}}
    assert method_of(run) == "static-depth+wide"
    assert method_of({"pruner": "wide", "recipe": {"pruner": {"name": "wide"}}}) == "wide"
    assert method_of({"pruner": None}) is None
