"""Where a decode step's GPU time goes on the runtime, for dense, WIDE and the ideal half-width model.

    python benchmarks/profile_runtime.py --out DIR                     # H200: Llama-3.1-8B shapes, batch 1
    python benchmarks/profile_runtime.py --smoke --out DIR             # CPU: tiny shapes, CPU time

Each member of ``compresskit bench --shape`` (``runtime.bench.shape_members``) decodes after a prompt of
``--context`` tokens; its decode steps run compiled but not graph-replayed (the same kernels a graph
replays, each visible to the profiler), ``--steps`` of them under ``torch.profiler``. The kernels'
device time per step is summed by kind: cuBLAS / CUTLASS products, WIDE's Triton kernels, attention,
inductor's fused elementwise and reduction kernels, copies, the rest. This is the profile the runtime
issue asks for where a target is missed: it separates what routing costs (WIDE against the ideal
half-width model) from what the runtime costs (both against the weight-read floor). Results: a table on
stdout and ``profile.json`` / ``profile.md`` (the top kernels of each member too).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import sys
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).resolve().parents[1] / p) for p in ("plugins/wide", ".")]

KINDS = (  # (kind, pattern on the kernel's name), first match wins
    ("WIDE triton", r"^triton_(masked_|attn_|router_|routing_layout)"),  # compresskit_wide's kernels
    ("attention", r"flash|fmha|attention|sdpa|softmax"),
    ("products (cuBLAS/CUTLASS)", r"gemm|gemv|cutlass|nvjet|sm90_xmma|xmma|cublas|matmul|dot"),
    ("fused elementwise (inductor)", r"triton_(poi|per|red)|fused"),
    ("copies", r"copy|memcpy|memset|fill|cat|index"),
)


def kind(name: str) -> str:
    for label, pattern in KINDS:
        if re.search(pattern, name, re.IGNORECASE):
            return label
    return "other"


def profile_member(runtime, batch: int, context: int, steps: int, cuda: bool) -> dict:
    from torch.profiler import ProfilerActivity, profile

    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(3, runtime.config.vocab_size, (batch, context), generator=gen).to(runtime.device)
    cache = runtime.new_cache(batch, context + steps + 4)
    token = torch.full((batch,), 5, device=runtime.device)
    runtime.forward(prompt, cache)
    runtime.decode(token, cache)  # compiles, autotunes
    runtime.decode(token, cache)
    if cuda:
        torch.cuda.synchronize()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        for _ in range(steps):
            runtime.decode(token, cache)
        if cuda:
            torch.cuda.synchronize()
    per_kind: dict[str, float] = {}
    kernels = []
    for ev in prof.key_averages():
        us = (ev.device_time_total if cuda else ev.self_cpu_time_total) / steps
        if us <= 0 or (not cuda and not ev.key.startswith("aten::")):
            continue
        if cuda and getattr(ev, "device_type", None) is not None and "CUDA" not in str(ev.device_type):
            continue
        per_kind[kind(ev.key)] = per_kind.get(kind(ev.key), 0.0) + us
        kernels.append((ev.key, us, ev.count // steps))
    kernels.sort(key=lambda k: -k[1])
    return {
        "us_per_step": {k: round(v, 1) for k, v in sorted(per_kind.items(), key=lambda kv: -kv[1])},
        "total_us_per_step": round(sum(per_kind.values()), 1),
        "top_kernels": [
            {"name": n[:120], "us_per_step": round(us, 1), "launches_per_step": c} for n, us, c in kernels[:15]
        ],
    }


def main() -> int:
    from compresskit.runtime.bench import shape_members

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", default="llama-3.1-8b")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--sparsity", type=float, default=0.5)
    parser.add_argument("--smoke", action="store_true", help="CPU, tiny shapes, eager: the path runs")
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    args = parser.parse_args()
    cuda = torch.cuda.is_available() and not args.smoke
    if not cuda and not args.smoke:
        print("no CUDA device: use --smoke")
        return 2
    if args.smoke:
        args.shape, args.context, args.steps = "tiny", 16, 2
    device = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    options = {"compile": cuda, "graphs": False}
    members = shape_members(args.shape, sparsity=args.sparsity, device=device, dtype=dtype, **options)
    results = {}
    for m in members:
        results[m.name] = profile_member(m.runtime, args.batch, args.context, args.steps, cuda)
        line = ", ".join(f"{k} {v:.0f} us" for k, v in results[m.name]["us_per_step"].items())
        print(f"{m.name:18s} {results[m.name]['total_us_per_step']:9.0f} us/step: {line}", flush=True)
    import transformers

    meta = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "gpu": torch.cuda.get_device_name(0) if cuda else "none (smoke: CPU time of aten ops, meaningless)",
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "command": " ".join(sys.argv),
        "shape": args.shape,
        "batch": args.batch,
        "context": args.context,
        "steps": args.steps,
        "decode": "compiled, launched one kernel at a time (no CUDA graph) so that each is profiled",
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "profile.json").write_text(json.dumps({"meta": meta, "members": results}, indent=2))
    kinds = sorted({k for r in results.values() for k in r["us_per_step"]})
    lines = [f"# Decode step profile\n\n{json.dumps(meta)}\n", "| member | total us/step | " + " | ".join(kinds) + " |"]
    lines.append("|---|---|" + "---|" * len(kinds))
    for name, r in results.items():
        cells = [f"{r['us_per_step'].get(k, 0.0):.0f}" for k in kinds]
        lines.append(f"| {name} | {r['total_us_per_step']:.0f} | " + " | ".join(cells) + " |")
    for name, r in results.items():
        lines += ["", f"## {name}: top kernels", "", "| kernel | us/step | launches/step |", "|---|---|---|"]
        lines += [f"| `{k['name']}` | {k['us_per_step']} | {k['launches_per_step']} |" for k in r["top_kernels"]]
    (out / "profile.md").write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
