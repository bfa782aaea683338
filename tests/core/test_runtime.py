"""The runtime against transformers on the tiny model: the same logits at prefill and decode, the
same greedy tokens with left padding, seeded sampling, the generate command."""

import re

import pytest
import torch

from compresskit.cli import main
from compresskit.errors import CompressKitError
from compresskit.modeling import load_model
from compresskit.runtime import Runtime
from compresskit.runtime.blocks import MLP, Attention, Block
from compresskit.runtime.llama import PREFILL_BUCKET, _pick, prefill_bucket


@pytest.fixture
def tiny(tiny_model_dir):
    return load_model(str(tiny_model_dir), dtype="float32", device="cpu")


def test_prefill_and_decode_logits_are_transformers(tiny):
    """The runtime's logits are transformers' (each block adding the residual of the one before it)."""
    model, _ = tiny
    rt = Runtime(model)
    ids = torch.randint(2, 300, (2, 9), generator=torch.Generator().manual_seed(0))
    cache = rt.new_cache(2, 12)
    with torch.no_grad():
        torch.testing.assert_close(rt.forward(ids, cache), model(ids).logits, rtol=1e-5, atol=1e-5)
        for _ in range(3):  # one token at a time from the cache
            nxt = torch.randint(2, 300, (2, 1))
            ids = torch.cat([ids, nxt], dim=1)
            torch.testing.assert_close(rt.forward(nxt, cache), model(ids).logits[:, -1:], rtol=1e-5, atol=1e-5)
    with pytest.raises(CompressKitError, match="13 tokens do not fit the cache of 12 slots"):
        rt.forward(torch.ones(2, 1, dtype=torch.long), cache)


class _Relay(Block):
    """A block that carries on how many relays ran right before it, around a dense one."""

    def __init__(self, inner: Block) -> None:
        super().__init__()
        self.inner, self.seen = inner, []

    def forward(self, x, delta, carry, step, *cache):
        self.seen.append(None if carry is None else int(carry))
        x, out, _ = self.inner(x, delta, None, step, *cache)
        return x, out, (torch.zeros((), dtype=torch.long) if carry is None else carry) + 1


class _RelayEvery:
    """An executor whose blocks all carry on, but the MLP of ``quiet_layer`` (None: the runtime's dense
    block, which carries nothing); or, with ``layers``, blocks for that many layers."""

    def __init__(self, quiet_layer: int, layers: int | None = None) -> None:
        self.quiet_layer, self.layers = quiet_layer, layers

    def runtime_blocks(self, model, head_dim):
        from compresskit.modeling import decoder_layers

        layers = decoder_layers(model)[: self.layers]
        return [
            (_Relay(Attention(layer, head_dim)), None if i == self.quiet_layer else _Relay(MLP(layer)))
            for i, layer in enumerate(layers)
        ]


