"""lm-eval's own tasks by name: resolved before any model is loaded, their data read offline, few-shot
settings per task, the results in the tables; a task YAML of one's own through evaluation.task_paths."""

import json
from pathlib import Path

import pytest

from compresskit.cli import main
from compresskit.errors import RecipeError
from compresskit.evaluate import evaluate, recovery
from compresskit.recipe import EvaluationSection
from compresskit.tasks import check_lm_eval_tasks, fewshot, result_columns

TASK_YAML = """task: {name}
dataset_path: json
dataset_kwargs:
  data_files:
    validation: {data}
validation_split: validation
fewshot_split: validation
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_target: label
doc_to_choice: "{{{{choices}}}}"
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
metadata:
  version: 1.0
"""


def task_folder(tmp_path, name="tiny_choice", n=6):
    """A folder with one lm-eval task YAML whose data is a local JSON-lines file."""
    folder = tmp_path / "tasks"
    folder.mkdir(exist_ok=True)
    data = tmp_path / f"{name}.jsonl"
    rows = [
        {"question": f"Which word comes after {w}?", "choices": [" one", " two", " three"], "label": i % 3}
        for i, w in enumerate(["red", "blue", "green", "black", "white", "grey", "pink", "gold"][:n])
    ]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    (folder / f"{name}.yaml").write_text(TASK_YAML.format(name=name, data=data))
    return folder


def test_a_task_yaml_of_ones_own_is_evaluated_with_its_few_shot_setting(tiny_model_dir, tmp_path):
    from test_evaluate import _articles

    from compresskit.data import DataModule
    from compresskit.modeling import load_model

    folder = task_folder(tmp_path)
    section = EvaluationSection(
        tasks=["piqa", "tiny_choice"], task_paths=[str(folder)], num_fewshot={"tiny_choice": 2}, limit=4, batch_size=4
    )
    check_lm_eval_tasks(section)  # found in the folder, its data local: no error, no download
    assert fewshot(section, "tiny_choice") == 2 and fewshot(section, "piqa") == 0
    model, tok = load_model(str(tiny_model_dir), dtype="float32", device="cpu")
    dm = DataModule(tok, articles=_articles(8), test_fraction=0.5)
    res = evaluate(model, tok, dm, section)
    assert set(res.tasks) == {"piqa", "tiny_choice"}
    ours = res.tasks["tiny_choice"]
    assert ours.n_items == 4 and 0 <= ours.metrics["acc"] <= 1
    assert res.higher_is_better == {"tiny_choice": {"acc": True}}
    # the zero-shot average stays that of the built-in tasks, so that comparisons keep their meaning
    assert res.zero_shot_average() == pytest.approx(res.tasks["piqa"].metrics["acc"])
    assert ("tiny_choice acc", "tiny_choice", "acc", "{:.4f}") in result_columns(res.metrics())


def test_recovery_follows_lm_evals_direction_for_its_metrics():
    dense, comp = {"t": {"loss_like": 2.0}}, {"t": {"loss_like": 4.0}}
    assert recovery(comp, dense) == {"t": {"loss_like": 2.0}}  # unknown: higher is better
    assert recovery(comp, dense, {"t": {"loss_like": False}}) == {"t": {"loss_like": 0.5}}


def test_unknown_tasks_and_bad_settings_are_one_clear_error(tmp_path):
    with pytest.raises(
        RecipeError, match=r"unknown task 'hellaswagg'\. Did you mean: hellaswag.*lm-eval's [0-9,]+ tasks"
    ):
        check_lm_eval_tasks(EvaluationSection(tasks=["perplexity", "hellaswagg"]))
    with pytest.raises(RecipeError, match=r"evaluation.task_paths: '.*nowhere' is not a folder"):
        check_lm_eval_tasks(EvaluationSection(tasks=["piqa"], task_paths=[str(tmp_path / "nowhere")]))
    with pytest.raises(ValueError, match="num_fewshot.piqa: the built-in task 'piqa' is zero-shot"):
        EvaluationSection(tasks=["piqa"], num_fewshot={"piqa": 5})
    with pytest.raises(ValueError, match="num_fewshot names 'arc_easy', which is not in tasks"):
        EvaluationSection(tasks=["piqa"], num_fewshot={"arc_easy": 5})
    with pytest.raises(ValueError, match="must be >= 0"):
        EvaluationSection(tasks=["arc_easy"], num_fewshot=-1)


