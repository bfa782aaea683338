"""Why the prefill output-width kernel's time does not follow its work: every tile of its table, fixed
(no autotuning), on q at Llama-3.1-8B shapes (4096 x 4096, 8 groups of 512 rows), beside cuBLAS.

    python benchmarks/sweep_out_prefill.py --out DIR                  # on the H200
    python benchmarks/sweep_out_prefill.py --smoke --out DIR          # tiny shapes, TRITON_INTERPRET=1

Masks at half of the groups: ``exact`` (half of each token's groups, random), ``iid``, ``all`` (every
group on: the kernel's own efficiency at cuBLAS's work) and ``balanced`` (half of each token's groups,
and every group exactly half of the tokens: each group's count a multiple of the tile rows, so no
group has a partly filled tile). For each (tokens, mask, tile) the row gives the programs that
multiply (tiles holding an active token, from the routing layout's counts), all programs, the
programs that fit on the GPU at once (occupancy from the compiled kernel's shared memory, registers
and warps), GPU time with the L2 flushed (median of 30) and cuBLAS's time / ours. The question it
answers: is the time set by the number of active tiles against the SMs (rounds of tiles), rather
than by the multiply-adds? Each tile is first checked against the reference."""

from __future__ import annotations

import argparse
import functools
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchmark_report as report  # noqa: E402  (beside this script)

from compresskit_wide.kernels import policy  # noqa: E402
from compresskit_wide.kernels.common import cdiv, m_bucket  # noqa: E402
from compresskit_wide.kernels.gemm_out import torch_masked_out_gemm  # noqa: E402
from compresskit_wide.kernels.layout import triton_routing_layout  # noqa: E402

