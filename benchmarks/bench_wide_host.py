"""The host's share of a WIDE prefill, measured on the CPU: a model of tiny width (so the arithmetic
is negligible; ``compresskit.testing.tiny_llama``) with many layers, its prompt's forward timed
dense, with WIDE's routers (the ``torch`` executor's reference path), and through the
``wide-triton`` executor (its ``torch`` backend: the same modules and dispatch as on a GPU, the
references doing the arithmetic), with counting on and off; the PyTorch operators each runs
per layer (each is a kernel launch or at least a dispatch on a GPU) and its Python function calls
(cProfile's count: the other half of the host's work).

    python benchmarks/bench_wide_host.py [--layers 32] [--prompt 16] [--repeats 20]

On the H200 the eager WIDE prefill is bound by the host (docs/wide-kernels-h200.md); this script
measures that host work where no GPU is needed, for comparing changes to the routed modules.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch


def median_ms(model, ids, repeats: int) -> float:
    with torch.no_grad():
        model(ids, use_cache=False)  # warm-up
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            model(ids, use_cache=False)
            times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def aten_ops(model, ids) -> int:
    from torch.profiler import ProfilerActivity, profile

    with torch.no_grad(), profile(activities=[ProfilerActivity.CPU]) as prof:
        model(ids, use_cache=False)
    return sum(a.count for a in prof.key_averages() if a.key.startswith("aten::"))


def python_calls(model, ids) -> int:
    """Python function calls (cProfile's count, builtins included) in one forward: the other half of
    the host's work, beside the operators."""
    import cProfile
    import pstats

    prof = cProfile.Profile()
    with torch.no_grad():
        prof.enable()
        model(ids, use_cache=False)
        prof.disable()
    return sum(v[1] for v in pstats.Stats(prof).stats.values())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--prompt", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    torch.set_num_threads(1)
    from compresskit import plugins
    from compresskit.interfaces import RunContext
    from compresskit.testing import tiny_llama

    model = tiny_llama(num_hidden_layers=args.layers)
    ids = torch.randint(3, model.config.vocab_size, (1, args.prompt), generator=torch.Generator().manual_seed(1))
    rows = [("dense", model)]
    wide = plugins.load("pruner", "wide")
    pruner = wide(wide.Config(target_sparsity=0.5, ffn_group_size=16, router_rank=8))
    routed = copy.deepcopy(model)  # prepare attaches the routers in place
    pruner.prepare(routed, RunContext(model_config=model.config, device=torch.device("cpu"), dtype=torch.float32))
    routed = pruner.finalize(routed)
    rows.append(("WIDE routers (torch executor)", routed))
    executor = plugins.load("executor", "wide-triton")
    for stats in (True, False):
        fast = executor(executor.Config(backend="torch", track_stats=stats)).convert(copy.deepcopy(routed))
        rows.append((f"wide-triton, torch backend, counting {'on' if stats else 'off'}", fast))
    base = None
    print(f"{args.layers} layers, {args.prompt}-token prompt, CPU, one thread")
    for name, m in rows:
        ms, ops, calls = median_ms(m, ids, args.repeats), aten_ops(m, ids), python_calls(m, ids)
        base = base or (ms, ops, calls)
        print(
            f"{name:44s} {ms:8.2f} ms ({ms / args.layers:6.3f} ms a layer) | {ops:6d} aten ops "
            f"({(ops - base[1]) / args.layers:+7.1f} a layer vs dense) | {calls:6d} Python calls "
            f"({(calls - base[2]) / args.layers:+7.1f} a layer)",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