def test_blocks_carry_on_to_the_block_after_them(tiny):
    """The one block contract (``Block``): a plugin's blocks, supplied for every layer at once, receive
    what the block before carried on (None first, and after the runtime's dense block, which carries
    nothing); the logits stay the dense model's. Blocks for another number of layers are one clear
    error."""
    model, _ = tiny
    rt = Runtime(model, executor=_RelayEvery(quiet_layer=0))
    order = [b for pair in rt.blocks for b in pair]
    assert len(order) >= 4 and isinstance(order[1], MLP) and not isinstance(order[1], _Relay)
    relays = [b for b in order if isinstance(b, _Relay)]
    ids = torch.randint(2, 300, (1, 5), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        got = rt.forward(ids, rt.new_cache(1, 6))
        torch.testing.assert_close(got, model(ids).logits, rtol=1e-5, atol=1e-5)
    want, run = [], 0  # each relay counts the relays right before it (None: the first, or after the quiet MLP)
    for block in order:
        if isinstance(block, _Relay):
            want.append(run or None)
        run = run + 1 if isinstance(block, _Relay) else 0
    assert [b.seen for b in relays] == [[w] for w in want] and want[:3] == [None, None, 1]
    with pytest.raises(CompressKitError, match="supplied blocks for 1 layers; the model has 2"):
        Runtime(model, executor=_RelayEvery(quiet_layer=0, layers=1))


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_projections_of_one_input_run_as_one_product(family, tmp_path):
    """q / k / v and gate / up are stacked by rows into one weight (and bias: Qwen2's q / k / v have
    them), their Parameters re-pointed at their rows: no second copy, the same logits as transformers,
    found stacked again by a second runtime, an in-place change seen, and the model saves and loads
    as before."""
    from compresskit.runtime.blocks import stacked_linear
    from compresskit.testing import tiny_llama

    model = tiny_llama(family=family)
    attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.inference_mode():  # as generation builds it: the weights stay trainable
        rt = Runtime(model)
    assert not attn.q_proj.weight.is_inference()
    weight, bias = rt.blocks[0][0].qkv
    assert weight.shape == (48 + 2 * 16, 48) and (bias is not None) == (family == "qwen2")
    for name, start in (("q_proj", 0), ("k_proj", 48), ("v_proj", 64)):
        proj = getattr(attn, name)
        assert proj.weight.data_ptr() == weight[start:].data_ptr()  # a view of its rows, not a copy
    assert mlp.gate_proj.weight.data_ptr() == rt.blocks[0][1].gate_up[0].data_ptr()
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    again = stacked_linear([attn.q_proj, attn.k_proj, attn.v_proj])
    assert again[0].data_ptr() == weight.data_ptr() and torch.equal(again[0], weight)
    ids = torch.randint(2, 300, (2, 7), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(rt.forward(ids, rt.new_cache(2, 7)), model(ids).logits, rtol=1e-5, atol=1e-5)
        attn.k_proj.weight.add_(0.5)  # in place, as a LoRA merge changes a weight
        assert torch.equal(weight[48:64], attn.k_proj.weight)
        torch.testing.assert_close(rt.forward(ids, rt.new_cache(2, 7)), model(ids).logits, rtol=1e-5, atol=1e-5)
    model.save_pretrained(tmp_path)
    reloaded = type(model).from_pretrained(tmp_path)
    assert all(torch.equal(v, reloaded.state_dict()[k]) for k, v in model.state_dict().items())
    lora = torch.nn.Sequential(attn.q_proj)  # not a plain Linear: left as it is
    assert stacked_linear([lora, attn.k_proj]) is None
    assert stacked_linear([attn.k_proj, torch.nn.Linear(48, 4, bias=family != "qwen2")]) is None


def test_greedy_generation_with_left_padding_is_transformers(tiny):
    model, _ = tiny
    rt = Runtime(model)
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(2, 300, (n,), generator=gen).tolist() for n in (7, 3, 5)]
    streamed = []
    res = rt.generate(prompts, max_new_tokens=5, on_token=lambda row, tok: streamed.append((row, tok)))
    for row, p in enumerate(prompts):
        with torch.no_grad():
            ref = model.generate(torch.tensor([p]), max_new_tokens=5, do_sample=False, pad_token_id=0)
        assert res.tokens[row] == ref[0, len(p) :].tolist()
    assert sorted(streamed) == sorted((r, t) for r, toks in enumerate(res.tokens) for t in toks)
    assert res.new_tokens == 15 and res.prefill_seconds > 0 and res.tokens_per_second > 0


def test_sampling_is_seeded_and_stops_at_eos(tiny):
    model, _ = tiny
    rt = Runtime(model)
    prompt = [[5, 6, 7, 8]]
    a = rt.generate(prompt, max_new_tokens=8, temperature=1.0, seed=3).tokens
    assert a == rt.generate(prompt, max_new_tokens=8, temperature=1.0, seed=3).tokens
    assert a != rt.generate(prompt, max_new_tokens=8, temperature=1.0, seed=4).tokens
    eos = a[0][2]
    stopped = rt.generate(prompt, max_new_tokens=8, temperature=1.0, seed=3, eos_token_id=eos).tokens[0]
    assert stopped == a[0][: a[0].index(eos) + 1]


@pytest.mark.parametrize("compiled", [False, True])
def test_time_decode_reruns_the_steps_of_a_generation_from_its_cache(tiny, compiled):
    """``time_decode`` rewinds the cache a generation of that shape used to the prompt's end and runs the
    same number of decode steps again: the cache's prompt slots keep their keys, the steps after them are
    written again (one slot a step past the first token, as generate's decode), and the time is positive."""
    model, _ = tiny
    rt = Runtime(model, compile=compiled)
    prompts = [[5, 6, 7, 8, 9], [9, 8, 7, 6, 5]]
    rt.generate(prompts, max_new_tokens=4)
    cache = rt._cache_for(2, 5 + 4)
    prompt_keys = cache.keys[0][:, :, :5].clone()
    cache.keys[0][:, :, 5:].fill_(float("nan"))
    seconds = rt.time_decode(2, 5, 4)
    assert seconds > 0 and cache.end >= 5 + 3
    assert torch.equal(cache.keys[0][:, :, :5], prompt_keys)
    assert not torch.isnan(cache.keys[0][:, :, 5:8]).any() and cache.valid[:, : cache.end].all()


def test_self_feeding_greedy_decode_gives_the_eager_tokens(tiny):
    """Compiled decode steps feed themselves (the token picked on the device, the host one step
    behind): the same tokens, streamed in order, as eager decoding, padded or not, stopping at EOS;
    when the caller stops, one more step has run than it read."""
    model, _ = tiny
    fast, eager = Runtime(model, compile=True), Runtime(model)
    assert fast.mode == "compiled"  # no CUDA graphs on the CPU, so no captured prefill either
    with pytest.raises(CompressKitError, match="prefill_graphs asked, but decode steps are not replayed"):
        Runtime(model, compile=True, prefill_graphs=True)
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(2, 300, (n,), generator=gen).tolist() for n in (6, 4)]
    streamed = []
    want = eager.generate(prompts, max_new_tokens=6).tokens
    assert eager.warm_up(2, 6, 6) == 0.0 and fast.warm_up(2, 6, 6) > 0.0  # compiles outside the clock
    got = fast.generate(prompts, max_new_tokens=6, on_token=lambda row, tok: streamed.append((row, tok)))
    assert got.tokens == want
    assert [t for r, t in streamed if r == 0] == want[0] and [t for r, t in streamed if r == 1] == want[1]
    eos = want[0][2]
    stopped = fast.generate(prompts[:1], max_new_tokens=6, eos_token_id=eos).tokens[0]
    assert stopped == want[0][: want[0].index(eos) + 1]
    cache = fast.new_cache(1, 12)
    logits = fast.forward(torch.tensor([prompts[0]]), cache)[:, -1]
    steps = fast.greedy_tokens(cache, logits.argmax(-1), 4)
    assert [next(steps), next(steps)] == [[want[0][0]], [want[0][1]]]
    steps.close()
    assert cache.end == len(prompts[0]) + 2  # the step after the last one read has run
    with pytest.raises(CompressKitError, match="needs compiled decode steps"):
        next(eager.greedy_tokens(cache, logits.argmax(-1), 2))
    # a bench over batches, lengths and models compiles a block class many times: none falls back to eager
    from compresskit.runtime.llama import RECOMPILE_LIMIT

    assert torch._dynamo.config.recompile_limit >= RECOMPILE_LIMIT


def test_top_p_keeps_the_smallest_set_reaching_the_mass():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    gen = torch.Generator().manual_seed(0)
    assert {int(_pick(logits, 1.0, 0.4, gen)) for _ in range(50)} == {0}
    assert {int(_pick(logits, 1.0, 0.7, gen)) for _ in range(200)} == {0, 1}
    assert int(_pick(logits, 0.0, 1.0, gen)) == 0


def test_unsupported_models_and_empty_prompts_are_refused(tiny):
    model, _ = tiny
    with pytest.raises(CompressKitError, match="every prompt needs at least one token"):
        Runtime(model).generate([[1], []])
    model.config.sliding_window = 8
    with pytest.raises(CompressKitError, match="sliding window of 8 tokens, which the runtime does not implement"):
        Runtime(model).generate([[1, 2, 3]], max_new_tokens=10)
    model.config.model_type = "gpt2"
    with pytest.raises(CompressKitError, match="model type 'gpt2' is not supported; supported: llama"):
        Runtime(model)


