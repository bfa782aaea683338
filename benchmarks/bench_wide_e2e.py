"""End-to-end speed of a WIDE-pruned model against the same model dense, through transformers.

    python benchmarks/bench_wide_e2e.py --out DIR                        # on the H200: Llama-3.1-8B shapes
    python benchmarks/bench_wide_e2e.py --smoke --out DIR                # tiny shapes, CPU (TRITON_INTERPRET=1)

One model with random weights (Llama-3.1-8B's shapes, ``--layers`` of them) is timed five ways, in this
order, on the same prompt: dense; WIDE's routers attached (``torch`` executor: masked dense, the
reference path); the ``wide-triton`` executor with ``backend="auto"`` (a kernel only where it was
measured faster); with ``backend="triton"`` (the kernels everywhere); and ``auto`` with
``track_stats: false`` (serving: the realised sparsity is not counted). The routers are untrained
(random, zero bias), which skips about half of the groups per token independently: a speed test, not a
quality one; the realised sparsity is reported beside each WIDE row.

Timings: prefill = one forward of ``--batch x --prompt`` tokens (median of ``--repeats``); CUDA-graph
prefill = the same forward replayed from a captured graph (what it costs the GPU, without the host); eager
decode = ``generate`` of ``--new-tokens`` greedy tokens after that prompt (transformers' dynamic cache,
eager: at batch 1 this is bound by the host's launch cost, for dense as for WIDE), its time minus one
prefill, per new token; CUDA-graph decode = the same tokens with a static cache, each step one
captured graph replay (how serving engines decode; it shows what the GPU spends). Correctness: each
decoder layer of a converted model is run on the reference's inputs to that layer with the
reference's routing decisions imposed, and compared with the ``torch`` executor's (masked dense)
output of that layer; the free-running logits' difference is reported beside it (in bf16 a router
decision near its threshold can flip on a last-bit difference upstream, so whole-model logits of
untrained routers are not a test of the kernels). Results: a table on stdout and ``e2e.json`` /
``e2e.md`` in ``--out`` with GPU, versions, date and command.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import os
import platform
import re
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).resolve().parents[1] / p) for p in ("plugins/wide", ".")]

from compresskit.modeling import cache_kwargs  # noqa: E402
from compresskit_wide.kernels.autotune import replay_ms  # noqa: E402

CUDA = torch.cuda.is_available()
# --rows: the WIDE rows after dense; name -> (wide-triton backend, track_stats), or None for the torch executor
ROWS = {"torch": None, "auto": ("auto", True), "triton": ("triton", True), "auto-nostats": ("auto", False)}


def sync() -> None:
    if CUDA:
        torch.cuda.synchronize()


def median_seconds(fn, repeats: int) -> float:
    fn()  # warm-up: compilation, autotuning, allocator
    times = []
    for _ in range(repeats):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def build_model(args, device: torch.device, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM, LlamaConfig

    if args.smoke:
        shape = dict(hidden_size=64, intermediate_size=256, num_attention_heads=8, num_key_value_heads=2, head_dim=8)
        vocab = 512
    else:  # Llama-3.1-8B
        shape = dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8)
        vocab = 128256
    config = LlamaConfig(
        vocab_size=vocab,
        num_hidden_layers=args.layers,
        max_position_embeddings=args.prompt + args.new_tokens + 8,
        rope_theta=500000.0,
        tie_word_embeddings=False,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        **shape,
    )
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
    return model.eval()


def realised(model) -> dict:
    from compresskit.routing import measured_sparsity, routed_projections

    projs = [p for _, p in routed_projections(model)]
    rep = measured_sparsity(projs, model.config)
    for p in projs:
        p.reset_stats()
    return {"attention": round(rep.attention, 4), "ffn": round(rep.ffn, 4), "macs": round(rep.macs, 4)}


def speedups(dense: dict, row: dict) -> tuple[float, float, float, float]:
    """(prefill, graph prefill, eager decode, graph decode) speedup of ``row`` over the dense row."""
    return (
        dense["prefill_ms"] / max(row["prefill_ms"], 1e-9),
        dense["graph_prefill_ms"] / max(row["graph_prefill_ms"], 1e-9),
        dense["decode_ms_per_token"] / max(row["decode_ms_per_token"], 1e-9),
        dense["graph_decode_ms_per_token"] / max(row["graph_decode_ms_per_token"], 1e-9),
    )


def leaders(model) -> dict:
    """The routed projections that decide (have a router), by (layer, kind): the same keys before
    and after an executor's conversion (which renames modules)."""
    from compresskit.routing import routed_projections

    return {(p.layer_idx, p.kind): p for _, p in routed_projections(model) if p.router is not None}


