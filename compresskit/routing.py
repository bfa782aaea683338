"""Per-token routing primitives shared by dynamic pruners (routers over width groups, or over whole sublayers).

* :class:`GroupRouter`: a low-rank affine map from the raw residual stream to one
  (execute, skip) logit pair per group; :func:`decide` turns logits into a 0/1 execute mask
  (hard Gumbel-softmax with a straight-through gradient in training, argmax otherwise);
  :func:`linear_tau` is the per-step temperature schedule.
* :class:`RouterTap` replaces a norm whose input is the residual stream the router reads, and
  :class:`RoutedProjection` replaces a projection (``o_proj``, ``down_proj``) whose input is
  split into ``G`` contiguous groups, each kept or zeroed per token. With ``G = 1`` that skips
  the whole sublayer (dynamic depth); K and V are never touched, so the KV cache stays complete.
* :class:`DecisionRule` (set on a model's routers by :func:`set_rule`): a plugin's rule that turns the
  tokens' own decisions of a pass into those that run (shared routing, say).

The transformers layer code is left alone: in a Llama-style decoder layer the input of
``input_layernorm`` is the residual entering the layer and the input of
``post_attention_layernorm`` the residual after the attention add.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator
from typing import ClassVar, Literal, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from compresskit.errors import ArtifactError
from compresskit.interfaces import Pruner, RunContext
from compresskit.modeling import replace_module
from compresskit.sparsity import (
    ATTENTION_PROJ,
    FFN_PROJ,
    BlockCount,
    SparsityProfile,
    SparsityReport,
    layer_linear_macs,
)
from compresskit.tokens import declared_mask, mask_for


class GroupRouter(nn.Module):
    """``x: [B, T, D] -> logits: [B, T, G, 2]`` (index 0 = execute, 1 = skip).

    ``Linear(D -> r)`` then ``Linear(r -> 2G)``, both with biases, no nonlinearity. Weights are
    Kaiming-uniform with the linear gain, biases zero. Parameters stay in fp32 and the router
    computes in fp32 whatever the model's dtype or autocast (the raw residual has outliers).
    """

    def __init__(self, hidden_size: int, groups: int, rank: int = 32) -> None:
        super().__init__()
        self.groups = groups
        self.down = nn.Linear(hidden_size, rank, bias=True, dtype=torch.float32)
        self.up = nn.Linear(rank, 2 * groups, bias=True, dtype=torch.float32)
        for lin in (self.down, self.up):
            nn.init.kaiming_uniform_(lin.weight, nonlinearity="linear")
            nn.init.zeros_(lin.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.autocast(device_type=x.device.type, enabled=False):
            z = self.down(x.float())  # [B, T, r]
            logits = self.up(z)  # [B, T, 2G]
        return logits.unflatten(-1, (self.groups, 2))  # [B, T, G, 2]


def decide(logits: torch.Tensor, *, sample: bool, tau: float) -> torch.Tensor:
    """Execute mask ``[B, T, G]`` from ``logits: [B, T, G, 2]``.

    sample=True (training): a hard two-way Gumbel-softmax sample with a straight-through
    gradient (exact 0/1 forward; the gradient of ``softmax((logits + g) / tau)``).
    sample=False (inference): deterministic; a group is skipped iff its skip logit is larger
    (a tie executes).
    """
    if sample:
        return F.gumbel_softmax(logits, tau=tau, hard=True, dim=-1)[..., 0]
    return (logits[..., 1] <= logits[..., 0]).to(logits.dtype)


class DecisionRule(Protocol):
    """A plugin's rule over a pass's routing decisions, set on a model's routers with :func:`set_rule` (a
    routing pruner's shared routing, say). Where it ``applies`` to a ``[batch, tokens]`` pass,
    ``agree(logits, execute, valid)`` returns what runs in place of the tokens' own decisions: ``logits``
    ``[B, T, G, 2]`` (the router's), ``execute`` ``[B, T, G]`` (their own, with its straight-through gradient in
    training), ``valid`` ``[B, T]`` (the real tokens; None: all are) -> ``[B, T, G]``, with the gradient the rule
    gives it. The tokens' own decisions are what the sparsity term counts in training."""

    def applies(self, batch: int, tokens: int) -> bool: ...

    def agree(self, logits: torch.Tensor, execute: torch.Tensor, valid: torch.Tensor | None) -> torch.Tensor: ...


def linear_tau(step: int, total_steps: int, tau_start: float, tau_end: float) -> float:
    """Temperature annealed linearly per optimiser step: ``tau_start`` at step 0, ``tau_end`` at
    the last step (``total_steps - 1``)."""
    if total_steps <= 1:
        return tau_end
    frac = min(max(step, 0), total_steps - 1) / (total_steps - 1)
    return tau_start + (tau_end - tau_start) * frac


