"""Putting runs side by side honestly: runs are compared only with runs evaluated on the same items.

Two runs belong to one group when they were scored on the same held-out text of the same base model (the
embedded wiki excerpt, or local files by content, and its split) under the same settings that apply to every
task (context, engine), and each task both ran was run on the same items (its own settings: the documents
perplexity read, the items and seed of next_sentence, the limit and shots of a zero-shot task). A run that
scored perplexity only and one that also scored PIQA on the same held-out documents share a group and their
perplexity column; the PIQA cell of the first is empty. Batch size and the logits budget change no item
and are left out. Each group leads with its own dense reference (when all its compressed runs were measured
against the same one and no dense run is in the group already); a compressed run evaluated without one (an
``eval`` of a saved run) is compared with the group's dense run on the tasks they share.
"""

from __future__ import annotations

import hashlib
import math
import statistics
from dataclasses import dataclass, field
from typing import Any

from compresskit.pipeline import NAME as PIPELINE

# evaluation keys that change how fast, not what is measured
_NOT_SETTINGS = ("batch_size", "logits_budget_mb", "compare_dense")
# evaluation keys that decide the items of some tasks only (task_settings), not of the run as a whole
_PER_TASK = ("tasks", "limit", "num_fewshot", "task_paths", "perplexity_docs", "next_sentence_items", "seed")


def _evaluation(run: dict[str, Any]) -> dict[str, Any]:
    return ((run.get("recipe") or {}).get("evaluation")) or {}


def eval_settings(run: dict[str, Any]) -> dict[str, Any]:
    """What decides the items of every task a run scored (from its results document): the base model,
    the held-out text and its split, and the evaluation settings that apply to every task."""
    recipe = run.get("recipe") or {}
    evaluation = {k: v for k, v in _evaluation(run).items() if k not in _NOT_SETTINGS + _PER_TASK}
    data = recipe.get("data") or {}
    model = run.get("model") or {}
    split = run.get("data") or {}
    files = split.get("files")  # a files source: the held-out text is the files' contents
    if split.get("source") in ("hf", "mixture"):  # every source's kind, weight and contents
        source = f"{split['source']} {split['fingerprint']}"
    elif files is not None:  # the files' contents, in order, as one short fingerprint
        digest = hashlib.sha256(",".join(f["sha256"] for f in files).encode()).hexdigest()[:12]
        source = f"{len(files)} files {digest}"
    else:
        source = data.get("source", "wiki")
    return {
        "model": model.get("base_model") or model.get("name_or_path"),
        **evaluation,
        "source": source,
        "test_fraction": data.get("test_fraction"),
        "split_seed": data.get("split_seed"),
    }


