"""``compresskit apply --dry-run``: exact parameter counts from a meta-device model, memory estimates
that follow the rank count, and nothing loaded."""

import pytest
import torch

from compresskit.cli import main
from compresskit.memory import CONTEXT_BYTES, plan
from compresskit.recipe import load_recipe


@pytest.fixture
def recipe(tiny_model_dir, tmp_path):
    return {
        "model": {"name_or_path": str(tiny_model_dir), "dtype": "float32", "device": "cpu"},
        "pruner": {"name": "toy-router", "config": {"groups": 6, "rank": 8}},
        "training": [
            {"name": "router", "config": {"steps": 10, "batch_size": 2, "seq_len": 64}},
            {"name": "lora", "config": {"steps": 5, "batch_size": 2, "seq_len": 64, "r": 4, "grad_accum": 3}},
        ],
        "output": {"dir": str(tmp_path / "run")},
    }


def test_plan_counts_what_the_real_run_trains(recipe, tiny_model_dir):
    from compresskit import plugins
    from compresskit.interfaces import RunContext
    from compresskit.modeling import load_model
    from compresskit.trainers import LoraStageConfig, inject_lora, lora_parameters

    resolved = load_recipe(recipe)
    model, tok = load_model(str(tiny_model_dir), dtype="float32", device="cpu")
    cls = plugins.load("pruner", "toy-router")
    pruner = cls(cls.Config(groups=6, rank=8))
    pruner.prepare(model, RunContext(model_config=model.config, tokenizer=tok))
    routers = sum(p.numel() for p in pruner.trainable_parameters(model))
    inject_lora(model, LoraStageConfig(r=4))
    lora = sum(p.numel() for p in lora_parameters(model))

    one = plan(resolved, world=1, config=model.config, dtype=torch.float32)
    two = plan(resolved, world=2, config=model.config, dtype=torch.float32)
    assert [s.stage for s in one.stages] == ["router", "lora", "evaluation"]
    assert [s.trainable_params for s in one.stages] == [routers, routers + lora, 0]
    assert [s.tokens_per_step for s in one.stages[:2]] == [2 * 64, 2 * 64 * 3]
    assert [s.tokens_per_step for s in two.stages[:2]] == [2 * 2 * 64, 2 * 2 * 64 * 3]  # each rank its share
    assert not one.sharded and two.sharded
    layer = max(sum(p.numel() * 4 for n, p in lay.named_parameters() if "lora_" not in n) for lay in model.model.layers)
    assert two.stages[0].weights == one.stages[0].weights // 2 + 2 * layer  # halved, plus two whole layers
    assert two.stages[1].trainable_state * 2 == one.stages[1].trainable_state
    assert two.stages[0].activations == one.stages[0].activations  # a micro-batch per rank either way
    assert all(s.peak > CONTEXT_BYTES for s in one.stages)
    # LoRA keeps each adapted projection's input again and the dropout's mask: under bf16 autocast on a GPU a
    # bf16 copy and a one-byte mask, on the CPU in fp32 the dropout's output and its float mask
    from peft.tuners.lora import LoraLayer

    inputs = sum(m.get_base_layer().in_features for m in model.modules() if isinstance(m, LoraLayer))
    assert one.stages[1].activations - one.stages[0].activations == 2 * 64 * inputs * (2 + 1)
    cpu = plan(resolved, world=1, config=model.config, dtype=torch.float32, device="cpu")
    assert cpu.stages[1].activations - cpu.stages[0].activations == 2 * 64 * inputs * (4 + 4)
    assert one.dtype == "bfloat16" and cpu.dtype == "float32"


def test_distillation_adds_the_kl_tensors_to_the_logits_only(recipe, tiny_model_dir):
    """A stage that distils holds six more fp32 tensors of the logits' size (the KL's inputs at
    temperature, their log-distributions, the teacher's probabilities, the elementwise term); nothing
    else in its plan changes."""
    from compresskit.modeling import load_config

    config = load_config(str(tiny_model_dir))[0]
    plain = plan(load_recipe(recipe), world=1, config=config, dtype=torch.float32)
    recipe["training"][0]["config"]["distill"] = {"weight": 0.5, "temperature": 2.0}
    distil = plan(load_recipe(recipe), world=1, config=config, dtype=torch.float32)
    a, b = plain.stages[0], distil.stages[0]
    assert b.logits - a.logits == 2 * 64 * config.vocab_size * 6 * 4
    assert (a.weights, a.activations, a.trainable_state) == (b.weights, b.activations, b.trainable_state)
    assert distil.stages[1] == plain.stages[1]  # the LoRA stage does not distil


def test_dry_run_prints_the_plan_and_loads_nothing(recipe, tmp_path, capsys, monkeypatch):
    import yaml
    from transformers import AutoModelForCausalLM

    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(recipe))

    def no_weights(*a, **k):
        pytest.fail("--dry-run loaded the weights")

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", no_weights)
    code = main(["apply", str(path), "--dry-run", "--nproc", "2"])
    out = capsys.readouterr().out
    assert code == 0 and "2 rank(s), weights sharded (FSDP2)" in out and "router" in out and "lora" in out
    # off a terminal the table is Markdown, whole: no cell cut to fit 80 columns
    assert "| stage | steps | tokens/step | trained params |" in out and "…" not in out
    if not torch.cuda.is_available():  # the plan is for the device the run would use: here the CPU, in its dtype
        assert "on the CPU: estimates per process" in out and "| peak/process |" in out and "CUDA context" not in out
        assert "computing in float32" in out
    assert not (tmp_path / "run").exists() and not (tmp_path / "run.partial").exists()
    code = main(["apply", str(path), "--dry-run", "--nproc", "0"])
    assert code == 2 and "--nproc: 0; give 1 or more" in capsys.readouterr().err


