"""How the kernels are autotuned on a GPU: ``triton.autotune`` over the tables of ``policy.py``, with
hooks that drop tiles a shape cannot use, and, for the decode kernels, a timing of the GPU's work
alone.

Triton's default timing (an event pair around each launch) measures the host's launch cost at
decode sizes, where a launch costs about as much as the 10-40 us kernel, so its choice among tiles
there is noise: ``flushed_graph_bench`` replays the calls in a CUDA graph with the L2 flushed
before each instead. Tiles are chosen on the first call of a shape: capture a CUDA graph after
it, never during it.
"""

from __future__ import annotations

import math

import torch

from compresskit_wide.kernels.common import cdiv, next_power_of_2
from compresskit_wide.kernels.policy import PACKED_SMEM_BUDGET

try:
    import triton
except ImportError:
    triton = None

_FLUSH: dict = {}


def l2_flush_buffer(device: str | torch.device = "cuda") -> torch.Tensor:
    """256 MiB on ``device`` (above any current GPU's L2), allocated once: writing it evicts the L2.
    A normal tensor even when the first call runs under ``torch.inference_mode`` (generation does),
    so that a later autotuning outside it can still write it."""
    key = str(torch.device(device))
    if key not in _FLUSH:
        with torch.inference_mode(False):
            _FLUSH[key] = torch.empty(256 << 20, dtype=torch.uint8, device=device)
    return _FLUSH[key]


def replay_ms(graph, times: int = 1) -> float:
    """Milliseconds of ``times`` back-to-back replays of a captured CUDA graph."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(times):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end)


def flushed_graph_bench(fn, quantiles=None, reps: int = 10, rounds: int = 7):
    """The decode kernels' timing (``do_bench=`` of ``triton.autotune``): one CUDA graph replays
    ``reps`` x [flush the L2, ``fn``], another the flushes alone; a call costs the difference /
    ``reps``, median over ``rounds``. Returns what ``do_bench`` would (the median, or one value per
    quantile)."""
    buf = l2_flush_buffer()
    fn()  # compile outside the capture
    torch.cuda.synchronize()

    def capture(body):
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(reps):
                buf.zero_()
                body()
        return graph

    with_fn, flush_only = capture(fn), capture(lambda: None)
    costs = sorted(max(replay_ms(with_fn) - replay_ms(flush_only), 1e-6) / reps for _ in range(rounds))
    if quantiles is None:
        return costs[len(costs) // 2]
    return [costs[min(len(costs) - 1, int(q * len(costs)))] for q in quantiles]


def configs(rows: list[tuple[dict, int, int]], pre_hook=None) -> list:
    """``[(meta, num_warps, num_stages), ...]`` -> ``triton.Config`` list (each with ``pre_hook``)."""
    return [triton.Config(meta, num_warps=w, num_stages=s, pre_hook=pre_hook) for meta, w, s in rows]


def autotuned(
    kernel,
    rows: list[tuple[dict, int, int]],
    key: list[str],
    *,
    decode: bool,
    prune=None,
    pre_hook=None,
    restore: tuple[str, ...] = (),
):
    """``kernel`` autotuned over ``rows`` per ``key``; ``decode`` kernels timed by
    ``flushed_graph_bench``; ``prune``: an ``early_config_prune`` hook; ``pre_hook``: run before
    each launch with the arguments and the tile (:func:`descriptor_blocks`); ``restore``: the
    arguments a launch adds to in place (counters), given back their values after each timed call."""
    return triton.autotune(
        configs=configs(rows, pre_hook),
        key=key,
        do_bench=flushed_graph_bench if decode else None,
        prune_configs_by={"early_config_prune": prune} if prune else None,
        restore_value=list(restore) or None,
    )(kernel)


def descriptor_blocks(**blocks: tuple):
    """Hook: set each named TMA descriptor's block shape from the tile, e.g.
    ``descriptor_blocks(w_desc=("BLOCK_N", "BLOCK_K"))`` (a descriptor's block is part of the
    compiled kernel, so it follows the tile the autotuner tries); a dimension is a meta-parameter's
    name or a function of the launch's arguments and meta-parameters."""

    def hook(nargs):
        for name, dims in blocks.items():
            nargs[name].block_shape = [d(nargs) if callable(d) else nargs[d] for d in dims]

    return hook


