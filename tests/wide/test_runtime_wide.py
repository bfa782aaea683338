"""WIDE on the runtime: the routed modules as they are (the masked dense reference), and WIDE's own
blocks (routers and masked ops as registered operators, decisions as tensors) against them: the same logits at
prefill and decode, padded or not, the same counts, compiled against eager, and on a GPU CUDA-graph
replays against eager."""

import re
from pathlib import Path

import pytest
import torch

from compresskit import plugins
from compresskit.interfaces import RunContext
from compresskit.modeling import load_model
from compresskit.routing import routed_projections
from compresskit.runtime import Runtime
from compresskit.testing import ModulesExecutor


def test_wide_model_on_the_runtime_gives_its_own_logits(tiny_model_dir):
    model, tok = load_model(str(tiny_model_dir), dtype="float32", device="cpu")
    cls = plugins.load("pruner", "wide")
    pruner = cls(cls.Config(ffn_group_size=16, router_rank=8))
    pruner.prepare(model, RunContext(model_config=model.config, tokenizer=tok, seed=0))
    model = pruner.finalize(model).eval()
    ids = torch.randint(2, 300, (2, 10), generator=torch.Generator().manual_seed(0))
    rt = Runtime(model, executor=ModulesExecutor())
    cache = rt.new_cache(2, 11)
    nxt = torch.full((2, 1), 9)
    with torch.no_grad():
        torch.testing.assert_close(rt.forward(ids, cache), model(ids).logits, rtol=1e-5, atol=1e-5)
        full = model(torch.cat([ids, nxt], dim=1)).logits[:, -1:]
        torch.testing.assert_close(rt.forward(nxt, cache), full, rtol=1e-5, atol=1e-5)
    # left padding: the padded slots are not counted as routed tokens
    pruner.reset_sparsity(model)
    res = rt.generate([[5, 6, 7, 8, 9], [5, 6]], max_new_tokens=3)
    deciders = [p for _, p in routed_projections(model) if p.router is not None]
    assert all(p.stat_tokens.item() == 5 + 2 + 2 * 2 for p in deciders)  # the prompts' 7, then 2 decode steps of 2
    assert [len(t) for t in res.tokens] == [3, 3]


def test_the_runtime_runs_routed_modules_only_as_a_method_s_blocks(tiny_model_dir):
    """A routed model on the runtime's own blocks (no executor that gives it blocks): one line saying why the
    runtime cannot, never an eager run of its modules; its dense view runs as the base model."""
    from compresskit.errors import RuntimeUnsupportedError

    model, pruner = _wide_model(tiny_model_dir)
    with pytest.raises(RuntimeUnsupportedError, match=r"runtime: layer 0 is routed and its pruner gives no runtime"):
        Runtime(model)
    Runtime(model, dense=True)


def test_bench_of_a_saved_wide_run_reports_its_realised_sparsity(capsys, tiny_model_dir, tmp_path):
    import json

    from compresskit.api import apply
    from compresskit.cli import main

    run = tmp_path / "run"
    recipe = {
        "model": {"name_or_path": str(tiny_model_dir), "dtype": "float32", "device": "cpu"},
        "pruner": {"name": "wide", "config": {"ffn_group_size": 16, "router_rank": 8}},
        "evaluation": {"tasks": ["piqa"], "limit": 2, "batch_size": 2, "max_length": 512, "compare_dense": False},
        "output": {"dir": str(run)},
    }
    apply(recipe)
    argv = ["bench", str(run / "model"), "--prompt", "8", "--new-tokens", "3", "--repeats", "1", "--dtype", "float32"]
    code = main([*argv, "--output", str(tmp_path / "b")])
    assert code == 0, capsys.readouterr().err
    rows = json.loads((tmp_path / "b" / "bench.json").read_text())["results"]
    assert [r["model"] for r in rows] == ["compressed", "dense", "dense (transformers)"]
    assert 0.2 < rows[0]["sparsity_macs"] < 0.8 and rows[1]["sparsity_macs"] is None  # untrained routers: about half


def _wide_model(tiny_model_dir, ffn_group_size=16):
    model, tok = load_model(str(tiny_model_dir), dtype="float32", device="cpu")
    cls = plugins.load("pruner", "wide")
    pruner = cls(cls.Config(ffn_group_size=ffn_group_size, router_rank=8))
    pruner.prepare(model, RunContext(model_config=model.config, tokenizer=tok, seed=0))
    return pruner.finalize(model).eval(), pruner


@pytest.mark.parametrize(("method", "blocks"), [(None, "WideMLP"), ("dynamic-depth", "SkipMLP")])
def test_bench_of_a_known_shape_with_a_routing_plugin(capsys, tmp_path, method, blocks, monkeypatch):
    """``compresskit bench --shape``: WIDE by default, or any routing pruner by ``--method`` (dynamic
    depth here), each on its own runtime blocks, with the realised sparsity those blocks counted."""
    import json

    from compresskit.cli import main
    from compresskit.runtime import llama

    built = []
    real_init = llama.Runtime.__init__

    def recording(self, *args, **kwargs):
        real_init(self, *args, **kwargs)
        built.append({type(b).__name__ for pair in self.blocks for b in pair})

    monkeypatch.setattr(llama.Runtime, "__init__", recording)
    out = tmp_path / "bench"
    argv = ["bench", "--shape", "tiny", "--prompt", "24", "--new-tokens", "3", "--repeats", "1", "--sparsity", "0.25"]
    argv += ["--method", method] if method else []
    assert main([*argv, "--transformers", "off", "--output", str(out)]) == 0, capsys.readouterr().err
    data = json.loads((out / "bench.json").read_text())
    assert data["meta"]["methods"] == {"compressed": method or "wide"} and blocks in built[0]  # the compressed member
    assert 0.0 < data["results"][0]["sparsity_macs"] < 0.5