def record_layers(model, ids) -> tuple[list, list, dict]:
    """One forward of ``model`` (no cache): each decoder layer's inputs and output, and each
    router's decision."""
    layers = model.model.layers
    inputs, outputs, decisions = [None] * len(layers), [None] * len(layers), {}
    hooks = []
    for i, layer in enumerate(layers):
        hooks.append(
            layer.register_forward_pre_hook(lambda m, a, k, i=i: inputs.__setitem__(i, (a, k)), with_kwargs=True)
        )
        hooks.append(layer.register_forward_hook(lambda m, a, o, i=i: outputs.__setitem__(i, o)))
    for key, proj in leaders(model).items():
        take = proj._take

        def recording(execute, valid, key=key, take=take):
            decisions[key] = execute
            take(execute, valid)

        proj._take = recording
    try:
        with torch.no_grad():
            model(ids, use_cache=False)
    finally:
        for h in hooks:
            h.remove()
        for proj in leaders(model).values():
            del proj._take
    return inputs, outputs, decisions


def layer_check(converted, recorded) -> tuple[bool, float]:
    """Each decoder layer of ``converted`` on the reference's inputs to that layer, with the
    reference's routing decisions imposed (so that the comparison is of the arithmetic: in bf16 a
    router decision near its threshold can flip on a last-bit difference upstream, and one flip
    changes that token's output by a whole group's contribution). Returns (every layer within
    tolerance, the largest error relative to the layer output's largest magnitude). Tolerance:
    1e-4 in fp32; 2e-2 in bf16, where the residual stream's own rounding is about 4e-3 of it:
    a wiring error (a wrong mask, group or head) moves a layer's output by far more, while the
    precision of each kernel is what tests/wide/kernels/ checks, with tight tolerances."""
    from compresskit.routing import mask_for

    inputs, outputs, decisions = recorded
    for key, proj in leaders(converted).items():
        proj.route = lambda x_raw, p=proj, e=decisions[key]: p._take(e, mask_for(x_raw))
    worst = 0.0
    try:
        with torch.no_grad():
            for layer, (a, k), ref in zip(converted.model.layers, inputs, outputs, strict=True):
                got = layer(*a, **k)
                got, ref = (got[0] if isinstance(got, tuple) else got), (ref[0] if isinstance(ref, tuple) else ref)
                rel = ((got.float() - ref.float()).abs().max() / ref.float().abs().max().clamp_min(1e-12)).item()
                worst = max(worst, rel)
    finally:
        for proj in leaders(converted).values():
            del proj.route
    return worst <= (2e-2 if CUDA else 1e-4), worst


def rewind(cache, pos: torch.Tensor, length: int) -> None:
    """Back to the prompt's end: our position and the static layers' own write counters (in
    transformers 5.x a static layer appends at its ``cumulative_length``, not at the
    ``cache_position`` it is given)."""
    pos.fill_(length)
    for layer in getattr(cache, "layers", []):
        counter = getattr(layer, "cumulative_length", None)
        if isinstance(counter, torch.Tensor):
            counter.fill_(length)


