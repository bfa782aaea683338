"""Rendering results: rich tables and progress for terminals, Markdown and CSV for files.

Only this module and ``cli.py`` import rich; library code returns plain data.
"""

from __future__ import annotations

import contextlib
import csv
import io
from collections.abc import Iterator
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, SpinnerColumn, TextColumn, TimeElapsedColumn
from rich.progress import Progress as _RichProgress
from rich.table import Table

from compresskit.comparison import (
    QUALITY,
    SPEED_TARGETS,
    Group,
    Speed,
    at_speed,
    dense_anchor,
    group_runs,
    pareto_front,
    speed_points,
)
from compresskit.modeling import memory_kind
from compresskit.progress import Progress, Task
from compresskit.tasks import DEFAULT_TASKS, result_columns, table_columns

NOT_MEASURED = "not measured"


LARGE = 1e4  # a float at least this large prints in scientific notation (a collapsed model's perplexity)


def _fmt(value: Any, fmt: str) -> str:
    if value is None:
        return "-"
    if isinstance(value, float) and abs(value) >= LARGE and fmt.endswith("f}"):
        return f"{value:.2e}"
    return fmt.format(value)


# the quality alarm: past either line, a run's model is not one a user would keep
ALARM_PERPLEXITY_X = 3.0  # held-out perplexity over the dense model's
ALARM_RECOVERY = 0.8  # zero-shot average over the dense model's
RECOVERY_STAGES = ("lora", "finetune")


def quality_alarm(results: dict[str, Any]) -> str | None:
    """One plain line when a run's quality fell past the alarm (held-out perplexity over
    ``ALARM_PERPLEXITY_X`` times the dense model's, or zero-shot recovery under ``ALARM_RECOVERY``): what
    fell, the likely causes in this run, and what to try; None when neither did or there is no dense
    reference to compare with."""
    dense = results.get("dense") or {}
    titles = {(task, metric): title for title, task, metric, _ in table_columns() + result_columns(results["metrics"])}
    fell = []
    for task, metrics in sorted(results.get("metrics", {}).items()):
        value = metrics.get("token_perplexity")
        base = (dense.get("metrics") or {}).get(task, {}).get("token_perplexity")
        if value is not None and base and value / base > ALARM_PERPLEXITY_X:
            title = titles.get((task, "token_perplexity"), task)
            fell.append(f"{title} {_fmt(value, '{:.2f}')} is {value / base:,.0f}x dense ({base:.2f})")
    zs, dz = results.get("zero_shot_average"), dense.get("zero_shot_average")
    if zs is not None and dz and zs / dz < ALARM_RECOVERY:
        fell.append(f"zero-shot recovery {zs / dz:.3f}")
    if not fell:
        return None
    stages = [st for st in results.get("training") or [] if st.get("steps")]
    tokens = sum(st.get("tokens") or 0 for st in stages)
    sp = (results.get("sparsity") or {}).get("macs")
    causes = [f"{sp:.0%} of the MACs skipped" if sp is not None else "the pruner's budget"]
    causes.append(f"{tokens:,} training tokens" if stages else "no training stage")
    if not any(st["stage"] in RECOVERY_STAGES for st in stages):
        causes.append("no recovery stage (lora, finetune)")
    return (
        f"quality alarm: {'; '.join(fell)} (alarms: perplexity over {ALARM_PERPLEXITY_X:g}x dense, zero-shot "
        f"recovery under {ALARM_RECOVERY:g}); this model is not one to keep. Likely causes: {', '.join(causes)}. "
        "Try a lower target sparsity, a router-fit stage before a lora stage with distill, more training steps "
        "on text like the evaluation's (recipes/wide-smollm2-quick.yaml; docs/first-run.md)"
    )


