"""The ``wide`` pruner: lifecycle and bookkeeping. The tensor math is in router.py and layers.py.

Sample YAML::

    pruner: {name: wide, config: {target_sparsity: 0.5, ffn_group_size: 128}}
    training:
      - {name: router, config: {steps: 200, lr: 2.0e-3}}     # stage 1: routers only
      - {name: lora, config: {steps: 200, lr: 2.0e-4}}       # stage 2: LoRA + routers

Lifecycle: ``prepare`` wraps every targeted layer's norms and o_proj/down_proj (routers in fp32);
training stages optimise ``trainable_parameters`` (the routers) on the LM loss plus
``regularization`` (``sparsity_coef * |target - realised|``), with ``on_train_step`` annealing
the Gumbel temperature; ``finalize`` makes routing deterministic (argmax) and freezes the
routers; ``state_dict`` holds the router tensors only.
"""

from __future__ import annotations

import re

import torch
from torch import nn

from compresskit.errors import RecipeError
from compresskit.interfaces import Pruner, PruneSummary, RunContext
from compresskit.modeling import count_parameters, decoder_layers, replace_module, select_modules
from compresskit.routing import (
    GroupRouter,
    RoutedProjection,
    RouterTap,
    batch_skip_fractions,
    linear_tau,
    load_router_state_dict,
    measured_sparsity,
    release_batch,
    routed_projections,
    router_state_dict,
    unwrap,
)
from compresskit.sparsity import SparsityReport, layer_linear_macs
from compresskit_wide.config import WidePrunerConfig
from compresskit_wide.layers import wide_projection

PREFIX = "wide."
_SUBLAYER = re.compile(r"^(?:.*\.)?layers\.(\d+)\.(self_attn|mlp)$")


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def resolve_group_sizes(config: WidePrunerConfig, model_config) -> tuple[int, int]:
    """(attention group size, FFN group size) for this model, with clear errors."""
    n_q = model_config.num_attention_heads
    n_kv = getattr(model_config, "num_key_value_heads", None) or n_q
    attn = config.attn_group_size or n_q // n_kv
    if n_q % attn:
        raise RecipeError(
            f"pruner.config.attn_group_size: {attn} does not divide num_attention_heads {n_q}; "
            f"valid: {', '.join(map(str, _divisors(n_q)))}"
        )
    ffn = model_config.intermediate_size
    if ffn % config.ffn_group_size:
        raise RecipeError(
            f"pruner.config.ffn_group_size: {config.ffn_group_size} does not divide intermediate_size {ffn}; "
            f"valid: {', '.join(map(str, _divisors(ffn)))}"
        )
    return attn, config.ffn_group_size