def test_the_cpu_plan_counts_the_process_and_the_heap_growth(recipe, tiny_model_dir):
    """On the CPU: the process in place of the CUDA context, nothing cast (no autocast), the step's tensors
    times the heap's growth; the evaluation's attention probabilities on top of its per-layer work."""
    from compresskit.memory import CONTEXT_BYTES, HEAP_GROWTH_CPU, PROCESS_BYTES_CPU
    from compresskit.modeling import load_config

    config = load_config(str(tiny_model_dir))[0]
    recipe["training"] = [{**st, "config": {**st["config"], "autocast_bf16": False}} for st in recipe["training"]]
    gpu = plan(load_recipe(recipe), world=1, config=config, dtype=torch.float32)
    cpu = plan(load_recipe(recipe), world=1, config=config, dtype=torch.float32, device="cpu")
    assert gpu.stages[0] == cpu.stages[0].__class__(**{**vars(cpu.stages[0]), "context": CONTEXT_BYTES, "growth": 1.0})
    for g, c in zip(gpu.stages, cpu.stages, strict=True):
        assert c.context == PROCESS_BYTES_CPU and g.context == CONTEXT_BYTES
        step = c.trainable_state + c.activations + c.logits
        assert c.peak == c.weights + round(HEAP_GROWTH_CPU * step) + PROCESS_BYTES_CPU
    heads, length = config.num_attention_heads, 1024  # (the default evaluation.max_length)
    rows = gpu.stages[2].tokens_per_step // length
    assert cpu.stages[2].activations - gpu.stages[2].activations == rows * heads * length * length * 2 * 4


def test_the_evaluation_row_follows_the_logits_budget(recipe, tiny_model_dir):
    """The evaluation's largest batch: ``batch_size`` rows of ``max_length``, fewer where their fp32 logits and
    log-softmax would pass ``logits_budget_mb``, never less than one row."""
    from compresskit.modeling import load_config

    config = load_config(str(tiny_model_dir))[0]
    vocab = config.vocab_size

    def evaluation(**section):
        recipe["evaluation"] = section
        return plan(load_recipe(recipe), world=1, config=config, dtype=torch.float32, device="cpu").stages[-1]

    whole = evaluation(batch_size=4, max_length=128)
    assert whole.tokens_per_step == 4 * 128 and whole.logits == 4 * 128 * vocab * 8 and whole.steps is None
    budget = 16 * 2**20  # (the smallest budget allowed)
    capped = evaluation(batch_size=64, max_length=128, logits_budget_mb=16)
    assert capped.tokens_per_step == budget // (vocab * 8) < 64 * 128
    one_row = evaluation(batch_size=8, max_length=100_000 // 8 * 8, logits_budget_mb=16)
    assert one_row.tokens_per_step == 100_000 // 8 * 8  # a row over the budget still runs, alone
    assert whole.trainable_params == whole.trainable_state == 0


@pytest.mark.slow
def test_memory_benchmark_script_runs_its_smoke_path(tmp_path):
    """``benchmarks/bench_train_memory.py --smoke``: the estimate and a training step on the CPU (the GPU
    run measures the peaks)."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_train_memory.py"
    res = subprocess.run(
        [sys.executable, str(script), "--smoke", "--out", str(tmp_path)], capture_output=True, text=True
    )
    assert res.returncode == 0, res.stderr[-2000:]
    rows = json.loads((tmp_path / "train_memory.json").read_text())["rows"]
    assert [r["stage"] for r in rows] == ["router", "lora"] and all(r["measured_peak_allocated"] is None for r in rows)
    assert rows[1]["trained_params"] > rows[0]["trained_params"] > 0
    assert all(r["batch"] == 1 and r["tokens_per_s"] > 0 and not r["distill"] for r in rows)


def test_finetune_counts_the_projections_and_a_distilling_run_its_teacher_copy(recipe, tiny_model_dir):
    """A ``finetune`` stage trains every targeted projection's weight besides the routers; where a stage
    distils during or after it, the run keeps the dense model as a copy (the model's own weights move),
    and the plan counts that copy in every stage's weights."""
    from compresskit.modeling import load_config, load_model

    config = load_config(str(tiny_model_dir))[0]
    base = plan(load_recipe(recipe), world=1, config=config, dtype=torch.float32)
    recipe["training"][1] = {"name": "finetune", "config": {"steps": 5, "batch_size": 2, "seq_len": 64}}
    tuned = plan(load_recipe(recipe), world=1, config=config, dtype=torch.float32)
    model, _ = load_model(str(tiny_model_dir), dtype="float32", device="cpu")
    targets = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    projections = sum(m.weight.numel() for n, m in model.named_modules() if n.split(".")[-1] in targets)
    assert tuned.stages[1].trainable_params == base.stages[0].trainable_params + projections
    assert tuned.stages[1].weights == base.stages[0].weights  # no teacher: nothing distills
    recipe["training"][0]["config"]["distill"] = {"weight": 0.5}  # before the weights move: the dense view
    early = plan(load_recipe(recipe), world=1, config=config, dtype=torch.float32)
    assert all(s.weights == base.stages[0].weights for s in early.stages)
    recipe["training"][1]["config"]["distill"] = {"weight": 0.5}
    distil = plan(load_recipe(recipe), world=1, config=config, dtype=torch.float32)
    assert all(s.weights == base.stages[0].weights + tuned.params * 4 for s in distil.stages[:-1])
    assert distil.stages[-1].weights == base.stages[0].weights  # the copy is freed before the evaluation
