"""A method's own inference settings, passed through the core without the core knowing them.

A pruner's models run on its ``runtime_executor``; that executor's config (``compresskit schema NAME``) is the
method's inference settings. A command takes one setting of it as ``--option KEY=VALUE[,KEY=VALUE...]``:
dotted keys into the config, values in YAML (``--option a.b=0.5,a.c=x`` sets ``{a: {b: 0.5, c: x}}``),
every key the option leaves out at the config's default. ``bench`` times each ``--option`` as a row of its own;
``eval`` scores a saved run under one. A recipe gives the same settings in its executor section.

A training stage may change how a model decides (the pruner's ``TrainingOptions``); ``Pruner.trained_options``
says under which settings it then runs as trained, and :func:`trained_notice` tells a user who evaluates it
without them.
"""

from __future__ import annotations

from typing import Any

import yaml
from pydantic import ValidationError

from compresskit import plugins
from compresskit.errors import CompressKitError
from compresskit.interfaces import Executor


def parse_option(text: str, flag: str = "--option") -> dict[str, Any]:
    """``"a.b=0.5,c=x"`` -> ``{"a": {"b": 0.5}, "c": "x"}`` (values parsed as YAML scalars); a
    ``CompressKitError`` naming ``flag`` where a part is no ``KEY=VALUE`` pair or a key repeats."""
    options: dict[str, Any] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        key, sep, value = part.partition("=")
        keys = [k.strip() for k in key.split(".")]
        if not sep or not all(keys):
            raise CompressKitError(f"{flag} {text}: {part!r} is no KEY=VALUE pair (e.g. a.b=0.5,a.c=x)")
        try:
            parsed = yaml.safe_load(value) if value.strip() else ""
        except yaml.YAMLError:
            parsed = value.strip()
        node = options
        for name in keys[:-1]:
            node = node.setdefault(name, {})
            if not isinstance(node, dict):
                raise CompressKitError(f"{flag} {text}: {'.'.join(keys)} sets a field inside {name}, given a value")
        if keys[-1] in node:
            raise CompressKitError(f"{flag} {text}: {'.'.join(keys)} is given twice")
        node[keys[-1]] = parsed
    if not options:
        raise CompressKitError(f"{flag} {text!r}: give one or more KEY=VALUE pairs (e.g. a.b=0.5,a.c=x)")
    return options


def _flat(options: dict[str, Any], prefix: str = "") -> list[tuple[str, Any]]:
    out = []
    for key, value in options.items():
        if isinstance(value, dict) and value:
            out += _flat(value, f"{prefix}{key}.")
        else:
            out.append((f"{prefix}{key}", value))
    return out


def option_text(options: dict[str, Any]) -> str:
    """The ``--option`` value that gives ``options``: the inverse of :func:`parse_option`."""

    def scalar(value: Any) -> str:
        return yaml.safe_dump(value, default_flow_style=True).strip().removesuffix("...").strip()

    return ",".join(f"{key}={scalar(value)}" for key, value in _flat(options))


def option_label(options: dict[str, Any], config: Any = None) -> str:
    """A row's name for the setting ``options``: ``a (b 0.5, c x)`` for ``{a: {b: 0.5, c: x}}``, settings
    of several fields joined by ``; ``; each value as ``config`` (the executor's, validated) holds it, where given."""
    held = config.model_dump(mode="json") if config is not None else {}

    def show(key: str, value: Any, held: Any) -> str:
        held = held.get(key, value) if isinstance(held, dict) else value
        if isinstance(value, dict):
            return f"{key} (" + ", ".join(show(k, v, held) for k, v in value.items()) + ")"
        return f"{key} {held}"

    return "; ".join(show(k, v, held) for k, v in options.items())


def runtime_executor_class(pruner_cls: type, flag: str = "--option") -> type[Executor]:
    """The executor class that runs ``pruner_cls``'s models on the runtime (its ``runtime_executor``); a
    ``CompressKitError`` naming ``flag`` where it has none (a method without settings of its own)."""
    name = getattr(pruner_cls, "runtime_executor", None)
    if name is None:
        raise CompressKitError(
            f"{flag}: {pruner_cls.__name__} runs on the runtime's own blocks, which take no settings of a method"
        )
    return plugins.load("executor", name)


def configured_executor(pruner_cls: type, options: dict[str, Any], flag: str = "--option") -> Executor:
    """``pruner_cls``'s runtime executor with its config's fields set from ``options`` (the others at their
    defaults), checked: a ``CompressKitError`` naming ``flag``, the key and what is allowed otherwise."""
    from compresskit.recipe import format_validation_error

    cls = runtime_executor_class(pruner_cls, flag)
    try:
        config = cls.Config(**options)
    except ValidationError as exc:
        name = getattr(pruner_cls, "runtime_executor", "")
        raise CompressKitError(
            f"{flag} {option_text(options)}: executor {name}: {format_validation_error(exc, cls.Config)}"
        ) from None
    except TypeError as exc:  # keys that are no identifiers
        raise CompressKitError(f"{flag} {option_text(options)}: {exc}") from None
    return cls(config)


def trained_notice(what: str, pruner_cls: type | None, recipe: dict | None, executor_config: Any) -> str | None:
    """The line telling that ``what`` (a run, or a model directory) is scored under settings other than those
    its training ran it with (``Pruner.trained_options``), with the ``--option`` that scores it as trained;
    None where they match (or training changed nothing). ``executor_config``: the config it is scored under
    (None: the runtime executor's defaults)."""
    options = pruner_cls.trained_options(recipe or {}) if pruner_cls is not None else {}
    if not options:
        return None
    expected = configured_executor(pruner_cls, options, flag="training").config
    if executor_config is None:
        executor_config = type(expected)()
    differs = [k for k in options if getattr(executor_config, k, None) != getattr(expected, k)]
    if not differs:
        return None
    scored = ", ".join(f"{k} {getattr(executor_config, k, None)}" for k in differs)
    return (
        f"{what}: its last training stage ran it with settings it is not scored with here ({scored}), where such a "
        f"model may do worse (--option {option_text(options)} scores it as it was trained)"
    )