def task_settings(run: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """For each task a run scored, the settings that decide that task's items."""
    evaluation = _evaluation(run)
    tasks = evaluation.get("tasks") or list(run.get("metrics") or {})
    out = {}
    for task in tasks:
        if task.endswith("perplexity"):
            keys = ("perplexity_docs",)
        elif task == "next_sentence":
            keys = ("next_sentence_items", "seed")
        else:  # a zero-shot task: a prefix of its items, its shots
            keys = ("limit", "num_fewshot", "task_paths")
        values = {k: evaluation.get(k) for k in keys}
        if isinstance(values.get("num_fewshot"), dict):
            values["num_fewshot"] = values["num_fewshot"].get(task)
        out[task] = values
    return out


@dataclass
class Group:
    settings: dict[str, Any]
    runs: list[dict[str, Any]] = field(default_factory=list)
    label: str = ""  # what sets this group apart from the others ("" when there is one group)
    tasks: dict[str, dict[str, Any]] = field(default_factory=dict)  # each task's settings, as its runs scored it

    def admits(self, settings: dict[str, Any], tasks: dict[str, dict[str, Any]]) -> bool:
        """The same text and shared settings, and every task both scored on the same items."""
        return settings == self.settings and all(self.tasks[t] == v for t, v in tasks.items() if t in self.tasks)

    def described(self) -> dict[str, Any]:
        """Its settings and its tasks' settings as one flat mapping (what a label names): a task setting by its
        recipe key (``limit``) where its tasks agree on it, else by task (``piqa.limit``)."""
        out = dict(self.settings)
        keys = {k for values in self.tasks.values() for k in values}
        for key in sorted(keys):
            seen = {t: values[key] for t, values in self.tasks.items() if key in values}
            if len({repr(v) for v in seen.values()}) == 1:
                out[key] = next(iter(seen.values()))
            else:
                out.update({f"{t}.{key}": v for t, v in seen.items()})
        return out


def _dense_row(runs: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The shared dense reference of a group's compressed runs as a row, or None."""
    refs = [r.get("dense") for r in runs if r.get("pruner")]
    if not refs or any(r is None for r in refs) or any(r.get("key") != refs[0].get("key") for r in refs):
        return None
    if any(not r.get("pruner") for r in runs):
        return None
    return _reference_row(next(r for r in runs if r.get("pruner")), "dense")


def _reference_row(run: dict[str, Any], name: str) -> dict[str, Any]:
    """The dense reference ``run`` was measured against, as a row of its own named ``name``."""
    ref, model = run["dense"], run.get("model") or {}
    params = model.get("params_before")
    return {
        "name": name,
        "pruner": None,
        "metrics": ref.get("metrics") or {},
        "zero_shot_average": ref.get("zero_shot_average"),
        "sparsity": {"attention": 0.0, "ffn": 0.0, "macs": 0.0, "dynamic": False, "tokens": 0},
        "model": {"params_before": params, "params_after": params, "name_or_path": model.get("name_or_path")},
        "recipe": run.get("recipe"),
        "dense": ref,
    }


def group_runs(runs: list[dict[str, Any]]) -> list[Group]:
    """Runs grouped by :func:`eval_settings` and :func:`task_settings` (see the module's notes), in order of
    first appearance, each group led by its dense reference where one is known."""
    groups: list[Group] = []
    for run in runs:
        settings, tasks = eval_settings(run), task_settings(run)
        group = next((g for g in groups if g.admits(settings, tasks)), None)
        if group is None:
            group = Group(settings)
            groups.append(group)
        group.runs.append(run)
        group.tasks.update(tasks)
    for group in groups:
        dense = _dense_row(group.runs)
        if dense is not None:
            group.runs.insert(0, dense)
        _lend_reference(group.runs)
    if len(groups) > 1:
        described = [g.described() for g in groups]
        keys = sorted({k for d in described for k in d})
        differing = [k for k in keys if len({repr(d[k]) for d in described if k in d}) > 1]
        for i, (group, d) in enumerate(zip(groups, described, strict=True), 1):
            group.label = f"group {i}: " + ", ".join(f"{k}={d.get(k)}" for k in differing if k in d)
    return groups


def _lend_reference(runs: list[dict[str, Any]]) -> None:
    """A compressed run with no dense reference of its own (``compresskit eval`` of a saved run) gets the
    group's one dense run as its reference, on the tasks both scored (their zero-shot averages only where
    both averaged the same tasks): the "x dense" and recovery columns then have what to divide by."""
    dense = [r for r in runs if not r.get("pruner")]
    if len(dense) != 1:
        return
    ref = dense[0]
    for i, run in enumerate(runs):
        if not run.get("pruner") or run.get("dense") is not None:
            continue
        shared = {t: m for t, m in (ref.get("metrics") or {}).items() if t in (run.get("metrics") or {})}
        same_tasks = set(ref.get("metrics") or {}) == set(run.get("metrics") or {})
        runs[i] = {
            **run,
            "dense": {
                "key": f"the group's dense run {ref.get('name')!r}",
                "metrics": shared,
                "zero_shot_average": ref.get("zero_shot_average") if same_tasks else None,
            },
        }


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


# ---------------------------------------------------------------------------------------------
# quality at equal speed: runs joined with `compresskit bench --shape S --run RUN` records of their structures

SPEED_TARGETS = (1.2, 1.4, 1.6)  # the speedups the "at equal speed" table reads each method's quality at
QUALITY = {  # name -> (how a run's value is read, better: min or max, interpolated on a log scale)
    "held-out ppl": (lambda r: (r.get("metrics") or {}).get("perplexity", {}).get("token_perplexity"), min, True),
    "zero-shot avg": (lambda r: r.get("zero_shot_average"), max, False),
}


@dataclass
class Speed:
    """What ``compresskit bench`` measured of the runs' structures, read from its ``bench.json`` files:
    one record per (row name, batch) (a run's row is named after the run; "dense" is 1.00x), at one
    prompt length; ``meta``: each file's settings (its base shape, device, versions, command)."""

    records: dict[tuple[str, int], dict[str, Any]]
    meta: list[dict[str, Any]]
    prompt: int

    @property
    def batches(self) -> list[int]:
        return sorted({b for _, b in self.records})

    @property
    def shapes(self) -> list[str]:
        return sorted({str(m.get("base")) for m in self.meta})

    def speedup(self, name: str, batch: int, measure: str = "tpot") -> float | None:
        """``name``'s ``measure`` ("tpot" or "ttft") speedup over dense at ``batch``."""
        record = self.records.get((name, batch))
        return None if record is None else record[f"{measure}_speedup"]

    def record(self, name: str, batch: int) -> dict[str, Any] | None:
        return self.records.get((name, batch))


def read_speed(docs: list[tuple[str, Any]]) -> Speed:
    """A :class:`Speed` from ``compresskit bench`` documents, ``(path, document)`` pairs; a ValueError
    naming the file where one is no bench output, and where they mix prompt lengths. A row measured in
    several files (dense, benched beside each group of runs) is taken from the first."""
    records: dict[tuple[str, int], dict[str, Any]] = {}
    meta, prompts = [], set()
    for path, doc in docs:
        results = doc.get("results") if isinstance(doc, dict) else None
        if not isinstance(results, list) or not all(isinstance(r, dict) and "tpot_speedup" in r for r in results):
            raise ValueError(f"{path}: not the bench.json of compresskit bench (no results with tpot_speedup)")
        meta.append({**(doc.get("meta") or {}), "file": str(path)})
        for r in results:
            records.setdefault((r["model"], int(r["batch"])), r)
            prompts.add(int(r["prompt"]))
    if len(prompts) > 1:
        raise ValueError(f"the bench files time prompts of {sorted(prompts)} tokens: give files of one prompt length")
    return Speed(records, meta, prompts.pop() if prompts else 0)


def dense_anchor(runs: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The dense model's row where ``runs`` hold one (a group's shared dense reference), else the dense
    reference the first compressed run was measured against (its runs measured it apart, e.g. on another
    evaluation engine), named so; None where no run has one."""
    dense = next((r for r in runs if not r.get("pruner")), None)
    if dense is not None:
        return dense
    first = next((r for r in runs if r.get("pruner") and r.get("dense")), None)
    return None if first is None else _reference_row(first, f"dense (the reference of {first['name']})")


def method_of(run: dict[str, Any]) -> str | None:
    """The method a run's results are a point of: its pruner, or for a pipeline its steps' pruners in order
    (``a+b``), so that each kind of hybrid is a line of its own."""
    steps = (run.get("recipe") or {}).get("steps")
    if run.get("pruner") == PIPELINE and steps:
        return "+".join(step["pruner"] for step in steps)
    return run.get("pruner")


def speed_points(runs: list[dict[str, Any]], speed: Speed, batch: int, measure: str = "tpot") -> dict[str, list]:
    """Each method's measured points at ``batch``: ``{method: [(budget, speedup, run), ...]}`` in order of
    the run's realised MACs skipped, each method's line starting at the dense model (budget 0, 1.00x)
    where the runs hold it. A run without a bench row at that batch is left out."""
    dense = dense_anchor(runs)
    points: dict[str, list] = {}
    for run in runs:
        method = method_of(run)
        value = speed.speedup(run["name"], batch, measure)
        if not method or value is None or not run.get("sparsity"):
            continue
        points.setdefault(method, []).append((run["sparsity"]["macs"], value, run))
    for method in points:
        points[method].sort(key=lambda p: p[0])
        if dense is not None:
            points[method].insert(0, (0.0, 1.0, dense))
    return points


def at_speed(points: list[tuple[float, float]], target: float, *, better=min, log: bool = False):
    """A method's best quality at exactly the speedup ``target``, from its ``(speedup, quality)`` points in
    order of budget: a measured point at ``target``, or the quality interpolated (linearly, in log space
    with ``log``) on each segment between consecutive budgets whose speedups bracket it; ``(quality,
    interpolated)``, the best by ``better`` (a measured point first on a tie); None where no segment
    brackets ``target`` (out of range: no guess beyond the measured budgets)."""
    candidates = [(q, False) for s, q in points if s == target and q is not None]
    for (s0, q0), (s1, q1) in zip(points, points[1:], strict=False):
        if q0 is None or q1 is None or not min(s0, s1) < target < max(s0, s1):
            continue
        w = (target - s0) / (s1 - s0)
        if log:
            q = math.exp((1 - w) * math.log(q0) + w * math.log(q1))
        else:
            q = (1 - w) * q0 + w * q1
        candidates.append((q, True))
    if not candidates:
        return None
    best = better(q for q, _ in candidates)
    return best, all(interp for q, interp in candidates if q == best)


def pareto_front(points: list[tuple[float, float, str]], *, better=min) -> set[str]:
    """The names of the ``(speedup, quality, name)`` points no other point dominates (at least as fast and
    at least as good, better in one)."""

    def beats(a, b) -> bool:  # quality a at least as good as b
        return better(a, b) == a

    front = set()
    for s, q, name in points:
        dominated = any(
            s2 >= s and beats(q2, q) and (s2 > s or q2 != q) for s2, q2, n2 in points if n2 != name and q2 is not None
        )
        if q is not None and not dominated:
            front.add(name)
    return front
