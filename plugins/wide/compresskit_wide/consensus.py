"""WIDE's shared routing: batch consensus and tile-coherent routing (:class:`Consensus`).

A rule is set on a routed model's routers (:func:`set_consensus`, through the core's generic
``compresskit.routing.set_rule``) by the ``wide-triton`` executor (its ``consensus`` setting: what evaluation
scores) and by a training stage whose config gives ``consensus`` (the pruner's training options,
:class:`WideTrainingOptions`, merged into every stage that trains). The runtime's blocks decide under the same
rule through the ``consensus_decide`` kernel (``kernels/consensus.py``); :func:`consensus_execute` is the
reference both equal.

Sample YAML::

    executor: {name: wide-triton, config: {consensus: {quorum: 0.5, budget: 0.6}}}
    training:
      - {name: lora, config: {steps: 200, consensus: {quorum: 0.5}, consensus_gradient: set}}
"""

from __future__ import annotations

import math
from typing import ClassVar, Literal

import torch
from pydantic import Field, field_validator, model_serializer, model_validator
from torch import nn

from compresskit.interfaces import PluginConfig
from compresskit.routing import set_rule

TILE_MULTIPLE = 16  # a tile of ``over: tile`` is a whole number of the products' smallest token tiles


class Consensus(PluginConfig):
    """Shared routing. ``over: batch`` (batch consensus): at each position, the real tokens of a batch's
    sequences share one set of groups per router, so that a product reads the weights of that set, not the
    union of every token's. ``over: tile`` (tile-coherent routing): the real tokens of each tile of ``tile``
    consecutive positions of a sequence share one set, so that a prefill tile's products can skip whole
    groups of weights; a tile of one real token (each decode step) keeps its own decision.

    The shared set: the groups that at least ``quorum`` of the position's real tokens execute (at least
    one token), ranked by their votes (ties: by the sum of the tokens' execute-minus-skip margins, then by
    index), at most ``ceil(budget * G)`` of them, and with ``follow`` at most ``ceil(follow * m)``, ``m`` the
    mean count of groups the position's real tokens would run (a cap that follows each router's own rate).
    ``share="set"``: every token runs the whole set; ``"own"``: each token runs its own choices within it;
    ``attention_share`` gives the attention routers another (``own`` with the FFN's ``set``: each sequence's
    attention reads only its own heads' K/V, as per-token routing does, while its q and o weights are read for
    the set only). A position with one real token (a batch of one) keeps that token's own decision exactly:
    per-token routing.
    The same object is what a recipe, a training stage or a command gives (``consensus: {quorum: 0.5}``).

    With ``over: batch`` a sequence's output depends on the sequences batched with it; with ``over: tile``
    a token's depends on the tokens of its tile (later ones too), so a prompt's logits differ from those of
    the same tokens decoded one at a time."""

    quorum: float = Field(
        0.5,
        ge=0.0,
        le=1.0,
        description="a group joins the batch's shared set when at least this share of the position's real "
        "tokens would run it (at least one token)",
    )
    budget: float = Field(
        1.0, gt=0.0, le=1.0, description="the shared set holds at most this share of a router's groups (rounded up)"
    )
    share: Literal["set", "own"] = Field(
        "set", description="set: every token runs the whole shared set; own: its own choices within it"
    )
    attention_share: Literal["set", "own"] | None = Field(
        None,
        description="the attention routers' share (None: as share); own with share: set keeps each sequence's "
        "attention to its own heads' K/V while the FFN runs the set",
    )
    over: Literal["batch", "tile"] = Field(
        "batch", description="batch: the sequences of a batch at each position; tile: each tile of a sequence"
    )
    tile: int = Field(
        64, ge=TILE_MULTIPLE, description=f"with over: tile, positions a tile (a multiple of {TILE_MULTIPLE})"
    )
    follow: float | None = Field(
        None,
        gt=0.0,
        le=4.0,
        description="the set follows the tokens: at most ceil(follow x the mean count of groups the position's "
        "real tokens would run) groups, within the budget's cap (a router that keeps most groups per token keeps "
        "most in the set)",
    )

    @field_validator("tile")
    @classmethod
    def _whole_tiles(cls, value: int) -> int:
        if value % TILE_MULTIPLE:
            raise ValueError(
                f"a tile is a whole number of the products' {TILE_MULTIPLE}-token tiles: give a multiple of "
                f"{TILE_MULTIPLE} (e.g. {TILE_MULTIPLE * max(1, round(value / TILE_MULTIPLE))}), not {value}"
            )
        return value

    @model_serializer(mode="wrap")
    def _without_unset_fields(self, handler):
        """Dumped without ``follow`` and ``attention_share`` while they are None: rules (and the recipes and
        results holding them) written before those fields keep their form and their recipe hash."""
        data = handler(self)
        for key in ("follow", "attention_share"):
            if data.get(key, 0) is None:
                del data[key]
        return data

    def for_kind(self, kind: str) -> Consensus:
        """The rule the routers of ``kind`` ("attention" or "ffn") run: this one, with ``attention_share`` as
        the share of the attention routers where it is given."""
        if kind != "attention" or self.attention_share in (None, self.share):
            return self
        return self.model_copy(update={"share": self.attention_share, "attention_share": None})

    def applies(self, batch: int, tokens: int) -> bool:
        """Whether a ``[batch, tokens]`` step has sets to share: two or more sequences (``over: batch``) or
        two or more positions (``over: tile``)."""
        return batch > 1 if self.over == "batch" else tokens > 1

    def cap(self, groups: int) -> int:
        """The most groups the shared set holds for a router of ``groups`` groups (at least one)."""
        return max(1, math.ceil(self.budget * groups - 1e-9))


