"""Saving and loading compressed models, and atomic output writing.

A compresskit model directory (``<output.dir>/model``) holds:

* ``compresskit.json``: format, base model, pruner name and resolved config, the resolved
  recipe, package versions;
* ``pruner.safetensors``: only the pruner's own tensors (routers, masks, ...), when the pruner
  re-applies itself to the base model on load (``format: "pruner"``);
* or a full transformers checkpoint (``format: "hf"``) when the pruner produced a plain,
  smaller model that stock ``from_pretrained`` loads;
* the tokenizer files.

A dense run (no pruner) records the base model only (``format: "dense"``).
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import shutil
import tempfile
import warnings
from collections.abc import Iterator
from importlib import metadata
from pathlib import Path
from typing import Any, NamedTuple

import torch
from pydantic import ValidationError
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from compresskit import plugins
from compresskit.errors import ArtifactError, CompressKitError, RecipeError
from compresskit.interfaces import PluginConfig, Pruner, RunContext
from compresskit.modeling import device_name, load_model

MANIFEST = "compresskit.json"
PRUNER_FILE = "pruner.safetensors"
FORMAT_VERSION = 1


def versions() -> dict[str, str]:
    """Versions of what determines the numbers."""
    out = {"python": platform.python_version()}
    for dist in ("compresskit", "torch", "transformers", "lm_eval", "datasets", "safetensors", "pydantic", "triton"):
        with contextlib.suppress(metadata.PackageNotFoundError):
            out[dist] = metadata.version(dist)
    out["cuda"] = torch.version.cuda or "none"
    if torch.cuda.is_available():
        out["gpu"] = torch.cuda.get_device_name(0)
    out["cpu"] = device_name("cpu")
    return out


def write_json(path: Path, data: Any) -> None:
    """Write JSON atomically (temp file in the same folder, then rename)."""
    write_text(path, json.dumps(data, indent=2, sort_keys=False) + "\n")


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def write_text(path: Path, text: str) -> None:
    """Write text atomically (temp file in the same folder, then rename), with the mode a plain
    ``open`` would give (0644 under the usual umask), not the temp file's 0600."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        os.fchmod(fd, 0o666 & ~_umask())
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def read_json(path: Path, *, what: str = "file") -> Any:
    if not path.is_file():
        raise ArtifactError(f"{path}: {what} not found")
    try:
        return json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ArtifactError(f"{path}: {what} is corrupt (not valid JSON: {exc})") from None


def check_creatable(path: Path, field: str) -> None:
    """Raise :class:`RecipeError` naming ``field`` unless ``path`` is a directory that exists or can
    be created, in a parent where a run can stage its outputs beside it. Probes with a temporary
    directory that is removed at once: nothing is left behind."""
    path = Path(path).expanduser()
    if path.exists() and not path.is_dir():
        raise RecipeError(f"{field}: {str(path)!r} exists and is not a directory")
    probe = path.absolute().parent
    while not probe.exists():
        probe = probe.parent
    if not probe.is_dir():
        raise RecipeError(f"{field}: cannot create {str(path)!r}: {str(probe)!r} is a file, not a directory")
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".compresskit-probe-", dir=probe))
    except OSError as exc:
        reason = exc.strerror or type(exc).__name__
        raise RecipeError(
            f"{field}: cannot create {str(path)!r} ({reason} in {str(probe)!r}); choose a writable directory"
        ) from None


def _make_dir(tmp_prefix: str, parent: Path) -> Path:
    """``mkdtemp`` with the mode a plain ``mkdir`` would give (0755 under the usual umask)."""
    tmp = Path(tempfile.mkdtemp(prefix=tmp_prefix, dir=parent))
    os.chmod(tmp, 0o777 & ~_umask())
    return tmp


