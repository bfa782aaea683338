"""Two ``compresskit bench`` outputs of the same cases side by side: each row of the "after" run beside
the same (model, batch, prompt) row of the "before" run of the same case (the N-th folder of each side), with
after's time over before's (TTFT and TPOT; 1.00 is unchanged, above 1 slower) and each side's speedup over its
own dense row. Prints a Markdown table and writes it, with both runs' facts, as ``before_after.md`` / ``.json``
under ``--out``.

    python benchmarks/before_after.py --before DIR [DIR ...] --after DIR [DIR ...] --out DIR
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def rows(folders: list[str]) -> tuple[dict, list[list[dict]]]:
    """``(the first run's facts, each folder's rows)`` of the ``bench.json`` files in ``folders``."""
    meta, out = {}, []
    for folder in folders:
        data = json.loads((Path(folder) / "bench.json").read_text())
        meta = meta or data["meta"]
        out.append(data["results"])
    return meta, out


def pair(before: list[list[dict]], after: list[list[dict]]) -> list[dict]:
    """One record a row of ``after`` that ``before`` has too in the same case (by model, batch and prompt):
    two cases may share those (one shape's 512-token row and another's)."""
    key = lambda r: (r["model"], r["batch"], r["prompt"])  # noqa: E731
    table = []
    for case, (old_rows, new_rows) in enumerate(zip(before, after, strict=True), start=1):
        old = {key(r): r for r in old_rows}
        for r in new_rows:
            b = old.get(key(r))
            if b is None:
                continue
            table.append(
                {
                    "case": case,
                    "model": r["model"],
                    "batch": r["batch"],
                    "prompt": r["prompt"],
                    "ttft_ms": (b["ttft_ms"], r["ttft_ms"]),
                    "tpot_ms": (b["tpot_ms"], r["tpot_ms"]),
                    "ttft_after_over_before": round(r["ttft_ms"] / b["ttft_ms"], 3),
                    "tpot_after_over_before": round(r["tpot_ms"] / b["tpot_ms"], 3),
                    "ttft_x_dense": (b["ttft_speedup"], r["ttft_speedup"]),
                    "tpot_x_dense": (b["tpot_speedup"], r["tpot_speedup"]),
                }
            )
    return table


def markdown(table: list[dict]) -> str:
    lines = [
        "| case | model | batch | prompt | TTFT ms before / after | after / before | TPOT ms before / after "
        "| after / before | TTFT x dense before / after | TPOT x dense before / after |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for t in table:
        lines.append(
            f"| {t['case']} | {t['model']} | {t['batch']} | {t['prompt']} | "
            f"{t['ttft_ms'][0]:.2f} / {t['ttft_ms'][1]:.2f} | "
            f"{t['ttft_after_over_before']:.3f} | {t['tpot_ms'][0]:.3f} / {t['tpot_ms'][1]:.3f} | "
            f"{t['tpot_after_over_before']:.3f} | {t['ttft_x_dense'][0]:.2f}x / {t['ttft_x_dense'][1]:.2f}x | "
            f"{t['tpot_x_dense'][0]:.2f}x / {t['tpot_x_dense'][1]:.2f}x |"
        )
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--before", nargs="+", required=True, help="bench output folders of the earlier tree")
    parser.add_argument("--after", nargs="+", required=True, help="bench output folders of this tree")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    if len(args.before) != len(args.after):
        counts = f"{len(args.before)} --before folders and {len(args.after)} --after"
        print(f"error: {counts}: one of each a case", file=sys.stderr)
        return 2
    (meta_b, before), (meta_a, after) = rows(args.before), rows(args.after)
    table = pair(before, after)
    if not table:
        print("no row of --after has a row of --before with the same model, batch and prompt")
        return 1
    md = markdown(table)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    facts = "\n".join(f"- {side}: {json.dumps(m)}" for side, m in (("before", meta_b), ("after", meta_a)))
    (out / "before_after.md").write_text(f"# Before and after, side by side\n\n{facts}\n\n{md}")
    (out / "before_after.json").write_text(json.dumps({"before": meta_b, "after": meta_a, "rows": table}, indent=1))
    print(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
