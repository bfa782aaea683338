from pathlib import Path

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


def test_a_mistyped_run_folder_is_not_read_as_a_hub_id(tmp_path, monkeypatch):
    """``runs/my-rnu`` where ``runs/`` exists: a folder that does not exist, not a hub id to download."""
    (tmp_path / "runs").mkdir()
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ModelNotFoundError, match="directory 'runs/my-rnu' does not exist"):
        resolve_model_source("runs/my-rnu")


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


@pytest.mark.parametrize("family", ["mistral", "qwen2"])
def test_other_families_run_the_pipeline(family, tmp_path, tiny_recipe):
    from compresskit.api import apply
    from compresskit.testing import save_tiny_model

    path = save_tiny_model(tmp_path / family, family=family)
    recipe = {**tiny_recipe, "model": {**tiny_recipe["model"], "name_or_path": str(path)}}
    recipe["pruner"] = {"name": "toy-magnitude", "config": {"sparsity": 0.5}}
    recipe["evaluation"] = {**recipe["evaluation"], "tasks": ["piqa"], "limit": 3, "compare_dense": False}
    res = apply(recipe).results
    assert res["sparsity"]["ffn"] == pytest.approx(0.5, abs=0.01)
    assert 0 <= res["metrics"]["piqa"]["acc"] <= 1


def test_unsupported_family_is_refused(tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel

    from compresskit.errors import RecipeError

    GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=64)).save_pretrained(tmp_path)
    with pytest.raises(RecipeError, match="model_type 'gpt2' is not supported; supported: llama, mistral, qwen2"):
        load_model(str(tmp_path), device="cpu")


def test_load_local_directory(tiny_model_dir):
    model, tok = load_model(str(tiny_model_dir), dtype="float32", device="cpu")
    assert model.config.num_hidden_layers == 2 and not model.training
    assert tok.pad_token is not None


def test_cache_kwargs_names_the_keyword_the_forward_takes():
    """The KV cache goes in as ``cache`` where the model's forward names it so (transformers 5.24),
    else as ``past_key_values`` (5.17, the GPU machine's)."""
    import inspect

    from compresskit.modeling import cache_kwargs

    class Old(nn.Module):
        def forward(self, input_ids, past_key_values=None, use_cache=None):
            return input_ids

    marker = object()
    assert cache_kwargs(Old(), marker) == {"past_key_values": marker}
    model = tiny_llama()
    expected = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    assert cache_kwargs(model, marker) == {expected: marker}


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="the process's peak is read from /proc")
def test_cpu_peak_memory_is_the_process_resident_peak_and_resets():
    import torch

    from compresskit.modeling import memory_kind, peak_memory, release_freed_memory, reset_peak_memory

    cpu = torch.device("cpu")
    reset_peak_memory(cpu)
    low = peak_memory(cpu)
    block = torch.ones(64 * 2**20 // 4)  # 64 MiB, touched
    high = peak_memory(cpu)
    assert high - low >= 60 * 2**20
    del block
    release_freed_memory()
    reset_peak_memory(cpu)
    assert peak_memory(cpu) < high - 32 * 2**20  # freed, handed back, and the count started afresh
    assert memory_kind(cpu) == "peak resident memory" and memory_kind("cuda:0") == "peak GPU memory"


def test_cpu_peak_memory_without_proc_is_unknown(monkeypatch):
    import torch

    from compresskit import modeling

    real = Path.read_text

    def no_proc(self, *a, **k):
        if str(self).startswith("/proc/"):
            raise FileNotFoundError(self)
        return real(self, *a, **k)

    monkeypatch.setattr(Path, "read_text", no_proc)
    assert modeling.peak_memory(torch.device("cpu")) is None


def test_a_checkpoint_that_does_not_fit_its_config_says_why(tmp_path):
    """transformers logs a load report (hidden by quiet logging) and raises "look at the above report": the
    error is one ArtifactError that carries the report's rows, the keys and their shapes."""
    import json

    from compresskit.errors import ArtifactError
    from compresskit.modeling import load_model
    from compresskit.testing import save_tiny_model

    folder = save_tiny_model(tmp_path / "m")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "intermediate_size": 64}))
    with pytest.raises(ArtifactError) as err:
        load_model(str(folder), dtype="float32", device="cpu")
    message = str(err.value)
    assert "the checkpoint does not fit the model" in message and "\n" not in message
    assert "mlp.up_proj.weight MISMATCH" in message and "torch.Size([96, 48])" in message


def test_catching_the_load_report_adds_no_warning_of_its_own(tiny_model_dir):
    """transformers runs (and warns of) more checks where its loader's logger has a level set: catching the
    report leaves that level alone where the report gets through without it."""
    import logging

    from compresskit.modeling import load_model

    said: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            said.append(record.getMessage())

    library, keep = logging.getLogger("transformers"), Keep()
    level = library.level
    library.setLevel(logging.WARNING)  # transformers' own default (a test run may lower it)
    library.addHandler(keep)
    try:
        load_model(str(tiny_model_dir), dtype="float32", device="cpu")
    finally:
        library.removeHandler(keep)
        library.setLevel(level)
    assert not [m for m in said if "not sharded" in m]
