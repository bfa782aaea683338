"""Decode attention over a static cache, as the runtime's compiled decode step runs it: which way of
writing it is fastest on the GPU. Each variant is checked against fp32 SDPA, then timed compiled
(``torch.compile``, ``dynamic=False``) in a CUDA graph with the L2 flushed before each call (median of
rounds); ratios are against the batched-matmul form.

    python benchmarks/bench_decode_attention.py --out DIR        # H200
    python benchmarks/bench_decode_attention.py --smoke          # CPU: correctness of each variant only

Variants (q: [B, H, 1, D]; cache K, V: [B, Hkv, S, D]; a bool mask of the valid slots [B, S]):
``matmul`` each KV head's query group as a batched product (``torch.matmul``), ``reduce`` the two
products written as broadcast-multiply-sum (inductor generates the reductions), ``split`` the second
product split over ``S`` in chunks (partial products summed), ``sdpa`` ``scaled_dot_product_attention``
with the mask, and ``wide-triton`` the WIDE plugin's split-KV decode kernel with every head group on
(valid length instead of a mask), as the bar a hand-written kernel sets.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path[:0] = [str(Path(__file__).resolve().parents[i] / p) for i, p in ((0, ""), (1, "plugins/wide"), (1, ""))]
import benchmark_report as report  # noqa: E402  (beside this script)


def matmul(q, keys, values, valid, scale):
    b, h, _, d = q.shape
    hkv, s = keys.shape[1], keys.shape[2]
    qg = q.reshape(b, hkv, h // hkv, d)
    scores = torch.matmul(qg, keys.transpose(-1, -2)).float() * scale
    scores = scores.masked_fill(~valid.view(b, 1, 1, s), float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(values.dtype)
    return torch.matmul(probs, values).view(b, h, 1, d)


def reduce(q, keys, values, valid, scale):
    b, h, _, d = q.shape
    hkv, s = keys.shape[1], keys.shape[2]
    qg = q.reshape(b, hkv, h // hkv, 1, d).float()
    scores = (qg * keys[:, :, None].float()).sum(-1) * scale  # [B, Hkv, A, S]
    scores = scores.masked_fill(~valid.view(b, 1, 1, s), float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    out = (probs[..., None] * values[:, :, None].float()).sum(-2)  # [B, Hkv, A, D]
    return out.to(q.dtype).view(b, h, 1, d)


def split(q, keys, values, valid, scale, chunk=256):
    b, h, _, d = q.shape
    hkv, s = keys.shape[1], keys.shape[2]
    qg = q.reshape(b, hkv, h // hkv, d)
    scores = torch.matmul(qg, keys.transpose(-1, -2)).float() * scale
    scores = scores.masked_fill(~valid.view(b, 1, 1, s), float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(values.dtype)  # [B, Hkv, A, S]
    c = s // chunk
    p = probs.view(b, hkv, -1, c, chunk).transpose(2, 3)  # [B, Hkv, C, A, chunk]
    v = values.view(b, hkv, c, chunk, d)
    return torch.matmul(p, v).float().sum(2).to(q.dtype).view(b, h, 1, d)


def sdpa(q, keys, values, valid, scale):
    b, h, _, d = q.shape
    hkv, s = keys.shape[1], keys.shape[2]
    qg = q.reshape(b, hkv, h // hkv, d)
    out = F.scaled_dot_product_attention(qg, keys, values, attn_mask=valid.view(b, 1, 1, s), scale=scale)
    return out.view(b, h, 1, d)


def wide_triton(q, keys, values, lens, groups):
    from compresskit_wide.kernels import ops  # noqa: F401

    mask = torch.ones(q.shape[0], groups, dtype=torch.bool, device=q.device)
    return torch.ops.compresskit_wide.routed_attention_decode(q[:, :, 0], keys, values, lens, mask, backend="triton")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    args = parser.parse_args()
    cuda = torch.cuda.is_available() and not args.smoke
    device, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    heads, hkv, d, groups = 32, 8, 128, 8
    cases = [(1, 1280, 1088), (1, 4352, 4160), (4, 1280, 1088), (16, 1280, 1088)] if cuda else [(2, 512, 300)]
    variants = {"matmul": matmul, "reduce": reduce, "split": split, "sdpa": sdpa}
    rows = []
    for b, s, length in cases:
        gen = torch.Generator(device=device).manual_seed(0)
        q = torch.randn(b, heads, 1, d, device=device, dtype=dtype, generator=gen)
        keys = torch.randn(b, hkv, s, d, device=device, dtype=dtype, generator=gen)
        values = torch.randn(b, hkv, s, d, device=device, dtype=dtype, generator=gen)
        valid = (torch.arange(s, device=device) < length).expand(b, s).contiguous()
        lens = torch.full((b,), length, dtype=torch.int32, device=device)
        scale = d**-0.5
        ref = F.scaled_dot_product_attention(
            q.float(), keys.float(), values.float(), attn_mask=valid.view(b, 1, 1, s), scale=scale, enable_gqa=True
        )
        fns = {}
        for name, fn in variants.items():
            fns[name] = (
                torch.compile(fn, dynamic=False, fullgraph=True) if cuda else fn,
                (q, keys, values, valid, scale),
            )
        if cuda:
            fns["wide-triton"] = (wide_triton, (q, keys, values, lens, groups))
        row = {"batch": b, "cache": s, "valid": length}
        for name, (fn, fargs) in fns.items():
            got = fn(*fargs).float().view_as(ref)
            err = (got - ref).abs().max().item()
            tol = 2e-2 if cuda else 1e-4
            if err > tol:
                print(f"MISMATCH {name} batch {b} cache {s}: max abs error {err:.3g} > {tol}")
                return 1
            if cuda:
                from compresskit_wide.kernels.autotune import flushed_graph_bench

                times = [flushed_graph_bench(lambda fn=fn, fargs=fargs: fn(*fargs), reps=20) for _ in range(3)]
                row[name] = statistics.median(times) * 1e3  # us
        rows.append(row)
        print("correct:", row if not cuda else f"batch {b} cache {s}", flush=True)
    if not cuda:
        print("smoke: every variant matches SDPA")
        return 0
    names = list(fns)
    lines = [
        "| batch | cache slots | valid | "
        + " | ".join(f"{n} us" for n in names)
        + " | "
        + " | ".join(f"{n} x matmul" for n in names[1:])
        + " |",
        "|---|---|---|" + "---|" * (2 * len(names) - 1),
    ]
    for r in rows:
        lines.append(
            f"| {r['batch']} | {r['cache']} | {r['valid']} | "
            + " | ".join(f"{r[n]:.1f}" for n in names)
            + " | "
            + " | ".join(f"{r['matmul'] / r[n]:.2f}x" for n in names[1:])
            + " |"
        )
    facts = report.run_facts(
        True, shape=f"{heads} query heads, {hkv} KV heads of {d}, bf16; one layer's attention per call"
    )
    print(report.write(args.out, "decode_attention", "Decode attention variants", facts, lines, {"rows": rows}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