def mask_input_groups(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Reference masking: ``x: [B, T, K]``, ``mask: [B, T, G]`` (1 = active; may carry
    straight-through gradients) -> ``x`` with each inactive group of K/G features exactly zero."""
    groups = mask.shape[-1]
    if x.shape[-1] % groups:
        raise ValueError(f"last axis {x.shape[-1]} is not divisible into {groups} groups")
    xg = x.unflatten(-1, (groups, x.shape[-1] // groups))  # [B, T, G, K/G]
    return (xg * mask.unsqueeze(-1).to(x.dtype)).flatten(-2)  # [B, T, K]


def _plain_set(module: nn.Module, name: str, value) -> None:
    """Set a plain attribute of ``module`` (never a parameter, buffer or submodule) without
    ``nn.Module.__setattr__``'s type checks: the per-pass state of the routed modules is written
    several times a layer and token, where those checks were a measurable share of the host's work
    (measured with ``benchmarks/bench_wide_host.py``, deleted with the routed modules' runtime path at ``176e872``)."""
    module.__dict__[name] = value


class RoutedProjection(nn.Module):
    """A projection whose input features form ``G`` contiguous groups, each kept or zeroed per token.

    Args:
        base_layer: the original ``nn.Linear`` (o_proj or down_proj).
        router: the :class:`GroupRouter` with ``G`` groups, or None to follow ``leader``.
        leader: another routed projection whose decision this one reuses (one router gating a
            whole layer); it must run first in the forward pass.
        kind: "attention" or "ffn" (for statistics).
        layer_idx: decoder layer index.
        macs_per_group: multiply-adds per token that skipping one group saves.
        masker: ``(x, mask) -> x`` zeroing inactive groups; :func:`mask_input_groups` by default.
    """

    counting = True  # outside training every decision is counted (what measured_sparsity reads)

    def __init__(
        self,
        base_layer: nn.Linear,
        router: GroupRouter | None,
        *,
        kind: Literal["attention", "ffn"],
        layer_idx: int,
        macs_per_group: int,
        leader: RoutedProjection | None = None,
        masker: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
    ) -> None:
        super().__init__()
        if (router is None) == (leader is None):
            raise ValueError("a routed projection needs exactly one of router and leader")
        self.base_layer = base_layer
        self.router = router
        self.__dict__["leader"] = leader  # a reference, not a submodule
        self.has_followers = False
        if leader is not None:
            leader.has_followers = True
        self.groups = router.groups if router is not None else leader.groups
        if base_layer.in_features % self.groups:
            raise ValueError(f"{base_layer.in_features} input features do not split into {self.groups} groups")
        self.kind = kind
        self.layer_idx = layer_idx
        self.macs_per_group = macs_per_group
        self.masker = masker or mask_input_groups
        self.tau = 1.0
        self.deterministic = False  # True after finalize: argmax even in train mode
        self.rule: DecisionRule | None = None  # a plugin's rule over each pass's decisions (set_rule), None: own
        self._mask: torch.Tensor | None = None  # execute mask of the pass in flight, [B, T, G]
        self._decision: tuple | None = None  # (execute, valid, own decisions) for followers
        self.last_skip: torch.Tensor | None = None  # training: skip sample with ST gradient, [B, T, G]
        self.last_valid: torch.Tensor | None = None  # training: real-token mask, [B, T]
        self.last_run_skip: torch.Tensor | None = None  # training under a rule: what ran, [B, T, G]
        self.reset_stats()

    def reset_stats(self) -> None:
        dev = self.base_layer.weight.device
        # counted without a host synchronisation: executed (token, group) pairs and, where a real-token
        # mask was declared, its real tokens on the device; tokens of unmasked passes (all real) on the host
        self._executed = torch.zeros((), dtype=torch.float64, device=dev)
        self._masked_tokens = torch.zeros((), dtype=torch.float64, device=dev)
        self._host_tokens = 0

    @property
    def stat_tokens(self) -> torch.Tensor:
        """Real tokens routed since ``reset_stats`` (a float64 scalar tensor)."""
        return self._masked_tokens + self._host_tokens

    @property
    def stat_skipped(self) -> torch.Tensor:
        """Skipped (real token, group) pairs since ``reset_stats`` (a float64 scalar tensor)."""
        return self.stat_tokens * self.groups - self._executed

    def _count(self, execute: torch.Tensor, valid: torch.Tensor | None) -> None:
        """Add one pass's decision to the counters: a sum and an add when every token is real
        (``valid`` None; three kernels on a GPU, which casts before it sums), a few more with a
        real-token mask."""
        with torch.no_grad():
            if valid is None:
                _plain_set(self, "_host_tokens", self._host_tokens + execute[..., 0].numel())
                self._executed.add_(execute.sum(dtype=torch.float64))
            else:
                self._masked_tokens.add_(valid.sum(dtype=torch.float64))
                self._executed.add_((execute.to(torch.float64) * valid.unsqueeze(-1)).sum())

    def route(self, x_raw: torch.Tensor) -> None:
        """Decide for the tokens of ``x_raw: [B, T, D]`` (the raw residual stream)."""
        logits = self.router(x_raw)  # [B, T, G, 2]
        execute = decide(logits, sample=self.training and not self.deterministic, tau=self.tau)
        # the real-token mask (training needs it as a tensor; otherwise None: every token is real)
        valid = mask_for(x_raw) if self.training else declared_mask(x_raw)
        own = execute
        if self.rule is not None and self.rule.applies(x_raw.shape[0], x_raw.shape[1]):
            execute = self.rule.agree(logits, execute, valid)
        self._take(execute, valid, own)

    def _take(self, execute: torch.Tensor, valid: torch.Tensor | None, own: torch.Tensor) -> None:
        """Run ``execute``; ``own``: the tokens' own decisions (``execute`` itself without a rule). In
        training the sparsity term counts ``own``: the routers answer for their own choices, not for the
        groups a rule adds to them or takes away (what ran is kept apart, for the logs)."""
        _plain_set(self, "_mask", execute)
        if self.has_followers:  # handed on, then released by the follower
            _plain_set(self, "_decision", (execute, valid, own))
        if self.training:
            self.last_skip, self.last_valid = 1.0 - own, valid
            self.last_run_skip = None if own is execute else (1.0 - execute).detach()
        else:
            self._count(execute, valid)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if _DENSE.get():  # the dense model (dense_view): no decision was made, none is read
            return self.base_layer(x)
        if self.leader is not None:
            decision = self.leader._decision
            _plain_set(self.leader, "_decision", None)
            if decision is not None and decision[0].shape[:2] == x.shape[:2]:
                self._take(*decision)
        mask = self._mask
        if mask is None or mask.shape[:2] != x.shape[:2]:
            raise RuntimeError(
                f"layer {self.layer_idx} {self.kind}: no routing decision for this input "
                f"({None if mask is None else tuple(mask.shape)} vs {tuple(x.shape)}); the router tap did not run"
            )
        _plain_set(self, "_mask", None)
        return self.base_layer(self.masker(x, mask))

    def extra_repr(self) -> str:
        return f"kind={self.kind}, layer={self.layer_idx}, groups={self.groups}"


class Counting:
    """For a runtime block that routes (mixed into an ``nn.Module``): the counters of its decisions, on
    the device and added inside its forward (so a replayed CUDA graph counts its replays), with what
    :func:`measured_sparsity` reads: ``stat_tokens`` (real tokens routed),
    ``stat_skipped`` ((token, group) pairs skipped), ``layer_idx``, ``kind``, ``groups``,
    ``macs_per_group``, taken from the routed projection ``proj`` the block stands for."""

    def setup_counts(self, proj: nn.Module, groups: int, counting: bool = True) -> None:
        """``counting``: whether the block adds its decisions (False: serving; its counts then say
        nothing, and readers report the sparsity as not measured)."""
        self.counting = counting
        self.groups, self.kind = groups, proj.kind
        self.layer_idx, self.macs_per_group = proj.layer_idx, proj.macs_per_group
        dev = proj.base_layer.weight.device
        # (real tokens, executed (token, group) pairs): one buffer, which an operator may add to itself
        self.register_buffer("stat_counts", torch.zeros(2, dtype=torch.float64, device=dev), persistent=False)

    @property
    def stat_tokens(self) -> torch.Tensor:
        return self.stat_counts[0]

    @property
    def stat_skipped(self) -> torch.Tensor:
        return self.stat_counts[0] * self.groups - self.stat_counts[1]

    def reset_stats(self) -> None:
        self.stat_counts.zero_()

    def count(self, execute: torch.Tensor, valid: torch.Tensor | None) -> None:
        """Add a decision: ``execute: [M, G]`` (bool, ``M`` the tokens in order) and ``valid``, the
        real-token mask (``[B, T]`` with ``B * T = M``) or None when every token is real."""
        if valid is None:
            self.stat_counts[0].add_(execute.shape[0])
            self.stat_counts[1].add_(execute.sum(dtype=torch.float64))
        else:
            real = valid.reshape(-1, 1).bool()
            self.stat_counts[0].add_(real.sum(dtype=torch.float64))
            self.stat_counts[1].add_((execute & real).sum(dtype=torch.float64))


class RouterTap(nn.Module):
    """Replaces a norm: routes its input (the raw residual) for ``target``, returns ``norm(x)``."""

    def __init__(self, base_layer: nn.Module, target: RoutedProjection) -> None:
        super().__init__()
        self.base_layer = base_layer
        self.__dict__["target"] = target  # a reference, not a submodule (it lives in the attention/MLP)

    def forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        if not _DENSE.get():
            self.target.route(x)
        return self.base_layer(x, *args, **kwargs)


_DENSE: contextvars.ContextVar[bool] = contextvars.ContextVar("compresskit_dense_view", default=False)


@contextlib.contextmanager
def dense_view() -> Iterator[None]:
    """Every routed sublayer runs whole inside this context (no router runs, nothing is counted):
    the model computes what the model before routing did, e.g. as a distillation teacher."""
    token = _DENSE.set(True)
    try:
        yield
    finally:
        _DENSE.reset(token)


# kind -> (sublayer, projection whose input is grouped, norm whose input the router reads)
SITES = {
    "attention": ("self_attn", "o_proj", "input_layernorm"),
    "ffn": ("mlp", "down_proj", "post_attention_layernorm"),
}


def route_sublayer(
    layer: nn.Module,
    kind: Literal["attention", "ffn"],
    router: GroupRouter | None,
    *,
    layer_idx: int,
    macs_per_group: int,
    leader: RoutedProjection | None = None,
    masker: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
) -> RoutedProjection:
    """Route one sublayer of a Llama-style decoder layer in place: wrap its ``o_proj`` (attention)
    or ``down_proj`` (FFN) in a :class:`RoutedProjection` and, given a router, put a
    :class:`RouterTap` on the norm whose input that router reads. Returns the projection."""
    sublayer_name, proj_name, norm_name = SITES[kind]
    sublayer = getattr(layer, sublayer_name)
    proj = RoutedProjection(
        getattr(sublayer, proj_name),
        router,
        kind=kind,
        layer_idx=layer_idx,
        macs_per_group=macs_per_group,
        leader=leader,
        masker=masker,
    )
    replace_module(sublayer, proj_name, proj)
    if router is not None:
        replace_module(layer, norm_name, RouterTap(getattr(layer, norm_name), proj))
    return proj


def routed_projections(model: nn.Module) -> list[tuple[str, RoutedProjection]]:
    return [(n, m) for n, m in model.named_modules() if isinstance(m, RoutedProjection)]


def routers(model: nn.Module) -> list[nn.Parameter]:
    """The trainable parameters of every router in ``model``."""
    return [p for _, proj in routed_projections(model) if proj.router is not None for p in proj.router.parameters()]


def set_rule(model: nn.Module, rule_for: Callable[[str], DecisionRule | None] | None) -> int:
    """Set each router of ``model`` to decide under ``rule_for(kind)`` (a :class:`DecisionRule`, or None: each
    token's own decision), ``kind`` its projection's ("attention" or "ffn"); ``rule_for`` None clears every rule.
    Returns how many routers it set (0: the model has none)."""
    n = 0
    for _, proj in routed_projections(model):
        if proj.router is not None:
            proj.rule = None if rule_for is None else rule_for(proj.kind)
            n += 1
    return n


def unwrap(model: nn.Module) -> nn.Module:
    """Put every original module back (the dense model, exactly)."""
    for name, module in list(model.named_modules()):
        if isinstance(module, (RoutedProjection, RouterTap)):
            replace_module(model, name, module.base_layer)
    return model


def batch_skip_fractions(projections: list[RoutedProjection], total_macs_per_token: float) -> dict[str, torch.Tensor]:
    """Skip fractions of the last training batch, differentiable through the ST masks: per kind,
    the mean over projections of the skipped (token, group) fraction over real tokens; and
    ``macs``, the skipped fraction of ``total_macs_per_token`` (all projection MACs of the model).
    They count the tokens' own decisions; where a rule changed them in the loop, ``run_macs`` (no gradient)
    is the fraction of what ran."""
    per_kind: dict[str, list[torch.Tensor]] = {"attention": [], "ffn": []}
    skipped_macs = run_macs = 0.0
    tokens, agreed = None, False
    for proj in projections:
        if proj.last_skip is None:
            continue
        valid = proj.last_valid.unsqueeze(-1)  # [B, T, 1]
        tokens = valid.sum().clamp_min(1.0)
        skipped_groups = (proj.last_skip * valid).sum()
        per_kind[proj.kind].append(skipped_groups / (tokens * proj.groups))
        skipped_macs = skipped_macs + skipped_groups * proj.macs_per_group
        ran = proj.last_skip if proj.last_run_skip is None else proj.last_run_skip
        run_macs = run_macs + (ran.detach() * valid).sum() * proj.macs_per_group
        agreed |= proj.last_run_skip is not None
    out: dict[str, torch.Tensor] = {k: torch.stack(v).mean() for k, v in per_kind.items() if v}
    if tokens is not None:
        out["macs"] = skipped_macs / (tokens * total_macs_per_token)
        if agreed:
            out["run_macs"] = run_macs / (tokens * total_macs_per_token)
    return out


def release_batch(projections: list[RoutedProjection]) -> None:
    """Drop the training tensors of the last batch (the autograd graph is not kept past a step)."""
    for proj in projections:
        proj.last_skip = proj.last_valid = proj.last_run_skip = None


def measured_sparsity(projections: list[RoutedProjection], model_config) -> SparsityReport:
    """The realised sparsity counted by the projections since their last ``reset_stats``: skipped
    projection MACs per layer, and skipped (token, group) slots per kind."""
    rep = SparsityReport.empty(model_config.num_hidden_layers, dynamic=True)
    macs = layer_linear_macs(model_config)
    tokens = max((float(p.stat_tokens) for p in projections), default=0.0)
    for layer in rep.layers:
        layer["attention"].total = tokens * sum(macs[p] for p in ATTENTION_PROJ)
        layer["ffn"].total = tokens * sum(macs[p] for p in FFN_PROJ)
    for proj in projections:
        rep.layers[proj.layer_idx][proj.kind].skipped += float(proj.stat_skipped) * proj.macs_per_group
        slots = rep.groups.setdefault(proj.kind, BlockCount())
        slots.skipped += float(proj.stat_skipped)
        slots.total += float(proj.stat_tokens) * proj.groups
    rep.tokens = int(tokens)
    return rep


def router_state_dict(
    model: nn.Module, prefix: str, named: list[tuple[str, RoutedProjection]] | None = None
) -> dict[str, torch.Tensor]:
    """Every router's tensors (fp32, CPU), keyed ``<prefix><projection name>.router.<tensor>``;
    ``named``: the (name, projection) pairs to key by (default: the model's current names)."""
    return {
        f"{prefix}{name}.router.{k}": v.detach().float().cpu()
        for name, proj in (routed_projections(model) if named is None else named)
        if proj.router is not None
        for k, v in proj.router.state_dict().items()
    }


def load_router_state_dict(
    model: nn.Module,
    state: dict[str, torch.Tensor],
    prefix: str,
    owner: str,
    named: list[tuple[str, RoutedProjection]] | None = None,
) -> None:
    """Load what :func:`router_state_dict` saved. A missing, unexpected or misshapen key is an
    :class:`~compresskit.errors.ArtifactError`, never a silently random router."""
    named = routed_projections(model) if named is None else named
    expected = router_state_dict(model, prefix, named)
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    if missing or unexpected:
        raise ArtifactError(
            f"{owner}: router checkpoint does not match the model: {len(missing)} missing keys "
            f"(e.g. {missing[:2]}), {len(unexpected)} unexpected keys (e.g. {unexpected[:2]}); "
            "check the group sizes, router_rank and targets"
        )
    for key, value in expected.items():
        if state[key].shape != value.shape:
            raise ArtifactError(
                f"{owner}: {key} has shape {tuple(state[key].shape)}, the model expects {tuple(value.shape)}"
            )
    for name, proj in named:
        if proj.router is not None:
            proj.router.load_state_dict({k: state[f"{prefix}{name}.router.{k}"] for k in proj.router.state_dict()})


@torch.inference_mode()
def calibrate_routers(
    model: nn.Module, rate: float | Callable[[RoutedProjection], float], *, tokens: int = 256, seed: int = 0
) -> None:
    """Give every router of a routed ``model`` the skip-logit biases with which each of its groups is
    skipped on a ``rate`` fraction of the tokens of a random prompt (speed runs of untrained routers:
    each router reads its real input, the residual stream, and its decisions vary by token). ``rate``:
    one fraction for every router, or a function of the router's projection."""
    taps = [m for m in model.modules() if isinstance(m, RouterTap)]
    seen: dict[int, torch.Tensor] = {}
    hooks = [t.register_forward_pre_hook(lambda m, a, i=i: seen.__setitem__(i, a[0])) for i, t in enumerate(taps)]
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, model.config.vocab_size, (1, tokens), generator=gen).to(next(model.parameters()).device)
    try:
        with dense_view():
            model(ids)
    finally:
        for h in hooks:
            h.remove()
    for i, tap in enumerate(taps):
        router = tap.target.router
        fraction = rate(tap.target) if callable(rate) else rate
        logits = router(seen[i]).reshape(-1, router.groups, 2).float()  # [tokens, G, 2]
        margin = logits[..., 1] - logits[..., 0]  # skip iff > 0
        shift = -torch.quantile(margin, 1.0 - fraction, dim=0)  # [G]: P(margin + shift > 0) = fraction
        router.up.bias.data.view(router.groups, 2)[:, 1] += shift.to(router.up.bias.dtype)


def group_contributions(proj: RoutedProjection, x: torch.Tensor, chunk: int = 256) -> torch.Tensor:
    """``[N, G]``: the norm of what each input group of ``proj`` adds to its output, per token of
    ``x: [N, in]`` (``||W[:, g] x_g||``): what skipping that group would take away."""
    weight = proj.base_layer.weight.float()
    wg = weight.unflatten(1, (proj.groups, -1))  # [out, G, g]
    out = []
    for part in x.float().split(chunk):
        xg = part.unflatten(-1, (proj.groups, -1))  # [n, G, g]
        out.append(torch.einsum("ngk,ogk->ngo", xg, wg).norm(dim=-1))
    return torch.cat(out)


def fit_routers(
    model: nn.Module,
    batches: list,
    skip: dict[str, float],
    *,
    total_macs: float,
    steps: int = 200,
    lr: float = 1e-2,
    batch_tokens: int = 1024,
    seed: int = 0,
) -> dict[str, float]:
    """Fit every router of a routed ``model`` to skip, per token, the groups that matter least, as the dense
    model measures them on ``batches`` (its own activations: no gradient through the model, a few dense
    forward passes): a warm start for the LM-loss router stage, or for a recovery stage directly.

    A (token, group) pair's importance is its :func:`group_contributions` over the norm of the residual
    stream the router reads there. ``skip`` is the budget: ``{"macs": s}`` skips the least important pairs of
    all routers together until a fraction ``s`` of ``total_macs`` a token is skipped (each pair weighted by
    the multiply-adds it saves, so the budget goes where skipping costs least); ``{"attention": a, "ffn": f}``
    the least important fraction of each kind's pairs. Each router learns those decisions (a logistic loss on
    its execute-minus-skip margin), then its skip biases are set so that each group is skipped as often as
    its labels say. Returns the fit's measures (the labels' MAC fraction, the decisions' agreement).
    """
    projections = [p for _, p in routed_projections(model)]
    leaders = [p for p in projections if p.router is not None]
    inputs: dict[int, list[torch.Tensor]] = {id(p): [] for p in leaders}
    scores: dict[int, list[torch.Tensor]] = {id(p): [] for p in leaders}
    taps = [m for m in model.modules() if isinstance(m, RouterTap)]
    hooks = [t.register_forward_pre_hook(lambda m, a: inputs[id(m.target)].append(a[0].detach())) for t in taps]

    def score(proj: RoutedProjection, args) -> None:
        lead = proj if proj.leader is None else proj.leader  # a follower's contribution counts for its leader
        value = group_contributions(proj, args[0].detach().flatten(0, -2))
        if proj.leader is not None:
            scores[id(lead)][-1] = scores[id(lead)][-1] + value
        else:
            scores[id(lead)].append(value)

    hooks += [p.register_forward_pre_hook(score) for p in projections]
    try:
        with torch.no_grad(), dense_view():
            for batch in batches:
                model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, use_cache=False)
    finally:
        for h in hooks:
            h.remove()
    real = torch.cat([b.attention_mask.flatten() for b in batches]).bool()
    whole = bool(real.all())
    x: dict[int, torch.Tensor] = {}
    importance: dict[int, torch.Tensor] = {}
    for p in leaders:  # one router's tensors at a time, its pieces freed as they are joined
        k = id(p)
        feats = torch.cat([t.flatten(0, -2).float() for t in inputs.pop(k)])
        score = torch.cat(scores.pop(k))
        if not whole:
            feats, score = feats[real.to(feats.device)], score[real.to(score.device)]
        x[k], importance[k] = feats, score / feats.norm(dim=-1, keepdim=True).clamp_min(1e-6)
    macs = {id(p): p.macs_per_group + sum(f.macs_per_group for f in projections if f.leader is p) for p in leaders}
    tokens = int(real.sum())
    keep = _skip_labels(leaders, importance, macs, skip, total_macs=total_macs, tokens=tokens)
    gen = torch.Generator().manual_seed(seed)
    agree = 0.0
    skipped_macs = 0.0
    for p in leaders:
        if id(p) not in keep:
            continue
        router, target, feats = p.router, keep[id(p)].float(), x[id(p)]
        _fit_router(router, feats, target, steps=steps, lr=lr, batch_tokens=batch_tokens, generator=gen)
        with torch.no_grad():  # each group skipped as often as its labels skip it
            logits = router(feats)
            margin = logits[..., 1] - logits[..., 0]  # skip iff > 0
            shift = _rate_shift(margin, 1.0 - target.mean(0))
            router.up.bias.view(router.groups, 2)[:, 1] += shift.to(router.up.bias.dtype)
            decided = (margin + shift) <= 0  # executes
            agree += float((decided == target.bool()).float().mean()) * p.groups
            skipped_macs += float((~decided).float().sum()) * macs[id(p)]
    groups = sum(p.groups for p in leaders if id(p) in keep)
    return {
        "label_macs": float(sum(float((~keep[id(p)]).float().sum()) * macs[id(p)] for p in leaders if id(p) in keep))
        / (tokens * total_macs),
        "fit_macs": skipped_macs / (tokens * total_macs),
        "agreement": agree / max(1, groups),
        "tokens": tokens,
    }