def summary_rows(results: dict[str, Any]) -> list[tuple[str, str, str, str]]:
    """(metric, value, dense, recovery) rows of one run."""
    rows = []
    dense = (results.get("dense") or {}).get("metrics", {})
    rec = results.get("recovery") or {}
    for title, task, metric, fmt in table_columns() + result_columns(results["metrics"]):
        value = results["metrics"].get(task, {}).get(metric)
        if value is None:
            continue
        rows.append(
            (
                title,
                _fmt(value, fmt),
                _fmt(dense.get(task, {}).get(metric), fmt),
                _fmt(rec.get(task, {}).get(metric), "{:.3f}"),
            )
        )
    zs = results.get("zero_shot_average")
    if zs is not None:
        dz = (results.get("dense") or {}).get("zero_shot_average")
        rows.append(("zero-shot avg acc", f"{zs:.4f}", _fmt(dz, "{:.4f}"), _fmt(zs / dz if dz else None, "{:.3f}")))
    sp = results["sparsity"]
    if sp is None:  # the pruner or its executor did not count it
        rows += [(f"sparsity {b}", NOT_MEASURED, "0.000", "-") for b in ("attention", "ffn", "MACs")]
    else:
        kind = "measured" if sp.get("dynamic") else "static"
        rows.append((f"sparsity attention ({kind})", f"{sp['attention']:.3f}", "0.000", "-"))
        rows.append((f"sparsity ffn ({kind})", f"{sp['ffn']:.3f}", "0.000", "-"))
        rows.append((f"sparsity MACs ({kind})", f"{sp['macs']:.3f}", "0.000", "-"))
        for key, value in (sp.get("groups") or {}).items():
            rows.append((f"skipped groups {key}", f"{value:.3f}", "0.000", "-"))
        for k, step in enumerate(sp.get("steps") or []):  # a pipeline: each step's share of the original MACs
            what = f"{step['macs']:.3f} ({step['of_input']:.3f} of its input)"
            rows.append((f"sparsity MACs, step {k} {step['name']}", what, "0.000", "-"))
    rows += speed_rows(results.get("speed"))
    m = results["model"]
    # recovery is a quality ratio: a parameter count has none
    rows.append(("parameters", f"{m['params_after']:,}", f"{m['params_before']:,}", "-"))
    return rows


def speed_rows(speed: dict[str, Any] | None) -> list[tuple[str, str, str, str]]:
    """(metric, value, dense, speedup) rows of a run's speed; the recovery column holds the speedup."""
    if not speed:  # a results.json from before speed was reported
        return []
    if not speed.get("measured"):
        return [(f"{k} ms", NOT_MEASURED, NOT_MEASURED, "-") for k in ("TTFT", "TPOT")]
    what = {"TTFT": f"batch {speed['batch']}, prompt {speed['prompt']}", "TPOT": speed["mode"]}
    return [
        (
            f"{k} ms ({what[k]})",
            f"{speed[f'{k.lower()}_ms']:.2f}",
            f"{speed[f'dense_{k.lower()}_ms']:.2f}",
            f"{speed[f'{k.lower()}_speedup']:.2f}x",
        )
        for k in ("TTFT", "TPOT")
    ]


def _speed_note(speed: dict[str, Any] | None) -> str:
    if not speed:
        return ""
    if not speed.get("measured"):
        return f"Speed: not measured ({speed.get('reason')})."
    return (
        f"Speed: time to first token (TTFT) and per output token (TPOT), medians of {speed['repeats']} greedy "
        f"generations of {speed['new_tokens']} tokens after a random {speed['prompt']}-token prompt, batch "
        f"{speed['batch']}, on the compresskit runtime ({speed['mode']}, {speed['device']}), the dense base on the "
        "same runtime in the same process; the recovery column holds the speedup over dense."
        + (f" It ran eagerly on the GPU: {speed['eager_reason']}." if speed.get("eager_reason") else "")
    )


def _columns(results: dict[str, Any]) -> int:
    """4 columns (metric, value, dense, recovery) when there is a dense reference, else 2."""
    return 4 if results.get("dense") else 2


