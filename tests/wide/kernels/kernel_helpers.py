"""What the kernel tests share: the device they run on, the sparsities they sweep, random masks, a router's
shares."""

import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SPARSITIES = [0.0, 0.5, 0.9, 1.0]  # all on, ragged, nearly all off, all off
NEEDS_GPU = "bf16 dot products need a GPU (the CPU interpreter computes in numpy)"


def random_mask(m, g, sparsity, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.rand(m, g, generator=gen) >= sparsity).to(DEVICE)


def poisoned(m, n, dtype=torch.float32):
    """An output buffer of ``m`` rows plus a guard of 2, all NaN: every element of ``buf[:m]`` must be
    written, nothing after it."""
    return torch.full((m + 2, n), float("nan"), device=DEVICE, dtype=dtype)


def prologue_inputs(m, k, groups, decided, dtype=torch.float32, seed=0):
    """A router's shares of ``x + delta`` (rank 8) and what ``router_norm_out_gemm`` reads before its product:
    ``(shares, b_down, route_w, route_b, x, delta, norm_w, eps)``; ``decided``: "ragged" (the router's own
    decision), "all on" or "all off" (its logits' biases forcing one side)."""
    from compresskit.routing import GroupRouter
    from compresskit_wide.kernels.gemm_reduce import torch_router_shares

    torch.manual_seed(seed)
    router = GroupRouter(k, groups, 8).to(DEVICE)
    route_b = router.up.bias.detach().clone()
    if decided != "ragged":
        route_b[0 if decided == "all on" else 1 :: 2] += 1e4  # (row 2g: execute, 2g + 1: skip)
    x, delta = (torch.randn(m, k, device=DEVICE).to(dtype) for _ in range(2))
    norm_w = (1 + torch.randn(k, device=DEVICE) / 4).to(dtype)
    shares = torch_router_shares(x + delta, router.down.weight.detach())
    return shares, router.down.bias.detach(), router.up.weight.detach(), route_b, x, delta, norm_w, 1e-5
