"""What WIDE's kernels compile to on Hopper, checked on any machine: no GPU needed.

    python benchmarks/hopper_codegen.py [--tail-split 1|2] [--pdl] [--json FILE]
    python benchmarks/hopper_codegen.py --reduce-tiles [--json FILE]
    python benchmarks/hopper_codegen.py --out-tiles [--tail-split 1|2] [--json FILE]

Each of WIDE's decode products (q and gate+up also with the router's decision, the residual add and the norm in
their prologue, as their wrappers launch them; the reductions also with the next router's shares in their epilogue;
the tile reduction for a shared set and for prefill tiles), the persistent prefill products (TMA weight tiles), the
routed decode attention's split kernel, the routers' deciding launches and the consensus kernel (which run on the
CUDA cores and need no pipeline; the consensus kernel with the arguments its wrapper passes) is compiled for sm_90
(the H200) at Llama-3.1-8B's shapes, one token (the prefill products: 4k), with a tile the H200's autotuner chose
for it (``docs/results/wide-kernels/``), its integer arguments specialised as Triton's launcher specialises them
(16-byte-aligned pointers, multiples of 16, a 1 made a constant). The script reads the compiled kernel's TTGIR and
reports, per kernel:
- the MMA kind: "wgmma" (Hopper's warp-group MMA, ``warp_group_dot``), "mma" or "none";
- the software pipeline: how many asynchronous global-to-shared copies stream the operands (0: the
  loads wait in registers each step, unpipelined), and how many of them are TMA copies;
- the shared memory a program takes, against the H200's 227 KB;
- the registers a thread takes and the bytes it spills (``ptxas -v``, the ptxas Triton ships).
It exits 1 when a kernel compiles to something else than expected (its MMA kind: the warp-group MMA
for the products; a pipelined stream, shared memory within bounds, no spills), 0 otherwise. Run it
in a process without TRITON_INTERPRET: the interpreter replaces the compiler.
``tests/wide/kernels/test_scripts.py`` runs it.

``--reduce-tiles``: the packed reduction's shared memory instead, for every tile of its table (4
groups a step), with its group list and without ("direct"), at o_proj's and down's group widths with
4 and 16 tokens, beside whether the autotuner hook (``autotune.packed_pruner``) keeps the tile.
``--out-tiles``: the same for the persistent prefill product's table (q, gate+up fused; groups of 512, 128
and 32 channels), beside the hook's estimate (``autotune.prune_staged_tiles``).
``--tail-split``: the persistent products compiled with that ``TAIL_SPLIT`` (2: their last round in pieces, a
second K loop); default each product's in the policy (``OUT_TAIL_SPLIT``). ``--pdl``: every kernel compiled for
programmatic dependent launch (``PDL``; ``policy.PDL_KERNELS``), each checked to wait for the kernel before it
(``griddepcontrol.wait``) and to let the next launch; without it, none may.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import sys
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[1] / p) for p in ("plugins/wide", ".")]

H200_SHARED = 232448  # bytes of shared memory a program may take on the H200 (sm_90)
D, FFN, GROUP, HEADS, HEAD_DIM, ATTN_GROUP = 4096, 14336, 128, 32, 128, 4


def compile_for_hopper(kernel, args: dict, constexprs: dict, num_warps: int, num_stages: int) -> dict:
    """Compile the ``@triton.jit`` ``kernel`` for sm_90. ``args``: its runtime arguments by name, a
    pointer as its Triton type ("*bf16"), an integer or a float as its value; ``constexprs``: the rest (a
    parameter with a default that neither gives: its default)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    signature, attrs, consts = {}, {}, dict(constexprs)
    for param in kernel.params:  # a parameter the launch leaves out takes its default
        if param.name not in args and param.name not in consts and param.default is not inspect.Parameter.empty:
            consts[param.name] = param.default
    for i, name in enumerate(kernel.arg_names):
        if name in consts:
            signature[name] = "constexpr"
            continue
        value = args[name]
        if isinstance(value, str) and value.startswith("tensordesc"):  # a host TMA descriptor
            signature[name] = value
        elif isinstance(value, str):  # a pointer: the launcher's tensors are 16-byte aligned
            signature[name] = value
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif isinstance(value, float):
            signature[name] = "fp32"
        elif value == 1:  # specialised to a constant, as the launcher does
            signature[name] = "constexpr"
            consts[name] = 1
        else:
            signature[name] = "i32"
            if value % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
    src = ASTSource(
        fn=kernel,
        signature=signature,
        constexprs={(kernel.arg_names.index(n),): v for n, v in consts.items()},
        attrs=attrs,
    )
    out = triton.compile(
        src, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps, "num_stages": num_stages}
    )
    ttgir = out.asm["ttgir"]
    mma = "wgmma" if "warp_group_dot" in ttgir else "mma" if "nvidia_mma" in ttgir else "none"
    return {
        "mma": mma,
        "async_copies": ttgir.count("async_copy_global_to_local") + ttgir.count("async_tma_copy_global_to_local"),
        "tma_copies": ttgir.count("async_tma_copy_global_to_local"),
        "pdl": all(f"griddepcontrol.{op}" in out.asm["ptx"] for op in ("wait", "launch_dependents")),
        "shared": out.metadata.shared,
        **registers(out.asm["ptx"]),
    }


