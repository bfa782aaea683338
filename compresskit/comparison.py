"""Putting runs side by side honestly: runs are compared only with runs evaluated on the same items.

Two runs belong to one group when everything that decides *which* items were scored and how is the
same: the base model, the evaluation settings (tasks, limit, context, item counts, seed), the text
(the embedded wiki excerpt, or local files by content) and its split. Batch size and the logits
budget change no item and are left out. Each group leads with its own dense reference (when all its
compressed runs were measured against the same one and no dense run is in the group already).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Any

# evaluation keys that change how fast, not what is measured
_NOT_SETTINGS = ("batch_size", "logits_budget_mb", "compare_dense")


def eval_settings(run: dict[str, Any]) -> dict[str, Any]:
    """What decides the items a run was scored on (from its results document)."""
    recipe = run.get("recipe") or {}
    evaluation = {k: v for k, v in (recipe.get("evaluation") or {}).items() if k not in _NOT_SETTINGS}
    data = recipe.get("data") or {}
    model = run.get("model") or {}
    split = run.get("data") or {}
    files = split.get("files")  # a files source: the held-out text is the files' contents
    if split.get("source") in ("hf", "mixture"):  # every source's kind, weight and contents
        source = f"{split['source']} {split['fingerprint']}"
    elif files is not None:
        source = "files " + ",".join(f["sha256"][:12] for f in files)
    else:
        source = data.get("source", "wiki")
    return {
        "model": model.get("base_model") or model.get("name_or_path"),
        **evaluation,
        "source": source,
        "test_fraction": data.get("test_fraction"),
        "split_seed": data.get("split_seed"),
    }


@dataclass
class Group:
    settings: dict[str, Any]
    runs: list[dict[str, Any]] = field(default_factory=list)
    label: str = ""  # what sets this group apart from the others ("" when there is one group)


def _dense_row(runs: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The shared dense reference of a group's compressed runs as a row, or None."""
    refs = [r.get("dense") for r in runs if r.get("pruner")]
    if not refs or any(r is None for r in refs) or any(r.get("key") != refs[0].get("key") for r in refs):
        return None
    if any(not r.get("pruner") for r in runs):
        return None
    first = next(r for r in runs if r.get("pruner"))
    params = first["model"]["params_before"]
    return {
        "name": "dense",
        "pruner": None,
        "metrics": refs[0]["metrics"],
        "zero_shot_average": refs[0].get("zero_shot_average"),
        "sparsity": {"attention": 0.0, "ffn": 0.0, "macs": 0.0, "dynamic": False, "tokens": 0},
        "model": {"params_before": params, "params_after": params, "name_or_path": first["model"]["name_or_path"]},
        "recipe": first.get("recipe"),
        "dense": refs[0],
    }


def group_runs(runs: list[dict[str, Any]]) -> list[Group]:
    """Runs grouped by :func:`eval_settings`, in order of first appearance, each group led by its
    dense reference where one is known."""
    groups: list[Group] = []
    for run in runs:
        settings = eval_settings(run)
        group = next((g for g in groups if g.settings == settings), None)
        if group is None:
            group = Group(settings)
            groups.append(group)
        group.runs.append(run)
    for group in groups:
        dense = _dense_row(group.runs)
        if dense is not None:
            group.runs.insert(0, dense)
    if len(groups) > 1:
        differing = sorted(k for k in groups[0].settings if len({repr(g.settings.get(k)) for g in groups}) > 1)
        for i, group in enumerate(groups, 1):
            group.label = f"group {i}: " + ", ".join(f"{k}={group.settings.get(k)}" for k in differing)
    return groups


def _mean_std(values: list[float]) -> tuple[float, float]:
    """Mean and sample standard deviation (0 for a single value)."""
    return statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else 0.0


def aggregate_seeds(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One row for the runs of one recipe over several seeds: every metric's mean, with its sample
    standard deviation in ``spread`` (same shape as ``metrics``); the seeds and each run's recipe
    hash are kept. Sparsity is averaged too (None when any run did not measure it)."""
    first = runs[0]
    metrics: dict[str, dict[str, float]] = {}
    spread: dict[str, dict[str, float]] = {}
    for task, values in first["metrics"].items():
        for metric in values:
            samples = [r["metrics"].get(task, {}).get(metric) for r in runs]
            if any(v is None for v in samples):
                continue
            metrics.setdefault(task, {})[metric], spread.setdefault(task, {})[metric] = _mean_std(samples)
    zero_shot = [r.get("zero_shot_average") for r in runs]
    zs_mean, zs_std = _mean_std(zero_shot) if all(z is not None for z in zero_shot) else (None, None)
    sparsity = None
    if all(r.get("sparsity") is not None for r in runs):
        sparsity = {**first["sparsity"]}
        for key in ("attention", "ffn", "macs"):
            sparsity[key] = _mean_std([r["sparsity"][key] for r in runs])[0]
        sparsity.pop("per_layer", None)
        sparsity.pop("per_task", None)
    return {
        **first,
        "metrics": metrics,
        "spread": spread,
        "zero_shot_average": zs_mean,
        "zero_shot_spread": zs_std,
        "sparsity": sparsity,
        "seeds": [(r.get("seeds") or {}).get("recipe") for r in runs],
        "runs": [{"recipe_hash": r.get("recipe_hash"), "seed": (r.get("seeds") or {}).get("recipe")} for r in runs],
    }
