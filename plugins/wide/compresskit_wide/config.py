"""Configuration of the ``wide`` pruner."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from compresskit import PluginConfig


class WidePrunerConfig(PluginConfig):
    """WIDE: per-token routers choose which attention-head groups and FFN-channel groups run.

    Sample YAML::

        pruner:
          name: wide
          config:
            target_sparsity: 0.5      # or target_attention + target_ffn
            budget: groups            # groups | macs
            ffn_group_size: 128
            attn_group_size: null     # default: the query heads that share one KV head
    """

    targets: list[str] = Field(
        default_factory=lambda: ["self_attn", "mlp"],
        description="Sublayers to route: decoder layers' self_attn and/or mlp modules (name, suffix or re:).",
    )
    ignore: list[str] = Field(default_factory=list, description="Sublayers left dense, e.g. model.layers.0.mlp.")
    attn_group_size: int | None = Field(
        None, ge=1, description="Query heads per attention group; default: heads per KV head (GQA-aligned)."
    )
    ffn_group_size: int = Field(128, ge=1, description="Contiguous FFN intermediate channels per group.")
    router_rank: int = Field(32, ge=1, description="Bottleneck rank r of each router (Linear d->r->2G).")
    target_sparsity: float | None = Field(
        0.5, ge=0.0, lt=1.0, description="One target: the skipped fraction (of groups, or of MACs with budget: macs)."
    )
    target_attention: float | None = Field(None, ge=0.0, le=1.0, description="Separate attention-group target.")
    target_ffn: float | None = Field(None, ge=0.0, le=1.0, description="Separate FFN-group target.")
    budget: Literal["groups", "macs"] = Field(
        "groups",
        description="groups: mean skipped-group fraction over router types (the reference); "
        "macs: fraction of the decoder layers' linear-projection multiply-adds skipped.",
    )
    sparsity_coef: float = Field(20.0, ge=0.0, description="Weight of |target - realised| in the loss.")
    tau_start: float = Field(5.0, gt=0.0, description="Gumbel temperature at the first optimiser step.")
    tau_end: float = Field(0.5, gt=0.0, description="Gumbel temperature at the last optimiser step.")

    @model_validator(mode="before")
    @classmethod
    def _per_type_targets_replace_the_shared_one(cls, data: Any) -> Any:
        if isinstance(data, dict) and (data.get("target_attention") is not None or data.get("target_ffn") is not None):
            if "target_sparsity" in data and data["target_sparsity"] is not None:
                raise ValueError(
                    "give either target_sparsity, or target_attention and target_ffn, not both kinds "
                    f"(given target_sparsity={data['target_sparsity']}, "
                    f"target_attention={data.get('target_attention')}, "
                    f"target_ffn={data.get('target_ffn')})"
                )
            data = {**data, "target_sparsity": None}
        return data

    @model_validator(mode="after")
    def _targets_consistent(self) -> WidePrunerConfig:
        per_type = (self.target_attention is not None, self.target_ffn is not None)
        if any(per_type) and not all(per_type):
            raise ValueError("target_attention and target_ffn go together: set both or neither")
        if not any(per_type) and self.target_sparsity is None:
            raise ValueError("no sparsity target: set target_sparsity, or target_attention and target_ffn")
        if all(per_type) and self.budget == "macs":
            raise ValueError("budget: macs takes one target (target_sparsity); per-type targets need budget: groups")
        return self
