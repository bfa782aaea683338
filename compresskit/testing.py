"""Helpers for tests and for ``compresskit plugins check``: a tiny Llama built from a config
(no download), a tiny tokenizer trained in memory, and the plugin contract.
"""

from __future__ import annotations

import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from compresskit import artifacts, plugins
from compresskit.interfaces import Batch, Executor, RunContext
from compresskit.modeling import load_model

# Imported inside the functions that use them: transformers and tokenizers; so importing this module, and running the
# commands that do not need them (`--help` and `validate` first), stays fast.

TINY_CORPUS = (
    "The quick brown fox jumps over the lazy dog. A model of language predicts the next word. "
    "Pruning removes work that a network does not need. History, science and art are topics of "
    "encyclopedia articles; each article has sentences, and each sentence has words. "
) * 8


def tiny_tokenizer(vocab_size: int = 384):
    """A byte-level BPE tokenizer trained in memory on a fixed text (deterministic, offline)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>", "<|pad|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([TINY_CORPUS], trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|pad|>", bos_token="<|endoftext|>"
    )


FAMILIES = ("llama", "mistral", "qwen2")

# A recipe's evaluation section that scores a tiny model on every built-in task in about a second.
TINY_EVALUATION = {
    "tasks": ["perplexity", "piqa", "next_sentence"],
    "limit": 6,
    "perplexity_docs": 1,
    "next_sentence_items": 6,
    "batch_size": 4,
    "max_length": 512,
}


def tiny_llama(seed: int = 0, family: str = "llama", **overrides: Any):
    """A random-init causal LM small enough for unit tests (GQA: 6 q heads, 2 kv heads), of the
    Llama family by default, or ``family="mistral"`` / ``"qwen2"``."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg: dict[str, Any] = dict(
        vocab_size=384,
        hidden_size=48,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=6,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=1,
    )
    cfg.update(overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(family, **cfg))
    return model.eval()


def save_tiny_model(directory: str | Path, seed: int = 0, family: str = "llama", **overrides: Any) -> Path:
    """Write a tiny model and its tokenizer as an HF directory (a stand-in for a real checkpoint)."""
    directory = Path(directory)
    tok = tiny_tokenizer()
    model = tiny_llama(seed=seed, family=family, vocab_size=len(tok), **overrides)
    model.save_pretrained(directory)
    tok.save_pretrained(directory)
    return directory


def random_batches(vocab_size: int, n: int = 2, batch: int = 2, seq_len: int = 16, seed: int = 0):

    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        ids = torch.randint(2, vocab_size, (batch, seq_len), generator=gen)
        out.append(Batch(ids, torch.ones_like(ids)))
    return out


class ModulesExecutor(Executor):
    """Runs each decoder layer's modules as they are, routing wrappers included, on the inference runtime,
    eagerly: the reference a method's runtime blocks are tested against (``Runtime(model,
    executor=ModulesExecutor())`` beside ``runtime_for(model, pruner)``). The runtime never runs routed modules
    this way unless asked: it refuses a routed model whose method gives it no blocks."""

    def convert(self, model):
        return model

    def runtime_blocks(self, model, head_dim: int):
        from compresskit.modeling import decoder_layers
        from compresskit.runtime.blocks import MLP, Attention

        return [(Attention(layer, head_dim, dense=False), MLP(layer, dense=False)) for layer in decoder_layers(model)]


@dataclass
class Check:
    name: str
    ok: bool
    detail: str = ""


def check_plugin_contract(name: str) -> list[Check]:
    """Run the pruner contract on a tiny model: config JSON round-trip, attach, forward finite,
    finalize, save/load through compresskit's artifacts with identical logits.

    Stops at the first failing check (later checks depend on earlier ones).
    """
    checks: list[Check] = []
    state: dict[str, Any] = {}
    steps = [
        ("load plugin", _contract_load_cls),
        ("config JSON round-trip", _contract_round_trip),
        ("prepare (attach)", _contract_attach),
        ("forward finite", _contract_forward),
        ("finalize", _contract_finalize),
        ("save/load identical logits", _contract_save_load),
    ]
    try:
        for check_name, fn in steps:
            try:
                detail = fn(state, name) or ""
            except Exception as exc:  # the contract reports every failure, whatever it is
                checks.append(Check(check_name, False, f"{type(exc).__name__}: {exc}"))
                break
            checks.append(Check(check_name, True, str(detail)))
    finally:
        if "tmp" in state:
            shutil.rmtree(state["tmp"], ignore_errors=True)
    return checks


# the contract's steps, in order: each reads what the ones before left in ``state``


def _contract_load_cls(state: dict[str, Any], name: str):
    state["cls"] = plugins.load("pruner", name)
    return state["cls"].__module__ + "." + state["cls"].__qualname__


def _contract_round_trip(state: dict[str, Any], name: str):
    cls = state["cls"]
    config = cls.Config(**cls.contract_config)
    again = cls.Config.model_validate_json(config.model_dump_json())
    if again != config:
        raise AssertionError(f"JSON round-trip changed the config: {config!r} -> {again!r}")
    if "schema_version" not in config.model_dump():
        raise AssertionError("config has no schema_version")
    cls.Config.model_json_schema()
    state["config"] = config
    return config.model_dump_json()


def _contract_attach(state: dict[str, Any], name: str):
    tmp = Path(tempfile.mkdtemp(prefix="ck-contract-"))
    state["tmp"] = tmp
    base = save_tiny_model(tmp / "base")

    model, tok = load_model(str(base), dtype="float32", device="cpu")
    state["model"], state["tok"], state["base"] = model, tok, base
    pruner = state["cls"](state["config"])
    ctx = RunContext(model_config=model.config, tokenizer=tok)
    targeted = pruner.prepare(model, ctx)
    if not targeted:
        raise AssertionError("prepare() returned no targeted modules")
    state["pruner"] = pruner
    return f"{len(targeted)} modules"


def _contract_forward(state: dict[str, Any], name: str):
    model, pruner = state["model"], state["pruner"]
    batches = random_batches(model.config.vocab_size)
    if pruner.requires_calibration:
        pruner.calibrate(model, batches)
    with torch.no_grad():
        logits = model(batches[0].input_ids).logits
    if not torch.isfinite(logits).all():
        raise AssertionError("non-finite logits after prepare")
    state["ids"] = batches[0].input_ids


def _contract_finalize(state: dict[str, Any], name: str):
    model = state["pruner"].finalize(state["model"])
    state["model"] = model
    with torch.no_grad():
        logits = model(state["ids"]).logits
    if not torch.isfinite(logits).all():
        raise AssertionError("non-finite logits after finalize")
    state["logits"] = logits
    rep = state["pruner"].sparsity(model)
    if rep is not None and not all(0.0 <= x <= 1.0 for x in (rep.attention, rep.ffn, rep.macs)):
        raise AssertionError(f"sparsity outside [0, 1]: {rep.to_dict(per_layer=False)}")
    return "" if rep is None else f"sparsity macs={rep.macs:.3f}"


def _contract_save_load(state: dict[str, Any], name: str):
    out = state["tmp"] / "saved"
    artifacts.save(
        out, state["model"], state["tok"], base_model=str(state["base"]), pruner_name=name, pruner=state["pruner"]
    )
    model2, _, _ = artifacts.load(out, dtype="float32", device="cpu")
    with torch.no_grad():
        logits2 = model2(state["ids"]).logits
    if not torch.equal(logits2, state["logits"]):
        diff = (logits2 - state["logits"]).abs().max().item()
        raise AssertionError(f"logits differ after save/load (max abs diff {diff:.3g})")
    return "identical logits"