def registers(ptx: str) -> dict:
    """Registers a thread and spilled bytes (stores + loads), from the ptxas that Triton ships
    (``ptxas -v`` on the kernel's PTX, for sm_90a)."""
    import re
    import subprocess
    import tempfile

    from triton.backends.nvidia.compiler import get_ptxas

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "kernel.ptx"
        path.write_text(ptx)
        cmd = [get_ptxas(90).path, "-v", "--gpu-name", "sm_90a", str(path), "-o", str(Path(tmp) / "kernel.cubin")]
        report = subprocess.run(cmd, capture_output=True, text=True, check=True).stderr
    used = re.search(r"Used (\d+) registers", report)
    spills = [int(n) for n in re.findall(r"(\d+) bytes spill (?:stores|loads)", report)]
    if used is None or len(spills) != 2:
        raise RuntimeError(f"unexpected ptxas report: {report!r}")
    return {"registers": int(used.group(1)), "spill_bytes": sum(spills)}


POINTER_TYPES = {"torch.float32": "*fp32", "torch.float64": "*fp64", "torch.bfloat16": "*bf16", "torch.uint8": "*u8"}


def as_launched(module, kernel_name: str, call) -> tuple[object, dict, dict]:
    """``(kernel, runtime args, constexprs)`` exactly as the wrapper ``call()`` (run on CPU tensors) passes
    them to ``module.kernel_name``'s launch, which is recorded instead of run: so that a compiled case sees the
    Python types the wrapper gives (an int argument equal to 1 is specialised into a constant, a float is not)."""
    kernel, seen = getattr(module, kernel_name), {}

    class Recorder:
        def __getitem__(self, grid):
            return lambda *args, **kwargs: seen.update(args=args, kwargs=kwargs)

    setattr(module, kernel_name, Recorder())
    try:
        call()
    finally:
        setattr(module, kernel_name, kernel)
    runtime = {}
    for name, value in zip(kernel.arg_names, seen["args"], strict=False):
        runtime[name] = POINTER_TYPES[str(value.dtype)] if hasattr(value, "data_ptr") else value
    return kernel, runtime, {k: v for k, v in seen["kwargs"].items() if k in kernel.arg_names}


def tail_descriptor(block_n: int, block_k: int, split: int) -> str:
    """The persistent product's tail descriptor type for a tile (its block rows: ``gemm_out._tail_width``)."""
    from compresskit_wide.kernels import gemm_out

    return f"tensordesc<bf16[{gemm_out._tail_width({'BLOCK_N': block_n, 'TAIL_SPLIT': split})}, {block_k}]>"


