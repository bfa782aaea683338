"""Which tokens are real: a context that training stages and the evaluator set, so that a
dynamic pruner can leave padding out of its sparsity statistics and losses.

    from compresskit.tokens import valid_tokens
    mask = valid_tokens()   # [B, T] bool for the forward pass in flight, or None (all real)
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

import torch

_VALID: contextvars.ContextVar[torch.Tensor | None] = contextvars.ContextVar("compresskit_valid_tokens", default=None)


def valid_tokens() -> torch.Tensor | None:
    """The ``[B, T]`` bool mask of real tokens of the forward pass in flight, or None."""
    return _VALID.get()


@contextlib.contextmanager
def token_mask(mask: torch.Tensor | None) -> Iterator[None]:
    """Declare which tokens of the next forward passes are real (``[B, T]``, nonzero = real)."""
    token = _VALID.set(None if mask is None else mask.bool())
    try:
        yield
    finally:
        _VALID.reset(token)


def declared_mask(x: torch.Tensor) -> torch.Tensor | None:
    """The declared real-token mask for activations ``x: [B, T, ...]`` as a bool tensor ``[B, T]``
    on ``x``'s device, or None when every token is real (none declared, or it does not fit this
    pass, e.g. a decode step). No kernel launch when none is declared."""
    mask = _VALID.get()
    if mask is None or mask.shape != x.shape[:2]:
        return None
    return mask.to(device=x.device)


def mask_for(x: torch.Tensor) -> torch.Tensor:
    """The valid mask for activations ``x: [B, T, ...]`` as a float tensor ``[B, T]`` (ones when
    no mask is declared or it does not fit this pass, e.g. a decode step)."""
    mask = declared_mask(x)
    if mask is None:
        return torch.ones(x.shape[:2], device=x.device, dtype=torch.float32)
    return mask.to(dtype=torch.float32)
