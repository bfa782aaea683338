"""One call of the prefill gate+up kernel (sorted tiles, fused SwiGLU) at Llama-3.1-8B shapes, for
Nsight Compute: the autotuner runs first, outside the profiled range, then one call between
cudaProfilerStart/Stop. On the device machine, through the device tool (carry [".whl"]):

    ncu --profile-from-start off --clock-control none --kernel-name regex:masked_out_gemm \
        --section SpeedOfLight --section Occupancy --section WarpStateStats \
        python3 benchmarks/ncu_gate_up.py [--tokens 4096]

Prints the autotuned tiles; ncu prints where the kernel's time goes (what the benchmark's side
by side rows cannot show)."""

from __future__ import annotations

import argparse

import torch

from compresskit_wide.kernels import gemm_out
from compresskit_wide.kernels.layout import triton_routing_layout


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--ffn", type=int, default=14336)
    parser.add_argument("--group", type=int, default=128)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA GPU")
        return 2
    gen = torch.Generator(device="cuda").manual_seed(0)
    m, d, ffn = args.tokens, args.hidden, args.ffn
    x = torch.randn(m, d, device="cuda", dtype=torch.bfloat16, generator=gen)
    wg, wu = (torch.randn(ffn, d, device="cuda", dtype=torch.bfloat16, generator=gen) / d**0.5 for _ in range(2))
    scores = torch.rand(m, ffn // args.group, device="cuda", generator=gen)
    mask = scores >= scores.median(dim=1, keepdim=True).values  # exactly half of the groups a token
    layout = triton_routing_layout(mask)
    gemm_out.triton_masked_out_gemm(x, wg, mask, wu, layout=layout)  # autotunes
    best = gemm_out._tuned_prefill.best_config
    print(f"tiles: {best.kwargs} warps={best.num_warps} stages={best.num_stages}", flush=True)
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    gemm_out.triton_masked_out_gemm(x, wg, mask, wu, layout=layout)
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
