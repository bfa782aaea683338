import json
from pathlib import Path

import pytest

from compresskit.errors import RecipeError
from compresskit.recipe import apply_overrides, load_raw, load_recipe

BASE = {"model": {"name_or_path": "smollm2-135m"}, "output": {"dir": "runs/x"}}


def write(path, text):
    path.write_text(text)
    return path


def test_minimal_recipe_gets_defaults():
    r = load_recipe(dict(BASE))
    assert r.recipe.executor.name == "torch"
    assert r.recipe.evaluation.tasks == ["perplexity", "piqa", "next_sentence"]
    assert r.pruner is None and r.training == []
    assert r.to_dict()["executor"]["config"] == {"schema_version": 1, "compile": False}


def test_include_composes_and_precedence(tmp_path):
    (tmp_path / "base").mkdir()
    write(tmp_path / "base" / "eval.yaml", "evaluation: {limit: 5, batch_size: 3}\nseed: 1\n")
    write(
        tmp_path / "r.yaml",
        "include: base/eval.yaml\nseed: 2\nmodel: {name_or_path: smollm2-135m}\n"
        "evaluation: {limit: 7}\noutput: {dir: o}\n",
    )
    r = load_recipe(tmp_path / "r.yaml", ["evaluation.batch_size=9"])
    assert r.recipe.seed == 2  # the including file wins over the include
    assert r.recipe.evaluation.limit == 7
    assert r.recipe.evaluation.batch_size == 9  # CLI wins over both
    assert r.overrides == ["evaluation.batch_size=9"]


def test_include_cycle(tmp_path):
    write(tmp_path / "a.yaml", "include: b.yaml\n")
    write(tmp_path / "b.yaml", "include: a.yaml\n")
    with pytest.raises(RecipeError, match="include cycle"):
        load_raw(tmp_path / "a.yaml")


def test_misspelt_top_level_key_suggests():
    with pytest.raises(RecipeError) as exc:
        load_recipe({**BASE, "evalution": {"limit": 3}})
    msg = str(exc.value)
    assert "evalution" in msg and "Did you mean: evaluation?" in msg and "Available:" in msg


def test_misspelt_nested_key_names_path():
    with pytest.raises(RecipeError) as exc:
        load_recipe({**BASE, "evaluation": {"limt": 3}})
    assert "evaluation.limt" in str(exc.value) and "limit" in str(exc.value)


def test_bad_value_names_path_given_and_allowed():
    with pytest.raises(RecipeError) as exc:
        load_recipe({**BASE, "model": {"name_or_path": "x", "dtype": "float8"}})
    msg = str(exc.value)
    assert "model.dtype" in msg and "float8" in msg and "bfloat16" in msg


def test_unknown_plugin_did_you_mean():
    with pytest.raises(RecipeError) as exc:
        load_recipe({**BASE, "executor": {"name": "trch"}})
    msg = str(exc.value)
    assert msg.startswith("executor.name:") and "Did you mean: torch?" in msg


def test_plugin_config_validated_with_yaml_path():
    with pytest.raises(RecipeError) as exc:
        load_recipe({**BASE, "pruner": {"name": "toy-magnitude", "config": {"sparsity": 1.5}}})
    msg = str(exc.value)
    assert "pruner.config.sparsity" in msg and "1.5" in msg and "less than 1" in msg
    with pytest.raises(RecipeError, match=r"pruner\.config\.sparsty.*Did you mean: sparsity"):
        load_recipe({**BASE, "pruner": {"name": "toy-magnitude", "config": {"sparsty": 0.5}}})


def test_training_stage_path():
    with pytest.raises(RecipeError, match=r"training\.1\.name: unknown trainer 'nope'"):
        load_recipe({**BASE, "training": [{"name": "none"}, {"name": "nope"}]})


def test_overrides_types_and_lists():
    raw = apply_overrides(
        {**BASE, "training": [{"name": "none"}]},
        ["evaluation.limit=12", "training.0.config.x=[1, 2]", "model.allow_download=true", "name=abc"],
    )
    assert raw["evaluation"]["limit"] == 12
    assert raw["training"][0]["config"]["x"] == [1, 2]
    assert raw["model"]["allow_download"] is True
    with pytest.raises(RecipeError, match="KEY=VALUE"):
        apply_overrides(BASE, ["evaluation.limit"])
    with pytest.raises(RecipeError, match="out of range"):
        apply_overrides({**BASE, "training": []}, ["training.3.name=none"])