def results_table(results: dict[str, Any]) -> Table:
    table = Table(title=f"{results['name']}: {results['model']['name_or_path']} ({results.get('pruner') or 'dense'})")
    n = _columns(results)
    for col, just in (("metric", "left"), ("value", "right"), ("dense", "right"), ("recovery", "right"))[:n]:
        table.add_column(col, justify=just)
    for row in summary_rows(results):
        table.add_row(*row[:n])
    return table


def _md_table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


_SOURCE_WORDS = {
    "wiki": "Wikipedia articles from the gensim test data",
    "files": "documents from local files",
    "hf": "documents of a Hugging Face dataset",
    "generated": "documents the dense model wrote (training text only)",
}


def _data_source(data: dict[str, Any]) -> str:
    if data.get("source") == "files":
        files = data["files"]
        names = ", ".join(f["path"] for f in files[:3]) + (f" and {len(files) - 3} more" if len(files) > 3 else "")
        cut = next((f for f in files if f.get("windows")), None)
        what = (
            f"one document cut into {cut['windows']} windows of about {cut['window_chars']:,} characters"
            if cut
            else f"{data['articles']} documents"
        )
        return f"{what} from {len(files)} local file(s) ({names})"
    sources = data.get("sources") or []
    if len(sources) > 1 or (sources and sources[0].get("kind") != "wiki"):
        parts = [
            f"{s['documents']} {_SOURCE_WORDS.get(s['kind'], s['kind'])}"
            + (f" (weight {s['weight']:g})" if len(sources) > 1 else "")
            for s in sources
        ]
        return ("a mixture of " if len(sources) > 1 else "") + " and ".join(parts)
    return f"{data['articles']} Wikipedia articles from the gensim test data"


def _sparsity_note(sp: dict[str, Any] | None) -> str:
    what = "Sparsity: fraction of the decoder layers' linear-projection multiply-adds skipped"
    if sp is None:
        return what + ": not measured in this run (its pruner or executor does not count it)."
    return what + (" (measured while the evaluator ran)." if sp.get("dynamic") else ".")


def _training_note(training: list[dict[str, Any]] | None, device: str) -> str | None:
    """One line on the training stages that trained something, or None (``device``: the model's)."""
    stages = []
    for st in training or []:
        if not st.get("steps"):
            continue
        what = [f"{st['tokens']:,} tokens", f"{st['seconds']:.0f} s"]
        if st.get("final_loss") is not None:
            what.append(f"final loss {st['final_loss']:.3f}")
        if st.get("peak_memory_bytes") is not None:
            what.append(f"{memory_kind(device)} {st['peak_memory_bytes'] / 2**30:.2f} GiB")
        stages.append(f"{st['stage']} {st['steps']} steps ({', '.join(what)})")
    return "Training: " + "; ".join(stages) + "." if stages else None


DETERMINISTIC_NOTE = "Deterministic algorithms only (`deterministic: true`; torch.use_deterministic_algorithms)."


