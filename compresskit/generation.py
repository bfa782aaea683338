"""Text the dense model writes itself (``data: {source: {generated: ...}}``): the model continues
the shipped openings (or the recipe's) into documents, on the inference runtime where it runs the
model's architecture, else through transformers' ``generate``. It sits above both
:mod:`compresskit.data` (which reads every other source) and :mod:`compresskit.runtime`: the data
layer knows nothing of the runtime."""

from __future__ import annotations

import contextlib
import hashlib
import json
from importlib import resources
from pathlib import Path

import torch
import transformers

from compresskit import files
from compresskit.data import Article, SourceDocuments, at_least_two
from compresskit.modeling import cache_dir
from compresskit.runtime import Runtime
from compresskit.runtime.llama import SUPPORTED


def shipped_prompts() -> list[str]:
    """The varied openings shipped in ``compresskit/resources/prompts`` (``\\n``: a line break)."""
    text = (resources.files("compresskit") / "resources" / "prompts" / "prompts.txt").read_text()
    return [ln.replace("\\n", "\n") for ln in text.splitlines() if ln.strip() and not ln.startswith("#")]


def write_generated(documents: list[SourceDocuments], model, tokenizer, *, model_id: str, progress=None) -> None:
    """Fill in every ``generated`` source of ``documents``: the dense ``model`` continues the openings
    into documents, once, on the runtime where it runs the model's architecture (compiled, with CUDA
    graphs, on a GPU), else through transformers' ``generate``. They are cached
    (``<cache>/generated/<key>.json``) by everything that decides them: the model, its dtype and
    device type, the settings and openings, the engine and the transformers version."""
    for src in documents:
        if src.pending is None:
            continue
        spec = src.pending
        prompts = spec.prompts or shipped_prompts()
        param = next(model.parameters())
        engine = generation_engine(model)
        key_src = {
            "model": model_id,
            "model_files": _files_identity(model_id),  # a local model folder: its files as they are now
            "dtype": str(param.dtype),
            "device": param.device.type,
            "settings": spec.model_dump(mode="json", exclude={"prompts"}),
            "prompts": hashlib.sha256("\n\n".join(prompts).encode()).hexdigest(),
            "engine": engine,
            "transformers": transformers.__version__,
        }
        key = hashlib.sha256(json.dumps(key_src, sort_keys=True).encode()).hexdigest()[:16]
        path = cache_dir() / "generated" / f"{key}.json"
        if path.is_file():
            texts = json.loads(path.read_text())["documents"]
        else:
            texts = _generate(model, tokenizer, spec, prompts, engine, progress)
            files.write_json(path, {"key": key_src, "documents": texts})
        src.articles = [Article(f"generated:{key}#{i}", i, t.strip()) for i, t in enumerate(texts) if t.strip()]
        at_least_two(src.articles, "data.source.generated", f"{len(texts)} written documents")
        src.info = {"generated": key, "documents": len(src.articles), "model": model_id, "engine": engine}
        src.pending = None


def generation_engine(model) -> str:
    """What writes the ``generated`` text: ``"runtime"`` where the runtime runs the model's
    architecture (the Llama family), else ``"transformers"`` (its ``generate``)."""
    return "runtime" if getattr(model.config, "model_type", None) in SUPPORTED else "transformers"


def _files_identity(model_id: str) -> list[tuple[str, int, int]] | None:
    """(name, size, mtime) of each file of a local model folder; None for a hub id or an alias."""
    folder = Path(model_id).expanduser()
    if not folder.is_dir():
        return None
    return [(p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in sorted(folder.iterdir()) if p.is_file()]


def _generate(model, tokenizer, spec, prompts: list[str], engine: str, progress) -> list[str]:
    """``spec.documents`` continuations of the openings, in turn, sampled in seeded batches (each
    batch its own seed, so the text does not depend on what ran before it)."""
    chat = getattr(tokenizer, "chat_template", None) is not None
    side, pad = tokenizer.padding_side, tokenizer.pad_token_id
    tokenizer.padding_side = "left"
    pad_id = pad if pad is not None else tokenizer.eos_token_id
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    runtime = None
    if engine == "runtime":
        runtime = Runtime(model)
    texts: list[str] = []
    task_cm = (
        progress.task("writing the generated text", total=spec.documents) if progress else contextlib.nullcontext()
    )
    try:
        with task_cm as task:
            for start in range(0, spec.documents, spec.batch_size):
                batch = [prompts[i % len(prompts)] for i in range(start, min(spec.documents, start + spec.batch_size))]
                if chat:
                    inputs = [
                        tokenizer.apply_chat_template(
                            [{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True
                        )
                        for p in batch
                    ]
                else:
                    inputs = batch
                seed = spec.seed * 1_000_003 + start
                if runtime is not None:
                    ids = [tokenizer(x, add_special_tokens=not chat)["input_ids"] for x in inputs]
                    new = runtime.generate(
                        ids,
                        max_new_tokens=spec.max_new_tokens,
                        temperature=spec.temperature,
                        top_p=spec.top_p,
                        eos_token_id=tokenizer.eos_token_id,
                        seed=seed,
                    ).tokens
                else:
                    enc = tokenizer(inputs, return_tensors="pt", padding=True, add_special_tokens=not chat).to(device)
                    torch.manual_seed(seed)
                    with torch.inference_mode():
                        out = model.generate(
                            **enc,
                            do_sample=True,
                            temperature=spec.temperature,
                            top_p=spec.top_p,
                            max_new_tokens=spec.max_new_tokens,
                            pad_token_id=pad_id,
                        )
                    new = out[:, enc["input_ids"].shape[1] :]
                written = tokenizer.batch_decode(new, skip_special_tokens=True)
                texts += [f"{p}{w}" for p, w in zip(inputs if chat else batch, written, strict=True)]
                if task is not None:
                    task.advance(len(batch))
    finally:
        tokenizer.padding_side = side
        model.train(was_training)
    return texts
