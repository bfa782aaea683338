"""The README and the docs point at what is there: every relative link resolves, and every repository file they
cite in backticks exists, or is cited with the commit that holds it (`path` at `0810d7a`) or removed it."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]
PAGES = [
    ROOT / "README.md",
    *sorted((ROOT / "docs").rglob("*.md")),
    *sorted((ROOT / "plugins").glob("*/README.md")),
    ROOT / "benchmarks" / "README.md",
]
LINK = re.compile(r"\]\(([^)\s]+)\)")
CITED = re.compile(
    r"`((?:compresskit|benchmarks|recipes|tests|plugins|docs)/"  # a repository path in backticks
    r"[A-Za-z0-9_./-]+\.(?:py|md|yaml|sh|json|toml))`"  # naming a file
)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_links_and_cited_files_resolve(page):
    missing = []
    for number, line in enumerate(page.read_text().splitlines(), 1):
        for target in LINK.findall(line):
            if target.startswith(("http://", "https://", "mailto:", "#")):
                continue
            if not (page.parent / target.split("#")[0]).exists():
                missing.append(f"line {number}: link {target}")
        if "deleted at" in line:  # a file cited with the commit that removed it
            continue
        for path in CITED.findall(line):
            if "..." in path or (ROOT / path).exists() or re.search(re.escape(path) + r"` at `[0-9a-f]{7,40}`", line):
                continue
            missing.append(f"line {number}: cites {path}")
    assert not missing, missing