def test_wide_blocks_match_the_routed_modules_at_prefill_and_decode(tiny_model_dir, monkeypatch):
    """WIDE's runtime blocks (routers, masked products and routed attention as registered operators, decisions
    as tensors) give the logits of the model's own routed modules, with padding and without: q, k and v
    are one routed product, each block adds the residual itself, every router but the first decides
    from the shares the block before it handed on, the first from the shares its own first launch wrote
    (``router_shares``), and that decision's operator adds the residual, applies the norm and runs the
    block's first product too (up to 16 tokens: every forward here)."""
    from compresskit_wide import blocks
    from compresskit_wide.blocks import WideAttention, WideMLP

    own, from_shares, with_norm, with_product = [], [], [], []
    for name, seen in (
        ("router_shares", own),
        ("router_decide_from_shares", from_shares),
        ("router_norm_from_shares", with_norm),
        ("router_norm_out_gemm", with_product),
    ):
        real = getattr(blocks, name)
        monkeypatch.setattr(blocks, name, lambda *a, real=real, seen=seen, **k: seen.append(1) or real(*a, **k))
    model, pruner = _wide_model(tiny_model_dir)
    cls = plugins.load("executor", "wide-triton")
    # the references of every operator (under auto the CPU hands nothing on: see the test after this one)
    fast = Runtime(model, executor=cls(cls.Config(backend="torch")))
    assert all(isinstance(a, WideAttention) and isinstance(m, WideMLP) for a, m in fast.blocks)
    assert all(a.wqkv is not None for a, _ in fast.blocks)
    order = [blk for pair in fast.blocks for blk in pair]
    handing = [blk.next_router_down for blk in order]
    want_handing = [after.router_down for after in order[1:]] + [None]
    assert all(a is b for a, b in zip(handing, want_handing, strict=True))
    assert fast.mode == "eager"  # on the CPU
    ref = Runtime(model, executor=ModulesExecutor())  # the routed modules as they are
    gen = torch.Generator().manual_seed(1)
    for prompts in ([[5, 6, 7, 8, 9, 10, 11]], [[5, 6, 7, 8, 9], [5, 6]]):
        b, longest = len(prompts), max(map(len, prompts))
        caches = [rt.new_cache(b, longest + 3) for rt in (fast, ref)]
        ids = torch.zeros(b, longest, dtype=torch.long)
        real = torch.zeros(b, longest, dtype=torch.bool)
        for row, p in enumerate(prompts):
            ids[row, longest - len(p) :] = torch.tensor(p)
            real[row, longest - len(p) :] = True
            for c in caches:
                c.pad[row] = longest - len(p)
        for c in caches:
            c.padded = b > 1
        valid = real if b > 1 else None
        got, want = (rt.forward(ids, c, new_valid=valid) for rt, c in zip((fast, ref), caches, strict=True))
        torch.testing.assert_close(got[real], want[real], rtol=1e-5, atol=1e-5)
        for _ in range(3):
            token = torch.randint(2, 300, (b,), generator=gen)
            got, want = (rt.decode(token, c) for rt, c in zip((fast, ref), caches, strict=True))
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # each forward (two prompts, six steps) decides every router from shares (the first block's its own), with
    # the norm and the first product in that operator (the runtime hands the blocks the residual's delta)
    assert len(own) == 8 and len(with_product) == 8 * len(order) and not from_shares and not with_norm


def test_on_the_cpu_auto_runs_the_cheapest_path(tiny_model_dir, monkeypatch):
    """Under ``auto`` on the CPU the blocks hand no shares on (the references would compute them on top of the
    products) and attend with the runtime's attention (the routed attention's reference is slower): what makes
    ``compresskit generate`` on the CPU as fast as transformers' generate for a WIDE model."""
    from compresskit.runtime import runtime_for
    from compresskit_wide import blocks

    called = []
    for name in ("router_norm_from_shares", "router_decide_from_shares", "routed_attention_decode"):
        real = getattr(blocks, name)
        monkeypatch.setattr(blocks, name, lambda *a, real=real, name=name, **k: called.append(name) or real(*a, **k))
    model, pruner = _wide_model(tiny_model_dir)
    fast = runtime_for(model, pruner)
    assert (
        fast.generate([[5, 6, 7, 8]], max_new_tokens=3).tokens
        == Runtime(model, executor=ModulesExecutor()).generate([[5, 6, 7, 8]], max_new_tokens=3).tokens
    )
    assert not called


