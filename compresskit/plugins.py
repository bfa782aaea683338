"""Plugin discovery through entry points, with stevedore.

Groups: ``compresskit.pruners``, ``compresskit.trainers``, ``compresskit.executors``.
:func:`load` imports only the plugin asked for (a baseline run never imports Triton);
:func:`discover` imports every plugin of a group and reports the broken ones with their error
instead of failing.
"""

from __future__ import annotations

import importlib.metadata
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from stevedore import DriverManager, ExtensionManager
from stevedore.exception import MultipleMatches, NoMatches

from compresskit.errors import CompressKitError, PluginLoadError, PluginNotFoundError, did_you_mean
from compresskit.interfaces import Executor, Pruner, Trainer

Kind = Literal["pruner", "trainer", "executor"]
KINDS: dict[str, type] = {"pruner": Pruner, "trainer": Trainer, "executor": Executor}


def namespace(kind: str) -> str:
    if kind not in KINDS:
        raise ValueError(did_you_mean(kind, KINDS, what="plugin kind"))
    return f"compresskit.{kind}s"


def names(kind: str) -> list[str]:
    """Registered plugin names of a kind, without importing any of them."""
    return sorted({ep.name for ep in importlib.metadata.entry_points(group=namespace(kind))})


def load(kind: str, name: str) -> type:
    """The plugin class registered as ``name``; imports only that plugin.

    Raises:
        PluginNotFoundError: nothing of that name ("Did you mean ...? Available: ...").
        PluginLoadError: it is registered but fails to import or is not a subclass of the API.
    """
    ns = namespace(kind)
    if name not in names(kind):
        raise PluginNotFoundError(did_you_mean(name, names(kind), what=kind))

    def _failed(_manager, entrypoint, exc):
        raise PluginLoadError(
            f"{kind} {name!r} ({entrypoint.value}) failed to load: {type(exc).__name__}: {exc}"
        ) from exc

    try:
        manager = DriverManager(ns, name, invoke_on_load=False, on_load_failure_callback=_failed)
    except (NoMatches, MultipleMatches) as exc:
        raise PluginLoadError(f"{kind} {name!r}: {exc}") from exc
    cls = manager.driver
    base = KINDS[kind]
    if not (isinstance(cls, type) and issubclass(cls, base)):
        raise PluginLoadError(f"{kind} {name!r} points to {cls!r}, which is not a subclass of {base.__name__}")
    return cls


def names_where(kind: str, test: Callable[[type], bool]) -> list[str]:
    """Registered plugin names of a kind whose class passes ``test`` (each imported; one that fails to load
    is left out): for a message that lists the plugins that could do what was asked."""
    found = []
    for name in names(kind):
        try:
            cls = load(kind, name)
        except CompressKitError:
            continue
        if test(cls):
            found.append(name)
    return found


@dataclass
class PluginInfo:
    kind: str
    name: str
    target: str
    distribution: str
    version: str
    ok: bool
    error: str = ""


def discover(kinds: tuple[str, ...] = ("pruner", "trainer", "executor")) -> list[PluginInfo]:
    """Every installed plugin with its load status; a broken plugin breaks nothing else."""
    infos: list[PluginInfo] = []
    for kind in kinds:
        failures: dict[str, str] = {}

        def _record(_manager, entrypoint, exc, _failures=failures):
            _failures[entrypoint.name] = f"{type(exc).__name__}: {exc}"

        manager = ExtensionManager(namespace(kind), invoke_on_load=False, on_load_failure_callback=_record)
        loaded = {ext.name: ext for ext in manager}
        for ep in sorted(importlib.metadata.entry_points(group=namespace(kind)), key=lambda e: e.name):
            dist = getattr(ep, "dist", None)
            info = PluginInfo(
                kind=kind,
                name=ep.name,
                target=ep.value,
                distribution=dist.name if dist else "?",
                version=dist.version if dist else "?",
                ok=True,
            )
            if ep.name in failures:
                info.ok, info.error = False, failures[ep.name]
            elif ep.name in loaded:
                cls = loaded[ep.name].plugin
                if not (isinstance(cls, type) and issubclass(cls, KINDS[kind])):
                    info.ok, info.error = False, f"not a subclass of {KINDS[kind].__name__}"
            infos.append(info)
    return infos
