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
"""

from __future__ import annotations

import torch

from compresskit_wide.kernels.common import next_power_of_2, pdl_launch

try:
    import triton
    import triton.language as tl

    from compresskit_wide.kernels.common import pdl_enter
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
    def triton_consensus_kernel(
        mg_ptr, valid_ptr, out_ptr, cnt_ptr, B, T, G, cap, quorum, follow,
        HAS_VALID: tl.constexpr, FOLLOW: tl.constexpr, SHARE_SET: tl.constexpr, COUNT: tl.constexpr,
        BLOCK_B: tl.constexpr, BLOCK_G: tl.constexpr,
        PDL: tl.constexpr = False,
    ):  # fmt: skip
        # program t: position t's tokens (rows b * T + t) and every group
        pdl_enter(PDL)
        t = tl.program_id(0)
        bs = tl.arange(0, BLOCK_B)
        gs = tl.arange(0, BLOCK_G)
        b_ok = bs < B
        g_ok = gs < G
        rows = bs * T + t
        tile = b_ok[:, None] & g_ok[None, :]
        margin = tl.load(mg_ptr + rows[:, None] * G + gs[None, :], mask=tile, other=-1.0)
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