@pytest.mark.parametrize("family", ["qwen2", "mistral"])
def test_routed_qkv_in_other_families(tmp_path, family):
    """Qwen2's q / k / v carry biases, so its blocks keep q and the k / v product
    apart; Mistral's have none, so one routed product serves. Both give the routed modules' logits at
    a prompt and at decode."""
    from compresskit.runtime import runtime_for
    from compresskit.testing import save_tiny_model

    model_dir = save_tiny_model(tmp_path / family, family=family)
    model, pruner = _wide_model(model_dir)
    fast, ref = runtime_for(model, pruner), Runtime(model, executor=ModulesExecutor())
    assert all((a.wqkv is None) == (family == "qwen2") for a, _ in fast.blocks)
    caches = [rt.new_cache(2, 10) for rt in (fast, ref)]
    ids = torch.randint(2, 300, (2, 6), generator=torch.Generator().manual_seed(3))
    got, want = (rt.forward(ids, c) for rt, c in zip((fast, ref), caches, strict=True))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    for token in ([7, 8], [9, 10]):
        got, want = (rt.decode(torch.tensor(token), c) for rt, c in zip((fast, ref), caches, strict=True))
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_routed_qkv_runs_q_alone_where_its_prefill_kernel_runs(tiny_model_dir, monkeypatch):
    """q, k and v are one routed product at decode and at prefill while q runs
    dense; where ``auto`` takes q's prefill kernel (here made to from 8 tokens) q runs alone and k, v
    in their own product. Both ways give the routed modules' logits."""
    from compresskit.runtime import runtime_for
    from compresskit_wide import blocks
    from compresskit_wide.kernels import ops, policy

    real_use_kernel = policy.use_kernel
    monkeypatch.setattr(policy, "decode_kernel", lambda m, shared: m <= 2)
    monkeypatch.setattr(
        policy, "use_kernel", lambda op, m, **kw: m >= 8 if op == "out" else real_use_kernel(op, m, **kw)
    )
    model, pruner = _wide_model(tiny_model_dir)
    fast, ref = runtime_for(model, pruner), Runtime(model, executor=ModulesExecutor())
    attn = fast.blocks[0][0]
    assert attn.wqkv is not None
    one = [ops.qkv_in_one_product("auto", m, False) for m in (1, 2, 3, 7, 8, 4096)]
    assert one == [True, True, True, True, False, False]
    # a forced backend runs q's kernel at every prefill
    assert [ops.qkv_in_one_product("triton", m, False) for m in (2, 3)] == [True, False]
    widths = []  # the output width of each masked_out_gemm of the first attention block
    real_gemm = blocks.masked_out_gemm

    def recording(x, w, *args, **kw):
        if w is attn.wqkv or w is attn.wq:
            widths.append(w.shape[0])
        return real_gemm(x, w, *args, **kw)

    monkeypatch.setattr(blocks, "masked_out_gemm", recording)
    q_rows, qkv_rows = attn.wq.shape[0], attn.wqkv.shape[0]
    for prompt, expected in (([5, 6, 7, 8, 9, 10, 11, 12, 13], q_rows), ([5, 6, 7], qkv_rows)):
        widths.clear()
        caches = [rt.new_cache(1, len(prompt) + 2) for rt in (fast, ref)]
        ids = torch.tensor([prompt])
        got, want = (rt.forward(ids, c) for rt, c in zip((fast, ref), caches, strict=True))
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        got, want = (rt.decode(torch.tensor([4]), c) for rt, c in zip((fast, ref), caches, strict=True))
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        assert widths == [expected, qkv_rows]  # the prompt's product, then the decode step's


