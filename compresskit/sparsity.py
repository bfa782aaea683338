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


def macs_dims(config: Any) -> dict[str, int]:
    """The dimensions of an HF config that its projection MACs depend on (what :func:`layer_linear_macs` and
    :meth:`SparsityReport.dense` read), as plain data: what a pipeline keeps of the model it started from."""
    d, n_q = config.hidden_size, config.num_attention_heads
    return {
        "hidden_size": d,
        "num_hidden_layers": config.num_hidden_layers,
        "num_attention_heads": n_q,
        "num_key_value_heads": getattr(config, "num_key_value_heads", None) or n_q,
        "head_dim": getattr(config, "head_dim", None) or d // n_q,
        "intermediate_size": config.intermediate_size,
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
    # Optional, for a pipeline of pruners (:func:`compose`): what each step skipped of the original model's
    # MACs (``skipped``) out of all of them (``total``), keyed ``"<index>:<name>"``.
    steps: dict[str, BlockCount] = field(default_factory=dict)

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

    @classmethod
    def from_dict(cls, doc: dict[str, Any]) -> SparsityReport:
        """A report with the fractions of ``doc`` (what :meth:`to_dict` wrote, ``per_layer`` included): each
        block's total is 1, so that its fractions, not its MAC counts, are what it keeps (what :func:`compose`
        reads)."""
        rep = cls.empty(len(doc["per_layer"]), dynamic=bool(doc.get("dynamic")))
        rep.tokens = int(doc.get("tokens") or 0)
        for layer, fractions in zip(rep.layers, doc["per_layer"], strict=True):
            for block in ("attention", "ffn"):
                layer[block] = BlockCount(float(fractions[block]), 1.0)
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
        for name in ("groups", "steps"):
            mine, theirs, merged = getattr(self, name), getattr(other, name), getattr(out, name)
            for kind in sorted(set(mine) | set(theirs)):
                merged[kind] = BlockCount()
                for part in (mine, theirs):
                    if kind in part:
                        merged[kind].add(part[kind])
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
        if self.steps:
            out["steps"] = _step_shares(self.steps)
        if per_layer:
            out["per_layer"] = [
                {b: round(layer[b].fraction or 0.0, 6) for b in ("attention", "ffn")} for layer in self.layers
            ]
        return out


BLOCKS = ("attention", "ffn")


def _step_shares(steps: dict[str, BlockCount]) -> list[dict[str, Any]]:
    """Each step of a pipeline in order: its name, the fraction of the original model's MACs it skipped
    (``macs``) and the fraction of the MACs it was given (``of_input``: what the earlier steps left)."""
    out, done = [], 0.0
    for key in sorted(steps, key=lambda k: int(k.split(":", 1)[0])):
        share = steps[key].fraction or 0.0
        left = 1.0 - done
        out.append(
            {
                "name": key.split(":", 1)[1],
                "macs": round(share, 6),
                "of_input": round(share / left, 6) if left > 0 else 0.0,
            }
        )
        done += share
    return out


def compose(config: Any, reports: list[SparsityReport], names: list[str]) -> SparsityReport:
    """The sparsity of pruners applied in turn (a pipeline's steps, named ``names``), of the original model
    (its HF ``config``): each of ``reports`` is of the model the step was given (its layers, its MACs). What a
    step skips of a layer it keeps is a fraction of what the steps before left of that layer; a layer a static
    step skips whole (every MAC of both blocks, ``dynamic`` off) is gone from the model the next step is given.
    The result is per original layer, its sums over the tokens of the dynamic steps' reports (one token where all
    are static); ``steps`` holds each step's share of the original MACs and ``groups`` the last routed step's."""
    if len(reports) != len(names):
        raise ValueError(f"{len(reports)} reports for {len(names)} steps")
    full = SparsityReport.dense(config)
    n = len(full.layers)
    position: list[int | None] = list(range(n))  # an original layer's index in the current step's model, or None
    kept = [dict.fromkeys(BLOCKS, 1.0) for _ in range(n)]
    grand = sum(full.layers[i][b].total for i in range(n) for b in BLOCKS)
    shares = []
    for k, rep in enumerate(reports):
        alive = [i for i in range(n) if position[i] is not None]
        if len(rep.layers) != len(alive):
            raise ValueError(
                f"step {k} ({names[k]}) reports {len(rep.layers)} layers; the model it was given has {len(alive)}"
            )
        skipped, gone = 0.0, set()
        for i in alive:
            layer = rep.layers[position[i]]
            fractions = {b: layer[b].fraction or 0.0 for b in BLOCKS}
            for b in BLOCKS:
                skipped += full.layers[i][b].total * kept[i][b] * fractions[b]
                kept[i][b] *= 1.0 - fractions[b]
            if not rep.dynamic and all(f >= 1.0 for f in fractions.values()):
                gone.add(i)
        shares.append(skipped / grand)
        survivors = [i for i in alive if i not in gone]
        for i in alive:
            position[i] = survivors.index(i) if i in survivors else None
    tokens = max((r.tokens for r in reports), default=0)
    scale = max(tokens, 1)
    out = SparsityReport.empty(n, dynamic=any(r.dynamic for r in reports))
    out.tokens = tokens
    for i, layer in enumerate(out.layers):
        for b in BLOCKS:
            layer[b].total = full.layers[i][b].total * scale
            layer[b].skipped = layer[b].total * (1.0 - kept[i][b])
    for rep in reports:
        if rep.groups:
            out.groups = {kind: BlockCount(c.skipped, c.total) for kind, c in rep.groups.items()}
    out.steps = {
        f"{k}:{name}": BlockCount(share * grand * scale, grand * scale)
        for k, (name, share) in enumerate(zip(names, shares, strict=True))
    }
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
    # a pipeline's run: each step's name, share of the original MACs and of what it was given (``sparsity.steps``)
    steps: tuple[dict[str, Any], ...] | None = None

    @classmethod
    def from_results(cls, doc: dict[str, Any], source: str = "") -> SparsityProfile:
        """The realised sparsity a run's ``results.json`` records (``sparsity``); a ValueError where it
        has none."""
        rep = doc.get("sparsity")
        if not isinstance(rep, dict) or not isinstance(rep.get("macs"), (int, float)):
            raise ValueError("it records no realised sparsity (sparsity.macs)")
        layers = rep.get("per_layer") or None
        steps = tuple(dict(x) for x in rep["steps"]) if rep.get("steps") else None
        per_layer = None if layers is None else tuple(dict(x) for x in layers)
        return cls(float(rep["macs"]), per_layer, source=source, steps=steps)

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