def test_generate_command_streams_text(capsys, tiny_model_dir):
    code = main(["generate", str(tiny_model_dir), "--prompt", "The cat", "--max-new-tokens", "4", "--dtype", "float32"])
    out, err = capsys.readouterr()
    assert code == 0 and out.startswith("The cat") and out.endswith("\n")  # the text ends its line
    assert "4 tokens in" in err and "tokens/s (compresskit runtime, eager, cpu)" in err
    code = main(["generate", str(tiny_model_dir), "--prompt", "x", "--max-new-tokens", "0"])
    assert code == 2 and "--max-new-tokens: 0; give 1 or more" in capsys.readouterr().err
    code = main(["generate", str(tiny_model_dir), "--prompt", "x", "--max-new-tokens", "100000"])
    assert code == 2 and "new ones exceed the model's" in capsys.readouterr().err


def test_bench_command_times_the_model_beside_its_dense_base(capsys, tiny_model_dir, tmp_path):
    import json

    out = tmp_path / "bench"
    argv = ["bench", str(tiny_model_dir), "--batch", "1,2", "--prompt", "8", "--new-tokens", "3", "--repeats", "1"]
    code = main([*argv, "--dtype", "float32", "--output", str(out)])
    printed, err = capsys.readouterr()
    assert code == 0, err
    data = json.loads((out / "bench.json").read_text())
    rows = data["results"]
    assert [(r["model"], r["batch"]) for r in rows] == [
        (m, b) for b in (1, 2) for m in ("compressed", "dense", "dense (transformers)")
    ]
    assert all(r["ttft_ms"] > 0 and r["tpot_ms"] > 0 for r in rows)
    assert all(r["tpot_speedup"] == 1.0 for r in rows if r["model"] == "dense")
    assert all(r["mode"] == "eager" for r in rows)  # on the CPU
    assert (out / "bench.png").stat().st_size > 10_000  # TTFT / TPOT speedup against batch size
    assert data["meta"]["command"].startswith("compresskit bench") and "TTFT x dense" in (out / "bench.md").read_text()
    assert "TTFT and TPOT" in printed
    # one whole generation a case, the other TPOT repeats from the prompt's cache
    argv = ["bench", str(tiny_model_dir), "--prompt", "8", "--new-tokens", "3", "--repeats", "3", "--ttft-repeats", "1"]
    assert main([*argv, "--dtype", "float32", "--transformers", "off", "--output", str(tmp_path / "once")]) == 0
    once = json.loads((tmp_path / "once" / "bench.json").read_text())
    assert once["meta"]["ttft_repeats"] == 1 and all(r["tpot_ms"] > 0 for r in once["results"])
    assert "TPOT medians of 3, TTFT of 1" in capsys.readouterr().out
    for bad, expect in (
        (["--batch", "0"], "--batch: '0': give integers of 1 or more"),
        (["--prompt", "a"], "--prompt: 'a' is not a comma-separated list of integers"),
        (["--prompt", "100000"], "--prompt 100000 + --new-tokens 32 exceed the model's"),
        (["--shape", "tiny"], "give a MODEL (a saved run, an HF directory or an alias) or --shape"),
        (["--compile", "on"], "CUDA graphs need a CUDA device"),
        (["--prefill-graphs", "on"], "--prefill-graphs on: needs CUDA graphs, so a GPU"),
        (["--prefill-graphs", "sometimes"], "--prefill-graphs: invalid choice"),
        (["--ttft-repeats", "4"], "--ttft-repeats 4: give 1 to --repeats (3)"),
        (["--ttft-repeats", "0"], "--ttft-repeats 0: give 1 to --repeats (3)"),
    ):
        code = main(["bench", str(tiny_model_dir), "--dtype", "float32", *bad])
        assert code == 2 and expect in capsys.readouterr().err
    if not torch.cuda.is_available():  # a GPU asked for where there is none: said, for a model and for a shape
        for target in ([str(tiny_model_dir)], ["--shape", "tiny"]):
            assert main(["bench", *target, "--device", "cuda"]) == 2
            assert "'cuda' was asked for but no CUDA device is available here" in capsys.readouterr().err


def test_bench_of_a_known_shape_has_the_ideal_half_width_row(capsys, tmp_path):
    """``--shape``: random weights of a known configuration; a routing pruner (``--method``, found through
    the plugin registry) with its untrained routers calibrated to the asked sparsity, the same weights
    dense, and the ideal half-width models (K/V heads kept, and halved too), on one runtime. A method that
    is no routing pruner, or no pruner, is one line and exit 2."""
    import json

    out = tmp_path / "bench"
    argv = ["bench", "--shape", "tiny", "--prompt", "24", "--new-tokens", "3", "--repeats", "1", "--sparsity", "0.25"]
    code = main([*argv, "--method", "toy-router", "--transformers", "off", "--output", str(out)])
    printed = capsys.readouterr()
    assert code == 0, printed.err
    assert "| model | decode | batch | prompt | TTFT ms | TPOT ms |" in printed.out and "…" not in printed.out
    assert "| ideal half-width, half K/V | eager | 1 | 24 |" in printed.out  # (Markdown off a terminal)
    data = json.loads((out / "bench.json").read_text())
    assert [r["model"] for r in data["results"]] == [
        "compressed", "dense", "ideal half-width", "ideal half-width, half K/V",
    ]  # fmt: skip
    assert 0.1 < data["results"][0]["sparsity_macs"] < 0.4  # a quarter of the groups, on tokens not calibrated on
    assert data["meta"]["methods"] == {"compressed": "toy-router"}
    assert data["results"][0]["method"] == "toy-router" and data["results"][0]["source"] == "--sparsity"
    code = main(["bench", "--shape", "llama-8b"])
    assert code == 2 and "Did you mean: llama-3.1-8b" in capsys.readouterr().err
    assert main(["bench", "--shape", "tiny", "--method", "toy-magnitude"]) == 2
    err = capsys.readouterr().err
    assert "--method toy-magnitude: it has no speed shape (Pruner.speed_shape)" in err
    assert "methods with one: dynamic-depth, static-depth, static-width, toy-router, wide" in err
    assert main(["bench", "--shape", "tiny", "--method", "toy-ruoter"]) == 2
    assert "error: --method: unknown pruner 'toy-ruoter'. Did you mean: toy-router" in capsys.readouterr().err


