"""Batch-consensus routing's decision in one launch: at each position the batch's tokens share one set of
groups, so that a routed product reads that set's weights instead of the union of every token's.

    margin: [B * T, G]  fp32, each token's execute-minus-skip logit per group (row b * T + t: sequence b,
                        position t); the token itself would execute the group where it is >= 0
    valid:  [B * T]     bool, the real tokens (optional: all are)
    out:    [B * T, G]  bool, the groups each token runs

At each position the real tokens vote: a group's votes are the tokens that would execute it. The shared set
is the groups with at least ``max(1, ceil(quorum * n))`` votes (``n`` the real tokens), ranked by votes,
then by the sum of the real tokens' margins, then by index, at most ``cap`` of them, and with ``follow`` > 0 at
most ``ceil(follow * votes / n)`` (``votes`` summed over the groups: the cap follows the tokens' own counts).
``share_set``: every token runs the whole set; else each runs its own choices within it. A position with fewer
than two real tokens keeps each token's own decision (a batch of one is per-token routing).

One program a position holds its B x G margins (``B`` and ``G`` padded to powers of two) and ranks the G
groups against each other (a G x G comparison): made for a decode batch, up to a few hundred tokens and
groups. It may also count what runs (``counts``: fp64 ``[2]``, real tokens and the groups they run).

At decode the router's margins come from the launch that decides from the shares the block before handed on
(``router.py``'s ``router_norm_from_shares``). ``router_norm_consensus`` does both in that one launch: its
deciding programs store the margins, then arrive on a counter (``arrivals``: int32 ``[1]``, zero between
launches); the program that arrives last reads every margin (each store before its program's arrival, the
arrival a release and acquire at GPU scope, the margins read again from L2) and decides for each position,
then sets the counter back to zero. One launch a router instead of two; the counter is the caller's (a block
owns one, and its launches follow each other on one stream).
"""

from __future__ import annotations

import torch

from compresskit_wide.kernels.common import cdiv, next_power_of_2, pdl_launch
from compresskit_wide.kernels.router import (
    check_norm_operands,
    checked_shares,
    torch_router_norm_from_shares,
)

try:
    import triton
    import triton.language as tl

    from compresskit_wide.kernels.common import pdl_enter
    from compresskit_wide.kernels.router import add_norm_row, triton_router_shares_kernel
except ImportError:
    triton = None


def torch_consensus(
    margin: torch.Tensor,
    batch: int,
    *,
    cap: int,
    quorum: float,
    share_set: bool,
    valid: torch.Tensor | None = None,
    follow: float = 0.0,
) -> torch.Tensor:
    """Reference (module docstring), by sorting: the groups in rank order are the stable sorts by margin
    sum, then by votes, each descending."""
    m, g = margin.shape
    t = m // batch
    mg = margin.float().view(batch, t, g)
    own = mg >= 0
    real = torch.ones(batch, t, dtype=torch.bool, device=margin.device) if valid is None else valid.view(batch, t)
    votes = (own & real[..., None]).sum(0)  # [T, G]
    conf = torch.where(real[..., None], mg, 0.0).sum(0)
    n = real.sum(0)
    order = torch.sort(conf, dim=-1, descending=True, stable=True).indices
    order = order.gather(-1, torch.sort(votes.gather(-1, order), dim=-1, descending=True, stable=True).indices)
    rank = torch.empty_like(order).scatter_(-1, order, torch.arange(g, device=margin.device).expand_as(order))
    need = torch.ceil(quorum * n.float()).clamp_min(1.0)
    caps = torch.full((t,), float(cap), device=margin.device)
    if follow > 0:
        caps = torch.minimum(caps, torch.ceil((follow * votes.sum(-1).float()) / n.clamp_min(1).float()).clamp_min(1.0))
    keep = (rank < caps[:, None]) & (votes.float() >= need[:, None])  # [T, G]
    shared = keep.expand_as(own) if share_set else own & keep
    return torch.where((n >= 2)[None, :, None], shared, own).reshape(m, g)


