"""A boolean switch of the code off and on, end to end on the runtime: TTFT and TPOT of every member of a
``--shape`` bench (WIDE with routers calibrated to skip half of each router's groups, dense, the ideal
half-width model) built with ``--flag`` False and with True, in one process, repeats interleaved (each
member off, on, off, on, ...) so that drift between them cancels. Reports whether each member gives the
same greedy tokens both ways. On a CPU everything runs eagerly (a smoke run, not a measurement).

    python benchmarks/bench_runtime_ab.py --flag compresskit.runtime.blocks:STACK_PROJECTIONS --out DIR
        [--shape llama-3.1-8b] [--context 1024] [--batch 1] [--new-tokens 32] [--repeats 5]

``--flag MODULE:NAME`` names a module-level boolean read when blocks and graphs are built (for example
``compresskit.runtime.blocks:STACK_PROJECTIONS``). Writes DIR/runtime-ab.{json,md}.
"""

from __future__ import annotations

import argparse
import importlib
import json
import statistics
from datetime import datetime, timezone
from pathlib import Path

import torch


def switch(flag: str):
    """``(module, name)`` of ``MODULE:NAME``, a module-level boolean; SystemExit naming what is wrong."""
    module_name, _, name = flag.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise SystemExit(f"--flag {flag}: cannot import {module_name!r} ({exc})") from None
    if not isinstance(getattr(module, name, None), bool):
        raise SystemExit(f"--flag {flag}: {module_name} has no boolean {name!r}")
    return module, name


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--flag", required=True, help="MODULE:NAME of a module-level boolean")
    ap.add_argument("--out", required=True)
    ap.add_argument("--shape", default="llama-3.1-8b")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args(argv)
    module, name = switch(args.flag)
    import transformers

    from compresskit.runtime.bench import shape_members, time_runtime

    gpu = torch.cuda.is_available()
    device = torch.device("cuda" if gpu else "cpu")
    dtype = torch.bfloat16 if gpu else torch.float32
    initial = getattr(module, name)
    runs: dict[str, object] = {}
    tokens: dict[str, list] = {}
    prompt = [list(range(3, 3 + args.context))] * args.batch
    try:
        for value in (False, True):
            setattr(module, name, value)  # read as each member's blocks and graphs are built
            for member in shape_members(args.shape, sparsity=0.5, device=device, dtype=dtype):
                key = f"{member.name}, {name}={value}"
                tokens[key] = member.runtime.generate(prompt, max_new_tokens=args.new_tokens).tokens  # warm-up
                runs[key] = member.runtime
    finally:
        setattr(module, name, initial)
    ttft: dict[str, list[float]] = {k: [] for k in runs}
    tpot: dict[str, list[float]] = {k: [] for k in runs}
    for _ in range(args.repeats):  # interleaved
        for key, rt in runs.items():
            a, b = time_runtime(rt, args.batch, args.context, args.new_tokens, 1)
            ttft[key].append(a)
            tpot[key].append(b)
    members = list(dict.fromkeys(k.rsplit(", ", 1)[0] for k in runs))  # in the order they were built
    rows = []
    for m in members:
        off, on = f"{m}, {name}=False", f"{m}, {name}=True"
        for key in (off, on):
            rows.append(
                {
                    "member": m,
                    "flag": key.endswith("True"),
                    "ttft_ms": round(statistics.median(ttft[key]), 3),
                    "tpot_ms": round(statistics.median(tpot[key]), 3),
                }
            )
        rows[-1]["tpot_off_over_on"] = round(rows[-2]["tpot_ms"] / rows[-1]["tpot_ms"], 3)
        rows[-1]["ttft_off_over_on"] = round(rows[-2]["ttft_ms"] / rows[-1]["ttft_ms"], 3)
        rows[-1]["same_greedy_tokens"] = tokens[off] == tokens[on]
    meta = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name(device) if gpu else "CPU (eager: a smoke run, not a measurement)",
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "command": "python benchmarks/bench_runtime_ab.py "
        + " ".join(f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if k != "out"),
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "runtime-ab.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n")
    lines = [f"# {args.flag} off and on, end to end", "", json.dumps(meta), ""]
    lines += [
        "| member | flag | TTFT ms | TPOT ms | on: TTFT / TPOT x off | same greedy tokens |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        gain = f"{r['ttft_off_over_on']}x / {r['tpot_off_over_on']}x" if r["flag"] else ""
        same = str(r.get("same_greedy_tokens", ""))
        lines.append(f"| {r['member']} | {r['flag']} | {r['ttft_ms']} | {r['tpot_ms']} | {gain} | {same} |")
    (out / "runtime-ab.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines[4:]))


if __name__ == "__main__":
    main()