def capture(step):
    """``step`` captured in a CUDA graph after three warm-up calls on a side stream (autotuning,
    compilation and the allocator happen outside the capture)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    return graph


def graph_prefill_ms(model, ids, args) -> float:
    """The prompt's forward replayed from one captured CUDA graph (no host work but the replay): what
    prefill costs the GPU, as an engine that captures prefill per prompt-length bucket runs it; the
    eager prefill is bound by the host for WIDE (its profile). Median of ``max(--repeats, 5)``
    replays. On the CPU (smoke) one eager forward runs: nan."""
    with torch.no_grad():

        def step():
            model(ids, use_cache=False)

        if not CUDA:
            step()
            return float("nan")
        graph = capture(step)
        times = [replay_ms(graph) for _ in range(max(args.repeats, 5))]
        del graph
        return statistics.median(times)


def graph_decode_ms(model, ids, args) -> tuple[float, dict | None]:
    """Per-token time of greedy decoding as a serving engine runs it: a static KV cache and one
    captured CUDA graph per step (no host work per token but the replay), after the prompt's
    prefill. The graph advances its own position and feeds back its argmax. Median of
    ``--repeats`` runs of ``--new-tokens`` replays, and the step's kernel profile (``decode_profile``).
    On the CPU (smoke) the same steps run eagerly: (nan, None)."""
    from transformers import StaticCache

    device = ids.device
    cache = StaticCache(config=model.config, max_cache_len=args.prompt + args.new_tokens + 8)
    prompt_pos = torch.arange(args.prompt, device=device)
    kv = cache_kwargs(model, cache)  # the cache's keyword in this transformers version
    with torch.no_grad():
        logits = model(ids, **kv, cache_position=prompt_pos, use_cache=True).logits
        tok = logits[:, -1:].argmax(-1)
        pos = torch.full((1,), args.prompt, dtype=torch.long, device=device)

        def step():
            out = model(tok, **kv, cache_position=pos, use_cache=True).logits
            tok.copy_(out[:, -1:].argmax(-1))
            pos.add_(1)

        if not CUDA:
            for _ in range(args.new_tokens):
                step()
            return float("nan"), None
        graph = capture(step)
        times = []
        for _ in range(args.repeats):
            rewind(cache, pos, args.prompt)
            times.append(replay_ms(graph, args.new_tokens) / args.new_tokens)
        profile = decode_profile(graph, cache, pos, args)
    return statistics.median(times), profile


def decode_profile(graph, cache, pos, args, steps: int = 8) -> dict:
    """Where a graph-replayed decode step's GPU time goes: ``kernel_profile`` of ``steps`` replays."""
    rewind(cache, pos, args.prompt)
    return kernel_profile(graph.replay, steps)


def kernel_profile(run, steps: int) -> dict:
    """``steps`` calls of ``run`` under torch.profiler: kernels per call, their summed GPU time per
    call against the wall time per call (far apart: the host is the bottleneck), the host-blocking
    runtime calls per call (synchronisations, device-to-host copies), the 12 costliest kernels and
    the 12 host operators with the most time of their own (where a host-bound call's time goes)."""
    from torch.profiler import ProfilerActivity, profile

    sync()
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if CUDA else [])) as prof:
        start = time.perf_counter()
        for _ in range(steps):
            run()
        sync()
        wall = time.perf_counter() - start
    per_name: dict[str, list] = {}
    blocking = 0
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA and e.time_range.elapsed_us() > 0:
            name = re.sub(r"\(.*", "", e.name)[:70]
            entry = per_name.setdefault(name, [0, 0.0])
            entry[0] += 1
            entry[1] += e.time_range.elapsed_us()
        elif e.device_type == torch.autograd.DeviceType.CPU and re.search(
            r"(Stream|Device|Event)Synchronize|MemcpyDtoH|cudaMemcpy\b|aten::item|aten::_local_scalar_dense", e.name
        ):
            blocking += 1
    top = sorted(per_name.items(), key=lambda kv: -kv[1][1])[:12]
    host = sorted(prof.key_averages(), key=lambda a: -a.self_cpu_time_total)[:12]
    return {
        "kernels_per_call": round(sum(n for n, _ in per_name.values()) / steps, 1),
        "kernel_ms_per_call": round(sum(t for _, t in per_name.values()) / steps / 1e3, 3),
        "wall_ms_per_call": round(wall / steps * 1e3, 3),
        "host_blocking_calls_per_call": round(blocking / steps, 1),
        "top_kernels_us_per_call": {k: [round(n / steps, 1), round(t / steps, 1)] for k, (n, t) in top},
        "top_host_ops_self_us_per_call": {
            a.key[:70]: [round(a.count / steps, 1), round(a.self_cpu_time_total / steps, 1)] for a in host
        },
    }


def python_profile(run, steps: int, top: int = 40) -> dict:
    """``steps`` calls of ``run`` under cProfile: where the host's Python time goes (a host-bound
    eager prefill). The ``top`` functions by their own time, as ``{"file:line(function)": [calls per
    call, own us per call, cumulative us per call]}``, and the profiled wall time per call."""
    import cProfile
    import pstats

    sync()
    prof = cProfile.Profile()
    start = time.perf_counter()
    prof.enable()
    for _ in range(steps):
        run()
    sync()
    prof.disable()
    wall = time.perf_counter() - start
    stats = pstats.Stats(prof).stats  # {(file, line, name): (prim calls, calls, tottime, cumtime, callers)}
    rows = sorted(stats.items(), key=lambda kv: -kv[1][2])[:top]

    def where(key) -> str:
        file, line, func = key
        parts = Path(file).parts
        short = "/".join(parts[-2:]) if len(parts) > 1 else file
        return f"{short}:{line}({func})"[:90]

    return {
        "wall_ms_per_call": round(wall / steps * 1e3, 3),
        "python_calls_per_call": round(sum(v[1] for v in stats.values()) / steps, 1),
        "top_self_us_per_call": {
            where(k): [round(v[1] / steps, 1), round(v[2] / steps * 1e6, 1), round(v[3] / steps * 1e6, 1)]
            for k, v in rows
        },
    }


