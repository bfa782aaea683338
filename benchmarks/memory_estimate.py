"""The dry run's memory estimate beside what finished runs measured, a row per training stage and the evaluation.

    python benchmarks/memory_estimate.py runs/wide-smollm2-50-quick [RUN ...]

Each run's ``results.json`` holds its resolved recipe and the peaks it measured (``training[].peak_memory_bytes``,
``evaluation.tasks[].peak_memory_bytes``: on a GPU the tensors allocated, on the CPU the process's peak resident
memory). The estimate is ``compresskit apply --dry-run``'s, recomputed from the recipe for the run's device and
world of one; on a GPU it is compared less the CUDA context, which the measured peak does not see.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from compresskit.memory import plan
from compresskit.modeling import load_config
from compresskit.recipe import load_recipe


def rows(run: Path) -> list[tuple[str, str, float, float | None]]:
    """(run, stage, estimate GiB, measured GiB or None) of one finished run."""
    results = json.loads((run / "results.json").read_text())
    resolved = load_recipe(results["recipe"])
    rec = resolved.recipe
    device = "cuda" if results["model"]["device"].startswith("cuda") else "cpu"
    config = load_config(rec.model.name_or_path, allow_download=False)[0]
    p = plan(resolved, world=1, config=config, dtype=getattr(torch, results["model"]["dtype"]), device=device)
    measured = {st["stage"]: st.get("peak_memory_bytes") for st in results.get("training") or []}
    tasks = [t.get("peak_memory_bytes") for t in results["evaluation"]["tasks"].values()]
    measured["evaluation"] = max((t for t in tasks if t is not None), default=None)
    out = []
    for st in p.stages:
        estimate = st.peak - (st.context if device == "cuda" else 0)
        got = measured.get(st.stage)
        out.append((run.name, st.stage, estimate / 2**30, None if got is None else got / 2**30))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", nargs="+", type=Path, help="output directories of finished runs")
    args = ap.parse_args()
    for run in args.runs:
        if not (run / "results.json").is_file():
            ap.error(f"{run}: no results.json there; give the output directory of a finished run")
    print("| run | row | estimate | measured | measured / estimate |")
    print("|---|---|---|---|---|")
    for run in args.runs:
        for name, stage, estimate, got in rows(run):
            shown = "-" if got is None else f"{got:.2f} GiB"
            ratio = "-" if got is None else f"{got / estimate:.3f}"
            print(f"| {name} | {stage} | {estimate:.2f} GiB | {shown} | {ratio} |")


if __name__ == "__main__":
    main()
