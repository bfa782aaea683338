"""``compresskit``: apply | eval | compare | generate | bench | plugins | validate | schema.

Exit codes: 0 ok, 2 bad input (one line naming the field, what was given and what is allowed),
1 internal error (add ``--debug`` for the traceback), 130 interrupted (SIGINT), 143 stopped by
SIGTERM; an interrupted ``apply`` resumes when run again.

Each command imports what it needs inside its function: ``--help``, ``--version`` and ``validate`` answer
without loading torch, transformers or lm-eval (``tests/core/test_cli.py`` checks that torch stays out).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import traceback

from compresskit import distributed
from compresskit.cli.bench import add_bench_parser
from compresskit.cli.common import (
    EXIT_BAD_INPUT,
    EXIT_INTERNAL,
    EXIT_OK,
    _consoles,
    _int_list,
    _Parser,
    _quiet_libraries,
)
from compresskit.cli.compare import _name_apart, add_compare_parser
from compresskit.cli.evaluate import add_eval_parser
from compresskit.cli.generate import add_generate_parser
from compresskit.cli.recipes import add_apply_parser, add_plugins_parser, add_schema_parser, add_validate_parser
from compresskit.errors import CompressKitError
from compresskit.interrupts import Interrupted, handle_signals

__all__ = ["EXIT_BAD_INPUT", "EXIT_INTERNAL", "EXIT_OK", "_int_list", "_name_apart", "build_parser", "main"]


def build_parser() -> argparse.ArgumentParser:
    """The whole command line: each command's arguments from its module."""
    parser = _Parser(
        prog="compresskit",
        description="Compress an LLM with pluggable pruners; evaluate every method with one evaluator.",
        epilog="Exit codes: 0 ok, 2 bad input (one line naming what was wrong), 1 internal error "
        "(--debug shows the traceback), 130 interrupted (Ctrl-C), 143 stopped by SIGTERM; "
        "an interrupted apply resumes when run again.",
    )
    parser.add_argument("--debug", action="store_true", help="show tracebacks")
    parser.add_argument("--version", action="store_true", help="print the version and exit")
    sub = parser.add_subparsers(dest="command", parser_class=_Parser)

    for add in (
        add_apply_parser,
        add_validate_parser,
        add_schema_parser,
        add_plugins_parser,
        add_generate_parser,
        add_bench_parser,
        add_eval_parser,
        add_compare_parser,
    ):
        add(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    out, err = _consoles()
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv
    _quiet_libraries()
    try:
        args = build_parser().parse_args(argv)
        args.argv = argv  # the command as given (recorded by bench)
        if args.version:
            from compresskit import __version__

            out.print(f"compresskit {__version__}")
            return EXIT_OK
        if not getattr(args, "fn", None):
            build_parser().print_help()
            return EXIT_BAD_INPUT
        with handle_signals(), contextlib.ExitStack() as held:
            args.held = held  # what a command holds until it returns (the lock of the folder it writes)
            return args.fn(args, out, err)
    except CompressKitError as exc:
        if debug:
            traceback.print_exc()
        for problem in getattr(exc, "problems", None) or [str(exc)]:
            msg = " ".join(problem.split())  # one line each
            err.print(f"{_rank_prefix()}error: {msg}", markup=False, highlight=False)
        return EXIT_BAD_INPUT
    except KeyboardInterrupt as exc:  # Ctrl-C, or SIGTERM / SIGINT through handle_signals
        why = f" ({exc})" if isinstance(exc, Interrupted) else ""
        err.print(f"interrupted{why}; run the same command again to resume", markup=False)
        return getattr(exc, "exit_code", 130)
    except Exception as exc:  # noqa: BLE001 - the CLI's last line of defence
        if debug:
            traceback.print_exc()
        err.print(
            f"{_rank_prefix()}internal error: {type(exc).__name__}: {exc} (rerun with --debug for the traceback)",
            markup=False,
            highlight=False,
        )
        return EXIT_INTERNAL


def _rank_prefix() -> str:
    """``rank R of N: `` in a process launched on several ranks, else nothing."""
    if not distributed.launched():
        return ""
    return f"rank {os.environ.get('RANK', '?')} of {os.environ.get('WORLD_SIZE')}: "
