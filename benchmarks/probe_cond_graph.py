"""Can dynamic depth skip work inside a CUDA graph? A probe of CUDA graph conditional nodes (CUDA 12.4+,
``torch.cuda.CUDAGraph.begin_capture_to_if_node``) around compiled sublayers, at batch-1 decode.

The runtime replays each decode step as one CUDA graph over compiled blocks; a graph cannot branch on a
decision, so dynamic depth's blocks compute every sublayer and zero the skipped ones' outputs (no saving).
A conditional node runs its body only when a flag in GPU memory is set at replay. This probe builds a
stack of SwiGLU MLP sublayers (one token; the residual add inside the compiled body), each with a run
flag on the GPU, and captures one graph per member:

- ``dense``: every sublayer runs;
- ``zeroed``: every sublayer runs, its output multiplied by its flag (what the depth blocks do today);
- ``if-node``: each sublayer's compiled body inside a conditional node on its flag.

It checks each member against the eager reference for two flag patterns set between replays of the same
graph (the node must read the flag at replay, not at capture), then times replays (median, L2 flushed)
at a fraction of the flags on, and prints a table. Without a GPU, or where this torch has no
conditional nodes, it says so and exits 2.

    python benchmarks/probe_cond_graph.py --out DIR                         # Llama-3.1-8B's MLP shape
    python benchmarks/probe_cond_graph.py --shape smollm2-135m --out DIR
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path[:0] = [str(Path(__file__).resolve().parent)]
import benchmark_report as report  # noqa: E402  (beside this script)

SHAPES = {"llama-3.1-8b": (4096, 14336, 32), "smollm2-135m": (576, 1536, 30)}  # (D, FFN, layers)


def sublayer(x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor) -> torch.Tensor:
    """``x + down(silu(gate(x)) * up(x))`` for ``x: [1, D]`` (the residual add inside the body)."""
    return x + F.linear(F.silu(F.linear(x, w_gate)) * F.linear(x, w_up), w_down)


def zeroed(x, w_gate, w_up, w_down, run):
    """Every sublayer computed, its output kept only where ``run`` (a 0-d float flag) is 1."""
    return x + F.linear(F.silu(F.linear(x, w_gate)) * F.linear(x, w_up), w_down) * run


def capture(step, x0: torch.Tensor, x: torch.Tensor) -> torch.cuda.CUDAGraph:
    """One graph of ``x.copy_(x0); step(x, graph)`` (``step`` warmed up first, outside the capture, with
    ``graph`` None)."""
    for _ in range(2):
        x.copy_(x0)
        step(x, None)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        x.copy_(x0)
        step(x, graph)
    return graph


def replay_ms(graph: torch.cuda.CUDAGraph, flush: torch.Tensor, reps: int = 50, rounds: int = 7) -> float:
    """Median over ``rounds`` of the mean replay time (ms) with the L2 flushed before each replay, the
    flush's own time taken off."""
    times = []
    for _ in range(rounds):
        start, mid, end = (torch.cuda.Event(enable_timing=True) for _ in range(3))
        start.record()
        for _ in range(reps):
            flush.zero_()
        mid.record()
        for _ in range(reps):
            flush.zero_()
            graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append((mid.elapsed_time(end) - start.elapsed_time(mid)) / reps)
    return statistics.median(times)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", default="llama-3.1-8b", choices=sorted(SHAPES))
    parser.add_argument("--on", type=float, default=0.5, help="fraction of the sublayers whose flag is on")
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device: this probe needs a GPU")
        return 2
    if not hasattr(torch.cuda.CUDAGraph, "begin_capture_to_if_node"):
        print(f"torch {torch.__version__} has no CUDA graph conditional nodes (begin_capture_to_if_node)")
        return 2
    d, ffn, layers = SHAPES[args.shape]
    dev, dt = torch.device("cuda"), torch.bfloat16
    gen = torch.Generator(device=dev).manual_seed(0)
    weights = [
        tuple(torch.randn(shape, device=dev, dtype=dt, generator=gen) * shape[1] ** -0.5 for shape in shapes)
        for shapes in [((ffn, d), (ffn, d), (d, ffn))] * layers
    ]
    x0 = torch.randn(1, d, device=dev, dtype=dt, generator=gen)
    flags = torch.zeros(layers, device=dev, dtype=torch.bool)  # read at replay by the if-node member
    scales = torch.zeros(layers, device=dev, dtype=dt)  # the same flags as multipliers (zeroed member)
    body = torch.compile(sublayer, fullgraph=True, dynamic=False)
    body_zeroed = torch.compile(zeroed, fullgraph=True, dynamic=False)

    def set_flags(pattern: list[bool]) -> None:
        flags.copy_(torch.tensor(pattern, device=dev))
        scales.copy_(flags.to(dt))

    def dense(x, graph):
        for w in weights:
            x.copy_(body(x, *w))

    def zeroed_step(x, graph):
        for i, w in enumerate(weights):
            x.copy_(body_zeroed(x, *w, scales[i]))

    def if_node_step(x, graph):
        for i, w in enumerate(weights):
            if graph is None:  # the warm-up, outside the capture: every body compiled and run once
                x.copy_(body(x, *w))
                continue
            graph.begin_capture_to_if_node(flags[i])
            x.copy_(body(x, *w))
            graph.end_capture_to_conditional_node()

    @torch.inference_mode()
    def reference(pattern: list[bool]) -> torch.Tensor:
        x = x0.clone()
        for on, w in zip(pattern, weights, strict=True):
            if on:
                x = sublayer(x, *w)
        return x

    on = max(1, min(layers, round(args.on * layers)))
    spread = {round(j * layers / on) for j in range(on)}  # the timed pattern: `on` flags spread evenly
    patterns = {"timed": [i in spread for i in range(layers)], "other": [i % 3 == 0 for i in range(layers)]}
    flush = torch.empty(256 * 1024 * 1024 // 4, dtype=torch.int32, device=dev)
    rows, ok = [], True
    with torch.inference_mode():
        x = torch.empty_like(x0)
        set_flags([True] * layers)
        graphs = {
            name: capture(fn, x0, x)
            for name, fn in (("dense", dense), ("zeroed", zeroed_step), ("if-node", if_node_step))
        }
        for name, graph in graphs.items():
            for label, pattern in [("all on", [True] * layers), *patterns.items()]:
                if name == "dense" and label != "all on":
                    continue
                set_flags(pattern)
                graph.replay()
                torch.cuda.synchronize()
                want = reference(pattern)
                err = ((x.float() - want.float()).abs().max() / want.float().abs().max()).item()
                good = err < 0.05
                ok &= good
                print(
                    f"check {name:8s} {label:8s}: relative max error {err:.2e} {'ok' if good else 'WRONG'}", flush=True
                )
        set_flags(patterns["timed"])
        times = {name: replay_ms(graph, flush) for name, graph in graphs.items()}
    for name, ms in times.items():
        rows.append(f"| {name} | {ms * 1000:.1f} | {times['dense'] / ms:.2f}x |")
    ideal = times["dense"] * sum(patterns["timed"]) / layers
    lines = [
        f"{layers} SwiGLU sublayers, D = {d}, FFN = {ffn}, bf16, one token; {sum(patterns['timed'])} of {layers} "
        f"flags on (the dense member runs all); replay time with the L2 flushed, median of 7 rounds of 50.",
        "",
        "| member | us a step | x dense |",
        "|---|---|---|",
        *rows,
        f"| (dense x fraction on: the bound) | {ideal * 1000:.1f} | {times['dense'] / ideal:.2f}x |",
        "",
        f"correct: {ok}",
    ]
    facts = report.run_facts(True, shape=args.shape, on=sum(patterns["timed"]), layers=layers)
    print(report.write(args.out, "probe-cond-graph", "Dynamic depth in a CUDA graph: conditional nodes", facts, lines,
                       {"times_ms": times, "correct": ok}))  # fmt: skip
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
