"""The products of a decode batch that shares one set of groups (batch consensus, ``share: set``) against cuBLAS.

    python benchmarks/bench_shared_set.py --out DIR            # on the H200 (Llama-3.1-8B shapes)
    python benchmarks/bench_shared_set.py --smoke --out DIR    # tiny shapes; CPU under TRITON_INTERPRET=1

For M tokens that all run one random set of half the groups: q with k and v stacked (8 groups of 512 rows, k / v
dense), gate+up with the SwiGLU fused (112 groups of 128), down and o handing the next router its shares, each
checked against its reference, then timed in GPU time with the L2 flushed (``bench_wide_kernels.gpu_time``) beside
the dense product cuBLAS runs for it ("x cuBLAS" > 1: the kernel is faster). What ``policy.SHARED_MAX_M`` (the
out-width products) rests on, the split-K reduction's settings (``--sweep``) and its handoff launch's tile
(``--sum-sweep``: ``policy.SHARED_SUM_TILE``). ``--prefill 1024,4096 --tile 64``
also times down and o over tile-coherent sets at prefill (each tile of 64 positions one random half of the groups,
the tile reduction) against cuBLAS.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path[:0] = [str(Path(__file__).resolve().parent)]

from bench_wide_kernels import CUDA, gpu_time, timed  # noqa: E402
from benchmark_report import run_facts, write  # noqa: E402

from compresskit_wide.kernels import policy  # noqa: E402
from compresskit_wide.kernels.gemm_out import torch_masked_out_gemm, triton_masked_out_gemm  # noqa: E402
from compresskit_wide.kernels.gemm_reduce import (  # noqa: E402
    torch_masked_reduce_gemm,
    torch_router_shares,
    triton_masked_reduce_gemm,
    triton_tile_reduce_gemm,
)


def shared_mask(m: int, groups: int, gen: torch.Generator, device) -> torch.Tensor:
    keep = torch.randperm(groups, generator=gen)[: groups // 2]
    row = torch.zeros(groups, dtype=torch.bool)
    row[keep] = True
    return row.expand(m, groups).contiguous().to(device)


def products(x, xf_in, res, mq, mf, kv, fixed, *, wqkv, wg, wu, wd, wo, share_w) -> dict:
    """name -> (ours, reference, cuBLAS) thunks of one token count. The reductions run the kernel as
    ``backend="triton"`` runs it (16-token tiles: an unpacked one-tile variant measured 0.34-0.77x of cuBLAS,
    kept at the tag ``shared-reduce-unpacked``, commit ad649cf)."""
    return {
        "qkv": (
            lambda: triton_masked_out_gemm(x, wqkv, mq, dense_rows=kv, shared=True, **fixed),
            lambda: torch_masked_out_gemm(x, wqkv, mq, None, kv),
            lambda: x @ wqkv.T,
        ),
        "gate+up": (
            lambda: triton_masked_out_gemm(x, wg, mf, wu, shared=True, **fixed),
            lambda: torch_masked_out_gemm(x, wg, mf, wu),
            lambda: F.silu(x @ wg.T) * (x @ wu.T),
        ),
        "down + next router": (
            lambda: triton_masked_reduce_gemm(xf_in, wd, mf, residual=res, share_w=share_w, **fixed),
            lambda: (torch_masked_reduce_gemm(xf_in, wd, mf), None),
            lambda: xf_in @ wd.T,
        ),
        "o + next router": (
            lambda: triton_masked_reduce_gemm(x, wo, mq, residual=res, share_w=share_w, **fixed),
            lambda: (torch_masked_reduce_gemm(x, wo, mq), None),
            lambda: x @ wo.T,
        ),
        "down, split K": (
            lambda: triton_tile_reduce_gemm(xf_in, wd, mf, rows_agree=True),
            lambda: torch_masked_reduce_gemm(xf_in, wd, mf),
            lambda: xf_in @ wd.T,
        ),
        "o, split K": (
            lambda: triton_tile_reduce_gemm(x, wo, mq, rows_agree=True),
            lambda: torch_masked_reduce_gemm(x, wo, mq),
            lambda: x @ wo.T,
        ),
    }


def sweep_split(name, x, w, mask, m) -> list[dict]:
    """The split-K reduction at every (split_k, block_n, block_k, warps) of a small grid: GPU time."""
    found = []
    for split_k in (1, 2, 4, 8, 16, 32):
        for block_n in (32, 64, 128):
            for block_k in (64, 128):
                for warps in (4, 8):
                    setting = {"split_k": split_k, "block_n": block_n, "block_k": block_k, "warps": warps}
                    t = gpu_time(lambda s=setting: triton_tile_reduce_gemm(x, w, mask, rows_agree=True, **s))[0]
                    found.append({"op": name, "m": m, **setting, "ms": t})
    return sorted(found, key=lambda r: r["ms"])


def sweep_sum(name, x, w, mask, m, residual, share_w) -> list[dict]:
    """The split-K reduction handing the next router its shares, its second launch at every (rows, columns,
    warps) of a small grid, each checked against the reference (the output and the shares' sum): GPU time of
    both launches (the first is the same in each)."""
    want = torch_masked_reduce_gemm(x, w, mask)
    want_shares = torch_router_shares(residual + want, share_w).sum(0)
    found = []
    for rows in (8, 16, 32):
        for cols in (16, 32, 64):
            for warps in (1, 2, 4):
                run = lambda t=(rows, cols, warps): triton_tile_reduce_gemm(  # noqa: E731
                    x, w, mask, rows_agree=True, residual=residual, share_w=share_w, sum_tile=t
                )
                got, shares = run()
                torch.testing.assert_close(got.float(), want.float(), rtol=3e-2, atol=3e-2)
                torch.testing.assert_close(shares.sum(0), want_shares, rtol=5e-2, atol=5e-1)
                found.append({"op": name, "m": m, "sum_tile": [rows, cols, warps], "ms": gpu_time(run)[0]})
    return sorted(found, key=lambda r: r["ms"])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--m", default="16,24,32,48,64", help="token counts")
    ap.add_argument("--sweep", action="store_true", help="also sweep the split-K reduction's launch settings")
    ap.add_argument("--sum-sweep", action="store_true", help="also sweep the handoff's second launch (sum_tile)")
    ap.add_argument("--prefill", default="", help="prompt lengths at which to time down and o over tile sets")
    ap.add_argument("--tile", type=int, default=64, help="with --prefill: positions a tile (one set each)")
    args = ap.parse_args()
    if not CUDA and not args.smoke:
        print("no CUDA device: use --smoke")
        return 2
    device, dtype = ("cuda", torch.bfloat16) if CUDA else ("cpu", torch.float32)
    d, ffn, group, heads, head_dim, kv_heads, rank = (
        (64, 256, 32, 8, 8, 2, 8) if args.smoke else (4096, 14336, 128, 32, 128, 8, 32)
    )
    qg, fg = heads // 4, ffn // group  # q's groups of 4 heads, the FFN's groups
    gen = torch.Generator().manual_seed(0)

    def w(n, k):
        return (torch.randn(n, k, generator=gen) / k**0.5).to(device, dtype)

    wqkv, wg, wu, wd, wo = w(heads * head_dim + 2 * kv_heads * head_dim, d), w(ffn, d), w(ffn, d), w(d, ffn), w(d, d)
    share_w = (torch.randn(rank, d, generator=gen) / d**0.5).to(device)
    rows, data, swept = [], [], []
    tol = {"rtol": 3e-2, "atol": 3e-2} if CUDA else {"rtol": 1e-4, "atol": 1e-4}
    for m in [int(v) for v in args.m.split(",")]:
        x = torch.randn(m, d, generator=gen).to(device, dtype)
        xf = torch.randn(m, ffn, generator=gen).to(device, dtype)
        res = torch.randn(m, d, generator=gen).to(device, dtype)
        mq, mf = shared_mask(m, qg, gen, device), shared_mask(m, fg, gen, device)
        kv = 2 * kv_heads * head_dim
        fixed = {} if CUDA else {"block_n": 16, "block_k": 16}
        xf_in = xf * mf.repeat_interleave(group, dim=-1)  # (down's input is zero in the skipped groups)
        cases = products(x, xf_in, res, mq, mf, kv, fixed, wqkv=wqkv, wg=wg, wu=wu, wd=wd, wo=wo, share_w=share_w)
        for name, (ours, ref, dense) in cases.items():
            got, want = ours(), ref()
            if isinstance(got, tuple):
                got, shares = got
                want = want[0]
                expect = torch_router_shares(res + want, share_w)
                torch.testing.assert_close(shares.sum(0), expect.sum(0), rtol=5e-2, atol=5e-1 if CUDA else 1e-3)
            torch.testing.assert_close(got.float(), want.float(), **tol)
            if CUDA:
                t_ours, t_dense = gpu_time(ours)[0], gpu_time(dense)[0]
            else:
                t_ours, t_dense = timed(ours), timed(dense)
            ratio = t_dense / t_ours
            rows.append(f"| {name} | {m} | {t_ours * 1e3:.1f} | {t_dense * 1e3:.1f} | {ratio:.2f}x |")
            data.append({"op": name, "m": m, "ours_ms": t_ours, "cublas_ms": t_dense, "x_cublas": ratio})
            print(rows[-1], flush=True)
        if CUDA and args.sweep:
            for name, a, wt, mk in (("down", xf_in, wd, mf), ("o", x, wo, mq)):
                found = sweep_split(name, a, wt, mk, m)
                swept += found[:3]
                dense_ms = gpu_time(lambda a=a, wt=wt: a @ wt.T)[0]
                for r in found[:3]:
                    print(f"sweep {name} M={m}: {r} -> {dense_ms / r['ms']:.2f}x cuBLAS", flush=True)
        if CUDA and args.sum_sweep:
            for name, a, wt, mk in (("down", xf_in, wd, mf), ("o", x, wo, mq)):
                found = sweep_sum(name, a, wt, mk, m, res, share_w)
                default = next(r for r in found if tuple(r["sum_tile"]) == policy.SHARED_SUM_TILE)
                swept += found[:3] + [default]
                for r in [*found[:3], default]:
                    print(f"sum sweep {name} M={m}: {r} -> {default['ms'] / r['ms']:.2f}x the default", flush=True)
    for t in [int(v) for v in args.prefill.split(",") if v]:
        # tile-coherent routing at prefill: each tile of --tile positions runs one random half of the groups
        x = torch.randn(t, d, generator=gen).to(device, dtype)
        xf = torch.randn(t, ffn, generator=gen).to(device, dtype)
        n_tiles = -(-t // args.tile)
        mq = torch.cat([shared_mask(args.tile, qg, gen, device) for _ in range(n_tiles)])[:t]
        mf = torch.cat([shared_mask(args.tile, fg, gen, device) for _ in range(n_tiles)])[:t]
        xf_in = xf * mf.repeat_interleave(group, dim=-1)
        for name, a, wt, mk in (
            (f"down, tiles of {args.tile}", xf_in, wd, mf),
            (f"o, tiles of {args.tile}", x, wo, mq),
        ):
            ours = lambda a=a, wt=wt, mk=mk, t=t: triton_tile_reduce_gemm(a, wt, mk, tile=args.tile, tokens=t)  # noqa: E731
            torch.testing.assert_close(ours().float(), torch_masked_reduce_gemm(a, wt, mk).float(), **tol)
            dense = lambda a=a, wt=wt: a @ wt.T  # noqa: E731
            t_ours, t_dense = (gpu_time(ours)[0], gpu_time(dense)[0]) if CUDA else (timed(ours), timed(dense))
            rows.append(f"| {name} | {t} | {t_ours * 1e3:.1f} | {t_dense * 1e3:.1f} | {t_dense / t_ours:.2f}x |")
            data.append({"op": name, "m": t, "ours_ms": t_ours, "cublas_ms": t_dense, "x_cublas": t_dense / t_ours})
            print(rows[-1], flush=True)
    lines = ["| product | tokens | ours us | cuBLAS us | x cuBLAS |", "|---|---|---|---|---|", *rows]
    facts = run_facts(CUDA, shapes="smoke" if args.smoke else "Llama-3.1-8B, half the groups in one shared set")
    print(write(args.out, "shared_set", "Shared-set products against cuBLAS (GPU time, L2 flushed)", facts, lines,
                {"rows": data, "sweep_best": swept}))  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
