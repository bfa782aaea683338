"""Quality of batch-consensus routing: saved WIDE runs scored per token and under consensus rules at
several consensus batch sizes, by the shared evaluator (the teacher-forced simulation: each evaluation
batch of B sequences decides together, as B sequences decoding at once would).

    python benchmarks/consensus_quality.py --run per-token=RUN/model --run consensus-trained=RUN2/model \
        --rule majority=quorum=0.5 --rule cap50=quorum=0,budget=0.5 --batches 4,8,16,32 \
        --only consensus-trained=majority --workers 3 --out DIR

Each run is scored once per token (at batch 16: per-token routing does not depend on the batch), then
under each rule at each batch size (``--only RUN=RULE,...`` limits a run to those rules; a tile rule, which
shares within each sequence, once, at the first). The evaluations
spread over ``--workers`` processes (a small model leaves a GPU mostly idle); ``--replot quality.json``
(or its folder) draws the plot and writes the table again from it. Writes ``DIR/quality.json``
(one row per evaluation: held-out, code and licence perplexity, the zero-shot tasks and their average,
the realised sparsity and the batch sizes lm-eval ran), ``DIR/quality.md`` and ``DIR/quality.png`` (held-out
perplexity against the realised MACs skipped, a line per run and rule through its batch sizes).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import multiprocessing
import time
from pathlib import Path

from compresskit import files

TASKS = ["perplexity", "code_perplexity", "legal_perplexity", "piqa", "next_sentence"]


def parse_rule(text: str) -> tuple[str, dict]:
    name, _, spec = text.partition("=")
    rule = {}
    for part in filter(None, spec.split(",")):
        key, _, value = part.partition("=")
        rule[key] = float(value) if key in ("quorum", "budget", "follow") else value
    return name, rule


def plan(runs: dict, rules: dict, only: dict, batches: list[int], limit: int | None) -> list[dict]:
    """The evaluations: each run per token (at batch 16), then under each of its rules (``only``: a run's
    rules, where given) at each batch size; a tile rule (``over: tile``) shares within each sequence, so
    the batch does not change it: scored once, at the largest batch size (the fewest of lm-eval's batches, so
    the fastest)."""
    cells = []
    for run, path in runs.items():
        cells.append({"run": run, "path": path, "rule_name": "per-token", "rule": None, "batch": 16, "limit": limit})
        for name, rule in rules.items():
            if run in only and name not in only[run]:
                continue
            for b in [max(batches)] if rule.get("over") == "tile" else batches:
                cells.append({"run": run, "path": path, "rule_name": name, "rule": rule, "batch": b, "limit": limit})
    return cells


def evaluate_cell(cell: dict) -> dict:
    """One evaluation (in a worker process): the run's model scored with ``cell``'s rule and batch size."""
    from compresskit.api import eval_model
    from compresskit.recipe import EvaluationSection

    evaluation = EvaluationSection(
        tasks=TASKS,
        batch_size=cell["batch"],
        max_length=1024,
        next_sentence_items=500,
        logits_budget_mb=1 << 16,  # lm-eval's batch is the consensus batch: never made smaller
        engine="transformers",
        limit=cell["limit"],
        perplexity_docs=cell["limit"],
    )
    options = {"consensus": cell["rule"]} if cell["rule"] is not None else None
    t0 = time.perf_counter()
    res = eval_model(cell["path"], evaluation=evaluation, options=options)
    m, sp = res["metrics"], res["sparsity"]
    used = sorted({t.get("batch_size") for t in res["evaluation"]["tasks"].values() if t.get("batch_size")})
    return {
        "run": cell["run"],
        "rule": cell["rule_name"],
        "consensus": cell["rule"],
        "batch": cell["batch"],
        "held_out_ppl": m["perplexity"]["token_perplexity"],
        "code_ppl": m["code_perplexity"]["token_perplexity"],
        "legal_ppl": m["legal_perplexity"]["token_perplexity"],
        "piqa_acc": m["piqa"]["acc"],
        "next_sentence_acc": m["next_sentence"]["acc"],
        "zero_shot_avg": res["zero_shot_average"],
        "macs_skipped": sp.get("macs"),
        "groups_skipped": {k: sp.get(k) for k in ("attention", "ffn")},
        "batch_sizes_run": used,
        "seconds": round(time.perf_counter() - t0, 1),
    }


def markdown(rows: list[dict], meta: dict) -> str:
    lines = [
        "# Batch-consensus routing: quality (teacher-forced simulation)",
        "",
        " ".join(f"{k}: {v};" for k, v in meta.items()),
        "",
        "| run | rule | consensus batch | held-out ppl | x its per-token | x reference | code ppl | licence ppl | "
        "PIQA acc | next-sent acc | zero-shot avg | MACs skipped |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    base = {r["run"]: r["held_out_ppl"] for r in rows if r["rule"] == "per-token"}
    reference = base.get(rows[0]["run"], float("nan")) if rows else float("nan")  # the first run, per token
    for r in rows:
        ratio = r["held_out_ppl"] / base.get(r["run"], float("nan"))
        batch = "-" if r["rule"] == "per-token" else str(r["batch"])
        lines.append(
            f"| {r['run']} | {r['rule']} | {batch} | {r['held_out_ppl']:.2f} | {ratio:.3f} | "
            f"{r['held_out_ppl'] / reference:.3f} | {r['code_ppl']:.2f} | "
            f"{r['legal_ppl']:.2f} | {r['piqa_acc']:.4f} | {r['next_sentence_acc']:.4f} | {r['zero_shot_avg']:.4f} | "
            f"{r['macs_skipped']:.3f} |"
        )
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from compresskit.plot import save

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for run, rule in dict.fromkeys((r["run"], r["rule"]) for r in rows):
        pts = sorted((r for r in rows if r["run"] == run and r["rule"] == rule), key=lambda r: r["batch"])
        xs, ys = [r["macs_skipped"] for r in pts], [r["held_out_ppl"] for r in pts]
        if rule == "per-token":
            ax.scatter(xs, ys, marker="*", s=140, label=f"{run}, per token", zorder=3)
            continue
        ax.plot(xs, ys, marker="o", label=f"{run}, {rule}")
        for r in pts:
            ax.annotate(f"B={r['batch']}", (r["macs_skipped"], r["held_out_ppl"]), fontsize=7, xytext=(3, 3),
                        textcoords="offset points")  # fmt: skip
    ax.set_xlabel("realised projection MACs skipped")
    ax.set_yscale("log")
    ax.set_ylabel("held-out perplexity (log scale, lower is better)")
    ax.set_title("SmolLM2-135M WIDE: consensus routing by consensus batch B")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    save(fig, path)


def replot_source(given: str, error) -> tuple[Path, dict]:
    """``--replot``'s file (``given``, or ``given/quality.json`` for a folder) and its table; ``error`` (the
    parser's: one line, exit 2) where it is missing or is no table this script wrote."""
    path = Path(given)
    if path.is_dir():
        path = path / "quality.json"
    try:
        table = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        error(f"--replot {given}: cannot read {path} ({type(exc).__name__}: {exc})")
    if not isinstance(table, dict) or not isinstance(table.get("rows"), list) or "meta" not in table:
        error(f"--replot {given}: {path} is no quality table of this script (it holds 'meta' and 'rows')")
    return path, table


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run", action="append", help="NAME=PATH of a saved run's model directory")
    ap.add_argument(
        "--replot", help="a quality.json, or the folder holding one: its table and plot written again beside it"
    )
    ap.add_argument("--rule", action="append", default=[], help="NAME=KEY=VALUE,... a consensus rule")
    ap.add_argument("--batches", default="4,8,16,32")
    ap.add_argument("--only", action="append", default=[], help="RUN=RULE,... the rules scored for that run")
    ap.add_argument("--workers", type=int, default=1)
    ap.add_argument("--limit", type=int, help="items per zero-shot task and held-out documents (a smoke test)")
    ap.add_argument("--out")
    args = ap.parse_args()
    if args.replot:
        path, table = replot_source(args.replot, ap.error)
        plot(table["rows"], path.with_name("quality.png"))
        files.write_text(path.with_name("quality.md"), markdown(table["rows"], table["meta"]))
        print(f"table and plot beside {path}")
        return
    if not args.run or not args.out:
        ap.error("give --run NAME=PATH (one or more) and --out DIR, or --replot")
    runs = dict(r.split("=", 1) for r in args.run)
    rules = dict(parse_rule(r) for r in args.rule)
    only = {k: v.split(",") for k, v in (o.split("=", 1) for o in args.only)}
    cells = plan(runs, rules, only, [int(x) for x in args.batches.split(",")], args.limit)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    ctx = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(max_workers=args.workers, mp_context=ctx) as pool:
        rows = list(pool.map(evaluate_cell, cells))
    import torch
    import transformers

    from compresskit.modeling import device_name

    meta = {
        "device": device_name("cuda" if torch.cuda.is_available() else "cpu"),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "date": time.strftime("%Y-%m-%d"),
        "seconds": round(time.perf_counter() - t0),
        "command": "python benchmarks/consensus_quality.py "
        + " ".join(f"--run {k}=..." for k in runs)
        + "".join(f" --rule {r}" for r in args.rule)
        + f" --batches {args.batches}"
        + "".join(f" --only {o}" for o in args.only)
        + f" --workers {args.workers}",
    }
    files.write_json(out / "quality.json", {"meta": meta, "rows": rows})
    files.write_text(out / "quality.md", markdown(rows, meta))
    plot(rows, out / "quality.png")
    print(markdown(rows, meta))


if __name__ == "__main__":
    main()
