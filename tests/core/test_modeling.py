import pytest
from torch import nn

from compresskit.errors import ModelNotFoundError, TargetNotFoundError
from compresskit.modeling import load_model, replace_module, resolve_model_source, select_modules
from compresskit.testing import tiny_llama


def test_select_by_suffix_regex_and_ignore():
    model = tiny_llama()
    names = [n for n, _ in select_modules(model, ["mlp"])]
    assert names == ["model.layers.0.mlp", "model.layers.1.mlp"]
    names = [n for n, _ in select_modules(model, [r"re:.*\.(q|o)_proj"], ignore=["model.layers.0.self_attn.o_proj"])]
    assert names == [
        "model.layers.0.self_attn.q_proj",
        "model.layers.1.self_attn.q_proj",
        "model.layers.1.self_attn.o_proj",
    ]
    assert len(select_modules(model, ["re:.*"], kind=nn.Linear)) == 2 * 7 + 1  # + lm_head


def test_select_nothing_is_an_error():
    with pytest.raises(TargetNotFoundError, match=r"matched no module.*module names look like: model"):
        select_modules(tiny_llama(), ["mpl"])


def test_replace_module_returns_old():
    model = tiny_llama()
    new = nn.Identity()
    old = replace_module(model, "model.layers.0.mlp", new)
    assert model.model.layers[0].mlp is new and old.__class__.__name__ == "LlamaMLP"


@pytest.mark.parametrize(
    ("name", "match"),
    [
        ("./no/such/dir", "directory './no/such/dir' does not exist"),
        ("/no/such/dir", "does not exist"),
        ("meta-llama/Llama-3.1-8B", "looks like a hub id.*downloads are off.*allow_download"),
        ("smollm2-13m", "unknown model alias 'smollm2-13m'. Did you mean: smollm2-135m"),
    ],
)
def test_model_source_errors(name, match):
    with pytest.raises(ModelNotFoundError, match=match) as exc:
        resolve_model_source(name)
    assert str(exc.value).startswith("model.name_or_path:")


def test_directory_without_config(tmp_path):
    with pytest.raises(ModelNotFoundError, match="no config.json"):
        resolve_model_source(str(tmp_path))


def test_load_local_directory(tiny_model_dir):
    model, tok = load_model(str(tiny_model_dir), dtype="float32", device="cpu")
    assert model.config.num_hidden_layers == 2 and not model.training
    assert tok.pad_token is not None
