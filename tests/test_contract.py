"""One table of pruners, one battery of checks (the same one `compresskit plugins check` runs).

Every pruner installed through an entry point must be in CASES, so a new plugin cannot skip
the contract; the broken fixture plugin is the one exception, and it must fail the battery.
"""

import pytest

from compresskit import plugins
from compresskit.testing import check_plugin_contract

CASES = ["toy-magnitude", "toy-router", "wide", "static-width", "static-depth", "dynamic-depth"]
OPTIONAL: set[str] = set()
EXPECTED_BROKEN = {"toy-broken"}


def installed():
    return [n for n in plugins.names("pruner") if n not in EXPECTED_BROKEN]


def test_every_installed_pruner_is_in_the_table():
    missing = set(installed()) - set(CASES) - OPTIONAL
    assert not missing, f"add these pruners to CASES: {sorted(missing)}"


@pytest.mark.parametrize("name", CASES + sorted(OPTIONAL))
def test_contract(name):
    if name not in installed():
        pytest.skip(f"{name} is not installed")
    checks = check_plugin_contract(name)
    failed = [c for c in checks if not c.ok]
    assert not failed, failed
    assert len(checks) == 6


def test_broken_plugin_fails_the_contract():
    checks = check_plugin_contract("toy-broken")
    assert len(checks) == 1 and not checks[0].ok
