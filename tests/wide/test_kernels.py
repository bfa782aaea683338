"""WIDE kernels against their PyTorch references: odd shapes, all-off / all-on / ragged masks,
groups spanning several tiles, outputs poisoned first. On the CPU they run in Triton's
interpreter (TRITON_INTERPRET=1, set by conftest); on a GPU, natively (bf16 too)."""

import pytest
import torch

triton = pytest.importorskip("triton")

from compresskit.errors import KernelUnavailableError  # noqa: E402
from compresskit_wide import kernels  # noqa: E402
from compresskit_wide.kernels.gemm_out import torch_masked_out_gemm, triton_masked_out_gemm  # noqa: E402
from compresskit_wide.kernels.layout import torch_routing_layout, triton_routing_layout  # noqa: E402

pytestmark = pytest.mark.triton
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SPARSITIES = [0.0, 0.5, 0.9, 1.0]


def random_mask(m, g, sparsity, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.rand(m, g, generator=gen) >= sparsity).to(DEVICE)


@pytest.mark.parametrize("m", [1, 2, 3, 5, 16, 17, 1000])
@pytest.mark.parametrize("sparsity", SPARSITIES)
def test_routing_layout_matches_reference_exactly(m, sparsity):
    mask = random_mask(m, 7, sparsity, seed=m)
    got = triton_routing_layout(mask)
    ref = torch_routing_layout(mask)
    for a, b in zip(got, ref, strict=True):
        assert a.dtype == b.dtype and torch.equal(a.cpu(), b.cpu())
    order, counts, groups, n_active = got
    assert order.is_contiguous() and order.shape == (7, m)
    for g in range(7):  # active tokens first, each partition in token order
        active = order[g, : counts[g]].cpu()
        assert bool(mask[active.long(), g].all())
        assert torch.equal(active, torch.sort(active).values)


@pytest.mark.parametrize(
    ("m", "k", "n", "groups"), [(1, 40, 64, 2), (3, 64, 96, 3), (17, 48, 64, 4), (9, 72, 48, 1), (33, 32, 256, 2)]
)
@pytest.mark.parametrize("sparsity", SPARSITIES)
@pytest.mark.parametrize("fuse", [False, True])
def test_masked_out_gemm_matches_reference(m, k, n, groups, sparsity, fuse):
    gen = torch.Generator().manual_seed(m * 7 + n)
    x = torch.randn(m, k, generator=gen).to(DEVICE)
    w = torch.randn(n, k, generator=gen).to(DEVICE)
    w_up = torch.randn(n, k, generator=gen).to(DEVICE) if fuse else None
    mask = random_mask(m, groups, sparsity, seed=m + groups)
    # poison the output and a guard region after it: every element of out must be written,
    # nothing beyond it
    buf = torch.full((m + 2, n), float("nan"), device=DEVICE)
    got = triton_masked_out_gemm(x, w, mask, w_up, out=buf[:m], block_m=16, block_n=16, block_k=16)
    ref = torch_masked_out_gemm(x, w, mask, w_up)
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)  # fp32 accumulation both sides
    inactive = ~mask.repeat_interleave(n // groups, dim=-1)
    assert torch.count_nonzero(got[inactive]) == 0  # inactive groups are exactly zero
    assert torch.isnan(buf[m:]).all()


@pytest.mark.skipif(DEVICE != "cuda", reason="bf16 dot products need a GPU (the CPU interpreter computes in numpy)")
@pytest.mark.parametrize("fuse", [False, True])
def test_masked_out_gemm_bf16(fuse):
    x = torch.randn(13, 256, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(512, 256, device="cuda", dtype=torch.bfloat16)
    w_up = torch.randn(512, 256, device="cuda", dtype=torch.bfloat16) if fuse else None
    mask = random_mask(13, 4, 0.5)
    got = triton_masked_out_gemm(x, w, mask, w_up)
    ref = torch_masked_out_gemm(x, w, mask, w_up)
    torch.testing.assert_close(got.float(), ref.float(), rtol=2e-2, atol=2e-2)


def test_dispatch():
    x = torch.randn(5, 32, device=DEVICE)
    w = torch.randn(64, 32, device=DEVICE)
    mask = random_mask(5, 4, 0.5)
    ref = torch_masked_out_gemm(x, w, mask)
    for backend in ("torch", "triton", "auto"):
        torch.testing.assert_close(kernels.masked_out_gemm(x, w, mask, backend=backend), ref, rtol=1e-4, atol=1e-4)
    layout = kernels.routing_layout(mask, backend="triton")
    torch.testing.assert_close(
        kernels.masked_out_gemm(x, w, mask, layout=layout, backend="triton"), ref, rtol=1e-4, atol=1e-4
    )
    with pytest.raises(ValueError, match="allowed: auto, torch, triton"):
        kernels.masked_out_gemm(x, w, mask, backend="cuda")


def test_triton_backend_refuses_clearly_when_it_cannot_run(monkeypatch):
    monkeypatch.setattr(kernels, "triton_available", lambda: "no CUDA device")
    with pytest.raises(KernelUnavailableError, match="backend 'triton': no CUDA device"):
        kernels.routing_layout(torch.ones(2, 2, dtype=torch.bool), backend="triton")
    # auto falls back to the reference
    assert kernels.routing_layout(torch.ones(2, 2, dtype=torch.bool), backend="auto")[1].tolist() == [2, 2]


@pytest.mark.parametrize(
    ("m", "k", "n", "groups"), [(1, 64, 48, 4), (2, 96, 32, 3), (5, 128, 64, 2), (17, 64, 40, 4), (16, 256, 16, 8)]
)
@pytest.mark.parametrize("sparsity", SPARSITIES)
def test_masked_reduce_gemm_matches_reference(m, k, n, groups, sparsity):
    from compresskit_wide.kernels.gemm_reduce import torch_masked_reduce_gemm, triton_masked_reduce_gemm

    gen = torch.Generator().manual_seed(m * 5 + k)
    x = torch.randn(m, k, generator=gen).to(DEVICE)
    w = torch.randn(n, k, generator=gen).to(DEVICE)
    mask = random_mask(m, groups, sparsity, seed=k + m)
    buf = torch.full((m + 2, n), float("nan"), device=DEVICE)
    # block_k 16 < group width: each group spans several K blocks
    got = triton_masked_reduce_gemm(x, w, mask, out=buf[:m], block_m=16, block_n=16, block_k=16)
    ref = torch_masked_reduce_gemm(x, w, mask)
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)
    if sparsity == 1.0:
        assert torch.count_nonzero(got) == 0  # no active group: nothing contributes
    assert torch.isnan(buf[m:]).all()


def test_reduce_dispatch_prefill_uses_the_dense_product():
    x = torch.randn(40, 64, device=DEVICE)
    w = torch.randn(32, 64, device=DEVICE)
    mask = random_mask(40, 4, 0.5)
    ref = kernels.torch_masked_reduce_gemm(x, w, mask)
    for backend in ("auto", "torch", "triton"):
        torch.testing.assert_close(kernels.masked_reduce_gemm(x, w, mask, backend=backend), ref, rtol=1e-4, atol=1e-4)