def results_markdown(results: dict[str, Any]) -> str:
    ev = results["evaluation"]
    items = ", ".join(f"{k}: {v['n_items']}" for k, v in ev["tasks"].items())
    lowered = [
        f"{k} {v['batch_size']}"
        for k, v in ev["tasks"].items()
        if v.get("batch_size") is not None and v["batch_size"] < ev["batch_size"]
    ]
    batch = f"batch size {ev['batch_size']}" + (
        f" ({', '.join(lowered)} under the {ev.get('logits_budget_mb')} MB logits budget)" if lowered else ""
    )
    peaks = {k: v["peak_memory_bytes"] for k, v in ev["tasks"].items() if v.get("peak_memory_bytes") is not None}
    peak = ""
    if peaks:
        top = max(peaks, key=peaks.get)
        peak = f" {memory_kind(ev.get('device', 'cpu')).capitalize()} {peaks[top] / 2**30:.2f} GiB ({top})."
    data = results["data"]
    parts = [
        f"# {results['name']}",
        "",
        f"Model `{results['model']['name_or_path']}` ({results['model']['dtype']}, {results['model']['device']}), "
        f"pruner `{results.get('pruner') or 'none (dense)'}`, recipe hash `{results['recipe_hash']}`, "
        f"{results['created']}.",
        "",
        *([f"**{alarm}**", ""] if (alarm := quality_alarm(results)) else []),
        _md_table(
            ["metric", "value", "dense", "recovery"][: _columns(results)],
            [list(r[: _columns(results)]) for r in summary_rows(results)],
        ),
        "",
        f"Evaluator: lm-eval {ev['lm_eval_version']} in memory, zero-shot, {batch}, "
        f"context {ev['max_length']}, limit {ev['limit']}, seed {ev['seed']}; items per task: {items}.{peak}",
        f"Data: {_data_source(data)}, split by document "
        f"(seed {data['split_seed']}): {data['train_articles']} for calibration/training "
        f"({data['train_tokens']:,} tokens), {data['test_articles']} held out.",
        *filter(None, [_training_note(results.get("training"), results["model"]["device"])]),
        *([DETERMINISTIC_NOTE] if (results.get("recipe") or {}).get("deterministic") else []),
        _sparsity_note(results["sparsity"]),
        _speed_note(results.get("speed")),
        "",
        "Versions: " + ", ".join(f"{k} {v}" for k, v in results["versions"].items()),
        "",
    ]
    return "\n".join(parts)


# ---------------------------------------------------------------------------------------------
# comparisons


def _seeds(r: dict[str, Any]) -> str:
    seeds = r.get("seeds")
    if isinstance(seeds, list):  # several runs of one recipe (compare --seeds)
        return ",".join(str(s) for s in seeds)
    if isinstance(seeds, dict) and seeds.get("recipe") is not None:
        return str(seeds["recipe"])
    return "-"


def _with_spread(value: Any, spread: Any, fmt: str) -> str:
    """``value``, and ``± spread`` when the row averages several seeds."""
    return _fmt(value, fmt) + (f" ± {fmt.format(spread)}" if value is not None and spread is not None else "")


def _speedups(speed: dict[str, Any] | None, reference: bool = False) -> list[str]:
    """TTFT and TPOT speedups over dense; ``reference``: the dense row of a table whose runs were timed
    against it (1.00x by definition)."""
    if reference:
        return ["1.00x"] * 2
    if not speed or not speed.get("measured"):
        return [NOT_MEASURED] * 2
    return [f"{speed['ttft_speedup']:.2f}x", f"{speed['tpot_speedup']:.2f}x"]


def compare_rows(runs: list[dict[str, Any]]) -> tuple[list[str], list[list[str]]]:
    """One row a run; a row that averages seeds shows ``mean ± standard deviation``."""
    header = ["run", "pruner", "sparsity MACs", "attn", "ffn", "params"]
    # the built-in tasks' columns that some run reported (the three default ones always), then any lm-eval task's
    columns = [
        c for c in table_columns() if c[1] in DEFAULT_TASKS or any(c[2] in r["metrics"].get(c[1], {}) for r in runs)
    ]
    for r in runs:
        columns += [c for c in result_columns(r["metrics"]) if c not in columns]
    # each perplexity over the dense model's on the same text, one column: in and out of domain side by side
    ppl = [c for c in columns if c[2].split(":")[0] == "token_perplexity"]
    ratio_header = [f"ppl x dense ({', '.join(c[0].replace(' ppl', '') for c in ppl)})"] if ppl else []
    header += [c[0] for c in columns] + ["zero-shot avg", "recovery (zero-shot)", *ratio_header]
    header += ["TTFT x dense", "TPOT x dense", "seeds"]
    timed = any((r.get("speed") or {}).get("measured") for r in runs)
    rows = []
    for r in runs:
        sp = r["sparsity"] or {}
        row = [
            r["name"],
            r.get("pruner") or "dense",
            *(_fmt(sp.get(k), "{:.3f}") if sp else NOT_MEASURED for k in ("macs", "attention", "ffn")),
            f"{r['model']['params_after'] / 1e6:.1f}M",
        ]
        spread = r.get("spread") or {}
        for _, task, metric, fmt in columns:
            row.append(_with_spread(r["metrics"].get(task, {}).get(metric), spread.get(task, {}).get(metric), fmt))
        zs = r.get("zero_shot_average")
        dz = (r.get("dense") or {}).get("zero_shot_average")
        row += [
            _with_spread(zs, r.get("zero_shot_spread"), "{:.4f}"),
            _fmt(zs / dz if zs is not None and dz else None, "{:.3f}"),
            *([_ppl_ratios(r, ppl)] if ppl else []),
            *_speedups(r.get("speed"), reference=timed and not r.get("pruner") and not r.get("speed")),
            _seeds(r),
        ]
        rows.append(row)
    return header, rows