def test_bench_of_a_shape_too_large_for_the_memory_says_so_before_building_it(capsys, monkeypatch):
    """The weights ``--shape`` holds (one model at a time, the largest the dense one) are checked
    against the free memory first: one line naming what fits, exit 2, nothing allocated; so are the
    shape's positions against the prompt and new tokens."""
    import compresskit.bench as bench_mod

    monkeypatch.setattr(bench_mod, "available_bytes", lambda device: 8 * 2**30)
    monkeypatch.setattr(bench_mod, "shape_members", lambda *a, **k: pytest.fail("built a model that does not fit"))
    argv = ["bench", "--shape", "llama-3.1-8b", "--device", "cpu", "--transformers", "off"]
    assert main([*argv, "--dtype", "float32"]) == 2
    err = capsys.readouterr().err
    assert "--shape llama-3.1-8b: one model's weights take 29.92 GiB in float32 and this machine has 8.00 GiB" in err
    assert "free; give a smaller --shape (llama-3.2-1b, smollm2-135m, tiny)" in err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1
    monkeypatch.setattr(bench_mod, "available_bytes", lambda device: 30 * 2**30)
    assert main([*argv, "--dtype", "float32"]) == 2  # in bf16 it would fit: said first
    assert "30.00 GiB free; give --dtype bfloat16 or a smaller --shape" in capsys.readouterr().err
    assert main(["bench", "--shape", "smollm2-135m", "--prompt", "8190", "--new-tokens", "4"]) == 2
    assert "--prompt 8190 + --new-tokens 4 exceed the model's 8192 positions" in capsys.readouterr().err
    # one model on the device at a time: the largest, the dense model
    smol = bench_mod.shape_model("smollm2-135m", device="meta", dtype=torch.float32)
    assert bench_mod.shape_weight_bytes("smollm2-135m", torch.float32) == 4 * sum(p.numel() for p in smol.parameters())


def test_bench_skips_a_cell_that_cannot_fit_and_releases_each_runtime(capsys, tmp_path, monkeypatch):
    """A bench case whose estimate (KV cache and prefill activations) exceeds the free memory is one line
    naming it, and the other cases run; each member's caches and graphs are released after its case."""
    import json

    import compresskit.bench as bench_mod
    from compresskit.runtime import llama

    released = []
    monkeypatch.setattr(llama.Runtime, "release", lambda self: released.append(self))
    real = bench_mod.available_bytes
    monkeypatch.setattr(
        bench_mod, "available_bytes", lambda device: real(device) if device.type == "meta" else 2 * 2**30
    )
    config = bench_mod.shape_config("tiny")
    fits = bench_mod.cell_bytes(config, 2, 24, 3, torch.float32)
    assert fits["kv"] == 2 * 2 * 2 * 2 * 256 * 8 * 4 and fits["total"] < 2 * 2**30
    big = bench_mod.cell_bytes(config, 4096, 3000, 3, torch.float32)
    assert big["total"] > 2 * 2**30
    out = tmp_path / "bench"
    argv = ["bench", "--shape", "tiny", "--prompt", "24,300", "--batch", "2,20000", "--new-tokens", "3"]
    code = main([*argv, "--repeats", "1", "--method", "toy-router", "--transformers", "off", "--output", str(out)])
    err = capsys.readouterr().err
    assert code == 0, err
    data = json.loads((out / "bench.json").read_text())
    assert {(r["batch"], r["prompt"]) for r in data["results"]} == {(2, 24), (2, 300)}
    assert data["meta"]["device"].startswith("CPU (") and "()" not in data["meta"]["device"]  # always named
    skipped = [line for line in err.splitlines() if "skipped, it needs about" in line]
    assert len(skipped) == 2 and skipped[0].startswith("batch 20000 x prompt 24: skipped")
    assert "KV cache" in skipped[0] and "2.00 GiB is free" in skipped[0]
    assert len(released) == 2 * 4  # two cases of four runtime members
    # the estimate before it starts: one line, the cells that will be skipped named
    plan = [line for line in err.splitlines() if line.startswith("plan: ")]
    assert len(plan) == 1 and err.index(plan[0]) < err.index(skipped[0])
    assert plan[0].startswith("plan: 4 cell(s) (batch 2-20000 x prompt 24-300) x 4 member(s)")
    assert ": 2 fit (the largest, batch 2 x prompt 300:" in plan[0]
    assert "2 will be skipped: batch 20000 x prompt 24 (" in plan[0] and "batch 20000 x prompt 300 (" in plan[0]


def test_bench_plan_names_the_cells_the_h200_skipped():
    """The plan's estimate at Llama-3.1-8B shapes against the memory the H200 had free in the serving matrix
    (docs/serving.md): the three cells the bench skipped there, with the sizes it printed."""
    import compresskit.bench as bench_mod

    config = bench_mod.shape_config("llama-3.1-8b")
    free = int(122.89 * 2**30)
    line = bench_mod.plan_line(config, [1, 2, 4, 8, 16, 32, 64], [512, 2048, 8192, 16384], 32, torch.bfloat16, free, 3)
    assert line.startswith("plan: 28 cell(s) (batch 1-64 x prompt 512-16384) x 3 member(s)")
    assert ": 25 fit (the largest, batch 32 x prompt 8192: about 64.02 GiB)" in line
    assert line.endswith(
        "3 will be skipped: batch 32 x prompt 16384 (126.02 GiB), batch 64 x prompt 8192 (127.03 GiB), "
        "batch 64 x prompt 16384 (251.03 GiB)"
    )


def test_generator_from_the_python_api(tiny_model_dir):
    import compresskit

    gen = compresskit.generator(str(tiny_model_dir), dtype="float32", device="cpu")
    one = gen.generate("The cat", max_new_tokens=4)
    both = gen.generate(["The cat", "A dog sat"], max_new_tokens=4)
    assert isinstance(one, str) and isinstance(both, list) and len(both) == 2
    assert both[0] == one  # greedy: the same continuation alone or in a padded batch
    assert gen.pruner is None


