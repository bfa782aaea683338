"""The routed operators, dispatched by backend, each registered as a PyTorch operator
(``torch.ops.compresskit_wide.<name>``) so that ``torch.compile`` traces a whole runtime step with
them inside (one opaque call each; the fake implementation gives the tracer the output's shape and
dtype). The runtime's blocks call the operators; the tests and the benchmarks call the same
functions directly.

``backend``: "torch" runs the references (``torch_*``: the semantics, the CPU path, the autograd
path); "triton" the Triton kernels (``triton_*``; an error naming the reason where they cannot
run); "auto" on CUDA tensors the kernel where ``policy.use_kernel`` says it was measured faster
and the op's dense fallback (``dense_*``: cuBLAS / SDPA in the input dtype, inactive outputs zeroed)
elsewhere, and the references on the CPU.

The operators are defined with ``torch.library.Library`` (schema inferred from the signature, one
``CompositeExplicitAutograd`` kernel, a fake kernel), not ``torch.library.custom_op``, whose Python
wrapper costs each call about ten times the host time of a plain dispatch: a prefill of a 32-layer
model calls them a few hundred times outside any CUDA graph. They are for inference: no autograd
formula (training runs the routed modules, not these operators).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from compresskit_wide.kernels import policy
from compresskit_wide.kernels.attention_decode import (
    dense_routed_attention_decode,
    torch_routed_attention_decode,
    triton_routed_attention_decode,
)
from compresskit_wide.kernels.attention_prefill import (
    dense_routed_attention_prefill,
    torch_routed_attention_prefill,
    triton_routed_attention_prefill,
)
from compresskit_wide.kernels.common import TritonUnavailableError, cdiv, interpreted
from compresskit_wide.kernels.consensus import (
    check_consensus,
    torch_consensus,
    triton_consensus,
)
from compresskit_wide.kernels.gemm_out import (
    dense_masked_out_gemm,
    out_kernel_takes,
    torch_masked_out_gemm,
    triton_masked_out_gemm,
    triton_router_norm_out_gemm,
)
from compresskit_wide.kernels.gemm_reduce import (
    dense_masked_reduce_gemm,
    share_slots,
    torch_group_masked_input,
    torch_masked_reduce_gemm,
    torch_router_shares,
    triton_masked_reduce_gemm,
    triton_tile_reduce_gemm,
)
from compresskit_wide.kernels.router import (
    torch_count,
    torch_router_decide,
    torch_router_decide_from_shares,
    torch_router_norm_from_shares,
    triton_router_decide,
    triton_router_decide_from_shares,
    triton_router_norm_from_shares,
    triton_router_shares,
)

BACKENDS = ("auto", "torch", "triton")
_LIB = torch.library.Library("compresskit_wide", "DEF")  # the registrations live as long as it does


def _operator(fake: Callable, mutates: tuple[str, ...] = ()):
    """Register the decorated function as the operator ``compresskit_wide::<its name>`` with the
    fake kernel ``fake`` (same parameters; returns empty tensors of the output's shape); ``mutates``:
    the parameters it writes in place."""

    def register(fn: Callable) -> Callable:
        _LIB.define(fn.__name__ + torch.library.infer_schema(fn, mutates_args=mutates))
        _LIB.impl(fn.__name__, fn, "CompositeExplicitAutograd")
        torch.library.register_fake(f"compresskit_wide::{fn.__name__}", fake, lib=_LIB)
        return fn

    return register


def triton_available() -> str | None:
    """None when Triton kernels can run here, else the reason they cannot."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return "triton is not installed"
    if not torch.cuda.is_available() and not interpreted():
        return "no CUDA device (set TRITON_INTERPRET=1 to run the kernels in Triton's CPU interpreter)"
    return None


def _use_triton(backend: str, *tensors: torch.Tensor) -> bool:
    if backend not in BACKENDS:
        raise ValueError(f"backend {backend!r} is not available; allowed: {', '.join(BACKENDS)}")
    if backend == "torch":
        return False
    reason = triton_available()
    if backend == "triton":
        if reason:
            raise TritonUnavailableError(f"backend 'triton': {reason}")
        return True
    return reason is None and all(t.is_cuda for t in tensors)  # auto


def _choose(backend: str, op: str, rows: int, *tensors: torch.Tensor, **where) -> str:
    """Which implementation of ``op`` runs: "triton" (the kernel: asked for, or under "auto"
    measured faster), "dense" (the fallback under "auto" on CUDA) or "torch" (the reference).
    ``where``: the call's criteria, as ``policy.use_kernel`` takes them."""
    if not _use_triton(backend, *tensors):
        return "torch"
    if backend == "triton":
        return "triton"
    policy.check_gpu(tensors[0].device)
    return "triton" if policy.use_kernel(op, rows, **where) else "dense"


# -- what a block asks before it calls an operator: each the one place its decision is made ----------------------
# (a block passes the backend a question returns to the operator, which then asks nothing again)

ROUTER_SHARE_COLUMNS = policy.ROUTER_SHARE_COLUMNS  # the columns a share of ``router_shares`` sums


def _concrete(backend: str, op: str, rows: int, x: torch.Tensor, **where) -> str | None:
    """The backend a block passes to ``op`` where it runs the kernel's structure (the kernel itself: "triton", or
    its reference: "torch"), or None where "auto" leaves the structure out (:func:`_choose` takes no kernel: on
    the CPU, without Triton, or on a GPU where the kernel was not measured faster)."""
    if backend != "auto":
        return backend
    return "triton" if _choose(backend, op, rows, x, **where) == "triton" else None


def own_shares_backend(backend: str, rows: int, x: torch.Tensor) -> str | None:
    """Whether a block whose router got no shares from the block before computes them itself (``router_shares``,
    so that the decision's launch can take the residual add and the norm): the backend for that launch, or None
    (the router runs whole, after the add)."""
    return _concrete(backend, "router_shares", rows, x)


def routed_attention_backend(backend: str, batch: int, tokens: int, context: int, q: torch.Tensor) -> str | None:
    """Whether the routed attention runs for a ``[batch, tokens]`` step over ``context`` cached positions (only the
    kept heads, zeros for the others): its backend, or None (the runtime's attention over every head; o then reads
    the kept heads). The caller has checked that the step allows it (an unpadded batch, the standard scale)."""
    if tokens == 1:  # (under "auto" on the CPU none: the reference is slower than the runtime's attention)
        return _concrete(backend, "attn_decode", batch, q, context=context)
    return _concrete(backend, "attn_prefill", tokens, q)


def qkv_in_one_product(backend: str, rows: int, shared: bool) -> bool:
    """Whether q, k and v of ``rows`` tokens run as one routed product (k and v its dense rows): at decode sizes
    (the decode kernel, a shared set's too), and at prefill where q would run dense anyway ("auto" below q's
    prefill kernel's range); where q's prefill kernel runs, the stacked product would drag k and v through it."""
    return policy.decode_kernel(rows, shared) or (backend == "auto" and not policy.use_kernel("out", rows))


def handoff_backend(
    backend: str, rows: int, *, groups: int, zeroed: bool, shared: bool, tiled: bool, x: torch.Tensor
) -> str | None:
    """Whether a block's last reduction hands the next router its shares (``masked_reduce_gemm_shares``): its
    backend, or None (``masked_reduce_gemm``; the next router computes its bottleneck itself). ``tiled``: the rows
    agree in tiles of a prefill (tile-coherent routing), whose tile reduction hands nothing on past the decode
    sizes; on the CPU under "auto" the reference's shares would be extra work."""
    if tiled and rows > policy.DECODE_MAX_M:
        return None
    return _concrete(backend, "reduce_handoff", rows, x, groups=groups, zeroed=zeroed, shared=shared)


def zeroes_before_reduce(rows: int, tokens: int) -> bool:
    """Whether a block zeroes the skipped groups of a reduction's input itself (where the select joins its graph):
    a prefill's past the decode kernels' sizes, whose dense fallback would zero them in a pass of its own."""
    return tokens > 1 and rows > policy.DECODE_MAX_M


def group_masked_input(x: torch.Tensor, mask: torch.Tensor, backend: str = "auto") -> torch.Tensor:
    """Zero the inactive groups of ``x``'s last axis: ``x: [B, T, K]``, ``mask: [B, T, K/G]``."""
    _use_triton("torch" if backend == "auto" else backend, x)  # validates the name
    return torch_group_masked_input(x, mask)


def _decision(rows: torch.Tensor, w_up: torch.Tensor, margin: bool) -> torch.Tensor:
    """A fake decision for ``rows.shape[0]`` tokens: bool, or fp32 margins."""
    return rows.new_empty(rows.shape[0], w_up.shape[0] // 2, dtype=torch.float32 if margin else torch.bool)


def _fake_decide(x, w_down, *, b_down, w_route, b_route, counts, count, backend="auto", margin=False):
    return _decision(x, w_route, margin)


@_operator(_fake_decide, mutates=("counts",))
def router_decide(
    x: torch.Tensor,
    w_down: torch.Tensor,
    *,
    b_down: torch.Tensor,
    w_route: torch.Tensor,
    b_route: torch.Tensor,
    counts: torch.Tensor,
    count: bool,
    backend: str = "auto",
    margin: bool = False,
) -> torch.Tensor:
    """``x: [M, D]`` -> execute mask ``[M, G]`` (bool): a ``GroupRouter``'s deterministic decision
    (``w_down: [R, D]``, ``w_route: [2G, R]`` (its ``up``), fp32, with their biases); with ``count`` the M tokens (every
    one real) and the groups they execute are added to ``counts`` (fp64 ``[2]``, in place). (A flag
    and a tensor always passed: an optional tensor written in place, passed as None, is what
    ``torch.compile``'s functionalization does not lower.) ``margin``: the fp32 margins (execute minus
    skip logit) instead, uncounted, for ``consensus_decide``."""
    counts = counts if count and not margin else None
    if _choose(backend, "router", x.shape[0], x) == "triton":
        return triton_router_decide(x, w_down, b_down, w_route, b_route, as_bool=True, margin=margin, counts=counts)
    # the reference is the dense path too
    execute = torch_router_decide(x, w_down, b_down, w_route, b_route, as_bool=True, margin=margin)
    torch_count(execute, counts)
    return execute


def _fake_shares(x, delta, w_down, columns, *, backend="auto"):
    return x.new_empty(cdiv(x.shape[1], columns), x.shape[0], w_down.shape[0], dtype=torch.float32)


@_operator(_fake_shares)
def router_shares(
    x: torch.Tensor, delta: torch.Tensor, w_down: torch.Tensor, columns: int, *, backend: str = "auto"
) -> torch.Tensor:
    """``x, delta: [M, D]`` -> the router bottleneck's shares ``[S, M, R]`` (fp32) of ``(x + delta) @ w_down.T``
    (the sum rounded as the residual add rounds it), one a ``columns`` columns of D (the kernel's:
    ``policy.ROUTER_SHARE_COLUMNS``; an argument so that a compiled graph, cached across runs, holds the shares'
    count it was traced with): what a block whose shares were not handed on decides from with
    ``router_norm_from_shares``."""
    if _choose(backend, "router_shares", x.shape[0], x) == "triton":
        return triton_router_shares(x, w_down, delta, columns=columns)
    return torch_router_shares(x + delta, w_down, columns)  # the reference is the dense path


def _fake_decide_from_shares(shares, *, b_down, w_route, b_route, counts, count, backend="auto", margin=False):
    return _decision(shares[0], w_route, margin)


@_operator(_fake_decide_from_shares, mutates=("counts",))
def router_decide_from_shares(
    shares: torch.Tensor,
    *,
    b_down: torch.Tensor,
    w_route: torch.Tensor,
    b_route: torch.Tensor,
    counts: torch.Tensor,
    count: bool,
    backend: str = "auto",
    margin: bool = False,
) -> torch.Tensor:
    """``shares: [S, M, R]`` (the bottleneck's shares, as ``masked_reduce_gemm_shares`` hands them
    on) -> execute mask ``[M, G]`` (bool): ``router_decide``'s decision from its second step on,
    counted as it counts (or its margins, as with ``margin`` there)."""
    counts = counts if count and not margin else None
    if _choose(backend, "router", shares.shape[1], shares) == "triton":
        route = (b_down, w_route, b_route)
        return triton_router_decide_from_shares(shares, *route, as_bool=True, margin=margin, counts=counts)
    execute = torch_router_decide_from_shares(shares, b_down, w_route, b_route, as_bool=True, margin=margin)
    torch_count(execute, counts)
    return execute


def _fake_router_norm(
    shares, *, b_down, w_route, b_route, x, delta, norm_w, eps, counts, count, backend="auto", margin=False
):
    return _decision(shares[0], w_route, margin), torch.empty_like(x), torch.empty_like(x)


@_operator(_fake_router_norm, mutates=("counts",))
def router_norm_from_shares(
    shares: torch.Tensor,
    *,
    b_down: torch.Tensor,
    w_route: torch.Tensor,
    b_route: torch.Tensor,
    x: torch.Tensor,
    delta: torch.Tensor,
    norm_w: torch.Tensor,
    eps: float,
    counts: torch.Tensor,
    count: bool,
    backend: str = "auto",
    margin: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``router_decide_from_shares`` with the block's residual add and RMSNorm in the same launch:
    ``(execute [M, G], x + delta, rms_norm(x + delta))`` for ``x, delta: [M, D]`` and the norm's
    weight ``norm_w: [D]`` and ``eps``; with ``count`` the decision is counted into ``counts``
    (fp64 ``[2]``; every token real); ``margin``: the margins instead of the decision, uncounted."""
    counts = counts if count and not margin else None
    if _choose(backend, "router", shares.shape[1], shares) == "triton":
        route = (b_down, w_route, b_route)
        return triton_router_norm_from_shares(shares, *route, x, delta, norm_w, eps, margin=margin, counts=counts)
    route = (b_down, w_route, b_route)
    execute, x_new, h = torch_router_norm_from_shares(shares, *route, x, delta, norm_w, eps, margin=margin)
    torch_count(execute, counts)
    return execute, x_new, h


def _fake_consensus(margin, valid, *, batch, cap, quorum, share_set, counts, count, backend="auto", follow=0.0):
    return margin.new_empty(margin.shape, dtype=torch.bool)


@_operator(_fake_consensus, mutates=("counts",))
def consensus_decide(
    margin: torch.Tensor,
    valid: torch.Tensor | None,
    *,
    batch: int,
    cap: int,
    quorum: float,
    share_set: bool,
    counts: torch.Tensor,
    count: bool,
    backend: str = "auto",
    follow: float = 0.0,
) -> torch.Tensor:
    """``margin: [B * T, G]`` (fp32, as the router ops give them with ``margin``; row ``b * T + t``) ->
    the execute mask ``[B * T, G]`` (bool) under batch consensus (``kernels/consensus.py``: at most
    ``cap`` groups a position, and with ``follow`` > 0 at most ``ceil(follow *`` the tokens' mean count``)``,
    with at least ``quorum`` of its real tokens' votes, the whole set run by every token with
    ``share_set``); ``valid: [B * T]`` the real tokens (None: all); with ``count`` the real tokens and the
    groups they run are added to ``counts``."""
    counts = counts if count else None
    rule = {"cap": cap, "quorum": quorum, "share_set": share_set, "valid": valid, "follow": follow}
    if _choose(backend, "router", margin.shape[0], margin) == "triton":
        return triton_consensus(margin, batch, counts=counts, **rule)
    check_consensus(margin, batch, cap, quorum, valid)
    execute = torch_consensus(margin, batch, **rule)
    torch_count(execute, counts, valid)
    return execute


def _fake_out(x, w, mask, *, w_up=None, zero_inactive=True, backend="auto", dense_rows=0, shared=False):
    return x.new_empty(x.shape[0], w.shape[0])


@_operator(_fake_out)
def masked_out_gemm(
    x: torch.Tensor,
    w: torch.Tensor,
    mask: torch.Tensor,
    *,
    w_up: torch.Tensor | None = None,
    zero_inactive: bool = True,
    backend: str = "auto",
    dense_rows: int = 0,
    shared: bool = False,
) -> torch.Tensor:
    """``x: [M, K]``, ``w: [N, K]``, ``mask: [M, G]`` -> ``[M, N]``: ``x @ w.T`` (or, with
    ``w_up``, ``silu(x @ w.T) * (x @ w_up.T)``) for active groups, exactly 0 elsewhere; the last
    ``dense_rows`` rows of ``w`` are not routed (every token runs them: k and v under q), the
    others split into the mask's G groups. ``zero_inactive=False``: the caller never reads the
    inactive groups' outputs (the routed attention reads only the active heads' queries), so the
    dense fallback may leave its dense product there and save the zeroing launch; the kernel and
    the reference write zeros anyway. ``shared``: every token runs the same groups (a batch's consensus
    set at decode), which the kernels take in one tile up to ``policy.SHARED_MAX_M`` tokens."""
    path = _choose(backend, "swiglu" if w_up is not None else "out", x.shape[0], x, w, shared=shared)
    if path == "triton" and backend == "auto" and not out_kernel_takes(x, w, shared, w_up):
        path = "dense"
    if path == "triton":
        return triton_masked_out_gemm(x, w, mask, w_up, dense_rows=dense_rows, shared=shared)
    if path == "dense":
        return dense_masked_out_gemm(x, w, mask, w_up, zero_inactive=zero_inactive, dense_rows=dense_rows)
    return torch_masked_out_gemm(x, w, mask, w_up, dense_rows)


def _fake_router_out(
    shares,
    w,
    *,
    b_down,
    w_route,
    b_route,
    x,
    delta,
    norm_w,
    eps,
    w_up,
    dense_rows,
    zero_inactive,
    counts,
    count,
    backend="auto",
):
    return x.new_empty(x.shape[0], w.shape[0]), _decision(shares[0], w_route, False), torch.empty_like(x)


@_operator(_fake_router_out, mutates=("counts",))
def router_norm_out_gemm(
    shares: torch.Tensor,
    w: torch.Tensor,
    *,
    b_down: torch.Tensor,
    w_route: torch.Tensor,
    b_route: torch.Tensor,
    x: torch.Tensor,
    delta: torch.Tensor,
    norm_w: torch.Tensor,
    eps: float,
    w_up: torch.Tensor | None,
    dense_rows: int,
    zero_inactive: bool,
    counts: torch.Tensor,
    count: bool,
    backend: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A block's start and its first product: ``(out, execute, x + delta)``, what ``router_norm_from_shares``
    (the decision from ``shares``, counted with ``count``, and the RMSNorm of ``x + delta``) and then
    ``masked_out_gemm`` of the normalised rows (``w``, ``w_up``, ``dense_rows``, ``zero_inactive`` as there)
    give. At decode sizes the kernel does both in one launch (the decision in the decode product's prologue,
    ``gemm_out.py``); elsewhere, and under "auto" wherever it was not measured faster (``policy``), the two
    operators run one after the other."""
    m = x.shape[0]
    if m <= policy.DECODE_MAX_M and _choose(backend, "router_out", m, x, w, width=x.shape[1]) == "triton":
        counted = counts if count else None
        route = (b_down, w_route, b_route)
        return triton_router_norm_out_gemm(
            shares, *route, x, delta, norm_w, eps, w, w_up, dense_rows=dense_rows, counts=counted
        )
    route = {"b_down": b_down, "w_route": w_route, "b_route": b_route}
    norm = {"x": x, "delta": delta, "norm_w": norm_w, "eps": eps}
    execute, x_new, h = router_norm_from_shares(shares, **route, **norm, counts=counts, count=count, backend=backend)
    product = {"w_up": w_up, "zero_inactive": zero_inactive, "dense_rows": dense_rows, "backend": backend}
    return masked_out_gemm(h, w, execute, **product), execute, x_new


def _fake_reduce(x, w, mask, *, input_is_masked=False, backend="auto", shared=False, tile=0, tokens=0):
    return x.new_empty(x.shape[0], w.shape[0])


@_operator(_fake_reduce)
def masked_reduce_gemm(
    x: torch.Tensor,
    w: torch.Tensor,
    mask: torch.Tensor,
    *,
    input_is_masked: bool = False,
    backend: str = "auto",
    shared: bool = False,
    tile: int = 0,
    tokens: int = 0,
) -> torch.Tensor:
    """``x: [M, K]``, ``w: [N, K]``, ``mask: [M, K/G]`` -> ``[M, N]``: the product over the active
    input groups only. ``input_is_masked``: ``x`` is already zero in the inactive groups (as the
    fused SwiGLU kernel and the routed attention leave it), so the dense fallback is the plain
    dense product. ``shared``: every row of ``mask`` is the same (a batch's shared set). ``tile`` (with
    ``tokens``, the rows a sequence): the rows agree in tiles of that many positions of each sequence
    (tile-coherent routing at prefill). Either way, past the decode kernel's tiles the kernel is the tile
    reduction, which reads each tile's set once."""
    m = x.shape[0]
    path = _choose(backend, "reduce", m, x, w, groups=mask.shape[-1], zeroed=input_is_masked, shared=shared)
    if path == "triton":
        # past the decode kernel's tiles, rows that agree (a tile-coherent prefill; a shared set of up to
        # SHARED_MAX_M) take the tile reduction
        if m > policy.DECODE_MAX_M and (tile or (shared and m <= policy.SHARED_MAX_M)):
            return triton_tile_reduce_gemm(x, w, mask, tile=tile or None, tokens=tokens or None, rows_agree=not tile)
        return triton_masked_reduce_gemm(x, w, mask)
    if path == "dense":
        return dense_masked_reduce_gemm(x, w, mask, input_is_masked=input_is_masked)
    return torch_masked_reduce_gemm(x, w, mask)


def _fake_reduce_shares(x, w, mask, *, residual, share_w, input_is_masked=False, backend="auto", shared=False):
    n = w.shape[0]
    shares = x.new_empty(share_slots(n), x.shape[0], share_w.shape[0], dtype=torch.float32)
    return x.new_empty(x.shape[0], n), shares


@_operator(_fake_reduce_shares)
def masked_reduce_gemm_shares(
    x: torch.Tensor,
    w: torch.Tensor,
    mask: torch.Tensor,
    *,
    residual: torch.Tensor,
    share_w: torch.Tensor,
    input_is_masked: bool = False,
    backend: str = "auto",
    shared: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``masked_reduce_gemm`` that also hands the next router its first step: ``(out, shares)``,
    ``shares: [S, M, R]`` the shares of ``(residual + out) @ share_w.T`` (``residual: [M, N]``, what
    the caller adds ``out`` to; ``share_w: [R, N]`` fp32, the next router's ``w_down``), for
    ``router_decide_from_shares``. In the kernel each program writes its columns' share; elsewhere
    the reference computes them after the product. Under "auto" on CUDA the kernel runs where
    ``policy`` says the handoff (the product, the add and the next router's first step) measured faster.
    ``shared``: every row runs the same groups (a decode batch's shared set); past the decode kernel's
    tiles the split-K tile reduction runs, its second launch writing the shares."""
    m = x.shape[0]
    path = _choose(backend, "reduce_handoff", m, x, w, groups=mask.shape[-1], zeroed=input_is_masked, shared=shared)
    if path == "triton":
        if shared and m > policy.DECODE_MAX_M:
            return triton_tile_reduce_gemm(x, w, mask, rows_agree=True, residual=residual, share_w=share_w)
        return triton_masked_reduce_gemm(x, w, mask, residual=residual, share_w=share_w)
    if path == "dense":
        out = dense_masked_reduce_gemm(x, w, mask, input_is_masked=input_is_masked)
    else:
        out = torch_masked_reduce_gemm(x, w, mask)
    return out, torch_router_shares(residual + out, share_w)


@_operator(lambda q, k, v, seq_lens, mask, *, backend="auto": q.new_empty(q.shape))
def routed_attention_decode(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    seq_lens: torch.Tensor,
    mask: torch.Tensor,
    *,
    backend: str = "auto",
) -> torch.Tensor:
    """``q: [B, Hq, D]``, ``k, v: [B, Hkv, S, D]``, ``seq_lens: [B]``, ``mask: [B, Hq/A]`` ->
    ``[B, Hq, D]``; inactive heads exactly 0, their K/V never read."""
    path = _choose(backend, "attn_decode", q.shape[0], q, k, v, context=k.shape[2])
    if path == "triton":
        out = triton_routed_attention_decode(q, k, v, seq_lens, mask)
    elif path == "dense":
        out = dense_routed_attention_decode(q, k, v, seq_lens, mask)
    else:
        out = torch_routed_attention_decode(q, k, v, seq_lens, mask)
    return out.contiguous()


@_operator(lambda q, k, v, mask, *, backend="auto": q.new_empty(q.shape[0], q.shape[2], q.shape[1], q.shape[3]))
def routed_attention_prefill(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, *, backend: str = "auto"
) -> torch.Tensor:
    """``q: [B, Hq, T, D]``, ``k, v: [B, Hkv, S, D]``, ``mask: [B, T, Hq/A]`` -> ``[B, T, Hq, D]`` (the
    layout o reads), causal with the original positions; inactive (token, head) exactly 0."""
    path = _choose(backend, "attn_prefill", q.shape[2], q, k, v)
    if path == "triton":
        out = triton_routed_attention_prefill(q, k, v, mask)
    elif path == "dense":
        out = dense_routed_attention_prefill(q, k, v, mask)
    else:
        out = torch_routed_attention_prefill(q, k, v, mask)
    return out.transpose(1, 2).contiguous()
