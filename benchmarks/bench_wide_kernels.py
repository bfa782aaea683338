"""Benchmark of WIDE's Triton kernels against the strongest dense baselines, in one run.

    python benchmarks/bench_wide_kernels.py --out DIR          # on the H200 (Llama-3.1-8B shapes)
    python benchmarks/bench_wide_kernels.py --smoke --out DIR  # tiny shapes; on the CPU under TRITON_INTERPRET=1

Each case first checks the kernel against its PyTorch reference, then times kernel and baselines
side by side: ``triton.testing.do_bench`` medians (it flushes the L2 cache between runs), and on a
GPU, CUDA-graph replays and the GPU time (the sum of the kernels' durations per call, read by
torch.profiler with the L2 flushed before each call: what the GPU spends, without the host's
launch cost that the flushed do_bench medians include at decode sizes), with the per-kernel
profile of our call (where its time goes: prep, main kernel, split sum). Masks at 50% sparsity,
exactly-k per token and i.i.d.; for the prefill kernels also every group on ("all": the kernel's
own efficiency against the dense product at equal work). Speedups are against the fastest dense baseline; "bound" is
1 / (1 - s) (or 1 / union for decode batches, the fraction of groups some token needs) and "of
bound" is speedup / bound. Results: a table on stdout and ``bench.json`` / ``bench.md`` in --out,
with GPU, driver, versions and date.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import statistics
import sys
import time
import warnings
import zlib
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path[:0] = [str(Path(__file__).resolve().parents[1] / p) for p in ("plugins/wide", ".")]

from compresskit_wide.kernels.attention_decode import (  # noqa: E402
    torch_routed_attention_decode,
    triton_routed_attention_decode,
)
from compresskit_wide.kernels.attention_prefill import (  # noqa: E402
    torch_routed_attention_prefill,
    triton_routed_attention_prefill,
)
from compresskit_wide.kernels.autotune import l2_flush_buffer  # noqa: E402
from compresskit_wide.kernels.common import zero_inactive_groups  # noqa: E402
from compresskit_wide.kernels.gemm_out import torch_masked_out_gemm, triton_masked_out_gemm  # noqa: E402
from compresskit_wide.kernels.gemm_reduce import (  # noqa: E402
    dense_masked_reduce_gemm,
    torch_masked_reduce_gemm,
    triton_masked_reduce_gemm,
)
from compresskit_wide.kernels.policy import DECODE_MAX_M  # noqa: E402

CUDA = torch.cuda.is_available()


def timed(fn, graph: bool = False) -> float:
    """Median milliseconds of ``fn``."""
    if CUDA:
        import triton.testing

        if graph:
            return triton.testing.do_bench_cudagraph(fn, return_mode="median")
        return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def gpu_time(fn, iters: int = 30) -> tuple[float, dict]:
    """Host-independent GPU time of ``fn`` with the L2 flushed before each call: the sum of the
    durations of the CUDA kernels it launches (CUPTI through torch.profiler; launch gaps and host
    cost excluded: the "kernel only" figure). Returns (median ms per call, {kernel: mean us per
    call}), the second being the profile that says where a call's time goes."""
    return gpu_times({"call": fn}, iters)["call"]


def gpu_times(calls: dict, iters: int = 30) -> dict[str, tuple[float, dict]]:
    """``gpu_time`` of several calls measured side by side: each of the ``iters`` rounds runs every call once (the L2
    flushed before each), starting one call further along the list each round, so that no call always runs first or
    after the same neighbour and a drift of the GPU's clock over the run falls on all of them alike. Returns
    {label: (median ms per call, {kernel: mean us per call})}."""
    from torch.profiler import ProfilerActivity, profile

    labels = list(calls)
    buf = l2_flush_buffer()  # flushed by a bitwise-not, the kernel recognised below
    for fn in calls.values():  # compiled and autotuned before the profile
        fn()
    torch.cuda.synchronize()
    order: list[str] = []
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for i in range(iters):
            for label in labels[i % len(labels) :] + labels[: i % len(labels)]:
                order.append(label)
                buf.bitwise_not_()
                calls[label]()
        torch.cuda.synchronize()
    kernels = sorted(
        (e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA and e.time_range.elapsed_us() > 0),
        key=lambda e: e.time_range.start,
    )
    return calls_of_profile(order, [(e.name, e.time_range.elapsed_us()) for e in kernels])


def calls_of_profile(order: list[str], kernels: list[tuple[str, float]]) -> dict[str, tuple[float, dict]]:
    """The calls' GPU times from a profile: ``kernels`` (name, us) in the order they ran, each call of ``order`` after
    its flush. Returns {label: (median ms, {kernel: mean us per call})}; NaN for every label where the flushes do not
    match the calls."""
    spans: list[tuple[float, dict]] = []  # each call's GPU time and its kernels, in the order they ran
    for kernel, us in kernels:
        # the flush: the one bitwise-not long enough to have swept 256 MiB (a call of ours may
        # itself invert a small mask, which must not be taken for a flush)
        if "bitwise_not" in kernel and us > 20:
            spans.append((0.0, {}))
            continue
        if not spans:  # before the first flush (none expected)
            continue
        name = re.sub(r"\(.*", "", kernel)[:60]
        total, parts = spans[-1]
        parts[name] = parts.get(name, 0.0) + us
        spans[-1] = (total + us, parts)
    labels = list(dict.fromkeys(order))
    if len(spans) != len(order):  # the calls could not be told apart: no number rather than a wrong one
        return {label: (float("nan"), {}) for label in labels}
    out = {}
    for label in labels:
        mine = [span for who, span in zip(order, spans, strict=True) if who == label]
        per_kernel: dict[str, float] = {}
        for _, parts in mine:
            for k, v in parts.items():
                per_kernel[k] = per_kernel.get(k, 0.0) + v
        median = statistics.median(total for total, _ in mine) / 1e3
        out[label] = (median, {k: round(v / len(mine), 2) for k, v in per_kernel.items()})
    return out


