"""The CLI as a user meets it: exit codes, one-line errors, no partial outputs, end to end on a tiny model."""

import json
import shutil
from pathlib import Path

import pytest
import torch

from compresskit.cli import main

TESTS = Path(__file__).parents[1]


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture
def recipe_file(tmp_path, tiny_recipe):
    import yaml

    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(tiny_recipe))
    return path


def apply_toy(capsys, model_dir, out_dir, *extra):
    """``compresskit apply`` of the tiny third-party-plugin recipe on ``model_dir`` into ``out_dir``."""
    recipe = str(TESTS / "recipes" / "tiny-toy.yaml")
    return run(
        capsys, "apply", recipe, "--set", f"model.name_or_path={model_dir}", "--set", f"output.dir={out_dir}", *extra
    )


def one_line_error(err):
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    return lines[0]


@pytest.mark.parametrize(
    ("override", "expect"),
    [
        ("evalution.limit=3", "evalution: unknown key 'evalution'. Did you mean: evaluation?"),
        ("pruner.name=toy-magnitud", "pruner.name: unknown pruner 'toy-magnitud'. Did you mean: toy-magnitude?"),
        (
            "pruner.config.sparsity=1.5",
            "pruner.config.sparsity: Input should be less than 1 (given: 1.5; allowed: 0.0 <= value < 1.0)",
        ),
        ("output.dir=/proc/compresskit-x", "output.dir: cannot create '/proc/compresskit-x'"),
        ("data.source={files: [does/not/*.txt]}", "data.source.files: 'does/not/*.txt' matches no file"),
        ("data.source=wikii", "data.source: unknown data source 'wikii'. Did you mean: wiki?"),
        ("output.dir=/sys/compresskit-x/run", "output.dir: cannot create '/sys/compresskit-x/run'"),
        ("model.name_or_path=./does/not/exist", "model.name_or_path: directory './does/not/exist' does not exist"),
        (
            "model.name_or_path=meta-llama/Llama-3.1-8B",
            "model.name_or_path: 'meta-llama/Llama-3.1-8B' looks like a hub id",
        ),
    ],
)
@pytest.mark.parametrize("command", ["validate", "apply"])
def test_bad_input_exit_2_one_line_no_output(capsys, recipe_file, tiny_recipe, override, expect, command):
    extra = ["--set", "pruner.name=toy-magnitude"] if "pruner.name" not in override else []
    code, out, err = run(capsys, command, str(recipe_file), *extra, "--set", override)
    assert code == 2
    line = one_line_error(err)
    assert expect in line
    assert "Traceback" not in err
    out_dir = Path(tiny_recipe["output"]["dir"])
    assert not out_dir.exists() and not out_dir.with_name("run.partial").exists()


@pytest.mark.parametrize(
    ("damage", "expect"),
    [
        ("config", "the checkpoint cannot be loaded: It looks like the config file at"),
        ("weights", "the checkpoint cannot be loaded: Error while deserializing header"),
    ],
)
def test_corrupt_checkpoint_exit_2_one_line(capsys, tiny_model_dir, tmp_path, damage, expect):
    """A model directory whose config is not JSON, or whose safetensors file is cut short: one line
    naming the field and the directory, exit 2, no output directory."""
    broken = tmp_path / "broken-model"
    shutil.copytree(tiny_model_dir, broken)
    if damage == "config":
        (broken / "config.json").write_text('{"model_type": "llama"')
    else:
        weights = broken / "model.safetensors"
        weights.write_bytes(weights.read_bytes()[:1000])
    out_dir = tmp_path / "run"
    code, _, err = apply_toy(capsys, broken, out_dir)
    assert code == 2
    # (the weights fail inside the "loading ..." progress task, whose start line comes first)
    line = one_line_error("\n".join(ln for ln in err.splitlines() if not ln.startswith("[compresskit] loading")))
    assert line.startswith(f"error: model.name_or_path: {broken}: ") and expect in line
    assert "Traceback" not in err and not out_dir.exists()