if triton is not None:

    @triton.jit
    def consensus_position(
        mg_ptr, valid_ptr, out_ptr, cnt_ptr, t, B, T, G, cap, quorum, follow,
        HAS_VALID: tl.constexpr, FOLLOW: tl.constexpr, SHARE_SET: tl.constexpr, COUNT: tl.constexpr,
        BLOCK_B: tl.constexpr, BLOCK_G: tl.constexpr,
    ):  # fmt: skip
        # position t's tokens (rows b * T + t) and every group. The margins are read from L2 (".cg"), past
        # this SM's L1: in the fused launch below other programs wrote them during this launch
        bs = tl.arange(0, BLOCK_B)
        gs = tl.arange(0, BLOCK_G)
        b_ok = bs < B
        g_ok = gs < G
        rows = bs * T + t
        tile = b_ok[:, None] & g_ok[None, :]
        margin = tl.load(mg_ptr + rows[:, None] * G + gs[None, :], mask=tile, other=-1.0, cache_modifier=".cg")
        real = b_ok
        if HAS_VALID:
            real = real & (tl.load(valid_ptr + rows, mask=b_ok, other=0) != 0)
        voters = real[:, None] & g_ok[None, :]
        own = margin >= 0
        votes = tl.sum(tl.where(own & voters, 1, 0), axis=0)  # [BLOCK_G]
        conf = tl.sum(tl.where(voters, margin, 0.0), axis=0)
        n = tl.sum(real.to(tl.int32), axis=0)
        need = tl.maximum(tl.ceil(quorum * n.to(tl.float32)), 1.0)
        # ahead[g, h]: group h ranks before group g
        va, vb = votes[:, None], votes[None, :]
        ca, cb = conf[:, None], conf[None, :]
        ahead = (vb > va) | ((vb == va) & ((cb > ca) | ((cb == ca) & (gs[None, :] < gs[:, None]))))
        rank = tl.sum(tl.where(ahead & g_ok[None, :], 1, 0), axis=1)
        limit = cap  # fp32: an int argument equal to 1 would be specialised into a constant
        if FOLLOW:  # the cap follows the tokens' own counts
            total = tl.sum(votes, axis=0).to(tl.float32)
            limit = tl.minimum(limit, tl.maximum(tl.ceil((follow * total) / tl.maximum(n, 1).to(tl.float32)), 1.0))
        keep = (rank.to(tl.float32) < limit) & (votes.to(tl.float32) >= need) & g_ok
        if SHARE_SET:
            shared = keep[None, :] & b_ok[:, None]
        else:
            shared = own & keep[None, :]
        run = tl.where(n >= 2, shared, own) & tile
        tl.store(out_ptr + rows[:, None] * G + gs[None, :], run.to(tl.uint8), mask=tile)
        if COUNT:
            executed = tl.sum(tl.sum(tl.where(run & voters, 1.0, 0.0), axis=1), axis=0)
            tl.atomic_add(cnt_ptr + 1, executed.to(tl.float64))
            tl.atomic_add(cnt_ptr, n.to(tl.float64))

    @triton.jit
    def triton_consensus_kernel(
        mg_ptr, valid_ptr, out_ptr, cnt_ptr, B, T, G, cap, quorum, follow,
        HAS_VALID: tl.constexpr, FOLLOW: tl.constexpr, SHARE_SET: tl.constexpr, COUNT: tl.constexpr,
        BLOCK_B: tl.constexpr, BLOCK_G: tl.constexpr,
        PDL: tl.constexpr = False,
    ):  # fmt: skip
        # program t: position t
        pdl_enter(PDL)
        consensus_position(
            mg_ptr, valid_ptr, out_ptr, cnt_ptr, tl.program_id(0), B, T, G, cap, quorum, follow,
            HAS_VALID, FOLLOW, SHARE_SET, COUNT, BLOCK_B, BLOCK_G,
        )  # fmt: skip

    @triton.jit
    def triton_router_norm_consensus_kernel(
        sh_ptr, bd_ptr, wu_ptr, bu_ptr, mg_ptr, x_ptr, dx_ptr, nw_ptr, xn_ptr, h_ptr,
        valid_ptr, out_ptr, cnt_ptr, arr_ptr, S, M, R, G, D, eps, B, T, cap, quorum, follow,
        BLOCK_S: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr,
        HAS_VALID: tl.constexpr, FOLLOW: tl.constexpr, SHARE_SET: tl.constexpr, COUNT: tl.constexpr,
        BLOCK_B: tl.constexpr, BLOCK_GC: tl.constexpr,
        PDL: tl.constexpr = False,
    ):  # fmt: skip
        # program (token m, j): j below the group blocks stores its token's margins for them, as the router's
        # decision from shares does, then arrives; the one that arrives last holds every margin and decides for
        # each position, then sets the arrivals back to zero for the next launch. The last j adds the token's
        # row to the residual and normalises it.
        pdl_enter(PDL)
        deciders = M * tl.cdiv(G, BLOCK_G)
        if tl.program_id(1) < tl.cdiv(G, BLOCK_G):
            triton_router_shares_kernel(
                sh_ptr, bd_ptr, wu_ptr, bu_ptr, mg_ptr, mg_ptr, S, M, R, G, G, BLOCK_S, BLOCK_R, BLOCK_G, False, True
            )  # fmt: skip
            tl.debug_barrier()  # every thread's margins stored before the arrival (a release at GPU scope)
            arrived = tl.atomic_add(arr_ptr, 1, sem="acq_rel", scope="gpu")
            if arrived == deciders - 1:
                tl.debug_barrier()
                for t in range(T):
                    consensus_position(
                        mg_ptr, valid_ptr, out_ptr, cnt_ptr, t, B, T, G, cap, quorum, follow,
                        HAS_VALID, FOLLOW, SHARE_SET, COUNT, BLOCK_B, BLOCK_GC,
                    )  # fmt: skip
                tl.atomic_xchg(arr_ptr, 0, sem="relaxed", scope="gpu")
        else:
            add_norm_row(tl.program_id(0), x_ptr, dx_ptr, nw_ptr, xn_ptr, h_ptr, D, eps, BLOCK_D)