def _umask_modes(root: Path) -> None:
    """Give every file under ``root`` the mode a plain ``open`` would (some writers, safetensors
    among them, create 0600 files) and every folder a plain ``mkdir``'s."""
    mask = _umask()
    for path in (root, *root.rglob("*")):
        if not path.is_symlink():
            os.chmod(path, (0o777 if path.is_dir() else 0o666) & ~mask)


@contextlib.contextmanager
def staged_dir(target: Path) -> Iterator[Path]:
    """Build a directory next to ``target`` and move it into place only when the block succeeds."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = _make_dir(f".{target.name}.", target.parent)
    try:
        yield tmp
        _umask_modes(tmp)
        replace_dir(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


@contextlib.contextmanager
def staged_files(target: Path) -> Iterator[Path]:
    """Build files in a folder next to ``target``; when the block succeeds, move each into
    ``target`` (one atomic rename per file), leaving every other file of ``target`` as it was."""
    target.mkdir(parents=True, exist_ok=True)
    tmp = _make_dir(f".{target.name}.", target.parent)
    try:
        yield tmp
        for item in sorted(tmp.iterdir()):
            os.replace(item, target / item.name)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def replace_dir(src: Path, target: Path) -> None:
    """Move ``src`` to ``target``, replacing an existing ``target`` with one rename each."""
    if target.exists():
        old = target.with_name(f".{target.name}.old-{os.getpid()}")
        os.replace(target, old)
        os.replace(src, target)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(src, target)


def save(
    directory: Path,
    model: torch.nn.Module,
    tokenizer,
    *,
    base_model: str,
    pruner_name: str | None = None,
    pruner: Pruner | None = None,
    stages: list[tuple[str, Any]] | None = None,
    recipe: dict[str, Any] | None = None,
) -> Path:
    """Save a (compressed) model to ``directory`` atomically; see the module docstring.

    ``stages`` are the training stages that ran, as (name, trainer); those that change the model
    beyond the pruner's tensors (LoRA) save their own tensors, re-applied on load in order.
    """
    directory = Path(directory)
    stage_tensors = [
        (i, name, t) for i, (name, t) in enumerate(stages or []) if hasattr(t, "state_dict") and hasattr(t, "restore")
    ]
    with staged_dir(directory) as tmp:
        manifest: dict[str, Any] = {
            "format_version": FORMAT_VERSION,
            "base_model": base_model,
            "pruner": None,
            "training": [],
            "recipe": recipe,
            "versions": versions(),
        }
        if pruner is not None and pruner.saves_full_model:
            manifest["format"] = "hf"
        elif pruner is None and not stage_tensors:
            manifest["format"] = "dense"
        else:
            manifest["format"] = "pruner"
        for i, name, trainer in stage_tensors:
            if manifest["format"] == "hf":
                break  # the full checkpoint already holds what the stages changed
            file = f"stage{i}-{name}.safetensors"
            save_file({k: v.contiguous() for k, v in trainer.state_dict(model).items()}, str(tmp / file))
            manifest["training"].append(
                {"index": i, "name": name, "config": trainer.config.model_dump(mode="json"), "file": file}
            )
        if pruner is not None:
            manifest["pruner"] = {"name": pruner_name, "config": pruner.config.model_dump(mode="json")}
            if pruner.saves_full_model:
                model.save_pretrained(tmp)
            else:
                state = {k: v.detach().contiguous().cpu() for k, v in pruner.state_dict(model).items()}
                save_file(state, str(tmp / PRUNER_FILE), metadata={"pruner": str(pruner_name)})
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        write_json(tmp / MANIFEST, manifest)
    return directory


def _pruner_config(cls: type[Pruner], data: dict[str, Any], where: str) -> PluginConfig:
    """Validate a saved pruner config; keys this version does not know are dropped with a warning
    (artifacts from a newer version), everything else must validate."""
    try:
        return cls.Config.model_validate(data)
    except ValidationError as exc:
        unknown = [e["loc"][0] for e in exc.errors() if e["type"] == "extra_forbidden" and len(e["loc"]) == 1]
        if not unknown or len(unknown) != len(exc.errors()):
            raise ArtifactError(f"{where}: saved pruner config is invalid: {exc.errors()[0]['msg']}") from None
        warnings.warn(f"{where}: dropping keys this compresskit does not know: {unknown}", stacklevel=3)
        return cls.Config.model_validate({k: v for k, v in data.items() if k not in unknown})


def read_manifest(directory: Path) -> dict[str, Any]:
    directory = Path(directory)
    if not directory.is_dir():
        raise ArtifactError(f"{directory}: model directory not found")
    manifest = read_json(directory / MANIFEST, what=f"{MANIFEST} (is this a compresskit model directory?)")
    if manifest.get("format") not in ("dense", "pruner", "hf"):
        raise ArtifactError(
            f"{directory / MANIFEST}: unknown format {manifest.get('format')!r}; allowed: dense, pruner, hf"
        )
    return manifest


class Loaded(NamedTuple):
    """What :func:`load` gives: the transformers ``model`` (routed as the run left it), its ``tokenizer`` and
    the ``pruner`` that routes it (None for a dense or static model); unpacks as ``model, tokenizer, pruner``."""

    model: Any
    tokenizer: Any
    pruner: Pruner | None


def load(path: str | Path, *, device: str = "auto", dtype: str = "auto", progress=None) -> Loaded:
    """Rebuild a saved model: a :class:`Loaded` ``(model, tokenizer, pruner or None)``.

    ``format: pruner`` reloads the base model, re-attaches the pruner and loads its tensors;
    ``format: hf`` loads the saved checkpoint; ``format: dense`` loads the base model.
    """
    directory = Path(path)
    manifest = read_manifest(directory)
    fmt = manifest["format"]
    if fmt == "hf":
        model, tokenizer = load_model(str(directory), dtype=dtype, device=device, progress=progress)
    else:
        model, tokenizer = load_model(manifest["base_model"], dtype=dtype, device=device, progress=progress)
    if fmt == "dense":
        return Loaded(model, tokenizer, None)
    info = manifest.get("pruner")
    pruner = None
    if info is not None:
        try:
            cls = plugins.load("pruner", info["name"])
        except CompressKitError as exc:
            raise ArtifactError(f"{directory / MANIFEST}: {exc}") from None
        pruner = cls(_pruner_config(cls, info.get("config", {}), str(directory / MANIFEST)))
    if fmt == "hf":
        return Loaded(model, tokenizer, pruner)
    param = next(model.parameters())
    device = str(param.device)
    ctx = RunContext(model_config=model.config, tokenizer=tokenizer, device=param.device, dtype=param.dtype)
    if pruner is not None:
        pruner.prepare(model, ctx)
    for stage in manifest.get("training", []):
        try:
            tcls = plugins.load("trainer", stage["name"])
        except CompressKitError as exc:
            raise ArtifactError(f"{directory / MANIFEST}: training stage {stage.get('index')}: {exc}") from None
        try:
            trainer = tcls(tcls.Config.model_validate(stage["config"]))
        except ValidationError as exc:
            raise ArtifactError(
                f"{directory / MANIFEST}: training stage {stage['name']!r}: invalid config: {exc}"
            ) from None
        trainer.restore(model, _read_tensors(directory / stage["file"], device))
    if pruner is not None:
        pruner.load_state_dict(model, _read_tensors(directory / PRUNER_FILE, device))
        model = pruner.finalize(model)
    model.eval()
    return Loaded(model, tokenizer, pruner)


def _read_tensors(file: Path, device: str) -> dict[str, torch.Tensor]:
    if not file.is_file():
        raise ArtifactError(f"{file}: tensors not found")
    try:
        return load_file(str(file), device=device)
    except (SafetensorError, OSError, ValueError) as exc:
        raise ArtifactError(f"{file}: corrupt safetensors file ({exc})") from None
