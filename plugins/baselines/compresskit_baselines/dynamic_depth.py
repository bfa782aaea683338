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

from compresskit import PluginConfig, Pruner
from compresskit.errors import RecipeError
from compresskit.interfaces import PruneSummary, RunContext
from compresskit.modeling import count_parameters, decoder_layers, replace_module
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
    routers,
    unwrap,
)
from compresskit.sparsity import SparsityReport, layer_linear_macs

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


class DynamicDepthPruner(Pruner):
    Config = DynamicDepthConfig
    contract_config = {"router_rank": 4}

    def _prepare(self, model: nn.Module, ctx: RunContext) -> list[str]:
        cfg = model.config
        macs = layer_linear_macs(cfg)
        layers = decoder_layers(model)
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
            attn = RoutedProjection(
                layer.self_attn.o_proj,
                GroupRouter(d, 1, rank).to(ctx.device),
                kind="attention",
                layer_idx=i,
                macs_per_group=macs["q"] + macs["o"],  # K and V still run for the cache
            )
            replace_module(layer.self_attn, "o_proj", attn)
            replace_module(layer, "input_layernorm", RouterTap(layer.input_layernorm, attn))
            if self.config.granularity == "sublayer":
                ffn = RoutedProjection(
                    layer.mlp.down_proj,
                    GroupRouter(d, 1, rank).to(ctx.device),
                    kind="ffn",
                    layer_idx=i,
                    macs_per_group=macs["gate"] + macs["up"] + macs["down"],
                )
                replace_module(layer, "post_attention_layernorm", RouterTap(layer.post_attention_layernorm, ffn))
            else:
                ffn = RoutedProjection(
                    layer.mlp.down_proj,
                    None,
                    leader=attn,
                    kind="ffn",
                    layer_idx=i,
                    macs_per_group=macs["gate"] + macs["up"] + macs["down"],
                )
            replace_module(layer.mlp, "down_proj", ffn)
            targeted.append(f"model.layers.{i}")
        model.train(model.training)
        self._model_config = cfg
        self._total_macs = sum(macs.values()) * len(layers)
        self._params_before = count_parameters(model)
        self.__dict__["_projs"] = [p for _, p in routed_projections(model)]
        return targeted

    def _finalize(self, model: nn.Module) -> nn.Module:
        for _, proj in routed_projections(model):
            proj.deterministic = True
        release_batch([p for _, p in routed_projections(model)])
        for p in routers(model):
            p.requires_grad_(False)
        return model

    def unwrap(self, model: nn.Module) -> nn.Module:
        return unwrap(model)

    def trainable_parameters(self, model: nn.Module) -> list[nn.Parameter]:
        return routers(model)

    def on_train_step(self, step: int, total_steps: int) -> dict[str, float]:
        tau = linear_tau(step, total_steps, self.config.tau_start, self.config.tau_end)
        for proj in self.__dict__.get("_projs", []):
            proj.tau = tau
        return {"tau": tau}

    def regularization(self, model: nn.Module) -> torch.Tensor | None:
        projs = self.__dict__.get("_projs", [])
        rho = batch_skip_fractions(projs, self._total_macs)
        release_batch(projs)
        if not rho:
            return None
        if self.config.budget == "macs":
            realised = rho["macs"]
        else:
            realised = torch.stack([rho[k] for k in ("attention", "ffn") if k in rho]).mean()
        self._last_rho = {k: float(v.detach()) for k, v in rho.items()}
        return self.config.sparsity_coef * (self.config.target_sparsity - realised).abs()

    def train_metrics(self, model: nn.Module) -> dict[str, float]:
        return {f"sparsity_{k}": v for k, v in getattr(self, "_last_rho", {}).items()}

    def state_dict(self, model: nn.Module) -> dict[str, torch.Tensor]:
        return router_state_dict(model, PREFIX)

    def load_state_dict(self, model: nn.Module, state: dict[str, torch.Tensor]) -> None:
        load_router_state_dict(model, state, PREFIX, "dynamic-depth")

    def reset_sparsity(self, model: nn.Module) -> None:
        for _, proj in routed_projections(model):
            proj.reset_stats()

    def sparsity(self, model: nn.Module) -> SparsityReport:
        return measured_sparsity([p for _, p in routed_projections(model)], self._model_config)

    def summary(self, model: nn.Module) -> PruneSummary:
        return PruneSummary(
            method="dynamic-depth",
            targeted=[n for n, _ in routed_projections(model)],
            params_before=self._params_before,
            params_after=count_parameters(model),
            details={"granularity": self.config.granularity, "budget": self.config.budget},
        )
