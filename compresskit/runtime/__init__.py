"""A lean inference runtime for Llama-family models (Llama, Mistral, Qwen2, Qwen3), written as one
readable forward per block with a static KV cache, in the manner of gpt-fast. It shares the loaded
Hugging Face model's weights (no copy) and knows nothing of any pruning method: a dense model, or
one that static pruning left narrower or shallower (smaller shapes, fewer layers), runs on it unchanged.

A pruning method's own layers run on it as blocks its executor supplies
(``Executor.runtime_blocks``; ``runtime_for`` picks the pruner's). On a GPU the decode steps are
compiled with ``torch.compile`` and replayed as CUDA graphs; on a CPU everything runs eagerly.

``compresskit.generator(path).generate("text")`` from Python, ``compresskit generate`` from the
shell; ``runtime_for(model, pruner).generate(token_ids, ...)`` underneath.
"""

from compresskit import artifacts, plugins
from compresskit.interfaces import Executor
from compresskit.modeling import load_model, merge_lora, resolve_model_source
from compresskit.runtime.llama import Runtime, StaticCache

__all__ = ["Runtime", "StaticCache", "TextGenerator", "generator", "load_for_runtime", "runtime_for"]


def runtime_for(model, pruner=None, executor=None, *, counting: bool = True, **options) -> Runtime:
    """The runtime for ``model`` as ``pruner`` left it: with the blocks of ``executor`` where it supplies
    some (a recipe's configured executor), else of the pruner's ``runtime_executor`` (its default
    configuration; with ``counting`` off, its ``track_stats`` off where it has one: for generation, which
    reports no sparsity), else the runtime's own blocks. ``options`` go to :class:`Runtime` (``compile``,
    ``graphs``, ``dense``)."""
    if executor is not None and type(executor).runtime_blocks is not Executor.runtime_blocks:
        return Runtime(model, executor=executor, **options)
    executor = None
    name = getattr(pruner, "runtime_executor", None)
    if name is not None:
        cls = plugins.load("executor", name)
        quiet = not counting and "track_stats" in cls.Config.model_fields
        executor = cls(cls.Config(**({"track_stats": False} if quiet else {})))
    return Runtime(model, executor=executor, **options)


class TextGenerator:
    """Text in, text out, through the runtime: what ``compresskit.generator(path)`` returns.

    ``generate("Once upon a time", max_new_tokens=32)`` -> the continuation; a list of prompts gives
    a list. ``runtime``, ``tokenizer`` and ``pruner`` (or None) are there for finer use."""

    def __init__(self, model, tokenizer, pruner=None) -> None:
        self.runtime = runtime_for(model, pruner, counting=False)
        self.tokenizer = tokenizer
        self.pruner = pruner

    def generate(
        self, prompt: str | list[str], *, max_new_tokens: int = 64, temperature: float = 0.0, top_p: float = 1.0, seed=0
    ) -> str | list[str]:
        prompts = [prompt] if isinstance(prompt, str) else list(prompt)
        ids = [self.tokenizer(p, add_special_tokens=True)["input_ids"] for p in prompts]
        res = self.runtime.generate(
            ids,
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            top_p=top_p,
            eos_token_id=self.tokenizer.eos_token_id,
            seed=seed,
        )
        texts = [self.tokenizer.decode(t, skip_special_tokens=True) for t in res.tokens]
        return texts[0] if isinstance(prompt, str) else texts


def load_for_runtime(path: str, *, device: str = "auto", dtype: str = "auto", field: str = "model", progress=None):
    """``(model, tokenizer, pruner or None, base model)`` of a run folder or its ``model/`` directory, an HF
    directory or an alias; errors about ``path`` name it as ``field``. For inference only: a run saved with
    its LoRA adapters apart (a ``lora`` stage without ``merge: true``) comes with them folded into its
    weights, as a merging stage would have saved it, so that a method's blocks read plain weights and the
    runtime compiles them and replays them as CUDA graphs (unmerged, the layers run eagerly)."""
    folder = artifacts.saved_dir(path)
    if folder is not None:
        model, tokenizer, pruner = artifacts.load(folder, device=device, dtype=dtype, progress=progress)
        merged = merge_lora(model)
        if merged and progress is not None:
            progress.log(f"{path}: its LoRA adapters folded into the weights of {merged} projections for the runtime")
        return model, tokenizer, pruner, artifacts.read_manifest(folder)["base_model"]
    resolve_model_source(path, field=field)
    model, tokenizer = load_model(path, device=device, dtype=dtype, progress=progress, field=field)
    return model, tokenizer, None, path


def generator(path: str, *, device: str = "auto", dtype: str = "auto") -> TextGenerator:
    """A :class:`TextGenerator` over a run folder or its ``model/`` directory, an HF directory or an alias,
    on the runtime (compiled, with CUDA graphs, on a GPU); ``compresskit.load`` gives the transformers model (for
    evaluation and training; it is not the fast path)."""
    model, tokenizer, pruner, _ = load_for_runtime(path, device=device, dtype=dtype)
    return TextGenerator(model, tokenizer, pruner)