def _skip_labels(leaders: list, importance: dict, macs: dict, skip: dict[str, float], *, total_macs, tokens) -> dict:
    """Each router's labels (``[tokens, G]`` bool, True: execute) under :func:`fit_routers`'s ``skip`` budget: the
    least important (token, group) pairs skipped, of all routers together until ``skip["macs"]`` of the
    ``tokens``' projection MACs (``total_macs`` a token) is, each pair weighted by the MACs it saves (``macs``); or
    the least important fraction of each kind's pairs."""
    keep: dict[int, torch.Tensor] = {}
    if "macs" in skip:
        flat = torch.cat([importance[id(p)].flatten().cpu() for p in leaders])
        weight = torch.cat([torch.full((importance[id(p)].numel(),), float(macs[id(p)])) for p in leaders])
        order = flat.argsort()
        budget = torch.tensor(skip["macs"] * total_macs * tokens, dtype=torch.float64)
        below = int(torch.searchsorted(weight[order].double().cumsum(0), budget))
        threshold = flat[order[min(below, len(order) - 1)]] if below > 0 else flat.min() - 1
        return {id(p): importance[id(p)] > threshold.to(importance[id(p)].device) for p in leaders}
    for kind, fraction in skip.items():
        of_kind = [p for p in leaders if p.kind == kind]
        if not of_kind:
            continue
        flat = torch.cat([importance[id(p)].flatten().cpu() for p in of_kind]).sort().values
        below = round(fraction * flat.numel())  # the pairs to skip: the lowest ``below``
        threshold = flat[below - 1] if below > 0 else flat[0] - 1
        for p in of_kind:
            keep[id(p)] = importance[id(p)] > threshold.to(importance[id(p)].device)
    return keep


