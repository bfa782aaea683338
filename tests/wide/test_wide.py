"""The WIDE pruner on a tiny random Llama (GQA 6 q / 2 kv heads, FFN 96): routers, masks,
budgets, training stages, checkpoints and cached decoding."""

import copy

import pytest
import torch
from transformers import DynamicCache

from compresskit.errors import ArtifactError, RecipeError
from compresskit.interfaces import RunContext
from compresskit.modeling import cache_kwargs
from compresskit.routing import GroupRouter, RoutedProjection, decide, linear_tau, routed_projections
from compresskit.testing import tiny_llama
from compresskit.tokens import token_mask
from compresskit_wide.config import WidePrunerConfig
from compresskit_wide.pruner import WidePruner


def wide(model, **kw):
    kw.setdefault("ffn_group_size", 16)
    kw.setdefault("router_rank", 8)
    pruner = WidePruner(WidePrunerConfig(**kw))
    pruner.prepare(model, RunContext(model_config=model.config))
    return pruner


def ids(b=2, t=12, seed=0):
    return torch.randint(2, 300, (b, t), generator=torch.Generator().manual_seed(seed))


# -- router ------------------------------------------------------------------------------------


def test_router_shapes_and_fp32_whatever_the_input():
    router = GroupRouter(48, groups=6, rank=8)
    x = torch.randn(2, 5, 48, dtype=torch.bfloat16)
    logits = router(x)
    assert logits.shape == (2, 5, 6, 2) and logits.dtype == torch.float32
    assert all(p.dtype == torch.float32 for p in router.parameters())
    assert torch.count_nonzero(router.down.bias) == 0 and torch.count_nonzero(router.up.bias) == 0


def test_routers_stay_fp32_in_a_bf16_model():
    model = tiny_llama().to(torch.bfloat16)
    pruner = wide(model)
    assert all(p.dtype == torch.float32 for p in pruner.trainable_parameters(model))
    with torch.no_grad():
        assert torch.isfinite(model(ids()).logits).all()


def test_decision_rule():
    logits = torch.tensor([[[[1.0, 0.0], [0.0, 1.0], [0.5, 0.5]]]])  # execute wins, skip wins, tie
    assert decide(logits, sample=False, tau=1.0).tolist() == [[[1.0, 0.0, 1.0]]]
    torch.manual_seed(0)
    sampled = decide(logits.expand(1, 2000, 3, 2), sample=True, tau=5.0)
    assert set(sampled.unique().tolist()) <= {0.0, 1.0}
    # hard samples follow softmax(logits) whatever tau: P(execute) = sigmoid(1) for the first group
    assert sampled[..., 0].mean().item() == pytest.approx(torch.sigmoid(torch.tensor(1.0)).item(), abs=0.04)


def test_temperature_schedule_is_linear_per_step():
    assert linear_tau(0, 11, 5.0, 0.5) == 5.0
    assert linear_tau(10, 11, 5.0, 0.5) == 0.5
    assert linear_tau(5, 11, 5.0, 0.5) == pytest.approx(2.75)
    model = tiny_llama()
    pruner = wide(model)
    assert pruner.on_train_step(5, 11) == {"tau": pytest.approx(2.75)}
    assert [p.tau for _, p in routed_projections(model)] == [pytest.approx(2.75)] * 4


# -- masks -------------------------------------------------------------------------------------


def test_inference_is_deterministic_and_pruned_inputs_exactly_zero():
    model = tiny_llama()
    pruner = wide(model)
    seen = {}

    def capture(name):
        def hook(module, args):
            seen[name] = args[0].detach().clone()

        return hook

    for name, proj in routed_projections(model):
        proj.base_layer.register_forward_pre_hook(capture(name))
    x = ids()
    with torch.no_grad():
        a = model(x).logits
        b = model(x).logits
    assert torch.equal(a, b)
    for name, proj in routed_projections(model):
        inp = seen[name].unflatten(-1, (proj.groups, -1))  # [B, T, G, width]
        off = inp.abs().amax(-1) == 0  # groups whose whole input is exactly zero
        assert off.any() and (~off).any(), name  # random routers skip some groups, keep others
    assert pruner.sparsity(model).tokens == 2 * 24  # two passes of 2 x 12 tokens