def seed_case(label: str, gen: torch.Generator) -> None:
    """Seed the mask generator ``gen`` and torch's own generator (the inputs) from the case's label:
    a case draws the same masks and inputs whether it runs alone (``--only``) or among others."""
    seed = zlib.crc32(label.encode())
    gen.manual_seed(seed)
    torch.manual_seed(seed)


def make_mask(m: int, groups: int, sparsity: float, kind: str, gen: torch.Generator, device) -> torch.Tensor:
    if kind == "all":  # every group on: a kernel's own efficiency against the dense product (bound 1)
        return torch.ones(m, groups, dtype=torch.bool, device=device)
    if kind == "exact":  # every token keeps exactly (1 - s) of the groups
        keep = round(groups * (1 - sparsity))
        scores = torch.rand(m, groups, generator=gen)
        idx = scores.topk(keep, dim=1).indices
        mask = torch.zeros(m, groups, dtype=torch.bool).scatter_(1, idx, True)
    else:
        mask = torch.rand(m, groups, generator=gen) >= sparsity
    return mask.to(device)


def bound(mask: torch.Tensor, decode: bool) -> float:
    """Theoretical speedup: work scales with the active fraction (per token), or for decode with
    the union of groups any token needs (the weight bytes read)."""
    frac = mask.any(0).float().mean().item() if decode else mask.float().mean().item()
    return float("inf") if frac == 0 else 1.0 / frac


