"""The comparison plot (quality against realised sparsity, one point per run) and the bench plot
(speedup over dense against batch size)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

# Imported inside the functions that use them: matplotlib; so importing this module, and running the commands that do
# not need them (`--help` and `validate` first), stays fast.


def save(fig, path: Path, colours: int = 64) -> None:
    """Write ``fig`` as a PNG of at most ``colours`` colours, and close it: a chart's lines, markers and their
    anti-aliased edges need no more than 64 (a quarter or less of the bytes of a true-colour PNG); a heat map,
    whose colours carry its values, keeps 256."""
    import io

    import matplotlib.pyplot as plt
    from PIL import Image

    buf = io.BytesIO()
    fig.savefig(buf, dpi=120, format="png")
    plt.close(fig)
    buf.seek(0)
    with Image.open(buf) as image:
        image.convert("RGB").quantize(colours).save(path, format="PNG", optimize=True)


LABEL_POINTS = 6  # the font size of a point's label
_LABEL_WIDTH_PER_CHAR = 0.6  # of the font size: a label's character's width, about


def label_points(ax, points: list[tuple[float, float, str]]) -> list[float]:
    """Label each ``(x, y, text)`` point of ``ax`` beside it, a label that would cover one already placed moved down
    a line at a time (points of one spot, two runs of nearly equal results, get a label each). Returns each
    label's vertical offset in points, in the order of ``points``."""
    ax.autoscale_view()
    scale = ax.figure.dpi / 72.0  # pixels a point
    height = (LABEL_POINTS + 2) * scale
    placed: list[tuple[float, float, float]] = []  # (left, bottom, right) of each label, in pixels
    offsets = []
    for x, y, text in points:
        px, py = ax.transData.transform((x, y))
        left, right = px + 3 * scale, px + 3 * scale + len(text) * LABEL_POINTS * _LABEL_WIDTH_PER_CHAR * scale
        dy = 3.0
        while any(left < end and start < right and abs(py + dy * scale - b) < height for start, b, end in placed):
            dy -= LABEL_POINTS + 2
        placed.append((left, py + dy * scale, right))
        offsets.append(dy)
        ax.annotate(text, (x, y), fontsize=LABEL_POINTS, xytext=(3, dy), textcoords="offset points")
    return offsets