@pytest.mark.slow
def test_apply_reports_speed_beside_quality(tiny_recipe, tmp_path):
    """``evaluation.speed``: on a CPU "auto" says not measured (and why); ``measure: true`` times the
    pruned model on the runtime against its dense base, and the report and comparison show both."""
    import copy

    from compresskit.api import apply
    from compresskit.report import compare_rows, results_markdown

    recipe = copy.deepcopy(tiny_recipe)
    recipe["evaluation"].update(tasks=["perplexity"], compare_dense=False)
    recipe["pruner"] = {"name": "toy-router", "config": {"groups": 6, "rank": 8}}
    res = apply(recipe).results
    assert res["speed"] == {"measured": False, "reason": res["speed"]["reason"]} and "no GPU" in res["speed"]["reason"]
    assert "Speed: not measured (no GPU" in results_markdown(res)
    header, rows = compare_rows([res])
    assert rows[0][header.index("TPOT x dense")] == "not measured"

    recipe["evaluation"]["speed"] = {"measure": True, "prompt": 16, "new_tokens": 3, "repeats": 1}
    recipe["output"] = {"dir": str(tmp_path / "timed")}
    res = apply(recipe).results
    speed = res["speed"]
    assert speed["measured"] and speed["mode"] == "eager" and speed["prompt"] == 16
    assert speed["ttft_ms"] > 0 and speed["dense_tpot_ms"] > 0 and 0.2 < speed["sparsity_macs"] < 0.8
    # (the times are stored to 3 decimals, the speedup from the unrounded ones: the ratio of the stored times
    # may differ by what that rounding allows)
    ratio = speed["dense_tpot_ms"] / speed["tpot_ms"]
    rounding = ratio * (0.0005 / speed["tpot_ms"] + 0.0005 / speed["dense_tpot_ms"]) + 0.0005
    assert abs(speed["tpot_speedup"] - ratio) <= rounding * 1.01
    assert res["sparsity"]["macs"] > 0  # the evaluator's own count, not mixed with the timed runs'
    assert "TPOT ms (eager)" in results_markdown(res)
    assert "eager_reason" not in speed and "It ran eagerly on the GPU" not in results_markdown(res)  # a CPU's way
    header, rows = compare_rows([res])
    assert rows[0][header.index("TPOT x dense")] == f"{speed['tpot_speedup']:.2f}x"
    lora = {**res, "speed": {**speed, "eager_reason": "layer 0 carries LoRA adapters that are not merged"}}
    assert "It ran eagerly on the GPU: layer 0 carries LoRA adapters that are not merged." in results_markdown(lora)


def test_speed_of_a_static_pruner_is_timed_against_the_reloaded_base(tiny_recipe):
    """A pruner that changes the weights cannot show its dense base: the base is loaded to be timed."""
    import copy

    from compresskit.api import apply

    recipe = copy.deepcopy(tiny_recipe)
    recipe["evaluation"].update(tasks=["perplexity"], compare_dense=False)
    recipe["evaluation"]["speed"] = {"measure": True, "prompt": 16, "new_tokens": 3, "repeats": 1}
    recipe["pruner"] = {"name": "static-width", "config": {"target_sparsity": 0.3, "ffn_group_size": 16}}
    speed = apply(recipe).results["speed"]
    assert speed["measured"] and speed["dense_ttft_ms"] > 0 and abs(speed["sparsity_macs"] - 0.3) < 0.05


def test_the_dense_base_is_timed_once_a_process(tiny_model_dir, monkeypatch):
    """A comparison times many runs of one base: the base's own timing is measured for the first and
    reused for the others with the same settings (new settings, or no base named, time it again)."""
    from compresskit import bench, plugins
    from compresskit.interfaces import RunContext
    from compresskit.recipe import SpeedSection

    cls = plugins.load("pruner", "toy-router")
    model, tok = load_model(str(tiny_model_dir), dtype="float32", device="cpu")
    pruner = cls(cls.Config(groups=6, rank=8))
    pruner.prepare(model, RunContext(model_config=model.config, tokenizer=tok, seed=0))
    model = pruner.finalize(model).eval()
    timed = []
    real = bench.time_runtime
    monkeypatch.setattr(bench, "time_runtime", lambda rt, *a: timed.append(rt.mode) or real(rt, *a))

    def speed(new_tokens=3, base=f"{tiny_model_dir}-dense-cache-test"):
        cfg = SpeedSection(measure=True, prompt=8, new_tokens=new_tokens, repeats=1)
        return bench.measure_speed(model, pruner, cfg, load_dense=None, base=base)

    first, second = speed(), speed()
    assert len(timed) == 3 and second["dense_tpot_ms"] == first["dense_tpot_ms"]  # model, dense; model
    speed(new_tokens=4)  # other settings: the base again
    speed(base=None)  # no base named: the base again
    assert len(timed) == 7


@pytest.mark.slow
def test_a_finished_run_is_retimed_not_rerun(tiny_recipe, tmp_path, capsys):
    """A run whose recipe changes in ``evaluation.speed`` alone (or whose speed could not be measured
    where it ran) keeps its training and quality numbers: ``apply`` and ``compare`` time its saved model
    again and rewrite its results, except that turning measurement off keeps what was measured at the
    same settings; any other change still needs a new output directory."""
    import copy
    import json

    from compresskit.api import apply
    from compresskit.errors import OutputExistsError

    recipe = copy.deepcopy(tiny_recipe)
    recipe["evaluation"].update(tasks=["perplexity"], compare_dense=False)
    recipe["pruner"] = {"name": "toy-router", "config": {"groups": 6, "rank": 8}}
    first = apply(recipe).results
    assert not first["speed"]["measured"]
    model_files = {p: p.stat().st_mtime_ns for p in (tmp_path / "run" / "model").iterdir()}

    recipe["evaluation"]["speed"] = {"measure": True, "prompt": 16, "new_tokens": 3, "repeats": 1}
    again = apply(recipe)
    assert again.reused and again.retimed
    assert again.results["speed"]["measured"] and again.results["speed"]["prompt"] == 16
    assert again.results["metrics"] == first["metrics"] and again.results["created"] == first["created"]
    on_disk = json.loads((tmp_path / "run" / "results.json").read_text())
    assert on_disk == again.results and on_disk["recipe_hash"] != first["recipe_hash"]
    assert "TPOT ms (eager)" in (tmp_path / "run" / "results.md").read_text()
    assert {p: p.stat().st_mtime_ns for p in (tmp_path / "run" / "model").iterdir()} == model_files
    current = apply(recipe)  # current now: nothing is timed again
    assert current.results == on_disk and not current.retimed

    recipe["evaluation"]["speed"]["new_tokens"] = 4  # compare retimes it too
    spec = tmp_path / "member.yaml"
    spec.write_text(json.dumps(recipe))
    assert main(["compare", str(spec), "--output", str(tmp_path / "cmp")]) == 0
    assert "reusing" in capsys.readouterr().err
    timed = json.loads((tmp_path / "run" / "results.json").read_text())
    assert timed["speed"]["new_tokens"] == 4 and timed["metrics"] == first["metrics"]

    recipe["evaluation"]["speed"]["measure"] = False  # nothing measured now: the numbers of these settings kept
    kept = apply(recipe)
    assert kept.reused and not kept.retimed and kept.results["speed"] == timed["speed"]
    assert json.loads((tmp_path / "run" / "results.json").read_text()) == timed  # the file untouched
    recipe["evaluation"]["speed"]["prompt"] = 8  # other settings that measure nothing: said so, no stale numbers
    assert apply(recipe).results["speed"] == {"measured": False, "reason": "evaluation.speed.measure is false"}

    recipe["evaluation"]["perplexity_docs"] = 2  # a quality setting: not the same run any more
    with pytest.raises(OutputExistsError, match="a run of a different recipe"):
        apply(recipe)


