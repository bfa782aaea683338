"""``compare``: one table from several recipes (run or reused) and results files."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rich.console import Console

from compresskit import locking
from compresskit.cli.common import EXIT_OK, _float_list, _parse_seeds, _plain, _progress, with_set
from compresskit.errors import CompressKitError


def _load_run(ref: str, overrides: list[str], progress, err: Console) -> dict[str, Any]:
    """A results document from a recipe (run, or reused when its results are current), a
    results.json file, a run directory or its model/ directory."""
    from compresskit import files
    from compresskit.api import apply
    from compresskit.recipe import load_recipe

    path = Path(ref)
    if path.suffix in (".yaml", ".yml"):
        result = apply(load_recipe(path, overrides), progress=progress)
        if result.reused:
            progress.log(f"{ref}: reusing {result.output_dir / 'results.json'}")
        return result.results
    if path.is_dir():  # a run folder, or its model/ (what generate and eval take too)
        inside = path / "results.json"
        path = inside if inside.is_file() or path.name != "model" else path.parent / "results.json"
    data = files.read_json(path, what="results file")
    if not isinstance(data, dict) or "metrics" not in data or "sparsity" not in data:
        raise CompressKitError(f"{path}: not a compresskit results.json (no metrics/sparsity)")
    return data


def _name_apart(runs: list[dict[str, Any]], inputs: list[str]) -> None:
    """Rows that would share a name (two runs of one recipe: on the shipped text and on one's own) get their
    input's folder beside it, ``my-recipe (runs/mine)``."""
    names = [r["name"] for r in runs]
    for i, (run, ref) in enumerate(zip(runs, inputs, strict=True)):
        if names.count(run["name"]) > 1:
            where = Path(ref).parent if Path(ref).suffix in (".json", ".yaml", ".yml") else Path(ref)
            runs[i] = {**run, "name": f"{run['name']} ({where})"}


def _seed_overrides(ref: str, overrides: list[str], seed: int) -> list[str]:
    """The overrides that run recipe ``ref`` with ``seed``, into ``<its output.dir>-seed<seed>``."""
    from compresskit.recipe import load_recipe

    out_dir = load_recipe(ref, overrides).recipe.output.dir.rstrip("/")
    return [*overrides, f"seed={seed}", f"output.dir={out_dir}-seed{seed}"]


def cmd_compare(args, out: Console, err: Console) -> int:
    from compresskit import files
    from compresskit.comparison import SPEED_TARGETS, aggregate_seeds, group_runs
    from compresskit.recipe import is_comparison, load_comparison, load_recipe
    from compresskit.report import compare_csv, compare_markdown, compare_tables, equal_speed_markdown

    # The flags first, then expand comparison specs and validate every recipe before running any of them.
    targets = _float_list(args.at, "--at") if args.at else SPEED_TARGETS
    if args.at and not args.speed:
        raise CompressKitError("--at: reads quality at equal speed, so it needs --speed BENCH.json")
    speed = _read_speed(args.speed) if args.speed else None
    seeds = _parse_seeds(args.seeds)
    inputs: list[str] = []
    for ref in args.inputs:
        if is_comparison(ref):
            members, spec_out, spec_seeds = load_comparison(ref)
            inputs += [str(m) for m in members]
            args.output = args.output or str(spec_out)
            seeds = seeds or spec_seeds
        else:
            inputs.append(ref)
    overrides = list(args.set or [])
    for ref in inputs:
        if Path(ref).suffix in (".yaml", ".yml"):
            load_recipe(ref, overrides)
        elif not Path(ref).exists():
            raise CompressKitError(
                f"compare: {ref!r} is neither a recipe (.yaml) nor an existing results file or run directory"
            )
        elif seeds:
            raise CompressKitError(f"compare --seeds: {ref!r} is a finished run; seeds apply to recipes only")
    progress = _progress(err)
    runs = []
    for ref in inputs:
        if seeds and Path(ref).suffix in (".yaml", ".yml"):
            per_seed = [_load_run(ref, _seed_overrides(ref, overrides, s), progress, err) for s in seeds]
            runs.append(aggregate_seeds(per_seed))
        else:
            runs.append(_load_run(ref, overrides, progress, err))
    _name_apart(runs, inputs)
    groups = group_runs(runs)
    if speed is not None:
        _check_speed_runs(speed, runs)
    if len(groups) > 1:
        _plain(
            err,
            f"warning: these runs were evaluated under {len(groups)} different settings; each group is shown "
            "apart, with its own dense reference: compare numbers only within a group",
        )
    sections = {g.label: equal_speed_markdown(g.runs, speed, targets) for g in groups} if speed else {}
    markdown = "\n".join(
        [compare_markdown(groups)] + [(f"### {label}\n\n" if label else "") + text for label, text in sections.items()]
    )
    if out.is_terminal:
        for table in compare_tables(groups):
            out.print(table)
        for text in sections.values():
            _plain(out, text)
    else:
        _plain(out, markdown)
    if args.output:
        target = Path(args.output)
        args.held.enter_context(locking.hold(target, field="compare's output folder", progress=progress))
        with files.staged_files(target) as tmp:  # the folder may hold the inputs: keep them
            files.write_text(tmp / "compare.md", markdown)
            files.write_text(tmp / "compare.csv", compare_csv(groups))
            files.write_json(
                tmp / "compare.json",
                [
                    {
                        "group": g.label or "1",
                        "settings": g.settings,
                        "runs": g.runs,
                        **({"speed": {"bench": speed.meta, "targets": list(targets)}} if speed else {}),
                    }
                    for g in groups
                ],
            )
            from compresskit.plot import quality_vs_sparsity, quality_vs_speed

            quality_vs_sparsity([r for g in groups for r in g.runs], tmp / "compare.png")
            written = ["compare.csv", "compare.json", "compare.png"]
            if speed:
                for i, g in enumerate(groups):
                    name = "quality_vs_speed.png" if len(groups) == 1 else f"quality_vs_speed-{i + 1}.png"
                    quality_vs_speed(g.runs, speed, tmp / name)
                    written.append(name)
        _plain(out, f"written: {target / 'compare.md'}, " + ", ".join(written))
    return EXIT_OK


def _read_speed(paths: list[str]):
    """``--speed``: the bench files' records (``compresskit.comparison.Speed``)."""
    from compresskit import files
    from compresskit.comparison import read_speed

    docs = []
    for ref in paths:
        path = Path(ref)
        if path.is_dir():
            path = path / "bench.json"
        docs.append((path, files.read_json(path, what="bench file (--speed)")))
    try:
        speed = read_speed(docs)
    except ValueError as exc:
        raise CompressKitError(f"--speed: {exc}") from None
    return speed


def _check_speed_runs(speed, runs: list[dict]) -> None:
    """The bench files must time some of ``runs`` (``compresskit bench --shape NAME --run RUN``)."""
    names = {r["name"] for r in runs if r.get("pruner")}
    timed = {name for name, _ in speed.records} - {"dense"}
    if not names & timed:
        raise CompressKitError(
            f"--speed: the bench files time none of these runs (they time {', '.join(sorted(timed)) or 'no run'}; "
            f"the runs are {', '.join(sorted(names))}): bench them with compresskit bench --shape NAME --run RUN"
        )


def add_compare_parser(sub) -> None:
    """The ``compare`` command's arguments."""
    p = sub.add_parser("compare", help="one table from several recipes (run or reused) and/or results files")
    p.add_argument(
        "inputs",
        nargs="+",
        help="recipes (run, or reused where their output.dir holds the run), a comparison spec, run folders or "
        "results.json files",
    )
    with_set(p)
    p.add_argument(
        "--seeds",
        metavar="S1,S2,...",
        help="run every recipe once per seed (into <output.dir>-seed<S>) and show mean ± standard deviation",
    )
    p.add_argument("--output", help="directory for compare.md, compare.csv and compare.json")
    p.add_argument(
        "--speed",
        action="append",
        default=[],
        metavar="BENCH",
        help="a bench.json of the runs' structures (compresskit bench --shape NAME --run RUN...): adds quality at "
        "equal speed, a table and a plot (repeatable)",
    )
    p.add_argument("--at", help="with --speed: comma-separated speedups to read each method's quality at (1.2,1.4,1.6)")
    p.set_defaults(fn=cmd_compare)
