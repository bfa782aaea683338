"""Launch settings shared by the kernels: dot precision, the decode/prefill split, and the tile
configurations the autotuner chooses from on a GPU.

Tile sizes are picked per shape by ``triton.autotune`` on the first call (keys: the problem
sizes, M in power-of-two buckets for prefill so that a new prompt length does not retune); the
decode kernels are timed by ``flushed_graph_bench`` (GPU time with the L2 flushed: Triton's default
timing measures the host's launch cost at those sizes). A CUDA graph must be captured after that
first call, never during it. In Triton's CPU interpreter (the CI path) one small
fixed configuration is used: the interpreter's speed does not depend on tiles.
"""

from __future__ import annotations

import math
import os

import torch

try:
    import triton
except ImportError:
    triton = None


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for the host code of launches (``triton.cdiv`` is a constexpr function in
    Triton 3.6, whose host calls cost several microseconds each; a prompt makes hundreds)."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= ``n`` (1 for ``n`` <= 1), as ``triton.next_power_of_2``."""
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


DECODE_MAX_M = 16  # at most this many tokens: the decode kernels (one 16-row tile, no token sort)


def use_kernel(op: str, m: int, *, context: int = 0, groups: int = 0, zeroed: bool = False) -> bool:
    """Whether ``backend="auto"`` takes the Triton kernel for ``op`` with ``m`` tokens (or, for
    decode attention, a batch of ``m`` with ``context`` cached positions; ``groups``: the reduction's
    input groups, where known; ``zeroed``: the reduction's input is already zero in its inactive
    groups, so its fallback is the plain dense product), on a GPU; otherwise the
    dense fallback (``dense.py``). Measured on the H200 at Llama-3.1-8B shapes and 50% sparsity
    (docs/wide-kernels-h200.md, runs 6-19: GPU time with the L2 flushed, and CUDA-graph medians): the
    kernel is taken only where it beat the dense path in both. Other GPUs and shapes get the same
    ranges (not measured).

    * ``"swiglu"`` (gate+up, fused): everywhere (1.6x-1.8x at M=1, about 1.0x where the union of
      a decode batch's masks is dense; at prefill sizes, since its programs take a group's tiles
      together, runs 20-22: 1.01x of cuBLAS gate+up's GPU time at T = 512, 1.25x-1.31x at
      1024-2048, 1.20x-1.45x at 4096; the FFN block it feeds is 1.02x-1.70x of cuBLAS at every M
      measured)
    * ``"out"`` (q): decode (M <= 16: 1.02x-1.5x with K split over 4 programs, runs 6-17; since
      runs 46-50, the weight tile as the MMA's rows and one program a block from 3 tokens:
      1.35x-1.68x at M = 1, 1.65x at 2, 1.03x-1.05x at 4-16; since run 62, K packed into one
      product: 1.83x / 1.58x at M = 1, exact / i.i.d., 1.06x at 8) and
      M >= 4096 (1.16x-1.31x GPU time, 1.27x-1.44x in a graph, runs 6, 20-21); 0.6x-1.0x between
      (2048: 0.82x-0.98x GPU time, run 21)
    * ``"reduce"`` (down, o): M = 1 (the fused active-group loop, 4 programs an output block:
      1.38x-1.68x GPU time, 1.44x-2.01x in a graph, runs 16-17; the packed loop since run 62: 1.71x
      / 1.82x GPU time, 1.94x / 2.33x in a graph, exact / i.i.d.); 0.8x-1.06x from M = 2,
      where the fallback on an input that is already zero-filled is the plain dense product. With
      few groups (``FEW_GROUPS``: o_proj's 8 of 512 inputs) the "direct" variant (GPU time
      against cuBLAS's plain product, exact / i.i.d. masks, run 67: 1.71x / 1.49x
      at M = 1, 1.16x at 2, 1.22x / 1.07x at 4, 1.01x at 8, 0.98x at 16; run 68 under ``auto``:
      1.72x / 1.48x, 1.11x, 1.21x / 1.05x, 1.01x, 0.97x, and 0.91x / 0.96x in a CUDA graph at 16)
      up to 8 tokens, and from 9 to 16 only where the input is not zero-filled yet (o_proj after a
      dense attention), whose fallback measured 0.79x (its select, then the product; run 67); on a
      zero-filled input (after the routed attention) the plain product is the dense op itself. The
      packed variant with its list measured 0.93x at M = 1 (run 64)
    * ``"attn_decode"``: batch >= 4 with context >= 8192 (1.44x-1.64x in a graph), any batch from
      32768 positions (1.44x-1.80x; run 11, 64 KV positions per step, the group mask read directly);
      batch 1 at 8192: 1.38x GPU time but 1.02x in a graph (batch 2-3 not measured), and below 8192
      positions 0.4x-0.9x (run 6)
    * ``"router"`` (the fused routing decision): everywhere (run 19, with the products beyond decode
      sizes on the tensor cores in three TF32 passes: 1.21x-2.94x of the reference's five or six
      launches in GPU time, 1.16x-2.75x in a graph, at M = 1, 16, 512, 1024, 2048, 4096 for the FFN's
      112 groups; run 20, D split from 2,048 tokens too: 2.47x at 2048, 2.10x at 4096; the attention
      router's 8 groups were last measured in run 13, 1.2x-4.9x up to 1024 tokens, and share the
      bottleneck product that dominates)
    * ``"attn_prefill"``: from 1024 new tokens (run 17, the busy tiles longest first: 1.23x-1.25x of
      cuDNN's GPU time at 1024, 1.38x-1.42x at 2048, 1.40x-1.41x at 4096, 1.24x-1.49x in a graph; runs
      39-40, up to 4 heads a program and a one-pass layout: 1.20x-1.22x at 1024, 1.53x-1.55x at 2048,
      1.50x-1.51x at 4096); 0.82x-0.91x at 512
    """
    if op == "swiglu":
        return True
    if op == "out":
        return m <= DECODE_MAX_M or m >= 4096
    if op == "reduce":
        return m == 1 or (0 < groups <= FEW_GROUPS and m <= (FEW_GROUPS_ZEROED_MAX_M if zeroed else DECODE_MAX_M))
    if op == "attn_decode":
        return context >= 32768 or (m >= 4 and context >= 8192)
    if op == "router":
        return True
    if op == "attn_prefill":
        return m >= 1024
    raise ValueError(f"unknown operator {op!r}; known: swiglu, out, reduce, attn_decode, attn_prefill, router")


