"""Run one pytest selection as N processes side by side, each on every N-th collected test.

On the device machine the kernel tests spend most of their time compiling and autotuning Triton
kernels, work for the host's cores rather than the GPU; N processes sharing the GPU finish the
whole file several times sooner (the correctness checks do not depend on timing). Each shard's
log goes to ``LOG.shard-I``; the combined log, the shards' summary lines and failures first, to
``LOG``. Exit status: the worst of the shards'.

    python3 benchmarks/pytest_shards.py --shards 4 --log $OUT/kernel-tests.log -- tests/wide/test_kernels.py -k "..."
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path


def collect(pytest_args: list[str]) -> list[str]:
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *pytest_args],
        capture_output=True,
        text=True,
    )
    ids = [line for line in done.stdout.splitlines() if "::" in line and not line.startswith(" ")]
    if done.returncode not in (0, 5) or not ids:
        sys.stderr.write(done.stdout[-4000:] + done.stderr[-4000:])
        raise SystemExit(f"pytest collected nothing to run (exit {done.returncode})")
    return ids


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shards", type=int, default=4, help="processes side by side (default 4)")
    parser.add_argument("--log", type=Path, required=True, help="the combined log")
    parser.add_argument("pytest_args", nargs="*", help="after --: the selection, as for pytest")
    args = parser.parse_args(argv)
    if args.shards < 1:
        parser.error(f"--shards must be at least 1, got {args.shards}")
    ids = collect(args.pytest_args)
    # the selection (-k, -m) is done by the collection: each shard runs its collected ids
    shards = [ids[i :: args.shards] for i in range(args.shards) if ids[i :: args.shards]]
    procs = []
    for i, shard in enumerate(shards):
        log = open(f"{args.log}.shard-{i}", "w")
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rfEs", *shard]
        procs.append((subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT), log))
    codes = []
    for proc, log in procs:
        codes.append(proc.wait())
        log.close()
    summary, bodies = [], []
    for i in range(len(shards)):
        text = Path(f"{args.log}.shard-{i}").read_text()
        last = [line for line in text.splitlines() if line.strip()][-1:] or ["(no output)"]
        summary.append(f"shard {i} ({len(shards[i])} tests, exit {codes[i]}): {last[0]}")
        bodies.append(f"===== shard {i} =====\n{text}")
    head = f"{len(ids)} tests in {len(shards)} shards\n" + "\n".join(summary) + "\n"
    args.log.write_text(head + "\n".join(bodies))
    print(head, end="")
    return max(codes)


if __name__ == "__main__":
    raise SystemExit(main())
