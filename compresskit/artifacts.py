"""Saving and loading compressed models.

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
import platform
import shutil
import warnings
from importlib import metadata
from pathlib import Path
from typing import Any, NamedTuple

import torch
from pydantic import ValidationError
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from compresskit import crashpoints, plugins
from compresskit.errors import ArtifactError, CompressKitError
from compresskit.files import MODEL_FILES_MARGIN_BYTES, disk_space, read_json, staged_dir, tensor_bytes, write_json
from compresskit.interfaces import PluginConfig, Pruner, RunContext
from compresskit.modeling import device_name, load_model
from compresskit.pipeline import NAME as PIPELINE
from compresskit.pipeline import Pipeline, PipelineConfig
from compresskit.recipe import stage_config_class

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
    if isinstance(pruner, Pipeline):
        return _save_pipeline(directory, model, tokenizer, pruner, base_model=base_model, recipe=recipe)
    stage_tensors = _stage_tensors(stages)
    manifest = _manifest(base_model, recipe)
    if pruner is not None and pruner.saves_full_model:
        manifest["format"] = "hf"
    elif pruner is None and not stage_tensors:
        manifest["format"] = "dense"
    else:
        manifest["format"] = "pruner"
    files: dict[str, dict[str, torch.Tensor]] = {}  # the tensor files of format "pruner", by name
    if manifest["format"] == "pruner":  # (in "hf", the full checkpoint holds what the stages changed)
        files, manifest["training"] = _stage_files(stages, model, "")
    if pruner is not None:
        manifest["pruner"] = {"name": pruner_name, "config": pruner.config.model_dump(mode="json")}
        if not pruner.saves_full_model:
            files[PRUNER_FILE] = {k: v.detach().contiguous().cpu() for k, v in pruner.state_dict(model).items()}
    meta = {PRUNER_FILE: {"pruner": str(pruner_name)}}
    return _write(directory, manifest, files, model, tokenizer, metadata=meta)


def _manifest(base_model: str, recipe: dict[str, Any] | None) -> dict[str, Any]:
    """What every saved model's manifest starts with (its ``format`` and ``pruner`` set by the caller)."""
    return {
        "format_version": FORMAT_VERSION,
        "base_model": base_model,
        "pruner": None,
        "training": [],
        "recipe": recipe,
        "versions": versions(),
    }


def _stage_tensors(stages: list[tuple[str, Any]] | None) -> list[tuple[int, str, Any]]:
    """``(index, name, trainer)`` of the stages that save tensors of their own (re-applied on load, in order)."""
    return [
        (i, name, t) for i, (name, t) in enumerate(stages or []) if hasattr(t, "state_dict") and hasattr(t, "restore")
    ]


def _stage_files(stages, model, prefix: str) -> tuple[dict[str, dict[str, torch.Tensor]], list[dict[str, Any]]]:
    """The tensor files of the ``stages`` that save their own (``<prefix>stage<i>-<name>.safetensors``) and their
    manifest entries."""
    files, entries = {}, []
    for i, name, trainer in _stage_tensors(stages):
        file = f"{prefix}stage{i}-{name}.safetensors"
        files[file] = {k: v.contiguous() for k, v in trainer.state_dict(model).items()}
        entries.append({"index": i, "name": name, "config": trainer.config.model_dump(mode="json"), "file": file})
    return files, entries


def _write(directory: Path, manifest, files, model, tokenizer, *, checkpoint: Path | None = None, metadata=None):
    """``directory`` written whole or not at all: the tensor ``files``, the full checkpoint of ``model`` (format
    hf), a copy of the plain ``checkpoint`` as ``base/`` with the tokenizer, the tokenizer and the manifest, last;
    after checking the disk holds them. ``metadata``: a tensor file's safetensors metadata, by file name."""
    tensors = [t for f in files.values() for t in f.values()]
    if manifest["format"] == "hf":
        tensors = list({t.data_ptr(): t for t in model.state_dict().values()}.values())
    needed = tensor_bytes(tensors) + MODEL_FILES_MARGIN_BYTES
    if checkpoint is not None:
        needed += sum(f.stat().st_size for f in Path(checkpoint).rglob("*") if f.is_file())
    with disk_space(directory.parent, needed, "saving the model"), staged_dir(directory) as tmp:
        for file, state in files.items():
            save_file(state, str(tmp / file), metadata=(metadata or {}).get(file))
            crashpoints.point(f"save {directory.name}/{file}: written, the model not whole")
        if manifest["format"] == "hf":
            model.save_pretrained(tmp)
        if checkpoint is not None:
            shutil.copytree(checkpoint, tmp / "base")
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        write_json(tmp / MANIFEST, manifest)
    return directory


