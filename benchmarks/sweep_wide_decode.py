"""Operand-order sweep of WIDE's decode products on the GPU, in GPU time (kernel durations with the
L2 flushed before every call, as ``bench_wide_kernels.py``'s GPU-time column), side by side with
cuBLAS measured in the same run.

    python benchmarks/sweep_wide_decode.py --out DIR [--only REGEX]
    python benchmarks/sweep_wide_decode.py --smoke --out DIR   # tiny shapes, CPU interpreter

Llama-3.1-8B shapes, bf16, 50% sparsity, exact-k and i.i.d. masks, M = 1 and 4 (``--cases``). Each
decode product runs with the tokens as the MMA's rows (a 16-row ``tl.dot`` tile) and with the weight
tile as its rows (``swap_ab``: 32 to 128 weight rows; from 64, Hopper's warp-group MMA), each
autotuned over its own tile table (the chosen tiles are printed): gate+up fused, q at K splits 1 to
8 (the last share adds the partials), down's fused loop at 2 to 8 shares, o's (8 groups of 512
inputs) at 1 to 8; each also with K chunks (down, o: active groups) packed into one product
(``k_pack`` 2, 4, 8: few output channels a program, no partial sums; for down and o with the
compacted group list and without it, "direct"; ``--variants`` selects variants by name). (Runs 47-52 also timed the
fused gate+up over 2 and 4 programs an output block and the decode attention with both products
transposed, options removed after: ``bb50dc3`` and ``8ded36d`` have them.) Each variant is first
checked against its PyTorch reference. Results: a table on stdout and
``sweep.json`` / ``sweep.md`` in --out (GPU, driver, versions, date, command).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).resolve().parent)]

from bench_wide_kernels import gpu_time, make_mask, meta, seed_case, timed  # noqa: E402

from compresskit_wide.kernels.gemm_out import (  # noqa: E402
    _tuned_out_gemv,
    _tuned_out_gemv_packed,
    _tuned_out_gemv_splitk,
    torch_masked_out_gemm,
    triton_masked_out_gemm,
)
from compresskit_wide.kernels.gemm_reduce import (  # noqa: E402
    _tuned_reduce_direct,
    _tuned_reduce_fused,
    _tuned_reduce_packed,
    torch_masked_reduce_gemm,
    triton_masked_reduce_gemm,
)

D, FFN, GROUP, HEADS, HEAD_DIM, ATTN_GROUP = 4096, 14336, 128, 32, 128, 4
CASES = ((1, "exact"), (1, "iid"), (4, "iid"))
DT = torch.bfloat16
DEV = "cuda"


def smoke() -> None:
    """Tiny shapes: the script's own test, on the GPU in bf16 where there is one, else on the CPU in
    fp32 (Triton's interpreter)."""
    global D, FFN, GROUP, HEADS, HEAD_DIM, ATTN_GROUP, CASES, DT, DEV
    D, FFN, GROUP, HEADS, HEAD_DIM, ATTN_GROUP = 64, 128, 32, 8, 16, 2
    CASES = ((1, "exact"),)
    DEV = "cuda" if torch.cuda.is_available() else "cpu"
    DT = torch.bfloat16 if DEV == "cuda" else torch.float32


def kernel_time(fn) -> tuple[float, dict]:
    """GPU time (ms, profile) on a GPU; the interpreter's wall time (meaningless) in the smoke run."""
    return gpu_time(fn) if DEV == "cuda" else (timed(fn), {})


def close(got, ref, tol=3e-2) -> bool:
    return bool(torch.allclose(got.float(), ref.float(), rtol=tol, atol=tol))


def best_config(tuned) -> str | None:
    cfg = getattr(tuned, "best_config", None)
    return None if cfg is None else f"{cfg.kwargs} w{cfg.num_warps} s{cfg.num_stages}"


class Sweep:
    def __init__(self, only: str | None, variants: str | None = None):
        self.rows: list[dict] = []
        self.only = re.compile(only) if only else None
        self.variants = re.compile(variants) if variants else None

    def begin(self, case: str, gen: torch.Generator) -> bool:
        """Whether ``case`` is selected (``--only``); if it is, its generators are seeded from its
        name (``seed_case``), so that it draws the same masks and inputs alone as in a full run."""
        if self.only is not None and not self.only.search(case):
            return False
        seed_case(case, gen)
        return True

    def add_packed(self, case: str, run, ref, base_ms: float, base_name: str, tuned: dict, suffix: str = "") -> None:
        """``add`` for each K packing with a tile table (``tuned``: packing -> autotuner), ``run(pack)``
        the product packed so; ``suffix`` ends the variants' names."""
        for pack in sorted(tuned):
            name = f"swap_ab=True k_pack={pack}{suffix}"
            self.add(case, name, lambda p=pack: run(p), ref, base_ms, base_name, tuned[pack])

    def add(self, case: str, variant: str, fn, ref, base_ms: float, base_name: str, tuned) -> None:
        """Check ``fn()`` against ``ref``, then time it; ``tuned``: the autotuner whose choice to print.
        Variants ``--variants`` does not select are skipped."""
        if self.variants is not None and not self.variants.search(variant):
            return
        ok = close(fn(), ref)
        ms, profile = kernel_time(fn)
        row = {
            "case": case,
            "variant": variant,
            "correct": ok,
            "gpu_ms": ms,
            "baseline": base_name,
            "baseline_gpu_ms": base_ms,
            "speedup": base_ms / ms if ms == ms and ms > 0 else float("nan"),
            "tiles": best_config(tuned),
            "profile": profile,
        }
        self.rows.append(row)
        print(
            f"{case:22s} {variant:26s} {'ok ' if ok else 'BAD'} {ms * 1e3:8.2f} us  "
            f"{base_name} {base_ms * 1e3:8.2f} us  {row['speedup']:.2f}x  {row['tiles'] or ''}",
            flush=True,
        )


def sweep_gate_up(sw: Sweep, m: int, kind: str, gen) -> None:
    case = f"gate+up M={m} {kind}"
    if not sw.begin(case, gen):
        return
    x = torch.randn(m, D, device=DEV, dtype=DT)
    wg = torch.randn(FFN, D, device=DEV, dtype=DT) / D**0.5
    wu = torch.randn(FFN, D, device=DEV, dtype=DT) / D**0.5
    w_cat = torch.cat([wg, wu])
    mask = make_mask(m, FFN // GROUP, 0.5, kind, gen, DEV)
    ref = torch_masked_out_gemm(x, wg, mask, wu)
    base, _ = kernel_time(lambda: x @ w_cat.T)
    for swap in (False, True):
        sw.add(
            case,
            f"swap_ab={swap}",
            lambda swap=swap: triton_masked_out_gemm(x, wg, mask, wu, swap_ab=swap, k_pack=1),
            ref,
            base,
            "cuBLAS gate+up",
            _tuned_out_gemv[swap],
        )
    run = lambda pack: triton_masked_out_gemm(x, wg, mask, wu, swap_ab=True, k_pack=pack)  # noqa: E731
    sw.add_packed(case, run, ref, base, "cuBLAS gate+up", _tuned_out_gemv_packed)


def sweep_q(sw: Sweep, m: int, kind: str, gen) -> None:
    case = f"q M={m} {kind}"
    if not sw.begin(case, gen):
        return
    x = torch.randn(m, D, device=DEV, dtype=DT)
    w = torch.randn(HEADS * HEAD_DIM, D, device=DEV, dtype=DT) / D**0.5
    mask = make_mask(m, HEADS // ATTN_GROUP, 0.5, kind, gen, DEV)
    ref = torch_masked_out_gemm(x, w, mask)
    base, _ = kernel_time(lambda: x @ w.T)
    for swap in (False, True):
        for split in (1, 2, 4, 8):
            sw.add(
                case,
                f"swap_ab={swap} split_k={split}",
                lambda swap=swap, split=split: triton_masked_out_gemm(
                    x, w, mask, split_k=split, swap_ab=swap, k_pack=1
                ),
                ref,
                base,
                "cuBLAS",
                (_tuned_out_gemv_splitk if split > 1 else _tuned_out_gemv)[swap],
            )
    run = lambda pack: triton_masked_out_gemm(x, w, mask, split_k=1, swap_ab=True, k_pack=pack)  # noqa: E731
    sw.add_packed(case, run, ref, base, "cuBLAS", _tuned_out_gemv_packed)


def sweep_reduce(sw: Sweep, op: str, m: int, kind: str, gen) -> None:
    """The reduction-width decode product: "down" (FFN inputs, 112 groups of 128) or "o" (the
    attention's heads, 8 groups of 4 heads x 128)."""
    case = f"{op} M={m} {kind}"
    if not sw.begin(case, gen):
        return
    k, groups = (FFN, FFN // GROUP) if op == "down" else (HEADS * HEAD_DIM, HEADS // ATTN_GROUP)
    x = torch.randn(m, k, device=DEV, dtype=DT)
    w = torch.randn(D, k, device=DEV, dtype=DT) / k**0.5
    mask = make_mask(m, groups, 0.5, kind, gen, DEV)
    ref = torch_masked_reduce_gemm(x, w, mask)
    base, _ = kernel_time(lambda: x @ w.T)
    for swap in (False, True):
        for split in (1, 2, 4, 8) if op == "o" else (2, 4, 8):
            sw.add(
                case,
                f"swap_ab={swap} split={split}",
                lambda swap=swap, split=split: triton_masked_reduce_gemm(
                    x, w, mask, split=split, variant="fused", swap_ab=swap
                ),
                ref,
                base,
                "cuBLAS",
                _tuned_reduce_fused[swap],
            )
    for variant, tuned in (("packed", _tuned_reduce_packed), ("direct", _tuned_reduce_direct)):
        run = lambda pack, v=variant: triton_masked_reduce_gemm(x, w, mask, variant=v, k_pack=pack)  # noqa: E731
        sw.add_packed(case, run, ref, base, "cuBLAS", tuned, "" if variant == "packed" else " direct")


def mma_kinds() -> dict:
    """Which MMA the compiler emitted for the gate+up decode kernel in each operand order (64 x 128
    weight tiles, 4 warps, 4 stages; the table's usual choice), read from the compiled kernel's TTGIR:
    "wgmma" (Hopper's warp-group MMA), "mma" (the older one) or "other"."""
    from compresskit_wide.kernels.gemm_out import triton_masked_out_gemv_kernel
    from compresskit_wide.kernels.layout import mask_bytes
    from compresskit_wide.kernels.tuning import dot_precision

    x = torch.randn(1, D, device=DEV, dtype=DT)
    w = torch.randn(FFN, D, device=DEV, dtype=DT)
    out = torch.empty(1, FFN, device=DEV, dtype=DT)
    mask = mask_bytes(torch.ones(1, FFN // GROUP, dtype=torch.bool, device=DEV))
    kinds = {}
    for swap in (False, True):
        kernel = triton_masked_out_gemv_kernel.warmup(
            x, w, w, out, mask, 1, FFN, D, GROUP, x.stride(0), w.stride(0), out.stride(0), mask.stride(0),
            FUSE_SWIGLU=True, DOT_PRECISION=dot_precision(DT), SWAP_AB=swap, BLOCK_M=16, BLOCK_N=64, BLOCK_K=128,
            num_warps=4, num_stages=4, grid=(1,),
        )  # fmt: skip
        ttgir = kernel.asm["ttgir"]
        kind = "wgmma" if "warp_group_dot" in ttgir else "mma" if "nvidia_mma" in ttgir else "other"
        kinds[f"swap_ab={swap}"] = kind
    return kinds


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--only", help="regex over the case names (e.g. 'q M=1|down')")
    parser.add_argument("--variants", help="regex over the variant names (e.g. 'k_pack|split_k=4')")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes (CPU interpreter, TRITON_INTERPRET=1)")
    parser.add_argument(
        "--cases", help="token counts and mask kinds, e.g. '1:exact,2:iid,16:iid' (default 1:exact,1:iid,4:iid)"
    )
    args = parser.parse_args()
    if args.smoke:
        smoke()
    elif not torch.cuda.is_available():
        print("error: the sweep times GPU kernels; no CUDA device here (--smoke: tiny shapes)", file=sys.stderr)
        return 2
    cases = CASES
    if args.cases:
        try:
            cases = tuple((int(m), kind) for m, kind in (c.split(":") for c in args.cases.split(",")))
        except ValueError:
            print(f"error: --cases {args.cases!r}: expected M:KIND pairs, e.g. 1:exact,2:iid", file=sys.stderr)
            return 2
        if any(kind not in ("exact", "iid") or not 1 <= m <= 16 for m, kind in cases):
            print(f"error: --cases {args.cases!r}: M in 1..16, KIND exact or iid", file=sys.stderr)
            return 2
    args.out.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(0)
    sw = Sweep(args.only, args.variants)
    info = meta(DT, D, FFN, GROUP, HEADS, HEAD_DIM, ATTN_GROUP)
    if DEV == "cuda":
        info["mma"] = mma_kinds()
    print(json.dumps(info), flush=True)
    for m, kind in cases:
        sweep_gate_up(sw, m, kind, gen)
        sweep_q(sw, m, kind, gen)
        sweep_reduce(sw, "down", m, kind, gen)
        sweep_reduce(sw, "o", m, kind, gen)
    (args.out / "sweep.json").write_text(json.dumps({"meta": info, "rows": sw.rows}, indent=2))
    lines = [
        f"# WIDE decode sweep\n\n{json.dumps(info)}\n",
        "| case | variant | correct | GPU us | baseline | baseline us | speedup | tiles |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in sw.rows:
        lines.append(
            f"| {r['case']} | {r['variant']} | {r['correct']} | {r['gpu_ms'] * 1e3:.2f} | {r['baseline']} | "
            f"{r['baseline_gpu_ms'] * 1e3:.2f} | {r['speedup']:.2f}x | {r['tiles'] or ''} |"
        )
    (args.out / "sweep.md").write_text("\n".join(lines) + "\n")
    return 0 if all(r["correct"] for r in sw.rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
