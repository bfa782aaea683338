"""What ``backend="auto"`` runs, and the launch settings of the kernels: data, apart from the kernels.

``KERNEL_RANGES`` lists where each op's Triton kernel beat its dense fallback (cuBLAS, SDPA) on the
GPU named in ``MEASURED_ON``, in GPU time with the L2 flushed and in a CUDA graph; everywhere else
"auto" runs the dense fallback. The reasons quote ``docs/wide-kernels-h200.md``, which has the
commands and raw files. On another GPU the same ranges apply (they were not measured there):
``check_gpu`` warns once, naming the benchmark that would measure them.

The tile tables are the autotuner's search spaces on a GPU (it picks per shape on the first call);
the CPU interpreter uses small fixed tiles instead (any tile is correct there).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch

MEASURED_ON = "NVIDIA H200"  # the GPU the ranges and tile tables were measured on (sm_90, 141 GB HBM3e)
SHAPES = "Llama-3.1-8B shapes (hidden 4096, FFN 14336 in groups of 128, 32 heads of 128 in groups of 4), bf16"

DECODE_MAX_M = 16  # up to this many tokens: the decode kernels (all tokens in one 16-row tile, no sort)
SHARED_MAX_M = 64  # a batch's shared set (consensus, every token the set): the out-width decode kernels, one tile
FEW_GROUPS = 8  # a reduction over this many input groups or fewer reads them without a group list
# up to this many tokens the router's deciding launch runs a program a token (router.router_finish), where a
# program a 64-token block sums up to 64 shares of D alone; the token shape measured faster up to 512 tokens and
# not beyond (docs/wide-kernels-h200.md, "Below 1k")
ROUTER_TOKEN_FINISH_MAX_M = 512


@dataclass(frozen=True)
class Range:
    """The kernel runs for ``op`` where every given bound holds; ``why`` is the measurement."""

    op: str
    min_m: int = 1
    max_m: int | None = None
    min_context: int = 0
    max_groups: int | None = None
    zeroed: bool | None = None  # the reduction's input already zero in its inactive groups
    shared: bool | None = None  # every token runs the same groups (a batch's consensus set at decode)
    max_width: int | None = None  # the product's input width (the model's hidden size)
    why: str = ""

    def covers(self, m: int, context: int, groups: int, zeroed: bool, shared: bool, width: int) -> bool:
        return (
            self.min_m <= m
            and (self.max_m is None or m <= self.max_m)
            and (self.max_width is None or 0 < width <= self.max_width)
            and context >= self.min_context
            and (self.max_groups is None or 0 < groups <= self.max_groups)
            and (self.zeroed is None or zeroed == self.zeroed)
            and (self.shared is None or shared == self.shared)
        )


# m: tokens (for attn_decode: the batch); context: cached positions; groups: a reduction's input groups.
# Each range is where the kernel measured faster than its dense fallback in GPU time and in a CUDA graph
# (docs/wide-kernels-h200.md; the boundary measurements are recorded at commit 217c749).
KERNEL_RANGES = (
    Range("swiglu", max_m=DECODE_MAX_M, why="the fused gate+up at decode: one tile of every token, the mask read"),
    Range(
        "swiglu",
        max_m=SHARED_MAX_M,
        shared=True,
        why="gate+up on a batch's shared set, 24-64 tokens in one tile: 1.88-1.95x cuBLAS (docs/serving.md); per "
        "token at 32-128 the stacked fallback was as fast or faster (0.95-1.01x, docs/wide-kernels-h200.md)",
    ),
    Range(
        "swiglu",
        min_m=512,
        why="the fused gate+up from 512 prefill tokens at 25-50% (1.09-1.84x); at 256 cuBLAS was faster (0.88-0.91x)",
    ),
    Range("out", max_m=DECODE_MAX_M, why="q at decode: K packed into one product, no layout to build"),
    Range(
        "out",
        min_m=4096,
        why="q on the persistent prefill kernel from 4k tokens; at 2k cuBLAS was faster (docs/wide-kernels-h200.md)",
    ),
    Range(
        "out",
        max_m=SHARED_MAX_M,
        shared=True,
        why="q (k / v stacked) on a batch's half set, 24-64 tokens in one tile: 1.21-1.35x cuBLAS (gate+up 1.88-1.95x)",
    ),
    Range("reduce", max_m=1, why="down / o at one token: the active groups packed four to a product"),
    Range(
        "reduce",
        min_m=DECODE_MAX_M + 1,
        max_m=SHARED_MAX_M,
        shared=True,
        why="down / o of a batch's shared set past the decode tile: K split among programs streams only the set's "
        "weights, faster than cuBLAS on every group (docs/serving.md)",
    ),
    Range("reduce", max_m=8, max_groups=FEW_GROUPS, why="o_proj's few wide groups read directly, up to 8 tokens"),
    Range(
        "reduce",
        max_m=DECODE_MAX_M,
        max_groups=FEW_GROUPS,
        zeroed=False,
        why="o after a dense attention, up to 16 tokens: the fallback must also zero the skipped heads first",
    ),
    Range(
        "reduce_handoff",
        max_m=DECODE_MAX_M,
        why="down / o writing the next router's shares, up to 16 tokens: faster than cuBLAS, the add and the "
        "two-launch router after it (down 1.20x / o 1.42x at 4 tokens, 1.10x / 1.24x at 16)",
    ),
    Range(
        "reduce_handoff",
        min_m=DECODE_MAX_M + 1,
        max_m=SHARED_MAX_M,
        shared=True,
        why="a shared set's split-K reduction, its second launch writing the next router's shares: consensus at "
        "32 / 64 x 2k decodes at 1.28x / 1.27x dense with it, 0.51x / 0.42x for the tree before (docs/serving.md)",
    ),
    Range(
        "attn_decode",
        min_context=512,
        why="each sequence's inactive KV heads go unread at any batch: faster than the runtime's attention in "
        "every cell of batch 1-64 x 512-32k positions with a quarter of the groups off (docs/serving.md)",
    ),
    Range("attn_prefill", min_m=1024, why="active queries only, from 1k new tokens; at 512 SDPA was faster"),
    Range("router", why="bottleneck, logits and decision in two launches instead of the module's five or six"),
    Range(
        "router_shares",
        max_m=ROUTER_TOKEN_FINISH_MAX_M,
        why="a block with no shares handed on writes its own, then decides with the add and the norm: TTFT 0.9-1.4% "
        "shorter at 128 and 512 tokens, 32 x 1k decode 2.2% faster (H100; docs/wide-kernels-h200.md, 'Below 1k')",
    ),
    Range(
        "router_out",
        max_m=1,
        max_width=576,
        why="the decision, add and norm in the first product's prologue at one token of SmolLM2's width: its "
        "decode 1.05x faster than with the decision's own launch; slower at 4 and 16 tokens and at 8B's width "
        "(docs/wide-kernels-h200.md)",
    ),
)
# ops whose kernel has not yet been measured against its fallback on the GPU: ``auto`` runs the fallback
# everywhere until a measured range is added above (``backend="triton"`` runs the kernel)
UNMEASURED: tuple[str, ...] = ()
OPS = (
    "swiglu",
    "out",
    "reduce",
    "reduce_handoff",
    "attn_decode",
    "attn_prefill",
    "router",
    "router_shares",
    "router_out",
)
_RANGES = {op: tuple(r for r in KERNEL_RANGES if r.op == op) for op in OPS}  # looked up on every call


def use_kernel(
    op: str,
    m: int,
    *,
    context: int = 0,
    groups: int = 0,
    zeroed: bool = False,
    shared: bool = False,
    width: int = 0,
) -> bool:
    """Whether ``backend="auto"`` takes ``op``'s Triton kernel for ``m`` tokens (the batch, for
    ``attn_decode``), ``context`` cached positions, a reduction over ``groups`` input groups whose
    input is (``zeroed``) or is not yet zero in the inactive ones, tokens that all run the same groups
    (``shared``) or not, a product over ``width`` input features (0: not given; a range bounded in width then
    does not apply). False: the dense fallback."""
    ranges = _RANGES.get(op)
    if ranges is None:
        raise ValueError(f"unknown operator {op!r}; known: {', '.join(OPS)}")
    for r in ranges:
        if r.covers(m, context, groups, zeroed, shared, width):
            return True
    return False


def decode_kernel(m: int, shared: bool) -> bool:
    """Whether the out-width products of ``m`` tokens take the decode kernel (one tile of every token, the mask
    read directly) rather than the prefill one: up to ``DECODE_MAX_M`` tokens, or ``SHARED_MAX_M`` sharing a set."""
    return m <= (SHARED_MAX_M if shared else DECODE_MAX_M)


_CHECKED: set = set()


def check_gpu(device: torch.device) -> None:
    """Warn once per device when ``KERNEL_RANGES`` were measured on another GPU model."""
    if device.index in _CHECKED:
        return
    _CHECKED.add(device.index)
    name = torch.cuda.get_device_name(device)
    if MEASURED_ON not in name:
        warnings.warn(
            f"WIDE's backend='auto' ranges were measured on an {MEASURED_ON}, not on this {name}: they apply "
            "unchanged here. To measure them: python benchmarks/bench_wide_kernels.py --out DIR",
            stacklevel=3,
        )


# the kernels launched with programmatic dependent launch on a GPU of sm_90 or later (their function names, or "*"
# for every WIDE kernel): such a kernel waits for the kernel before it at its start and lets the next launch, so
# that where two of them follow each other (a block's reduction, then the next block's router and product) the
# second's launch overlaps the first's end. Every kernel: measured faster at SmolLM2's decode, its prefill
# unchanged (docs/runtime-h200.md, "Programmatic dependent launch")
PDL_KERNELS: tuple[str, ...] = ("*",)
# decode launch settings
OUT_K_PACK = ((4, 4), (16, 2))  # q: (up to M tokens, K chunks a product); the fastest packing measured
SWIGLU_K_PACK = 1  # gate+up: packing K was slower (it has twice the weight rows already)
REDUCE_K_PACK = 4  # active groups a product in the reduction (2 and 8 were slower at M = 1)
SHARE_N = 16  # columns a share of the next router's bottleneck covers (the narrowest reduction tile at REDUCE_K_PACK)
# the shared set's reduction: (BLOCK_N, BLOCK_K, warps, stages) and its programs in all (output blocks x K
# splits), the settings its sweep chose for down and o (docs/serving.md)
SHARED_REDUCE_TILE = (64, 128, 4, 4)
SHARED_REDUCE_PROGRAMS = 512
# its second launch handing the next router its shares: (rows, output columns, warps) a program; one share
# slot of 8 rows a program ran down and o of 32 / 64 tokens within 2% of the sweep's best, 1.14-1.38x faster
# than 16 x 64 with 4 warps (docs/serving.md)
SHARED_SUM_TILE = (8, 16, 2)
ATTN_DECODE_BLOCK = 64  # KV positions a step (16 was slower than cuDNN at batch 1)
# KV splits: about ATTN_DECODE_PROGRAMS split programs over the batch's (sequence, KV head) pairs (a small batch
# splits its cache finer to fill the GPU, a large one less to merge less), none shorter than 64 positions, at most
# 64 (the rule and its sweep: docs/serving.md)
ATTN_DECODE_POSITIONS_PER_SPLIT = 64
ATTN_DECODE_MAX_SPLITS = 64
ATTN_DECODE_PROGRAMS = 2048
# a program's warps (with ATTN_DECODE_BLOCK positions a step): one setting for every cell (docs/serving.md)
ATTN_DECODE_WARPS = 4
ROUTER_DECODE_PROGRAMS = 128  # the decode router spreads its bottleneck over this many programs
ROUTER_PREFILL_PROGRAMS = 256  # from 64 token blocks: shares of D so that about this many run
# the router's tile past decode sizes: (tokens, columns of D) a step; measured at 4k tokens and 112 groups:
# 2.9x faster than (32, 128) and the fastest of the six pairs of 32-128 tokens and 64-128 columns (GPU time)
ROUTER_PREFILL_TILE = (64, 64)
# the router's first launch on its own (router.triton_router_shares, a block with no shares handed on): a share a
# this many columns of D, so that the shares' count depends on D only
ROUTER_SHARE_COLUMNS = 128

# tile tables: (meta-parameters, num_warps, num_stages)
# the K-packed decode product (weights as the MMA's rows): (MMA rows, BLOCK_K, warps, stages); a program
# holds MMA rows / K_PACK output channels; 64 rows per 4 warps is Hopper's warp-group MMA
PACKED_DECODE_ROWS = [
    (64, 128, 4, 4),
    (64, 128, 4, 5),
    (64, 64, 4, 6),
    (64, 256, 4, 3),
    (128, 64, 8, 4),
    (128, 128, 8, 3),
]
# gate+up at decode (K_PACK = 1): the same shape of tiles, plus 32-row ones (twice the programs)
SWIGLU_DECODE = [
    ({"BLOCK_N": 64, "BLOCK_K": 128}, 4, 4),
    ({"BLOCK_N": 64, "BLOCK_K": 128}, 4, 5),
    ({"BLOCK_N": 64, "BLOCK_K": 128}, 4, 6),
    ({"BLOCK_N": 64, "BLOCK_K": 64}, 4, 6),
    ({"BLOCK_N": 64, "BLOCK_K": 64}, 4, 8),
    ({"BLOCK_N": 64, "BLOCK_K": 256}, 4, 3),
    ({"BLOCK_N": 128, "BLOCK_K": 64}, 8, 4),
    ({"BLOCK_N": 128, "BLOCK_K": 128}, 8, 3),
    ({"BLOCK_N": 32, "BLOCK_K": 256}, 4, 4),
    ({"BLOCK_N": 32, "BLOCK_K": 128}, 4, 5),
    # 16-row tiles: for 17-64 tokens of a shared set, more programs stream the weights (q: 8 groups of 512 rows)
    ({"BLOCK_N": 16, "BLOCK_K": 256}, 4, 4),
    ({"BLOCK_N": 16, "BLOCK_K": 128}, 4, 5),
]
# the reduction's K-packed product (BLOCK_K steps through one group)
REDUCE_DECODE_ROWS = [(64, 128, 4, 4), (64, 128, 4, 3), (64, 64, 4, 6), (128, 64, 8, 4), (128, 128, 8, 3)]
PACKED_SMEM_BUDGET = 200 * 1024  # bytes of operand tiles a program may stage (Hopper: 227 KB shared memory)
# the persistent output-width product at prefill: tiles, and the programs an SM runs (PER_SM: the grid is
# that many per SM); tiles whose stages do not fit PACKED_SMEM_BUDGET are pruned (the fused SwiGLU stages
# two weight tiles).
# the persistent product's last round of active items, where it fills at most 1 / OUT_TAIL_SPLIT of the programs,
# runs in that many pieces of an item's channels (1: whole items), by product: q ("plain") and gate+up ("swiglu").
# Measured: gate+up's pieces never slower and faster where they cut a round; with them q's autotuner picked another
# tile at 1k tokens, slower with half the groups off (docs/wide-kernels-h200.md, "The last round in pieces")
OUT_TAIL_SPLIT = {"plain": 1, "swiglu": 2}
OUT_PERSISTENT = [
    ({"BLOCK_M": 128, "BLOCK_N": 256, "BLOCK_K": 64, "PER_SM": 1}, 8, 3),
    ({"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "PER_SM": 1}, 8, 4),
    ({"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 128, "PER_SM": 1}, 8, 3),
    ({"BLOCK_M": 64, "BLOCK_N": 256, "BLOCK_K": 64, "PER_SM": 1}, 8, 4),
    ({"BLOCK_M": 64, "BLOCK_N": 256, "BLOCK_K": 64, "PER_SM": 2}, 8, 3),
    ({"BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": 64, "PER_SM": 2}, 4, 4),
    ({"BLOCK_M": 128, "BLOCK_N": 64, "BLOCK_K": 64, "PER_SM": 2}, 4, 4),
]
# the routed prefill attention: rows (tokens x HP heads of a group and KV head) x key tiles
ATTN_PREFILL = [
    ({"BLOCK_M": bm, "BLOCK_N": bn, "HP": hp}, warps, stages)
    for hp in (1, 2, 4)
    for (bm, bn), warps, stages in [
        ((64, 64), 4, 3),
        ((128, 64), 8, 3),
        ((128, 64), 4, 3),
        ((128, 128), 8, 3),
        ((128, 128), 8, 2),
        ((64, 128), 4, 3),
        ((128, 64), 8, 4),
        ((64, 64), 4, 4),
    ]
]


def per_packing(rows: list[tuple[int, int, int, int]], pack: int) -> list:
    """A K-packed kernel's tile table for one packing, from ``(MMA rows, BLOCK_K, warps, stages)``."""
    return [({"BLOCK_N": mma_rows // pack, "BLOCK_K": bk}, warps, stages) for mma_rows, bk, warps, stages in rows]


def out_k_pack(m: int, fused: bool) -> int:
    """K chunks a product of the output-width decode kernel for ``m`` tokens (1: not packed)."""
    if fused:
        return SWIGLU_K_PACK
    return next((pack for max_m, pack in OUT_K_PACK if m <= max_m), 1)


def out_tail_split(fused: bool) -> int:
    """The pieces of an item in the persistent prefill product's last round (``OUT_TAIL_SPLIT``): gate+up's
    (``fused``, the SwiGLU) or q's."""
    return OUT_TAIL_SPLIT["swiglu" if fused else "plain"]


def shared_reduce_splits(n_blocks: int, k_steps: int) -> int:
    """Programs an output block's K steps are split among in the shared set's reduction: about
    ``SHARED_REDUCE_PROGRAMS`` programs in all, at most one a K step of every group (the set is at most
    all of them)."""
    return max(1, min(k_steps, -(-SHARED_REDUCE_PROGRAMS // max(1, n_blocks))))


def attention_decode_splits(context: int, batch: int = 1, kv_heads: int = 1) -> int:
    """KV splits a (sequence, KV head) of the routed decode attention: enough programs to fill the GPU
    (``ATTN_DECODE_PROGRAMS`` over the batch's (sequence, KV head) pairs), never a split shorter than
    ``ATTN_DECODE_POSITIONS_PER_SPLIT`` positions, 1 to ``ATTN_DECODE_MAX_SPLITS``."""
    most = max(1, min(ATTN_DECODE_MAX_SPLITS, context // ATTN_DECODE_POSITIONS_PER_SPLIT))
    wanted = -(-ATTN_DECODE_PROGRAMS // max(1, batch * kv_heads))
    return max(1, min(most, wanted))
