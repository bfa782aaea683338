"""The ``wide`` pruner: surgery and budget. Routers, routed layers and the shared training and
measurement hooks are in ``compresskit.routing``; kernels dispatch through ``kernels.ops``.

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

import contextlib
import re

import torch
from torch import nn

from compresskit.errors import RecipeError, check_divides
from compresskit.interfaces import PruneSummary, RunContext
from compresskit.modeling import count_parameters, decoder_layers, select_modules
from compresskit.routing import GroupRouter, RoutedPruner, route_sublayer, routed_projections
from compresskit_wide.config import WidePrunerConfig
from compresskit_wide.consensus import WideTrainingOptions, set_consensus, trained_rule
from compresskit_wide.layers import kernel_masker

PREFIX = "wide."
_SUBLAYER = re.compile(r"^(?:.*\.)?layers\.(\d+)\.(self_attn|mlp)$")


def resolve_group_sizes(config: WidePrunerConfig, model_config) -> tuple[int, int]:
    """(attention group size, FFN group size) for this model, with clear errors."""
    n_q = model_config.num_attention_heads
    n_kv = getattr(model_config, "num_key_value_heads", None) or n_q
    attn = config.attn_group_size or n_q // n_kv
    check_divides("pruner.config.attn_group_size", attn, n_q, "num_attention_heads")
    check_divides(
        "pruner.config.ffn_group_size", config.ffn_group_size, model_config.intermediate_size, "intermediate_size"
    )
    return attn, config.ffn_group_size


class WidePruner(RoutedPruner):
    Config = WidePrunerConfig
    router_prefix = PREFIX
    contract_config = {"ffn_group_size": 16, "router_rank": 4}
    runtime_executor = "wide-triton"
    TrainingOptions = WideTrainingOptions

    # -- training options: shared routing in the loop ------------------------------------------
    @contextlib.contextmanager
    def training_scope(self, model: nn.Module, config):
        """A stage's ``consensus`` (``WideTrainingOptions``) on every router while it trains; per token after. A
        config without the options (a stage's own, built by hand) trains per token."""
        rule = getattr(config, "consensus", None)
        if rule is None:
            yield
            return
        set_consensus(model, rule, config.consensus_gradient)
        try:
            yield
        finally:
            set_consensus(model, None)  # evaluation and the runtime take the executor's rule

    @classmethod
    def trained_options(cls, recipe: dict) -> dict:
        """The ``wide-triton`` executor's ``consensus`` its last training stage ran in the loop, where it did."""
        rule = trained_rule(recipe)
        return {} if rule is None else {"consensus": rule.model_dump(exclude_defaults=True, exclude={"schema_version"})}

    # -- surgery ------------------------------------------------------------------------------
    def check(self, model_config) -> None:
        act = getattr(model_config, "hidden_act", "silu")
        if act != "silu":
            raise RecipeError(f"pruner: wide needs a SwiGLU FFN (hidden_act silu); this model has {act!r}")
        resolve_group_sizes(self.config, model_config)

    def _prepare(self, model: nn.Module, ctx: RunContext) -> list[str]:
        cfg = model.config
        self.check(cfg)
        attn_g, ffn_g = resolve_group_sizes(self.config, cfg)
        self._params_before = count_parameters(model)
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
            idx = int(match.group(1))
            if match.group(2) == "self_attn":  # q rows + o columns of the group's heads
                kind, groups, macs = "attention", cfg.num_attention_heads // attn_g, 2 * attn_g * head_dim * d
            else:  # gate and up rows, down columns of the group's channels
                kind, groups, macs = "ffn", cfg.intermediate_size // ffn_g, 3 * ffn_g * d
            router = GroupRouter(d, groups, self.config.router_rank).to(ctx.device)
            route_sublayer(layers[idx], kind, router, layer_idx=idx, macs_per_group=macs, masker=kernel_masker())
            targeted.append(name)
        self._bind(model)
        self._attn_g, self._ffn_g = attn_g, ffn_g
        return targeted

    def regularization(self, model: nn.Module) -> torch.Tensor | None:
        rho = self.batch_fractions()
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
        return c.sparsity_coef * loss

    def skip_budget(self) -> dict[str, float]:
        c = self.config
        if c.target_sparsity is None:  # one target a kind
            return {k: t for k, t in (("attention", c.target_attention), ("ffn", c.target_ffn)) if t is not None}
        return super().skip_budget()

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
