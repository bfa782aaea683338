"""Give an op of ``policy.UNMEASURED`` a range in a copy of ``policy.py``, for a before/after on the device: the
tree as it is runs the op's fallback under ``auto``, the copy with the range its kernel, so that the two trees side
by side (``device_before_after.sh``, through ``device_policy_trial.sh``) measure what the range would change end to
end. Edits the file in place (the device's copy of the tree; never commit the result unmeasured).

    python benchmarks/policy_range.py plugins/wide/compresskit_wide/kernels/policy.py router_consensus --max-m 64
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path


def with_range(source: str, op: str, max_m: int) -> str:
    """``policy.py``'s text with ``op`` out of ``UNMEASURED`` and a ``Range(op, max_m=...)`` last in
    ``KERNEL_RANGES``; a ValueError where the text does not hold what this edits."""
    unmeasured = re.search(r"^UNMEASURED(: [^=]+)? = \((.*)\)$", source, flags=re.M)
    if unmeasured is None or f'"{op}"' not in unmeasured.group(2):
        raise ValueError(f"{op!r} is not in UNMEASURED")
    rest = [name.strip() for name in unmeasured.group(2).split(",") if name.strip() and name.strip() != f'"{op}"']
    listed = f"UNMEASURED{unmeasured.group(1) or ''} = ({', '.join(rest)}{',' if rest else ''})"
    source = source[: unmeasured.start()] + listed + source[unmeasured.end() :]
    start = source.find("KERNEL_RANGES = (")
    end = source.find("\n)\n", start)
    if start < 0 or end < 0:
        raise ValueError("KERNEL_RANGES has no closing parenthesis to add a range before")
    why = "under test: a before/after on the device (benchmarks/policy_range.py)"
    added = f'\n    Range("{op}", max_m={max_m}, why="{why}"),'
    return source[:end] + added + source[end:]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("policy", type=Path)
    parser.add_argument("op")
    parser.add_argument("--max-m", type=int, required=True, help="the range's largest token count")
    args = parser.parse_args()
    try:
        args.policy.write_text(with_range(args.policy.read_text(), args.op, args.max_m))
    except (OSError, ValueError) as exc:
        print(f"error: {args.policy}: {exc}", file=sys.stderr)
        return 2
    print(f"{args.policy}: {args.op} runs its kernel up to {args.max_m} tokens under auto")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