# tiles beyond the table: wider channel blocks (cuBLAS-like 128 x 256), longer K steps, deeper pipelines
EXTRA = [
    ({"BLOCK_M": 128, "BLOCK_N": 256, "BLOCK_K": 64}, 8, 3),
    ({"BLOCK_M": 64, "BLOCK_N": 256, "BLOCK_K": 64}, 4, 4),
    ({"BLOCK_M": 64, "BLOCK_N": 256, "BLOCK_K": 64}, 8, 4),
    ({"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 128}, 8, 3),
    ({"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64}, 8, 5),
    ({"BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": 64}, 4, 6),
]


def make_mask(m: int, groups: int, kind: str, gen: torch.Generator) -> torch.Tensor:
    if kind == "all":
        return torch.ones(m, groups, dtype=torch.bool)
    if kind == "iid":
        return torch.rand(m, groups, generator=gen) >= 0.5
    if kind == "balanced":  # token t: the groups of its parity, t's parity shuffled over the tokens
        parity = torch.randperm(m, generator=gen) % 2
        return (parity[:, None] + torch.arange(groups)[None, :]) % 2 == 0
    idx = torch.rand(m, groups, generator=gen).topk(groups // 2, dim=1).indices
    return torch.zeros(m, groups, dtype=torch.bool).scatter_(1, idx, True)


def occupancy(compiled, warps: int) -> int | None:
    """Programs of ``compiled`` one SM holds at once (shared memory, registers, warps); None where
    the compiled kernel does not say."""
    try:
        props = torch.cuda.get_device_properties(0)
        smem = compiled.metadata.shared
        regs = compiled.n_regs
    except (AttributeError, RuntimeError):
        return None
    by_smem = props.shared_memory_per_multiprocessor // max(smem, 1)
    by_regs = props.regs_per_multiprocessor // max(regs * 32 * warps, 1)
    by_warps = props.max_threads_per_multi_processor // (32 * warps)
    return int(min(by_smem, by_regs, by_warps))


def launch(x, w, out, order, counts, grid, meta, warps, stages, gpu):
    """One launch of the sorted-tile kernel with the tile fixed; returns the compiled kernel."""
    from compresskit_wide.kernels.gemm_out import triton_masked_out_gemm_kernel

    (m, d), n, groups = x.shape, w.shape[0], counts.shape[0]
    return triton_masked_out_gemm_kernel[grid](
        x, w, w, out, order, counts, m, n, d, n // groups, groups, groups, m_bucket(m),
        x.stride(0), w.stride(0), out.stride(0),
        FUSE_SWIGLU=False, DOT_PRECISION="tf32" if gpu else "ieee", **meta, num_warps=warps, num_stages=stages,
    )  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", default="1024,2048,4096")
    parser.add_argument("--masks", default="exact,iid,all,balanced")
    parser.add_argument(
        "--tiles",
        choices=["all", "two"],
        default="all",
        help="two: only 128 x 128 x 64 and 128 x 256 x 64 (8 warps, 3 stages)",
    )
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    args = parser.parse_args()
    where = report.gpu_or_smoke(args.smoke)
    if where is None:
        return 2
    dev, dt = where
    gpu = dev.type == "cuda"
    if gpu:
        from bench_wide_kernels import gpu_time
    d, n, groups = (4096, 4096, 8) if gpu else (64, 64, 4)
    tokens = [int(t) for t in args.tokens.split(",")] if gpu else [40]
    tiles = policy.OUT_PREFILL + EXTRA if gpu else [({"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 32}, 4, 2)]
    if args.tiles == "two" and gpu:
        tiles = [t for t in tiles if t[0]["BLOCK_M"] == 128 and t[0]["BLOCK_K"] == 64 and t[1:] == (8, 3)]
    gw = n // groups
    sms = torch.cuda.get_device_properties(0).multi_processor_count if gpu else 1
    gen = torch.Generator().manual_seed(0)
    rows, lines, ok = [], [], True
    header = (
        "| tokens | mask | BLOCK_M x N x K, warps, stages | active programs | programs | at once | us | cuBLAS us "
        "| x cuBLAS |"
    )
    lines += [header, "|---|---|---|---|---|---|---|---|---|"]
    print(header, flush=True)
    for m in tokens:
        x = torch.randn(m, d, generator=gen).to(dev, dt)
        w = (torch.randn(n, d, generator=gen) / d**0.5).to(dev, dt)
        dense_us = gpu_time(functools.partial(torch.matmul, x, w.T))[0] * 1e3 if gpu else float("nan")
        for kind in args.masks.split(","):
            mask = make_mask(m, groups, kind, gen).to(dev)
            order, counts = triton_routing_layout(mask)
            want = torch_masked_out_gemm(x, w, mask).float()
            host_counts = counts.cpu().tolist()
            for meta, warps, stages in tiles:
                bm, bn = meta["BLOCK_M"], meta["BLOCK_N"]
                if bn > gw:
                    continue
                out = torch.empty(m, n, device=dev, dtype=dt)
                grid = (cdiv(m, bm) * cdiv(gw, bn) * groups,)

                call = functools.partial(launch, x, w, out, order, counts, grid, meta, warps, stages, gpu)
                compiled = call()
                good = torch.allclose(out.float(), want, rtol=3e-2, atol=3e-2)
                ok &= good
                us = gpu_time(call)[0] * 1e3 if gpu else float("nan")
                active = sum(cdiv(c, bm) for c in host_counts) * cdiv(gw, bn)
                at_once = occupancy(compiled, warps) if gpu else None
                slots = "" if at_once is None else f"{at_once * sms} ({at_once} an SM)"
                label = f"{bm} x {bn} x {meta['BLOCK_K']}, {warps}, {stages}"
                row = {
                    "tokens": m, "mask": kind, "tile": meta, "warps": warps, "stages": stages, "ok": good,
                    "active_programs": active, "programs": grid[0], "per_sm": at_once, "us": us,
                    "cublas_us": dense_us,
                }  # fmt: skip
                rows.append(row)
                line = (
                    f"| {m} | {kind} | {label} | {active} | {grid[0]} | {slots} | {us:.1f} | {dense_us:.1f} "
                    f"| {dense_us / us:.2f}x |" + ("" if good else " WRONG")
                )
                lines.append(line)
                print(line, flush=True)
    facts = report.run_facts(gpu, sms=sms, shape=f"q: x [T, {d}] @ w [{n}, {d}].T, {groups} groups of {gw}")
    report.write(
        args.out, "sweep-out-prefill", "Prefill output-width kernel: every tile, fixed", facts, lines, {"rows": rows}
    )
    print("all tiles match the reference" if ok else "SOME TILES DO NOT MATCH THE REFERENCE", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
