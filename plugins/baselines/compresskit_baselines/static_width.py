"""``static-width``: one-shot structured width pruning driven by calibration activations.

Sample YAML::

    pruner: {name: static-width, config: {target_sparsity: 0.25, score: wanda, attention: per_kv_group}}

Calibration records the input-activation norm of every projection; each attention head (or KV
group) and each contiguous FFN channel group gets a Wanda-style score ``sum |W| * ||X||`` over
the weights it owns (``score: magnitude`` drops the activation term). ``finalize`` removes the
same number of the lowest-scoring units from every layer, so the result is a uniform, physically
smaller model that stock ``AutoModelForCausalLM.from_pretrained`` loads (``saves_full_model``).

Attention stays GQA-consistent: ``per_kv_group`` removes the same number of query heads from
every KV group (K and V are kept); ``kv_groups`` removes whole KV groups (their query heads, K and
V); ``none`` leaves attention alone. The unit counts are chosen so that the removed fraction of
the decoder layers' projection MACs is as close as the granularity allows to ``target_sparsity``.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Literal

import torch
from pydantic import Field
from torch import nn

from compresskit import PluginConfig
from compresskit.errors import RecipeError, check_divides
from compresskit.hooks import HookSet, first_tensor
from compresskit.interfaces import Batch, PruneSummary, RunContext
from compresskit.modeling import count_parameters, decoder_layers, replace_module
from compresskit.sparsity import layer_linear_macs, macs_dims
from compresskit_baselines.bookkeeping import StaticPruner, record_pruning
from compresskit_baselines.scoring import group_sum, wanda_cols, wanda_rows

INPUTS = ("q_proj", "o_proj", "gate_proj", "down_proj")  # k, v share q's input; up shares gate's


class StaticWidthConfig(PluginConfig):
    target_sparsity: float = Field(0.25, gt=0.0, lt=1.0, description="Fraction of projection MACs to remove.")
    score: Literal["wanda", "magnitude"] = Field("wanda", description="wanda: |W| x ||X||; magnitude: |W|.")
    attention: Literal["per_kv_group", "kv_groups", "none"] = Field(
        "per_kv_group", description="How heads are removed, GQA-consistently (see the module docstring)."
    )
    prune_ffn: bool = Field(True, description="Remove FFN channel groups.")
    ffn_group_size: int = Field(128, ge=1, description="Contiguous FFN channels per group (as in WIDE).")


def _attention_options(cfg: dict, mode: str) -> list[tuple[int, int]]:
    """(units removed per layer, MACs removed per token per layer) for each attention choice."""
    d, nq, nkv, hd = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    hpk = nq // nkv
    if mode == "none":
        return [(0, 0)]
    if mode == "per_kv_group":
        return [(h, 2 * h * nkv * hd * d) for h in range(hpk)]  # h query heads out of every KV group
    return [(g, 2 * g * hpk * hd * d + 2 * g * hd * d) for g in range(nkv)]  # whole KV groups


def choose_counts(cfg: dict, config: StaticWidthConfig) -> tuple[int, int, float]:
    """(attention units, FFN groups) removed per layer, and the MAC fraction that gives."""
    macs = layer_linear_macs(type("C", (), cfg))
    total = sum(macs.values())
    attn_total = sum(macs[p] for p in ("q", "k", "v", "o"))
    ffn_total = sum(macs[p] for p in ("gate", "up", "down"))
    n_groups = cfg["intermediate_size"] // config.ffn_group_size
    ffn_options = [
        (f, f * 3 * config.ffn_group_size * cfg["hidden_size"]) for f in range(n_groups if config.prune_ffn else 1)
    ]
    best = None
    for a, a_macs in _attention_options(cfg, config.attention):
        for f, f_macs in ffn_options:
            frac = (a_macs + f_macs) / total
            balance = abs(a_macs / attn_total - f_macs / ffn_total)
            key = (round(abs(frac - config.target_sparsity), 9), balance, a)
            if best is None or key < best[0]:
                best = (key, a, f, frac)
    _, a, f, frac = best
    if a == 0 and f == 0:
        raise RecipeError(
            f"pruner.config.target_sparsity: {config.target_sparsity} rounds to removing nothing at this granularity "
            f"(attention: {config.attention}, ffn_group_size: {config.ffn_group_size}); raise it or use smaller groups"
        )
    return a, f, frac


def _slice_linear(linear: nn.Linear, rows: torch.Tensor | None = None, cols: torch.Tensor | None = None) -> nn.Linear:
    w = linear.weight.detach()
    if rows is not None:
        w = w[rows]
    if cols is not None:
        w = w[:, cols]
    bias = linear.bias
    if bias is not None and rows is not None:
        bias = bias.detach()[rows]
    new = nn.Linear(w.shape[1], w.shape[0], bias=bias is not None, device=w.device, dtype=w.dtype)
    with torch.no_grad():
        new.weight.copy_(w)
        if bias is not None:
            new.bias.copy_(bias)
    new.weight.requires_grad_(linear.weight.requires_grad)
    return new


def _rows_of(units: list[int], width: int, device) -> torch.Tensor:
    return torch.cat([torch.arange(u * width, (u + 1) * width, device=device) for u in units])


class StaticWidthPruner(StaticPruner):
    Config = StaticWidthConfig
    contract_config = {"target_sparsity": 0.3, "ffn_group_size": 16}

    def check(self, model_config) -> None:
        cfg = macs_dims(model_config)
        check_divides(
            "pruner.config.ffn_group_size", self.config.ffn_group_size, cfg["intermediate_size"], "intermediate_size"
        )
        choose_counts(cfg, self.config)  # a target that rounds to nothing is an error

    def _prepare(self, model: nn.Module, ctx: RunContext) -> list[str]:
        self.check(model.config)
        cfg = macs_dims(model.config)
        self._cfg = cfg
        self._attn_units, self._ffn_groups, self._planned = choose_counts(cfg, self.config)
        self._params_before = count_parameters(model)
        self._sq: dict[tuple[int, str], torch.Tensor] = {}  # (layer, proj) -> sum of squared inputs [K]
        return [f"model.layers.{i}" for i in range(len(decoder_layers(model)))]

    def calibrate(self, model: nn.Module, batches: Iterable[Batch]) -> None:
        super().calibrate(model, batches)
        if self.config.score == "magnitude":
            return

        def observe(key):
            def hook(module, args, kwargs):
                x = first_tensor(args, kwargs, "input").detach().float()
                sq = x.pow(2).flatten(0, -2).sum(dim=0)  # [K]
                self._sq[key] = self._sq[key] + sq if key in self._sq else sq

            return hook

        with HookSet() as hooks, torch.no_grad():
            for i, layer in enumerate(decoder_layers(model)):
                for proj in INPUTS:
                    parent = layer.self_attn if proj in ("q_proj", "o_proj") else layer.mlp
                    hooks.forward_pre(getattr(parent, proj), observe((i, proj)))
            for batch in batches:
                model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, use_cache=False)
        if not self._sq:
            raise RecipeError("static-width: calibration saw no tokens; check data.calibration")

    def _norm(self, i: int, proj: str) -> torch.Tensor | None:
        if self.config.score == "magnitude":
            return None
        if (i, proj) not in self._sq:
            raise RuntimeError("static-width: finalize() before calibrate(): no activation statistics")
        return self._sq[(i, proj)].sqrt()

    def _finalize(self, model: nn.Module) -> nn.Module:
        c = self._cfg
        nq, nkv, hd = c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
        hpk = nq // nkv
        self._removed: dict[str, list] = {"heads": [], "ffn_groups": []}
        for i, layer in enumerate(decoder_layers(model)):
            attn, mlp = layer.self_attn, layer.mlp
            if self._attn_units:
                xq, xo = self._norm(i, "q_proj"), self._norm(i, "o_proj")
                head_scores = group_sum(wanda_rows(attn.q_proj.weight, xq), hd) + group_sum(
                    wanda_cols(attn.o_proj.weight, xo), hd
                )  # [nq]
                if self.config.attention == "per_kv_group":
                    keep_heads = []
                    for g in range(nkv):
                        heads = list(range(g * hpk, (g + 1) * hpk))
                        ranked = sorted(heads, key=lambda h: (float(head_scores[h]), h))
                        keep_heads += sorted(ranked[self._attn_units :])
                    keep_kv = list(range(nkv))
                else:
                    kv_scores = head_scores.view(nkv, hpk).sum(dim=1)
                    kv_scores = kv_scores + group_sum(wanda_rows(attn.k_proj.weight, xq), hd)
                    kv_scores = kv_scores + group_sum(wanda_rows(attn.v_proj.weight, xq), hd)
                    ranked = sorted(range(nkv), key=lambda g: (float(kv_scores[g]), g))
                    keep_kv = sorted(ranked[self._attn_units :])
                    keep_heads = [h for g in keep_kv for h in range(g * hpk, (g + 1) * hpk)]
                dev = attn.q_proj.weight.device
                q_rows = _rows_of(keep_heads, hd, dev)
                kv_rows = _rows_of(keep_kv, hd, dev)
                replace_module(attn, "q_proj", _slice_linear(attn.q_proj, rows=q_rows))
                replace_module(attn, "k_proj", _slice_linear(attn.k_proj, rows=kv_rows))
                replace_module(attn, "v_proj", _slice_linear(attn.v_proj, rows=kv_rows))
                replace_module(attn, "o_proj", _slice_linear(attn.o_proj, cols=q_rows))
                attn.num_key_value_groups = len(keep_heads) // len(keep_kv)
                self._removed["heads"].append(sorted(set(range(nq)) - set(keep_heads)))
            if self._ffn_groups:
                size = self.config.ffn_group_size
                xg, xd = self._norm(i, "gate_proj"), self._norm(i, "down_proj")
                channel = wanda_rows(mlp.gate_proj.weight, xg) + wanda_rows(mlp.up_proj.weight, xg)
                channel = channel + wanda_cols(mlp.down_proj.weight, xd)
                scores = group_sum(channel, size)
                ranked = sorted(range(scores.numel()), key=lambda g: (float(scores[g]), g))
                keep = sorted(ranked[self._ffn_groups :])
                rows = _rows_of(keep, size, mlp.gate_proj.weight.device)
                replace_module(mlp, "gate_proj", _slice_linear(mlp.gate_proj, rows=rows))
                replace_module(mlp, "up_proj", _slice_linear(mlp.up_proj, rows=rows))
                replace_module(mlp, "down_proj", _slice_linear(mlp.down_proj, cols=rows))
                if hasattr(mlp, "intermediate_size"):
                    mlp.intermediate_size = rows.numel()
                self._removed["ffn_groups"].append(sorted(set(range(scores.numel())) - set(keep)))
        cfg = model.config
        if self._attn_units:
            new_nq = nq - (
                self._attn_units * nkv if self.config.attention == "per_kv_group" else self._attn_units * hpk
            )
            cfg.num_attention_heads = new_nq
            cfg.num_key_value_heads = nkv if self.config.attention == "per_kv_group" else nkv - self._attn_units
            cfg.head_dim = hd  # no longer hidden_size / num_attention_heads
        if self._ffn_groups:
            cfg.intermediate_size = c["intermediate_size"] - self._ffn_groups * self.config.ffn_group_size
        record_pruning(cfg, "static-width", c, removed=self._removed)
        self._sq.clear()
        return model

    def summary(self, model: nn.Module) -> PruneSummary:
        return PruneSummary(
            method="static-width",
            targeted=[f"model.layers.{i}" for i in range(len(decoder_layers(model)))],
            params_before=self._params_before,
            params_after=count_parameters(model),
            details={
                "attention_units_removed_per_layer": self._attn_units,
                "attention_mode": self.config.attention,
                "ffn_groups_removed_per_layer": self._ffn_groups,
                "planned_mac_fraction": round(self._planned, 6),
            },
        )
