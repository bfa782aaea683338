"""Boolean switches of the code off and on, end to end on the runtime: TTFT and TPOT of every member of a
``--shape`` bench (WIDE with routers calibrated to skip half of each router's groups, dense, the ideal
half-width model) built with every ``--flag`` False, with each one True alone and, for several, with all
True, in one process, repeats interleaved (each variant in turn, repeat after repeat) so that drift
between them cancels. Each variant's realised sparsity is counted over its timed runs. Reports how many
of the baseline's greedy tokens each variant gives before its first different one (a change of rounding
can flip a router's decision that sits on its threshold, and a random-weight model's near-flat logits
turn that into another token), and, to tell rounding from a defect, the variant fed the baseline's
tokens (teacher-forced): at how many steps its top token is the baseline's, and its largest logit
difference against the baseline's logit scale (the largest absolute logit). The baseline's row gives
the same for the baseline run eagerly (no compile, no graphs): the spread that rounding alone makes.
On a CPU everything runs eagerly (a smoke run, not a measurement).

    python benchmarks/bench_runtime_ab.py --flag compresskit.runtime.llama:FUSE_RESIDUAL \
        [--flag compresskit_wide.blocks:ROUTED_QKV ...] --out DIR
        [--shape llama-3.1-8b] [--context 1024] [--batch 1] [--new-tokens 32] [--repeats 5]
        [--members compressed,dense] [--dtype float32]

``--flag MODULE:NAME`` names a module-level boolean read when blocks and graphs are built (for example
``compresskit.runtime.blocks:STACK_PROJECTIONS``); switches not named keep their values. Writes
DIR/runtime-ab.{json,md}.
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


def variants(names: list[str]) -> list[tuple[str, ...]]:
    """The switches on in each variant: none (the baseline), each alone, and all where there are several."""
    out = [(), *((n,) for n in names)]
    return out + [tuple(names)] if len(names) > 1 else out


def leading_equal(a: list[int], b: list[int]) -> int:
    """How many tokens ``a`` and ``b`` share before their first difference."""
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def teacher_forced(runtime, prompt: list[list[int]], tokens: list[list[int]]) -> torch.Tensor:
    """fp32 logits ``[N, B, V]`` of ``runtime`` at each of ``tokens``' N steps, fed ``prompt`` then
    ``tokens`` (each step's logits predict ``tokens[:, step]``)."""
    device = runtime.device
    ids = torch.tensor(prompt, device=device)
    fed = torch.tensor(tokens, device=device)  # [B, N]
    cache = runtime.new_cache(ids.shape[0], ids.shape[1] + fed.shape[1])
    with torch.inference_mode():
        out = [runtime.forward(ids, cache, last_only=True)[:, -1].float()]
        for step in range(fed.shape[1] - 1):
            out.append(runtime.decode(fed[:, step], cache).float())
    return torch.stack(out)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--flag", required=True, action="append", help="MODULE:NAME of a module-level boolean (repeatable)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--shape", default="llama-3.1-8b")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument(
        "--dtype", choices=("bfloat16", "float16", "float32"), help="default: bfloat16 on a GPU, float32 on a CPU"
    )
    ap.add_argument("--members", default="", help="comma-separated members to build (default: all)")
    args = ap.parse_args(argv)
    wanted = {m.strip() for m in args.members.split(",") if m.strip()}
    switches = {flag.partition(":")[2]: switch(flag) for flag in dict.fromkeys(args.flag)}
    if len(switches) < len(dict.fromkeys(args.flag)):
        raise SystemExit(f"--flag: two switches of one name in {args.flag}")
    import transformers

    from compresskit.runtime import Runtime, runtime_for
    from compresskit.runtime.bench import realised_sparsity, reset_counts, shape_members, time_runtime

    gpu = torch.cuda.is_available()
    device = torch.device("cuda" if gpu else "cpu")
    dtype = getattr(torch, args.dtype) if args.dtype else torch.bfloat16 if gpu else torch.float32
    initial = {name: getattr(module, name) for name, (module, _) in switches.items()}
    runs: dict[tuple[str, tuple[str, ...]], object] = {}  # (member, switches on) -> its Member
    tokens: dict[tuple[str, tuple[str, ...]], list] = {}
    logits: dict[tuple[str, tuple[str, ...]], torch.Tensor] = {}
    prompt = [list(range(3, 3 + args.context))] * args.batch
    try:
        for on in variants(list(switches)):
            for name, (module, _) in switches.items():
                setattr(module, name, name in on)  # read as each member's blocks and graphs are built
            members = shape_members(args.shape, sparsity=0.5, device=device, dtype=dtype)
            unknown = wanted - {m.name for m in members}
            if unknown:
                names = ", ".join(m.name for m in members)
                raise SystemExit(f"--members: {', '.join(sorted(unknown))} not among this shape's members ({names})")
            for member in (m for m in members if not wanted or m.name in wanted):
                tokens[member.name, on] = member.runtime.generate(prompt, max_new_tokens=args.new_tokens).tokens
                runs[member.name, on] = member  # (that generate was its warm-up)
        for (name, on), member in runs.items():  # every variant fed the baseline's tokens
            logits[name, on] = teacher_forced(member.runtime, prompt, tokens[name, ()])
        for name in dict.fromkeys(m for m, _ in runs):  # the rounding floor: the baseline, eagerly
            for flag, (module, _) in switches.items():
                setattr(module, flag, False)
            member = runs[name, ()]
            eager = (
                runtime_for(member.model, member.pruner, compile=False, graphs=False)
                if member.pruner is not None
                else Runtime(member.model, dense=True, compile=False, graphs=False)
            )
            logits[name, "eager"] = teacher_forced(eager, prompt, tokens[name, ()])
    finally:
        for name, (module, _) in switches.items():
            setattr(module, name, initial[name])
    ttft: dict = {k: [] for k in runs}
    tpot: dict = {k: [] for k in runs}
    for member in runs.values():
        reset_counts(member.runtime, member.model, member.pruner)
    for _ in range(args.repeats):  # interleaved
        for key, member in runs.items():
            a, b = time_runtime(member.runtime, args.batch, args.context, args.new_tokens, 1)
            ttft[key].append(a)
            tpot[key].append(b)
    rows = []
    for name in dict.fromkeys(n for n, _ in runs):  # in the order they were built
        base = (name, ())
        for on in variants(list(switches)):
            key = (name, on)
            m = runs[key]
            row = {
                "member": name,
                "on": list(on),
                "ttft_ms": round(statistics.median(ttft[key]), 3),
                "tpot_ms": round(statistics.median(tpot[key]), 3),
                "sparsity_macs": None
                if (sp := realised_sparsity(m.runtime, m.model, m.pruner)) is None
                else round(sp, 4),
            }
            if on:
                row["tpot_gain"] = round(statistics.median(tpot[base]) / row["tpot_ms"], 3)
                row["ttft_gain"] = round(statistics.median(ttft[base]) / row["ttft_ms"], 3)
                row["same_greedy_tokens"] = tokens[key] == tokens[base]
                row["equal_leading_tokens"] = min(
                    leading_equal(a, b) for a, b in zip(tokens[key], tokens[base], strict=True)
                )
            row["new_tokens"] = args.new_tokens
            got, want = logits[key if on else (name, "eager")], logits[base]
            row["teacher_forced_top_equal"] = int((got.argmax(-1) == want.argmax(-1)).all(-1).sum())
            row["logit_max_abs_diff"] = round(float((got - want).abs().max()), 4)
            row["logit_scale"] = round(float(want.abs().max()), 4)
            rows.append(row)
    meta = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name(device) if gpu else "CPU (eager: a smoke run, not a measurement)",
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "dtype": str(dtype).removeprefix("torch."),
        "flags": list(dict.fromkeys(args.flag)),
        "command": "python benchmarks/bench_runtime_ab.py "
        + " ".join(f"--flag {f}" for f in dict.fromkeys(args.flag))
        + " "
        + " ".join(f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if k not in ("out", "flag") and v),
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "runtime-ab.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n")
    lines = [f"# {', '.join(switches)}: off and on, end to end", "", json.dumps(meta), ""]
    lines += [
        "| member | on | TTFT ms | TPOT ms | TTFT / TPOT x all off | sparsity MACs | greedy tokens equal to all off "
        "| teacher-forced: top token equal, max abs logit diff (logit scale) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        gain = f"{r['ttft_gain']}x / {r['tpot_gain']}x" if r["on"] else ""
        same = f"{r['equal_leading_tokens']} of {r['new_tokens']}" if r["on"] else ""
        forced = f"{r['teacher_forced_top_equal']} of {r['new_tokens']}, {r['logit_max_abs_diff']} ({r['logit_scale']})"
        forced = forced if r["on"] else f"run eagerly: {forced}"
        sp = "-" if r["sparsity_macs"] is None else f"{r['sparsity_macs']:.3f}"
        lines.append(
            f"| {r['member']} | {' + '.join(r['on']) or '(none)'} | {r['ttft_ms']} | {r['tpot_ms']} | {gain} | {sp} "
            f"| {same} | {forced} |"
        )
    (out / "runtime-ab.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines[4:]))


if __name__ == "__main__":
    main()
