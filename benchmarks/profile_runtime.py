"""Where a decode step's and a prefill's GPU time goes on the runtime, for dense, WIDE and the ideal half-width models.

    python benchmarks/profile_runtime.py --out DIR                     # H200: Llama-3.1-8B shapes, batch 1
    python benchmarks/profile_runtime.py --phase prefill --context 128,512 --out DIR   # several prompt lengths
    python benchmarks/profile_runtime.py --batch 32 --context 2048 --phase decode \
        --option consensus.quorum=0.5,consensus.budget=0.5 \
        --members "consensus (quorum 0.5, budget 0.5),compressed,dense" --out DIR
    python benchmarks/profile_runtime.py --smoke --out DIR             # CPU: tiny shapes, CPU time

Each member of ``compresskit bench --shape`` (``compresskit.bench.shape_members``) decodes after a prompt of
``--context`` tokens; its decode steps run compiled but not graph-replayed (the same kernels a graph
replays, each visible to the profiler), ``--steps`` of them under ``torch.profiler``. The kernels'
device time per step is summed by kind: cuBLAS / CUTLASS products, WIDE's Triton kernels, attention,
inductor's fused elementwise and reduction kernels, copies, the rest; and the kernels a step launches are
counted (a CUDA graph replays them one after another, so that a graphed step's time exceeds its GPU time by about a
launch's gap a kernel: the count says what a method's extra launches cost). This is the profile the runtime
issue asks for where a target is missed: it separates what routing costs (WIDE against the ideal
half-width model) from what the runtime costs (both against the weight-read floor). Results: a table on
stdout and ``profile.json`` / ``profile.md`` (the top kernels of each member too).
"""

from __future__ import annotations

import argparse
import itertools
import os
import re
import sys
import time
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).resolve().parents[i] / p) for i, p in ((0, ""), (1, "plugins/wide"), (1, ""))]
import benchmark_report as report  # noqa: E402  (beside this script)

KINDS = (  # (kind, pattern on the kernel's name), first match wins
    # compresskit_wide's kernels are triton_<name>_kernel (inductor's: triton_poi_ / _red_ / _per_ ..._N), by role
    ("routing (WIDE)", r"^triton_(router|routing_layout|consensus)[a-z0-9_]*_kernel$"),
    ("routed products (WIDE)", r"^triton_(masked|persistent|tile_reduce|split_sum|swiglu)[a-z0-9_]*_kernel$"),
    ("attention", r"^triton_attn_[a-z0-9_]*_kernel$"),
    # inductor's fused kernels, whose names list the ops fused (attention, gemm...) and so come before those
    ("fused elementwise (inductor)", r"^triton_(poi|per|red)_"),
    ("attention", r"flash|fmha|attention|sdpa|softmax"),
    ("products (cuBLAS/CUTLASS)", r"gemm|gemv|cutlass|nvjet|sm90_xmma|xmma|cublas|matmul|dot|^triton_tem_"),
    ("fused elementwise (inductor)", r"fused"),
    ("copies", r"copy|memcpy|memset|fill|cat|index"),
)


def kind(name: str) -> str:
    for label, pattern in KINDS:
        if re.search(pattern, name, re.IGNORECASE):
            return label
    return "other"