def triton_consensus(
    margin: torch.Tensor,
    batch: int,
    *,
    cap: int,
    quorum: float,
    share_set: bool,
    valid: torch.Tensor | None = None,
    counts: torch.Tensor | None = None,
    follow: float = 0.0,
) -> torch.Tensor:
    """Triton version of :func:`torch_consensus`: one program a position. ``counts``: fp64 ``[2]`` the
    real tokens and the groups they run are added to."""
    if triton is None:
        raise RuntimeError("triton is not installed")
    check_consensus(margin, batch, cap, quorum, valid)
    if counts is not None and (counts.shape != (2,) or counts.dtype != torch.float64 or counts.device != margin.device):
        raise ValueError(f"counts must be a float64 [2] on {margin.device}, got {tuple(counts.shape)} {counts.dtype}")
    m, g = margin.shape
    margin = margin.contiguous()
    out = torch.empty((m, g), dtype=torch.uint8, device=margin.device)
    if m:
        t = m // batch
        triton_consensus_kernel[(t,)](
            margin, margin if valid is None else valid.contiguous().view(torch.uint8), out,
            out if counts is None else counts, batch, t, g, float(cap), float(quorum), float(follow),
            HAS_VALID=valid is not None, FOLLOW=follow > 0, SHARE_SET=share_set, COUNT=counts is not None,
            BLOCK_B=max(2, next_power_of_2(batch)), BLOCK_G=max(2, next_power_of_2(g)),
            **pdl_launch(triton_consensus_kernel, margin.device),
        )  # fmt: skip
    return out.view(torch.bool)


def torch_router_norm_consensus(
    shares: torch.Tensor,
    b_down: torch.Tensor,
    w_up: torch.Tensor,
    b_up: torch.Tensor,
    x: torch.Tensor,
    delta: torch.Tensor,
    norm_w: torch.Tensor,
    eps: float,
    batch: int,
    *,
    cap: int,
    quorum: float,
    share_set: bool,
    valid: torch.Tensor | None = None,
    follow: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Reference: ``(execute [M, G] bool, x + delta, its RMSNorm)``, the router's margins from ``shares`` (as
    ``router.torch_router_norm_from_shares`` gives them) under the batch's consensus (:func:`torch_consensus`)."""
    margin, x_new, h = torch_router_norm_from_shares(shares, b_down, w_up, b_up, x, delta, norm_w, eps, margin=True)
    rule = {"cap": cap, "quorum": quorum, "share_set": share_set, "valid": valid, "follow": follow}
    return torch_consensus(margin, batch, **rule), x_new, h


