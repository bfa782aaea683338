"""How far rounding alone moves the logits of a ``--shape`` bench's WIDE model (random weights, routers
calibrated to skip half of each router's groups): the runtime compiled (inductor fuses and reorders
elementwise work) against the same runtime run eagerly, fed the same greedy tokens. A switch whose A/B
(``bench_runtime_ab.py``) moves the logits no further than this is within rounding; one that moves them
further in fp32 than this does in fp32 is a defect.

    python benchmarks/rounding_floor.py [--shape smollm2-135m] [--dtype bfloat16] [--context 24] [--new-tokens 12]

Runs on the CPU or a GPU (compiled, no CUDA graphs); prints one line per dtype.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_runtime_ab import teacher_forced  # noqa: E402  (beside this script)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="smollm2-135m")
    ap.add_argument("--dtype", default="bfloat16,float32", help="comma-separated dtypes")
    ap.add_argument("--context", type=int, default=24)
    ap.add_argument("--new-tokens", type=int, default=12)
    args = ap.parse_args(argv)
    from compresskit.runtime import runtime_for
    from compresskit.runtime.bench import shape_members

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    prompt = [list(range(3, 3 + args.context))]
    for name in args.dtype.split(","):
        member = shape_members(
            args.shape, sparsity=0.5, device=device, dtype=getattr(torch, name), compile=True, graphs=False
        )[0]
        eager = runtime_for(member.model, member.pruner, compile=False, graphs=False)
        tokens = eager.generate(prompt, max_new_tokens=args.new_tokens).tokens
        want = teacher_forced(eager, prompt, tokens)
        got = teacher_forced(member.runtime, prompt, tokens)  # compiled
        same = int((got.argmax(-1) == want.argmax(-1)).all(-1).sum())
        print(
            f"{args.shape} {name} on {device.type}, compiled against eager: top token equal at {same} of "
            f"{args.new_tokens} steps, max abs logit diff {float((got - want).abs().max()):.3g} "
            f"(logit scale {float(want.abs().max()):.3g})"
        )


if __name__ == "__main__":
    main()
