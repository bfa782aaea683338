"""One call of the prefill output-width kernel (persistent, over sorted tiles) at Llama-3.1-8B shapes, for Nsight
Compute: gate+up with the fused SwiGLU (``--op gate-up``) or q (``--op q``: 32 heads of 128 in 8
groups), with half of each token's groups on (``--mask exact``), i.i.d. at one half (``iid``) or every
group on (``all``). The autotuner runs first, outside the profiled range, then one call between
cudaProfilerStart/Stop. On a GPU host, from the root of a copy of this tree with .whl/ beside it:

    ncu --profile-from-start off --clock-control none --kernel-name regex:masked_out_gemm \
        --section SpeedOfLight --section Occupancy --section WarpStateStats --section LaunchStats \
        python3 benchmarks/ncu_out_gemm.py [--op q] [--tokens 1024] [--mask all]

Prints the autotuned tiles; ncu prints where the kernel's time goes (what the benchmark's side
by side rows cannot show), for example why q's time at 1k tokens hardly falls with half the groups."""

from __future__ import annotations

import argparse

import torch

from compresskit_wide.kernels import gemm_out

OPS = {"gate-up": (14336, 128, True), "q": (4096, 512, False)}  # output rows, rows a group, fused SwiGLU


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--op", choices=sorted(OPS), default="gate-up")
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--mask", choices=["exact", "iid", "all"], default="exact")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA GPU")
        return 2
    gen = torch.Generator(device="cuda").manual_seed(0)
    n, group, fused = OPS[args.op]
    m, d = args.tokens, args.hidden
    x = torch.randn(m, d, device="cuda", dtype=torch.bfloat16, generator=gen)
    w = torch.randn(n, d, device="cuda", dtype=torch.bfloat16, generator=gen) / d**0.5
    w_up = torch.randn(n, d, device="cuda", dtype=torch.bfloat16, generator=gen) / d**0.5 if fused else None
    scores = torch.rand(m, n // group, device="cuda", generator=gen)
    if args.mask == "exact":
        mask = scores >= scores.median(dim=1, keepdim=True).values  # exactly half of the groups a token
    else:
        mask = scores >= (0.5 if args.mask == "iid" else 0.0)
    gemm_out.triton_masked_out_gemm(x, w, mask, w_up)  # autotunes
    best = gemm_out._tuned_prefill.best_config
    print(f"{args.op}, {m} tokens, {args.mask} mask ({mask.float().mean():.3f} of the groups on)", flush=True)
    print(f"tiles: {best.kwargs} warps={best.num_warps} stages={best.num_stages}", flush=True)
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    gemm_out.triton_masked_out_gemm(x, w, mask, w_up)  # the routing layout's kernel, then the product's
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
