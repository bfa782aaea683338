"""``dynamic-depth``: per-token routers that skip whole sublayers (or whole layers).

Sample YAML::

    pruner: {name: dynamic-depth, config: {target_sparsity: 0.5, granularity: sublayer}}
    training:
      - {name: router, config: {steps: 600, lr: 2.0e-3}}

In every decoder layer a router reading the residual entering the layer decides, per token,
whether the attention sublayer runs, and a router reading the residual after the attention add
decides whether the FFN runs (``granularity: sublayer``, the like-for-like control for WIDE:
the same routers, Gumbel straight-through training, temperature schedule and budget, one group
per sublayer). ``granularity: layer`` uses one router per layer, on the layer input, for both.
A skipped attention sublayer still computes and caches K and V, so cached decoding stays exact;
its output (and a skipped FFN's) contributes exactly nothing. Trained by the core ``router``
stage. The budget is the skipped fraction of the decoder layers' projection MACs
(``budget: macs``, the default, the scale every method is compared on) or of the decisions.
"""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import Field
from torch import nn

from compresskit import PluginConfig
from compresskit.errors import RecipeError
from compresskit.interfaces import PruneSummary, RunContext
from compresskit.modeling import count_parameters, decoder_layers
from compresskit.routing import GroupRouter, RoutedPruner, route_sublayer, routed_projections
from compresskit.sparsity import layer_linear_macs

PREFIX = "dynamic_depth."


class DynamicDepthConfig(PluginConfig):
    granularity: Literal["sublayer", "layer"] = Field(
        "sublayer", description="sublayer: attention and FFN routed separately; layer: one decision for both."
    )
    ignore_layers: list[int] = Field(default_factory=list, description="Layer indices left dense.")
    router_rank: int = Field(32, ge=1)
    target_sparsity: float = Field(0.5, ge=0.0, lt=1.0, description="Target skipped fraction (see budget).")
    budget: Literal["macs", "decisions"] = Field(
        "macs", description="macs: skipped fraction of projection MACs; decisions: of sublayer decisions."
    )
    sparsity_coef: float = Field(20.0, ge=0.0)
    tau_start: float = Field(5.0, gt=0.0)
    tau_end: float = Field(0.5, gt=0.0)


class DynamicDepthPruner(RoutedPruner):
    Config = DynamicDepthConfig
    router_prefix = PREFIX
    contract_config = {"router_rank": 4}
    runtime_executor = "depth-skip"

    def _prepare(self, model: nn.Module, ctx: RunContext) -> list[str]:
        cfg = model.config
        macs = layer_linear_macs(cfg)
        layers = decoder_layers(model)
        self._params_before = count_parameters(model)
        bad = [i for i in self.config.ignore_layers if not 0 <= i < len(layers)]
        if bad:
            raise RecipeError(
                f"pruner.config.ignore_layers: {bad} out of range; the model has layers 0..{len(layers) - 1}"
            )
        d, rank = cfg.hidden_size, self.config.router_rank
        targeted = []
        for i, layer in enumerate(layers):
            if i in self.config.ignore_layers:
                continue
            attn_macs = macs["q"] + macs["o"]  # K and V still run for the cache
            ffn_macs = macs["gate"] + macs["up"] + macs["down"]
            attn = route_sublayer(
                layer, "attention", GroupRouter(d, 1, rank).to(ctx.device), layer_idx=i, macs_per_group=attn_macs
            )
            if self.config.granularity == "sublayer":
                route_sublayer(
                    layer, "ffn", GroupRouter(d, 1, rank).to(ctx.device), layer_idx=i, macs_per_group=ffn_macs
                )
            else:  # one decision per layer: the FFN follows the attention router
                route_sublayer(layer, "ffn", None, leader=attn, layer_idx=i, macs_per_group=ffn_macs)
            targeted.append(f"model.layers.{i}")
        self._bind(model)
        return targeted

    def regularization(self, model: nn.Module) -> torch.Tensor | None:
        rho = self.batch_fractions()
        if not rho:
            return None
        if self.config.budget == "macs":
            realised = rho["macs"]
        else:
            realised = torch.stack([rho[k] for k in ("attention", "ffn") if k in rho]).mean()
        return self.config.sparsity_coef * (self.config.target_sparsity - realised).abs()

    def summary(self, model: nn.Module) -> PruneSummary:
        return PruneSummary(
            method="dynamic-depth",
            targeted=[n for n, _ in routed_projections(model)],
            params_before=self._params_before,
            params_after=count_parameters(model),
            details={"granularity": self.config.granularity, "budget": self.config.budget},
        )