def test_runtime_reuses_its_caches_and_keeps_a_few(tiny_model_dir):
    from compresskit.runtime.llama import KEPT_CACHES

    model, _ = load_model(str(tiny_model_dir), dtype="float32", device="cpu")
    rt = Runtime(model)
    first = rt.generate([[5, 6, 7]], max_new_tokens=2)
    cache = rt._caches[(1, 5)]
    again = rt.generate([[5, 6, 7]], max_new_tokens=2)
    assert rt._caches[(1, 5)] is cache and again.tokens == first.tokens  # reset, reused, same result
    for n in range(KEPT_CACHES + 2):
        rt.generate([[5] * (n + 1)], max_new_tokens=2)
    assert len(rt._caches) == KEPT_CACHES and (1, KEPT_CACHES + 3) in rt._caches


def test_profile_script_runs_its_smoke_path(tmp_path):
    """``benchmarks/profile_runtime.py --smoke``: every member profiled, time summed by kind (CPU time
    here; the GPU run sums kernels)."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[2] / "benchmarks" / "profile_runtime.py"
    res = subprocess.run(
        [sys.executable, str(script), "--smoke", "--out", str(tmp_path)], capture_output=True, text=True
    )
    assert res.returncode == 0, res.stderr[-2000:]
    members = json.loads((tmp_path / "profile.json").read_text())["members"]
    assert list(members) == [
        f"{m} {p}"
        for m in ("compressed", "dense", "ideal half-width", "ideal half-width, half K/V")
        for p in ("decode", "prefill")
    ]
    assert all(m["total_us_per_step"] > 0 and m["top_kernels"] and m["wall_us_per_step"] > 0 for m in members.values())
    assert all(bool(m["python_top_by_own_time"]) == k.endswith("prefill") for k, m in members.items())
    # the ops (a GPU: kernels) a step launches, counted: the routed model's routers launch more than dense
    for phase in ("decode", "prefill"):
        assert members[f"compressed {phase}"]["launches_per_step"] > members[f"dense {phase}"]["launches_per_step"] > 0


def test_bench_times_transformers_with_a_static_cache_too(capsys, tiny_model_dir, tmp_path):
    import json

    out = tmp_path / "bench"
    argv = ["bench", str(tiny_model_dir), "--prompt", "8", "--new-tokens", "3", "--repeats", "1", "--dtype", "float32"]
    assert main([*argv, "--transformers", "static", "--output", str(out)]) == 0, capsys.readouterr().err
    rows = json.loads((out / "bench.json").read_text())["results"]
    assert [(r["model"], r["mode"]) for r in rows][-1] == ("dense (transformers, static cache)", "static cache, eager")
    assert rows[-1]["tpot_ms"] > 0


def test_decode_attention_bench_checks_every_form_on_the_cpu():
    """``bench_decode_attention.py --smoke``: each way of writing decode attention matches fp32 SDPA."""
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_decode_attention.py"
    res = subprocess.run([sys.executable, str(script), "--smoke"], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "every variant matches SDPA" in res.stdout


def test_before_after_script_pairs_the_rows_of_two_bench_runs(tmp_path):
    """``before_after.py``: each row of the later run beside the same (model, batch, prompt) row of the
    earlier one of the same case (two cases with the same rows stay apart), with after / before times; rows one
    side lacks are left out; no common row is an error, as are unequal counts of folders."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    def bench_dir(name, tpot):
        rows = [
            {"model": m, "batch": 1, "prompt": 1024, "ttft_ms": 20.0, "tpot_ms": t, "ttft_speedup": 1.0,
             "tpot_speedup": round(4.0 / t, 3)}
            for m, t in (("compressed", tpot), ("dense", 4.0))
        ]  # fmt: skip
        folder = tmp_path / name
        folder.mkdir()
        (folder / "bench.json").write_text(json.dumps({"meta": {"commit": name}, "results": rows}))
        return str(folder)

    script = Path(__file__).parents[2] / "benchmarks" / "before_after.py"
    out = tmp_path / "out"
    args = ["--before", bench_dir("b", 3.0), bench_dir("b2", 2.0), "--after", bench_dir("a", 3.3),
            bench_dir("a2", 1.0), "--out", str(out)]  # fmt: skip
    proc = subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    rows = json.loads((out / "before_after.json").read_text())["rows"]
    got = [(r["case"], r["model"], r["tpot_after_over_before"]) for r in rows]
    assert got == [(1, "compressed", 1.1), (1, "dense", 1.0), (2, "compressed", 0.5), (2, "dense", 1.0)]
    assert (
        "| 1 | compressed | 1 | 1024 | 20.00 / 20.00 | 1.000 | 3.000 / 3.300 | 1.100 |"
        in (out / "before_after.md").read_text()
    )
    fewer = [*args[:5], *args[6:]]  # the second case's after missing
    proc = subprocess.run([sys.executable, str(script), *fewer], capture_output=True, text=True)
    assert proc.returncode == 2 and "2 --before folders and 1 --after" in proc.stderr
    other = tmp_path / "other"
    other.mkdir()
    (other / "bench.json").write_text(json.dumps({"meta": {}, "results": []}))
    proc = subprocess.run([sys.executable, str(script), "--before", str(other), "--after", args[4], "--out", str(out)])
    assert proc.returncode == 1