def _save_pipeline(directory: Path, model, tokenizer, pipeline: Pipeline, *, base_model: str, recipe) -> Path:
    """A pipeline's model: ``format: hf`` where every step left a plain model (the checkpoint whole), else
    ``format: pipeline``: the plain model its first live step was given (``base/``, a transformers checkpoint with
    its tokenizer; the base model itself where no step before it saved one), then each live step's tensors and its
    stages' (re-attached in order on load). The manifest's ``steps`` keep each step's config as it ran, its report
    where taken when it finished, and its summary; ``original``: the first model's dimensions (the accounting)."""
    live = [k for k in range(len(pipeline.steps)) if pipeline.live(k)]
    checkpoint = pipeline.checkpoint if live else None
    manifest = _manifest(base_model, recipe)
    manifest["format"] = "pipeline" if live else "hf"
    manifest["pruner"] = {"name": PIPELINE, "config": pipeline.config.model_dump(mode="json")}
    manifest.update(original=pipeline.original, checkpoint="base" if checkpoint is not None else None, steps=[])
    files: dict[str, dict[str, torch.Tensor]] = {}
    for k, (spec, step) in enumerate(zip(pipeline.config.steps, pipeline.steps, strict=True)):
        entry = {
            "name": spec.name,
            "config": step.config.model_dump(mode="json"),
            "report": pipeline.reports[k],
            "summary": pipeline.summaries[k],
            "file": None,
            "training": [],
        }
        if k in live:
            entry["file"] = f"step{k}-{spec.name}.safetensors"
            files[entry["file"]] = {kk: v.detach().contiguous().cpu() for kk, v in step.state_dict(model).items()}
            stage_files, entry["training"] = _stage_files(pipeline.stages[k], model, f"step{k}-")
            files.update(stage_files)
        manifest["steps"].append(entry)
    return _write(directory, manifest, files, model, tokenizer, checkpoint=checkpoint)


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


RESULTS = "results.json"  # a run folder's mark (compresskit.api writes it last)


def saved_dir(path: str | Path) -> Path | None:
    """The saved model ``path`` names: ``path`` itself where it holds a manifest, its ``model/`` where it is
    a run folder (what ``compresskit apply`` prints), else None (an HF directory, an alias, a hub id).

    Raises:
        ArtifactError: ``path`` is a run folder whose model is not there (a results-only folder).
    """
    folder = Path(path).expanduser()
    if not folder.is_dir():
        return None
    if (folder / MANIFEST).is_file():
        return folder
    if (folder / "model" / MANIFEST).is_file():
        return folder / "model"
    if (folder / RESULTS).is_file() and not (folder / "config.json").is_file():
        raise ArtifactError(
            f"{folder}: a run folder that holds its results only (no model/ with a {MANIFEST}); "
            "its model was saved on another machine, or removed: run `compresskit apply` on its recipe again"
        )
    return None


def run_name(path: str | Path) -> str:
    """What to call the model at ``path`` in a table: its run's folder name for a run folder's ``model/``
    (not "model"), else the folder's or alias's own name."""
    folder = Path(path).expanduser()
    if folder.name == "model" and (folder / MANIFEST).is_file():
        return folder.resolve().parent.name
    return folder.name or str(path)


def read_manifest(directory: Path) -> dict[str, Any]:
    directory = Path(directory)
    if not directory.is_dir():
        raise ArtifactError(f"{directory}: model directory not found")
    directory = saved_dir(directory) or directory
    manifest = read_json(directory / MANIFEST, what=f"{MANIFEST} (is this a compresskit model directory?)")
    if manifest.get("format") not in ("dense", "pruner", "hf", "pipeline"):
        raise ArtifactError(
            f"{directory / MANIFEST}: unknown format {manifest.get('format')!r}; allowed: dense, pruner, hf, pipeline"
        )
    return manifest


class Loaded(NamedTuple):
    """What :func:`load` gives: the transformers ``model`` (routed as the run left it), its ``tokenizer`` and
    the ``pruner``: None for a dense model; for a method that saves a plain smaller model (``saves_full_model``) a
    fresh instance from its saved config, never prepared, whose ``sparsity(model)`` reads the model alone; for any
    other, the pruner attached, its tensors loaded and finalized. Unpacks as ``model, tokenizer, pruner``."""

    model: Any
    tokenizer: Any
    pruner: Pruner | None


