"""Give an op of ``policy.UNMEASURED`` a range, or a launch setting of the policy another value, in a copy of
``policy.py``, for a before/after on the GPU host: the tree as it is runs the op's fallback (or the setting's
measured value) under ``auto``, the copy the kernel (or the value under test), so that the two trees side by side
(``device_before_after.sh``, through ``device_policy_trial.sh``) measure what the change would do end to end.
Edits the file in place (the GPU host's copy of the tree; never commit the result unmeasured).

    python benchmarks/policy_range.py plugins/wide/compresskit_wide/kernels/policy.py NEW_OP --max-m 64
    python benchmarks/policy_range.py plugins/wide/compresskit_wide/kernels/policy.py --set OUT_TAIL_SPLIT=2
"""

from __future__ import annotations

import argparse
import ast
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
    why = "under test: a before/after on the GPU host (benchmarks/policy_range.py)"
    added = f'\n    Range("{op}", max_m={max_m}, why="{why}"),'
    return source[:end] + added + source[end:]


def with_setting(source: str, assignment: str) -> str:
    """``policy.py``'s text with the one-line setting ``NAME=VALUE`` (an upper-case name assigned a number, a
    string, or a tuple or dict of them on a line of its own, perhaps a comment after it) given ``VALUE``; a
    ValueError where it is not such a setting or the value is no literal of the same type (a dict: the same keys)."""
    name, sep, value = assignment.partition("=")
    name = name.strip()
    pattern = rf"^{re.escape(name)}(: [^=\n]+)? = ([^#\n]+?)([ \t]+#.*)?$"  # (a comment after the value, same line)
    line = re.search(pattern, source, flags=re.M) if name.isupper() else None
    if not sep or line is None:
        raise ValueError(f"{name!r} is not a one-line setting of the policy (NAME=VALUE)")
    try:
        old, new = ast.literal_eval(line.group(2)), ast.literal_eval(value.strip())
    except (ValueError, SyntaxError):
        raise ValueError(f"{name}: {line.group(2)!r} or {value.strip()!r} is not a literal") from None
    if type(old) is not type(new):
        raise ValueError(f"{name}: {value.strip()!r} is a {type(new).__name__}, the policy's a {type(old).__name__}")
    if isinstance(old, dict) and set(new) != set(old):
        raise ValueError(f"{name}: keys {sorted(new)}, the policy's {sorted(old)}")
    edited = f"{name}{line.group(1) or ''} = {new!r}  # under test: benchmarks/policy_range.py (was {old!r})"
    return source[: line.start()] + edited + source[line.end() :]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("policy", type=Path)
    parser.add_argument("op", nargs="?", help="an op of UNMEASURED, given a range up to --max-m tokens")
    parser.add_argument("--max-m", type=int, help="the range's largest token count")
    parser.add_argument("--set", metavar="NAME=VALUE", help="a launch setting's value instead")
    args = parser.parse_args()
    if (args.op is None) == (args.set is None) or (args.op is not None) != (args.max_m is not None):
        parser.error("give an op and --max-m, or --set NAME=VALUE")
    try:
        text = args.policy.read_text()
        edited = with_setting(text, args.set) if args.set else with_range(text, args.op, args.max_m)
        args.policy.write_text(edited)
    except (OSError, ValueError) as exc:
        print(f"error: {args.policy}: {exc}", file=sys.stderr)
        return 2
    if args.set:
        print(f"{args.policy}: {args.set.strip()} under auto")
    else:
        print(f"{args.policy}: {args.op} runs its kernel up to {args.max_m} tokens under auto")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