def time_model(name, model, ids, args, reference_logits, results, recorded=None):
    from compresskit.routing import routed_projections

    for _, p in routed_projections(model):
        p.reset_stats()
    with torch.no_grad():
        logits = model(ids).logits
        counting = routed_projections(model) and all(p.track_stats for _, p in routed_projections(model))
        sparsity = realised(model) if counting else None  # not counted without stats
        ok, layer_err = (True, None) if recorded is None else layer_check(model, recorded)
        err = None if reference_logits is None else (logits.float() - reference_logits.float()).abs().max().item()
        prefill = median_seconds(lambda: model(ids, use_cache=False), args.repeats)
        prefill_prof = kernel_profile(lambda: model(ids, use_cache=False), 2)
        prefill_python = python_profile(lambda: model(ids, use_cache=False), 3)

        def gen():
            model.generate(
                ids,
                max_new_tokens=args.new_tokens,
                min_new_tokens=args.new_tokens,
                do_sample=False,
                pad_token_id=0,
            )

        total = median_seconds(gen, args.repeats)
    per_token = max(total - prefill, 0.0) / max(args.new_tokens - 1, 1)
    try:
        graph_prefill, graph_prefill_error = graph_prefill_ms(model, ids, args), None
    except Exception as exc:  # as below: a prefill that cannot be captured is a finding
        graph_prefill, graph_prefill_error = float("nan"), f"{type(exc).__name__}: {exc}"[:500]
        print(f"  CUDA-graph prefill failed: {graph_prefill_error}", flush=True)
    try:
        (graph_ms, decode_prof), graph_error = graph_decode_ms(model, ids, args), None
    except Exception as exc:  # a step that cannot be captured is a finding, reported in the row
        graph_ms, decode_prof, graph_error = float("nan"), None, f"{type(exc).__name__}: {exc}"[:500]
        print(f"  CUDA-graph decode failed: {graph_error}", flush=True)
    row = {
        "model": name,
        "correct": bool(ok),
        "layer_max_rel_err_vs_masked_dense": layer_err,
        "logits_max_abs_err_vs_masked_dense_free_running": err,
        "prefill_ms": prefill * 1e3,
        "graph_prefill_ms": graph_prefill,
        "graph_prefill_error": graph_prefill_error,
        "decode_ms_per_token": per_token * 1e3,
        "graph_decode_ms_per_token": graph_ms,
        "graph_error": graph_error,
        "graph_decode_profile": decode_prof,
        "prefill_profile": prefill_prof,  # per prompt (decode: per token)
        "prefill_python_profile": prefill_python,
        "sparsity": sparsity,
    }
    results.append(row)
    x_prefill, x_graph_prefill, x_decode, x_graph = speedups(results[0], row)
    print(
        f"{name:32s} ok={ok!s:5s} prefill {row['prefill_ms']:9.2f} ms ({x_prefill:4.2f}x) "
        f"| graph prefill {graph_prefill:8.2f} ms ({x_graph_prefill:4.2f}x) "
        f"| decode {row['decode_ms_per_token']:8.2f} ms/token ({x_decode:4.2f}x)"
        f" | graph decode {graph_ms:7.3f} ms/token ({x_graph:4.2f}x)"
        + (f" | realised MACs skipped {sparsity['macs']:.3f}" if sparsity else ""),
        flush=True,
    )
    if CUDA:
        print(
            f"{'':32s} prefill profile: {prefill_prof['kernels_per_call']:.0f} kernels, GPU "
            f"{prefill_prof['kernel_ms_per_call']:.2f} ms of {prefill_prof['wall_ms_per_call']:.2f} ms wall, "
            f"{prefill_prof['host_blocking_calls_per_call']:.0f} host-blocking calls; "
            f"{prefill_python['python_calls_per_call']:.0f} Python calls, "
            f"{prefill_python['wall_ms_per_call']:.2f} ms wall under cProfile",
            flush=True,
        )
    return logits


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--smoke", action="store_true", help="tiny shapes (CPU interpreter)")
    parser.add_argument("--layers", type=int, default=None, help="decoder layers (default 32; 2 with --smoke)")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--prompt", type=int, default=None, help="prompt tokens (default 1024; 12 with --smoke)")
    parser.add_argument("--new-tokens", type=int, default=None, help="generated tokens (default 64; 3 with --smoke)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--rows",
        default=",".join(ROWS),
        help=f"the WIDE rows to time after dense, comma-separated, of: {', '.join(ROWS)} (default: all)",
    )
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    args = parser.parse_args()
    rows = [r.strip() for r in args.rows.split(",") if r.strip()]
    unknown = [r for r in rows if r not in ROWS]
    if unknown:
        parser.error(f"--rows: unknown {', '.join(unknown)}; allowed: {', '.join(ROWS)}")
    if not CUDA and not args.smoke:
        print("no CUDA device: use --smoke (tiny shapes under TRITON_INTERPRET=1)")
        return 2
    args.layers = args.layers or (2 if args.smoke else 32)
    args.prompt = args.prompt or (12 if args.smoke else 1024)
    args.new_tokens = args.new_tokens or (3 if args.smoke else 64)
    if args.smoke:
        args.repeats = 1
    device = torch.device("cuda" if CUDA else "cpu")
    dtype = torch.bfloat16 if CUDA else torch.float32

    from compresskit import plugins
    from compresskit.interfaces import RunContext

    model = build_model(args, device, dtype)
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(3, model.config.vocab_size, (args.batch, args.prompt), generator=gen).to(device)
    results: list[dict] = []
    time_model("dense", model, ids, args, None, results)

    wide = plugins.load("pruner", "wide")
    pruner = wide(wide.Config(target_sparsity=0.5))
    pruner.prepare(model, RunContext(model_config=model.config, device=device, dtype=dtype))
    model = pruner.finalize(model)
    reference = None
    if "torch" in rows:
        reference = time_model("WIDE, torch (masked dense)", model, ids, args, None, results)
    recorded = record_layers(model, ids)
    executor = plugins.load("executor", "wide-triton")
    for backend, stats in [ROWS[r] for r in rows if ROWS[r] is not None]:
        fast = executor(executor.Config(backend=backend, track_stats=stats))
        fast.check(model)
        converted = fast.convert(copy.deepcopy(model))
        name = f"WIDE, wide-triton {backend}" + ("" if stats else ", no stats")
        time_model(name, converted, ids, args, reference, results, recorded)
        del converted
    import transformers
    import triton

    meta = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "gpu": torch.cuda.get_device_name(0) if CUDA else "none (CPU interpreter, timings meaningless)",
        "torch": torch.__version__,
        "triton": triton.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "dtype": str(dtype),
        "command": " ".join(sys.argv),
        "shape": {k: getattr(model.config, k) for k in ("hidden_size", "intermediate_size", "num_attention_heads")},
        "layers": args.layers,
        "batch": args.batch,
        "prompt": args.prompt,
        "new_tokens": args.new_tokens,
        "repeats": args.repeats,
        "routers": "untrained (random init, zero bias), target 0.5",
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "e2e.json").write_text(json.dumps({"meta": meta, "results": results}, indent=2))
    dense = results[0]
    lines = [
        f"# WIDE end to end\n\n{json.dumps(meta)}\n",
        "| model | correct (layer rel. err) | prefill ms | x dense | CUDA-graph prefill ms | x dense "
        "| eager decode ms/token | x dense "
        "| CUDA-graph decode ms/token | x dense | MACs skipped |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        x_prefill, x_graph_prefill, x_decode, x_graph = speedups(dense, r)
        err = r["layer_max_rel_err_vs_masked_dense"]
        lines.append(
            f"| {r['model']} | {r['correct']}{f' ({err:.1e})' if err is not None else ''} | {r['prefill_ms']:.2f} "
            f"| {x_prefill:.2f} | {r['graph_prefill_ms']:.2f} | {x_graph_prefill:.2f} "
            f"| {r['decode_ms_per_token']:.2f} | {x_decode:.2f} "
            f"| {r['graph_decode_ms_per_token']:.3f} | {x_graph:.2f} "
            f"| {r['sparsity']['macs'] if r['sparsity'] else '-'} |"
        )
    (out / "e2e.md").write_text("\n".join(lines) + "\n")
    bad = [r for r in results if not r["correct"]]
    print(f"{len(results)} rows, {len(bad)} incorrect; written {out / 'e2e.md'}")
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