def load(path: str | Path, *, device: str = "auto", dtype: str = "auto", progress=None) -> Loaded:
    """Rebuild a saved model: a :class:`Loaded` ``(model, tokenizer, pruner or None)``. ``path``: a saved model
    folder or the run folder that holds it (``model/``).

    ``format: pruner`` reloads the base model, re-attaches the pruner and loads its tensors;
    ``format: hf`` loads the saved checkpoint; ``format: dense`` loads the base model.
    """
    directory = Path(path).expanduser()
    directory = saved_dir(directory) or directory  # a run folder: its model/
    manifest = read_manifest(directory)
    fmt = manifest["format"]
    if (manifest.get("pruner") or {}).get("name") == PIPELINE:
        return _load_pipeline(directory, manifest, device=device, dtype=dtype, progress=progress)
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
    _restore_stages(directory, manifest.get("training", []), model, pruner, device)
    if pruner is not None:
        pruner.load_state_dict(model, _read_tensors(directory / PRUNER_FILE, device))
        model = pruner.finalize(model)
    model.eval()
    return Loaded(model, tokenizer, pruner)


def _restore_stages(directory: Path, stages: list[dict[str, Any]], model, pruner: Pruner | None, device: str) -> None:
    """Re-apply the saved tensors of training ``stages`` (manifest entries) that trained with ``pruner``."""
    for stage in stages:
        try:
            tcls = plugins.load("trainer", stage["name"])
        except CompressKitError as exc:
            raise ArtifactError(f"{directory / MANIFEST}: training stage {stage.get('index')}: {exc}") from None
        try:  # (with the pruner's training options where the stage took them)
            trainer = tcls(stage_config_class(tcls, type(pruner) if pruner else None).model_validate(stage["config"]))
        except ValidationError as exc:
            raise ArtifactError(
                f"{directory / MANIFEST}: training stage {stage['name']!r}: invalid config: {exc}"
            ) from None
        trainer.restore(model, _read_tensors(directory / stage["file"], device))


def _load_pipeline(directory: Path, manifest: dict[str, Any], *, device: str, dtype: str, progress) -> Loaded:
    """A saved pipeline (:func:`_save_pipeline`): its plain model loaded (the checkpoint whole, its ``base/``, or
    the base model), each live step re-attached in order with its stages' tensors and its own, and the
    :class:`~compresskit.pipeline.Pipeline` of all of them."""
    where = str(directory / MANIFEST)
    try:
        config = PipelineConfig.model_validate(manifest["pruner"]["config"])
        entries = list(manifest["steps"])
        original = dict(manifest["original"])
    except (KeyError, TypeError, ValidationError) as exc:
        raise ArtifactError(f"{where}: not a whole pipeline record ({type(exc).__name__}: {exc})") from None
    if manifest["format"] == "hf":
        source = str(directory)
    else:
        source = str(directory / manifest["checkpoint"]) if manifest.get("checkpoint") else manifest["base_model"]
    model, tokenizer = load_model(source, dtype=dtype, device=device, progress=progress)
    param = next(model.parameters())
    ctx = RunContext(model_config=model.config, tokenizer=tokenizer, device=param.device, dtype=param.dtype)
    steps = []
    for k, entry in enumerate(entries):
        try:
            cls = plugins.load("pruner", entry["name"])
        except CompressKitError as exc:
            raise ArtifactError(f"{where}: step {k}: {exc}") from None
        step = cls(_pruner_config(cls, entry.get("config", {}), f"{where}: step {k}"))
        if entry.get("file"):  # a live step: attached again, its tensors loaded
            step.prepare(model, ctx)
            _restore_stages(directory, entry.get("training", []), model, step, str(param.device))
            step.load_state_dict(model, _read_tensors(directory / entry["file"], str(param.device)))
            model = step.finalize(model)
        steps.append(step)
    reports = [e.get("report") for e in entries]
    summaries = [e.get("summary") for e in entries]
    pipeline = Pipeline(config, steps=steps, reports=reports, summaries=summaries, original=original)
    model.eval()
    return Loaded(model, tokenizer, pipeline)


def _read_tensors(file: Path, device: str) -> dict[str, torch.Tensor]:
    if not file.is_file():
        raise ArtifactError(f"{file}: tensors not found")
    try:
        return load_file(str(file), device=device)
    except (SafetensorError, OSError, ValueError) as exc:
        raise ArtifactError(f"{file}: corrupt safetensors file ({exc})") from None
