"""What the benchmark scripts share: where a run goes (the GPU, or the CPU with ``--smoke``), the facts
of a run (date, GPU, versions, command) and writing its result as ``<stem>.md`` (a title, the facts,
the tables) and ``<stem>.json``."""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path

import torch


def int_list(text: str) -> list[int]:
    """An argparse type: a comma-separated list of positive integers, read as the CLI reads its lists
    (``compresskit.cli._int_list``); anything else is argparse's one line naming the flag, and exit 2."""
    from compresskit.cli import _int_list
    from compresskit.errors import CompressKitError

    try:
        return _int_list(text, "list")
    except CompressKitError as exc:
        raise argparse.ArgumentTypeError(str(exc).removeprefix("list: ")) from None


def gpu_or_smoke(smoke: bool) -> tuple[torch.device, torch.dtype] | None:
    """The GPU in bf16, or with ``smoke`` the CPU in fp32 (the path runs, nothing is measured); None,
    after saying so, without a GPU and without ``smoke``."""
    if smoke:
        return torch.device("cpu"), torch.float32
    if not torch.cuda.is_available():
        print("no CUDA device: use --smoke")
        return None
    return torch.device("cuda"), torch.bfloat16


def run_facts(gpu: bool, **extra) -> dict:
    """Date, GPU (or "none (CPU)"), torch / transformers / triton versions and the command line, then
    ``extra``."""
    facts = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "gpu": torch.cuda.get_device_name(0) if gpu else "none (CPU)",
        "torch": torch.__version__,
    }
    for name in ("transformers", "triton"):
        try:
            facts[name] = __import__(name).__version__
        except ImportError:
            pass
    facts["command"] = " ".join(sys.argv)
    return {**facts, **extra}


def write(out: str | Path, stem: str, title: str, facts: dict, lines: list[str], data: dict) -> str:
    """``out/<stem>.md`` (``# title``, the facts as one JSON line, ``lines``) and ``out/<stem>.json``
    (``{"meta": facts, **data}``); returns the Markdown text."""
    text = f"# {title}\n\n{json.dumps(facts)}\n\n" + "\n".join(lines) + "\n"
    folder = Path(out)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{stem}.md").write_text(text)
    (folder / f"{stem}.json").write_text(json.dumps({"meta": facts, **data}, indent=2))
    return text
