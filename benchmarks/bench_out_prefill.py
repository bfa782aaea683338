"""The prefill output-width products against cuBLAS, side by side in one run: WIDE's persistent kernel
(programs over the active tiles, the weight through TMA), autotuned, and with ``--tiles`` each tile of its table.

    python benchmarks/bench_out_prefill.py --out DIR            # on the H200
    python benchmarks/bench_out_prefill.py --tiles --out DIR    # also each tile of the persistent kernel, fixed
    python benchmarks/bench_out_prefill.py --tail-split 1,2 --tokens 512,1024 --masks all,keep78.5 --out DIR
    python benchmarks/bench_out_prefill.py --retune ...        # each row's mask autotunes (default: a shape's first)
    python benchmarks/bench_out_prefill.py --smoke --out DIR    # tiny shapes, TRITON_INTERPRET=1
    python benchmarks/bench_out_prefill.py --rounds RAW.json    # no GPU: a run's items and rounds (masks redrawn)

Products at Llama-3.1-8B shapes: q with k and v stacked under it (6144 x 4096, 8 routed groups of 512 rows,
2048 dense rows) and gate+up with the SwiGLU fused (14336 x 4096 each, 112 groups of 128). Masks: ``all``
(every group on: the kernel's own efficiency at cuBLAS's work), ``iid50`` / ``iid25`` (each group off with
probability 0.5 / 0.25, independently per token), ``exact50`` (half of each token's groups) and ``keepP`` (each
group active on exactly P% of the tokens, drawn per group: ``keep78.5`` holds 402 of 512 tokens a group, as the
end-to-end bench's 25% row realised). The kernel runs with each product's ``TAIL_SPLIT`` of the policy
(``policy.OUT_TAIL_SPLIT``); with ``--tail-split 1,2`` with each of these values instead (its last round of active
items whole, or in two pieces where it fills at most half the programs), each on the tile the autotuner chose for
it, the first as the "kernel" column, and each row gives the items and each value's rounds
(``gemm_out.persistent_rounds``). cuBLAS is the dense fallback ``auto`` runs (``dense_masked_out_gemm``; gate+up:
gate and up stacked in memory as the runtime stacks them, one product, then the SwiGLU and the select in one
pass), the inactive groups of q left as computed;
for gate+up also the fallback before (two products and the eager SwiGLU: ``eager us``). GPU time with the
L2 flushed, median of 30 calls, a row's columns interleaved (each round runs every column once, starting one column
further along; ``bench_wide_kernels.gpu_times``); each kernel's call includes its routing layout. Every kernel's
output is first checked against the reference (``torch_masked_out_gemm``)."""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchmark_report as report  # noqa: E402  (beside this script)

from compresskit_wide.kernels import gemm_out, policy  # noqa: E402
from compresskit_wide.kernels.autotune import staged_tile_bytes  # noqa: E402
from compresskit_wide.kernels.gemm_out import (  # noqa: E402
    dense_masked_out_gemm,
    torch_masked_out_gemm,
    triton_persistent_out_gemm,
)

MASKS = {"all": None, "iid50": 0.5, "iid25": 0.25, "exact50": "exact"}


def make_mask(m: int, groups: int, kind: str, gen: torch.Generator) -> torch.Tensor:
    if kind.startswith("keep"):  # each group active on exactly this share of the tokens
        active = round(float(kind[4:]) / 100 * m)
        ranks = torch.rand(m, groups, generator=gen).argsort(dim=0).argsort(dim=0)
        return ranks < active
    off = MASKS[kind]
    if off is None:
        return torch.ones(m, groups, dtype=torch.bool)
    if off == "exact":
        idx = torch.rand(m, groups, generator=gen).topk(groups // 2, dim=1).indices
        return torch.zeros(m, groups, dtype=torch.bool).scatter_(1, idx, True)
    return torch.rand(m, groups, generator=gen) >= off


def eager_swiglu(x: torch.Tensor, w: torch.Tensor, w_up: torch.Tensor) -> torch.Tensor:
    """The SwiGLU fallback before the one pass: two products, then the SiLU and the product eagerly."""
    return torch.nn.functional.silu(x @ w.T) * (x @ w_up.T)


def products(gpu: bool) -> dict:
    """name -> (rows of w, K, groups, dense rows, fused)."""
    if gpu:
        return {"q (+k, v dense)": (6144, 4096, 8, 2048, False), "gate+up (SwiGLU)": (14336, 4096, 112, 0, True)}
    return {"q (+k, v dense)": (96, 64, 4, 32, False), "gate+up (SwiGLU)": (64, 48, 4, 0, True)}


def arguments() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=report.int_list, default=[1024, 2048, 4096, 8192])
    parser.add_argument("--masks", default=",".join(MASKS))
    parser.add_argument("--tiles", action="store_true", help="also each tile of the persistent kernel, fixed")
    parser.add_argument(
        "--tail-split",
        type=report.int_list,
        help="the kernel's TAIL_SPLIT values, side by side (1,2; default each product's in the policy)",
    )
    parser.add_argument(
        "--retune",
        action="store_true",
        help="autotune the kernel on each row's mask (default: once a shape, on its first row's mask, as a model's "
        "first call with its own masks does)",
    )
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument(
        "--rounds", metavar="RAW", help="no timing: a raw file's items and rounds, its masks drawn again on the CPU"
    )
    parser.add_argument("--sms", type=int, default=132, help="with --rounds: the GPU's SMs (the H200's 132)")
    return parser