def _ppl_ratios(run: dict[str, Any], columns: list[tuple[str, str, str, str]]) -> str:
    """The run's perplexity over its dense reference's, for each perplexity column ("-" where either is
    missing), as "3.0x, 7.2x"."""
    dense = (run.get("dense") or {}).get("metrics", {})
    cells = []
    for _, task, metric, _ in columns:
        value, ref = run["metrics"].get(task, {}).get(metric), dense.get(task, {}).get(metric)
        cells.append(f"{value / ref:.1f}x" if value is not None and ref else "-")
    return ", ".join(cells)


_TITLE = "comparison (sparsity = realised fraction of prunable MACs skipped)"


def compare_tables(groups: list[Group]) -> list[Table]:
    """One rich table per evaluation group."""
    tables = []
    for group in groups:
        header, rows = compare_rows(group.runs)
        table = Table(title=_TITLE + (f"; {group.label}" if group.label else ""))
        for i, h in enumerate(header):
            table.add_column(h, justify="left" if i < 2 else "right")
        for row in rows:
            table.add_row(*row)
        table.caption = speed_footnote(group.runs)
        tables.append(table)
    return tables


def speed_footnote(runs: list[dict[str, Any]]) -> str | None:
    """How the speed columns of ``runs`` were measured (device, runtime mode, batch, prompt, new tokens,
    repeats), or, where runs were timed under different settings, each setting with its runs: speedups
    timed differently are not comparable. None where no run's speed was measured."""
    settings: dict[tuple, list[str]] = {}
    for run in runs:
        speed = run.get("speed") or {}
        if speed.get("measured"):
            key = tuple(speed.get(k) for k in ("device", "mode", "batch", "prompt", "new_tokens", "repeats"))
            settings.setdefault(key, []).append(run["name"])
    if not settings:
        return None

    def describe(key: tuple) -> str:
        device, mode, batch, prompt, new_tokens, repeats = key
        return (
            f"{device}, {mode}, batch {batch}, a {prompt}-token prompt, {new_tokens} new tokens, medians of {repeats}"
        )

    if len(settings) == 1:
        return (
            "Speed: TTFT and TPOT of each run over its dense base, timed in the same process on the compresskit "
            f"runtime ({describe(next(iter(settings)))})."
        )
    listed = "; ".join(f"{', '.join(names)}: {describe(key)}" for key, names in settings.items())
    return f"Speed: warning, the runs were timed under {len(settings)} different settings ({listed})."


def compare_markdown(groups: list[Group] | list[dict[str, Any]]) -> str:
    """Markdown tables, one per evaluation group (headed by what sets it apart when there are
    several), each with a line on how its speed was measured; a list of runs is grouped first."""
    groups = _as_groups(groups)
    parts = []
    for group in groups:
        header, rows = compare_rows(group.runs)
        if group.label:
            parts.append(f"### Evaluation {group.label}\n")
        parts.append(_md_table(header, rows) + "\n")
        note = speed_footnote(group.runs)
        if note:
            parts.append(note + "\n")
    return "\n".join(parts)


