"""A method's own settings through the core's one generic door: ``--option`` (``compresskit.options``) for its
runtime executor, and a pruner's ``TrainingOptions`` merged into the training stages that train with it (the
third-party ``toy-router`` fixture's ``run_every_group``)."""

import pytest
import torch

from compresskit import plugins
from compresskit.errors import CompressKitError, RecipeError
from compresskit.executors import TorchExecutorConfig
from compresskit.interfaces import Pruner
from compresskit.options import configured_executor, option_label, option_text, parse_option, trained_notice
from compresskit.recipe import load_recipe


def test_an_option_is_dotted_keys_with_yaml_values():
    assert parse_option("a.b=0.5,a.c=x, d=3,e=true,f={}") == {"a": {"b": 0.5, "c": "x"}, "d": 3, "e": True, "f": {}}
    for given in ({"a": {"b": 0.5, "c": "x"}, "d": 3}, {"consensus": {}}, {"a": {"b": None}}, {"s": "1.0"}):
        assert parse_option(option_text(given)) == given, option_text(given)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("quorum", "'quorum' is no KEY=VALUE pair"),
        ("a.=1", "'a.=1' is no KEY=VALUE pair"),
        ("a.b=1,a.b=2", "a.b is given twice"),
        ("a=1,a.b=2", "a.b sets a field inside a, given a value"),
        (",", "give one or more KEY=VALUE pairs"),
    ],
)
def test_a_malformed_option_is_one_line_naming_it(text, message):
    with pytest.raises(CompressKitError, match=message) as info:
        parse_option(text)
    assert str(info.value).startswith(f"--option {text}") or "give one or more" in str(info.value)


def test_a_row_is_named_by_its_setting_as_the_executor_holds_it():
    assert option_label({"a": {"b": 0, "c": "x"}}) == "a (b 0, c x)"
    assert option_label({"compile": 1}, TorchExecutorConfig(compile=True)) == "compile True"
    assert option_label({"a": 1, "b": {"c": 2}}) == "a 1; b (c 2)"


class _Compiled(Pruner):
    """A method whose runtime executor is the core's ``torch`` and whose training leaves it compiled."""

    runtime_executor = "torch"

    def _prepare(self, model, ctx):
        return []

    def _finalize(self, model):
        return model

    @classmethod
    def trained_options(cls, recipe):
        return {"compile": True} if recipe.get("trained") else {}


def test_a_setting_is_checked_against_the_method_s_executor_config():
    assert configured_executor(_Compiled, {"compile": True}).config.compile is True
    with pytest.raises(CompressKitError, match=r"--option compiled=true: executor torch: compiled: unknown key"):
        configured_executor(_Compiled, {"compiled": True})
    toy = plugins.load("pruner", "toy-magnitude")
    with pytest.raises(CompressKitError, match="ToyMagnitudePruner runs on the runtime's own blocks"):
        configured_executor(toy, {"a": 1})


def test_a_run_scored_without_the_settings_it_was_trained_with_is_told_the_option():
    line = trained_notice("run r", _Compiled, {"trained": True}, TorchExecutorConfig())
    assert line == (
        "run r: its last training stage ran it with settings it is not scored with here (compile False), where such "
        "a model may do worse (--option compile=true scores it as it was trained)"
    )
    assert trained_notice("run r", _Compiled, {"trained": True}, TorchExecutorConfig(compile=True)) is None
    assert trained_notice("run r", _Compiled, {"trained": True}, None) == line  # None: the executor's defaults
    assert trained_notice("run r", _Compiled, {}, TorchExecutorConfig()) is None
    assert trained_notice("run r", None, {"trained": True}, None) is None


def _recipe(tiny_model_dir, tmp_path, pruner: str, stage: dict) -> dict:
    return {
        "model": {"name_or_path": str(tiny_model_dir)},
        "pruner": {"name": pruner, "config": {"groups": 4} if pruner == "toy-router" else {}},
        "training": [stage],
        "output": {"dir": str(tmp_path / "out")},
    }


def test_a_pruner_s_training_options_reach_the_stages_that_train_with_it(tiny_model_dir, tmp_path):
    stage = {"name": "router", "config": {"steps": 1, "run_every_group": True}}
    resolved = load_recipe(_recipe(tiny_model_dir, tmp_path, "toy-router", stage))
    assert resolved.training[0].config.run_every_group is True
    assert resolved.to_dict()["training"][0]["config"]["run_every_group"] is True
    assert load_recipe(resolved.to_dict()).hash() == resolved.hash()  # a saved recipe reads back the same
    with pytest.raises(RecipeError, match=r"training.0.config.run_every_group: unknown key") as info:
        load_recipe(_recipe(tiny_model_dir, tmp_path, "static-width", stage))  # another pruner: not its option
    assert str(info.value).endswith(
        "(run_every_group is a training option of pruner toy-router; this recipe's pruner has none such)"
    )
    fit = {"name": "router-fit", "config": {"run_every_group": True}}
    with pytest.raises(RecipeError, match=r"training.0.config.run_every_group: unknown key") as info:
        load_recipe(_recipe(tiny_model_dir, tmp_path, "toy-router", fit))  # a stage that does not train with it
    assert str(info.value).endswith("given to a stage that trains with it: finetune, lora, router)")
    stage["config"]["run_every_group"] = "sometimes"
    with pytest.raises(RecipeError, match=r"training.0.config.run_every_group"):
        load_recipe(_recipe(tiny_model_dir, tmp_path, "toy-router", stage))


def test_a_stage_trains_inside_the_pruner_s_scope_and_leaves_it(tiny_model_dir, tmp_path):
    """The toy's option runs every group in the stage's loop (what ran is logged beside the routers' own
    decisions), and its rule is gone after the stage."""
    from compresskit.data import DataModule
    from compresskit.interfaces import RunContext
    from compresskit.modeling import load_model
    from compresskit.routing import routed_projections
    from compresskit.trainers import RouterTrainer

    model, tok = load_model(str(tiny_model_dir), dtype="float32", device="cpu")
    stage = {"name": "router", "config": {"steps": 2, "batch_size": 2, "seq_len": 16, "run_every_group": True}}
    resolved = load_recipe(_recipe(tiny_model_dir, tmp_path, "toy-router", stage))
    pruner = resolved.pruner.cls(resolved.pruner.config)
    pruner.prepare(model, RunContext(model_config=model.config, tokenizer=tok, seed=0))
    summary = RouterTrainer(resolved.training[0].config).fit(model, pruner, DataModule(tok), RunContext(model.config))
    assert summary.history and all(h["sparsity_run_macs"] == 0.0 for h in summary.history)
    assert all(h["sparsity_macs"] > 0.0 for h in summary.history)  # the routers' own decisions skip
    assert all(p.rule is None for _, p in routed_projections(model))
    with torch.no_grad():
        model(torch.tensor([[1, 2, 3]]))  # per token again: no rule left behind
