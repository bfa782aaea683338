"""Resident memory of a command over time, by phase (a run records its stages' and tasks' peaks itself; this
samples any command, and every phase of it, loading included).

    python benchmarks/sample_memory.py -- compresskit apply recipes/wide-smollm2-50-quick.yaml --overwrite
    python benchmarks/sample_memory.py --imports      # the process with the libraries a run imports

Runs the command, samples the resident memory of its process tree every 0.25 s, and prints its stderr lines with
the seconds since the start; a phase is what the last ``[compresskit] STEP ...`` line started. At the end: the peak
of each phase and of the whole run, in GiB.
"""

from __future__ import annotations

import argparse
import re
import resource
import subprocess
import sys
import threading
import time

import psutil

STEP = re.compile(r"\[compresskit\] (.*) \.\.\.$")


def imports() -> None:
    import datasets  # noqa: F401
    import lm_eval  # noqa: F401
    import lm_eval.models.huggingface  # noqa: F401
    import torch  # noqa: F401
    import transformers  # noqa: F401

    import compresskit.api  # noqa: F401
    import compresskit.evaluate  # noqa: F401

    print(f"resident after the imports: {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20:.3f} GiB")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--imports", action="store_true", help="measure the imports alone")
    ap.add_argument("command", nargs="*", help="the command to sample (after --)")
    args = ap.parse_args()
    if args.imports:
        imports()
        return
    if not args.command:
        ap.error("give a command after --, or --imports")
    t0 = time.monotonic()
    proc = subprocess.Popen(args.command, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
    phase = ["start"]
    peaks: dict[str, int] = {}

    def read() -> None:
        for line in proc.stderr:
            line = line.rstrip()
            print(f"{time.monotonic() - t0:7.1f} {line}", flush=True)
            step = STEP.search(line)
            if step:
                phase[0] = step.group(1)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    root = psutil.Process(proc.pid)
    while proc.poll() is None:
        try:
            rss = root.memory_info().rss + sum(c.memory_info().rss for c in root.children(recursive=True))
        except psutil.Error:
            break
        peaks[phase[0]] = max(peaks.get(phase[0], 0), rss)
        time.sleep(0.25)
    reader.join(timeout=5)
    print(f"exit {proc.returncode} after {time.monotonic() - t0:.0f} s; peak resident memory by phase:")
    for name, rss in peaks.items():
        print(f"  {rss / 2**30:6.3f} GiB  {name}")
    print(f"  {max(peaks.values(), default=0) / 2**30:6.3f} GiB  the whole run")
    sys.exit(proc.returncode)


if __name__ == "__main__":
    main()