def _fit_router(router: GroupRouter, feats: torch.Tensor, target: torch.Tensor, *, steps, lr, batch_tokens, generator):
    """``router`` trained to give ``target`` (``[tokens, G]``, 1: execute) from ``feats`` (the residual it reads):
    a logistic loss on its execute-minus-skip margin, ``steps`` Adam steps on random draws of ``batch_tokens``."""
    params = list(router.parameters())
    was = [q.requires_grad for q in params]
    for q in params:
        q.requires_grad_(True)
    optimizer = torch.optim.Adam(params, lr=lr)
    tokens = feats.shape[0]
    with torch.enable_grad():
        for _ in range(steps):
            idx = torch.randint(0, tokens, (min(batch_tokens, tokens),), generator=generator).to(feats.device)
            logits = router(feats[idx])
            margin = logits[..., 0] - logits[..., 1]  # execute minus skip
            loss = F.binary_cross_entropy_with_logits(margin, target[idx])
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
    for q, w in zip(params, was, strict=True):
        q.requires_grad_(w)


def _rate_shift(margin: torch.Tensor, rate: torch.Tensor) -> torch.Tensor:
    """``[G]``: what to add to each group's skip margin (``margin: [N, G]``, skip iff > 0) so that a ``rate[g]``
    fraction of its ``N`` tokens is skipped (all of them at 1, none at 0)."""
    ordered = margin.sort(dim=0).values  # ascending, per group
    n = margin.shape[0]
    shift = torch.empty_like(rate)
    for g, r in enumerate(rate.tolist()):
        skipped = round(r * n)
        if skipped <= 0:  # none: every margin below zero
            shift[g] = -ordered[-1, g].clamp_min(0) - 1.0
        elif skipped >= n:  # all: every margin above zero
            shift[g] = -ordered[0, g].clamp_max(0) + 1.0
        else:  # between the last token kept and the first skipped
            shift[g] = -(ordered[n - skipped - 1, g] + ordered[n - skipped, g]) / 2
    return shift