def test_a_prefills_o_gets_its_skipped_heads_zeroed_in_the_block(tiny_model_dir, monkeypatch):
    """Past the decode kernels' sizes, after the runtime's attention, the block zeroes the skipped heads itself
    (in its compiled graph on a GPU) and tells o's reduction so, whose fallback is then the plain product; at
    decode o gets the attention's output as it is. The logits stay the routed modules'."""
    from compresskit.runtime import runtime_for
    from compresskit_wide import blocks
    from compresskit_wide.kernels.policy import DECODE_MAX_M

    model, pruner = _wide_model(tiny_model_dir)
    fast, ref = runtime_for(model, pruner), Runtime(model, executor=ModulesExecutor())
    attn = fast.blocks[0][0]
    seen = []  # (tokens, zeroed as told, exactly zero in the skipped heads) of the first block's o
    real = blocks.masked_reduce_gemm

    def recording(x, w, mask, **kw):
        if w is attn.wo:
            skipped = ~mask.bool().repeat_interleave(x.shape[1] // mask.shape[1], dim=1)
            seen.append((x.shape[0], kw["input_is_masked"], bool((x[skipped] == 0).all())))
        return real(x, w, mask, **kw)

    monkeypatch.setattr(blocks, "masked_reduce_gemm", recording)
    ids = torch.randint(2, 300, (2, 10), generator=torch.Generator().manual_seed(4))
    caches = [rt.new_cache(2, 11) for rt in (fast, ref)]
    with torch.no_grad():
        got, want = (rt.forward(ids, c) for rt, c in zip((fast, ref), caches, strict=True))
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        got, want = (rt.decode(torch.tensor([7, 8]), c) for rt, c in zip((fast, ref), caches, strict=True))
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert 20 > DECODE_MAX_M and seen[0] == (20, True, True)
    assert seen[1][:2] == (2, False)


def test_wide_blocks_on_the_kernels_match_the_routed_modules(tiny_model_dir, monkeypatch):
    """WIDE's blocks on the Triton kernels (in the CPU interpreter without a GPU, natively on one): the
    logits of the routed modules at a prompt and at decode, and the counts (q, k and v through one
    routed kernel, o's and down's kernels handing the next router its shares, the router kernels
    counting, the decision's kernel adding the residual and applying the norm). The prompt is 24 rows, past
    the decode kernels' 16, and the first block's router writes its own shares (``router_shares``)."""
    from compresskit_wide import blocks

    rows = []
    real_shares = blocks.router_shares
    monkeypatch.setattr(blocks, "router_shares", lambda x, *a, **k: rows.append(x.shape[0]) or real_shares(x, *a, **k))
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model, pruner = _wide_model(tiny_model_dir)
    model = model.to(device)
    cls = plugins.load("executor", "wide-triton")
    fast = Runtime(model, executor=cls(cls.Config(backend="triton")), compile=False, graphs=False)
    ref = Runtime(model, executor=ModulesExecutor())
    caches = [rt.new_cache(2, 16) for rt in (fast, ref)]
    ids = torch.randint(2, 300, (2, 12), generator=torch.Generator().manual_seed(2)).to(device)
    pruner.reset_sparsity(model)
    got, want = (rt.forward(ids, c) for rt, c in zip((fast, ref), caches, strict=True))
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    for token in ([7, 8], [9, 10]):
        token = torch.tensor(token, device=device)
        got, want = (rt.decode(token, c) for rt, c in zip((fast, ref), caches, strict=True))
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    counts = fast.counted_sparsity()
    assert counts.tokens == 2 * 12 + 2 * 2 and 0.2 < counts.macs < 0.8
    # the first block's router wrote its own shares at the prompt and at each step (the kernels hand the others
    # theirs under "triton"; under "auto" on a GPU past 16 rows each router writes its own)
    assert rows == [24, 2, 2]


@pytest.mark.parametrize("prompts", [[[5, 6, 7, 8, 9], [5, 6]], [[5, 6, 7, 8, 9]]])
def test_wide_blocks_count_what_the_routed_modules_count(tiny_model_dir, monkeypatch, prompts):
    """A padded batch and a single prompt: the blocks' counts equal the routed modules'; the router
    operators count where every token is real (their ``count`` flag), the block elsewhere."""
    from compresskit.runtime import runtime_for
    from compresskit_wide import blocks

    counted_by_router = []
    for name in ("router_decide", "router_decide_from_shares", "router_norm_from_shares", "router_norm_out_gemm"):
        real = getattr(blocks, name)

        def recording(*a, real=real, **k):
            counted_by_router.append(k["count"])
            return real(*a, **k)

        monkeypatch.setattr(blocks, name, recording)
    model, pruner = _wide_model(tiny_model_dir)
    fast = runtime_for(model, pruner)
    pruner.reset_sparsity(model)
    fast.generate(prompts, max_new_tokens=3)
    got = fast.counted_sparsity()
    Runtime(model, executor=ModulesExecutor()).generate(prompts, max_new_tokens=3)
    want = pruner.sparsity(model)
    assert got.tokens == want.tokens == sum(map(len, prompts)) + 2 * len(prompts)
    assert abs(got.macs - want.macs) < 1e-9 and 0.2 < got.macs < 0.8
    # the padded prompt's tokens are counted by the block, every decode step's by the router's launch
    assert any(counted_by_router) and all(counted_by_router) == (len(prompts) == 1)


def test_the_runtime_refuses_an_unmerged_lora_mlp_in_one_line(tiny_model_dir):
    """A projection that is not a plain Linear (LoRA not merged): WIDE's blocks do not take the layer's MLP, and
    the runtime says so in one line with what to do (merge it) rather than run the routed modules eagerly; merged
    (``lora_merged``, as generate, bench and apply's speed columns do) every layer runs WIDE's blocks."""
    from peft import LoraConfig, get_peft_model

    from compresskit.errors import RuntimeUnsupportedError
    from compresskit.modeling import lora_merged
    from compresskit.runtime import runtime_for
    from compresskit_wide.blocks import WideMLP

    model, pruner = _wide_model(tiny_model_dir)
    model = get_peft_model(model, LoraConfig(r=2, target_modules=["gate_proj"])).base_model.model
    with pytest.raises(RuntimeUnsupportedError) as info:
        runtime_for(model, pruner)
    assert str(info.value).startswith("runtime: layer 0 carries LoRA adapters that are not merged")
    assert "merge: true" in str(info.value) and "\n" not in str(info.value)
    with lora_merged(model):
        assert all(isinstance(m, WideMLP) for _, m in runtime_for(model, pruner).blocks)


def test_evaluation_scores_a_model_the_runtime_refuses_through_transformers(tiny_model_dir, monkeypatch):
    """``evaluation.engine: runtime`` on a model the runtime refuses is that one line as a recipe error; ``auto``
    (which takes the runtime on a GPU) scores it through transformers and says why."""
    from peft import LoraConfig, get_peft_model

    from compresskit import evaluate
    from compresskit.errors import RecipeError
    from compresskit.progress import Progress
    from compresskit.recipe import EvaluationSection

    model, pruner = _wide_model(tiny_model_dir)
    model = get_peft_model(model, LoraConfig(r=2, target_modules=["gate_proj"])).base_model.model
    with pytest.raises(RecipeError, match=r"^evaluation.engine: runtime: layer 0 carries LoRA adapters"):
        evaluate._scored(model, EvaluationSection(engine="runtime"), pruner, None, Progress())
    logged = []

    class Recording(Progress):
        def log(self, message: str) -> None:
            logged.append(message)

    monkeypatch.setattr(evaluate, "resolve_engine", lambda model, section: "runtime")  # (auto, as on a GPU)
    scored, engine = evaluate._scored(model, EvaluationSection(), pruner, None, Recording())
    assert scored is model and engine == "transformers"
    assert len(logged) == 1 and logged[0].endswith("scored through transformers (evaluation.engine: auto)")


def test_lora_kept_apart_is_timed_merged_and_left_as_it_was(tiny_model_dir, monkeypatch):
    """``apply``'s speed columns time a model whose LoRA adapters are apart with them merged (``lora_merged``):
    WIDE's blocks run every layer (no eager fallback), on the logits of the adapted model; afterwards every
    tensor, the adapter layers themselves and the logits are exactly what they were (the run is then evaluated
    or saved with its adapters apart), an error inside the timing included."""
    from peft import LoraConfig, get_peft_model

    from compresskit import bench
    from compresskit.modeling import lora_merged
    from compresskit.recipe import SpeedSection
    from compresskit.runtime import runtime_for
    from compresskit_wide.blocks import WideMLP

    model, pruner = _wide_model(tiny_model_dir)
    targets = ["gate_proj", "up_proj", "down_proj.base_layer", "q_proj"]
    model = get_peft_model(model, LoraConfig(r=2, target_modules=targets)).base_model.model.eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.2, generator=torch.Generator().manual_seed(len(name)))
    state = {k: v.clone() for k, v in model.state_dict().items()}
    adapters = dict(model.named_modules())
    ids = torch.randint(2, 300, (1, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = model(ids).logits
        with lora_merged(model) as merged:
            assert merged == 4 * len(model.model.layers)
            rt = runtime_for(model, pruner)
            assert all(isinstance(m, WideMLP) for _, m in rt.blocks) and rt.eager_reason is None
            torch.testing.assert_close(rt.forward(ids, rt.new_cache(1, 9)), want, rtol=1e-4, atol=1e-4)
        assert dict(model.named_modules()).keys() == adapters.keys()
        assert all(model.get_submodule(n) is m for n, m in adapters.items() if n)
        assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())
        assert torch.equal(model(ids).logits, want)
    with pytest.raises(RuntimeError, match="the timing failed"), lora_merged(model):  # (an error midway)
        raise RuntimeError("the timing failed")
    assert all(model.get_submodule(n) is m for n, m in adapters.items() if n)
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())
    built = []
    real = bench.runtime_for
    monkeypatch.setattr(bench, "runtime_for", lambda *a, **k: built.append(real(*a, **k)) or built[-1])
    speed = bench.measure_speed(model, pruner, SpeedSection(measure=True, prompt=6, new_tokens=2, repeats=1),
                                load_dense=None)  # fmt: skip
    assert speed["measured"] and built[0].eager_reason is None
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())