def cases(tail_split: int | None = None) -> list[tuple[str, object, dict, dict, int, int, str]]:
    """(name, kernel, runtime args, constexprs, warps, stages, expected MMA kind): the decode defaults
    at M = 1, and the routed decode attention's split kernel at 8k positions, batch 1 (its 4 query
    heads of a KV head are a 16-row tile: the older MMA)."""
    import torch

    from compresskit_wide.kernels import attention_decode, consensus, gemm_out, gemm_reduce, policy, router
    from compresskit_wide.kernels.common import softmax_scale

    bf16, u8 = "*bf16", "*u8"
    # the out-width decode products as their wrappers launch them at one token: q (K packed 4), gate+up fused;
    # each also with the router's decision, the add and the norm in its prologue (256 shares of rank 32)
    x1, wq, w_ffn = (torch.empty(*shape, dtype=torch.bfloat16) for shape in ((1, D), (HEADS * HEAD_DIM, D), (FFN, D)))
    q_mask, ffn_mask = (torch.ones(1, groups, dtype=torch.bool) for groups in (HEADS // ATTN_GROUP, FFN // GROUP))

    def prologue(groups):
        shares = (torch.empty(D // 16, 1, 32), torch.empty(32), torch.empty(2 * groups, 32), torch.empty(2 * groups))
        return (*shares, x1, torch.empty_like(x1), torch.empty(D, dtype=torch.bfloat16), 1e-5)

    tiles = {"q": {"k_pack": 4, "block_n": 16, "block_k": 128}, "gate_up": {"k_pack": 1, "block_n": 64, "block_k": 128}}
    out_kernels = {
        "q": lambda: gemm_out.triton_masked_out_gemm(x1, wq, q_mask, **tiles["q"]),
        "gate_up": lambda: gemm_out.triton_masked_out_gemm(x1, w_ffn, ffn_mask, w_ffn, **tiles["gate_up"]),
        "q decided": lambda: gemm_out.triton_router_norm_out_gemm(
            *prologue(HEADS // ATTN_GROUP), wq, counts=torch.zeros(2, dtype=torch.float64), **tiles["q"]
        ),
        "gate_up decided": lambda: gemm_out.triton_router_norm_out_gemm(
            *prologue(FFN // GROUP), w_ffn, w_ffn, counts=torch.zeros(2, dtype=torch.float64), **tiles["gate_up"]
        ),
    }
    out_kernels = {k: as_launched(gemm_out, "triton_masked_out_gemv_kernel", call) for k, call in out_kernels.items()}
    down = dict(x_ptr=bf16, w_ptr=bf16, mask_ptr=u8, out_ptr=bf16, list_ptr="*i32", M=1, N=D, G=FFN // GROUP)
    down.update(stride_xm=FFN, stride_wn=FFN, stride_mm=FFN // GROUP, stride_om=D)
    # the next router's shares (read only with SHARES): the residual, its w_down (rank 32), the shares
    down.update(res_ptr=bf16, sw_ptr="*fp32", sh_ptr="*fp32", R=32, stride_rm=D)
    o = {**down, "G": HEADS // ATTN_GROUP, "stride_xm": D, "stride_wn": D, "stride_mm": HEADS // ATTN_GROUP}
    tf32 = {"DOT_PRECISION": "tf32"}
    packed = {**tf32, "BLOCK_M": 4, "K_PACK": 4}
    no_shares = {"SHARES": False, "SHARE_N": 16, "BLOCK_R": 32}  # the reductions' epilogue
    listed = {**packed, **no_shares, "DIRECT": False}
    direct = {**packed, **no_shares, "DIRECT": True}
    kv_len, kv_heads = 8192, HEADS // ATTN_GROUP
    attn = dict(q_ptr=bf16, k_ptr=bf16, v_ptr=bf16, lens_ptr="*i32", mask_ptr=u8, m_ptr="*fp32", l_ptr="*fp32")
    attn.update(acc_ptr="*fp32", HQ=HEADS, HKV=kv_heads, S=kv_len, D=HEAD_DIM, SPLITS=32, SPLIT_LEN=kv_len // 32)
    attn.update(scale=softmax_scale(HEAD_DIM), stride_qb=HEADS * HEAD_DIM, stride_qh=HEAD_DIM)
    attn.update(stride_kb=kv_heads * kv_len * HEAD_DIM, stride_kh=kv_len * HEAD_DIM, stride_ks=HEAD_DIM)
    attn.update(stride_mb=HEADS // ATTN_GROUP, HEADS_PER_GROUP=ATTN_GROUP)
    attn_meta = {**tf32, "REP": HEADS // kv_heads, "BLOCK_H": 16, "BLOCK_N": 64, "BLOCK_D": HEAD_DIM}
    # the decode routers (CUDA cores, fp32): the FFN router's decision from 256 shares, counting; with the
    # residual add and the norm; the two-launch router's second launch
    f32, groups = "*fp32", FFN // GROUP
    shares = dict(sh_ptr=f32, bd_ptr=f32, wu_ptr=f32, bu_ptr=f32, out_ptr=u8, cnt_ptr="*fp64", S=D // 16, M=1, R=32)
    shares.update(G=groups, stride_om=groups)
    shares_meta = {"BLOCK_S": D // 16, "BLOCK_R": 32, "BLOCK_G": 32, "COUNT": True, "MARGIN": False}
    norm = {**shares, "x_ptr": bf16, "dx_ptr": bf16, "nw_ptr": bf16, "xn_ptr": bf16, "h_ptr": bf16, "D": D, "eps": 1e-5}
    finish = {k: shares[k] for k in ("bd_ptr", "wu_ptr", "bu_ptr", "out_ptr", "cnt_ptr", "M", "R", "G", "stride_om")}
    finish_meta = {"SPLIT": 32, "DOT_PRECISION": "ieee", "BLOCK_M": 16, "BLOCK_R": 32, "BLOCK_G": 32}
    finish_meta.update(COUNT=True, MARGIN=False)
    # the tile reduction: a decode batch's shared set (64 tokens, one tile, K split 8 ways, rows agreeing) and a
    # 4k prefill in tiles of 64 (each row's own groups read, one split), at the policy's tile
    tiles = dict(x_ptr=bf16, w_ptr=bf16, mask_ptr=u8, list_ptr="*i32", part_ptr="*fp32", out_ptr=bf16, N=D)
    tiles.update(G=FFN // GROUP, stride_xm=FFN, stride_wn=FFN, stride_mm=FFN // GROUP)
    shared_set = {**tiles, "M": 64, "SPLIT_K": 8, "SEQ": 64, "TILE": 64, "TILES_PER_SEQ": 1}
    prefill = {**tiles, "M": 4096, "SPLIT_K": 1, "SEQ": 4096, "TILE": 64, "TILES_PER_SEQ": 64}
    o_set = {**shared_set, "G": HEADS // ATTN_GROUP, "stride_xm": D, "stride_wn": D, "stride_mm": HEADS // ATTN_GROUP}
    tile_meta = {**tf32, "BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 128, "WIDE_ROWS": False}
    # the persistent prefill products at 4k tokens: q with k and v under it, gate+up fused (TMA weight tiles)
    desc = "tensordesc<bf16[128, 64]>"
    persistent = dict(x_ptr=bf16, w_desc=desc, wu_desc=desc, out_ptr=bf16, order_ptr="*i32", counts_ptr="*i32")
    # the tail's pieces, each product's
    split = {fused: tail_split or policy.out_tail_split(fused) for fused in (False, True)}
    q_tail = tail_descriptor(128, 64, split[False])
    persistent.update(w_tail_desc=q_tail, wu_tail_desc=q_tail)
    persistent.update(M=4096, K=D, M_BUCKET=4096, stride_xm=D)
    q_prefill = {**persistent, "N": (HEADS + 2 * 8) * HEAD_DIM, "GW": ATTN_GROUP * HEAD_DIM, "G": HEADS // ATTN_GROUP}
    q_prefill.update(LAUNCHED=HEADS // ATTN_GROUP + 4, stride_om=(HEADS + 2 * 8) * HEAD_DIM)
    gu_desc = "tensordesc<bf16[64, 64]>"
    gu_prefill = {
        **persistent,
        "w_desc": gu_desc,
        "wu_desc": gu_desc,
        "N": FFN,
        "GW": GROUP,
        "G": FFN // GROUP,
        "LAUNCHED": FFN // GROUP,
        "stride_om": FFN,
    }
    gu_prefill["w_tail_desc"] = gu_prefill["wu_tail_desc"] = tail_descriptor(64, 64, split[True])
    p_meta = {**tf32, "BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "PER_SM": 1}
    # the consensus kernel as its wrapper launches it: a decode step of 8 sequences (one position, so T is 1),
    # the FFN router's margins, the set capped at one group and following the tokens' count, counted
    margin = torch.zeros(8, FFN // GROUP)
    agree = as_launched(
        consensus,
        "triton_consensus_kernel",
        lambda: consensus.triton_consensus(
            margin,
            8,
            cap=1,
            quorum=0.0,
            share_set=True,
            valid=torch.ones(8, dtype=torch.bool),
            counts=torch.zeros(2, dtype=torch.float64),
            follow=1.25,
        ),
    )
    return [
        ("q, K packed 4", *out_kernels["q"], 4, 4, "wgmma"),
        ("gate+up fused, weight rows", *out_kernels["gate_up"], 4, 4, "wgmma"),
        ("q, K packed 4, the decision in its prologue", *out_kernels["q decided"], 4, 4, "wgmma"),
        ("gate+up fused, the decision in its prologue", *out_kernels["gate_up decided"], 4, 4, "wgmma"),
        ("down, 4 groups packed, listed", gemm_reduce.triton_masked_reduce_gemm_kernel, down,
         {**listed, "GW": GROUP, "BLOCK_G": 128, "BLOCK_N": 16, "BLOCK_K": 64}, 4, 6, "wgmma"),
        ("o, 4 groups packed, listed (a table tile)", gemm_reduce.triton_masked_reduce_gemm_kernel, o,
         {**listed, "GW": ATTN_GROUP * HEAD_DIM, "BLOCK_G": 16, "BLOCK_N": 16, "BLOCK_K": 128}, 4, 4, "wgmma"),
        ("o, 4 groups a step, no list (a table tile)", gemm_reduce.triton_masked_reduce_gemm_kernel, o,
         {**direct, "GW": ATTN_GROUP * HEAD_DIM, "BLOCK_G": 16, "BLOCK_N": 16, "BLOCK_K": 128}, 4, 4, "wgmma"),
        ("down, listed, handing on the next router's shares", gemm_reduce.triton_masked_reduce_gemm_kernel, down,
         {**listed, "GW": GROUP, "BLOCK_G": 128, "BLOCK_N": 16, "BLOCK_K": 64, "SHARES": True}, 4, 6, "wgmma"),
        ("o, 4 groups a step, no list, handing on shares", gemm_reduce.triton_masked_reduce_gemm_kernel, o,
         {**packed, **no_shares, "DIRECT": True, "GW": ATTN_GROUP * HEAD_DIM, "BLOCK_G": 16, "BLOCK_N": 32,
          "BLOCK_K": 128, "SHARES": True}, 4, 4, "wgmma"),
        ("down, a shared set of 64 tokens, K split 8", gemm_reduce.triton_tile_reduce_kernel, shared_set,
         {**tile_meta, "GW": GROUP, "BLOCK_G": 128, "ONE_SPLIT": False, "ROW_MASKS": False}, 4, 4, "wgmma"),
        ("o, a shared set of 64 tokens, K split 8", gemm_reduce.triton_tile_reduce_kernel, o_set,
         {**tile_meta, "GW": ATTN_GROUP * HEAD_DIM, "BLOCK_G": 16, "ONE_SPLIT": False, "ROW_MASKS": False}, 4, 4,
         "wgmma"),
        ("down, 4k prefill in tiles of 64, own groups", gemm_reduce.triton_tile_reduce_kernel, prefill,
         {**tile_meta, "GW": GROUP, "BLOCK_G": 128, "ONE_SPLIT": True, "ROW_MASKS": True}, 4, 4, "wgmma"),
        ("q prefill, 4k, persistent (TMA weight)", gemm_out.triton_persistent_out_gemm_kernel, q_prefill,
         {**p_meta, "FUSE_SWIGLU": False, "GROUPS_P2": 16, "TAIL_SPLIT": split[False]}, 8, 4, "wgmma"),
        ("gate+up prefill, 4k, persistent (TMA weights)", gemm_out.triton_persistent_out_gemm_kernel, gu_prefill,
         {**p_meta, "FUSE_SWIGLU": True, "BLOCK_N": 64, "GROUPS_P2": 128, "TAIL_SPLIT": split[True]}, 8, 4,
         "wgmma"),
        ("attention decode split, 8k, batch 1 (defaults)", attention_decode.triton_attn_decode_split_kernel, attn,
         attn_meta, 4, 3, "mma"),
        ("router: decision from shares, counting", router.triton_router_shares_kernel, shares, shares_meta, 4, 1,
         "none"),
        ("router: from shares with the add and norm", router.triton_router_norm_shares_kernel, norm,
         {**shares_meta, "BLOCK_D": D}, 4, 1, "none"),
        ("router: second launch, counting", router.triton_router_finish_kernel, {**finish, "ws_ptr": f32},
         finish_meta, 4, 1, "none"),
        ("consensus: 8 sequences, a cap of 1 group, following", *agree, 4, 1, "none"),
    ]  # fmt: skip


def tile_key(c) -> tuple:
    """A ``triton.Config``'s tile, warps and stages, comparable."""
    return tuple(c.kwargs.items()), c.num_warps, c.num_stages


def tile_row(c, table: list, kept: list, shared: int, head: str, note: str = "", **fields) -> dict:
    """The row (``fields``, then the tile, its shared memory, whether it is in ``table`` and whether the hook
    ``kept`` it) of a compiled tile ``c``, printed after ``head`` (and ``note``)."""
    row = {
        **fields, "tile": c.kwargs, "warps": c.num_warps, "stages": c.num_stages, "shared": shared,
        "in_table": tile_key(c) in {tile_key(t) for t in table}, "kept": tile_key(c) in {tile_key(k) for k in kept},
    }  # fmt: skip
    status = ("kept" if row["kept"] else "pruned") + ("" if row["in_table"] else " (the hook's own)")
    print(
        f"{head} {c.kwargs} w{c.num_warps} s{c.num_stages}  shared {shared / 1024:6.1f} KB{note}  {status}", flush=True
    )
    return row


def reduce_tiles() -> list[dict]:
    """Every tile of the packed reduction's table (4 groups a step), listed and direct, at o's (512
    inputs a group) and down's (128) widths with 4 and 16 tokens, and any tile the autotuner hook
    (``autotune.packed_pruner``) makes of its own where none fits: its shared memory compiled for
    sm_90, and whether the hook keeps it."""
    import torch

    from compresskit_wide.kernels import autotune, policy

    name, kernel, runtime, constexprs, *_ = next(c for c in cases() if c[0].startswith("o, 4 groups packed"))
    table = autotune.configs(policy.per_packing(policy.REDUCE_DECODE_ROWS, 4))
    rows = []
    for direct in (False, True):
        for gw, tokens in ((512, 4), (512, 16), (128, 4), (128, 16)):
            named = {"GW": gw, "x_ptr": torch.empty(1, dtype=torch.bfloat16)}
            hook = autotune.packed_pruner("BLOCK_K", unrolled_group=not direct)
            kept = hook(table, named, K_PACK=4, BLOCK_M=tokens)
            variant = "direct" if direct else "listed"
            for c in table + [c for c in kept if tile_key(c) not in {tile_key(t) for t in table}]:
                meta = {**constexprs, **c.kwargs, "GW": gw, "BLOCK_M": tokens, "DIRECT": direct}
                got = compile_for_hopper(kernel, runtime, meta, c.num_warps, c.num_stages)
                head = f"{variant:6s} width {gw:3d} tokens {tokens:2d}"
                rows.append(tile_row(c, table, kept, got["shared"], head, variant=variant, group_width=gw,
                                     tokens=tokens))  # fmt: skip
    return rows


def out_tiles(tail_split: int | None = None) -> list[dict]:
    """Every tile of the persistent prefill product's table, q alone and gate+up fused, at group widths of
    512, 128 and 32 channels, and any tile the autotuner hook (``autotune.prune_staged_tiles``) makes of its
    own (narrowed to a group, or with fewer stages): its shared memory compiled for sm_90, beside the
    hook's estimate and whether the hook keeps it."""
    import torch

    from compresskit_wide.kernels import autotune, policy

    named_cases = {c[0]: c for c in cases(tail_split)}
    table = autotune.configs(policy.OUT_PERSISTENT)
    compiled, rows = {}, []
    for fused in (False, True):
        name = "gate+up prefill, 4k, persistent (TMA weights)" if fused else "q prefill, 4k, persistent (TMA weight)"
        _, kernel, runtime, constexprs, *_ = named_cases[name]
        product = "gate+up" if fused else "q"
        for gw in (512, 128, 32):
            named = {"GW": gw, "x_ptr": torch.empty(1, dtype=torch.bfloat16)}
            kept = autotune.prune_staged_tiles("BLOCK_N")(table, named, FUSE_SWIGLU=fused)
            for c in table + [c for c in kept if tile_key(c) not in {tile_key(t) for t in table}]:
                if (fused, tile_key(c)) not in compiled:
                    desc = f"tensordesc<bf16[{c.kwargs['BLOCK_N']}, {c.kwargs['BLOCK_K']}]>"
                    tail = tail_descriptor(c.kwargs["BLOCK_N"], c.kwargs["BLOCK_K"], constexprs["TAIL_SPLIT"])
                    args = {**runtime, "w_desc": desc, "wu_desc": desc, "w_tail_desc": tail, "wu_tail_desc": tail}
                    got = compile_for_hopper(kernel, args, {**constexprs, **c.kwargs}, c.num_warps, c.num_stages)
                    compiled[fused, tile_key(c)] = got["shared"]
                estimate = autotune.staged_tile_bytes(c.kwargs, c.num_stages, 2, fused)
                note = f" (estimate {estimate / 1024:6.1f})"
                rows.append(tile_row(c, table, kept, compiled[fused, tile_key(c)], f"{product:7s} width {gw:3d}", note,
                                     product=product, group_width=gw, estimate=estimate))  # fmt: skip
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument("--reduce-tiles", action="store_true", help="the packed reduction's tiles' shared memory")
    parser.add_argument("--out-tiles", action="store_true", help="the persistent prefill tiles' shared memory")
    parser.add_argument(
        "--tail-split", type=int, choices=(1, 2), help="the persistent products' TAIL_SPLIT (default: the policy's)"
    )
    parser.add_argument("--pdl", action="store_true", help="every kernel with PDL (programmatic dependent launch)")
    args = parser.parse_args()
    if os.environ.get("TRITON_INTERPRET") == "1":
        print("error: TRITON_INTERPRET=1 replaces Triton's compiler; run without it", file=sys.stderr)
        return 2
    if args.reduce_tiles or args.out_tiles:
        rows = reduce_tiles() if args.reduce_tiles else out_tiles(args.tail_split)
        if args.json:
            args.json.write_text(json.dumps(rows, indent=2))
        return 0
    rows, failed = [], 0
    for name, kernel, runtime, constexprs, warps, stages, mma in cases(args.tail_split):
        got = compile_for_hopper(kernel, runtime, {**constexprs, "PDL": args.pdl}, warps, stages)
        problems = [
            what
            for what, bad in (
                (f"MMA {got['mma']}, not {mma}", got["mma"] != mma),
                ("no software pipeline", got["async_copies"] == 0 and mma != "none"),  # (CUDA-core kernels: none)
                ("over the H200's shared memory", got["shared"] > H200_SHARED),
                ("registers spilled", got["spill_bytes"] > 0),
                (f"programmatic dependent launch {'missing' if args.pdl else 'present'}", got["pdl"] != args.pdl),
            )
            if bad
        ]
        failed += bool(problems)
        rows.append({"kernel": name, "warps": warps, "stages": stages, **got, "problems": problems})
        print(
            f"{name:48s} {got['mma']:5s} async copies {got['async_copies']:3d}  shared {got['shared'] / 1024:6.1f} KB"
            f"  registers {got['registers']:3d}  spilled {got['spill_bytes']} B"
            f"  {'; '.join(problems) or 'ok'}",
            flush=True,
        )
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