def out_decode_split_k(m: int, fused: bool) -> int:
    """Programs sharing each output block's K range in the decode product: 4 for the plain one (q) up
    to 2 tokens; 1 from 3 tokens, for the fused SwiGLU (gate+up: twice the columns, enough programs
    already; splitting it measured slower, runs 47 and 49, and was removed) and in the CPU
    interpreter (any split is correct there). With the weight tile as the MMA's rows
    (``decode_swap_ab``) on the H200, q in GPU time (runs 46-47 and 49-50,
    ``benchmarks/sweep_wide_decode.py``): at M = 1 9.82-9.89 us with 4 shares against 10.66-10.67
    with 1 (runs 47, 49); at M = 2 9.25 with 4, 9.36 with 2, 9.82 with 1; at M = 4 14.62 with 1
    against 15.34 with 4 (run 47), at M = 8 14.67 against 15.44, at M = 16 14.72 against 15.74 (run
    50). M = 3 was not measured. (Runs 6-7, with the tokens as the rows, had found 4 faster at every M
    up to 16.)"""
    return 4 if not fused and m <= 2 and not interpreted() else 1


FEW_GROUPS = 8  # a reduction over at most this many input groups reads them without a list ("direct")
FEW_GROUPS_ZEROED_MAX_M = 8  # beyond, on a zero-filled input, the plain product (run 68: direct 0.97x at 16)