def case_gate_up(m, d, ffn, group, mask_kind, dtype, device, gen, results):
    x = torch.randn(m, d, device=device, dtype=dtype)
    wg = torch.randn(ffn, d, device=device, dtype=dtype) / d**0.5
    wu = torch.randn(ffn, d, device=device, dtype=dtype) / d**0.5
    w_cat = torch.cat([wg, wu])  # cuBLAS baseline: gate and up as one GEMM of N = 2 * ffn
    mask = make_mask(m, ffn // group, 0.5, mask_kind, gen, device)
    got = triton_masked_out_gemm(x, wg, mask, wu)
    ref = torch_masked_out_gemm(x, wg, mask, wu)
    err = (got.float() - ref.float()).abs().max().item()
    ok = torch.allclose(got.float(), ref.float(), rtol=3e-2, atol=3e-2)
    decode = m <= DECODE_MAX_M

    def ours():  # decode reads the mask itself; prefill includes the routing-layout prep
        return triton_masked_out_gemm(x, wg, mask, wu)

    def dense_gemm():
        return x @ w_cat.T

    def dense_swiglu():
        y = x @ w_cat.T
        return F.silu(y[:, :ffn]) * y[:, ffn:]

    def naive():  # gather the needed weight rows, compute, scatter
        cols = mask.any(0).repeat_interleave(group).nonzero().squeeze(1)
        h = F.silu(x @ wg[cols].T) * (x @ wu[cols].T)
        out = torch.zeros(m, ffn, device=device, dtype=dtype)
        out[:, cols] = h
        return out * mask.repeat_interleave(group, dim=1)

    add_row(
        results,
        "gate+up fused",
        m,
        mask_kind,
        mask,
        ours,
        {"cuBLAS gate+up": dense_gemm, "cuBLAS + SiLU*mul": dense_swiglu, "naive gather": naive},
        ok,
        err,
        decode,
    )
    if not decode:
        note_prefill_tiles(results[-1])


def note_prefill_tiles(row: dict, tuned=None) -> None:
    """Record (and print) the tiles the autotuner chose for the last call of ``tuned`` (default:
    the prefill gate+up kernel)."""
    from compresskit_wide.kernels import gemm_out

    tuned = tuned if tuned is not None else gemm_out._tuned_prefill
    best = getattr(tuned, "best_config", None) if CUDA else None
    if best is not None:
        row["tiles"] = f"{best.kwargs} warps={best.num_warps} stages={best.num_stages}"
        print(f"  tiles: {row['tiles']}", flush=True)


def case_down(m, d, ffn, group, mask_kind, dtype, device, gen, results):
    h = torch.randn(m, ffn, device=device, dtype=dtype)
    wd = torch.randn(d, ffn, device=device, dtype=dtype) / ffn**0.5
    mask = make_mask(m, ffn // group, 0.5, mask_kind, gen, device)
    decode = m <= DECODE_MAX_M
    got = triton_masked_reduce_gemm(h, wd, mask) if decode else dense_masked_reduce_gemm(h, wd, mask)
    ref = torch_masked_reduce_gemm(h, wd, mask)
    err = (got.float() - ref.float()).abs().max().item()
    ok = torch.allclose(got.float(), ref.float(), rtol=3e-2, atol=3e-2)

    def ours():  # decode: the kernel with its defaults; prefill: the masked dense product
        if decode:
            return triton_masked_reduce_gemm(h, wd, mask)
        return dense_masked_reduce_gemm(h, wd, mask)

    def dense():
        return h @ wd.T

    op = "down (incl. prep)" if decode else "down (masked dense)"
    add_row(results, op, m, mask_kind, mask, ours, {"cuBLAS down": dense}, ok, err, decode)


def case_handoff(m, n, k, groups, rank, next_groups, mask_kind, dtype, device, gen, results, label):
    """A reduction at decode (``label``: down or o) and the next router's decision, as a block hands
    them on: the kernel writing the next router's shares, then the decision's launch alone, against
    the kernel, the residual add and the two-launch router (what runs without the handoff), and
    against cuBLAS's product, the add and the two-launch router (what runs where ``auto`` takes the
    dense product: the input arrives zero-filled, after the SwiGLU kernel or the routed attention)."""
    from compresskit_wide.kernels.router import triton_router_decide, triton_router_decide_from_shares

    h = torch.randn(m, k, device=device, dtype=dtype)
    w = torch.randn(n, k, device=device, dtype=dtype) / k**0.5
    residual = torch.randn(m, n, device=device, dtype=dtype)
    mask = make_mask(m, groups, 0.5, mask_kind, gen, device)
    r = (torch.randn(rank, n, device=device) / n**0.5, torch.zeros(rank, device=device))
    r += (torch.randn(2 * next_groups, rank, device=device) / rank**0.5, torch.zeros(2 * next_groups, device=device))

    def ours():
        out, shares = triton_masked_reduce_gemm(h, w, mask, residual=residual, share_w=r[0])
        return out, triton_router_decide_from_shares(shares, *r[1:], as_bool=True)

    def separate():
        out = triton_masked_reduce_gemm(h, w, mask)
        return out, triton_router_decide(residual + out, *r, as_bool=True)

    def dense():
        out = h @ w.T
        return out, triton_router_decide(residual + out, *r, as_bool=True)

    (got_out, got), (ref_out, ref) = ours(), separate()
    flips = (got != ref).float().mean().item()  # fp32 near-ties decided by another summation order
    # (two launches of one kernel may take other tiles, whose sums round differently: close, not bit-equal)
    ok = torch.allclose(got_out.float(), ref_out.float(), rtol=3e-2, atol=3e-2) and flips <= 1e-3
    add_row(
        results,
        f"{label} + next router",
        m,
        mask_kind,
        mask,
        ours,
        {"kernel, add, router": separate, "cuBLAS, add, router": dense},
        ok,
        flips,
        True,
    )


def case_ffn(m, d, ffn, group, mask_kind, dtype, device, gen, results):
    """The whole SwiGLU block as the wide-triton executor runs it: the dispatch with
    backend="auto" (gate+up with the fused SwiGLU; down by the measured policy, on the zero-filled h)."""
    from compresskit_wide.kernels import ops as kernels

    x = torch.randn(m, d, device=device, dtype=dtype)
    wg = torch.randn(ffn, d, device=device, dtype=dtype) / d**0.5
    wu = torch.randn(ffn, d, device=device, dtype=dtype) / d**0.5
    wd = torch.randn(d, ffn, device=device, dtype=dtype) / ffn**0.5
    w_cat = torch.cat([wg, wu])
    mask = make_mask(m, ffn // group, 0.5, mask_kind, gen, device)
    decode = m <= DECODE_MAX_M
    backend = "auto" if CUDA else "triton"

    def ours():
        h = kernels.masked_out_gemm(x, wg, mask, w_up=wu, backend=backend)
        return kernels.masked_reduce_gemm(h, wd, mask, input_is_masked=True, backend=backend)

    def dense():
        y = x @ w_cat.T
        return (F.silu(y[:, :ffn]) * y[:, ffn:]) @ wd.T

    got = ours()
    ref = torch_masked_reduce_gemm(torch_masked_out_gemm(x, wg, mask, wu), wd, mask)
    err = (got.float() - ref.float()).abs().max().item()
    ok = torch.allclose(got.float(), ref.float(), rtol=3e-2, atol=3e-2)
    add_row(results, "FFN block (auto)", m, mask_kind, mask, ours, {"cuBLAS FFN": dense}, ok, err, decode)


def case_o(m, d, heads, head_dim, attn_group, mask_kind, dtype, device, gen, results):
    """o_proj at decode: the reduction over the attention's head groups (attn_group x head_dim inputs
    a group: 512 at Llama-3.1-8B shapes, against down's 128) as the wide-triton executor runs it
    (the dispatch with backend="auto", on an input not zero-filled yet, as after a dense attention,
    and on one the routed attention has zero-filled), beside the kernel with its group list (its
    default for 8 groups is "direct") and cuBLAS's plain product."""
    from compresskit_wide.kernels import ops as kernels

    k = heads * head_dim
    h = torch.randn(m, k, device=device, dtype=dtype)
    wo = torch.randn(d, k, device=device, dtype=dtype) / k**0.5
    groups = heads // attn_group
    mask = make_mask(m, groups, 0.5, mask_kind, gen, device)
    ref = torch_masked_reduce_gemm(h, wo, mask)
    backend = "auto" if CUDA else "triton"

    def dense():
        return h @ wo.T

    hz = zero_inactive_groups(h, mask)  # as the routed attention leaves it: the skipped heads are zero
    variants = (
        ("o (auto)", lambda: kernels.masked_reduce_gemm(h, wo, mask, backend=backend)),
        (
            "o (auto), zero-filled input",
            lambda: kernels.masked_reduce_gemm(hz, wo, mask, input_is_masked=True, backend=backend),
        ),
        ("o kernel, group list", lambda: triton_masked_reduce_gemm(h, wo, mask, direct=False)),
    )
    for op, ours in variants:
        got = ours()
        err = (got.float() - ref.float()).abs().max().item()
        ok = torch.allclose(got.float(), ref.float(), rtol=3e-2, atol=3e-2)
        add_row(results, op, m, mask_kind, mask, ours, {"cuBLAS o": dense}, ok, err, True)


def case_q(m, d, heads, head_dim, attn_group, mask_kind, dtype, device, gen, results):
    x = torch.randn(m, d, device=device, dtype=dtype)
    wq = torch.randn(heads * head_dim, d, device=device, dtype=dtype) / d**0.5
    mask = make_mask(m, heads // attn_group, 0.5, mask_kind, gen, device)
    if CUDA and m > DECODE_MAX_M:  # tiles and launch order tuned for this row's mask, not an earlier row's
        from compresskit_wide.kernels import gemm_out

        gemm_out._tuned_prefill.cache.clear()
    got = triton_masked_out_gemm(x, wq, mask)
    ref = torch_masked_out_gemm(x, wq, mask)
    err = (got.float() - ref.float()).abs().max().item()
    ok = torch.allclose(got.float(), ref.float(), rtol=3e-2, atol=3e-2)

    decode = m <= DECODE_MAX_M

    def ours():  # decode reads the mask itself; prefill includes the routing-layout prep
        return triton_masked_out_gemm(x, wq, mask)

    def dense():
        return x @ wq.T

    add_row(results, "q", m, mask_kind, mask, ours, {"cuBLAS q": dense}, ok, err, decode)
    if not decode:
        note_prefill_tiles(results[-1])


def case_qkv(m, d, heads, kv_heads, head_dim, attn_group, mask_kind, dtype, device, gen, results):
    """q, k and v stacked, k and v as the product's dense rows (``dense_rows``: one launch), against
    cuBLAS over the whole stack and against what runs without it: the q kernel, then cuBLAS k and v."""
    q_rows, kv_rows = heads * head_dim, 2 * kv_heads * head_dim
    x = torch.randn(m, d, device=device, dtype=dtype)
    w = torch.randn(q_rows + kv_rows, d, device=device, dtype=dtype) / d**0.5
    wq, wkv = w[:q_rows], w[q_rows:]
    mask = make_mask(m, heads // attn_group, 0.5, mask_kind, gen, device)
    got = triton_masked_out_gemm(x, w, mask, dense_rows=kv_rows)
    ref = torch_masked_out_gemm(x, w, mask, None, kv_rows)
    err = (got.float() - ref.float()).abs().max().item()
    ok = torch.allclose(got.float(), ref.float(), rtol=3e-2, atol=3e-2)
    decode = m <= DECODE_MAX_M

    def ours():
        return triton_masked_out_gemm(x, w, mask, dense_rows=kv_rows)

    def q_then_kv():
        return triton_masked_out_gemm(x, wq, mask), x @ wkv.T

    # the bound counts the dense rows as groups that always run
    whole = torch.cat([mask, torch.ones(m, kv_rows * mask.shape[1] // q_rows, dtype=mask.dtype, device=device)], 1)
    baselines = {"cuBLAS qkv": lambda: x @ w.T, "q kernel + cuBLAS kv": q_then_kv}
    add_row(results, "q+k+v, k and v dense rows", m, mask_kind, whole, ours, baselines, ok, err, decode)


def case_router(
    m, d, groups, rank, dtype, device, gen, results, split=None, block_g=None, block_m=None, block_k=None, finish=None
):
    """The routing decision of one sublayer: the fused kernels against the reference (the router
    module's two products and the comparison); ``split``, ``block_g``, ``block_m``, ``block_k`` and
    ``finish`` other than their defaults for the sweep rows."""
    from compresskit_wide.kernels.router import torch_router_decide, triton_router_decide

    x = torch.randn(m, d, device=device, dtype=dtype)
    w = (torch.randn(rank, d, device=device) / d**0.5, torch.zeros(rank, device=device))
    w += (torch.randn(2 * groups, rank, device=device) / rank**0.5, torch.zeros(2 * groups, device=device))
    tiles = {"split": split, "block_g": block_g, "block_m": block_m, "block_k": block_k, "finish": finish}
    tiles = {k: v for k, v in tiles.items() if v is not None}
    got, ref = triton_router_decide(x, *w, **tiles), torch_router_decide(x, *w)
    flips = (got != ref).float().mean().item()  # fp32 ties decided by summation order: ~never
    add_row(
        results,
        f"router G={groups}" + "".join(f" {k}={v}" for k, v in tiles.items()),
        m,
        "-",
        torch.ones_like(ref, dtype=torch.bool),  # no work is skipped here: the bound is 1 (fewer launches)
        lambda: triton_router_decide(x, *w, **tiles),
        {"torch router + decide": lambda: torch_router_decide(x, *w)},
        flips <= 1e-3,
        flips,
        False,
    )


def block_start(m, d, groups, dtype, device, rank=32) -> tuple:
    """What a block's start at decode reads when the block before handed its router the shares of ``m`` tokens:
    ``(shares, b_down, route_w, route_b, x, delta, norm_w, eps)`` (a router of ``groups`` groups and ``rank``)."""
    from compresskit_wide.kernels.gemm_reduce import torch_router_shares

    x, delta = torch.randn(m, d, device=device, dtype=dtype), torch.randn(m, d, device=device, dtype=dtype) / 4
    norm_w = (1 + torch.randn(d, device=device) / 4).to(dtype)
    route = (torch.zeros(rank, device=device), torch.randn(2 * groups, rank, device=device) / rank**0.5)
    route += (torch.zeros(2 * groups, device=device),)
    shares = torch_router_shares(x + delta, torch.randn(rank, d, device=device) / d**0.5)
    return shares, *route, x, delta, norm_w, 1e-5


def case_router_out(m, d, n, groups, dense_rows, fuse, dtype, device, gen, results, label):
    """A block's start at decode from the shares the block before handed on (``label``: the model and the
    product): the router's decision, the residual add and the RMSNorm in the first product's prologue, one
    launch (``router_norm_out_gemm``), against the decision's launch with the add and the norm and then the
    product (what ``auto`` runs until ``policy`` gives the one launch a range). Counting, as the runtime's
    blocks count. The bound is 1: both skip the same groups, the one launch saves a launch and its wait."""
    from compresskit_wide.kernels.gemm_out import triton_router_norm_out_gemm
    from compresskit_wide.kernels.router import triton_router_norm_from_shares

    shares, *route, x, delta, norm_w, eps = block_start(m, d, groups, dtype, device)
    w = (torch.randn(n + dense_rows, d, device=device) / d**0.5).to(dtype)
    w_up = (torch.randn(n, d, device=device) / d**0.5).to(dtype) if fuse else None
    norm = (x, delta, norm_w, eps)
    counts = torch.zeros(2, dtype=torch.float64, device=device)

    def ours():
        return triton_router_norm_out_gemm(shares, *route, *norm, w, w_up, dense_rows=dense_rows, counts=counts)

    def separate():
        execute, x_new, h = triton_router_norm_from_shares(shares, *route, *norm, counts=counts)
        return triton_masked_out_gemm(h, w, execute, w_up, dense_rows=dense_rows), execute, x_new

    (got, execute, x_new), (ref, ref_execute, ref_x) = ours(), separate()
    flips = (execute != ref_execute).float().mean().item()  # fp32 near-ties decided by another summation order
    same = (execute == ref_execute).all(dim=-1)
    err = (got[same].float() - ref[same].float()).abs().max().item() if same.any() else 0.0
    ok = flips <= 1e-3 and torch.equal(x_new, ref_x) and err <= (0.25 if fuse else 0.1)
    add_row(
        results,
        f"{label} decided in the prologue",
        m,
        "router",
        torch.ones_like(ref_execute),
        ours,
        {"decision launch, then product": separate},
        ok,
        err,
        True,
    )


def tiles_tag(tiles: dict) -> str:
    """A case's launch settings other than their defaults, as its label's suffix (`` columns=64``)."""
    return "".join(f" {k}={v}" for k, v in tiles.items() if v is not None)


def case_router_own_shares(m, d, groups, dtype, device, gen, results, columns=None, block_m=None):
    """A block's start where no shares were handed on (``label``'s sizes; a prefill of 17-512 tokens, a decode step
    past 16, the first block): the router's first launch alone on ``x + delta`` (``router_shares``, ``columns`` a
    share and ``block_m`` tokens a program other than their defaults for the sweep), then the decision with the
    residual add and the norm (``router_norm_from_shares``), against what ran before it: the add, the two-launch
    router, the norm (eagerly here: the runtime's graph fuses the add and the norm into one kernel). Counting, as the
    runtime's blocks count. The bound is 1: the same decision, fewer launches."""
    from compresskit_wide.kernels.router import torch_rms_norm, triton_router_decide, triton_router_norm_from_shares
    from compresskit_wide.kernels.router import triton_router_shares as own_shares

    shares, *route, x, delta, norm_w, eps = block_start(m, d, groups, dtype, device)
    w_down = torch.randn(route[1].shape[1], d, device=device) / d**0.5
    counts = torch.zeros(2, dtype=torch.float64, device=device)
    tiles = {k: v for k, v in {"columns": columns, "block_m": block_m}.items() if v is not None}

    def ours():
        mine = own_shares(x, w_down, delta, **tiles)
        return triton_router_norm_from_shares(mine, *route, x, delta, norm_w, eps, counts=counts)

    def before():
        x_new = x + delta
        execute = triton_router_decide(x_new, w_down, *route, as_bool=True, counts=counts)
        return execute, x_new, torch_rms_norm(x_new, norm_w, eps)

    (execute, x_new, _), (ref_execute, ref_x, _) = ours(), before()
    flips = (execute != ref_execute).float().mean().item()  # fp32 near-ties decided by another summation order
    add_row(
        results,
        f"router own shares G={groups}" + tiles_tag(tiles),
        m,
        "router",
        torch.ones_like(ref_execute),
        ours,
        {"add, two-launch router, norm": before},
        flips <= 1e-3 and torch.equal(x_new, ref_x),
        flips,
        m <= 16,
    )


def sdpa_variants(q, k, v, causal: bool) -> dict:
    """The dense attention baselines PyTorch offers here, each with native GQA."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backends = {"math SDPA": SDPBackend.MATH}
    if CUDA:
        backends = {
            "cuDNN SDPA": SDPBackend.CUDNN_ATTENTION,
            "flash SDPA": SDPBackend.FLASH_ATTENTION,
            "efficient SDPA": SDPBackend.EFFICIENT_ATTENTION,
        }
    out = {}
    for name, backend in backends.items():

        def fn(backend=backend):
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)

        try:
            fn()
            out[name] = fn
        except RuntimeError:  # that backend does not take these shapes or dtype here
            continue
    return out


def decode_attention_inputs(batch, ctx, heads, kv_heads, head_dim, attn_group, mask_kind, dtype, device, gen):
    """A decode step's attention inputs: queries [B, Hq, D], a full KV cache [B, Hkv, ctx, D], its
    lengths, and a group mask at 50% (``mask_kind``). Returns ``(q, k, v, lens, mask)``."""
    q = torch.randn(batch, heads, head_dim, device=device, dtype=dtype)
    k = torch.randn(batch, kv_heads, ctx, head_dim, device=device, dtype=dtype)
    v = torch.randn(batch, kv_heads, ctx, head_dim, device=device, dtype=dtype)
    lens = torch.full((batch,), ctx, device=device, dtype=torch.int32)
    return q, k, v, lens, make_mask(batch, heads // attn_group, 0.5, mask_kind, gen, device)


def case_attention_decode(batch, ctx, heads, kv_heads, head_dim, attn_group, mask_kind, dtype, device, gen, results):
    q, k, v, lens, mask = decode_attention_inputs(
        batch, ctx, heads, kv_heads, head_dim, attn_group, mask_kind, dtype, device, gen
    )
    got = triton_routed_attention_decode(q, k, v, lens, mask)
    ref = torch_routed_attention_decode(q, k, v, lens, mask)
    err = (got.float() - ref.float()).abs().max().item()
    ok = torch.allclose(got.float(), ref.float(), rtol=3e-2, atol=3e-2)

    def ours():
        return triton_routed_attention_decode(q, k, v, lens, mask)  # the shipped defaults (policy.py)

    q4 = q[:, :, None, :]  # [B, Hq, 1, D]
    add_row(
        results, f"attn decode ctx={ctx}", batch, mask_kind, mask, ours, sdpa_variants(q4, k, v, False), ok, err, False
    )


def case_attention_prefill(t, heads, kv_heads, head_dim, attn_group, mask_kind, dtype, device, gen, results):
    q = torch.randn(1, heads, t, head_dim, device=device, dtype=dtype)
    k = torch.randn(1, kv_heads, t, head_dim, device=device, dtype=dtype)
    v = torch.randn(1, kv_heads, t, head_dim, device=device, dtype=dtype)
    mask = make_mask(t, heads // attn_group, 0.5, mask_kind, gen, device)[None]  # [1, T, G]
    got = triton_routed_attention_prefill(q, k, v, mask)
    ref = torch_routed_attention_prefill(q, k, v, mask)
    err = (got.float() - ref.float()).abs().max().item()
    ok = torch.allclose(got.float(), ref.float(), rtol=3e-2, atol=3e-2)

    def ours():  # including the layout
        return triton_routed_attention_prefill(q, k, v, mask)

    from compresskit_wide.kernels import attention_prefill

    baselines = sdpa_variants(q, k, v, True)
    add_row(results, "attn prefill causal", t, mask_kind, mask[0], ours, baselines, ok, err, False)
    note_prefill_tiles(results[-1], attention_prefill._tuned)


def add_row(results, op, m, mask_kind, mask, ours, baselines, ok, err, decode):
    t_ours = timed(ours)
    t_base = {name: timed(fn) for name, fn in baselines.items()}
    best_name = min(t_base, key=t_base.get)
    row = {
        "op": op,
        "M": m,
        "mask": mask_kind,
        "correct": bool(ok),
        "max_abs_err": err,
        "ours_ms": t_ours,
        "baselines_ms": t_base,
        "best_baseline": best_name,
        "speedup": t_base[best_name] / t_ours,
        "bound": bound(mask, decode),
    }
    row["of_bound"] = row["speedup"] / row["bound"]
    if CUDA:
        g_ours, row["profile"] = gpu_time(ours)
        g_base = {name: gpu_time(fn)[0] for name, fn in baselines.items()}
        row["gpu_ms"] = {"ours": g_ours, **g_base}
        row["gpu_best_baseline"] = min(g_base, key=g_base.get)
        row["gpu_speedup"] = g_base[row["gpu_best_baseline"]] / g_ours
        try:  # every kernel is meant to be capturable: a failure here is a finding, not a crash
            row["graph_ms"] = {"ours": timed(ours, graph=True), best_name: timed(baselines[best_name], graph=True)}
            row["graph_speedup"] = row["graph_ms"][best_name] / row["graph_ms"]["ours"]
        except Exception as exc:
            row["graph_error"] = f"{type(exc).__name__}: {exc}"[:500]
            print(f"  CUDA graph capture failed: {row['graph_error']}", flush=True)
    results.append(row)
    print(
        f"{op:18s} M={m:5d} {mask_kind:5s} ok={ok!s:5s} ours {t_ours:8.4f} ms | best {best_name} "
        f"{t_base[best_name]:8.4f} ms | speedup {row['speedup']:5.2f}x of bound {row['of_bound']:5.2f}"
        + (f" | graph {row.get('graph_speedup', float('nan')):5.2f}x | gpu {row['gpu_speedup']:5.2f}x" if CUDA else ""),
        flush=True,
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--smoke", action="store_true", help="tiny shapes (CPU interpreter)")
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--only", default="", help="run only the cases whose label matches this regex")
    args = parser.parse_args()
    warnings.filterwarnings("ignore", message=".*(kernel not used|runtime disabled|same num_heads).*")
    if not CUDA and not args.smoke:
        print("no CUDA device: use --smoke (tiny shapes under TRITON_INTERPRET=1)")
        return 2
    device = "cuda" if CUDA else "cpu"
    dtype = torch.bfloat16 if CUDA else torch.float32
    if args.smoke:
        d, ffn, group, heads, head_dim, attn_group = 64, 256, 32, 8, 8, 2
        decode_m, prefill_m = [1, 3], [33]
    else:  # Llama-3.1-8B
        d, ffn, group, heads, head_dim, attn_group = 4096, 14336, 128, 32, 128, 4
        decode_m, prefill_m = [1, 2, 4, 8, 16], [512, 1024, 2048, 4096]
    kv_heads, contexts, batches = (2, [64], [1, 2]) if args.smoke else (8, [1024, 8192, 32768], [1, 4, 16])
    gen = torch.Generator().manual_seed(0)
    results: list[dict] = []
    cases = []  # (label, thunk): FFN and q first, the headline targets
    for m in decode_m + prefill_m:
        for kind in ("exact", "iid"):
            cases.append(
                (
                    f"gate+up M={m} {kind}",
                    lambda m=m, k=kind: case_gate_up(m, d, ffn, group, k, dtype, device, gen, results),
                )
            )
            cases.append(
                (f"down M={m} {kind}", lambda m=m, k=kind: case_down(m, d, ffn, group, k, dtype, device, gen, results))
            )
            if m <= 16:  # the reduction kernels' decode sizes: down, then o, handing on the next router's shares
                for label, k_in, g_in, g_next in (
                    ("down", ffn, ffn // group, heads // attn_group),
                    ("o", heads * head_dim, heads // attn_group, ffn // group),
                ):
                    cases.append(
                        (
                            f"{label} + next router M={m} {kind}",
                            lambda m=m, kind=kind, label=label, k_in=k_in, g_in=g_in, g_next=g_next: case_handoff(
                                m, d, k_in, g_in, 32, g_next, kind, dtype, device, gen, results, label
                            ),
                        )
                    )
            cases.append(
                (
                    f"FFN block M={m} {kind}",
                    lambda m=m, k=kind: case_ffn(m, d, ffn, group, k, dtype, device, gen, results),
                )
            )
            cases.append(
                (
                    f"q M={m} {kind}",
                    lambda m=m, k=kind: case_q(m, d, heads, head_dim, attn_group, k, dtype, device, gen, results),
                )
            )
            cases.append(
                (
                    f"qkv M={m} {kind}",
                    lambda m=m, k=kind: case_qkv(
                        m, d, heads, kv_heads, head_dim, attn_group, k, dtype, device, gen, results
                    ),
                )
            )
    # a block's start at decode: the decision, add and norm in the first product's prologue, at these shapes and
    # at SmolLM2-135M's (D 576; q of 3 groups with k and v under it, gate+up of 12 groups of 128)
    prologue_shapes = [
        ("q+kv", d, heads * head_dim, heads // attn_group, 2 * kv_heads * head_dim, False),
        ("gate+up", d, ffn, ffn // group, 0, True),
    ]
    if not args.smoke:
        prologue_shapes += [("SmolLM2 q+kv", 576, 576, 3, 384, False), ("SmolLM2 gate+up", 576, 1536, 12, 0, True)]
    for m in decode_m:
        for label, width, n, groups, dense_rows, fuse in prologue_shapes:
            cases.append(
                (
                    f"{label} decided in the prologue M={m}",
                    lambda m=m, a=(width, n, groups, dense_rows, fuse), label=label: case_router_out(
                        m, *a, dtype, device, gen, results, label
                    ),
                )
            )
    for m in prefill_m:  # every group on: what the prefill kernel costs against cuBLAS at equal work
        cases.append(
            (f"q M={m} all", lambda m=m: case_q(m, d, heads, head_dim, attn_group, "all", dtype, device, gen, results))
        )
    for m in decode_m:  # o at decode (at prefill it is the dense product, as down's)
        for kind in ("exact", "iid"):
            cases.append(
                (
                    f"o M={m} {kind}",
                    lambda m=m, k=kind: case_o(m, d, heads, head_dim, attn_group, k, dtype, device, gen, results),
                )
            )
    for m in decode_m + prefill_m:
        for groups in (ffn // group, heads // attn_group):
            cases.append(
                (
                    f"router M={m} G={groups}",
                    lambda m=m, g=groups: case_router(m, d, g, 32, dtype, device, gen, results),
                )
            )
    for m in (1, 16):  # the sweep of the decode launch shape: shares of D, groups a program
        for split in (8, 16, 32):
            for block_g in (16, 32, 128):
                cases.append(
                    (
                        f"router sweep M={m} G={ffn // group} split={split} block_g={block_g}",
                        lambda m=m, s=split, b=block_g: case_router(
                            m, d, ffn // group, 32, dtype, device, gen, results, split=s, block_g=b
                        ),
                    )
                )
    for m in prefill_m[-2:]:  # the prefill sizes: shares of D (1 = one launch)
        for split in (1, 2, 4, 8):
            cases.append(
                (
                    f"router sweep M={m} G={ffn // group} split={split}",
                    lambda m=m, s=split: case_router(m, d, ffn // group, 32, dtype, device, gen, results, split=s),
                )
            )
    for m in prefill_m[-2:]:  # the prefill sizes: tokens and columns of D a program (default split)
        for block_m in (32, 64, 128):
            for block_k in (64, 128):
                cases.append(
                    (
                        f"router sweep M={m} G={ffn // group} block_m={block_m} block_k={block_k}",
                        lambda m=m, bm=block_m, bk=block_k: case_router(
                            m, d, ffn // group, 32, dtype, device, gen, results, block_m=bm, block_k=bk
                        ),
                    )
                )
    # the deciding launch's two shapes, a program a token block or a token, from decode to prefill sizes, for FFN
    # and attention's groups (the second's G the attention router's); then, at three sizes, with D in fewer shares
    for m in [1, 3] if args.smoke else [16, 32, 64, 128, 256, 512, 1024, 2048]:
        for groups in (ffn // group, heads // attn_group):
            for finish in ("tile", "token"):
                cases.append(
                    (
                        f"router finish M={m} G={groups} finish={finish}",
                        lambda m=m, g=groups, f=finish: case_router(m, d, g, 32, dtype, device, gen, results, finish=f),
                    )
                )
    for m in [3] if args.smoke else [32, 128, 512]:
        for split in (2,) if args.smoke else (8, 16, 32):
            for finish in ("tile", "token"):
                cases.append(
                    (
                        f"router finish M={m} G={ffn // group} finish={finish} split={split}",
                        lambda m=m, s=split, f=finish: case_router(
                            m, d, ffn // group, 32, dtype, device, gen, results, split=s, finish=f
                        ),
                    )
                )
    # the token shape with more groups a program (each program reads all of its token's shares: 4 programs a
    # token at the default 32 groups and 112 groups read them 4 times) and the block shape with fewer tokens a block
    for m in [3] if args.smoke else [128, 256, 512]:
        for finish, key, values in (("token", "block_g", (64, 128)), ("tile", "block_m", (16, 32))):
            for value in values:
                cases.append(
                    (
                        f"router finish M={m} G={ffn // group} finish={finish} {key}={value}",
                        lambda m=m, f=finish, kw={key: value}: case_router(
                            m, d, ffn // group, 32, dtype, device, gen, results, finish=f, **kw
                        ),
                    )
                )
    # a block's start with no shares handed on: the router's own first launch, its share's columns and token block
    for m in [3] if args.smoke else [16, 32, 128, 512]:
        for columns, block_m in [(None, None), (64, None), (256, None), (None, 16), (None, 32)]:
            if args.smoke and (columns or 0) > d:
                continue
            tag = tiles_tag({"columns": columns, "block_m": block_m})
            cases.append(
                (
                    f"router own shares M={m} G={ffn // group}{tag}",
                    lambda m=m, c=columns, bm=block_m: case_router_own_shares(
                        m, d, ffn // group, dtype, device, gen, results, columns=c, block_m=bm
                    ),
                )
            )
    # a narrow model's prefill router (SmolLM2-135M: D = 576, 12 FFN groups of 128 channels), where the
    # token blocks are few: tokens a program, and the default shares of D against one
    narrow_d = 64 if args.smoke else 576
    for m in sorted({prefill_m[0], prefill_m[len(prefill_m) // 2]}):
        for block_m in (16, 32, 64):
            for split in (None, 1):
                cases.append(
                    (
                        f"router sweep D={narrow_d} M={m} G=12 block_m={block_m}"
                        + (f" split={split}" if split else ""),
                        lambda m=m, bm=block_m, s=split: case_router(
                            m, narrow_d, 12, 32, dtype, device, gen, results, split=s, block_m=bm
                        ),
                    )
                )
    for ctx in contexts:
        for batch in batches:
            for kind in ("exact", "iid"):
                cases.append(
                    (
                        f"attn decode ctx={ctx} B={batch} {kind}",
                        lambda c=ctx, b=batch, k=kind: case_attention_decode(
                            b, c, heads, kv_heads, head_dim, attn_group, k, dtype, device, gen, results
                        ),
                    )
                )
    for t in prefill_m:
        for kind in ("exact", "iid"):
            cases.append(
                (
                    f"attn prefill T={t} {kind}",
                    lambda t=t, k=kind: case_attention_prefill(
                        t, heads, kv_heads, head_dim, attn_group, k, dtype, device, gen, results
                    ),
                )
            )
    info = meta(dtype, d, ffn, group, heads, head_dim, attn_group)
    failures: list[dict] = []
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for label, run_case in cases:
        if args.only and not re.search(args.only, label):
            continue
        seed_case(label, gen)
        try:
            run_case()
        except Exception as exc:  # one failing case must not hide the others' numbers
            failures.append({"case": label, "error": f"{type(exc).__name__}: {exc}"[:2000]})
            print(f"FAILED {label}: {type(exc).__name__}: {str(exc)[:500]}", flush=True)
        write_results(out, info, results, failures)
    bad = [r for r in results if not r["correct"]]
    print(f"{len(results)} cases, {len(bad)} incorrect, {len(failures)} failed; written {out / 'bench.md'}")
    return 1 if bad or failures else 0


def driver_version() -> str | None:
    import subprocess

    try:
        query = ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"]
        return subprocess.run(query, capture_output=True, text=True, check=True).stdout.split("\n")[0].strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def meta(dtype, d, ffn, group, heads, head_dim, attn_group) -> dict:
    import triton

    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "gpu": torch.cuda.get_device_name(0) if CUDA else "none (CPU interpreter, timings meaningless)",
        "driver": driver_version(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "python": platform.python_version(),
        "dtype": str(dtype),
        "command": " ".join(sys.argv),
        "shapes": {
            "hidden": d,
            "ffn": ffn,
            "ffn_group": group,
            "heads": heads,
            "head_dim": head_dim,
            "attn_group": attn_group,
        },
    }


def write_results(out: Path, meta: dict, results: list[dict], failures: list[dict]) -> None:
    """bench.json / bench.md, rewritten after every case so that a run cut short keeps its numbers."""
    (out / "bench.json").write_text(json.dumps({"meta": meta, "results": results, "failures": failures}, indent=2))
    lines = [
        f"# WIDE kernels benchmark\n\n{json.dumps(meta)}\n",
        "| op | M | mask | correct | ours ms | best baseline | ms | speedup | bound | of bound | graph speedup "
        "| GPU-time speedup | ours GPU ms (profile: kernel us per call) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        base_ms = r["baselines_ms"][r["best_baseline"]]
        graph = f"{r['graph_speedup']:.2f}x" if "graph_speedup" in r else "-"
        gpu = f"{r['gpu_speedup']:.2f}x vs {r['gpu_best_baseline']}" if "gpu_speedup" in r else "-"
        prof = (
            f"{r['gpu_ms']['ours']:.4f} ({'; '.join(f'{k} {v}' for k, v in r['profile'].items())})"
            if "profile" in r
            else "-"
        )
        lines.append(
            f"| {r['op']} | {r['M']} | {r['mask']} | {r['correct']} | {r['ours_ms']:.4f} | {r['best_baseline']} | "
            f"{base_ms:.4f} | {r['speedup']:.2f}x | {r['bound']:.2f} | {r['of_bound']:.2f} | {graph} | {gpu} | {prof} |"
        )
    lines += [f"\nFAILED {f['case']}: {f['error']}" for f in failures]
    (out / "bench.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    raise SystemExit(main())