def replayed_rounds(raw: str, sms: int) -> list[dict]:
    """Each kernel row of a raw file of this script (``--rounds``): the masks its run drew, drawn again on the CPU
    (the same seed, shapes, token counts and masks, in the same order), and the items and rounds the persistent
    kernel ran on the tile the autotuner chose (``gemm_out.persistent_rounds``, ``sms`` x its programs an SM)
    beside the time it measured."""
    data = json.loads(Path(raw).read_text())
    run = arguments().parse_known_args(data["meta"]["command"].split()[1:])[0]
    timed = {(r["product"], r["tokens"], r["mask"]): r for r in data["rows"] if "kernel_us" in r}
    gen = torch.Generator().manual_seed(0)
    rows = []
    for name, (n, d, groups, dense_rows, fused) in data["meta"]["shapes"].items():
        torch.randn(2 * n if fused else n, d, generator=gen)  # the weights' draws
        gw = (n - dense_rows) // groups
        for m in run.tokens:
            torch.randn(m, d, generator=gen)
            for kind in run.masks.split(","):
                mask = make_mask(m, groups, kind, gen)
                row = timed.get((name, m, kind))
                if row is None or "tile" not in row:
                    continue
                tile = row["tile"]
                programs, split = sms * tile["PER_SM"], row.get("tail_split", 1)  # (older files: whole items)
                bm, bn = tile["BLOCK_M"], tile["BLOCK_N"]
                plan = gemm_out.persistent_rounds(mask, gw, dense_rows, bm, bn, programs, split)
                rows.append({**row, **plan, "us_per_round": row["kernel_us"] / plan["rounds"]})
    return rows


