"""``static-depth``: remove whole decoder layers chosen by block influence (ShortGPT-style).

Sample YAML::

    pruner: {name: static-depth, config: {target_sparsity: 0.25}}

Calibration measures each layer's block influence, ``1 - cos(input, output)`` averaged over
calibration tokens; ``finalize`` deletes the least influential layers. The result is a stock
transformers model with fewer layers (``saves_full_model``): ``AutoModelForCausalLM.from_pretrained``
loads it with no compresskit code.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from pydantic import Field, model_validator
from torch import nn

from compresskit import PluginConfig
from compresskit.errors import RecipeError
from compresskit.hooks import HookSet, first_tensor, output_tensor
from compresskit.interfaces import Batch, PruneSummary, RunContext
from compresskit.modeling import count_parameters, decoder_layers
from compresskit.sparsity import macs_dims
from compresskit.tokens import token_mask
from compresskit_baselines.bookkeeping import StaticPruner, record_pruning
from compresskit_baselines.scoring import block_influence


class StaticDepthConfig(PluginConfig):
    target_sparsity: float | None = Field(
        0.25, gt=0.0, lt=1.0, description="Fraction of the decoder layers' projection MACs to remove (= of layers)."
    )
    n_layers: int | None = Field(None, ge=1, description="Remove exactly this many layers instead.")
    keep_first: int = Field(1, ge=0, description="Never remove the first N layers.")
    keep_last: int = Field(1, ge=0, description="Never remove the last N layers.")

    @model_validator(mode="before")
    @classmethod
    def _count_replaces_fraction(cls, data):
        if isinstance(data, dict) and data.get("n_layers") is not None:
            if data.get("target_sparsity") is not None:
                raise ValueError(
                    "give target_sparsity or n_layers, not both "
                    f"(given {data['target_sparsity']} and {data['n_layers']})"
                )
            data = {**data, "target_sparsity": None}
        return data

    @model_validator(mode="after")
    def _one_target(self):
        if self.target_sparsity is None and self.n_layers is None:
            raise ValueError("set target_sparsity or n_layers")
        return self


class StaticDepthPruner(StaticPruner):
    Config = StaticDepthConfig
    contract_config = {"target_sparsity": 0.5, "keep_first": 0, "keep_last": 0}

    def _prepare(self, model: nn.Module, ctx: RunContext) -> list[str]:
        layers = decoder_layers(model)
        n = len(layers)
        count = self.config.n_layers if self.config.n_layers is not None else round(self.config.target_sparsity * n)
        removable = n - self.config.keep_first - self.config.keep_last
        if not 1 <= count <= removable:
            raise RecipeError(
                f"pruner.config: removing {count} of {n} layers is not possible with keep_first="
                f"{self.config.keep_first} and keep_last={self.config.keep_last}; "
                f"allowed: 1..{max(removable, 0)} layers"
            )
        self._count = count
        self._scores = torch.zeros(n, dtype=torch.float64)
        self._tokens = 0
        self._params_before = count_parameters(model)
        self._original = macs_dims(model.config)
        prefix = "model.layers" if hasattr(getattr(model, "model", None), "layers") else "layers"
        return [f"{prefix}.{i}" for i in range(n)]

    @classmethod
    def with_budget(cls, config: StaticDepthConfig, fraction: float) -> StaticDepthConfig:
        """The fraction of the layers replaces a count (``n_layers``) where one was given."""
        return cls.Config.model_validate({**config.model_dump(), "target_sparsity": fraction, "n_layers": None})

    def calibrate(self, model: nn.Module, batches: Iterable[Batch]) -> None:
        super().calibrate(model, batches)
        layers = decoder_layers(model)
        valid_now: dict[str, torch.Tensor | None] = {"mask": None}

        def observe(i):
            def hook(module, args, kwargs, output):
                total, count = block_influence(first_tensor(args, kwargs), output_tensor(output), valid_now["mask"])
                self._scores[i] += total
                if i == 0:
                    self._tokens += count

            return hook

        with HookSet() as hooks, torch.no_grad():
            for i, layer in enumerate(layers):
                hooks.forward(layer, observe(i))
            for batch in batches:
                valid_now["mask"] = batch.attention_mask.float()
                with token_mask(batch.attention_mask):
                    model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, use_cache=False)
        if self._tokens == 0:
            raise RecipeError("static-depth: calibration saw no tokens; check data.calibration")

    def _finalize(self, model: nn.Module) -> nn.Module:
        if self._tokens == 0:
            raise RuntimeError("static-depth: finalize() before calibrate(): no block-influence scores")
        layers = decoder_layers(model)
        n = len(layers)
        scores = self._scores / self._tokens
        candidates = list(range(self.config.keep_first, n - self.config.keep_last))
        ranked = sorted(candidates, key=lambda i: (float(scores[i]), i))
        removed = sorted(ranked[: self._count])
        kept = [i for i in range(n) if i not in removed]
        new_layers = nn.ModuleList([layers[i] for i in kept])
        for new_idx, layer in enumerate(new_layers):
            attn = getattr(layer, "self_attn", None)
            if attn is not None and hasattr(attn, "layer_idx"):
                attn.layer_idx = new_idx  # the KV cache is indexed by position in the stack
            if hasattr(layer, "layer_idx"):
                layer.layer_idx = new_idx
        model.model.layers = new_layers
        cfg = model.config
        cfg.num_hidden_layers = len(kept)
        if getattr(cfg, "layer_types", None):
            cfg.layer_types = [cfg.layer_types[i] for i in kept]
        self._removed = removed
        self._block_influence = [round(float(s), 6) for s in scores]
        record_pruning(cfg, "static-depth", self._original, removed_layers=removed)
        return model

    def summary(self, model: nn.Module) -> PruneSummary:
        return PruneSummary(
            method="static-depth",
            targeted=[f"model.layers.{i}" for i in self._removed],
            params_before=self._params_before,
            params_after=count_parameters(model),
            details={"removed_layers": self._removed, "block_influence": self._block_influence},
        )