def test_registered_ops_pass_opcheck():
    """The registered ops' fake implementations agree with the real ones (shapes, dtypes, no aliasing)."""
    from compresskit_wide.kernels import ops as registers  # noqa: F401

    gen = torch.Generator().manual_seed(0)
    m, d, n, g = 5, 16, 32, 4
    x, w, wu = (torch.randn(*s, generator=gen) for s in ((m, d), (n, d), (n, d)))
    mask = torch.rand(m, g, generator=gen) > 0.5
    ops = torch.ops.compresskit_wide
    r = (torch.randn(3, d, generator=gen), torch.randn(3, generator=gen), torch.randn(2 * g, 3, generator=gen))
    counts = torch.zeros(2, dtype=torch.float64)  # counted in place (a mutated argument)
    torch_ = {"backend": "torch"}
    route = {"b_down": r[1], "w_route": r[2], "b_route": torch.zeros(2 * g)}
    for count in (False, True):
        torch.library.opcheck(ops.router_decide, (x, r[0]), {**route, "counts": counts, "count": count, **torch_})
    torch.library.opcheck(ops.masked_out_gemm, (x, w, mask), {"w_up": wu, "zero_inactive": True, **torch_})
    torch.library.opcheck(ops.masked_out_gemm, (x, w, mask), {"w_up": None, "zero_inactive": False, **torch_})
    qkv_rows = {"zero_inactive": False, "dense_rows": 12, **torch_}
    torch.library.opcheck(ops.masked_out_gemm, (x, torch.cat([w, wu[:12]]), mask), qkv_rows)
    h, w_down = torch.randn(m, n, generator=gen), torch.randn(d, n, generator=gen)
    torch.library.opcheck(ops.masked_reduce_gemm, (h, w_down, mask), {"input_is_masked": False, **torch_})
    residual, next_down = torch.randn(m, d, generator=gen), torch.randn(3, d, generator=gen)
    hand = {"residual": residual, "share_w": next_down, "input_is_masked": False, **torch_}
    torch.library.opcheck(ops.masked_reduce_gemm_shares, (h, w_down, mask), hand)
    shares = torch.randn(2, m, 3, generator=gen)
    for count in (False, True):
        torch.library.opcheck(
            ops.router_decide_from_shares, (shares,), {**route, "counts": counts, "count": count, **torch_}
        )
    norm = {"x": x, "delta": torch.randn(m, d, generator=gen), "norm_w": torch.ones(d), "eps": 1e-5}
    counted = {"counts": counts, "count": True}
    torch.library.opcheck(ops.router_norm_from_shares, (shares,), {**route, **norm, **counted, **torch_})
    for columns in (16, 48):  # the shares' count from the columns given (D = 16: one share, or one partly filled)
        torch.library.opcheck(ops.router_shares, (x, torch.randn(m, d, generator=gen), r[0], columns), torch_)
    # a block's start and its first product: gate+up fused; q with k and v rows under it
    gate_up = {"w_up": wu, "dense_rows": 0, "zero_inactive": True}
    torch.library.opcheck(ops.router_norm_out_gemm, (shares, w), {**route, **norm, **gate_up, **counted, **torch_})
    qkv = torch.randn(n + 8, d, generator=gen)
    rows = {"w_up": None, "dense_rows": 8, "zero_inactive": False, "counts": counts, "count": False}
    torch.library.opcheck(ops.router_norm_out_gemm, (shares, qkv), {**route, **norm, **rows, **torch_})
    # the margins the consensus decides from, and its decision
    margins = {"counts": counts, "count": False, "margin": True, **torch_}
    torch.library.opcheck(ops.router_norm_from_shares, (shares,), {**route, **norm, **margins})
    torch.library.opcheck(ops.router_decide, (x, r[0]), {**route, **margins})
    margin = torch.randn(m - 1, g, generator=gen)
    rule = {"batch": 2, "cap": 3, "quorum": 0.5, "share_set": True, "counts": counts, "count": True, **torch_}
    for valid in (None, torch.tensor([True, False, True, True])):
        torch.library.opcheck(ops.consensus_decide, (margin, valid), rule)
    q, k, v = torch.randn(2, 8, 4), torch.randn(2, 2, 6, 4), torch.randn(2, 2, 6, 4)
    heads = torch.rand(2, 2, generator=gen) > 0.5
    lens = torch.tensor([6, 4], dtype=torch.int32)
    torch.library.opcheck(ops.routed_attention_decode, (q, k, v, lens, heads), torch_)
    qp = torch.randn(2, 8, 6, 4)
    torch.library.opcheck(ops.routed_attention_prefill, (qp, k, v, torch.rand(2, 6, 2) > 0.5), torch_)


