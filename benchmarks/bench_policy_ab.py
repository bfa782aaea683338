"""A WIDE policy switch off and on, end to end: TPOT and TTFT of the same WIDE model on the runtime
(random weights of a known shape, routers calibrated to skip half of each router's groups) with
``policy.FLAG`` False and True, beside dense, in one process, repeats interleaved (dense, off, on,
dense, off, on, ...) so that drift between them cancels. It reports whether both WIDE runtimes give
the same greedy tokens (a decision that ties within rounding may go the other way).

    python benchmarks/bench_policy_ab.py --flag ROUTER_IN_CONSUMER --out DIR [--shape llama-3.1-8b]
        [--context 1024] [--batch 1] [--new-tokens 32] [--repeats 5]

Writes DIR/policy-ab.{json,md}. Needs a GPU.
"""

from __future__ import annotations

import argparse
import json
import statistics
from datetime import datetime, timezone
from pathlib import Path

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--flag", required=True, help="a boolean of compresskit_wide.kernels.policy")
    ap.add_argument("--out", required=True)
    ap.add_argument("--shape", default="llama-3.1-8b")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    from compresskit_wide.kernels import policy

    if not isinstance(getattr(policy, args.flag, None), bool):
        raise SystemExit(f"--flag {args.flag}: not a boolean of compresskit_wide.kernels.policy")
    if not torch.cuda.is_available():
        raise SystemExit("bench_policy_ab.py needs a GPU")
    import transformers
    import triton

    from compresskit.runtime import runtime_for
    from compresskit.runtime.bench import shape_members, time_runtime

    device = torch.device("cuda")
    members = {m.name: m for m in shape_members(args.shape, sparsity=0.5, device=device, dtype=torch.bfloat16)}
    wide = members["compressed"]
    runtimes = {"dense": members["dense"].runtime}
    tokens = {}
    prompt = [list(range(3, 3 + args.context))] * args.batch
    for value in (False, True):
        name = f"WIDE, {args.flag}={value}"
        setattr(policy, args.flag, value)  # read when each graph is captured
        rt = runtime_for(wide.model, wide.pruner)
        tokens[name] = rt.generate(prompt, max_new_tokens=args.new_tokens).tokens  # warm-up and capture
        runtimes[name] = rt
    names = list(runtimes)
    same_tokens = tokens[names[1]] == tokens[names[2]]
    print(f"greedy tokens equal between the two WIDE runtimes: {same_tokens}")
    tpot: dict[str, list[float]] = {n: [] for n in names}
    ttft: dict[str, list[float]] = {n: [] for n in names}
    for _ in range(args.repeats):  # interleaved
        for n in names:
            a, b = time_runtime(runtimes[n], args.batch, args.context, args.new_tokens, 1)
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
        "command": "python benchmarks/bench_policy_ab.py "
        + " ".join(f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if k != "out"),
        "same_greedy_tokens": same_tokens,
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "policy-ab.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n")
    lines = [f"# policy.{args.flag} off and on, end to end", "", json.dumps(meta), ""]
    lines += ["| model | TTFT ms | TPOT ms | TPOT x dense |", "|---|---|---|---|"]
    lines += [f"| {r['model']} | {r['ttft_ms']} | {r['tpot_ms']} | {r['tpot_x_dense']}x |" for r in rows]
    (out / "policy-ab.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines[4:]))


if __name__ == "__main__":
    main()