def to_voters(x: torch.Tensor, consensus: Consensus, fill=0) -> torch.Tensor:
    """``x: [B, T, ...]`` in the layout the rule shares over, ``[voters, positions, ...]``: itself for
    ``over: batch``; for ``over: tile``, ``[S, B * ceil(T / S), ...]`` with ``S = tile``, the tokens of each
    tile along the first axis (the last tile padded with ``fill``)."""
    if consensus.over == "batch":
        return x
    b, t, size = x.shape[0], x.shape[1], consensus.tile
    n = -(-t // size)
    if n * size != t:
        x = torch.cat([x, x.new_full((b, n * size - t, *x.shape[2:]), fill)], 1)
    return x.unflatten(1, (n, size)).movedim(2, 0).flatten(1, 2)


def from_voters(x: torch.Tensor, consensus: Consensus, batch: int, tokens: int) -> torch.Tensor:
    """The inverse of :func:`to_voters`: back to ``[batch, tokens, ...]``."""
    if consensus.over == "batch":
        return x
    return x.unflatten(1, (batch, -1)).movedim(0, 2).flatten(1, 2)[:, :tokens]


def consensus_keep(
    margin: torch.Tensor, own: torch.Tensor, valid: torch.Tensor | None, consensus: Consensus
) -> tuple[torch.Tensor, torch.Tensor]:
    """The shared sets ``keep: [T, G]`` (bool) and which positions have one (``multi: [T]``, two or more
    real tokens) from the margins ``margin: [B, T, G]`` (fp32, execute minus skip logit), the tokens'
    own decisions ``own: [B, T, G]`` (bool) and the real tokens ``valid: [B, T]`` (None: all)."""
    b, t, g = own.shape
    real = torch.ones(b, t, dtype=torch.bool, device=own.device) if valid is None else valid.bool()
    votes = (own & real[..., None]).sum(0)  # [T, G]
    conf = (margin.float() * real[..., None]).sum(0)  # [T, G]
    n = real.sum(0)  # [T]
    need = torch.ceil(consensus.quorum * n.float()).clamp_min(1.0)  # [T]
    # rank[t, g]: the groups ahead of g (more votes; as many and a larger margin sum; a tie of both and a lower index)
    va, vb = votes[:, :, None], votes[:, None, :]
    ca, cb = conf[:, :, None], conf[:, None, :]
    idx = torch.arange(g, device=own.device)
    lower = (idx[None, :] < idx[:, None])[None]
    ahead = (vb > va) | ((vb == va) & ((cb > ca) | ((cb == ca) & lower)))
    rank = ahead.sum(-1)
    cap = torch.full((t,), float(consensus.cap(g)), device=own.device)
    if consensus.follow is not None:
        cap = torch.minimum(cap, follow_cap(votes, n, consensus.follow))
    keep = (rank < cap[:, None]) & (votes.float() >= need[:, None])
    return keep, n >= 2


def follow_cap(votes: torch.Tensor, n: torch.Tensor, follow: float) -> torch.Tensor:
    """``Consensus.follow``'s cap per position (fp32 ``[T]``): ``ceil(follow * votes.sum(-1) / n)``, at least 1,
    from the votes ``[T, G]`` and the real tokens ``n: [T]``; computed in fp32 in this order, as the kernel does."""
    mean_times = (follow * votes.sum(-1).float()) / n.clamp_min(1).float()
    return torch.ceil(mean_times).clamp_min(1.0)


def consensus_execute(
    margin: torch.Tensor, own: torch.Tensor, valid: torch.Tensor | None, consensus: Consensus
) -> torch.Tensor:
    """Reference: the execute mask ``[B, T, G]`` (bool) that runs under ``consensus`` (see
    :class:`Consensus` and :func:`consensus_keep`)."""
    b, t = own.shape[:2]
    real = torch.ones(b, t, dtype=torch.bool, device=own.device) if valid is None else valid.bool()
    own_v = to_voters(own, consensus, False)
    keep, multi = consensus_keep(to_voters(margin, consensus), own_v, to_voters(real, consensus, False), consensus)
    shared = keep[None].expand_as(own_v) if consensus.share == "set" else own_v & keep[None]
    return from_voters(torch.where(multi[None, :, None], shared, own_v), consensus, b, t)


class ConsensusRule:
    """A :class:`Consensus` as the decision rule of one router (``compresskit.routing.DecisionRule``): in training
    with the gradient through each token's own decision (``gradient="own"``) or through the shared set
    (``"set"``, :meth:`agree`)."""

    def __init__(self, consensus: Consensus, gradient: Literal["own", "set"] = "own") -> None:
        if gradient not in ("own", "set"):
            raise ValueError(f"gradient must be 'own' or 'set', got {gradient!r}")
        self.consensus, self.gradient = consensus, gradient

    def applies(self, batch: int, tokens: int) -> bool:
        return self.consensus.applies(batch, tokens)

    def agree(self, logits: torch.Tensor, execute: torch.Tensor, valid: torch.Tensor | None) -> torch.Tensor:
        """``execute`` (the tokens' own decisions, with their straight-through gradient in training) under
        the batch's consensus: the forward value :func:`consensus_execute`'s, the gradient the own
        decision's (``share="set"``) or the own decision's where the set keeps the group (``"own"``). With
        ``gradient="set"`` (``share="set"``) the gradient goes through the set instead, as the mean
        of its real voters' soft decisions: each voter's router learns what the set it shares costs all of
        them, where the own decision's gradient tells it only what its own token would pay."""
        c = self.consensus
        b, t = execute.shape[:2]
        with torch.no_grad():
            margin = to_voters(logits[..., 0] - logits[..., 1], c)
            own = to_voters(execute > 0.5, c, False)
            real = torch.ones(b, t, dtype=torch.bool, device=execute.device) if valid is None else valid > 0.5
            keep, multi = consensus_keep(margin, own, to_voters(real, c, False), c)
            keep = from_voters(keep[None].expand_as(own), c, b, t)  # the set of each token's position or tile
            multi = from_voters(multi[None].expand(own.shape[:2]), c, b, t)[..., None]
        if c.share == "own":
            return execute * torch.where(multi, keep, True).to(execute.dtype)
        shared = torch.where(multi, keep, execute > 0.5).to(execute.dtype)
        if not execute.requires_grad:
            return shared
        straight = execute - execute.detach()  # zero, with the own decision's gradient
        if self.gradient == "set":
            weight = to_voters(real, c, False).to(execute.dtype)[..., None]  # [V, P, 1]: the real voters
            voters = to_voters(straight, c, 0.0)
            mean = (voters * weight).sum(0, keepdim=True) / weight.sum(0, keepdim=True).clamp_min(1.0)
            # a real voter of a shared set; a padded token keeps its own (its loss is masked in training)
            straight = torch.where(multi & real[..., None], from_voters(mean.expand_as(voters), c, b, t), straight)
        return shared + straight


def set_consensus(model: nn.Module, consensus: Consensus | None, gradient: Literal["own", "set"] = "own") -> int:
    """Route every router of ``model`` under ``consensus`` (None: per token again), in training with the
    gradient ``gradient`` (:class:`ConsensusRule`); returns how many routers it set (0: the model has none)."""
    if consensus is None:
        return set_rule(model, None)
    rules = {kind: ConsensusRule(consensus.for_kind(kind), gradient) for kind in ("attention", "ffn")}
    return set_rule(model, rules.get)


class WideTrainingOptions(PluginConfig):
    """What a training stage of a ``wide`` recipe may also give (merged into the config of each stage that trains
    the model: ``router``, ``lora``): shared routing in the loop."""

    omitted_at_default: ClassVar[dict] = {"consensus_gradient": "own"}

    consensus: Consensus | None = Field(
        None,
        description="Train with shared routing in the loop (compresskit_wide.consensus.Consensus): with over: batch, "
        "at each position the batch_size sequences of a micro-batch (unrelated text, as a served batch) share each "
        "router's groups; with over: tile, the tokens of each tile of a sequence do; so that the routers learn to "
        "agree.",
    )
    consensus_gradient: Literal["own", "set"] = Field(
        "own",
        description="With consensus (share: set): the routers' gradient goes straight through each token's own "
        "decision (own), or through the shared set, as the mean of its voters' soft decisions (set), so that each "
        "router learns what the set costs the tokens that share it.",
    )

    @model_validator(mode="after")
    def _set_gradient_needs_a_set(self):
        c = self.consensus
        if self.consensus_gradient == "set" and (c is None or c.share != "set" or c.attention_share == "own"):
            given = (
                "no consensus"
                if c is None
                else "consensus " + (f"share: {c.share}" if c.share != "set" else "attention_share: own")
            )
            raise ValueError(
                "consensus_gradient: set goes through a shared set, so needs consensus with share: set "
                f"(given: {given})"
            )
        return self


def trained_rule(recipe: dict | None) -> Consensus | None:
    """The consensus rule the last training stage of ``recipe`` (a resolved recipe's dict, as a run's
    ``results.json`` and its model's manifest hold it) ran in its loop, or None."""
    rule = None
    for stage in (recipe or {}).get("training") or []:
        given = (stage.get("config") or {}).get("consensus")
        rule = Consensus(**given) if given else None
    return rule