def test_bench_matrix_names_its_worst_cell_and_draws_a_heat_map(tmp_path, capsys):
    """Over several batch sizes and prompts the bench writes each model's TPOT x dense as a batch x prompt
    table naming its worst and best cells (a cell that did not run says so), and a heat map of them."""
    from compresskit.bench import matrix_markdown

    records = [
        {"model": m, "batch": b, "prompt": p, "tpot_speedup": s}
        for m, b, p, s in [
            ("dense", 1, 512, 1.0), ("wide", 1, 512, 1.45), ("wide", 1, 2048, 1.30), ("wide", 8, 512, 1.01),
            ("dense", 8, 512, 1.0), ("dense", 1, 2048, 1.0),
        ]
    ]  # fmt: skip
    md = matrix_markdown(records)
    assert "## wide: TPOT x dense, batch x prompt" in md and "dense:" not in md
    assert "| 1 | 1.45x | 1.30x |" in md and "| 8 | 1.01x | skipped |" in md
    assert "Worst cell: batch 8 x prompt 512, 1.01x; best: batch 1 x prompt 512, 1.45x." in md
    assert matrix_markdown(records[:2]) == ""  # one case: the main table says it all
    out = tmp_path / "bench"
    argv = ["bench", "--shape", "tiny", "--batch", "1,2", "--prompt", "8,12", "--new-tokens", "2", "--repeats", "1"]
    assert main([*argv, "--transformers", "off", "--bounds", "off", "--output", str(out)]) == 0
    assert "Worst cell: batch" in (out / "bench.md").read_text()
    assert (out / "bench-heatmap.png").stat().st_size > 5_000


def test_heat_map_colours_are_even_in_ratio_about_one():
    """A cell just under 1.00x is not drawn as deep a red as a loss by half: the range reaches as far
    below 1.00x (in ratio) as the largest ratio either side."""
    from compresskit.plot import speedup_range

    assert speedup_range([0.975, 1.25, 1.83]) == pytest.approx((1 / 1.83, 1.83))
    assert speedup_range([0.5, 1.2]) == pytest.approx((0.5, 2.0))
    assert speedup_range([1.0]) == pytest.approx((1 / 1.01, 1.01))


def test_bench_times_several_sparsities_beside_one_dense_model(tmp_path, capsys):
    """``--sparsity 0.25,0.5``: a compressed row per fraction (named after it), each calibrated to it, one dense
    row; bench.md has the prompt x sparsity tables of TTFT and TPOT x dense at each batch, worst cell named. A
    fraction out of range, a repeated one or a word is one line and exit 2."""
    import json

    from compresskit.bench import model_matrix_markdown

    out = tmp_path / "bench"
    argv = ["bench", "--shape", "tiny", "--prompt", "16,24", "--new-tokens", "2", "--repeats", "1"]
    code = main([*argv, "--sparsity", "0.25,0.5", "--method", "toy-router", "--transformers", "off",
                 "--bounds", "off", "--output", str(out)])  # fmt: skip
    assert code == 0, capsys.readouterr().err
    data = json.loads((out / "bench.json").read_text())
    rows = {(r["model"], r["prompt"]): r for r in data["results"]}
    assert {m for m, _ in rows} == {"compressed (0.25)", "compressed (0.5)", "dense"}
    assert rows["compressed (0.25)", 16]["sparsity_macs"] < rows["compressed (0.5)", 16]["sparsity_macs"]
    assert data["meta"]["methods"] == {"compressed (0.25)": "toy-router", "compressed (0.5)": "toy-router"}
    md = (out / "bench.md").read_text()
    assert "## TTFT x dense at batch 1, model x prompt" in md and "## TPOT x dense at batch 1, model x prompt" in md
    assert "| model | 16 | 24 |" in md and "| compressed (0.25) | " in md and "Worst cell: compressed" in md
    records = [
        {"model": m, "batch": 1, "prompt": p, "ttft_speedup": v}
        for m, p, v in [("dense", 512, 1.0), ("a (0.25)", 512, 1.03), ("a (0.25)", 1024, 1.1), ("a (0.5)", 512, 1.2)]
    ]
    md = model_matrix_markdown(records)
    assert "| a (0.25) | 1.03x | 1.10x |" in md and "| a (0.5) | 1.20x | skipped |" in md
    assert "Worst cell: a (0.25) at prompt 512, 1.03x." in md
    assert model_matrix_markdown(records[:3]) == ""  # one model: its batch x prompt matrix says it all
    for bad, expect in (
        ("0.25,1.5", "--sparsity: '0.25,1.5'; give fractions in [0, 1), e.g. 0.25,0.5"),
        ("0.5,0.5", "--sparsity: '0.5,0.5' names a fraction twice"),
        ("half", "--sparsity: 'half' is not a comma-separated list of fractions"),
    ):
        assert main([*argv, "--sparsity", bad]) == 2
        err = capsys.readouterr().err
        assert expect in err and "Traceback" not in err and err.count("error:") == 1