def test_hash_ignores_output_but_not_settings():
    a = load_recipe(dict(BASE))
    b = load_recipe({**BASE, "output": {"dir": "elsewhere"}})
    c = load_recipe({**BASE, "seed": 5})
    assert a.hash() == b.hash() != c.hash()


def test_resolved_recipe_round_trips_through_json():
    r = load_recipe({**BASE, "pruner": {"name": "toy-magnitude", "config": {"sparsity": 0.2}}})
    again = load_recipe(json.loads(json.dumps(r.to_dict())))
    assert again.to_dict() == r.to_dict() and again.hash() == r.hash()


def test_cross_field_rules():
    with pytest.raises(RecipeError, match="output.dir 'm' would overwrite the input model.name_or_path 'm'"):
        load_recipe({"model": {"name_or_path": "m"}, "output": {"dir": "m"}})
    with pytest.raises(RecipeError, match="evaluation.tasks: .*listed twice"):
        load_recipe({**BASE, "evaluation": {"tasks": ["piqa", "piqa"]}})
    with pytest.raises(RecipeError, match="evaluation.tasks: .*at least one task"):
        load_recipe({**BASE, "evaluation": {"tasks": []}})
    generated = {"source": {"generated": {"documents": 4}}}
    with pytest.raises(RecipeError, match="only generated text, .*tasks perplexity, next_sentence would have no held"):
        load_recipe({**BASE, "data": generated})
    load_recipe({**BASE, "data": generated, "evaluation": {"tasks": ["piqa"]}})  # no held-out text needed
    load_recipe({**BASE, "data": {"source": [{"source": "wiki"}, generated]}})


def test_newer_schema_version_refused():
    with pytest.raises(RecipeError, match="schema_version"):
        load_recipe({**BASE, "schema_version": 99})


def test_yaml_syntax_error_names_line(tmp_path):
    write(tmp_path / "bad.yaml", "model: {name_or_path: x\noutput: [\n")
    with pytest.raises(RecipeError, match="not valid YAML at line"):
        load_recipe(tmp_path / "bad.yaml")


def test_every_shipped_recipe_validates():
    from compresskit.recipe import is_comparison, load_comparison

    root = Path(__file__).parents[2] / "recipes"
    recipes = [p for p in root.rglob("*.yaml") if not p.parent.name.startswith("_") and not p.name.startswith("_")]
    assert recipes
    hashes = {}
    for path in recipes:
        if is_comparison(path):
            members = load_comparison(path)[0]
            assert members
            continue
        r = load_recipe(path)
        hashes.setdefault(r.hash(), []).append(path.name)
    assert all(len(v) == 1 for v in hashes.values()), hashes  # no two shipped recipes run the same thing


def test_comparison_spec(tmp_path):
    from compresskit.recipe import is_comparison, load_comparison

    write(tmp_path / "a.yaml", "model: {name_or_path: smollm2-135m}\noutput: {dir: x}\n")
    write(tmp_path / "c.yaml", "compare: [a.yaml]\noutput: {dir: out}\n")
    assert is_comparison(tmp_path / "c.yaml") and not is_comparison(tmp_path / "a.yaml")
    members, out, seeds = load_comparison(tmp_path / "c.yaml")
    assert members == [tmp_path / "a.yaml"] and out == Path("out") and seeds is None
    write(tmp_path / "s.yaml", "compare: [a.yaml]\nseeds: [0, 1, 2]\noutput: {dir: out}\n")
    assert load_comparison(tmp_path / "s.yaml")[2] == [0, 1, 2]
    write(tmp_path / "s2.yaml", "compare: [a.yaml]\nseeds: [0, 0]\noutput: {dir: out}\n")
    with pytest.raises(RecipeError, match="a seed is listed twice"):
        load_comparison(tmp_path / "s2.yaml")
    write(tmp_path / "bad.yaml", "compare: [a.yaml, nope.yaml]\noutput: {dir: out}\n")
    with pytest.raises(RecipeError, match="recipe files not found: .*nope.yaml"):
        load_comparison(tmp_path / "bad.yaml")
    write(tmp_path / "typo.yaml", "compare: [a.yaml]\noutptu: {dir: out}\n")
    with pytest.raises(RecipeError, match="Did you mean: output"):
        load_comparison(tmp_path / "typo.yaml")


def test_check_divides_names_field_numbers_and_choices():
    from compresskit.errors import check_divides

    check_divides("x.size", 3, 9, "heads")
    with pytest.raises(RecipeError, match=r"^x.size: 4 does not divide heads 9; valid: 1, 3, 9$"):
        check_divides("x.size", 4, 9, "heads")