@pytest.mark.slow
def test_a_task_whose_data_is_not_here_fails_before_the_model_loads(capsys, tmp_path, tiny_recipe, monkeypatch):
    """``arc_easy`` is an lm-eval task whose dataset lives on the hub: offline, validate and apply
    answer with one line and exit 2 at once, and apply loads no model and writes nothing."""
    import yaml

    import compresskit.api as api

    recipe = {**tiny_recipe, "evaluation": {**tiny_recipe.get("evaluation", {}), "tasks": ["piqa", "arc_easy"]}}
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(recipe))
    loads = []
    monkeypatch.setattr(api, "load_model", lambda *a, **k: loads.append(1))
    for command in ("validate", "apply"):
        code = main([command, str(path)])
        err = capsys.readouterr().err
        lines = [ln for ln in err.splitlines() if ln.strip()]
        assert code == 2 and len(lines) == 1, err
        assert lines[0].startswith("error: evaluation.tasks: 'arc_easy' cannot load its data: not available offline")
    assert loads == [] and not Path(recipe["output"]["dir"]).exists()


def test_eval_command_takes_lm_eval_tasks_and_their_folder(capsys, tiny_model_dir, tmp_path):
    folder = task_folder(tmp_path)
    out = tmp_path / "out"
    argv = ["eval", str(tiny_model_dir), "--tasks", "tiny_choice", "--task-path", str(folder), "--num-fewshot", "1"]
    code = main(
        [*argv, "--limit", "3", "--batch-size", "4", "--dtype", "float32", "--device", "cpu", "--output", str(out)]
    )
    captured = capsys.readouterr()
    assert code == 0, captured.err
    results = json.loads((out / "results.json").read_text())
    assert results["metrics"]["tiny_choice"]["acc"] >= 0 and results["evaluation"]["num_fewshot"] == 1
    assert "tiny_choice acc" in (out / "results.md").read_text()


PPL_YAML = """task: {name}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: loglikelihood_rolling
doc_to_text: ""
doc_to_target: "{{{{text}}}}"
metric_list:
  - metric: word_perplexity
  - metric: byte_perplexity
  - metric: bits_per_byte
metadata:
  version: 1.0
"""


def test_perplexity_on_text_of_another_domain_through_a_task_yaml(tiny_model_dir, tmp_path):
    """Held-out perplexity on any text (a domain the model was not trained on) is a task YAML of
    one's own: lm-eval's rolling log-likelihood on a local file, reported lower-is-better."""
    from test_evaluate import _articles

    from compresskit.data import DataModule
    from compresskit.modeling import load_model

    folder = tmp_path / "tasks"
    folder.mkdir()
    data = tmp_path / "recipes.jsonl"
    data.write_text(
        "".join(json.dumps({"text": f"Step {i}: whisk two eggs with flour. " * 5}) + "\n" for i in range(3))
    )
    (folder / "cooking_ppl.yaml").write_text(PPL_YAML.format(name="cooking_ppl", data=data))
    section = EvaluationSection(tasks=["cooking_ppl"], task_paths=[str(folder)], batch_size=2, max_length=64)
    check_lm_eval_tasks(section)
    model, tok = load_model(str(tiny_model_dir), dtype="float32", device="cpu")
    res = evaluate(model, tok, DataModule(tok, articles=_articles(8), test_fraction=0.5), section)
    ppl = res.tasks["cooking_ppl"].metrics
    assert ppl["word_perplexity"] > 1 and ppl["byte_perplexity"] > 1
    assert res.higher_is_better["cooking_ppl"]["word_perplexity"] is False
    worse = {"cooking_ppl": {"word_perplexity": 2 * ppl["word_perplexity"]}}
    assert recovery(worse, res.metrics(), res.higher_is_better)["cooking_ppl"]["word_perplexity"] == pytest.approx(0.5)