def compare_csv(groups: list[Group]) -> str:
    """One CSV of every run; the last column names its evaluation group."""
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    for i, group in enumerate(groups):
        header, rows = compare_rows(group.runs)
        if i == 0:
            writer.writerow([*header, "evaluation group"])
        writer.writerows([*row, group.label or "1"] for row in rows)
    return buf.getvalue()


def _quality_cell(value: float | None, metric: str) -> str:
    return "-" if value is None else (f"{value:.2f}" if metric == "held-out ppl" else f"{value:.4f}")


def equal_speed_markdown(
    runs: list[dict[str, Any]], speed: Speed, targets: tuple[float, ...] = SPEED_TARGETS, measure: str = "tpot"
) -> str:
    """The "quality at equal speed" section of a comparison: for each benched batch size a table of each
    method's held-out perplexity and zero-shot average at each speedup of ``targets`` (:func:`at_speed`:
    measured, interpolated between budgets and marked so, or "out of range"), then every measured point
    with its speedups and the Pareto fronts it is on, and how the speed was measured (stating it where the
    speed and the quality come from different models' shapes)."""
    what = measure.upper()
    models = sorted({str((r.get("model") or {}).get("name_or_path")) for r in runs if r.get("pruner")})
    shapes = speed.shapes
    lines = ["## Quality at equal speed", ""]
    lines.append(
        f"Speed: {what} of each run's structure over the dense model, measured by `compresskit bench` at "
        f"{', '.join(shapes)} shapes, prompt {speed.prompt}; quality: each run's own evaluation of "
        f"{', '.join(models)}."
        + (
            f" **The speed is measured at other shapes ({', '.join(shapes)}) than the quality's model.**"
            if set(shapes) != set(models)
            else ""
        )
    )
    lines.append("")
    fronts: dict[tuple[int, str], set[str]] = {}
    for batch in speed.batches:
        points = speed_points(runs, speed, batch, measure)
        if not points:
            continue
        header = ["method", *[f"{t:.2f}x" for t in targets]]
        rows, cells = [], {}
        for method, pts in points.items():
            row = [method]
            for t in targets:
                found = {
                    metric: at_speed([(s, read(r)) for _, s, r in pts], t, better=better, log=log)
                    for metric, (read, better, log) in QUALITY.items()
                }
                if found["held-out ppl"] is None and found["zero-shot avg"] is None:
                    row.append("out of range")
                    continue
                cells[(method, t)] = found["held-out ppl"]
                text = " / ".join(_quality_cell(None if v is None else v[0], m) for m, v in found.items())
                row.append(text + (" (interpolated)" if any(v is not None and v[1] for v in found.values()) else ""))
            rows.append(row)
        for j, t in enumerate(targets, start=1):  # the best perplexity of each column in bold
            values = [(v[0], i) for i, m in enumerate(points) if (v := cells.get((m, t))) is not None]
            if values:
                rows[min(values)[1]][j] = f"**{rows[min(values)[1]][j]}**"
        lines += [f"### {what} x dense at batch {batch}: held-out ppl / zero-shot avg", ""]
        lines.append(_md_table(header, rows))
        lines.append("")
        for metric, (read, better, _) in QUALITY.items():
            everything = [(s, read(r), r["name"]) for pts in points.values() for _, s, r in pts]
            fronts[(batch, metric)] = pareto_front(list({p[2]: p for p in everything}.values()), better=better)
    lines.append(
        "Each cell is the method's quality at exactly that speedup: measured, or interpolated between the two "
        'budgets whose speedups bracket it (perplexity on a log scale) and marked so; "out of range" where no '
        "two budgets of the method bracket it. Each method's line starts at the dense model (1.00x). The best "
        "perplexity of a column is in bold."
    )
    lines += ["", "### Measured points", "", _measured_points(runs, speed, fronts, measure)]
    lines += ["", "Bench runs:", ""]
    for m in speed.meta:
        lines.append(
            f"- `{m.get('command', '?')}` ({m.get('device', '?')}, {m.get('dtype', '?')}, torch {m.get('torch', '?')}, "
            f"triton {m.get('triton', '?')}, transformers {m.get('transformers', '?')}, {m.get('date', '?')}; "
            f"{m['file']})"
        )
    return "\n".join(lines) + "\n"