def prune_wider_than_group(block: str, group_width_arg: str = "GW"):
    """Hook: drop tiles whose ``block`` (``BLOCK_N`` of an output-width kernel, which never spans two
    groups; ``BLOCK_K`` of the reduction, which steps through one group) is wider than a group. Where
    every tile is, each narrowed to the group (its ``block`` the group width's power of two, at least 16)."""

    def prune(configs_, named_args, **kwargs):
        width = max(16, next_power_of_2(named_args[group_width_arg]))
        kept = [c for c in configs_ if c.kwargs[block] <= width]
        if kept:
            return kept
        narrowed = {}
        for c in configs_:
            meta = {**c.kwargs, block: width}
            key = (tuple(meta.items()), c.num_warps, c.num_stages)
            tile = triton.Config(meta, num_warps=c.num_warps, num_stages=c.num_stages, pre_hook=c.pre_hook)
            narrowed.setdefault(key, tile)
        return list(narrowed.values())

    return prune


def packed_pruner(block: str, unrolled_group: bool = False):
    """Hook of the K-packed decode kernels: ``prune_wider_than_group(block)``, then the tiles whose
    pipeline stages fit ``PACKED_SMEM_BUDGET`` (the operand tiles only; fp32 takes twice bf16's
    bytes). ``unrolled_group``: the kernel unrolls a group's ``GW / BLOCK_K`` K steps, each with
    its own buffers (the reduction with its group list), so a stage counts them all. Where none
    fits, the smallest tile with as many stages as fit."""

    def prune(configs_, named_args, **kwargs):
        kept = prune_wider_than_group(block)(configs_, named_args)
        elem = named_args["x_ptr"].element_size()
        weights = 2 if kwargs.get("FUSE_SWIGLU") else 1
        pack, block_m = kwargs["K_PACK"], kwargs["BLOCK_M"]
        inputs = 2 if kwargs.get("DECIDE") else 1  # (deciding, the kernel streams the residual and the delta)

        def stage_bytes(c):
            steps = cdiv(named_args["GW"], c.kwargs["BLOCK_K"]) if unrolled_group else 1
            return steps * c.kwargs["BLOCK_K"] * elem * pack * (c.kwargs["BLOCK_N"] * weights + block_m * inputs)

        fit = [c for c in kept if c.num_stages * stage_bytes(c) <= PACKED_SMEM_BUDGET]
        if fit:
            return fit
        small = min(kept, key=stage_bytes)
        stages = max(1, min(small.num_stages, PACKED_SMEM_BUDGET // stage_bytes(small)))
        return [triton.Config(dict(small.kwargs), num_warps=small.num_warps, num_stages=stages)]

    return prune


def staged_tile_bytes(meta: dict, stages: int, elem: int, fused: bool) -> int:
    """The shared memory a prefill output-width tile stages: ``stages`` x (a token tile and one weight
    tile, two with the fused SwiGLU) of ``BLOCK_K`` elements of ``elem`` bytes (what the compiled kernel
    takes on sm_90, within a few bytes: ``benchmarks/hopper_codegen.py --out-tiles``)."""
    return stages * meta["BLOCK_K"] * elem * (meta["BLOCK_M"] + meta["BLOCK_N"] * (2 if fused else 1))


def prune_staged_tiles(block_n: str = "BLOCK_N"):
    """Hook of the prefill products: ``prune_wider_than_group(block_n)``, then the tiles whose pipeline
    stages (:func:`staged_tile_bytes`) fit ``PACKED_SMEM_BUDGET``; where none fits, the smallest with as
    many stages as fit."""

    def prune(configs_, named_args, **kwargs):
        kept = prune_wider_than_group(block_n)(configs_, named_args)
        elem = named_args["x_ptr"].element_size()
        fused = bool(kwargs.get("FUSE_SWIGLU"))
        fit = [c for c in kept if staged_tile_bytes(c.kwargs, c.num_stages, elem, fused) <= PACKED_SMEM_BUDGET]
        if fit:
            return fit
        small = min(kept, key=lambda c: staged_tile_bytes(c.kwargs, 1, elem, fused))
        stages = max(1, PACKED_SMEM_BUDGET // staged_tile_bytes(small.kwargs, 1, elem, fused))
        return [triton.Config(dict(small.kwargs), num_warps=small.num_warps, num_stages=min(stages, small.num_stages),
                              pre_hook=small.pre_hook)]  # fmt: skip

    return prune


def prune_heads_per_program(configs_, named_args, **kwargs):
    """Hook of the prefill attention: the tiles whose heads a program (``HP``) divide both the heads
    of a group (``A``) and those of a KV head (``REP``)."""
    shared = math.gcd(kwargs["A"], kwargs["REP"])
    return [c for c in configs_ if shared % c.kwargs["HP"] == 0] or configs_[:1]