def main() -> int:
    parser = arguments()
    args = parser.parse_args()
    if args.rounds:
        print("| product | tokens | mask | tile (M x N, an SM) | items | rounds | kernel us | us a round | x cuBLAS |")
        print("|---|---|---|---|---|---|---|---|---|")
        for r in replayed_rounds(args.rounds, args.sms):
            tile = f"{r['tile']['BLOCK_M']} x {r['tile']['BLOCK_N']}, {r['tile']['PER_SM']}"
            line = f"| {r['product']} | {r['tokens']} | {r['mask']} | {tile} | {r['items']} | {r['rounds']:g} | "
            print(line + f"{r['kernel_us']:.1f} | {r['us_per_round']:.1f} | {r['cublas_us'] / r['kernel_us']:.2f}x |")
        return 0
    where = report.gpu_or_smoke(args.smoke)
    if where is None:
        return 2
    dev, dt = where
    gpu = dev.type == "cuda"
    if gpu:
        from bench_wide_kernels import gpu_time, gpu_times
    else:

        def gpu_time(fn):
            fn()
            return float("nan"), {}

        def gpu_times(calls):
            return {label: gpu_time(fn) for label, fn in calls.items()}

    tokens = args.tokens if gpu else [40]
    fixed = {"block_m": 16, "block_n": 16, "block_k": 16} if not gpu else {}
    tiles = policy.OUT_PERSISTENT if gpu else [({"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 16, "PER_SM": 1}, 4, 2)]
    gen = torch.Generator().manual_seed(0)
    rows, ok = [], True
    # the TAIL_SPLIT values: the first is the "kernel" column (default: each product's in the policy)
    splits = args.tail_split or [None]
    more = splits[1:]
    header = "| product | tokens | mask | cuBLAS us | kernel us | x cuBLAS | eager us |"
    header += "".join(f" split {s} us | x kernel |" for s in more)
    header += " items, rounds |" if more else ""
    lines = [header, "|---" * header.count(" |") + "|"]
    tile_lines = [
        "| product | tokens | mask | BLOCK_M x N x K, warps, stages, programs | us | x cuBLAS |",
        "|---|---|---|---|---|---|",
    ]
    print(header, flush=True)
    for name, (n, d, groups, dense_rows, fused) in products(gpu).items():
        # gate and up stacked in memory, as the runtime's blocks stack them (stacked_linear)
        both = (torch.randn(2 * n if fused else n, d, generator=gen) / d**0.5).to(dev, dt)
        w, w_up = both.split(n) if fused else (both, None)
        gw = (n - dense_rows) // groups
        own = [policy.out_tail_split(fused) if s is None else s for s in splits]
        labels = {("kernel" if i == 0 else f"split{s}"): s for i, s in enumerate(own)}
        for m in tokens:
            x = torch.randn(m, d, generator=gen).to(dev, dt)
            for kind in args.masks.split(","):
                mask = make_mask(m, groups, kind, gen).to(dev)
                if args.retune and gpu:  # this row's mask picks the tile (the autotuner's choices forgotten)
                    gemm_out._tuned_prefill.cache.clear()
                want = torch_masked_out_gemm(x, w, mask, w_up, dense_rows).float()
                calls = {
                    "cublas": functools.partial(
                        dense_masked_out_gemm, x, w, mask, w_up, zero_inactive=False, dense_rows=dense_rows
                    ),
                }
                for label, split in labels.items():  # the persistent kernel (M > 16) at each TAIL_SPLIT
                    calls[label] = functools.partial(
                        triton_persistent_out_gemm, x, w, mask, w_up, dense_rows=dense_rows, tail_split=split, **fixed
                    )
                if fused:  # the fallback before the one pass
                    calls["eager"] = functools.partial(eager_swiglu, x, w, w_up)
                chosen, plans = {}, {}
                for label, call in calls.items():
                    # (q's fallback leaves its inactive groups as computed: not compared)
                    kernel = label.startswith(("kernel", "split"))
                    if kernel or (label == "cublas" and fused):
                        good = torch.allclose(call().float(), want, rtol=3e-2, atol=3e-2)
                        ok &= good
                        if not good:
                            print(f"{name} {m} {kind} {label}: WRONG", flush=True)
                    best = getattr(gemm_out._tuned_prefill, "best_config", None) if gpu and kernel else None
                    if best is not None:  # the tile the autotuner chose for this variant at this row's shape
                        chosen[label] = {**best.kwargs, "warps": best.num_warps, "stages": best.num_stages}
                        sms = torch.cuda.get_device_properties(dev).multi_processor_count
                        tile = (best.kwargs["BLOCK_M"], best.kwargs["BLOCK_N"], sms * best.kwargs["PER_SM"])
                        plans[label] = gemm_out.persistent_rounds(mask, gw, dense_rows, *tile, labels[label])
                us = {label: ms * 1e3 for label, (ms, _) in gpu_times(calls).items()}  # side by side, interleaved
                row = {"product": name, "tokens": m, "mask": kind, "tail_split": own[0]}
                row |= {f"{k}_us": v for k, v in us.items()}
                if chosen:
                    row |= {"tile": chosen["kernel"], "tiles": chosen, "plans": plans}
                rows.append(row)
                c, ours = us["cublas"], us["kernel"]
                eager = f"{us['eager']:.1f}" if "eager" in us else "-"
                line = f"| {name} | {m} | {kind} | {c:.1f} | {ours:.1f} | {c / ours:.2f}x | {eager} |"
                line += "".join(f" {us[v]:.1f} | {ours / us[v]:.2f}x |" for v in list(labels)[1:])
                if more:
                    rounds = " / ".join(f"{plans[v]['rounds']:g}" for v in labels) if plans else "-"
                    line += f" {plans['kernel']['items'] if plans else '-'}, {rounds} |"
                lines.append(line)
                print(line, flush=True)
                if args.tiles and kind == "all":
                    for meta, warps, stages in tiles:
                        staged = staged_tile_bytes(meta, stages, x.element_size(), fused)
                        if meta["BLOCK_N"] > gw or staged > policy.PACKED_SMEM_BUDGET:
                            continue
                        call = functools.partial(
                            triton_persistent_out_gemm, x, w, mask, w_up, dense_rows=dense_rows,
                            block_m=meta["BLOCK_M"], block_n=meta["BLOCK_N"], block_k=meta["BLOCK_K"],
                            per_sm=meta["PER_SM"], warps=warps, stages=stages,
                        )  # fmt: skip
                        label = (
                            f"{meta['BLOCK_M']} x {meta['BLOCK_N']} x {meta['BLOCK_K']}, {warps}, {stages}, "
                            f"{meta['PER_SM']} an SM"
                        )
                        good = torch.allclose(call().float(), want, rtol=3e-2, atol=3e-2)
                        ok &= good
                        t_us = gpu_time(call)[0] * 1e3
                        rows.append({"product": name, "tokens": m, "mask": kind, "tile": meta, "warps": warps,
                                     "stages": stages, "us": t_us, "ok": good})  # fmt: skip
                        tile_line = f"| {name} | {m} | {kind} | {label} | {t_us:.1f} | {us['cublas'] / t_us:.2f}x |"
                        tile_lines.append(tile_line + ("" if good else " WRONG"))
                        print(tile_line, flush=True)
    facts = report.run_facts(gpu, shapes={k: list(v) for k, v in products(gpu).items()})
    all_lines = lines + ([""] + tile_lines if args.tiles else [])
    report.write(args.out, "bench-out-prefill", "Prefill output-width products against cuBLAS", facts, all_lines,
                 {"rows": rows})  # fmt: skip
    print("every kernel matches the reference" if ok else "SOME KERNELS DO NOT MATCH THE REFERENCE", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
