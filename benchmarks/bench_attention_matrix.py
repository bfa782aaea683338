"""WIDE's routed decode attention against the runtime's dense decode attention over a batch x context
matrix, at several sparsities: where the kernel wins, what ``policy.KERNEL_RANGES`` should say.

    python benchmarks/bench_attention_matrix.py --out DIR            # H200, Llama-3.1-8B's attention shapes
    python benchmarks/bench_attention_matrix.py --out DIR --shape smollm2-135m --contexts 512,2048 --batches 1,4,16
    python benchmarks/bench_attention_matrix.py --out DIR --sweep    # and the launch settings per cell
    python benchmarks/bench_attention_matrix.py --smoke              # CPU interpreter: correctness only

One layer's decode attention a call, as the runtime runs it: the dense side is ``runtime.blocks.attend`` (the
batched-matmul form over the static cache) compiled with ``torch.compile(dynamic=False)``, the inactive heads
then zeroed (o reads only the kept ones either way); the routed side is the Triton split-KV kernel, which skips
the K/V reads of each sequence's inactive head groups (a group of query heads is one KV head: 4 of
Llama-3.1-8B's 32, 3 of SmolLM2-135M's 9, ``--shape``). Masks: each sequence keeps exactly
``round((1 - s) * G)`` of its ``G`` groups, drawn at random. Each cell is checked against the dense side first,
then both are timed in CUDA graphs with the L2 flushed before each call (median of rounds). With ``--sweep``
the kernel is also timed at each KV split count (1 to 64, splits of at least 64 positions) and, at the best
count, with 32/64/128 positions a step and 2/4/8 warps, at the highest sparsity; the best setting is then timed
at every sparsity. Results: ``attention_matrix.md`` / ``.json`` in ``--out``.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).resolve().parents[i] / p) for i, p in ((0, ""), (1, "plugins/wide"), (1, ""))]
import benchmark_report as report  # noqa: E402  (beside this script)

from compresskit.runtime.blocks import Step, attend  # noqa: E402
from compresskit_wide.kernels import policy  # noqa: E402
from compresskit_wide.kernels.attention_decode import (  # noqa: E402
    torch_routed_attention_decode,
    triton_routed_attention_decode,
)
from compresskit_wide.kernels.common import zero_inactive_groups  # noqa: E402

# (query heads, KV heads, head dim, groups): a group is the query heads of one KV head
SHAPES = {"llama-3.1-8b": (32, 8, 128, 8), "smollm2-135m": (9, 3, 64, 3)}


def exact_mask(batch: int, groups: int, sparsity: float, gen: torch.Generator, device) -> torch.Tensor:
    """Each sequence keeps exactly ``round((1 - sparsity) * groups)`` groups, at random."""
    keep = round(groups * (1 - sparsity))
    idx = torch.rand(batch, groups, generator=gen).topk(keep, dim=1).indices
    return torch.zeros(batch, groups, dtype=torch.bool).scatter_(1, idx, True).to(device)


def dense_attention(q, keys, values, step, scale):
    """The runtime's decode attention, one token a sequence: ``q: [B, H, D]`` -> ``[B, H, D]``."""
    return attend(q[:, :, None], keys, values, step, scale)[:, :, 0]


def timer(cuda: bool):
    if not cuda:
        return None
    from compresskit_wide.kernels.autotune import flushed_graph_bench

    return lambda fn: flushed_graph_bench(fn, reps=10, rounds=7) * 1e3  # us