def test_the_ops_are_cheap_dispatches_that_compile_whole():
    """The ops are plain operator registrations (no ``custom_op`` wrapper): eagerly they give the
    function's result, and a compiled function holds them as single nodes, with no graph break."""
    from compresskit_wide.kernels import ops as plain

    gen = torch.Generator().manual_seed(0)
    x, w = torch.randn(3, 8, generator=gen), torch.randn(12, 8, generator=gen)
    mask = torch.tensor([[True, False, True], [False, False, False], [True, True, True]])
    want = plain.masked_out_gemm(x, w, mask, zero_inactive=True, backend="torch")
    op = torch.ops.compresskit_wide.masked_out_gemm.default
    torch.testing.assert_close(op(x, w, mask, zero_inactive=True, backend="torch"), want)

    targets = []

    def record(gm, _inputs):
        targets.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return gm.forward

    torch._dynamo.reset()
    compiled = torch.compile(lambda a, b, c: op(a, b, c, backend="torch") * 2, backend=record, fullgraph=True)
    got = compiled(x, w, mask)
    torch.testing.assert_close(got, want * 2)
    assert any("compresskit_wide.masked_out_gemm" in t for t in targets)


@pytest.mark.slow
def test_compiled_decode_steps_match_eager_for_dense_and_wide(tiny_model_dir):
    """``torch.compile`` traces whole decode blocks (``fullgraph``: the WIDE ops are registered operators, every
    index a tensor); the compiled prefill (symbolic shapes, padded and not; every
    block one graph, WIDE's ops inside) and decode steps give the eager logits. (CUDA graphs need a GPU:
    the GPU tests.)"""
    from torch._dynamo.utils import counters

    from compresskit.runtime import runtime_for

    model, pruner = _wide_model(tiny_model_dir)
    pairs = [
        (Runtime(model, dense=True, compile=True), Runtime(model, dense=True)),
        (runtime_for(model, pruner, compile=True), runtime_for(model, pruner)),
    ]
    for fast, eager in pairs:
        assert fast.mode == "compiled"
        counters.clear()
        before = [b.stat_tokens.clone() for b in fast.stat_blocks()]
        assert fast.warm_up(1, 4, 3) > 0  # compiles and runs, and leaves the routing counters as they were
        assert all(torch.equal(a, b.stat_tokens) for a, b in zip(before, fast.stat_blocks(), strict=True))
        caches = [rt.new_cache(2, 9) for rt in (fast, eager)]
        ids = torch.tensor([[5, 6, 7, 8, 9], [0, 0, 0, 5, 6]])
        real = ids > 0
        for c in caches:
            c.pad[1], c.padded = 3, True
        got, want = (rt.forward(ids, c, new_valid=real) for rt, c in zip((fast, eager), caches, strict=True))
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        for length in (7, 4):  # fresh unpadded prompts of two lengths: one symbolic compilation
            fresh = torch.arange(3, 3 + 2 * length).view(2, length)
            got, want = (rt.forward(fresh, rt.new_cache(2, 9)) for rt in (fast, eager))
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        assert not sum(counters["graph_break"].values())  # the prefill too is one graph a block
        for token in ([3, 4], [7, 8], [11, 12]):
            token = torch.tensor(token)
            got, want = (rt.decode(token, c) for rt, c in zip((fast, eager), caches, strict=True))
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("method", ["dense", "wide"])
def test_a_prefill_with_a_padded_tail_is_the_prompts_own(tiny_model_dir, method):
    """What a captured prefill computes (``Runtime._prefill_step``, eagerly here): the prompt padded
    at its end to the bucket's length gives the prompt's last logits, its cache slots and its routing
    counts, and decoding after it gives what decoding after the plain prefill gives."""
    from compresskit.runtime import runtime_for

    model, pruner = _wide_model(tiny_model_dir)
    rt = runtime_for(model, pruner) if method == "wide" else Runtime(model, dense=True)
    ids = torch.tensor([[5, 6, 7, 8, 9], [9, 8, 7, 6, 5]])
    plain, tailed = rt.new_cache(2, 12), rt.new_cache(2, 12)
    rt.reset_counts()
    want = rt.forward(ids, plain, last_only=True)
    counts = rt.counted_sparsity().macs if method == "wide" else None
    torch.testing.assert_close(want, rt.forward(ids, rt.new_cache(2, 12))[:, -1:])  # last_only: the last row
    rt.reset_counts()
    padded = torch.cat([ids, torch.full((2, 3), 11)], dim=1)  # [B, 8]: a bucket of 8 with 3 tail tokens
    valid = torch.arange(8)[None].expand(2, 8) < 5
    with torch.inference_mode():
        got = rt._prefill_step(tailed, padded, valid, torch.tensor([4]))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    if method == "wide":
        assert rt.counted_sparsity().macs == counts
    for k_plain, k_tailed in zip(plain.keys + plain.values, tailed.keys + tailed.values, strict=True):
        torch.testing.assert_close(k_tailed[:, :, :5], k_plain[:, :, :5], rtol=1e-5, atol=1e-5)
    tailed.valid[:, :5], tailed.end = True, 5
    for token in ([3, 4], [7, 8], [1, 2], [6, 6]):  # the tail's slots are overwritten before they are seen
        token = torch.tensor(token)
        torch.testing.assert_close(rt.decode(token, tailed), rt.decode(token, plain), rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("method", ["dense", "wide"])
def test_cuda_graph_decode_matches_eager_on_the_gpu(tiny_model_dir, method):
    """On a GPU in fp32: compiled decode steps replayed as CUDA graphs give the eager runtime's logits
    step by step (the WIDE kernels inside, under ``auto``: the reductions hand the next router its
    shares at every decode size, the batch of two's steps included), and the same greedy tokens; the
    counts of a graph-replayed run equal the eager run's (warm-up runs are not counted)."""
    from compresskit.runtime import runtime_for

    model, tok = load_model(str(tiny_model_dir), dtype="float32", device="cuda")
    pruner = None
    if method == "wide":
        cls = plugins.load("pruner", "wide")
        pruner = cls(cls.Config(ffn_group_size=16, router_rank=8))
        pruner.prepare(model, RunContext(model_config=model.config, tokenizer=tok, seed=0, device=torch.device("cuda")))
        model = pruner.finalize(model).eval()
    fast = runtime_for(model, pruner, prefill_graphs=False)
    eager = runtime_for(model, pruner, compile=False, graphs=False)
    captured = runtime_for(model, pruner)  # prefill graphs wherever decode is graphed
    assert fast.mode == "compiled + CUDA graphs" and eager.mode == "eager"
    assert captured.mode == "compiled + CUDA graphs (prefill too)"
    prompts = [[5, 6, 7, 8, 9, 10], [5, 6, 7]]
    tokens, counted = [], []
    for rt in (fast, eager):
        rt.reset_counts()
        tokens.append(rt.generate(prompts, max_new_tokens=8).tokens)
        if method == "wide":
            counted.append(rt.counted_sparsity().macs)
    assert tokens[0] == tokens[1]
    if method == "wide":
        assert abs(counted[0] - counted[1]) < 1e-9  # the warm-up steps before the capture are not counted
    # a captured prefill (unpadded prompts, two lengths in one 256-token bucket, replayed twice each)
    for prompt in ([[5, 6, 7, 8, 9, 10]], [[9, 8, 7]], [[5, 6, 7, 8, 9, 10]]):
        runs = []
        for rt in (captured, eager):
            rt.reset_counts()
            out = rt.generate(prompt, max_new_tokens=6).tokens
            runs.append((out, rt.counted_sparsity().macs if method == "wide" else 0))
        assert runs[0][0] == runs[1][0] and abs(runs[0][1] - runs[1][1]) < 1e-9  # the padded tail is not counted
    assert [len(c.prefills) for c in captured._caches.values()] == [1]
    caches = [rt.new_cache(2, 12) for rt in (fast, eager)]
    ids = torch.tensor([[5, 6, 7, 8, 9, 10], [0, 0, 0, 5, 6, 7]], device="cuda")
    for rt, c in zip((fast, eager), caches, strict=True):
        c.pad[1], c.padded = 3, True
        rt.forward(ids, c, new_valid=ids > 0)
    for token in ([3, 4], [7, 8], [11, 12], [13, 14]):
        token = torch.tensor(token, device="cuda")
        got, want = (rt.decode(token, c).clone() for rt, c in zip((fast, eager), caches, strict=True))
        torch.testing.assert_close(got, want, rtol=2e-3, atol=2e-3)


@pytest.mark.gpu
@pytest.mark.parametrize("batch", [1, 3])
def test_programmatic_dependent_launch_decodes_as_without_it(tiny_model_dir, monkeypatch, batch):
    """Every WIDE kernel launched with programmatic dependent launch (``policy.PDL_KERNELS = ("*",)``: each waits for
    the kernel before it, then lets the next launch) on the GPU in fp32, every op on its Triton kernel: compiled
    decode steps replayed as CUDA graphs give the same greedy tokens and counts as without it, over enough steps
    for a missing wait to show."""
    from compresskit_wide.kernels import common, gemm_out, policy

    model, tok = load_model(str(tiny_model_dir), dtype="float32", device="cuda")
    cls = plugins.load("pruner", "wide")
    pruner = cls(cls.Config(ffn_group_size=16, router_rank=8))
    pruner.prepare(model, RunContext(model_config=model.config, tokenizer=tok, seed=0, device=torch.device("cuda")))
    model = pruner.finalize(model).eval()
    executor = plugins.load("executor", "wide-triton")
    prompts = [[5, 6, 7, 8, 9, 10], [5, 6, 7], [9, 8, 7, 6]][:batch]
    runs = []
    for kernels in ((), ("*",)):
        monkeypatch.setattr(policy, "PDL_KERNELS", kernels)
        assert bool(common.pdl_launch(gemm_out.triton_masked_out_gemv_kernel, torch.device("cuda"))) == bool(kernels)
        rt = Runtime(model, executor=executor(executor.Config(backend="triton")))
        rt.reset_counts()
        out = rt.generate(prompts, max_new_tokens=24)
        runs.append((out.tokens, rt.counted_sparsity().macs))
    assert runs[0][0] == runs[1][0] and abs(runs[0][1] - runs[1][1]) < 1e-9


def test_programmatic_dependent_launch_where_the_policy_names_the_kernel(monkeypatch):
    """The kernels' launch arguments for programmatic dependent launch: none on the CPU (or in the interpreter)
    whatever ``policy.PDL_KERNELS`` names, none on a GPU for a kernel it does not name (a GPU's capability
    stands in); each name it may hold is a WIDE kernel's."""
    from compresskit_wide.kernels import common, gemm_out, policy

    kernel = gemm_out.triton_persistent_out_gemm_kernel
    assert policy.PDL_KERNELS == ("*",) and common.pdl_launch(kernel, torch.device("cpu")) == {}
    monkeypatch.setattr(common, "interpreted", lambda: False)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    gpu = torch.device("cuda", 0)
    on = {"PDL": True, "launch_pdl": True}
    for named, want in (((), {}), (("triton_persistent_out_gemm_kernel",), on), (("triton_router_finish_kernel",), {})):
        monkeypatch.setattr(policy, "PDL_KERNELS", named)
        assert common.pdl_launch(kernel, gpu) == want, named
    monkeypatch.setattr(policy, "PDL_KERNELS", ("*",))
    assert common.pdl_launch(kernel, gpu) == on
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    assert common.pdl_launch(kernel, gpu) == {}
    sources = [p.read_text() for p in Path(common.__file__).parent.glob("*.py")]
    names = {n for source in sources for n in re.findall(r"def (triton_\w+_kernel)\(", source)}
    assert len(names) == 16
    for source in sources:  # every kernel takes the constexpr PDL first thing, and every launch names a kernel
        assert (
            source.count("pdl_enter(PDL)")
            == source.count("PDL: tl.constexpr = False")
            == len(re.findall(r"def (triton_\w+_kernel)\(", source))
        )
        assert set(re.findall(r"(?<!def )pdl_launch\((\w+),", source)) <= names
