"""The fused routing decision against ``decide(GroupRouter(x))``."""

import pytest
import torch

pytest.importorskip("triton")

from kernel_helpers import DEVICE  # noqa: E402

from compresskit.routing import GroupRouter, decide  # noqa: E402
from compresskit_wide.kernels.router import (  # noqa: E402
    _COUNTERS,
    torch_router_decide,
    triton_router_decide,
)


def router_counters(device) -> torch.Tensor:
    """The one-launch kernel's counters on ``device`` ("cuda" finds those of "cuda:0")."""
    return next(c for d, c in _COUNTERS.items() if d.type == torch.device(device).type)


pytestmark = pytest.mark.triton


@pytest.mark.parametrize("m", [1, 3, 17, 40])
@pytest.mark.parametrize(("d", "rank", "groups"), [(200, 8, 3), (96, 32, 8), (64, 5, 130)])
@pytest.mark.parametrize("bias", [0.0, 50.0, -50.0])
@pytest.mark.parametrize(("split", "block_g"), [(None, None), (1, None), (3, 16), (3, 128)])
def test_matches_the_router_and_decide(m, d, rank, groups, bias, split, block_g):
    """D no multiple of the K step, a rank below tl.dot's 16 and above it, more groups than a
    program's block; biases that make every group execute (+50), none (-50) or about half (0); in
    one launch, with D in three shares, with the default split; 16 groups a program or 128."""
    torch.manual_seed(m + d + groups)
    router = GroupRouter(d, groups, rank).to(DEVICE)
    with torch.no_grad():
        router.up.bias.view(groups, 2)[:, 0] = bias  # the execute logits
    x = torch.randn(2, m, d, device=DEVICE)
    ref = decide(router(x), sample=False, tau=1.0).reshape(2 * m, groups)
    args = (x.reshape(2 * m, d), router.down.weight, router.down.bias, router.up.weight, router.up.bias)
    assert torch.equal(torch_router_decide(*args), ref)
    got = triton_router_decide(*args, split=split, block_g=block_g)
    assert got.dtype == torch.float32 and torch.equal(got, ref)
    # both steps in one launch (the last program of a token block decides): the same decisions, twice
    # over (its counters are back at zero after each call)
    for _ in range(2):
        one = triton_router_decide(*args, split=split, block_g=block_g, one_launch=True)
        assert torch.equal(one, ref)
    assert not router_counters(DEVICE).any()
    if split is None:  # as a bool mask (what the executor asks for)
        assert torch.equal(torch_router_decide(*args, as_bool=True), ref.bool())
        as_bool = triton_router_decide(*args, block_g=block_g, as_bool=True)
        assert as_bool.dtype == torch.bool and torch.equal(as_bool, ref.bool())
    if bias:
        assert torch.all(got == (1.0 if bias > 0 else 0.0))


def test_validates_its_tensors():
    x, wd, bd = torch.zeros(2, 8), torch.zeros(4, 8), torch.zeros(4)
    with pytest.raises(ValueError, match="router tensors do not fit"):
        triton_router_decide(x, wd, bd, torch.zeros(6, 4), torch.zeros(5))
    with pytest.raises(ValueError, match="router tensors do not fit"):
        triton_router_decide(x, wd.half(), bd, torch.zeros(6, 4), torch.zeros(6))
    with pytest.raises(ValueError, match="split must be >= 1, got 0"):
        triton_router_decide(x, wd, bd, torch.zeros(6, 4), torch.zeros(6), split=0)
    with pytest.raises(ValueError, match="block_g must be a power of two >= 16, got 24"):
        triton_router_decide(x, wd, bd, torch.zeros(6, 4), torch.zeros(6), block_g=24)


@pytest.mark.gpu
def test_one_launch_router_in_a_cuda_graph():
    """Captured in a CUDA graph, the one-launch router decides each replay's input as the reference
    does and leaves its counters at zero; captured before its counters exist, it falls back to the
    two launches (a graph cannot allocate them), with the same decisions."""
    from compresskit.routing import GroupRouter
    from compresskit_wide.kernels import router as router_module

    router = GroupRouter(300, 40, 8).to("cuda")
    w = (router.down.weight, router.down.bias, router.up.weight, router.up.bias)
    x = torch.randn(3, 300, device="cuda")
    for fresh in (False, True):
        if fresh:
            router_module._COUNTERS.clear()
        else:
            triton_router_decide(x, *w, one_launch=True)  # its counters are made outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = triton_router_decide(x, *w, one_launch=True)
        for i in range(10):
            x.copy_(torch.randn(3, 300, device="cuda", generator=torch.Generator("cuda").manual_seed(i)))
            graph.replay()
            assert torch.equal(out, torch_router_decide(x, *w))
        if not fresh:
            assert not router_counters("cuda").any()


def test_one_launch_router_compiles_for_hopper_with_release_acquire_counting():
    """Compiled for sm_90 (the compiler, not the interpreter; no GPU needed) at Llama-3.1-8B's decode
    shape: the count is an acquire-release atomic at GPU scope, the reset a relaxed exchange, the
    last program reads the shares past L1 (``ld.global.cg``), and nothing spills."""
    import subprocess
    import sys
    from pathlib import Path

    codegen = Path(__file__).parents[3] / "benchmarks" / "hopper_codegen.py"
    script = f"""
import re, runpy, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from compresskit_wide.kernels import policy
from compresskit_wide.kernels.router import triton_router_one_launch_kernel as k
ptrs = dict(x_ptr="*bf16", wd_ptr="*fp32", ws_ptr="*fp32", count_ptr="*i32", bd_ptr="*fp32", wu_ptr="*fp32",
            bu_ptr="*fp32", out_ptr="*u8")
consts = dict(SPLIT=policy.ROUTER_DECODE_PROGRAMS, DOT_PRECISION="ieee", BLOCK_M=16, BLOCK_K=128, BLOCK_R=32,
              BLOCK_G=32, SUM_UNROLL=policy.ROUTER_SUM_UNROLL)
sig = {{n: "constexpr" if n in consts else ptrs.get(n, "i32") for n in k.arg_names}}
src = ASTSource(fn=k, signature=sig, constexprs={{(k.arg_names.index(n),): v for n, v in consts.items()}})
out = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={{"num_warps": 4, "num_stages": 3}})
ptx = out.asm["ptx"]
values = dict(ptrs, M=1, D=4096, R=32, G=112, CHUNK=32, stride_xm=4096, stride_om=112)  # as launched: M=1 constant
use = runpy.run_path({str(codegen)!r})["compile_for_hopper"](k, values, consts, 4, 3)
print(" ".join(sorted(set(re.findall(r"atom\\.[\\w.]+|ld\\.global\\.cg", ptx)))), use["registers"], use["spill_bytes"])
"""
    env = {k: v for k, v in __import__("os").environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    ops, regs, spills = proc.stdout.strip().split("\n")[-1].rsplit(" ", 2)
    assert set(ops.split()) == {"atom.global.gpu.acq_rel.add.u32", "atom.global.gpu.relaxed.exch.b32", "ld.global.cg"}
    assert regs.isdigit() and 0 < int(regs) <= 255 and spills == "0", proc.stdout
