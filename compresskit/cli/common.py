"""What every command shares: the parser that exits with one line, the consoles, the shared flags and the
parsers of list-valued flags."""

from __future__ import annotations

import argparse
import json
import os
import re
from typing import Any

from rich.console import Console

from compresskit.errors import CompressKitError

EXIT_OK, EXIT_INTERNAL, EXIT_BAD_INPUT = 0, 1, 2


class _Parser(argparse.ArgumentParser):
    """argparse that exits with our bad-input code and one line."""

    def error(self, message: str):
        raise CompressKitError(f"{self.prog}: {message}{_settings_hint(message)}")


OPTION_HELP = (
    "one setting of the method's own inference options, KEY=VALUE[,KEY=VALUE...]: dotted keys into its runtime "
    "executor's config (`compresskit schema EXECUTOR` lists them), values in YAML"
)


def _settings_hint(message: str) -> str:
    """Where argparse found a flag it does not know given ``KEY=VALUE`` pairs (a method's setting under a flag of
    its own), the ``--option`` that gives them."""
    match = re.match(r"unrecognized arguments: .*?--([\w-]+)[ =]((?:[\w.-]+=[^,\s]+,?)+)", message)
    if not match:
        return ""
    name, pairs = match.groups()
    keys = ",".join(f"{name}.{pair}" for pair in pairs.strip(",").split(","))
    return f"; a method's own settings go through --option KEY=VALUE,... (bench, eval): --option {keys}"


def _consoles() -> tuple[Console, Console]:
    out = Console(soft_wrap=True)
    err = Console(stderr=True, soft_wrap=True)
    return out, err


def _progress(err: Console):
    from compresskit.progress import PlainProgress
    from compresskit.report import RichProgress

    return RichProgress(err) if err.is_terminal else PlainProgress()


def _quiet_libraries() -> None:
    """Our progress bars and tables replace the libraries' tqdm bars and INFO logs, through the
    settings those libraries document (each can be overridden from the environment): tqdm's
    ``TQDM_DISABLE`` (every tqdm bar of lm-eval, datasets, transformers), transformers' verbosity,
    the hub's progress bars, and the standard loggers of the others. Nothing is imported here."""
    import logging

    for key, value in (
        ("TOKENIZERS_PARALLELISM", "false"),
        ("TQDM_DISABLE", "1"),
        ("TRANSFORMERS_VERBOSITY", "error"),
        ("HF_HUB_DISABLE_PROGRESS_BARS", "1"),
    ):
        os.environ.setdefault(key, value)
    for name in ("lm_eval", "lm-eval", "datasets", "huggingface_hub", "stevedore", "gensim", "smart_open"):
        logging.getLogger(name).setLevel(logging.ERROR)


def _plain(out: Console, text: str) -> None:
    """Stable text for pipes and logs, written as is (no wrapping, no markup)."""
    out.file.write(text if text.endswith("\n") else text + "\n")
    out.file.flush()


def _print_table(out: Console, table) -> None:
    """A rich ``Table`` in a terminal; elsewhere (a pipe, a file, a log) the same table as Markdown, whole
    (a rich table in a pipe is cut to 80 columns)."""
    if out.is_terminal:
        out.print(table)
        return
    from rich.text import Text

    def plain(cell) -> str:
        text = cell.plain if isinstance(cell, Text) else Text.from_markup(str(cell)).plain
        return text.replace("|", "\\|")

    columns = [[plain(c) for c in col.cells] for col in table.columns]
    lines = [f"{table.title}", ""] if table.title else []
    lines.append("| " + " | ".join(plain(c.header) for c in table.columns) + " |")
    lines.append("|" + "---|" * len(table.columns))
    lines += ["| " + " | ".join(row) + " |" for row in zip(*columns, strict=True)]
    _plain(out, "\n".join(lines))


def _print_results(out: Console, results: dict[str, Any]) -> None:
    from compresskit.report import quality_alarm, results_markdown, results_table

    if out.is_terminal:
        out.print(results_table(results))
        alarm = quality_alarm(results)
        if alarm:  # (the Markdown below holds it too)
            out.print(alarm, style="bold red", markup=False, highlight=False)
    else:
        _plain(out, results_markdown(results))


MODEL_HELP = "a run folder (what apply prints), its model/ directory, an HF model directory or an alias"


def _load_for_runtime(ref: str, args, err: Console, field: str):
    """(model, tokenizer, pruner or None, base model name) of a saved run, an HF directory or an alias."""
    from compresskit.runtime import load_for_runtime

    return load_for_runtime(ref, device=args.device, dtype=args.dtype, field=field, progress=_progress(err))


def _default(*keys: str) -> Any:
    """A product default that names a plugin (``compresskit/resources/defaults.json``)."""
    from importlib.resources import files as resource_files

    node = json.loads(resource_files("compresskit").joinpath("resources/defaults.json").read_text())
    for key in keys:
        node = node[key]
    return node


def _version(name: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(name)
    except PackageNotFoundError:
        return None


def _float_list(
    text: str,
    flag: str,
    *,
    what: str = "numbers",
    ok=lambda v: v > 0,
    rule: str = ": give positive speedups",
    example: str = "1.2,1.4",
    distinct: bool = False,
) -> tuple[float, ...]:
    """A comma-separated list of numbers each ``ok`` (``rule`` says which; ``distinct``: none twice), or one
    line naming ``flag``."""
    try:
        values = tuple(float(v) for v in str(text).split(",") if v.strip())
    except ValueError:
        raise CompressKitError(f"{flag}: {text!r} is not a comma-separated list of {what}, e.g. {example}") from None
    if not values or not all(ok(v) for v in values):
        raise CompressKitError(f"{flag}: {text!r}{rule}, e.g. {example}")
    if distinct and len(set(values)) < len(values):
        raise CompressKitError(f"{flag}: {text!r} names a {what.removesuffix('s')} twice")
    return values


def _int_list(text: str, flag: str, minimum: int | None = 1) -> list[int]:
    """A comma-separated list of integers (each at least ``minimum``), or one line naming ``flag``."""
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise CompressKitError(f"{flag}: {text!r} is not a comma-separated list of integers, e.g. 1,2") from None
    if not values:
        raise CompressKitError(f"{flag}: {text!r}: give at least one integer, e.g. 1,2")
    if minimum is not None and min(values) < minimum:
        raise CompressKitError(f"{flag}: {text!r}: give integers of {minimum} or more, e.g. 1,2")
    return values


def _parse_seeds(text: str | None) -> list[int] | None:
    if text is None:
        return None
    seeds = _int_list(text, "--seeds", minimum=None)
    if len(set(seeds)) != len(seeds):
        raise CompressKitError(f"--seeds: {text!r}: give distinct integers, e.g. 0,1,2")
    return seeds


def with_placement(p) -> None:
    """--dtype and --device: where a model loads."""
    p.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "float32", "bfloat16", "float16"],
        help="weights' dtype (auto: bfloat16 on a GPU, float32 on the CPU)",
    )
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"], help="auto: a GPU where there is one")


def with_set(p) -> None:
    """--set KEY=VALUE: a recipe value overridden."""
    p.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a recipe value (repeatable)")