@pytest.mark.slow
def test_merge_bench_puts_several_runs_in_one_matrix(tmp_path):
    """``merge_bench.py``: the records of several bench runs (and of an earlier merge) in one matrix, a cell
    no input has marked not measured, every input's facts kept; a cell two inputs both have is refused."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    def bench_dir(name, batch, prompt, speedup):
        rows = [
            {"model": m, "batch": batch, "prompt": prompt, "ttft_ms": 9.0, "tpot_ms": 3.0, "ttft_speedup": s,
             "tpot_speedup": s}
            for m, s in (("wide", speedup), ("dense", 1.0))
        ]  # fmt: skip
        meta = {"model": "--shape x", "device": "GPU", "dtype": "bfloat16", "torch": "2", "transformers": "5",
                "triton": "3", "date": name, "command": f"compresskit bench {name}"}  # fmt: skip
        folder = tmp_path / name
        folder.mkdir()
        (folder / "bench.json").write_text(json.dumps({"meta": meta, "results": rows}))
        return str(folder)

    script = Path(__file__).parents[2] / "benchmarks" / "merge_bench.py"

    def merge(out, *inputs):
        return subprocess.run(
            [sys.executable, str(script), str(tmp_path / out), *inputs], capture_output=True, text=True
        )

    assert merge("m1", bench_dir("a", 8, 2048, 1.07), bench_dir("b", 32, 2048, 0.97)).returncode == 0
    proc = merge("m2", str(tmp_path / "m1"), bench_dir("c", 16, 8192, 1.27))
    assert proc.returncode == 0, proc.stderr
    md = (tmp_path / "m2" / "bench.md").read_text()
    assert "| 8 | 1.07x | - |" in md and "| 16 | - | 1.27x |" in md and "| 32 | 0.97x | - |" in md
    assert "Worst cell: batch 32 x prompt 2048, 0.97x; best: batch 16 x prompt 8192, 1.27x." in md
    merged = json.loads((tmp_path / "m2" / "bench.json").read_text())
    assert [p["command"] for p in merged["meta"]["parts"]] == [f"compresskit bench {n}" for n in "abc"]
    assert (tmp_path / "m2" / "bench-heatmap.png").is_file()
    proc = merge("m3", str(tmp_path / "a"), str(tmp_path / "m1"))
    assert proc.returncode == 2 and "more than one input" in proc.stderr
    # two compressed rows (two sparsities, one process a prompt): merged into a model x prompt table a batch
    one = bench_dir("d", 1, 512, 1.1)
    two = tmp_path / "e"
    two.mkdir()
    rows = json.loads((tmp_path / "d" / "bench.json").read_text())
    for r in rows["results"]:
        r.update(prompt=4096, model="wide (0.25)" if r["model"] == "wide" else r["model"], ttft_speedup=1.02)
    (two / "bench.json").write_text(json.dumps(rows))
    assert merge("m4", one, str(two)).returncode == 0
    md = (tmp_path / "m4" / "bench.md").read_text()
    assert "## TTFT x dense at batch 1, model x prompt" in md
    assert "| wide | 1.10x | - |" in md and "| wide (0.25) | - | 1.02x |" in md


def test_profile_script_counts_every_wide_kernel_by_its_role():
    """The profile's kinds: each of compresskit_wide's Triton kernels is routing, a routed product (the
    persistent one too, whose name says gemm) or attention, never cuBLAS's; inductor's fused kernels are
    elementwise, whatever op names they carry."""
    import importlib.util
    from pathlib import Path

    script = Path(__file__).resolve().parents[2] / "benchmarks" / "profile_runtime.py"
    spec = importlib.util.spec_from_file_location("profile_runtime", script)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    wide = Path(__file__).resolve().parents[2] / "plugins" / "wide" / "compresskit_wide" / "kernels"
    names = {m for f in wide.glob("*.py") for m in re.findall(r"def (triton_\w+_kernel)\(", f.read_text())}
    assert "triton_persistent_out_gemm_kernel" in names and len(names) >= 10
    roles = {n: mod.kind(n) for n in names}
    assert set(roles.values()) == {"routing (WIDE)", "routed products (WIDE)", "attention"}
    assert (
        roles["triton_persistent_out_gemm_kernel"]
        == roles["triton_masked_reduce_gemm_kernel"]
        == ("routed products (WIDE)")
    )
    assert roles["triton_router_partial_kernel"] == roles["triton_routing_layout_kernel"] == "routing (WIDE)"
    assert roles["triton_attn_prefill_kernel"] == "attention"
    assert mod.kind("triton_red_fused__to_copy_add_masked_out_gemm_mean_mul_pow_rsqrt_view_0").startswith("fused")
    assert mod.kind("triton_poi_fused_add_cat_mul_neg_routed_attention_prefill_slice_view_2").startswith("fused")
    assert mod.kind("nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_TNT") == "products (cuBLAS/CUTLASS)"


@pytest.mark.slow
def test_profile_script_profiles_several_contexts_on_one_build(tmp_path):
    """``profile_runtime.py --context 128,512``: a row per member, phase and context (the smoke's shapes
    stand in for the lengths)."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[2] / "benchmarks" / "profile_runtime.py"
    argv = [sys.executable, str(script), "--smoke", "--phase", "prefill", "--context", "128,512", "--members", "dense"]
    res = subprocess.run([*argv, "--out", str(tmp_path)], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr[-2000:]
    data = json.loads((tmp_path / "profile.json").read_text())
    assert list(data["members"]) == ["dense prefill @16", "dense prefill @24"]
    bad = subprocess.run([*argv[:-4], "--context", "128,x"], capture_output=True, text=True)
    assert bad.returncode == 2 and "--context: '128,x' is not a comma-separated list" in bad.stderr


@pytest.mark.slow
def test_profile_script_profiles_a_consensus_rule(tmp_path):
    """``profile_runtime.py --option consensus.KEY=VALUE``: WIDE under the rule is a member of its own, named as
    the bench names its row (a name with commas, which ``--members`` takes whole); a name that is no member, or a bad
    rule, is one line and exit 2."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[2] / "benchmarks" / "profile_runtime.py"
    rule = "consensus (quorum 0.5, budget 0.5)"
    argv = [sys.executable, str(script), "--smoke", "--phase", "decode", "--batch", "2"]
    res = subprocess.run(
        [
            *argv,
            "--option",
            "consensus.quorum=0.5,consensus.budget=0.5",
            "--members",
            f"{rule},dense",
            "--out",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
    )
    assert res.returncode == 0, res.stderr[-2000:]
    members = json.loads((tmp_path / "profile.json").read_text())["members"]
    assert list(members) == [f"{rule} decode", "dense decode"]
    assert members[f"{rule} decode"]["total_us_per_step"] > 0
    bad = subprocess.run([*argv, "--members", "dense,nope"], capture_output=True, text=True)
    assert bad.returncode == 2 and "--members 'dense,nope': allowed names are 'compressed'" in bad.stderr
    bad = subprocess.run([*argv, "--option", "consensus.budget=2"], capture_output=True, text=True)
    assert bad.returncode == 2 and "--option consensus.budget=2: executor wide-triton: consensus.budget" in bad.stderr


def test_a_prompt_is_captured_in_a_bucket_at_most_twice_its_length():
    """``prefill_bucket``: a prompt of up to half ``PREFILL_BUCKET`` tokens runs the next power of two of rows (at
    least 16), longer ones the next multiple of ``PREFILL_BUCKET``; every bucket holds its prompt."""
    assert [prefill_bucket(t) for t in (1, 16, 17, 100, 128, 129, 256, 257, 1000, 1024)] == [
        16, 16, 32, 128, 128, 256, 256, 512, 1024, 1024,
    ]  # fmt: skip
    for t in range(1, 3 * PREFILL_BUCKET):
        bucket = prefill_bucket(t)
        assert t <= bucket and (bucket < 2 * t or bucket == 16 if t <= PREFILL_BUCKET // 2 else bucket - t < 256)
