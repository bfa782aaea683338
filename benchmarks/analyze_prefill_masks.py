"""What a routed prefill reduction (down_proj, o_proj) could save: the bound of each design, from the
routers' real prefill masks. No GPU needed.

    python benchmarks/analyze_prefill_masks.py runs/wide-smollm2-50-quick/model --out DIR   # a saved WIDE run
    python benchmarks/analyze_prefill_masks.py --shape smollm2-135m --out DIR              # untrained, calibrated
    python benchmarks/analyze_prefill_masks.py --smoke                                     # tiny, the path runs

A reduction-width product ``y = x @ W.T`` where ``x``'s K axis is split in groups and each (token,
group) pair is active or not can skip work in two ways:

* **tile union**: a tile of ``BLOCK_M`` tokens steps through the groups active for *any* of its tokens
  (inactive pairs read as zeros), accumulating in registers. Its multiply-adds are the union fraction
  ``U`` of (tile, group) pairs, so its bound is ``1 / U`` of the dense product. Reordering the tokens
  so that a tile's tokens share their groups lowers ``U``; the output is scattered back.
* **exact pairs**: one product per group over its active tokens only (``p`` of the work), whose fp32
  partial outputs are summed across groups in memory: ``p * T * G * N * 4`` bytes of partials, which
  is compared here with the dense product's own time.

For each router kind (attention: o's head groups; MLP: down's channel groups) this prints the density
``p``, the tile union in token order, after sorting the tokens by their masks (groups by frequency,
most frequent first), and what independent tokens with the same per-group rates would give
(``1 - (1 - p_g) ** BLOCK_M``). Results: a table and ``prefill_masks.json`` / ``.md``.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).resolve().parents[i] / p) for i, p in ((0, ""), (1, "plugins/wide"), (1, ""))]
import benchmark_report as report  # noqa: E402  (beside this script)

TILES = (16, 32, 64, 128)


def capture_masks(model, ids: torch.Tensor) -> dict[str, list[torch.Tensor]]:
    """Run ``model`` on ``ids: [1, T]`` and return each routed projection's execute mask ``[T, G]``
    (bool), by kind ("attention" / "mlp"), in layer order."""
    from compresskit.routing import decide, routed_projections

    masks: dict[str, list[torch.Tensor]] = {"attention": [], "mlp": []}
    handles = []
    for _, proj in routed_projections(model):
        if proj.router is None:
            continue
        kind = "mlp" if proj.kind in ("mlp", "ffn") else "attention"

        def hook(_module, _inputs, logits, kind=kind):
            masks[kind].append(decide(logits.detach(), sample=False, tau=1.0)[0].bool().cpu())

        handles.append(proj.router.register_forward_hook(hook))
    try:
        with torch.no_grad():
            model(ids)
    finally:
        for h in handles:
            h.remove()
    return masks


def union_fraction(mask: torch.Tensor, tile: int) -> float:
    """Mean over tiles of ``tile`` consecutive tokens and groups: whether any token is active."""
    t, g = mask.shape
    pad = (-t) % tile
    m = torch.cat([mask, torch.zeros(pad, g, dtype=torch.bool)]) if pad else mask
    tiles = m.view(-1, tile, g).any(dim=1)  # [tiles, G]
    return tiles.float().mean().item()


def sorted_by_mask(mask: torch.Tensor) -> torch.Tensor:
    """The tokens reordered so that equal masks are adjacent: lexicographic on the groups taken from
    the most to the least often active."""
    order = torch.argsort(mask.float().mean(dim=0), descending=True, stable=True)
    keys = mask[:, order]
    perm = torch.arange(mask.shape[0])
    for col in reversed(range(keys.shape[1])):  # least significant first; stable sorts keep the rest
        perm = perm[torch.argsort(~keys[perm, col], stable=True)]
    return mask[perm]


def independent_union(mask: torch.Tensor, tile: int) -> float:
    p = mask.float().mean(dim=0)
    return (1 - (1 - p) ** tile).mean().item()


def summarize(masks: list[torch.Tensor]) -> dict:
    row = {"layers": len(masks), "groups": masks[0].shape[1], "tokens": masks[0].shape[0]}
    row["density"] = round(sum(m.float().mean().item() for m in masks) / len(masks), 4)
    for tile in TILES:
        row[f"union_{tile}"] = round(sum(union_fraction(m, tile) for m in masks) / len(masks), 4)
        row[f"union_sorted_{tile}"] = round(sum(union_fraction(sorted_by_mask(m), tile) for m in masks) / len(masks), 4)
        row[f"union_independent_{tile}"] = round(sum(independent_union(m, tile) for m in masks) / len(masks), 4)
    return row


def partial_traffic(row: dict, out_features: int, in_features: int, tflops: float, tbps: float) -> dict:
    """The exact-pairs design's fp32 partials against the dense product's time (ideal rates)."""
    t, g = row["tokens"], row["groups"]
    partial_bytes = row["density"] * t * g * out_features * 4 * 2  # written, then read to be summed
    dense_s = 2 * t * in_features * out_features / (tflops * 1e12)
    return {
        "partials_gb": round(partial_bytes / 1e9, 3),
        "partials_vs_dense_time": round(partial_bytes / (tbps * 1e12) / dense_s, 2),
    }


def load(args):
    if args.smoke or args.shape:
        from compresskit import plugins
        from compresskit.bench import shape_model
        from compresskit.interfaces import RunContext
        from compresskit.routing import calibrate_routers

        model = shape_model("tiny" if args.smoke else args.shape, device="cpu", dtype=torch.float32)
        cls = plugins.load("pruner", "wide")
        pruner = cls(cls.Config(target_sparsity=args.sparsity))
        pruner.prepare(model, RunContext(model_config=model.config, device=torch.device("cpu"), dtype=torch.float32))
        model = pruner.finalize(model).eval()
        calibrate_routers(model, args.sparsity)
        return model, None, f"--shape {'tiny' if args.smoke else args.shape} (random weights, routers calibrated)"
    from compresskit.runtime import load_for_runtime

    model, tokenizer, _, base = load_for_runtime(args.run, device="cpu", dtype="float32")
    return model.eval(), tokenizer, f"{args.run} (trained routers, base {base})"


def prompt_ids(tokenizer, vocab: int, tokens: int) -> torch.Tensor:
    if tokenizer is None:
        return torch.randint(3, vocab, (1, tokens), generator=torch.Generator().manual_seed(0))
    from compresskit.data import load_wiki_articles

    ids: list[int] = []
    for article in reversed(load_wiki_articles()):  # the last articles: what calibration reads least
        ids += tokenizer(article.text)["input_ids"]
        if len(ids) >= tokens:
            break
    return torch.tensor([ids[:tokens]])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("run", nargs="?", help="a saved WIDE run's model directory")
    parser.add_argument("--shape", help="a known shape with random weights instead (e.g. smollm2-135m)")
    parser.add_argument("--sparsity", type=float, default=0.5, help="with --shape: the routers' calibrated skip rate")
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    args = parser.parse_args()
    if not (args.run or args.shape or args.smoke):
        parser.error("give a saved WIDE run, --shape or --smoke")
    if args.smoke:
        args.tokens = 64
    model, tokenizer, source = load(args)
    cfg = model.config
    masks = capture_masks(model, prompt_ids(tokenizer, cfg.vocab_size, args.tokens))
    if not any(masks.values()):
        print(f"{source}: no routers (not a WIDE model)")
        return 2
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    widths = {  # (out_features, in_features) of the reduction each router gates
        "attention": (cfg.hidden_size, cfg.num_attention_heads * head_dim),
        "mlp": (cfg.hidden_size, cfg.intermediate_size),
    }
    rows = {}
    for kind, found in masks.items():
        if found:
            rows[kind] = summarize(found)
            rows[kind].update(partial_traffic(rows[kind], *widths[kind], tflops=790, tbps=4.8))
    header = ["router", "groups", "density p"] + [f"U{t} order / sorted / indep." for t in TILES]
    lines = ["| " + " | ".join(header) + " | exact pairs: partials / dense time |", "|---" * (len(header) + 1) + "|"]
    for kind, r in rows.items():
        cells = [kind, str(r["groups"]), f"{r['density']:.3f}"]
        cells += [
            f"{r[f'union_{t}']:.3f} / {r[f'union_sorted_{t}']:.3f} / {r[f'union_independent_{t}']:.3f}" for t in TILES
        ]
        lines.append("| " + " | ".join(cells) + f" | {r['partials_vs_dense_time']:.2f}x |")
    facts = report.run_facts(
        False,
        source=source,
        tokens=args.tokens,
        rates="exact pairs' partials at 4.8 TB/s against the dense product at 790 TFLOP/s (H200 peaks)",
    )
    print(
        report.write(
            args.out, "prefill_masks", "Prefill masks: what a routed reduction could skip", facts, lines, {"rows": rows}
        )
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