def reduce_variant(m: int, groups: int) -> str:
    """The reduction kernel's default variant (``triton_masked_reduce_gemm``) for ``m`` tokens and
    ``groups`` input groups: on a GPU "direct" for ``FEW_GROUPS`` or fewer at every decode size
    (o_proj's 8 of 512 inputs: 4 consecutive groups a step in one product, no group list; run 65,
    GPU time, M = 1: 9.07 us against 12.59 with the list and 9.36 for the fused one, exact masks,
    10.58 against 16.48 and 11.17 i.i.d.; M = 2: 13.86 against 17.97 and 14.14; run 67 against
    cuBLAS: 1.01x at M = 8 and 0.98x at 16, where the fused one measured 0.67x-0.71x); else up to
    4 tokens "packed" (4 active groups a step in one product, one program an output block; down's
    112 groups: 20.96 us against 25.52 direct, i.i.d., run 65), "fused"
    (one launch: its own group list, the shares summed through tickets) for the other decode sizes
    and in the CPU interpreter, "loop" (the layout launch, the loop, the summing launch) beyond. On
    the H200, down at M = 1 (run 61, ``benchmarks/sweep_wide_decode.py``, GPU time): packed 22.62
    us against the fused one's 24.74 (exact masks; 21.12 against 23.01 i.i.d.), at M = 4 36.42
    against 38.13; 8 groups a step 22.78 / 21.52, 2 slower than fused (27.76 / 25.39). Before (run
    16, split 4) the fused one measured 1.48x-1.68x of cuBLAS in GPU time and 1.60x-2.01x in a CUDA
    graph, the loop 1.51x-1.68x and 1.50x-1.87x; at M = 4 both 0.97x-1.01x."""
    if m <= DECODE_MAX_M and groups <= FEW_GROUPS and not interpreted():
        return "direct"
    if m <= 4 and not interpreted():
        return "packed"
    return "fused" if m <= DECODE_MAX_M else "loop"


def decode_k_pack(m: int, fused: bool) -> int:
    """K chunks packed into one product of the output-width decode kernel
    (``gemm_out.packed_output_tile``; 1: not packed): for the plain one (q) 4 up to 4 tokens, 2 from
    5 to 16 (measured at 8 and 16), else 1 (and 1 in the CPU interpreter, where the other kernels
    keep their tests' meaning). On the H200 (run 59, ``benchmarks/sweep_wide_decode.py``, GPU time,
    each autotuned): q at M = 1 with 4 chunks 8.45 us against 10.24 with K split over 4 programs and
    10.72 unsplit (exact masks; 9.60 against 11.46 and 11.62 i.i.d.), 8.50 with 8 chunks, 8.86 with
    2; at M = 2 10.94 against 12.72-12.75, at M = 4 12.40 against 13.68-14.08 (i.i.d.); run 60,
    i.i.d.: at M = 8 13.89 us with 2 chunks, 13.92 with 4, against 14.64 unpacked; at M = 16 14.70 /
    14.72 against 15.06. The fused gate+up gains nothing from it (M = 1: 37.7-38.1 us packed against
    36.9 unpacked, exact masks; 34.9-37.2 against 34.6 i.i.d.; M = 4: 62.6-63.7 against 60.9)."""
    if fused or m > DECODE_MAX_M or interpreted():
        return 1
    return 4 if m <= 4 else 2