def split_counts(context: int) -> list[int]:
    return [s for s in (1, 2, 4, 8, 16, 32, 64) if context // s >= 64]


def run_cell(batch, context, sparsities, sweep, device, dtype, bench, gen, shape=SHAPES["llama-3.1-8b"]) -> dict:
    heads, kv_heads, head_dim, groups = shape
    scale = head_dim**-0.5
    q = torch.randn(batch, heads, head_dim, device=device, dtype=dtype)
    keys = torch.randn(batch, kv_heads, context, head_dim, device=device, dtype=dtype)
    values = torch.randn(batch, kv_heads, context, head_dim, device=device, dtype=dtype)
    lens = torch.full((batch,), context, dtype=torch.int32, device=device)
    allowed = torch.ones(batch, 1, 1, context, dtype=torch.bool, device=device)
    step = Step(None, None, None, allowed, None, False)
    masks = {s: exact_mask(batch, groups, s, gen, device) for s in sparsities}
    cuda = device.type == "cuda"
    if cuda:
        torch._dynamo.reset()  # one compiled graph per shape, as the runtime's (dynamic=False)
        dense = torch.compile(dense_attention, dynamic=False, fullgraph=True)
    else:
        dense = dense_attention
    base = dense(q, keys, values, step, scale).float()
    row = {"batch": batch, "context": context, "correct": True, "max_abs_err": 0.0}
    for mask in masks.values():
        want = zero_inactive_groups(base.reshape(batch, -1), mask).view_as(base)
        if batch * context <= 4096:  # the fp32 reference too, where it is small
            ref = torch_routed_attention_decode(q, keys, values, lens, mask).float()
            row["max_abs_err"] = max(row["max_abs_err"], (ref - want).abs().max().item())
        got = triton_routed_attention_decode(q, keys, values, lens, mask).float()
        err = (got - want).abs().max().item()
        row["max_abs_err"] = max(row["max_abs_err"], err)
        row["correct"] &= err <= (3e-2 if cuda else 1e-4)
    if bench is None or not row["correct"]:
        return row
    row["dense_us"] = bench(lambda: dense(q, keys, values, step, scale))
    default = {
        "splits": policy.attention_decode_splits(context, batch, kv_heads),
        "block_n": policy.ATTN_DECODE_BLOCK,
        "warps": policy.ATTN_DECODE_WARPS,
    }

    def kernel_us(setting: dict, s: float) -> float:
        return bench(lambda: triton_routed_attention_decode(q, keys, values, lens, masks[s], **setting))

    row["default"] = {**default, **{f"s{s:g}": kernel_us(default, s) for s in sparsities}}
    if sweep:
        top = max(sparsities)
        tried = {}
        for splits in split_counts(context):
            setting = {"splits": splits, "block_n": 64, "warps": 4}
            tried[(splits, 64, 4)] = kernel_us(setting, top)
        splits = min(tried, key=tried.get)[0]
        for block_n in (32, 64, 128):
            for warps in (2, 4, 8):
                if (splits, block_n, warps) not in tried and context // splits >= block_n:
                    tried[(splits, block_n, warps)] = kernel_us(
                        {"splits": splits, "block_n": block_n, "warps": warps}, top
                    )
        best = min(tried, key=tried.get)
        setting = dict(zip(("splits", "block_n", "warps"), best, strict=True))
        row["best"] = {**setting, **{f"s{s:g}": kernel_us(setting, s) for s in sparsities}}
        row["tried"] = [{"splits": k[0], "block_n": k[1], "warps": k[2], "us": v} for k, v in tried.items()]
    return row


def table(rows: list[dict], sparsities: list[float], which: str) -> list[str]:
    head = " | ".join(f"s={s:g} us | x dense" for s in sparsities)
    lines = [
        f"| batch | context | dense us | splits | block | warps | {head} |",
        "|---|---|---|---|---|---|" + "---|---|" * len(sparsities),
    ]
    for r in rows:
        if which not in r:
            continue
        k = r[which]
        cells = " | ".join(f"{k[f's{s:g}']:.1f} | {r['dense_us'] / k[f's{s:g}']:.2f}x" for s in sparsities)
        lines.append(
            f"| {r['batch']} | {r['context']} | {r['dense_us']:.1f} | {k['splits']} | {k['block_n']} | {k['warps']} "
            f"| {cells} |"
        )
    return lines


def write(out: str, rows: list[dict], sparsities: list[float], sweep: bool, shape=SHAPES["llama-3.1-8b"]) -> str:
    heads, kv_heads, head_dim, groups = shape
    lines = ["## The shipped launch settings (policy.py)", "", *table(rows, sparsities, "default")]
    if sweep:
        lines += ["", "## The best launch settings of the sweep", "", *table(rows, sparsities, "best")]
    facts = report.run_facts(
        True,
        shape=f"{heads} query heads, {kv_heads} KV heads of {head_dim}, {groups} groups of {heads // groups} heads, "
        "bf16; "
        "one layer's decode attention a call, the cache full",
    )
    title = "Routed decode attention over batch x context"
    return report.write(out, "attention_matrix", title, facts, lines, {"sparsities": sparsities, "rows": rows})


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU (interpreter): correctness only")
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--batches", type=report.int_list, default=[1, 2, 4, 8, 16, 32, 64])
    parser.add_argument("--contexts", type=report.int_list, default=[512, 2048, 8192, 16384, 32768])
    parser.add_argument("--sparsities", default="0,0.25,0.5", help="fractions of each sequence's groups skipped")
    parser.add_argument("--sweep", action="store_true", help="also sweep the kernel's launch settings per cell")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="llama-3.1-8b", help="the model's attention shapes")
    args = parser.parse_args()
    shape = SHAPES[args.shape]
    where = report.gpu_or_smoke(args.smoke)
    if where is None:
        return 2
    device, dtype = where
    cuda = device.type == "cuda"
    sparsities = [float(v) for v in args.sparsities.split(",") if v]
    if args.smoke:
        args.batches, args.contexts = [1, 3], [40, 200]
    bench = timer(cuda)
    gen = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    rows = []
    for context in args.contexts:
        for batch in args.batches:
            row = run_cell(batch, context, sparsities, args.sweep, device, dtype, bench, gen, shape)
            if cuda:
                torch.cuda.empty_cache()  # the cell's cache, before the next one's
            rows.append(row)
            state = "correct" if row["correct"] else f"MISMATCH (max abs error {row['max_abs_err']:.3g})"
            timing = ""
            if "default" in row:
                timing = ", ".join(f"s={s:g} {row['dense_us'] / row['default'][f's{s:g}']:.2f}x" for s in sparsities)
                if "best" in row:
                    best = row["best"]
                    timing += f"; best {best['splits']}/{best['block_n']}/{best['warps']}: " + ", ".join(
                        f"{row['dense_us'] / best[f's{s:g}']:.2f}x" for s in sparsities
                    )
            print(f"batch {batch} context {context}: {state} {timing}", flush=True)
            if cuda:  # written after every cell: a run stopped early keeps what it measured
                write(args.out, rows, sparsities, args.sweep, shape)
    if not all(r["correct"] for r in rows):
        print("MISMATCH: see above")
        return 1
    if not cuda:
        print("smoke: the routed decode attention matches the runtime's attention in every cell")
        return 0
    print(write(args.out, rows, sparsities, args.sweep, shape))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
