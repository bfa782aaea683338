"""WIDE's decode router in one launch against two, end to end: TPOT of the same WIDE model on the runtime
(Llama-3.1-8B shapes, random weights, routers calibrated to skip half of each router's groups) with
``policy.ROUTER_ONE_LAUNCH`` off and on, beside dense, in one process, repeats interleaved (A, B, A, B)
so that drift between them cancels. First it checks that both give the same decisions on random decode
inputs, alone and replayed from a CUDA graph, and the same greedy tokens.

    python benchmarks/bench_router_launch.py --out DIR [--shape llama-3.1-8b] [--context 1024] [--repeats 5]

Writes DIR/router-launch.{json,md}. Needs a GPU.
"""

from __future__ import annotations

import argparse
import json
import statistics
from datetime import datetime, timezone
from pathlib import Path

import torch


def check_decisions(device: torch.device) -> list[str]:
    """Decisions of the one-launch kernel against the reference and the two-launch kernels on random
    decode inputs (M = 1, 4, 16; attention- and FFN-sized routers), eagerly and from a CUDA graph."""
    from compresskit.routing import GroupRouter
    from compresskit_wide.kernels.router import torch_router_decide, triton_router_decide

    lines = []
    gen = torch.Generator(device=device).manual_seed(0)
    for m in (1, 4, 16):
        for groups in (8, 112):
            router = GroupRouter(4096, groups, 32).to(device)
            w = (router.down.weight, router.down.bias, router.up.weight, router.up.bias)
            x = torch.randn(m, 4096, device=device, dtype=torch.bfloat16, generator=gen)
            ref = torch_router_decide(x, *w)
            two = triton_router_decide(x, *w, one_launch=False)
            one = triton_router_decide(x, *w, one_launch=True)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                captured = triton_router_decide(x, *w, one_launch=True)
            same = []
            for _ in range(20):
                x.copy_(torch.randn(m, 4096, device=device, dtype=torch.bfloat16, generator=gen))
                graph.replay()
                same.append(torch.equal(captured, torch_router_decide(x, *w)))
            ok = torch.equal(one, two) and torch.equal(one, ref) and all(same)
            lines.append(f"M={m} G={groups}: one launch == two launches == reference, 20 graph replays: {ok}")
            if not ok:
                raise SystemExit("\n".join(lines) + "\nthe one-launch router disagrees: not benchmarked")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--shape", default="llama-3.1-8b")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_router_launch.py needs a GPU")
    import transformers
    import triton

    from compresskit.runtime import runtime_for
    from compresskit.runtime.bench import shape_members, time_runtime
    from compresskit_wide.kernels import policy

    device = torch.device("cuda")
    checks = check_decisions(device)
    print("\n".join(checks))
    members = {m.name: m for m in shape_members(args.shape, sparsity=0.5, device=device, dtype=torch.bfloat16)}
    wide = members["compressed"]
    runtimes = {"dense": members["dense"].runtime}
    tokens = {}
    for name, flag in (("WIDE, router in two launches", False), ("WIDE, router in one launch", True)):
        policy.ROUTER_ONE_LAUNCH = flag  # read when each graph is captured
        rt = runtime_for(wide.model, wide.pruner)
        prompt = [list(range(3, 3 + args.context))]
        tokens[name] = rt.generate(prompt, max_new_tokens=args.new_tokens).tokens  # warm-up and capture
        runtimes[name] = rt
    names = list(runtimes)
    same_tokens = tokens[names[1]] == tokens[names[2]]
    print(f"greedy tokens equal between the two WIDE runtimes: {same_tokens}")
    tpot: dict[str, list[float]] = {n: [] for n in names}
    ttft: dict[str, list[float]] = {n: [] for n in names}
    for _ in range(args.repeats):  # interleaved
        for n in names:
            a, b = time_runtime(runtimes[n], 1, args.context, args.new_tokens, 1)
            ttft[n].append(a)
            tpot[n].append(b)
    dense = statistics.median(tpot["dense"])
    rows = [
        {
            "model": n,
            "ttft_ms": round(statistics.median(ttft[n]), 3),
            "tpot_ms": round(statistics.median(tpot[n]), 3),
            "tpot_x_dense": round(dense / statistics.median(tpot[n]), 3),
        }
        for n in names
    ]
    meta = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "gpu": torch.cuda.get_device_name(device),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "triton": triton.__version__,
        "shape": args.shape,
        "context": args.context,
        "new_tokens": args.new_tokens,
        "repeats": args.repeats,
        "command": "python benchmarks/bench_router_launch.py "
        + " ".join(f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if k != "out"),
        "checks": checks,
        "same_greedy_tokens": same_tokens,
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "router-launch.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n")
    lines = ["# WIDE's decode router: one launch against two", "", json.dumps(meta), ""]
    lines += ["| model | TTFT ms | TPOT ms | TPOT x dense |", "|---|---|---|---|"]
    lines += [f"| {r['model']} | {r['ttft_ms']} | {r['tpot_ms']} | {r['tpot_x_dense']}x |" for r in rows]
    (out / "router-launch.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines[4:]))


if __name__ == "__main__":
    main()