def packed_pruner(block: str, unrolled_group: bool = False):
    """Autotuner hook of the K-packed decode kernels: ``prune_wider_than_group(block)``, then the
    tiles whose pipeline stages fit in shared memory (fp32 inputs take twice bf16's bytes; an
    estimate of the operand tiles only). ``unrolled_group``: the kernel unrolls a group's K steps
    (the packed reduction with its group list), each with its own buffers: the estimate counts
    ``GW / BLOCK_K`` steps a stage (an upper bound: Triton 3.6's sm_90 compiles of that kernel at
    o_proj's and down's widths, ``benchmarks/hopper_codegen.py``, allocate at most that; the bound
    without the steps let a 256 KB tile through at o's 512 inputs and 16 tokens, run 66). Where
    none fits, the smallest tile with as many stages as fit (at least 1)."""

    def prune(configs_, named_args, **kwargs):
        kept = prune_wider_than_group(block)(configs_, named_args)
        elem = named_args["x_ptr"].element_size()
        weights = 2 if kwargs.get("FUSE_SWIGLU") else 1
        pack, block_m = kwargs["K_PACK"], kwargs["BLOCK_M"]

        def stage_bytes(c):
            steps = cdiv(named_args["GW"], c.kwargs["BLOCK_K"]) if unrolled_group else 1
            return steps * c.kwargs["BLOCK_K"] * elem * pack * (c.kwargs["BLOCK_N"] * weights + block_m)

        fit = [c for c in kept if c.num_stages * stage_bytes(c) <= PACKED_SMEM_BUDGET]
        if fit:
            return fit
        small = min(kept, key=stage_bytes)
        stages = max(1, min(small.num_stages, PACKED_SMEM_BUDGET // stage_bytes(small)))
        return [triton.Config(dict(small.kwargs), num_warps=small.num_warps, num_stages=stages)]

    return prune


PACKED_SMEM_BUDGET = 200 * 1024  # bytes of operand tiles a program (Hopper: 227 KB of shared memory)


def decode_swap_ab(op: str) -> bool:
    """Whether the decode products of ``op`` ("swiglu": gate+up, "out": q, "reduce": down and o)
    take the weight tile as the MMA's row operand (``tile_dot``'s ``SWAP_AB``; the compiler then
    emits Hopper's warp-group MMA, with the tokens as the rows the older one, run 50): yes for all
    three, at every decode size. Measured side by side on the H200 (``benchmarks/sweep_wide_decode.py``,
    runs 46-50, GPU time, each order with its own autotuned tiles): gate+up at M = 1 36.98-37.94
    against 38.26-38.72 us (exact masks) and 39.63-40.42 against 40.99-41.25 (i.i.d.), at M = 4
    59.4-60.0 against 60.2-60.3; q at M = 1 (4 shares of K) 9.82-9.89 against 10.69-10.83 us and
    11.14-11.34 against 11.71-11.78, at M = 2 9.25 against 10.03, at M = 4, 8 and 16 (one share:
    ``out_decode_split_k``) 14.62-14.72 against 14.91-15.02; down (the fused loop, 4 shares) at
    M = 1 24.69-24.78 against 25.70-25.74 us and 25.50-25.52 against 26.29-26.34, at M = 4 38.5
    against 39.5."""
    if op not in ("swiglu", "out", "reduce"):
        raise ValueError(f"unknown decode product {op!r}; known: swiglu, out, reduce")
    return True


def attention_decode_splits(context: int) -> int:
    """KV splits of the routed decode attention: one per 256 cached positions, 1 to 64 (the H200
    sweep, run 9: 64 beat 32 at 32k positions, batch 1 and 4)."""
    return max(1, min(64, context // 256))


def attention_decode_block() -> int:
    """KV positions per step of the routed decode attention: 64 on a GPU (the H200 sweep, run 9:
    1.16x-1.38x of cuDNN at batch 1 where 16 gave 0.77x-0.87x; GPU time), 16 in the interpreter."""
    return 16 if interpreted() else 64


def attention_prefill_block() -> int:
    """Query and key tile of the routed prefill attention when the caller fixes it or in the CPU
    interpreter (16: any tile is correct there, small ones are faster); on a GPU the autotuner
    picks from ``ATTN_PREFILL``."""
    return 16 if interpreted() else 64


def dot_precision(dtype: torch.dtype) -> str:
    """fp32 inputs get full-precision products (as ``torch.matmul`` does by default), not TF32."""
    return "ieee" if dtype == torch.float32 else "tf32"


def interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def m_bucket(m: int) -> int:
    """The autotuning key for M: its power-of-two bucket."""
    return max(1, int(m - 1).bit_length())


_FLUSH: dict = {}


def l2_flush_buffer(device: str | torch.device = "cuda") -> torch.Tensor:
    """256 MiB on ``device`` (above any current GPU's L2), allocated once per device: writing it
    evicts the L2 before a timed call (here and in ``benchmarks/bench_wide_kernels.py``). A normal
    tensor even when the first call (the first autotuning) runs under ``torch.inference_mode``, as
    generation and evaluation do: an inference tensor could not be written in place by a later
    autotuning outside it."""
    key = str(torch.device(device))
    if key not in _FLUSH:
        with torch.inference_mode(False):
            _FLUSH[key] = torch.empty(256 << 20, dtype=torch.uint8, device=device)
    return _FLUSH[key]


def flushed_graph_bench(fn, quantiles=None, reps: int = 10, rounds: int = 7):
    """The autotuner's timing for the decode kernels (``do_bench=`` of ``triton.autotune``): what a
    call costs the GPU with the L2 flushed first, free of the host's launch cost. Triton's default
    (``do_bench``: an event pair around each launch) measures the host at decode sizes, where a
    launch costs about as much as the 10-40 us kernel, so its choice among tiles is noise. Here one
    CUDA graph replays ``reps`` x [flush the L2, fn] and another the flushes alone; a call costs the
    difference / ``reps`` (median over ``rounds``). Returns what ``do_bench`` would: the median, or a
    list with one value per quantile (the quantiles of the rounds)."""
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
    costs = []
    for _ in range(rounds):
        costs.append(max(replay_ms(with_fn) - replay_ms(flush_only), 1e-6) / reps)
    costs.sort()
    if quantiles is None:
        return costs[len(costs) // 2]
    return [costs[min(len(costs) - 1, int(q * len(costs)))] for q in quantiles]


def replay_ms(graph, times: int = 1) -> float:
    """Milliseconds of ``times`` back-to-back replays of a captured CUDA graph (an event pair)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(times):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end)


def configs(rows: list[tuple[dict, int, int]]) -> list:
    """``[(meta, num_warps, num_stages), ...]`` -> ``triton.Config`` list."""
    return [triton.Config(meta, num_warps=w, num_stages=s) for meta, w, s in rows]


def autotuned(kernel, rows: list[tuple[dict, int, int]], key: list[str], *, decode: bool, prune=None):
    """``kernel`` autotuned over the tile table ``rows`` per ``key``; ``decode`` kernels are timed by
    ``flushed_graph_bench`` (the default timing measures the host at their sizes); ``prune``: the
    block that must not be wider than a group (``prune_wider_than_group``), or an autotuner hook of
    its own (``early_config_prune``)."""
    if isinstance(prune, str):
        prune = prune_wider_than_group(prune)
    return triton.autotune(
        configs=configs(rows),
        key=key,
        do_bench=flushed_graph_bench if decode else None,
        prune_configs_by={"early_config_prune": prune} if prune else None,
    )(kernel)


def decode_autotuned(kernel, tables: dict, key: list[str], prune) -> dict:
    """A decode ``kernel`` autotuned per variant: ``{variant: autotuned(kernel, table, ...)}`` for
    each ``variant: table`` of ``tables`` (an operand order, a packing), each with its own tiles."""
    return {variant: autotuned(kernel, table, key, decode=True, prune=prune) for variant, table in tables.items()}


def packed_block_m(m: int, k_pack: int) -> int:
    """The token tile of a K-packed decode kernel: the tokens (up to 16) padded to a power of two and
    so that the product has 16 or more columns (``k_pack`` x the tile; ``tl.dot``'s least)."""
    return min(16, max(next_power_of_2(m), 16 // k_pack))


def packed_fixed_tiles(block_n: int | None, block_k: int | None, k_pack: int, default_k: int) -> tuple[int, int]:
    """The fixed tiles of a K-packed decode kernel (tests, the interpreter): ``block_n`` channels a
    program (default: 16 MMA rows' worth) and ``block_k`` (default ``default_k``); an error where
    ``tl.dot`` would get fewer than 16 rows or columns of K."""
    bn, bk = block_n or max(16 // k_pack, 1), block_k or default_k
    if k_pack * bn < 16 or bk < 16:
        raise ValueError(f"block_n={bn} x k_pack={k_pack} and block_k={bk}: tl.dot needs 16 or more of each")
    return bn, bk


def packed_table(tables: dict, k_pack: int) -> list:
    """``tables[k_pack]``: a packing's tile table, or an error that names the tuned packings."""
    if k_pack not in tables:
        raise ValueError(f"k_pack={k_pack} has no tile table on a GPU; tuned: {sorted(tables)}")
    return tables[k_pack]


# output-width GEMV for decode: BLOCK_M is 16 (tl.dot's minimum); the weight stream needs wide K
# blocks and enough programs in flight
OUT_DECODE = [
    ({"BLOCK_N": 16, "BLOCK_K": 256}, 4, 4),
    ({"BLOCK_N": 32, "BLOCK_K": 256}, 4, 4),
    ({"BLOCK_N": 32, "BLOCK_K": 128}, 4, 5),
    ({"BLOCK_N": 64, "BLOCK_K": 128}, 4, 4),
    ({"BLOCK_N": 16, "BLOCK_K": 512}, 4, 3),
    ({"BLOCK_N": 32, "BLOCK_K": 512}, 8, 3),
    ({"BLOCK_N": 64, "BLOCK_K": 256}, 8, 3),
    ({"BLOCK_N": 128, "BLOCK_K": 128}, 8, 3),
]
# the plain (q) decode GEMV with K split over several programs: shorter K loops
OUT_DECODE_SPLITK = [
    ({"BLOCK_N": 16, "BLOCK_K": 256}, 4, 3),
    ({"BLOCK_N": 32, "BLOCK_K": 256}, 4, 3),
    ({"BLOCK_N": 64, "BLOCK_K": 128}, 4, 3),
    ({"BLOCK_N": 32, "BLOCK_K": 512}, 8, 2),
]
# the same two with the weight tile as the product's row operand (``SWAP_AB``): 64 or 128 weight rows
# a tile, so that Hopper runs a warp-group MMA (64 rows per 4 warps)
OUT_DECODE_SWAP = [
    ({"BLOCK_N": 64, "BLOCK_K": 128}, 4, 4),
    ({"BLOCK_N": 64, "BLOCK_K": 128}, 4, 5),
    ({"BLOCK_N": 64, "BLOCK_K": 128}, 4, 6),
    ({"BLOCK_N": 64, "BLOCK_K": 64}, 4, 6),
    ({"BLOCK_N": 64, "BLOCK_K": 64}, 4, 8),
    ({"BLOCK_N": 64, "BLOCK_K": 256}, 4, 3),
    ({"BLOCK_N": 128, "BLOCK_K": 64}, 8, 4),
    ({"BLOCK_N": 128, "BLOCK_K": 128}, 8, 3),
    ({"BLOCK_N": 32, "BLOCK_K": 256}, 4, 4),  # 32 rows: the older MMA again, twice the programs
    ({"BLOCK_N": 32, "BLOCK_K": 128}, 4, 5),
]
OUT_DECODE_SPLITK_SWAP = [
    ({"BLOCK_N": 64, "BLOCK_K": 128}, 4, 3),
    ({"BLOCK_N": 64, "BLOCK_K": 128}, 4, 4),
    ({"BLOCK_N": 64, "BLOCK_K": 128}, 4, 5),
    ({"BLOCK_N": 64, "BLOCK_K": 256}, 4, 4),
    ({"BLOCK_N": 64, "BLOCK_K": 256}, 4, 3),
    ({"BLOCK_N": 64, "BLOCK_K": 64}, 4, 6),
    ({"BLOCK_N": 128, "BLOCK_K": 128}, 8, 3),
    ({"BLOCK_N": 128, "BLOCK_K": 64}, 8, 4),
    ({"BLOCK_N": 32, "BLOCK_K": 256}, 4, 3),
]


def per_packing(rows: list[tuple[int, int, int, int]], packs=(2, 4, 8)) -> dict:
    """A K-packed kernel's tile tables, one per packing, from ``(MMA rows, BLOCK_K, warps, stages)``
    rows: the MMA's rows are K_PACK x BLOCK_N (64 for 4 warps, 128 for 8), so a program holds
    ``MMA rows / K_PACK`` output channels."""
    return {
        pack: [({"BLOCK_N": mma_rows // pack, "BLOCK_K": bk}, warps, stages) for mma_rows, bk, warps, stages in rows]
        for pack in packs
    }


# the K-packed output-width decode kernel (``gemm_out.packed_output_tile``), per packing
OUT_DECODE_PACKED = per_packing(
    [(64, 128, 4, 4), (64, 128, 4, 5), (64, 64, 4, 6), (64, 256, 4, 3), (128, 64, 8, 4), (128, 128, 8, 3)]
)
# output-width GEMM for prefill over the sorted tokens: tensor-core tiles (256-row tiles, 8 or 16
# warps, were never chosen at T = 512..4096 on the H200, run 21)
OUT_PREFILL = [
    ({"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64}, 8, 3),
    ({"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64}, 8, 4),
    ({"BLOCK_M": 128, "BLOCK_N": 64, "BLOCK_K": 64}, 4, 4),
    ({"BLOCK_M": 128, "BLOCK_N": 64, "BLOCK_K": 64}, 8, 4),
    ({"BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": 64}, 4, 4),
    ({"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 32}, 8, 4),
    ({"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 64}, 4, 4),
]
# reduction-width decode loop over the active groups
REDUCE_DECODE = [
    ({"BLOCK_N": 16, "BLOCK_K": 128}, 4, 4),
    ({"BLOCK_N": 16, "BLOCK_K": 128}, 4, 6),
    ({"BLOCK_N": 32, "BLOCK_K": 128}, 4, 4),
    ({"BLOCK_N": 32, "BLOCK_K": 64}, 4, 6),
    ({"BLOCK_N": 64, "BLOCK_K": 128}, 4, 4),
    ({"BLOCK_N": 64, "BLOCK_K": 128}, 8, 3),
    ({"BLOCK_N": 16, "BLOCK_K": 64}, 2, 6),
]

# the same loop with the weight tile as the product's row operand (``SWAP_AB``)
REDUCE_DECODE_SWAP = [
    ({"BLOCK_N": 64, "BLOCK_K": 128}, 4, 4),
    ({"BLOCK_N": 64, "BLOCK_K": 128}, 4, 6),
    ({"BLOCK_N": 64, "BLOCK_K": 64}, 4, 6),
    ({"BLOCK_N": 128, "BLOCK_K": 128}, 8, 3),
    ({"BLOCK_N": 128, "BLOCK_K": 64}, 8, 4),
]

# the packed reduction (``gemm_reduce.triton_masked_reduce_gemm_packed_kernel``), per packing;
# BLOCK_K steps through one group
REDUCE_DECODE_PACKED = per_packing(
    [(64, 128, 4, 4), (64, 128, 4, 3), (64, 64, 4, 6), (128, 64, 8, 4), (128, 128, 8, 3)]
)

# the unrolled variant of that loop (whole-group K tiles; no software pipeline to feed)
REDUCE_UNROLLED = [
    ({"BLOCK_N": 16}, 4, 1),
    ({"BLOCK_N": 32}, 4, 1),
    ({"BLOCK_N": 16}, 8, 1),
    ({"BLOCK_N": 64}, 8, 1),
]

# routed prefill attention (flash forward over gathered queries): rows (query tokens x HP heads of
# one group and KV head) x key tiles; run 8's fixed 64 x 64 with 4 warps reached about 217 TFLOP/s
# on the H200 against cuDNN's 535; HP = 1 until run 39
_ATTN_PREFILL_TILES = [
    ({"BLOCK_M": 64, "BLOCK_N": 64}, 4, 3),
    ({"BLOCK_M": 128, "BLOCK_N": 64}, 8, 3),
    ({"BLOCK_M": 128, "BLOCK_N": 64}, 4, 3),
    ({"BLOCK_M": 128, "BLOCK_N": 128}, 8, 3),
    ({"BLOCK_M": 128, "BLOCK_N": 128}, 8, 2),
    ({"BLOCK_M": 64, "BLOCK_N": 128}, 4, 3),
    ({"BLOCK_M": 128, "BLOCK_N": 64}, 8, 4),
    ({"BLOCK_M": 64, "BLOCK_N": 64}, 4, 4),
]
ATTN_PREFILL = [({**meta, "HP": hp}, w, s) for hp in (1, 2, 4) for meta, w, s in _ATTN_PREFILL_TILES]


def prune_heads_per_program(configs_, named_args, **kwargs):
    """Autotuner hook of the prefill attention: keep the configurations whose heads per program
    (``HP``) divide both the heads of a group (``A``) and those of a KV head (``REP``)."""
    shared = math.gcd(kwargs["A"], kwargs["REP"])
    return [c for c in configs_ if shared % c.kwargs["HP"] == 0] or configs_[:1]


def prune_wider_than_group(block: str, group_width_arg: str = "GW"):
    """Autotuner hook: drop configurations whose ``block`` (``BLOCK_N`` of an output-width kernel,
    where a block never spans two groups, or ``BLOCK_K`` of the reduction loop, which steps
    through one group at a time) is wider than a group."""

    def prune(configs_, named_args, **kwargs):
        width = max(16, next_power_of_2(named_args[group_width_arg]))
        return [c for c in configs_ if c.kwargs[block] <= width] or configs_[:1]

    return prune