def test_routed_forward_equals_manual_masked_dense():
    model = tiny_llama()
    dense = copy.deepcopy(model)
    wide(model)
    x = ids()
    layer = model.model.layers[0]
    proj = layer.mlp.down_proj
    h = model.model.embed_tokens(x)
    with torch.no_grad():
        logits = proj.router(h)  # FFN router of layer 0 reads the residual after attention: check attention first
        att = layer.self_attn.o_proj
        exec_attn = (att.router(h)[..., 1] <= att.router(h)[..., 0]).float()  # [B, T, 2 groups of 3 heads]
        base = dense.model.layers[0]
        normed = base.input_layernorm(h)
        pos = torch.arange(x.shape[1])[None]
        cos_sin = dense.model.rotary_emb(h, pos)
        captured = {}
        hook = base.self_attn.o_proj.register_forward_pre_hook(lambda m, a: captured.setdefault("heads", a[0]))
        base.self_attn(normed, position_embeddings=cos_sin, attention_mask=None)
        hook.remove()
        heads = captured["heads"].unflatten(-1, (2, -1)) * exec_attn.unsqueeze(-1)
        h1 = h + base.self_attn.o_proj(heads.flatten(-2))
        exec_ffn = (proj.router(h1)[..., 1] <= proj.router(h1)[..., 0]).float()  # [B, T, 6]
        mlp = base.mlp
        act = mlp.act_fn(mlp.gate_proj(base.post_attention_layernorm(h1))) * mlp.up_proj(
            base.post_attention_layernorm(h1)
        )
        h2 = h1 + mlp.down_proj((act.unflatten(-1, (6, -1)) * exec_ffn.unsqueeze(-1)).flatten(-2))
        out = {}
        hook = model.model.layers[0].register_forward_hook(
            lambda m, a, o: out.setdefault("h", o[0] if isinstance(o, tuple) else o)
        )
        model(x)
        hook.remove()
    assert logits.shape == (2, 12, 6, 2)
    torch.testing.assert_close(out["h"], h2, rtol=1e-5, atol=1e-5)


def test_unwrap_restores_the_dense_model_exactly():
    model = tiny_llama()
    dense = copy.deepcopy(model)
    pruner = wide(model)
    pruner.unwrap(model)
    assert not routed_projections(model)
    with torch.no_grad():
        assert torch.equal(model(ids()).logits, dense(ids()).logits)


def test_group_size_errors_name_both_numbers_and_valid_choices():
    with pytest.raises(
        RecipeError, match=r"attn_group_size: 4 does not divide num_attention_heads 6; valid: 1, 2, 3, 6"
    ):
        wide(tiny_llama(), attn_group_size=4)
    with pytest.raises(
        RecipeError, match=r"ffn_group_size: 100 does not divide intermediate_size 96; valid: 1, 2, 3, 4, 6, 8"
    ):
        wide(tiny_llama(), ffn_group_size=100)


def test_default_attention_group_is_the_gqa_group():
    model = tiny_llama()
    wide(model)
    assert model.model.layers[0].self_attn.o_proj.groups == 2  # 6 query heads / 3 per KV head


def test_config_rules():
    with pytest.raises(ValueError, match="not both kinds"):
        WidePrunerConfig(target_sparsity=0.5, target_attention=0.3, target_ffn=0.6)
    with pytest.raises(ValueError, match="set both or neither"):
        WidePrunerConfig(target_attention=0.3)
    with pytest.raises(ValueError, match="budget: macs takes one target"):
        WidePrunerConfig(target_attention=0.3, target_ffn=0.6, budget="macs")
    cfg = WidePrunerConfig(target_attention=0.3, target_ffn=0.6)
    assert cfg.target_sparsity is None
    assert WidePrunerConfig.model_validate_json(cfg.model_dump_json()) == cfg


def test_targets_and_ignore():
    model = tiny_llama()
    pruner = wide(model, targets=["mlp"], ignore=["model.layers.0.mlp"])
    assert [n for n, _ in routed_projections(model)] == ["model.layers.1.mlp.down_proj"]
    assert pruner.state == "prepared"
    with pytest.raises(RecipeError, match="not a decoder layer's self_attn or mlp"):
        wide(tiny_llama(), targets=["q_proj"])


# -- sparsity accounting -------------------------------------------------------------------------


