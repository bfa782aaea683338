import json

import pytest
import torch

from compresskit import artifacts, files, plugins
from compresskit.errors import ArtifactError
from compresskit.interfaces import RunContext
from compresskit.modeling import load_model


def _pruned(tiny_model_dir, sparsity=0.4):
    model, tok = load_model(str(tiny_model_dir), dtype="float32", device="cpu")
    cls = plugins.load("pruner", "toy-magnitude")
    pruner = cls(cls.Config(sparsity=sparsity))
    pruner.prepare(model, RunContext(model_config=model.config, tokenizer=tok))
    model = pruner.finalize(model)
    return model, tok, pruner


def _saved(tiny_model_dir, tmp_path, sparsity=0.4):
    model, tok, pruner = _pruned(tiny_model_dir, sparsity)
    out = artifacts.save(
        tmp_path / "m", model, tok, base_model=str(tiny_model_dir), pruner_name="toy-magnitude", pruner=pruner
    )
    return out, model


def test_save_load_round_trip_identical_logits(tiny_model_dir, tmp_path):
    model, tok, pruner = _pruned(tiny_model_dir)
    ids = torch.randint(2, 300, (2, 12))
    out = artifacts.save(
        tmp_path / "m", model, tok, base_model=str(tiny_model_dir), pruner_name="toy-magnitude", pruner=pruner
    )
    manifest = json.loads((out / "compresskit.json").read_text())
    assert manifest["format"] == "pruner" and manifest["pruner"]["config"]["sparsity"] == 0.4
    assert "torch" in manifest["versions"]
    from safetensors.torch import load_file

    keys = set(load_file(str(out / "pruner.safetensors")))
    assert keys and all(k.startswith("toy.") for k in keys)  # only the plugin's own tensors
    loaded = artifacts.load(out, dtype="float32", device="cpu")
    model2, _, pruner2 = loaded  # a named tuple: unpacks as before
    assert loaded.model is model2 and loaded.pruner is pruner2 and loaded.tokenizer is loaded[1]
    assert "versions" in manifest and manifest["versions"]["cpu"].startswith("CPU (")  # never an empty name
    with torch.no_grad():
        assert torch.equal(model(ids).logits, model2(ids).logits)
    assert pruner2.state == "finalized"
    assert not list(tmp_path.glob(".m.*"))  # no staging leftovers


def test_missing_and_corrupt_artifacts(tiny_model_dir, tmp_path):
    with pytest.raises(ArtifactError, match="model directory not found"):
        artifacts.load(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ArtifactError, match="compresskit.json .*not found"):
        artifacts.load(tmp_path / "empty")
    out, model = _saved(tiny_model_dir, tmp_path)
    (out / "pruner.safetensors").write_bytes(b"\x00garbage")
    with pytest.raises(ArtifactError, match="pruner.safetensors: corrupt"):
        artifacts.load(out)
    (out / "compresskit.json").write_text("{not json")
    with pytest.raises(ArtifactError, match="corrupt"):
        artifacts.load(out)


def test_missing_key_is_an_error_not_a_silent_default(tiny_model_dir, tmp_path):
    from safetensors.torch import load_file, save_file

    out, model = _saved(tiny_model_dir, tmp_path)
    state = load_file(str(out / "pruner.safetensors"))
    state.pop(sorted(state)[0])
    save_file(state, str(out / "pruner.safetensors"))
    with pytest.raises(ArtifactError, match="missing keys"):
        artifacts.load(out)


def test_newer_artifact_keys_dropped_with_warning(tiny_model_dir, tmp_path):
    out, model = _saved(tiny_model_dir, tmp_path)
    manifest = json.loads((out / "compresskit.json").read_text())
    manifest["pruner"]["config"]["added_in_a_later_version"] = 1
    (out / "compresskit.json").write_text(json.dumps(manifest))
    with pytest.warns(UserWarning, match="added_in_a_later_version"):
        artifacts.load(out)


def test_staged_dir_leaves_nothing_on_failure(tmp_path):
    with pytest.raises(RuntimeError), files.staged_dir(tmp_path / "out") as tmp:
        (tmp / "half-written").write_text("x")
        raise RuntimeError("interrupted")
    assert list(tmp_path.iterdir()) == []