def _measured_points(runs: list[dict[str, Any]], speed: Speed, fronts: dict, measure: str) -> str:
    """The table of every measured point of :func:`equal_speed_markdown`: each run's MACs skipped, its speedups at
    every batch size, its quality and the Pareto fronts (``fronts``: batch and metric -> names) it is on."""
    batches, shapes, what = speed.batches, speed.shapes, measure.upper()
    header = ["run", "method", "MACs skipped (run)", f"MACs skipped at {', '.join(shapes)}"]
    header += [f"{what} x dense, batch {b}" for b in batches]
    header += [f"{'TTFT' if measure == 'tpot' else 'TPOT'} x dense, batch {b}" for b in batches]
    header += ["held-out ppl", "zero-shot avg", "on the Pareto front"]
    other = "ttft" if measure == "tpot" else "tpot"
    rows = []
    anchor = dense_anchor(runs)
    for run in ([anchor] if anchor is not None and anchor not in runs else []) + runs:
        if run.get("pruner") and all(speed.record(run["name"], b) is None for b in batches):
            continue
        sp = run.get("sparsity") or {}
        at_shape = [(speed.record(run["name"], b) or {}).get("sparsity_macs") for b in batches]
        shape_macs = next((v for v in at_shape if v is not None), None)
        on = [
            f"{metric}: batch " + ", ".join(hits)
            for metric in QUALITY
            if (hits := [str(b) for b in batches if run["name"] in fronts.get((b, metric), set())])
        ]
        rows.append(
            [
                run["name"],
                run.get("pruner") or "dense",
                _fmt(sp.get("macs"), "{:.3f}"),
                _fmt(0.0 if not run.get("pruner") else shape_macs, "{:.3f}"),
                *[
                    _fmt(1.0 if not run.get("pruner") else speed.speedup(run["name"], b, m), "{:.2f}x")
                    for m in (measure, other)
                    for b in batches
                ],
                *[_quality_cell(read(run), metric) for metric, (read, _, _) in QUALITY.items()],
                "; ".join(on) or "-",
            ]
        )
    return _md_table(header, rows)


def _as_groups(items: list) -> list[Group]:
    return group_runs(items) if items and not isinstance(items[0], Group) else items


# ---------------------------------------------------------------------------------------------
# progress


class _RichTask(Task):
    def __init__(self, progress: _RichProgress, task_id) -> None:
        self.progress, self.task_id = progress, task_id

    def advance(self, n: float = 1) -> None:
        self.progress.advance(self.task_id, n)

    def update(self, **fields: object) -> None:
        text = " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in fields.items())
        self.progress.update(self.task_id, info=text)


class RichProgress(Progress):
    """Progress bars on a terminal: one bar per long step, kept on screen when done."""

    def __init__(self, console: Console) -> None:
        self.console = console
        self._progress = _RichProgress(
            SpinnerColumn(),
            TextColumn("[bold]{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            TextColumn("{task.fields[info]}"),
            console=console,
        )
        self._depth = 0

    @contextlib.contextmanager
    def task(self, description: str, total: float | None = None) -> Iterator[Task]:
        if self._depth == 0:
            self._progress.start()
        self._depth += 1
        task_id = self._progress.add_task(description, total=total, info="")
        try:
            yield _RichTask(self._progress, task_id)
            if total is None:
                self._progress.update(task_id, total=1, completed=1)
            else:
                self._progress.update(task_id, completed=total)
        finally:
            self._depth -= 1
            if self._depth == 0:
                self._progress.stop()  # leaves the finished bars on screen
                for tid in list(self._progress.task_ids):
                    self._progress.remove_task(tid)

    def log(self, message: str) -> None:
        self.console.log(message) if self._depth else self.console.print(f"[dim]{message}[/dim]")
