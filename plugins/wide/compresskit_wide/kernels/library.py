"""The routed ops as PyTorch operators (``torch.ops.compresskit_wide.*``), so that ``torch.compile``
traces a whole runtime step with them inside: each runs as one opaque call (its kernel, dense
fallback or reference, as ``ops`` dispatches by ``backend``), and its fake implementation gives the
output's shape and dtype to the tracer. Importing this module registers them; the blocks call them
the same way eagerly, compiled, at prefill and at decode.

They are defined with ``torch.library.Library`` (schema inferred from the signature, one
``CompositeExplicitAutograd`` kernel, a fake kernel), not ``torch.library.custom_op``, whose Python
wrapper costs each call about ten times the host time of a plain dispatch: a prefill of a 32-layer
model calls these ops a few hundred times outside any CUDA graph. They are for inference: no
autograd formula (training runs the routed modules, not these ops)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from compresskit_wide.kernels import ops

_LIB = torch.library.Library("compresskit_wide", "DEF")  # the registrations live as long as it does


def _register(fn: Callable) -> Callable:
    """``fn`` as the operator ``compresskit_wide::<its name>``: the decorated function's
    ``register_fake`` registers its fake kernel."""
    name = fn.__name__
    _LIB.define(name + torch.library.infer_schema(fn, mutates_args=()))
    _LIB.impl(name, fn, "CompositeExplicitAutograd")
    fn.register_fake = lambda fake: torch.library.register_fake(f"compresskit_wide::{name}", fake, lib=_LIB)
    return fn


@_register
def router_decide(
    x: torch.Tensor, w_down: torch.Tensor, b_down: torch.Tensor, w_up: torch.Tensor, b_up: torch.Tensor, backend: str
) -> torch.Tensor:
    """``x: [M, D]`` -> the router's execute mask ``[M, G]`` (bool)."""
    return ops.router_decide(x, w_down, b_down, w_up, b_up, backend=backend, as_bool=True)


@router_decide.register_fake
def _(x, w_down, b_down, w_up, b_up, backend):
    return x.new_empty(x.shape[0], w_up.shape[0] // 2, dtype=torch.bool)


@_register
def masked_out_gemm(
    x: torch.Tensor,
    w: torch.Tensor,
    mask: torch.Tensor,
    w_up: torch.Tensor | None,
    zero_inactive: bool,
    backend: str,
) -> torch.Tensor:
    """``x: [M, K]`` -> ``[M, N]``, only the active output groups (``ops.masked_out_gemm``)."""
    return ops.masked_out_gemm(x, w, mask, w_up, zero_inactive=zero_inactive, backend=backend)


@masked_out_gemm.register_fake
def _(x, w, mask, w_up, zero_inactive, backend):
    return x.new_empty(x.shape[0], w.shape[0])


@_register
def masked_reduce_gemm(
    x: torch.Tensor, w: torch.Tensor, mask: torch.Tensor, input_is_masked: bool, backend: str
) -> torch.Tensor:
    """``x: [M, K]`` -> ``[M, N]`` over the active input groups only (``ops.masked_reduce_gemm``)."""
    return ops.masked_reduce_gemm(x, w, mask, input_is_masked=input_is_masked, backend=backend)


@masked_reduce_gemm.register_fake
def _(x, w, mask, input_is_masked, backend):
    return x.new_empty(x.shape[0], w.shape[0])


@_register
def routed_attention_decode(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seq_lens: torch.Tensor, mask: torch.Tensor, backend: str
) -> torch.Tensor:
    """``q: [B, Hq, D]`` over ``k, v: [B, Hkv, S, D]`` -> ``[B, Hq, D]``, the active heads only."""
    return ops.routed_attention_decode(q, k, v, seq_lens, mask, backend=backend).contiguous()


@routed_attention_decode.register_fake
def _(q, k, v, seq_lens, mask, backend):
    return q.new_empty(q.shape)


@_register
def routed_attention_prefill(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, backend: str
) -> torch.Tensor:
    """``q: [B, Hq, T, D]`` causal over ``k, v: [B, Hkv, T, D]`` -> ``[B, T, Hq, D]`` (the layout o
    reads; the kernel writes it so), the active (token, head) pairs only."""
    return ops.routed_attention_prefill(q, k, v, mask, backend=backend).transpose(1, 2).contiguous()


@routed_attention_prefill.register_fake
def _(q, k, v, mask, backend):
    b, h, t, d = q.shape
    return q.new_empty(b, t, h, d)
