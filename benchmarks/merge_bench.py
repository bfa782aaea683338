"""One batch x prompt matrix from several ``compresskit bench`` outputs (e.g. one process a prompt length, as
``device_serving_matrix.sh`` runs them): their records together as ``bench.json``, the matrix of each model's
TPOT (and TTFT) x dense with its worst and best cells as ``bench.md`` (with two or more compressed rows, e.g.
several ``--sparsity`` values, also a model x prompt table a batch), and the heat map ``bench-heatmap.png``.

    python benchmarks/merge_bench.py OUT_DIR BENCH_DIR_OR_JSON...

Each input keeps its own dense row (the speedups are the ones measured side by side in its process); the facts
of every input (date, GPU, versions, command) are kept in ``bench.json``'s ``meta.parts``; an earlier merge's
``bench.json`` may be an input (a matrix grows a call at a time).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from compresskit import files
from compresskit.bench import matrix_markdown, model_matrix_markdown
from compresskit.plot import speedup_heatmap


def load(path: Path) -> dict:
    file = path / "bench.json" if path.is_dir() else path
    if not file.is_file():
        raise SystemExit(f"merge_bench: {file}: no such bench.json")
    return json.loads(file.read_text())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("inputs", type=Path, nargs="+")
    args = parser.parse_args()
    loaded = [load(p) for p in args.inputs]
    records = [r for part in loaded for r in part["results"]]
    # an earlier merge's output is an input like any other: its parts' facts come along
    parts = [{"meta": meta} for part in loaded for meta in part["meta"].get("parts", [part["meta"]])]
    cells = [(r["model"], r["batch"], r["prompt"]) for r in records]
    twice = sorted({c for c in cells if cells.count(c) > 1})
    if twice:
        model, batch, prompt = twice[0]
        print(f"merge_bench: {model} at batch {batch} x prompt {prompt} is in more than one input", file=sys.stderr)
        return 2
    first = parts[0]["meta"]
    lines = [
        f"# {first['model']}: batch x prompt",
        "",
        f"{first['device']}, {first['dtype']}, torch {first['torch']}, transformers {first['transformers']}, "
        f"triton {first['triton']}; {len(parts)} processes, each with its own dense row beside the others:",
        "",
        *[f"- {p['meta']['date']}: `{p['meta']['command']}`" for p in parts],
        "",
        "A cell with - was not measured (no input has it).",
        "",
        matrix_markdown(records, missing="-"),
        matrix_markdown(records, "ttft", missing="-"),
        model_matrix_markdown(records, "ttft", missing="-"),
        model_matrix_markdown(records, "tpot", missing="-"),
    ]
    with files.staged_dir(args.out) as tmp:
        files.write_json(tmp / "bench.json", {"meta": {"parts": [p["meta"] for p in parts]}, "results": records})
        files.write_text(tmp / "bench.md", "\n".join(lines))
        speedup_heatmap(records, tmp / "bench-heatmap.png")
    print(f"{args.out / 'bench.md'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
