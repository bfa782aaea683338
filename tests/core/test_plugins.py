import os
import subprocess
import sys
from pathlib import Path

import pytest

from compresskit import plugins
from compresskit.errors import PluginLoadError, PluginNotFoundError
from compresskit.executors import TorchExecutor
from compresskit.interfaces import NoopTrainer


def test_core_plugins_load_through_entry_points():
    assert plugins.load("trainer", "none") is NoopTrainer
    assert plugins.load("executor", "torch") is TorchExecutor


def test_unknown_name_did_you_mean():
    with pytest.raises(PluginNotFoundError) as exc:
        plugins.load("executor", "torhc")
    msg = str(exc.value)
    assert msg.startswith("unknown executor 'torhc'. Did you mean: torch? Available: ")
    assert "torch" in msg.split("Available: ")[1].split(", ")


def test_unknown_name_unlike_any_suggests_nothing():
    with pytest.raises(PluginNotFoundError) as exc:
        plugins.load("executor", "nosuch")
    assert str(exc.value).startswith("unknown executor 'nosuch'. Available: ")


def test_third_party_plugin_is_discovered():
    cls = plugins.load("pruner", "toy-magnitude")
    assert cls.__module__ == "ck_toy_pruner"
    assert "toy-magnitude" in plugins.names("pruner")


def test_broken_plugin_is_listed_and_breaks_nothing():
    infos = {(i.kind, i.name): i for i in plugins.discover()}
    broken = infos[("pruner", "toy-broken")]
    assert not broken.ok and "ModuleNotFoundError" in broken.error
    assert infos[("pruner", "toy-magnitude")].ok and infos[("executor", "torch")].ok
    with pytest.raises(PluginLoadError, match="toy-broken.*failed to load"):
        plugins.load("pruner", "toy-broken")


def test_loading_one_plugin_imports_no_other():
    code = (
        "import sys; from compresskit import plugins; plugins.load('executor', 'torch'); "
        "print('ck_toy_pruner' in sys.modules, 'triton' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["False", "False"]


def test_unknown_kind():
    with pytest.raises(ValueError, match="Did you mean: pruner"):
        plugins.names("pruners")


def test_the_tests_keep_out_of_the_users_environment_and_caches():
    """The fixture plugin is registered in this process only (not installed), and every cache the
    tests write lives in the session's temporary folder."""
    from importlib import metadata

    from conftest import SANDBOX, TESTS

    from compresskit.modeling import cache_dir

    dist = metadata.distribution("ck-toy-pruner")
    assert Path(str(dist.locate_file(""))).resolve() == (TESTS / "fixtures" / "toy_plugin").resolve()
    assert cache_dir().resolve().is_relative_to(SANDBOX.resolve())
    # stevedore caches its entry-point scans under $XDG_CACHE_HOME/python-entrypoints on Linux: after a lookup the
    # sandbox's folder holds them (stevedore writes no cache at all for an interpreter under /tmp)
    plugins.load("pruner", "toy-magnitude")
    assert os.environ["XDG_CACHE_HOME"] == str(SANDBOX / "xdg")
    if not sys.executable.startswith("/tmp"):
        assert any((SANDBOX / "xdg" / "python-entrypoints").iterdir())


def test_the_fixture_dist_info_declares_the_entry_points_of_its_pyproject():
    tomllib = pytest.importorskip("tomllib")
    from importlib import metadata

    from conftest import TESTS

    project = tomllib.loads((TESTS / "fixtures" / "toy_plugin" / "pyproject.toml").read_text())["project"]
    declared = {(g, n, v) for g, eps in project["entry-points"].items() for n, v in eps.items()}
    registered = {(ep.group, ep.name, ep.value) for ep in metadata.distribution("ck-toy-pruner").entry_points}
    assert registered == declared