def profile_member(runtime, batch: int, context: int, steps: int, cuda: bool, phase: str) -> dict:
    """Profiles ``steps`` decode steps after a prompt of ``context`` tokens (``phase="decode"``), or
    ``steps`` prefills of that prompt, each into a fresh cache (``phase="prefill"``)."""
    from torch.profiler import ProfilerActivity, profile

    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(3, runtime.config.vocab_size, (batch, context), generator=gen).to(runtime.device)
    slots = -(-(context + 2 * steps + 8) // 256) * 256  # aligned, as the runtime's caches on a GPU
    caches = [runtime.new_cache(batch, slots) for _ in range(steps + 1 if phase == "prefill" else 1)]
    token = torch.full((batch,), 5, device=runtime.device)
    runtime.forward(prompt, caches[-1], last_only=True)  # compiles, autotunes
    if phase == "decode":
        runtime.decode(token, caches[0])
        runtime.decode(token, caches[0])
    if cuda:
        torch.cuda.synchronize()

    def run() -> None:
        for i in range(steps):
            if phase == "decode":
                runtime.decode(token, caches[0])
            else:
                runtime.forward(prompt, caches[i], last_only=True)  # the head on the last position: what TTFT pays
        if cuda:
            torch.cuda.synchronize()

    t0 = time.perf_counter()  # the wall clock first, unprofiled: host work a GPU waits on counts
    run()
    wall_us = (time.perf_counter() - t0) * 1e6 / steps
    if phase == "prefill":  # the same prefills again, profiled
        for c in caches:
            c.end = 0
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        run()
    per_kind: dict[str, float] = {}
    kernels = []
    for ev in prof.key_averages():
        us = (ev.device_time_total if cuda else ev.self_cpu_time_total) / steps
        if us <= 0 or (not cuda and not ev.key.startswith("aten::")):
            continue
        if cuda and getattr(ev, "device_type", None) is not None and "CUDA" not in str(ev.device_type):
            continue
        per_kind[kind(ev.key)] = per_kind.get(kind(ev.key), 0.0) + us
        kernels.append((ev.key, us, ev.count / steps))
    kernels.sort(key=lambda k: -k[1])
    host = sorted(
        ((ev.key, ev.self_cpu_time_total / steps, ev.count // steps) for ev in prof.key_averages()),
        key=lambda k: -k[1],
    )
    python_top = []
    if phase == "prefill":  # where the host's time goes, by Python function (one more prefill)
        import cProfile
        import pstats

        caches[0].end = 0
        prof_py = cProfile.Profile()
        prof_py.enable()
        runtime.forward(prompt, caches[0], last_only=True)
        prof_py.disable()
        if cuda:
            torch.cuda.synchronize()
        stats = pstats.Stats(prof_py).stats
        rows = sorted(stats.items(), key=lambda kv: -kv[1][2])[:25]  # by own time
        python_top = [
            {"function": f"{Path(f).name}:{line} {fn}", "own_us": round(st[2] * 1e6, 1), "calls": st[1]}
            for (f, line, fn), st in rows
        ]
    return {
        "wall_us_per_step": round(wall_us, 1),
        "python_top_by_own_time": python_top,
        "us_per_step": {k: round(v, 1) for k, v in sorted(per_kind.items(), key=lambda kv: -kv[1])},
        "total_us_per_step": round(sum(per_kind.values()), 1),
        # every kernel launched a step: in a CUDA graph each still starts after the one before it ends, so a method
        # that launches more pays per launch what the GPU time above does not show
        "launches_per_step": round(sum(c for _, _, c in kernels), 1),
        "top_kernels": [
            {"name": n[:120], "us_per_step": round(us, 1), "launches_per_step": round(c, 1)}
            for n, us, c in kernels[:15]
        ],
        "top_host_ops": [
            {"name": n[:120], "self_cpu_us_per_step": round(us, 1), "calls_per_step": c} for n, us, c in host[:12]
        ],
    }


def wanted_members(text: str, names: list[str]) -> set[str] | None:
    """The member names ``--members`` asks for (empty: all), each of ``names`` found whole in the
    comma-separated text (an --option row's name holds commas); None where a part names no member."""
    rest = f",{text},"
    chosen = set()
    for name in sorted(names, key=len, reverse=True):
        if f",{name}," in rest or f", {name}," in rest:
            chosen.add(name)
            rest = rest.replace(f", {name},", ",").replace(f",{name},", ",")
    return chosen if not rest.strip(", ") else None


def main() -> int:
    from compresskit.bench import free_device_memory, method_source, shape_members
    from compresskit.cli import _int_list
    from compresskit.errors import CompressKitError
    from compresskit.options import configured_executor, parse_option

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", default="llama-3.1-8b")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument(
        "--context",
        default="1024",
        help="cached positions (decode) or prompt tokens (prefill); several, comma-separated, are each profiled on "
        "one build of each member (rows 'MEMBER PHASE @CONTEXT')",
    )
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--sparsity", type=float, default=0.5)
    parser.add_argument("--phase", choices=("decode", "prefill", "both"), default="both")
    parser.add_argument(
        "--option",
        action="append",
        default=[],
        help="also profile WIDE under this setting of its executor, as `compresskit bench --option` takes it (a "
        "member each, named as the bench names its rows); repeatable",
    )
    parser.add_argument(
        "--members",
        default="",
        help="member names (default: all), comma-separated; a name that holds commas (an --option row's) is matched "
        "whole first",
    )
    parser.add_argument("--smoke", action="store_true", help="CPU, tiny shapes, eager: the path runs")
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    args = parser.parse_args()
    where = report.gpu_or_smoke(args.smoke)
    if where is None:
        return 2
    device, dtype = where
    cuda = device.type == "cuda"
    try:
        contexts = _int_list(args.context, "--context")
        settings = [parse_option(text) for text in args.option]
        source = method_source("wide", args.sparsity)
        for setting in settings:  # each fits WIDE's executor: checked before anything is built
            configured_executor(source.pruner_cls, setting)
    except CompressKitError as exc:
        parser.error(str(exc))
    if args.smoke:
        args.shape, contexts, args.steps = "tiny", [16 + 8 * i for i in range(len(contexts))], 2
    options = {"compile": cuda, "graphs": False}
    members = shape_members(args.shape, [source], device=device, dtype=dtype, settings=settings, **options)
    phases = ("decode", "prefill") if args.phase == "both" else (args.phase,)
    results = {}
    chosen = wanted_members(args.members, [m.name for m in members])
    if chosen is None:
        parser.error(f"--members {args.members!r}: allowed names are {', '.join(repr(m.name) for m in members)}")
    for m in members:
        if chosen and m.name not in chosen:
            continue
        _, runtime, _ = m.build()  # one member on the device at a time
        for context, phase in itertools.product(contexts, phases):
            key = f"{m.name} {phase}" + (f" @{context}" if len(contexts) > 1 else "")
            results[key] = profile_member(runtime, args.batch, context, args.steps, cuda, phase)
            line = ", ".join(f"{k} {v:.0f} us" for k, v in results[key]["us_per_step"].items())
            r = results[key]
            print(
                f"{key:26s} wall {r['wall_us_per_step']:9.0f} us, GPU {r['total_us_per_step']:9.0f} us: {line}",
                flush=True,
            )
        del runtime
        free_device_memory(device)
    facts = report.run_facts(
        cuda,
        shape=args.shape,
        batch=args.batch,
        context=contexts[0] if len(contexts) == 1 else contexts,
        steps=args.steps,
        decode="compiled, launched one kernel at a time (no CUDA graph) so that each is profiled",
        prefill="one prompt of `context` tokens into a fresh cache; us per prefill",
    )
    if not cuda:
        facts["gpu"] = "none (smoke: CPU time of aten ops, meaningless)"
    kinds = sorted({k for r in results.values() for k in r["us_per_step"]})
    lines = [
        "| member, phase | wall us/step | GPU us/step | kernels/step | " + " | ".join(kinds) + " |",
    ]
    lines.append("|---|---|---|---|" + "---|" * len(kinds))
    for name, r in results.items():
        cells = [f"{r['us_per_step'].get(k, 0.0):.0f}" for k in kinds]
        head = f"| {name} | {r['wall_us_per_step']:.0f} | {r['total_us_per_step']:.0f} | {r['launches_per_step']:g} | "
        lines.append(head + " | ".join(cells) + " |")
    for name, r in results.items():
        lines += ["", f"## {name}: top kernels", "", "| kernel | us/step | launches/step |", "|---|---|---|"]
        lines += [f"| `{k['name']}` | {k['us_per_step']} | {k['launches_per_step']} |" for k in r["top_kernels"]]
        lines += ["", f"## {name}: top host ops (self CPU time)", "", "| op | us/step | calls/step |", "|---|---|---|"]
        lines += [f"| `{k['name']}` | {k['self_cpu_us_per_step']} | {k['calls_per_step']} |" for k in r["top_host_ops"]]
        if r["python_top_by_own_time"]:
            lines += [
                "",
                f"## {name}: Python functions by own time (cProfile, one call)",
                "",
                "| function | us | calls |",
            ]
            lines += ["|---|---|---|"] + [
                f"| `{k['function']}` | {k['own_us']} | {k['calls']} |" for k in r["python_top_by_own_time"]
            ]
    report.write(args.out, "profile", "Decode step and prefill profile", facts, lines, {"members": results})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