def test_measured_sparsity_matches_the_masks_and_excludes_padding():
    model = tiny_llama()
    pruner = wide(model)
    x = ids()
    valid = torch.ones_like(x, dtype=torch.bool)
    valid[1, 7:] = False  # the last 5 tokens of row 2 are padding
    skips = {}

    def record(name):
        def hook(module, args, out):
            skips[name] = (out[..., 1] > out[..., 0]).float()

        return hook

    for name, proj in routed_projections(model):
        proj.router.register_forward_hook(record(name))
    pruner.reset_sparsity(model)
    with torch.no_grad(), token_mask(valid):
        model(x)
    rep = pruner.sparsity(model)
    assert rep.tokens == 19 and rep.dynamic
    cfg = model.config
    for name, proj in routed_projections(model):
        expected = (skips[name] * valid.unsqueeze(-1)).sum().item()
        assert proj.stat_skipped.item() == expected
        block = rep.layers[proj.layer_idx][proj.kind]
        assert block.skipped == expected * proj.macs_per_group
    # attention groups skip q rows + o columns: 2 * 3 heads * 8 dims * 48 MACs per token
    assert model.model.layers[0].self_attn.o_proj.macs_per_group == 2 * 3 * 8 * cfg.hidden_size
    assert model.model.layers[0].mlp.down_proj.macs_per_group == 3 * 16 * cfg.hidden_size
    assert 0 < rep.macs < 1 and 0 < rep.attention < 1


def test_counting_without_a_mask_and_mixed_passes():
    """Passes without a declared mask count every token as real (on the host, no mask tensor is
    made); a decode step whose shape does not fit the declared mask too; passes with and without a
    mask add up; ``reset_stats`` starts again from zero."""
    model = tiny_llama()
    pruner = wide(model)
    skips = {}

    def record(name):
        def hook(module, args, out):
            skips.setdefault(name, []).append(out[..., 1] > out[..., 0])

        return hook

    for name, proj in routed_projections(model):
        proj.router.register_forward_hook(record(name))
    pruner.reset_sparsity(model)
    a, b = ids(seed=1), ids(b=1, t=5, seed=2)
    valid = torch.ones_like(a, dtype=torch.bool)
    valid[0, :3] = False
    with torch.no_grad():
        model(a)  # no mask: 24 real tokens
        with token_mask(valid):
            model(a)  # 21 real tokens
            model(b)  # the declared mask does not fit: 5 real tokens
    for name, proj in routed_projections(model):
        unmasked, masked, other = skips[name]
        expected = unmasked.sum() + (masked & valid.unsqueeze(-1)).sum() + other.sum()
        assert proj.stat_tokens.item() == 24 + 21 + 5
        assert proj.stat_skipped.item() == expected.item()
    assert pruner.sparsity(model).tokens == 50
    pruner.reset_sparsity(model)
    assert all(p.stat_tokens.item() == 0 and p.stat_skipped.item() == 0 for _, p in routed_projections(model))


def test_budget_losses():
    model = tiny_llama()
    model.train()
    for budget, kw in (
        ("groups", {}),
        ("macs", {"budget": "macs"}),
        ("split", {"target_sparsity": None, "target_attention": 0.2, "target_ffn": 0.8}),
    ):
        m = copy.deepcopy(model)
        pruner = wide(m, **kw)
        x = ids()
        with token_mask(torch.ones_like(x)):
            m(x)
        skipped = sum(float(p.last_skip.detach().sum()) for _, p in routed_projections(m) if p.kind == "ffn")
        loss = pruner.regularization(m)
        assert all(p.last_skip is None for _, p in routed_projections(m))  # the step's graph is released
        rho = {k.removeprefix("sparsity_"): v for k, v in pruner.train_metrics(m).items()}  # the batch's fractions
        if budget == "groups":
            expected = 20 * abs(0.5 - (rho["attention"] + rho["ffn"]) / 2)
        elif budget == "macs":
            expected = 20 * abs(0.5 - rho["macs"])
        else:
            expected = 20 * (abs(0.2 - rho["attention"]) + abs(0.8 - rho["ffn"])) / 2
        assert loss.detach().item() == pytest.approx(float(expected), rel=1e-5)
        # skip fractions computed from the masks
        assert rho["ffn"] == pytest.approx(skipped / (2 * 24 * 6), rel=1e-6)