class WidePruner(Pruner):
    Config = WidePrunerConfig
    contract_config = {"ffn_group_size": 16, "router_rank": 4}

    # -- surgery ------------------------------------------------------------------------------
    def _prepare(self, model: nn.Module, ctx: RunContext) -> list[str]:
        cfg = model.config
        act = getattr(cfg, "hidden_act", "silu")
        if act != "silu":
            raise RecipeError(f"pruner: wide needs a SwiGLU FFN (hidden_act silu); this model has {act!r}")
        attn_g, ffn_g = resolve_group_sizes(self.config, cfg)
        self._model_config = cfg
        self._params_before = count_parameters(model)
        macs = layer_linear_macs(cfg)
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        d = cfg.hidden_size
        layers = decoder_layers(model)
        targeted = []
        for name, _ in select_modules(model, self.config.targets, self.config.ignore):
            match = _SUBLAYER.match(name)
            if not match:
                raise RecipeError(
                    f"pruner.config.targets: {name!r} is not a decoder layer's self_attn or mlp; "
                    "wide routes whole sublayers (e.g. targets: [self_attn, mlp])"
                )
            idx, kind = int(match.group(1)), match.group(2)
            layer = layers[idx]
            dev = ctx.device
            if kind == "self_attn":
                groups = cfg.num_attention_heads // attn_g
                router = GroupRouter(d, groups, self.config.router_rank).to(dev)
                proj = wide_projection(
                    layer.self_attn.o_proj,
                    router,
                    kind="attention",
                    layer_idx=idx,
                    macs_per_group=2 * attn_g * head_dim * d,  # q rows + o columns of the group's heads
                )
                replace_module(layer.self_attn, "o_proj", proj)
                replace_module(layer, "input_layernorm", RouterTap(layer.input_layernorm, proj))
            else:
                groups = cfg.intermediate_size // ffn_g
                router = GroupRouter(d, groups, self.config.router_rank).to(dev)
                proj = wide_projection(
                    layer.mlp.down_proj,
                    router,
                    kind="ffn",
                    layer_idx=idx,
                    macs_per_group=3 * ffn_g * d,  # gate and up rows, down columns
                )
                replace_module(layer.mlp, "down_proj", proj)
                replace_module(layer, "post_attention_layernorm", RouterTap(layer.post_attention_layernorm, proj))
            targeted.append(name)
        model.train(model.training)  # new wrappers take the model's current mode
        self._bind(model)
        self._layer_macs = sum(macs.values())
        self._num_layers = len(layers)
        self._attn_g, self._ffn_g = attn_g, ffn_g
        return targeted

    def _finalize(self, model: nn.Module) -> nn.Module:
        for _, proj in routed_projections(model):
            proj.deterministic = True
            proj.last_skip = proj.last_valid = None
            for p in proj.router.parameters():
                p.requires_grad_(False)
        return model

    def unwrap(self, model: nn.Module) -> nn.Module:
        """Remove every router and wrapper: the dense model, exactly."""
        return unwrap(model)

    # -- training hooks -----------------------------------------------------------------------
    def trainable_parameters(self, model: nn.Module) -> list[nn.Parameter]:
        return [p for _, proj in routed_projections(model) for p in proj.router.parameters()]

    def on_train_step(self, step: int, total_steps: int) -> dict[str, float]:
        tau = linear_tau(step, total_steps, self.config.tau_start, self.config.tau_end)
        for _, proj in self._projections:
            proj.tau = tau
        return {"tau": tau}

    @property
    def _projections(self) -> list[tuple[str, RoutedProjection]]:
        return self.__dict__.get("_proj_cache") or []

    def _bind(self, model: nn.Module) -> list[tuple[str, RoutedProjection]]:
        self.__dict__["_proj_cache"] = routed_projections(model)
        return self._projections

    def realised(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """Skip fractions of the last training batch (differentiable): per router type (mean over
        layers of skipped-group fractions, real tokens only) and of the linear MACs."""
        projs = [p for _, p in self._bind(model)]
        return batch_skip_fractions(projs, self._layer_macs * self._num_layers)

    def regularization(self, model: nn.Module) -> torch.Tensor | None:
        rho = self.realised(model)
        release_batch([p for _, p in self._projections])
        if not rho:
            return None
        c = self.config
        if c.budget == "macs":
            loss = (c.target_sparsity - rho["macs"]).abs()
        elif c.target_sparsity is not None:
            kinds = [rho[k] for k in ("attention", "ffn") if k in rho]
            loss = (c.target_sparsity - torch.stack(kinds).mean()).abs()
        else:
            targets = {"attention": c.target_attention, "ffn": c.target_ffn}
            loss = torch.stack([(targets[k] - rho[k]).abs() for k in ("attention", "ffn") if k in rho]).mean()
        self._last_rho = {k: float(v.detach()) for k, v in rho.items()}
        return c.sparsity_coef * loss

    def train_metrics(self, model: nn.Module) -> dict[str, float]:
        return {f"sparsity_{k}": v for k, v in getattr(self, "_last_rho", {}).items()}

    # -- tensors ------------------------------------------------------------------------------
    def state_dict(self, model: nn.Module) -> dict[str, torch.Tensor]:
        return router_state_dict(model, PREFIX)

    def load_state_dict(self, model: nn.Module, state: dict[str, torch.Tensor]) -> None:
        load_router_state_dict(model, state, PREFIX, "wide")

    # -- measurement --------------------------------------------------------------------------
    def reset_sparsity(self, model: nn.Module) -> None:
        for _, proj in routed_projections(model):
            proj.reset_stats()

    def sparsity(self, model: nn.Module) -> SparsityReport:
        return measured_sparsity([p for _, p in routed_projections(model)], self._model_config)

    def summary(self, model: nn.Module) -> PruneSummary:
        projs = routed_projections(model)
        router_params = sum(p.numel() for _, pr in projs for p in pr.router.parameters())
        return PruneSummary(
            method="wide",
            targeted=[n for n, _ in projs],
            params_before=self._params_before,
            params_after=count_parameters(model),
            details={
                "attn_group_size": self._attn_g,
                "ffn_group_size": self._ffn_g,
                "attention_groups": self._model_config.num_attention_heads // self._attn_g,
                "ffn_groups": self._model_config.intermediate_size // self._ffn_g,
                "router_params": router_params,
                "budget": self.config.budget,
            },
        )