def triton_router_norm_consensus(
    shares: torch.Tensor,
    b_down: torch.Tensor,
    w_up: torch.Tensor,
    b_up: torch.Tensor,
    x: torch.Tensor,
    delta: torch.Tensor,
    norm_w: torch.Tensor,
    eps: float,
    batch: int,
    arrivals: torch.Tensor,
    *,
    cap: int,
    quorum: float,
    share_set: bool,
    valid: torch.Tensor | None = None,
    counts: torch.Tensor | None = None,
    follow: float = 0.0,
    block_g: int = 32,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Triton version of :func:`torch_router_norm_consensus` in one launch (module docstring): program
    (token, ``block_g`` groups) stores its margins and arrives on ``arrivals`` (int32 ``[1]``, zero; zero
    again after the launch), the last to arrive decides for every position; one program a token adds and
    normalises its row. ``counts``: as :func:`triton_consensus`'s. Made for decode sizes."""
    s, m, r, groups = checked_shares(shares, b_down, w_up, b_up, block_g, counts)
    check_norm_operands(m, x, delta, norm_w)
    if arrivals.shape != (1,) or arrivals.dtype != torch.int32 or arrivals.device != shares.device:
        raise ValueError(
            f"arrivals must be an int32 [1] on {shares.device}, got {tuple(arrivals.shape)} {arrivals.dtype} "
            f"on {arrivals.device}"
        )
    margin = torch.empty((m, groups), dtype=torch.float32, device=shares.device)
    check_consensus(margin, batch, cap, quorum, valid)
    shares, b_down, w_up, b_up = (t.contiguous() for t in (shares, b_down, w_up, b_up))
    x, delta, norm_w = x.contiguous(), delta.contiguous(), norm_w.contiguous()
    out = torch.empty((m, groups), dtype=torch.uint8, device=shares.device)
    x_new, h = torch.empty_like(x), torch.empty_like(x)
    if m:
        d = x.shape[1]
        triton_router_norm_consensus_kernel[(m, cdiv(groups, block_g) + 1)](
            shares, b_down, w_up, b_up, margin, x, delta, norm_w, x_new, h,
            out if valid is None else valid.contiguous().view(torch.uint8), out, out if counts is None else counts,
            arrivals, s, m, r, groups, d, eps, batch, m // batch, float(cap), float(quorum), float(follow),
            BLOCK_S=next_power_of_2(s), BLOCK_R=next_power_of_2(r), BLOCK_G=block_g, BLOCK_D=next_power_of_2(d),
            HAS_VALID=valid is not None, FOLLOW=follow > 0, SHARE_SET=share_set, COUNT=counts is not None,
            BLOCK_B=max(2, next_power_of_2(batch)), BLOCK_GC=max(2, next_power_of_2(groups)),
            **pdl_launch(triton_router_norm_consensus_kernel, x.device),
        )  # fmt: skip
    return out.view(torch.bool), x_new, h


def check_consensus(margin: torch.Tensor, batch: int, cap: int, quorum: float, valid: torch.Tensor | None) -> None:
    """An error naming what does not fit: ``margin`` fp32 ``[B * T, G]``, ``cap`` in 1..G, ``quorum`` in [0, 1],
    ``valid`` a bool ``[B * T]``."""
    if margin.dim() != 2 or margin.dtype != torch.float32 or batch < 1 or margin.shape[0] % batch:
        raise ValueError(
            f"margin must be float32 [B * T, G] for a batch of {batch}, got {tuple(margin.shape)} {margin.dtype}"
        )
    if not 1 <= cap <= max(1, margin.shape[1]):
        raise ValueError(f"cap must be in 1..{margin.shape[1]} (the groups), got {cap}")
    if not 0.0 <= quorum <= 1.0:
        raise ValueError(f"quorum must be in [0, 1], got {quorum}")
    if valid is not None and (valid.dtype != torch.bool or valid.shape != (margin.shape[0],)):
        raise ValueError(f"valid must be bool [{margin.shape[0]}], got {tuple(valid.shape)} {valid.dtype}")