def quality_vs_sparsity(runs: list[dict[str, Any]], path: Path) -> Path:
    """Write a PNG with two panels: zero-shot average accuracy and held-out perplexity against
    the realised fraction of projection MACs skipped; points of one pruner share a colour, and a
    point that averages seeds carries its standard deviation as an error bar. A run
    whose sparsity was not measured has no place on the x axis and is left out."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_acc, ax_ppl) = plt.subplots(1, 2, figsize=(11, 4.2))
    methods = sorted({r.get("pruner") or "dense" for r in runs})
    colours = {m: plt.get_cmap("tab10")(i % 10) for i, m in enumerate(methods)}
    labels: dict[Any, list[tuple[float, float, str]]] = {ax_acc: [], ax_ppl: []}
    for method in methods:
        pts = sorted(
            (
                r["sparsity"]["macs"],
                r.get("zero_shot_average"),
                r["metrics"].get("perplexity", {}).get("token_perplexity"),
                r["name"],
                r.get("zero_shot_spread") or 0.0,  # over seeds (compare --seeds), else none
                (r.get("spread") or {}).get("perplexity", {}).get("token_perplexity") or 0.0,
            )
            for r in runs
            if (r.get("pruner") or "dense") == method and r.get("sparsity") is not None
        )
        for ax, idx in ((ax_acc, 1), (ax_ppl, 2)):
            shown = [p for p in pts if p[idx] is not None]
            if not shown:
                continue
            ax.errorbar(
                [p[0] for p in shown],
                [p[idx] for p in shown],
                yerr=[p[idx + 3] for p in shown],
                fmt="o",
                capsize=3,
                color=colours[method],
                label=method,
                zorder=3,
            )
            labels[ax] += [(p[0], p[idx], p[3]) for p in shown]  # each point is its own run: labelled, not joined
    ax_acc.set_xlabel("realised sparsity (fraction of projection MACs skipped)")
    ax_acc.set_ylabel("zero-shot average accuracy")
    ax_ppl.set_xlabel("realised sparsity (fraction of projection MACs skipped)")
    ax_ppl.set_ylabel("held-out perplexity (log scale)")
    ax_ppl.set_yscale("log")
    for ax, points in labels.items():  # (on the final scales: a label's place is measured on the axes)
        if points:
            label_points(ax, points)
    for ax in (ax_acc, ax_ppl):
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
        else:
            ax.text(0.5, 0.5, "not measured in these runs", ha="center", va="center", transform=ax.transAxes)
    fig.tight_layout()
    path = Path(path)
    save(fig, path)
    return path


def speedup_vs_batch(records: list[dict[str, Any]], path: Path) -> Path:
    """Write a PNG with two panels, TTFT and TPOT speedup over the dense model on the runtime against
    the batch size (log 2), one line per model row and prompt length (``compresskit bench``'s
    records); 1.0 is dense."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_ttft, ax_tpot) = plt.subplots(1, 2, figsize=(11, 4.2))
    series = sorted({(r["model"], r["prompt"]) for r in records if r["model"] != "dense"})
    for model, prompt in series:
        pts = sorted(
            (r["batch"], r["ttft_speedup"], r["tpot_speedup"])
            for r in records
            if (r["model"], r["prompt"]) == (model, prompt)
        )
        for ax, idx in ((ax_ttft, 1), (ax_tpot, 2)):
            ax.plot([p[0] for p in pts], [p[idx] for p in pts], "o-", label=f"{model}, prompt {prompt}")
    for ax, what in ((ax_ttft, "TTFT"), (ax_tpot, "TPOT")):
        ax.axhline(1.0, color="grey", lw=1, ls="--")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("batch size")
        ax.set_ylabel(f"{what} speedup over dense (same runtime)")
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    fig.tight_layout()
    path = Path(path)
    save(fig, path)
    return path