def test_missing_recipe_file(capsys, tmp_path):
    code, _, err = run(capsys, "validate", str(tmp_path / "nope.yaml"))
    assert code == 2 and "recipe file not found" in one_line_error(err)


@pytest.mark.parametrize("text", ["", "# only a comment\n"])
def test_empty_recipe_file_says_it_is_empty(capsys, tmp_path, text):
    (tmp_path / "empty.yaml").write_text(text)
    code, _, err = run(capsys, "validate", str(tmp_path / "empty.yaml"))
    assert code == 2 and f"{tmp_path / 'empty.yaml'}: the file is empty" in one_line_error(err)


def test_eval_errors_name_the_argument_not_a_recipe_key(capsys, tmp_path):
    code, _, err = run(capsys, "eval", str(tmp_path / "nonexistent"))
    line = one_line_error(err)
    assert code == 2 and line.startswith("error: MODEL (compresskit eval's argument): directory ")
    assert "model.name_or_path" not in line
    code, _, err = run(capsys, "eval", "smollm2-135m", "--output", "/proc/compresskit-x")
    assert code == 2 and "output directory (--output): cannot create '/proc/compresskit-x'" in one_line_error(err)


def test_help_is_plain_text(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    assert "``" not in out and ":class:" not in out and "Exit codes" in out


def test_cli_starts_without_importing_torch():
    """``--help`` and ``--version`` answer at once: the package imports what a command needs, when it
    needs it."""
    import subprocess
    import sys

    code = "import sys; from compresskit.cli import main; main(['--version']); print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split()[-1] == "False"


def test_debug_shows_traceback(capsys, recipe_file):
    code, _, err = run(capsys, "--debug", "validate", str(recipe_file), "--set", "seed=x")
    assert code == 2 and "Traceback" in err


def test_validate_ok_and_print(capsys, recipe_file):
    code, out, _ = run(capsys, "validate", str(recipe_file), "--print")
    assert code == 0 and "ok: " in out and '"executor"' in out


def test_validate_reports_every_problem_at_once(capsys, recipe_file, tmp_path):
    """A key typo, an impossible plugin value, a missing data file, a bad stage value and an output folder
    that cannot be made: one run of validate, one line each, in recipe order; the same mistakes in a
    comparison's member are named after it."""
    mistakes = [
        "evalution.limit=3",
        "pruner={name: toy-magnitude, config: {sparsity: 1.5}}",
        "training=[{name: finetune, config: {steps: 0}}]",
        "data.source={files: [does/not/*.txt]}",
        "output.dir=/proc/compresskit-x",
    ]
    argv = [arg for m in mistakes for arg in ("--set", m)]
    code, out, err = run(capsys, "validate", str(recipe_file), *argv)
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert code == 2 and out == "" and all(ln.startswith("error: ") for ln in lines), err
    expected = ["evalution: unknown key", "pruner.config.sparsity: Input should be less than 1",
                "training.0.config.steps:", "data.source.files: 'does/not/*.txt' matches no file",
                "output.dir: cannot create '/proc/compresskit-x'"]  # fmt: skip
    assert len(lines) == len(expected), err
    for line, start in zip(lines, expected, strict=True):
        assert line.removeprefix("error: ").startswith(start), (line, start)
    # a recipe whose fields are all valid gets to the plugin configs' problems, all of them
    pruner, stages = (
        "pruner={name: toy-magnitude, config: {sparsity: -1}}",
        "training=[{name: finetune, config: {steps: 0}}]",
    )
    code, _, err = run(capsys, "validate", str(recipe_file), "--set", pruner, "--set", stages)
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert code == 2 and len(lines) == 2 and "pruner.config.sparsity" in lines[0] and "training.0" in lines[1]


def test_schema(capsys):
    code, out, _ = run(capsys, "schema", "toy-magnitude")
    assert code == 0 and json.loads(out)["properties"]["sparsity"]["exclusiveMaximum"] == 1.0
    code, out, _ = run(capsys, "schema", "recipe")
    assert code == 0 and "model" in json.loads(out)["properties"]
    code, _, err = run(capsys, "schema", "tooy-magnitude")
    assert code == 2 and "Did you mean: toy-magnitude" in one_line_error(err)


def test_plugins_list_and_check(capsys):
    code, out, _ = run(capsys, "plugins")
    assert code == 0
    rows = {tuple(line.split("\t")[:2]): line for line in out.splitlines()}
    assert "\tok\t" in rows[("pruner", "toy-magnitude")]
    assert "broken: ModuleNotFoundError" in rows[("pruner", "toy-broken")]
    code, out, _ = run(capsys, "plugins", "check", "toy-magnitude")
    assert code == 0 and out.count("PASS") == 6 and "contract passed" in out
    code, out, _ = run(capsys, "plugins", "check", "toy-broken")
    assert code == 1 and "FAIL  load plugin" in out


@pytest.mark.slow
def test_apply_end_to_end_with_third_party_plugin(capsys, tiny_model_dir, tmp_path):
    out_dir = tmp_path / "run"
    code, out, err = apply_toy(capsys, tiny_model_dir, out_dir)
    assert code == 0, err
    results = json.loads((out_dir / "results.json").read_text())
    assert results["pruner"] == "toy-magnitude"
    assert set(results["metrics"]) == {"perplexity", "piqa", "next_sentence"}
    sp = results["sparsity"]
    assert set(sp) >= {"attention", "ffn", "macs", "per_layer", "per_task"}
    assert sp["attention"] == 0.0 and sp["ffn"] == pytest.approx(0.3, abs=0.01) and 0 < sp["macs"] < sp["ffn"]
    assert results["dense"]["metrics"]["piqa"]["acc"] >= 0 and results["recovery"]["piqa"]["acc"] >= 0
    assert results["recipe"]["pruner"]["config"]["sparsity"] == 0.3
    assert results["data"]["test_articles"] > 0 and results["versions"]["torch"]
    assert len(results["recipe_hash"]) == 16
    assert (out_dir / "results.md").read_text().startswith("# tiny-toy")
    assert "held-out ppl" in out and "sparsity MACs" in out
    params_row = next(ln for ln in (out_dir / "results.md").read_text().splitlines() if ln.startswith("| parameters"))
    assert params_row.split("|")[-2].strip() == "-"  # a parameter count has no quality recovery
    assert not (tmp_path / "run.partial").exists()

    # the saved model reloads with identical logits, and `eval` evaluates it
    from compresskit import load

    model, _, pruner = load(out_dir / "model", dtype="float32", device="cpu")
    assert pruner.state == "finalized"
    code, out, err = run(
        capsys,
        "eval",
        str(out_dir / "model"),
        "--limit",
        "4",
        "--perplexity-docs",
        "1",
        "--next-sentence-items",
        "4",
        "--max-length",
        "512",
        "--output",
        str(tmp_path / "ev"),
    )
    assert code == 0, err
    ev = json.loads((tmp_path / "ev" / "results.json").read_text())
    assert ev["pruner"] == "toy-magnitude" and ev["sparsity"]["ffn"] == pytest.approx(sp["ffn"])

    # compare: a results file and a recipe whose results are current (reused, not rerun)
    code, out, err = run(
        capsys, "compare", str(out_dir), str(tmp_path / "ev" / "results.json"), "--output", str(tmp_path / "cmp")
    )
    assert code == 0, err
    csv_rows = (tmp_path / "cmp" / "compare.csv").read_text().splitlines()
    # the eval ran on fewer items (limit 4, not 6): two groups, never side by side without a word; the
    # run's group leads with its dense reference, the eval's carries none, so none is invented for it
    assert "evaluated under 2 different settings" in err
    assert len(csv_rows) == 4 and csv_rows[0].startswith("run,pruner,sparsity MACs")
    # each row named after its run (the eval of run/model too), the two set apart by their folders
    assert [r.split(",")[0] for r in csv_rows[1:]] == ["dense", "tiny-toy", "run"]
    assert csv_rows[1].endswith('"group 1: limit=6, next_sentence_items=6"') and "group 2: limit=4" in csv_rows[3]
    assert "### Evaluation group 2: limit=4, next_sentence_items=4" in out
    assert (tmp_path / "cmp" / "compare.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    code, out, err = run(capsys, "compare", str(out_dir), "--output", str(tmp_path / "cmp2"))
    rows = (tmp_path / "cmp2" / "compare.csv").read_text().splitlines()
    assert code == 0 and len(rows) == 3 and rows[1].startswith("dense,dense,0.000")  # the run's dense reference leads

    # the table may be written into the folder that holds its inputs: they stay, and a rerun replaces only its own files
    shutil.copy(out_dir / "results.json", tmp_path / "cmp2" / "run.results.json")
    (tmp_path / "cmp2" / "notes.txt").write_text("mine")
    code, _, err = run(
        capsys, "compare", str(tmp_path / "cmp2" / "run.results.json"), "--output", str(tmp_path / "cmp2")
    )
    assert code == 0, err
    assert sorted(p.name for p in (tmp_path / "cmp2").iterdir()) == [
        "compare.csv",
        "compare.json",
        "compare.md",
        "compare.png",
        "notes.txt",
        "run.results.json",
    ]
    assert (tmp_path / "cmp2" / "compare.csv").read_text().splitlines() == rows

    # a finished run of a different recipe is never silently replaced
    code, _, err = apply_toy(capsys, tiny_model_dir, out_dir, "--set", "seed=7")
    assert code == 2 and "already holds a run of a different recipe" in one_line_error(err)


def test_calibrate_and_evaluate_on_your_own_files(capsys, recipe_file, tmp_path):
    import yaml

    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i in range(4):
        (corpus / f"{i}.txt").write_text(f"My own text number {i}. It says something. " * 60)
    code, out, err = run(
        capsys,
        "apply",
        str(recipe_file),
        "--set",
        f"data.source={{files: ['{corpus}/*.txt']}}",
        "--set",
        "evaluation.tasks=[perplexity]",
    )
    assert code == 0, err
    out_dir = Path(yaml.safe_load(recipe_file.read_text())["output"]["dir"])
    results = json.loads((out_dir / "results.json").read_text())
    assert results["data"]["source"] == "files" and results["data"]["test_articles"] == 1
    assert [f["path"] for f in results["data"]["files"]] == [str(corpus / f"{i}.txt") for i in range(4)]
    assert "4 documents from 4 local file(s)" in (out_dir / "results.md").read_text()


def test_dense_run_reports_its_sparsity_per_task_too(capsys, recipe_file):
    code, _, err = run(capsys, "apply", str(recipe_file), "--set", "evaluation.tasks=[piqa, next_sentence]")
    assert code == 0, err
    import yaml

    results = json.loads((Path(yaml.safe_load(recipe_file.read_text())["output"]["dir"]) / "results.json").read_text())
    per_task = results["sparsity"]["per_task"]
    assert set(per_task) == {"piqa", "next_sentence"} and all(t["macs"] == 0.0 for t in per_task.values())


def test_rerun_of_a_finished_recipe_does_nothing_and_files_get_the_umask(capsys, tiny_model_dir, tmp_path):
    import os

    out_dir = tmp_path / "run"
    args = ["--set", "evaluation.tasks=[piqa]", "--set", "evaluation.compare_dense=false"]
    code, _, err = apply_toy(capsys, tiny_model_dir, out_dir, *args)
    assert code == 0, err
    umask = os.umask(0)
    os.umask(umask)
    for f in ("results.json", "results.md", "model/compresskit.json", "model/pruner.safetensors"):
        assert (out_dir / f).stat().st_mode & 0o777 == 0o666 & ~umask, f
    for d in (out_dir, out_dir / "model"):
        assert d.stat().st_mode & 0o777 == 0o777 & ~umask, d
    before = {p: p.stat().st_mtime_ns for p in out_dir.rglob("*")}
    code, out, err = apply_toy(capsys, tiny_model_dir, out_dir, *args)
    assert code == 0 and "already done (same recipe hash): nothing to do; --overwrite to redo" in err
    assert "PIQA acc" in out  # the finished run's table
    assert {p: p.stat().st_mtime_ns for p in out_dir.rglob("*")} == before
    assert not (tmp_path / "run.partial").exists()
    code, _, err = apply_toy(capsys, tiny_model_dir, out_dir, *args, "--overwrite")
    assert code == 0 and "already done" not in err
    assert {p: p.stat().st_mtime_ns for p in out_dir.rglob("*")} != before


def test_interrupted_run_leaves_partial_and_resumes(capsys, tiny_model_dir, tmp_path, monkeypatch):
    import compresskit.api as api

    out_dir = tmp_path / "run"
    args = ["--set", "evaluation.tasks=[piqa]", "--set", "evaluation.compare_dense=false"]

    def boom(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(api, "evaluate", boom)
    code, _, err = apply_toy(capsys, tiny_model_dir, out_dir, *args)
    assert code == 130 and "resume" in err
    assert not out_dir.exists() and (tmp_path / "run.partial" / "recipe.json").is_file()
    monkeypatch.undo()
    code, _, err = apply_toy(capsys, tiny_model_dir, out_dir, *args)
    assert code == 0, err
    assert "resuming" in err
    assert (out_dir / "results.json").is_file() and not (tmp_path / "run.partial").exists()


def test_internal_error_exit_1(capsys, recipe_file, monkeypatch):
    import compresskit.api as api

    def broken(*a, **k):
        raise ZeroDivisionError("boom")

    monkeypatch.setattr(api, "load_model", broken)
    code, _, err = run(capsys, "apply", str(recipe_file))
    assert code == 1 and "internal error: ZeroDivisionError: boom (rerun with --debug" in err


def test_validate_takes_a_comparison_spec(capsys):
    """``validate`` on a comparison spec checks every member (it used to read the spec as one
    recipe and complain that ``compare`` is an unknown key)."""
    code, out, err = run(capsys, "validate", str(TESTS.parent / "recipes" / "compare-smollm2.yaml"))
    assert code == 0, err
    lines = out.strip().splitlines()
    assert len(lines) == 8 and all(ln.startswith("ok: ") for ln in lines)
    assert "pruner wide" in out and "pruner static-depth" in out


@pytest.mark.slow
def test_compare_spec_runs_members_once_then_reuses(capsys, tiny_model_dir, tmp_path):
    import yaml

    for s in (0.2, 0.4):
        member = {
            "name": f"toy-{s}",
            "model": {"name_or_path": str(tiny_model_dir), "dtype": "float32", "device": "cpu"},
            "pruner": {"name": "toy-magnitude", "config": {"sparsity": s}},
            "evaluation": {"tasks": ["piqa"], "limit": 4, "batch_size": 4, "max_length": 512},
            "output": {"dir": str(tmp_path / f"run-{s}")},
        }
        (tmp_path / f"m{s}.yaml").write_text(yaml.safe_dump(member))
    (tmp_path / "spec.yaml").write_text(
        yaml.safe_dump({"compare": ["m0.2.yaml", "m0.4.yaml"], "output": {"dir": str(tmp_path / "cmp")}})
    )
    code, out, err = run(capsys, "compare", str(tmp_path / "spec.yaml"))
    assert code == 0, err
    rows = (tmp_path / "cmp" / "compare.csv").read_text().splitlines()
    assert [r.split(",")[0] for r in rows] == ["run", "dense", "toy-0.2", "toy-0.4"]
    code, out, err = run(capsys, "compare", str(tmp_path / "spec.yaml"))
    assert code == 0 and err.count("reusing") == 2  # results with the same recipe hash are not rerun


def test_error_found_after_loading_leaves_no_partial_output(capsys, tiny_model_dir, tmp_path):
    """Some input can only be checked against the loaded model (a group size that does not divide
    the FFN width): still one line, exit 2, nothing left behind, and before the dense evaluation."""
    out_dir = tmp_path / "run"
    code, _, err = apply_toy(
        capsys, tiny_model_dir, out_dir, "--set", "pruner.name=toy-router", "--set", "pruner.config={groups: 100}"
    )
    assert code == 2 and "Traceback" not in err
    last = err.strip().splitlines()[-1]  # after the progress lines of the steps that ran
    assert last.startswith("error: pruner.config.groups: 100 does not divide intermediate_size 96; valid: ")
    assert not out_dir.exists() and not (tmp_path / "run.partial").exists()
    assert "dense reference" not in err  # checked before any expensive step


def test_a_bad_line_in_your_files_stops_apply_before_the_model_loads(capsys, recipe_file, tmp_path, monkeypatch):
    import compresskit.api as api

    (tmp_path / "a.jsonl").write_text('{"text": "fine text here"}\n{"txt": "typo"}\n')
    monkeypatch.setattr(api, "load_model", lambda *a, **k: pytest.fail("the model was loaded"))
    code, _, err = run(capsys, "apply", str(recipe_file), "--set", f"data.source={{files: ['{tmp_path}/a.jsonl']}}")
    assert code == 2 and f"{tmp_path}/a.jsonl line 2: no field 'text' (fields: txt)" in one_line_error(err)
    assert not (tmp_path / "run").exists() and not (tmp_path / "run.partial").exists()


@pytest.mark.slow
def test_compare_over_seeds_shows_mean_and_spread_and_reuses_runs(capsys, tiny_model_dir, tmp_path):
    """``compare --seeds 0,1`` runs a recipe once per seed (the routers start from each seed's draw),
    then shows one row with mean ± standard deviation; a second call reuses the runs."""
    import yaml

    recipe = {
        "name": "wide-tiny",
        "model": {"name_or_path": str(tiny_model_dir), "dtype": "float32", "device": "cpu"},
        "pruner": {"name": "toy-router", "config": {"groups": 6, "rank": 4}},
        "training": [{"name": "router", "config": {"steps": 2, "batch_size": 2, "seq_len": 32}}],
        "evaluation": {"tasks": ["perplexity", "piqa"], "limit": 4, "perplexity_docs": 1, "max_length": 512},
        "output": {"dir": str(tmp_path / "wide")},
    }
    (tmp_path / "w.yaml").write_text(yaml.safe_dump(recipe))
    code, out, err = run(capsys, "compare", str(tmp_path / "w.yaml"), "--seeds", "0,1", "--output", str(tmp_path / "c"))
    assert code == 0, err
    runs = [json.loads((tmp_path / f"wide-seed{s}" / "results.json").read_text()) for s in (0, 1)]
    assert [r["seeds"]["recipe"] for r in runs] == [0, 1]
    ppl = [r["metrics"]["perplexity"]["token_perplexity"] for r in runs]
    assert ppl[0] != ppl[1]  # the seeds drew different routers
    rows = list(__import__("csv").reader((tmp_path / "c" / "compare.csv").read_text().splitlines()))
    header, dense, wide = rows[0], rows[1], rows[2]
    assert dense[0] == "dense" and wide[0] == "wide-tiny" and wide[header.index("seeds")] == "0,1"
    mean, std = (sum(ppl) / 2), abs(ppl[0] - ppl[1]) / 2**0.5
    assert wide[header.index("held-out ppl")] == f"{mean:.2f} ± {std:.2f}"
    code, _, err = run(capsys, "compare", str(tmp_path / "w.yaml"), "--seeds", "0,1")
    assert code == 0 and err.count("reusing") == 2
    # a run folder that holds only its results (carried from another machine, its model left behind) is
    # reused as well where nothing needs the model (no speed to measure on a CPU)
    import shutil

    for item in (tmp_path / "wide-seed0").iterdir():
        if item.name not in ("results.json", "results.md"):
            shutil.rmtree(item) if item.is_dir() else item.unlink()
    code, _, err = run(capsys, "compare", str(tmp_path / "w.yaml"), "--seeds", "0,1", "--output", str(tmp_path / "c"))
    assert code == 0 and err.count("reusing") == 2, err
    again = list(__import__("csv").reader((tmp_path / "c" / "compare.csv").read_text().splitlines()))
    assert again[2] == wide
    code, _, err = run(capsys, "compare", str(tmp_path / "w.yaml"), "--seeds", "0,x")
    assert code == 2 and "--seeds: '0,x' is not a comma-separated list of integers" in one_line_error(err)


def _short_corpus(folder: Path, n: int = 8) -> Path:
    """``n`` documents of five 4-sentence paragraphs each, whose sentences are 12 words: next_sentence finds
    its items only where 3 or more documents are held out."""
    folder.mkdir()
    words = "the cat sat on a mat while dogs ran far away from home and birds sang songs".split()
    for i in range(n):
        paras = [
            " ".join(
                " ".join(words[(i + p + s + k) % len(words)] for k in range(12)).capitalize() + "." for s in range(4)
            )
            for p in range(5)
        ]
        (folder / f"doc{i}.txt").write_text("\n\n".join(paras))
    return folder


def test_validate_checks_that_the_tasks_find_their_items_in_your_text(capsys, recipe_file, tmp_path):
    """Before any model loads: a held-out share too small for next_sentence is one line that states the
    task's requirement and the way out; a larger share passes."""
    corpus = _short_corpus(tmp_path / "corpus")
    source = f"data.source={{files: ['{corpus}/*.txt']}}"
    code, _, err = run(
        capsys, "validate", str(recipe_file), "--set", source, "--set", "evaluation.tasks=[next_sentence]"
    )
    line = one_line_error(err)
    assert code == 2 and "next_sentence can build no item: an item needs a paragraph with 3 consecutive" in line
    assert "of the 2 held-out documents, 2 have such a paragraph, and 3 are needed" in line
    assert "Raise data.test_fraction" in line
    code, out, err = run(
        capsys, "validate", str(recipe_file), "--set", source, "--set", "data.test_fraction=0.5",
        "--set", "evaluation.tasks=[next_sentence]",
    )  # fmt: skip
    assert code == 0, err


def test_eval_takes_your_own_text(capsys, tiny_model_dir, tmp_path):
    """``compresskit eval MODEL --data FILE...``: the files and globs a recipe's data.source.files takes, split
    as a recipe splits them; what cannot be read or split is said before the model loads, naming the flags."""
    corpus = _short_corpus(tmp_path / "corpus")
    common = ["eval", str(tiny_model_dir), "--dtype", "float32", "--data", f"{corpus}/*.txt"]
    code, _, err = run(capsys, *common, "--tasks", "perplexity,next_sentence", "--test-fraction", "0.5")
    assert code == 0, err
    code, _, err = run(capsys, *common, "--tasks", "next_sentence", "--output", str(tmp_path / "r"))
    assert code == 2 and "Raise --test-fraction" in one_line_error(err)
    code, _, err = run(capsys, *common, "--tasks", "perplexity", "--output", str(tmp_path / "r"))
    results = json.loads((tmp_path / "r" / "results.json").read_text())
    assert code == 0 and results["data"]["source"] == "files" and results["data"]["test_articles"] == 2
    code, _, err = run(capsys, "eval", str(tiny_model_dir), "--data", str(tmp_path / "none*.txt"))
    assert code == 2 and one_line_error(err).startswith(f"error: --data: '{tmp_path}/none*.txt' matches no file")
    code, _, err = run(capsys, "eval", str(tiny_model_dir), "--test-fraction", "0.5")
    assert code == 2 and "--test-fraction: it splits your own text; give --data FILE... too" in one_line_error(err)
    code, _, err = run(capsys, "eval", "someone/some-model", "--tasks", "perplexity")
    assert code == 2 and "give --allow-download on a machine with network" in one_line_error(err)


def test_a_run_folder_is_taken_wherever_a_model_is(capsys, tiny_model_dir, tmp_path):
    """What apply prints (the run folder) works in generate, eval, bench and compresskit.load, as its model/
    does; eval names its results after the run, not "model"; a results-only run folder says so."""
    import compresskit

    run_dir = tmp_path / "my-run"
    recipe = str(TESTS / "recipes" / "tiny-wide-fit.yaml")
    code, out, err = run(
        capsys, "apply", recipe, "--set", f"model.name_or_path={tiny_model_dir}", "--set", f"output.dir={run_dir}"
    )
    assert code == 0, err
    results = json.loads((run_dir / "results.json").read_text())
    fit = results["training"][0]
    assert fit["stage"] == "router-fit" and fit["tokens"] == 256
    assert 0.2 < results["sparsity"]["macs"] < 0.4  # the budget, held on text the fit did not see
    code, out, err = run(capsys, "generate", str(run_dir), "--prompt", "hello", "--max-new-tokens", "3")
    assert code == 0, err
    by_run, by_model = compresskit.load(run_dir), compresskit.load(run_dir / "model")
    ids = torch.tensor([[3, 5, 7, 9]])
    with torch.no_grad():
        assert torch.equal(by_run.model(ids).logits, by_model.model(ids).logits)
    assert type(by_run.pruner).__name__ == "WidePruner"
    code, out, err = run(
        capsys, "eval", str(run_dir), "--tasks", "perplexity", "--perplexity-docs", "1", "--output", str(tmp_path / "e")
    )
    assert code == 0, err
    evaluated = json.loads((tmp_path / "e" / "results.json").read_text())
    assert evaluated["name"] == "my-run" and (tmp_path / "e" / "results.md").read_text().startswith("# my-run")
    code, out, err = run(capsys, "bench", str(run_dir), "--device", "cpu", "--new-tokens", "2", "--repeats", "1",
                         "--prompt", "8", "--transformers", "off")  # fmt: skip
    assert code == 0, err
    code, out, err = run(capsys, "compare", str(run_dir / "model"), str(tmp_path / "e"))
    assert code == 0 and "| tiny-wide-fit |" in out and "| my-run |" in out, err  # the eval: named after the run
    shutil.rmtree(run_dir / "model")  # its results only, as when the model stayed on another machine
    code, _, err = run(capsys, "generate", str(run_dir), "--prompt", "hello")
    assert code == 2 and "a run folder that holds its results only" in one_line_error(err)


def test_every_flag_has_help_text():
    import argparse

    from compresskit.cli import build_parser

    missing = []

    def walk(parser, prefix):
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, sub in action.choices.items():
                    walk(sub, [*prefix, name])
            elif not action.help and action.dest != "help":
                missing.append(" ".join([*prefix, *(action.option_strings or [action.dest])]))

    walk(build_parser(), [])
    assert missing == []


def test_rows_of_one_recipe_run_twice_are_set_apart_by_their_folders():
    from compresskit.cli import _name_apart

    runs = [{"name": "wide-smollm2-quick"}, {"name": "wide-smollm2-quick"}, {"name": "dense"}]
    _name_apart(runs, ["runs/mine", "runs/wide-smollm2-quick/results.json", "runs/dense"])
    assert [r["name"] for r in runs] == [
        "wide-smollm2-quick (runs/mine)",
        "wide-smollm2-quick (runs/wide-smollm2-quick)",
        "dense",
    ]