def test_gradient_flows_through_the_straight_through_mask():
    model = tiny_llama()
    pruner = wide(model)
    for p in model.parameters():
        p.requires_grad_(False)
    for p in pruner.trainable_parameters(model):
        p.requires_grad_(True)
    model.train()
    x = ids()
    loss = model(input_ids=x, labels=x).loss  # LM loss only: gradient reaches routers through the masks
    loss.backward()
    grads = [p.grad for p in pruner.trainable_parameters(model)]
    assert all(g is not None and torch.isfinite(g).all() for g in grads)
    # the layer-0 attention router is reached through the whole (frozen) backbone
    assert model.model.layers[0].self_attn.o_proj.router.up.weight.grad.abs().sum() > 0
    for p in pruner.trainable_parameters(model):
        p.grad = None
    pruner.on_train_step(0, 10)
    model(input_ids=x, labels=x)
    pruner.regularization(model).backward()
    assert model.model.layers[1].mlp.down_proj.router.up.weight.grad.abs().sum() > 0


def test_finalize_is_deterministic_even_in_train_mode_and_guards_lifecycle():
    model = tiny_llama()
    pruner = wide(model)
    pruner.finalize(model)
    model.train()
    x = ids()
    with torch.no_grad():
        assert torch.equal(model(x).logits, model(x).logits)
    with pytest.raises(RuntimeError, match="finalize"):
        pruner.finalize(model)


def test_state_dict_round_trip_and_key_checks():
    model = tiny_llama()
    pruner = wide(model)
    state = pruner.state_dict(model)
    assert state and all(k.startswith("wide.model.layers.") and ".router." in k for k in state)
    other = tiny_llama()
    p2 = wide(other)
    p2.load_state_dict(other, state)
    with torch.no_grad():
        assert torch.equal(model(ids()).logits, other(ids()).logits)
    bad = dict(state)
    bad.pop(next(iter(bad)))
    with pytest.raises(ArtifactError, match="1 missing keys"):
        p2.load_state_dict(other, bad)
    with pytest.raises(ArtifactError, match="unexpected"):
        p2.load_state_dict(other, {**state, "wide.extra": torch.zeros(1)})


# -- cached decoding ------------------------------------------------------------------------------


def test_generate_with_kv_cache_equals_no_cache_forward():
    model = tiny_llama()
    pruner = wide(model)
    pruner.finalize(model)
    prompt = ids(b=1, t=6)
    with torch.no_grad():
        out = model.generate(prompt, max_new_tokens=8, do_sample=False, use_cache=True, pad_token_id=1)
        ref = model.generate(prompt, max_new_tokens=8, do_sample=False, use_cache=False, pad_token_id=1)
        assert torch.equal(out, ref)
        # and the cached step-by-step logits match one full forward pass
        full = model(out).logits
        past, logits = DynamicCache(config=model.config), []
        for t in range(out.shape[1]):  # the cache filled in place, step by step
            logits.append(model(out[:, t : t + 1], **cache_kwargs(model, past), use_cache=True).logits)
        torch.testing.assert_close(torch.cat(logits, dim=1), full, rtol=1e-4, atol=1e-4)


def test_routed_projection_needs_its_tap():
    model = tiny_llama()
    wide(model)
    proj = model.model.layers[0].self_attn.o_proj
    assert isinstance(proj, RoutedProjection)
    with pytest.raises(RuntimeError, match="router tap did not run"):
        proj(torch.zeros(1, 2, 48))


def test_group_fractions_are_reported_beside_mac_fractions():
    model = tiny_llama()
    pruner = wide(model)
    with torch.no_grad():
        model(ids())
    rep = pruner.sparsity(model)
    d = rep.to_dict()
    groups = d["groups"]
    att = [p for _, p in routed_projections(model) if p.kind == "attention"]
    expected_att = sum(float(p.stat_skipped) for p in att) / sum(float(p.stat_tokens) * p.groups for p in att)
    assert groups["attention"] == pytest.approx(expected_att, abs=1e-6)
    assert groups["mean"] == pytest.approx((groups["attention"] + groups["ffn"]) / 2, abs=1e-6)
    # every attention group costs the same MACs: the block's MAC fraction is the group fraction
    # times the prunable (q + o) share of the block (k and v are never skipped)
    cfg = model.config
    share = (2 * 48 * 48) / (2 * 48 * 48 + 2 * 48 * 16)
    assert d["attention"] == pytest.approx(groups["attention"] * share, abs=1e-5)
    assert rep.merge(rep).to_dict()["groups"] == groups
    assert cfg.num_attention_heads == 6