def quality_vs_speed(runs: list[dict[str, Any]], speed, path: Path, measure: str = "tpot") -> Path:
    """Write a PNG of each method's quality against its measured speedup over dense (``speed``: a
    ``compresskit.comparison.Speed``): a row of two panels (held-out perplexity, log scale; zero-shot
    average) per benched batch size, one line per method through its budgets from the dense model at
    1.00x, each point labelled with its realised MACs skipped; the Pareto front of each panel dashed, its
    points ringed. The title says where the speed and the quality were measured."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from compresskit.comparison import QUALITY, pareto_front, speed_points

    batches = speed.batches
    fig, axes = plt.subplots(len(batches), 2, figsize=(11, 4.0 * len(batches)), squeeze=False)
    methods = sorted({r["pruner"] for r in runs if r.get("pruner")})
    colours = {m: plt.get_cmap("tab10")(i % 10) for i, m in enumerate(methods)}
    for row, batch in zip(axes, batches, strict=True):
        points = speed_points(runs, speed, batch, measure)
        for ax, (metric, (read, better, log)) in zip(row, QUALITY.items(), strict=True):
            everything = {}
            for method, pts in points.items():
                shown = [(s, read(r), b) for b, s, r in pts if read(r) is not None]
                ax.plot([p[0] for p in shown], [p[1] for p in shown], "o-", color=colours[method], label=method)
                for s, q, b in shown[1:]:
                    ax.annotate(f"{b:.2f}", (s, q), fontsize=6, xytext=(3, 3), textcoords="offset points")
                everything.update({r["name"]: (s, read(r)) for _, s, r in pts if read(r) is not None})
            front = pareto_front([(s, q, n) for n, (s, q) in everything.items()], better=better)
            hull = sorted(everything[n] for n in front)
            if hull:
                ax.plot([p[0] for p in hull], [p[1] for p in hull], "k--", lw=1, label="Pareto front", zorder=1)
                ax.scatter(
                    [p[0] for p in hull], [p[1] for p in hull], s=110, facecolors="none", edgecolors="k", zorder=4
                )
            ax.axvline(1.0, color="grey", lw=1, ls=":")
            ax.set_xlabel(f"{measure.upper()} speedup over dense, batch {batch}")
            ax.set_ylabel(metric + (" (log scale)" if log else ""))
            if log:
                ax.set_yscale("log")
            ax.grid(alpha=0.3)
            if ax.get_legend_handles_labels()[0]:
                ax.legend(fontsize=8)
    models = sorted({str((r.get("model") or {}).get("name_or_path")) for r in runs if r.get("pruner")})
    fig.suptitle(
        f"quality of {', '.join(models)} against speed measured at {', '.join(speed.shapes)} shapes "
        f"(prompt {speed.prompt}); labels: MACs skipped",
        fontsize=10,
    )
    fig.tight_layout()
    path = Path(path)
    save(fig, path)
    return path


def speedup_range(values: list[float]) -> tuple[float, float]:
    """The colour range of a speedup heat map: even in ratio about 1.00x, out to the largest ratio either
    side (at least 1.01x), so that 0.5x is as deep a red as 2.0x is a green."""
    reach = max(max(values), 1 / min(values), 1.01)
    return 1 / reach, reach


def speedup_heatmap(records: list[dict[str, Any]], path: Path, measure: str = "tpot") -> Path:
    """Write a PNG with one heat map per model row of ``compresskit bench``'s records (the dense one
    aside): its ``measure`` ("tpot" or "ttft") speedup over dense for every batch size (rows) and prompt
    length (columns), each cell annotated, coloured red below 1.00x and green above, on a scale even in
    ratio (0.5x as deep a red as 2.0x is a green), so that a cell just under 1.00x is not drawn as deep as a
    loss by half; a cell that was not measured (skipped: it did not fit) is marked "-"."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.colors import TwoSlopeNorm

    models = list(dict.fromkeys(r["model"] for r in records if r["model"] != "dense"))
    batches = sorted({r["batch"] for r in records})
    prompts = sorted({r["prompt"] for r in records})
    values = [r[f"{measure}_speedup"] for r in records if r["model"] != "dense"] or [1.0]
    low, high = speedup_range(values)
    norm = TwoSlopeNorm(vcenter=1.0, vmin=low, vmax=high)
    fig, axes = plt.subplots(
        1,
        max(1, len(models)),
        figsize=(1.2 + 1.1 * len(prompts) * max(1, len(models)), 1.4 + 0.55 * len(batches)),
        squeeze=False,
    )
    for ax, model in zip(axes[0], models, strict=False):
        cells = {(r["batch"], r["prompt"]): r[f"{measure}_speedup"] for r in records if r["model"] == model}
        grid = [[cells.get((b, p), float("nan")) for p in prompts] for b in batches]
        ax.imshow(grid, cmap="RdYlGn", norm=norm, aspect="auto")
        for i, b in enumerate(batches):
            for j, p in enumerate(prompts):
                text = f"{cells[(b, p)]:.2f}x" if (b, p) in cells else "-"
                ax.text(j, i, text, ha="center", va="center", fontsize=8, color="black" if (b, p) in cells else "grey")
        ax.set_xticks(range(len(prompts)), [str(p) for p in prompts])
        ax.set_yticks(range(len(batches)), [str(b) for b in batches])
        ax.set_xlabel("prompt (tokens)")
        ax.set_ylabel("batch")
        ax.set_title(model, fontsize=8)
    fig.suptitle(f"{measure.upper()} speedup over dense, batch x prompt", fontsize=9)
    fig.tight_layout()
    path = Path(path)
    save(fig, path, colours=256)
    return path
