"""What the kernel tests share: the device they run on, the sparsities they sweep, random masks."""

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
