"""``eval``: a run, a saved model, an HF directory or an alias through the shared evaluator."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rich.console import Console

from compresskit.cli.common import EXIT_OK, MODEL_HELP, OPTION_HELP, _plain, _print_results, _progress, with_placement
from compresskit.errors import CompressKitError, RecipeError


def cmd_eval(args, out: Console, err: Console) -> int:
    from pydantic import ValidationError

    from compresskit.api import eval_model
    from compresskit.options import parse_option
    from compresskit.recipe import DataSection, EvaluationSection, format_validation_error

    fields: dict[str, Any] = {}
    if args.tasks:
        fields["tasks"] = args.tasks.split(",")
    for key in (
        "limit",
        "batch_size",
        "perplexity_docs",
        "max_length",
        "next_sentence_items",
        "num_fewshot",
        "task_paths",
        "engine",
        "logits_budget_mb",
    ):
        if getattr(args, key) is not None:
            fields[key] = getattr(args, key)
    try:
        evaluation = EvaluationSection(**fields)
    except ValidationError as exc:
        flags = {key: "--" + key.replace("_", "-").removesuffix("s" if key == "task_paths" else "") for key in fields}
        raise RecipeError(format_validation_error(exc, EvaluationSection, names=flags)) from None
    data = DataSection()
    if args.data:  # your own text, as a recipe's data.source.files takes it
        try:
            split = {} if args.test_fraction is None else {"test_fraction": args.test_fraction}
            data = DataSection(source={"files": args.data}, **split)
        except ValidationError as exc:
            names = {"source": "--data", "test_fraction": "--test-fraction"}
            raise RecipeError(format_validation_error(exc, DataSection, names=names)) from None
    elif args.test_fraction is not None:
        raise CompressKitError("--test-fraction: it splits your own text; give --data FILE... too")
    results = eval_model(
        args.model,
        options=None if args.option is None else parse_option(args.option),
        allow_download=args.allow_download,
        data_field="--data",
        evaluation=evaluation,
        data=data,
        dtype=args.dtype,
        device=args.device,
        output_dir=args.output,
        progress=_progress(err),
        field="MODEL (compresskit eval's argument)",
    )
    _print_results(out, results)
    if args.output:
        _plain(out, f"results: {Path(args.output) / 'results.json'}")
    return EXIT_OK


def add_eval_parser(sub) -> None:
    """The ``eval`` command's arguments."""
    from compresskit import tasks

    p = sub.add_parser("eval", help="evaluate a run, a saved model directory, an HF directory or an alias")
    p.add_argument("model", help=MODEL_HELP)
    p.add_argument(
        "--tasks", help=f"comma-separated: built in ({','.join(tasks.names())}) or lm-eval task and group names"
    )
    p.add_argument("--num-fewshot", type=int, dest="num_fewshot", help="few-shot examples for the lm-eval tasks")
    p.add_argument("--task-path", action="append", dest="task_paths", help="a folder of lm-eval task YAML files")
    p.add_argument(
        "--engine",
        choices=["auto", "transformers", "runtime"],
        help="what computes the logits: the runtime with the method's blocks, transformers' modules, or auto (the "
        "runtime on a GPU where it runs the architecture)",
    )
    p.add_argument("--limit", type=int, help="items per zero-shot task")
    p.add_argument(
        "--perplexity-docs",
        type=int,
        dest="perplexity_docs",
        help="held-out documents the perplexity task reads (default: all of them)",
    )
    p.add_argument(
        "--next-sentence-items", type=int, dest="next_sentence_items", help="items of the next_sentence task (500)"
    )
    p.add_argument("--batch-size", type=int, dest="batch_size", help="sequences a forward pass (16)")
    p.add_argument(
        "--max-length", type=int, dest="max_length", help="context in tokens; perplexity reads windows this long (1024)"
    )
    p.add_argument(
        "--logits-budget-mb",
        type=int,
        dest="logits_budget_mb",
        help="memory for one batch's log-probabilities; a batch that would need more is made smaller",
    )
    p.add_argument(
        "--data",
        nargs="+",
        metavar="FILE",
        help="your own text instead of the shipped Wikipedia excerpt: paths or globs of .txt, .jsonl, .json or "
        ".parquet files, as a recipe's data.source.files; the held-out share (--test-fraction) is what "
        "perplexity and next_sentence read",
    )
    p.add_argument(
        "--test-fraction",
        type=float,
        dest="test_fraction",
        help="with --data: the share of your documents held out for evaluation (default 0.25, as in a recipe)",
    )
    p.add_argument(
        "--allow-download",
        action="store_true",
        dest="allow_download",
        help="a hub model or an lm-eval task's data not in the local caches may be downloaded",
    )
    p.add_argument(
        "--option",
        metavar="KEY=VALUE,...",
        help=f"score a saved run under {OPTION_HELP}; the reference path decides as the runtime's blocks would",
    )
    with_placement(p)
    p.add_argument("--output", help="directory for results.json and results.md")
    p.set_defaults(fn=cmd_eval)