def group_rates(model: nn.Module, profile: SparsityProfile) -> Callable[[RoutedProjection], float]:
    """The skipped fraction of each router's groups that realises ``profile`` on ``model``: its
    fraction of each routed block's MACs at the block's relative depth (or ``profile.groups`` in every
    router), over the MACs the router's groups can skip (its own and its followers')."""
    if profile.groups is not None:
        return lambda proj: profile.groups
    macs = layer_linear_macs(model.config)
    totals = {"attention": sum(macs[p] for p in ATTENTION_PROJ), "ffn": sum(macs[p] for p in FFN_PROJ)}
    layers = model.config.num_hidden_layers
    projections = [p for _, p in routed_projections(model)]

    def rate(proj: RoutedProjection) -> float:
        led = [proj] + [p for p in projections if p.leader is proj]
        skipped = sum(profile.at(p.layer_idx, layers, p.kind) * totals[p.kind] for p in led)
        routable = sum(p.groups * p.macs_per_group for p in led)
        return min(1.0, max(0.0, skipped / routable))

    return rate


class RoutedPruner(Pruner):
    """Base of pruners built on routed projections (width or depth routing): the training hooks,
    router tensors and sparsity measurement they share.

    A subclass's ``_prepare`` wraps the model, then calls :meth:`_bind`; its config has
    ``tau_start`` and ``tau_end``; it implements ``regularization`` from :meth:`batch_fractions`.
    """

    router_prefix: ClassVar[str] = "routed."

    def _bind(self, model: nn.Module) -> None:
        """Record the routed projections (after surgery) and the model's projection MACs."""
        model.train(model.training)  # new wrappers take the model's current mode
        # the names the pruner gave its projections: what it saves under, whatever an executor
        # wraps around them later
        self.__dict__["_named"] = routed_projections(model)
        self.__dict__["_projs"] = [p for _, p in self._named]
        self._model_config = model.config
        self._total_macs = sum(layer_linear_macs(model.config).values()) * model.config.num_hidden_layers

    @property
    def projections(self) -> list[RoutedProjection]:
        return self.__dict__.get("_projs", [])

    def _finalize(self, model: nn.Module) -> nn.Module:
        for proj in self.projections:
            proj.deterministic = True
        release_batch(self.projections)
        for p in routers(model):
            p.requires_grad_(False)
        return model

    def unwrap(self, model: nn.Module) -> nn.Module:
        """Remove every router and wrapper: the dense model, exactly."""
        return unwrap(model)

    can_view_dense = True

    def dense_view(self, model: nn.Module) -> contextlib.AbstractContextManager:
        return dense_view()

    def trainable_parameters(self, model: nn.Module) -> list[nn.Parameter]:
        return routers(model)

    def on_train_step(self, step: int, total_steps: int) -> dict[str, float]:
        tau = linear_tau(step, total_steps, self.config.tau_start, self.config.tau_end)
        for proj in self.projections:
            proj.tau = tau
        return {"tau": tau}

    def batch_fractions(self) -> dict[str, torch.Tensor]:
        """Differentiable skip fractions of the last training batch (see :func:`batch_skip_fractions`);
        the batch's tensors are released afterwards."""
        rho = batch_skip_fractions(self.projections, self._total_macs)
        release_batch(self.projections)
        self._last_rho = {k: v.detach() for k, v in rho.items()}  # (read back with the step's other logs)
        return rho

    def train_metrics(self, model: nn.Module) -> dict[str, float | torch.Tensor]:
        return {f"sparsity_{k}": v for k, v in getattr(self, "_last_rho", {}).items()}

    def state_dict(self, model: nn.Module) -> dict[str, torch.Tensor]:
        return router_state_dict(model, self.router_prefix, self.__dict__.get("_named"))

    def load_state_dict(self, model: nn.Module, state: dict[str, torch.Tensor]) -> None:
        load_router_state_dict(model, state, self.router_prefix, type(self).__name__, self.__dict__.get("_named"))

    @property
    def total_macs(self) -> float:
        """The model's projection multiply-adds a token (what a ``macs`` budget is a fraction of)."""
        return self._total_macs

    def skip_budget(self) -> dict[str, float]:
        """The budget :func:`fit_routers` fits the routers to: ``{"macs": s}`` for a fraction of the projection
        MACs, else ``{"attention": a, "ffn": f}``, each kind's fraction of (token, group) decisions. From the
        config's ``target_sparsity`` and ``budget`` (``macs``, or another name for decisions); a pruner with
        other targets says so here."""
        c = self.config
        if c.budget == "macs":
            return {"macs": c.target_sparsity}
        return {"attention": c.target_sparsity, "ffn": c.target_sparsity}

    def reset_sparsity(self, model: nn.Module) -> None:
        for _, proj in routed_projections(model):
            proj.reset_stats()

    def sparsity(self, model: nn.Module) -> SparsityReport | None:
        """The realised sparsity counted since the last reset."""
        return measured_sparsity([p for _, p in routed_projections(model)], self._model_config)

    def speed_shape(self, model: nn.Module, ctx: RunContext, profile: SparsityProfile) -> nn.Module:
        """Routed and finalized, its untrained routers calibrated to skip what ``profile`` skipped, per
        router and by relative depth (:func:`group_rates`), independently per token."""
        self.prepare(model, ctx)
        model = self.finalize(model)
        calibrate_routers(model, group_rates(model, profile))
        return model
