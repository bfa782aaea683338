"""Launch-setting sweep of WIDE's decode kernels on the GPU, in GPU time (kernel durations with the
L2 flushed before every call, as ``bench_wide_kernels.py``'s GPU-time column), side by side with
the dense baselines measured in the same run.

    python benchmarks/sweep_wide_decode.py --out DIR [--only REGEX]
    python benchmarks/sweep_wide_decode.py --smoke --out DIR   # tiny shapes, CPU interpreter

Llama-3.1-8B shapes, bf16, 50% sparsity, exact-k and i.i.d. masks. Sweeps:
* the decode products with ``tl.dot`` on a 16-row token tile against the CUDA-core GEMV
  (``gemv="fma"``), each with its autotuned tiles (the chosen ones are printed): q (split over K),
  gate+up fused, down (the fused loop, 1 to 8 shares), at M = 1, 2, 4;
* the routed decode attention: KV splits x the merge (a second launch or folded into the last
  split), then positions per step x warps x pipeline stages for the best of those, at 8k and 32k
  positions, batch 1, 4, 16.
Each kernel is first checked against its PyTorch reference. Results: a table on stdout and
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

from bench_wide_kernels import gpu_time, make_mask, meta, sdpa_variants, timed  # noqa: E402
from compresskit_wide.kernels import tuning  # noqa: E402
from compresskit_wide.kernels.attention_decode import (  # noqa: E402
    torch_routed_attention_decode,
    triton_routed_attention_decode,
)
from compresskit_wide.kernels.gemm_out import (  # noqa: E402
    _tuned_out_gemv,
    _tuned_out_gemv_splitk,
    torch_masked_out_gemm,
    triton_masked_out_gemm,
)
from compresskit_wide.kernels.gemm_reduce import (  # noqa: E402
    _tuned_reduce_fused,
    torch_masked_reduce_gemm,
    triton_masked_reduce_gemm,
)

D, FFN, GROUP, HEADS, KV_HEADS, HEAD_DIM, ATTN_GROUP = 4096, 14336, 128, 32, 8, 128, 4
CONTEXTS = ((8192, 1), (32768, 1), (8192, 4), (32768, 16), (16384, 1))  # (positions, batch); the first: full sweep
DT = torch.bfloat16
DEV = "cuda"


def smoke() -> None:
    """Tiny shapes in fp32 on the CPU (Triton's interpreter): the script's own test."""
    global D, FFN, GROUP, HEADS, KV_HEADS, HEAD_DIM, ATTN_GROUP, CONTEXTS, DT, DEV
    D, FFN, GROUP, HEADS, KV_HEADS, HEAD_DIM, ATTN_GROUP = 64, 128, 32, 8, 2, 16, 2
    CONTEXTS, DT, DEV = ((512, 1),), torch.float32, "cpu"


def kernel_time(fn) -> tuple[float, dict]:
    """GPU time (ms, profile) on a GPU; the interpreter's wall time (meaningless) in the smoke run."""
    return gpu_time(fn) if DEV == "cuda" else (timed(fn), {})


def close(got, ref, tol=3e-2) -> bool:
    return bool(torch.allclose(got.float(), ref.float(), rtol=tol, atol=tol))


class Sweep:
    def __init__(self, only: str | None):
        self.rows: list[dict] = []
        self.only = re.compile(only) if only else None

    def wanted(self, case: str) -> bool:
        return self.only is None or bool(self.only.search(case))

    def add(self, case: str, variant: str, ok: bool, fn, base_ms: float, base_name: str, tiles=None) -> None:
        ms, profile = kernel_time(fn)
        row = {
            "case": case,
            "variant": variant,
            "correct": ok,
            "gpu_ms": ms,
            "baseline": base_name,
            "baseline_gpu_ms": base_ms,
            "speedup": base_ms / ms if ms == ms and ms > 0 else float("nan"),
            "tiles": tiles,
            "profile": profile,
        }
        self.rows.append(row)
        print(
            f"{case:34s} {variant:42s} {'ok ' if ok else 'BAD'} {ms * 1e3:8.2f} us  "
            f"{base_name} {base_ms * 1e3:8.2f} us  {row['speedup']:.2f}x  {tiles or ''}",
            flush=True,
        )


def best_config(tuned) -> str | None:
    cfg = getattr(tuned, "best_config", None)
    return None if cfg is None else f"{cfg.kwargs} w{cfg.num_warps} s{cfg.num_stages}"


def sweep_q(sw: Sweep, m: int, kind: str, gen) -> None:
    case = f"q M={m} {kind}"
    if not sw.wanted(case):
        return
    x = torch.randn(m, D, device=DEV, dtype=DT)
    w = torch.randn(HEADS * HEAD_DIM, D, device=DEV, dtype=DT) / D**0.5
    mask = make_mask(m, HEADS // ATTN_GROUP, 0.5, kind, gen, DEV)
    ref = torch_masked_out_gemm(x, w, mask)
    base, _ = kernel_time(lambda: x @ w.T)
    for gemv in ("dot", "fma"):
        for split in (1, 2, 4, 8):
            got = triton_masked_out_gemm(x, w, mask, split_k=split, gemv=gemv)
            tuned = _tuned_out_gemv_splitk[gemv] if split > 1 else _tuned_out_gemv[gemv]
            sw.add(
                case,
                f"{gemv} split_k={split}",
                close(got, ref),
                lambda split=split, gemv=gemv: triton_masked_out_gemm(x, w, mask, split_k=split, gemv=gemv),
                base,
                "cuBLAS",
                best_config(tuned),
            )


def sweep_gate_up(sw: Sweep, m: int, kind: str, gen) -> None:
    case = f"gate+up M={m} {kind}"
    if not sw.wanted(case):
        return
    x = torch.randn(m, D, device=DEV, dtype=DT)
    wg = torch.randn(FFN, D, device=DEV, dtype=DT) / D**0.5
    wu = torch.randn(FFN, D, device=DEV, dtype=DT) / D**0.5
    w_cat = torch.cat([wg, wu])
    mask = make_mask(m, FFN // GROUP, 0.5, kind, gen, DEV)
    ref = torch_masked_out_gemm(x, wg, mask, wu)
    base, _ = kernel_time(lambda: x @ w_cat.T)
    for gemv in ("dot", "fma"):
        got = triton_masked_out_gemm(x, wg, mask, wu, gemv=gemv)
        sw.add(
            case,
            f"{gemv}",
            close(got, ref),
            lambda gemv=gemv: triton_masked_out_gemm(x, wg, mask, wu, gemv=gemv),
            base,
            "cuBLAS gate+up",
            best_config(_tuned_out_gemv[gemv]),
        )


def sweep_down(sw: Sweep, m: int, kind: str, gen) -> None:
    case = f"down M={m} {kind}"
    if not sw.wanted(case):
        return
    x = torch.randn(m, FFN, device=DEV, dtype=DT)
    w = torch.randn(D, FFN, device=DEV, dtype=DT) / FFN**0.5
    mask = make_mask(m, FFN // GROUP, 0.5, kind, gen, DEV)
    ref = torch_masked_reduce_gemm(x, w, mask)
    base, _ = kernel_time(lambda: x @ w.T)
    for gemv in ("dot", "fma"):
        for split in (1, 2, 4, 8):
            got = triton_masked_reduce_gemm(x, w, mask, split=split, variant="fused", gemv=gemv)
            sw.add(
                case,
                f"fused {gemv} split={split}",
                close(got, ref),
                lambda split=split, gemv=gemv: triton_masked_reduce_gemm(
                    x, w, mask, split=split, variant="fused", gemv=gemv
                ),
                base,
                "cuBLAS",
                best_config(_tuned_reduce_fused[gemv]),
            )


def sweep_attention(sw: Sweep, batch: int, ctx: int, gen, full: bool) -> None:
    case = f"attn decode ctx={ctx} B={batch}"
    if not sw.wanted(case):
        return
    q = torch.randn(batch, HEADS, HEAD_DIM, device=DEV, dtype=DT)
    k = torch.randn(batch, KV_HEADS, ctx, HEAD_DIM, device=DEV, dtype=DT)
    v = torch.randn(batch, KV_HEADS, ctx, HEAD_DIM, device=DEV, dtype=DT)
    lens = torch.full((batch,), ctx, device=DEV, dtype=torch.int32)
    mask = make_mask(batch, HEADS // ATTN_GROUP, 0.5, "exact", gen, DEV)
    ref = torch_routed_attention_decode(q, k, v, lens, mask)
    dense = {name: kernel_time(fn)[0] for name, fn in sdpa_variants(q[:, :, None, :], k, v, False).items()}
    base_name = min(dense, key=dense.get)
    base = dense[base_name]

    def run(**kw):
        got = triton_routed_attention_decode(q, k, v, lens, mask, **kw)
        name = " ".join(f"{key}={val}" for key, val in kw.items()) or "default"
        sw.add(case, name, close(got, ref), lambda: triton_routed_attention_decode(q, k, v, lens, mask, **kw), base,
               base_name)  # fmt: skip
        return sw.rows[-1]["gpu_ms"]

    run()  # the shipped defaults
    times = {}
    for splits in (16, 32, 64, 128, 256):
        if splits * tuning.attention_decode_block() > ctx:
            continue
        for fold in (False, True):
            times[(splits, fold)] = run(splits=splits, fold_merge=fold)
    if not full:
        return
    splits, fold = min(times, key=times.get)
    for block_n in (32, 64, 128):
        for warps in (4, 8):
            for stages in (2, 3, 4):
                run(splits=splits, fold_merge=fold, block_n=block_n, num_warps=warps, num_stages=stages)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--only", help="regex over the case names (e.g. 'q M=1|attn')")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes (CPU interpreter, TRITON_INTERPRET=1)")
    args = parser.parse_args()
    if args.smoke:
        smoke()
    elif not torch.cuda.is_available():
        print("error: the sweep times GPU kernels; no CUDA device here (--smoke: tiny shapes on the CPU)", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(0)
    sw = Sweep(args.only)
    info = meta(DT, D, FFN, GROUP, HEADS, HEAD_DIM, ATTN_GROUP)
    print(json.dumps(info), flush=True)
    for m in (1, 2, 4):
        for kind in ("exact", "iid"):
            if m > 1 and kind == "exact":
                continue
            sweep_gate_up(sw, m, kind, gen)
            sweep_q(sw, m, kind, gen)
            sweep_down(sw, m, kind, gen)
    for i, (ctx, batch) in enumerate(CONTEXTS):
        sweep_attention(sw, batch, ctx, gen, full=i == 0)
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
