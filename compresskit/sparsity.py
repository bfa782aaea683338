"""Accounting of the prunable work, in multiply-adds (MACs) per token.

The prunable work of a decoder layer is the MACs of its linear projections: the attention
block's ``q, k, v, o`` and the FFN block's ``gate, up, down``. Embeddings, the LM head, norms,
routers and the attention score/value products (which grow with context) are not counted.
Every method reports the fraction of this work it skipped, so that methods that prune
different things (heads, channels, whole sublayers, whole layers) are compared on one scale.

``sparsity.attention``, ``sparsity.ffn`` and ``sparsity.macs`` in ``results.json`` are the
skipped fractions of the attention block, the FFN block and of both together.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


def layer_linear_macs(config: Any) -> dict[str, int]:
    """Per-token MACs of one decoder layer's projections, from an HF Llama-style config.

    Returns ``{"q", "k", "v", "o", "gate", "up", "down"}`` -> MACs per token.
    """
    d = config.hidden_size
    n_q = config.num_attention_heads
    n_kv = getattr(config, "num_key_value_heads", None) or n_q
    head_dim = getattr(config, "head_dim", None) or d // n_q
    ffn = config.intermediate_size
    return {
        "q": d * n_q * head_dim,
        "k": d * n_kv * head_dim,
        "v": d * n_kv * head_dim,
        "o": n_q * head_dim * d,
        "gate": d * ffn,
        "up": d * ffn,
        "down": ffn * d,
    }


ATTENTION_PROJ = ("q", "k", "v", "o")
FFN_PROJ = ("gate", "up", "down")


@dataclass
class BlockCount:
    """Skipped and total MACs of one block, summed over the tokens seen."""

    skipped: float = 0.0
    total: float = 0.0

    def add(self, other: BlockCount) -> None:
        self.skipped += other.skipped
        self.total += other.total

    @property
    def fraction(self) -> float | None:
        return None if self.total == 0 else self.skipped / self.total


@dataclass
class SparsityReport:
    """Realised sparsity: skipped / total prunable MACs, overall and per layer.

    Raw sums (not fractions) are kept so that reports from several tasks or batches add up
    exactly with :meth:`merge`. ``tokens`` is the number of tokens measured (0 for a static
    method, whose sparsity does not depend on the input).
    """

    layers: list[dict[str, BlockCount]] = field(default_factory=list)
    tokens: int = 0
    dynamic: bool = False
    # Optional, for methods that skip groups of units: skipped and total (token, group) slots per
    # block kind, so the method's own budget (the mean skipped-group fraction) can be checked.
    groups: dict[str, BlockCount] = field(default_factory=dict)

    @classmethod
    def empty(cls, num_layers: int, *, dynamic: bool = False) -> SparsityReport:
        return cls(
            layers=[{"attention": BlockCount(), "ffn": BlockCount()} for _ in range(num_layers)],
            dynamic=dynamic,
        )

    @classmethod
    def dense(cls, config: Any) -> SparsityReport:
        """A report for a model that skips nothing (totals for one token)."""
        rep = cls.empty(config.num_hidden_layers)
        macs = layer_linear_macs(config)
        for layer in rep.layers:
            layer["attention"].total = sum(macs[p] for p in ATTENTION_PROJ)
            layer["ffn"].total = sum(macs[p] for p in FFN_PROJ)
        return rep

    def merge(self, other: SparsityReport) -> SparsityReport:
        if len(self.layers) != len(other.layers):
            raise ValueError(f"cannot merge reports of {len(self.layers)} and {len(other.layers)} layers")
        out = SparsityReport.empty(len(self.layers), dynamic=self.dynamic or other.dynamic)
        for mine, theirs, merged in zip(self.layers, other.layers, out.layers, strict=True):
            for block in ("attention", "ffn"):
                merged[block].add(mine[block])
                merged[block].add(theirs[block])
        out.tokens = self.tokens + other.tokens
        for kind in sorted(set(self.groups) | set(other.groups)):
            out.groups[kind] = BlockCount()
            for rep in (self, other):
                if kind in rep.groups:
                    out.groups[kind].add(rep.groups[kind])
        return out

    def _block(self, block: str) -> BlockCount:
        acc = BlockCount()
        for layer in self.layers:
            acc.add(layer[block])
        return acc

    @property
    def attention(self) -> float:
        return self._block("attention").fraction or 0.0

    @property
    def ffn(self) -> float:
        return self._block("ffn").fraction or 0.0

    @property
    def macs(self) -> float:
        att, ffn = self._block("attention"), self._block("ffn")
        total = att.total + ffn.total
        return 0.0 if total == 0 else (att.skipped + ffn.skipped) / total

    def to_dict(self, *, per_layer: bool = True) -> dict[str, Any]:
        out: dict[str, Any] = {
            "attention": round(self.attention, 6),
            "ffn": round(self.ffn, 6),
            "macs": round(self.macs, 6),
            "dynamic": self.dynamic,
            "tokens": self.tokens,
        }
        if self.groups:
            fracs = {k: v.fraction or 0.0 for k, v in sorted(self.groups.items())}
            out["groups"] = {
                **{k: round(v, 6) for k, v in fracs.items()},
                "mean": round(sum(fracs.values()) / len(fracs), 6),
            }
        if per_layer:
            out["per_layer"] = [
                {b: round(layer[b].fraction or 0.0, 6) for b in ("attention", "ffn")} for layer in self.layers
            ]
        return out


@dataclass(frozen=True)
class SparsityProfile:
    """What a run skipped, to give another model of another size its structure (a speed-only bench:
    ``Pruner.speed_shape``): ``macs``, the skipped fraction of the projection MACs; ``per_layer``, the
    run's ``{"attention": f, "ffn": f}`` a layer of its model, where measured; or ``groups``, the
    fraction of each router's groups to skip in every layer (``compresskit bench --sparsity``), which a
    static method reads as its MAC fraction. ``source``: where it came from (a run's results file)."""

    macs: float
    per_layer: tuple[dict[str, float], ...] | None = None
    groups: float | None = None
    source: str = ""

    @classmethod
    def from_results(cls, doc: dict[str, Any], source: str = "") -> SparsityProfile:
        """The realised sparsity a run's ``results.json`` records (``sparsity``); a ValueError where it
        has none."""
        rep = doc.get("sparsity")
        if not isinstance(rep, dict) or not isinstance(rep.get("macs"), (int, float)):
            raise ValueError("it records no realised sparsity (sparsity.macs)")
        layers = rep.get("per_layer") or None
        return cls(float(rep["macs"]), None if layers is None else tuple(dict(x) for x in layers), source=source)

    def at(self, layer: int, num_layers: int, block: str) -> float:
        """The skipped fraction of ``block``'s MACs ("attention" or "ffn") in layer ``layer`` of a model
        of ``num_layers`` layers: the run's layers at the same relative depth (linear between the two
        nearest centres), or ``macs`` where the run has no per-layer record."""
        if not self.per_layer:
            return self.macs
        n = len(self.per_layer)
        pos = min(max((layer + 0.5) * n / num_layers - 0.5, 0.0), n - 1.0)
        lo = int(pos)
        hi = min(lo + 1, n - 1)
        w = pos - lo
        return (1.0 - w) * self.per_layer[lo][block] + w * self.per_layer[hi][block]
