"""Batch-consensus routing: the decision's kernel against its two references (odd shapes, all-off,
all-on, ragged real tokens), a batch of one as per-token routing, WIDE's runtime blocks under consensus
against the routed modules under the same rule (the teacher-forced simulation evaluation scores),
training with the consensus in the loop, and the option's bad values."""

import copy
import itertools
import math

import pytest
import torch

from compresskit import plugins
from compresskit.interfaces import RunContext
from compresskit.modeling import load_model
from compresskit.routing import routed_projections, router_state_dict
from compresskit.runtime import Runtime
from compresskit.seeding import seed_everything
from compresskit_wide.consensus import Consensus, consensus_execute, set_consensus
from compresskit_wide.kernels.consensus import torch_consensus, triton_consensus

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _margins(b, t, g, kind, gen):
    if kind == "off":
        return -torch.rand(b, t, g, generator=gen) - 0.25
    if kind == "on":
        return torch.rand(b, t, g, generator=gen)
    return torch.randint(-8, 9, (b, t, g), generator=gen).float() / 4  # exact sums: ties broken the same way


@pytest.mark.parametrize(("b", "t", "g"), [(1, 3, 5), (2, 1, 3), (5, 3, 12), (3, 2, 7), (9, 1, 33)])
@pytest.mark.parametrize("kind", ["ragged", "off", "on"])
def test_consensus_kernel_matches_both_references(b, t, g, kind):
    gen = torch.Generator().manual_seed(b * 100 + t * 10 + g)
    margin = _margins(b, t, g, kind, gen)
    valid = torch.rand(b, t, generator=gen) > 0.3
    rules = itertools.product([1.0, 0.5, 0.2], [0.0, 0.5, 1.0], ["set", "own"], [None, 0.5, 1.0, 1.3])
    for (budget, quorum, share, follow), real in itertools.product(rules, [None, valid]):
        rule = Consensus(budget=budget, quorum=quorum, share=share, follow=follow)
        want = consensus_execute(margin, margin >= 0, real, rule).reshape(b * t, g)
        flat = None if real is None else real.reshape(-1)
        kw = {"cap": rule.cap(g), "quorum": quorum, "share_set": share == "set", "follow": follow or 0.0}
        ref = torch_consensus(margin.reshape(-1, g), b, valid=flat, **kw)
        counts = torch.zeros(2, dtype=torch.float64, device=DEVICE)
        on = None if flat is None else flat.to(DEVICE)
        got = triton_consensus(margin.reshape(-1, g).to(DEVICE), b, valid=on, counts=counts, **kw).cpu()
        rows = torch.ones(b * t, dtype=torch.bool) if flat is None else flat
        assert torch.equal(ref[rows], want[rows]) and torch.equal(got[rows], want[rows]), (
            budget,
            quorum,
            share,
            follow,
        )
        assert counts.tolist() == [rows.sum().item(), got[rows].sum().item()]


def test_consensus_rule_on_a_worked_case():
    """Four tokens, four groups: votes 4, 2, 2, 1; margin sums break the tie of groups 1 and 2."""
    margin = torch.tensor(
        [[1.0, 1.0, -1.0, -1.0], [1.0, 1.0, -1.0, -1.0], [1.0, -1.0, 3.0, -1.0], [1.0, -1.0, 3.0, 1.0]]
    ).view(4, 1, 4)
    own = margin >= 0
    assert consensus_execute(margin, own, None, Consensus(quorum=0.5))[0, 0].tolist() == [True, True, True, False]
    # the tie of groups 1 and 2 (2 votes each) goes to group 2 (margin sum 4 against 0)
    assert consensus_execute(margin, own, None, Consensus(budget=0.5, quorum=0.0))[0, 0].tolist() == [
        True, False, True, False,
    ]  # fmt: skip
    own_rule = consensus_execute(margin, own, None, Consensus(budget=0.5, quorum=0.0, share="own"))
    assert own_rule[:, 0].tolist() == [[True, False, False, False]] * 2 + [[True, False, True, False]] * 2
    # a single real token keeps its own decision, whatever the budget
    one = consensus_execute(margin, own, torch.tensor([[False], [False], [True], [False]]), Consensus(budget=0.25))
    assert one[2, 0].tolist() == own[2, 0].tolist()
    # follow: the set holds the first ceil(follow * the tokens' mean count of groups) of the ranking (votes, then
    # margin sums): groups 0, 2, 1, 3; all four once that many or more
    rank = torch.tensor([0, 2, 1, 3])
    mean = own.sum(-1).float().mean().item()
    for follow in (1.0, 0.4, 0.8, 2.0):
        size = math.ceil(follow * mean)
        got = consensus_execute(margin, own, None, Consensus(quorum=0.0, follow=follow))[0, 0]
        assert got.tolist() == (rank < size).tolist(), follow
    assert [math.ceil(f * mean) for f in (0.4, 0.8, 1.0)] == [1, 2, 3]  # each cap a different set here


@pytest.mark.parametrize(
    "value",
    [
        {"budget": 0.0}, {"budget": 1.5}, {"quorum": -0.1}, {"share": "all"}, {"follow": 0.0}, {"follow": 5.0},
        {"attention_share": "some"},
    ],
)  # fmt: skip
def test_bad_consensus_values_are_refused(value):
    with pytest.raises(ValueError, match=next(iter(value))):
        Consensus(**value)
    cls = plugins.load("executor", "wide-triton")
    with pytest.raises(ValueError, match=next(iter(value))):
        cls.Config(consensus=value)


def _wide_model(tiny_model_dir):
    model, tok = load_model(str(tiny_model_dir), dtype="float32", device="cpu")
    cls = plugins.load("pruner", "wide")
    pruner = cls(cls.Config(ffn_group_size=16, router_rank=8))
    pruner.prepare(model, RunContext(model_config=model.config, tokenizer=tok, seed=0))
    return pruner.finalize(model).eval(), pruner


def _executor(backend="torch", **consensus):
    cls = plugins.load("executor", "wide-triton")
    return cls(cls.Config(backend=backend, consensus=consensus or None))


def test_the_attention_routers_may_share_otherwise():
    """``attention_share``: the attention routers' rule is the rule with that share, the FFN's the rule itself;
    unset, a rule dumps as before the field (its recipes keep their hash)."""
    rule = Consensus(quorum=0.0, follow=1.25, attention_share="own")
    assert rule.for_kind("attention") == Consensus(quorum=0.0, follow=1.25, share="own")
    assert rule.for_kind("ffn") is rule
    assert Consensus(quorum=0.0, share="own", attention_share="own").for_kind("attention").share == "own"
    assert "attention_share" not in Consensus(quorum=0.5).model_dump()
    assert rule.model_dump()["attention_share"] == "own"


@pytest.mark.parametrize(
    "rule",
    [
        {"share": "set"}, {"share": "own"}, {"share": "set", "follow": 0.75}, {"share": "own", "follow": 1.0},
        {"share": "set", "attention_share": "own"}, {"share": "own", "attention_share": "set"},
    ],
)  # fmt: skip
def test_runtime_blocks_under_consensus_match_the_routed_modules(tiny_model_dir, rule):
    """The runtime's WIDE blocks under consensus give the logits of the routed modules under the same rule
    (the reference path that evaluation scores), at a prompt and at decode; and the rule changes them. With
    ``follow`` too (the set's cap from the tokens' mean count), and with the attention routers sharing
    otherwise than the FFN's (``attention_share``: each kind's blocks and modules take their kind's rule)."""
    model, pruner = _wide_model(tiny_model_dir)
    executor = _executor(quorum=0.5, budget=0.5, **rule)
    fast = Runtime(model, executor=executor, compile=False, graphs=False)
    plain = Runtime(model, executor=_executor(), compile=False, graphs=False)
    ids = torch.randint(2, 300, (3, 6), generator=torch.Generator().manual_seed(0))
    caches = [rt.new_cache(3, 8) for rt in (fast, plain)]
    got, per_token = (rt.forward(ids, c) for rt, c in zip((fast, plain), caches, strict=True))
    executor.convert(model)  # the routed modules under the same rule
    with torch.no_grad():
        want = model(ids).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(got, per_token, atol=1e-3)
    token = torch.tensor([7, 8, 9])
    with torch.no_grad():
        want = model(torch.cat([ids, token[:, None]], 1)).logits[:, -1]
    torch.testing.assert_close(fast.decode(token, caches[0]), want, rtol=1e-5, atol=1e-5)
    for block in (b for pair in fast.blocks for b in pair if hasattr(b, "rule")):
        assert block.rule == executor.config.consensus.for_kind(block.kind)
    for _, proj in routed_projections(model):
        assert proj.rule.consensus == executor.config.consensus.for_kind(proj.kind)
    set_consensus(model, None)


def test_the_attention_routers_own_share_mixes_the_two_rules(tiny_model_dir, monkeypatch):
    """Under ``share: set, attention_share: own`` every FFN router runs one set at each position (the same
    groups for every sequence) and every attention router each token's own choices within the set (a part of
    them, differing between sequences); with neither given, the attention routers run the set too."""
    from compresskit.routing import RoutedProjection

    model, pruner = _wide_model(tiny_model_dir)
    ids = torch.randint(2, 300, (4, 5), generator=torch.Generator().manual_seed(5))
    seen: dict = {}
    take = RoutedProjection._take
    monkeypatch.setattr(
        RoutedProjection,
        "_take",
        lambda self, execute, valid, own: (
            seen.setdefault((self.layer_idx, self.kind), (execute > 0.5, own > 0.5)) and take(self, execute, valid, own)
        ),
    )
    for rule in (Consensus(quorum=0.0, budget=0.5, attention_share="own"), Consensus(quorum=0.0, budget=0.5)):
        set_consensus(model, rule)
        seen.clear()
        with torch.no_grad():
            model(ids)
        assert {kind for _, kind in seen} == {"attention", "ffn"}
        for (layer, kind), (ran, own) in seen.items():
            one_set = bool((ran == ran[:1]).all())
            if kind == "attention" and rule.attention_share == "own":
                assert not one_set and bool((ran <= own).all()) and not torch.equal(ran, own), layer
            else:
                assert one_set, (layer, kind)
    set_consensus(model, None)


def test_a_batch_of_one_under_consensus_is_per_token_routing(tiny_model_dir):
    model, pruner = _wide_model(tiny_model_dir)
    ids = torch.randint(2, 300, (1, 9), generator=torch.Generator().manual_seed(1))
    outs = []
    for executor in (_executor(budget=0.1, quorum=1.0), _executor()):
        rt = Runtime(model, executor=executor, compile=False, graphs=False)
        cache = rt.new_cache(1, 10)
        outs.append((rt.forward(ids, cache), rt.decode(torch.tensor([5]), cache)))
    assert all(torch.equal(a, b) for a, b in zip(*outs, strict=True))


def test_consensus_counts_what_ran(tiny_model_dir):
    """Under ``share: set`` every token of a position runs the same groups: the counted sparsity is the set's."""
    model, pruner = _wide_model(tiny_model_dir)
    rt = Runtime(model, executor=_executor(quorum=1.0), compile=False, graphs=False)
    cache = rt.new_cache(4, 3)
    rt.forward(torch.randint(2, 300, (4, 2), generator=torch.Generator().manual_seed(3)), cache)
    plain = Runtime(model, executor=_executor(), compile=False, graphs=False)
    plain.forward(torch.randint(2, 300, (4, 2), generator=torch.Generator().manual_seed(3)), plain.new_cache(4, 3))
    agreed = [blk.stat_skipped / (blk.stat_tokens * blk.groups) for blk in rt.stat_blocks()]
    own = [blk.stat_skipped / (blk.stat_tokens * blk.groups) for blk in plain.stat_blocks()]
    # a unanimous quorum keeps only what every token wants: more skipped than per token
    assert all(a >= o for a, o in zip(agreed, own, strict=True)) and sum(agreed) > sum(own)


@pytest.mark.parametrize("attention_share", [None, "own"])
def test_wide_blocks_under_consensus_on_the_kernels(tiny_model_dir, attention_share, monkeypatch):
    """The same on the Triton kernels (in the CPU interpreter without a GPU, natively on one): the router kernels
    give margins, the consensus kernel decides for every router, the prompt's positions and the decode step's,
    the products run the shared sets (with ``attention_share: own`` the attention blocks each token's own
    choices within the set)."""
    from compresskit_wide.kernels import ops

    decided = []
    real = ops.triton_consensus
    monkeypatch.setattr(ops, "triton_consensus", lambda *a, **k: decided.append(1) or real(*a, **k))
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model, pruner = _wide_model(tiny_model_dir)
    model = model.to(device)
    pruner.reset_sparsity(model)  # (the counters on the model's device)
    executor = _executor("triton", quorum=0.5, budget=0.75, follow=1.0, attention_share=attention_share)
    fast = Runtime(model, executor=executor, compile=False, graphs=False)
    ids = torch.randint(2, 300, (3, 5), generator=torch.Generator().manual_seed(2)).to(device)
    cache = fast.new_cache(3, 7)
    got = [fast.forward(ids, cache)]
    routers = 2 * model.config.num_hidden_layers  # attention's and the FFN's in every layer
    assert len(decided) == routers
    got.append(fast.decode(torch.tensor([7, 8, 9], device=device), cache))
    assert len(decided) == 2 * routers
    executor.convert(model)
    with torch.no_grad():
        full = model(torch.cat([ids, torch.tensor([[7], [8], [9]], device=device)], 1)).logits
    torch.testing.assert_close(got[0], full[:, :5], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(got[1], full[:, 5], rtol=1e-4, atol=1e-4)
    set_consensus(model, None)


@pytest.mark.slow
def test_a_decode_batch_past_16_runs_its_shared_set_on_the_decode_kernels(tiny_model_dir, monkeypatch):
    """At decode a batch of 20 under ``share: set`` runs the out-width products on the decode kernels' one
    tile and the reductions (down, o) on the split-K one (a shared set, up to 64 tokens), each but the last
    handing the next block's router its shares, and gives the routed modules' logits under the same rule."""
    from compresskit_wide.kernels import gemm_out, ops

    device = "cuda" if torch.cuda.is_available() else "cpu"
    model, pruner = _wide_model(tiny_model_dir)
    model = model.to(device)
    pruner.reset_sparsity(model)
    executor = _executor("triton", quorum=0.5, budget=0.5)
    fast = Runtime(model, executor=executor, compile=False, graphs=False)
    ids = torch.randint(2, 300, (20, 2), generator=torch.Generator().manual_seed(4)).to(device)
    cache = fast.new_cache(20, 3)
    fast.forward(ids, cache)
    layouts = []
    real = gemm_out.triton_routing_layout
    monkeypatch.setattr(gemm_out, "triton_routing_layout", lambda mask: layouts.append(mask) or real(mask))
    split = []
    reduce = ops.triton_tile_reduce_gemm
    monkeypatch.setattr(ops, "triton_tile_reduce_gemm", lambda *a, **k: split.append("share_w" in k) or reduce(*a, **k))
    token = torch.arange(20, device=device) + 7
    got = fast.decode(token, cache)
    assert layouts == []  # no product of the step took the prefill kernels' sorted layout
    assert split == [True] * (2 * model.config.num_hidden_layers - 1) + [False]  # o and down of every layer
    executor.convert(model)
    with torch.no_grad():
        want = model(torch.cat([ids, token[:, None]], 1)).logits[:, -1]
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    set_consensus(model, None)


def test_training_with_consensus_in_the_loop(tiny_model_dir):
    """In training, the forward runs the batch's consensus of the sampled decisions; the routers still get a
    gradient (straight through the tokens' own samples). What ran is kept for the logs (``last_run_skip``), and
    the sparsity term counts the tokens' own decisions (``last_skip``)."""
    model, tok = load_model(str(tiny_model_dir), dtype="float32", device="cpu")
    cls = plugins.load("pruner", "wide")
    pruner = cls(cls.Config(ffn_group_size=16, router_rank=8))
    pruner.prepare(model, RunContext(model_config=model.config, tokenizer=tok, seed=0))
    model.train()
    assert set_consensus(model, Consensus(quorum=0.5)) > 0
    ids = torch.randint(2, 300, (4, 6), generator=torch.Generator().manual_seed(0))
    model(ids).logits.sum().backward()
    proj = next(p for _, p in routed_projections(model) if p.router is not None)
    execute = 1.0 - proj.last_run_skip  # [B, T, G]: one set a position
    assert torch.equal(execute, execute[:1].expand_as(execute))
    own = 1.0 - proj.last_skip
    assert own.requires_grad and not torch.equal(own, execute)  # each token's own sample, not the set
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in proj.router.parameters())
    # over: tile, each sequence's tiles share their sets (share: set): one set a tile of 16 positions
    for p in model.parameters():
        p.grad = None
    set_consensus(model, Consensus(over="tile", tile=16, quorum=0.0, budget=0.5))
    model(torch.randint(2, 300, (2, 20), generator=torch.Generator().manual_seed(1))).logits.sum().backward()
    execute = 1.0 - proj.last_run_skip  # [B, T, G]
    assert torch.equal(execute[:, :16], execute[:, :1].expand(-1, 16, -1))  # the first tile: one set
    assert torch.equal(execute[:, 16:], execute[:, 16:17].expand(-1, 4, -1))  # the last, short tile
    assert (execute.sum(-1) <= math.ceil(0.5 * proj.groups)).all()  # within the budget
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in proj.router.parameters())
    # the union capped at the tokens' own mean count (quorum 0, follow 1.0): one set a position, no larger than
    # that cap, and a gradient (recipes/study/wide-smollm2-50-stage1-follow8.yaml trains with follow 1.25)
    for p in model.parameters():
        p.grad = None
    set_consensus(model, Consensus(quorum=0.0, follow=1.0))
    model(ids).logits.sum().backward()
    execute = 1.0 - proj.last_run_skip  # [B, T, G]
    assert torch.equal(execute, execute[:1].expand_as(execute))
    assert (execute[0].sum(-1) >= 1).all() and (execute[0].sum(-1) < proj.groups).any()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in proj.router.parameters())
    set_consensus(model, None)


def test_the_sparsity_term_counts_the_tokens_own_decisions_under_consensus(tiny_model_dir):
    """Under a rule whose set is larger than a token's own choices (the union, quorum 0), the skip fractions the
    regularisation reads are those of the tokens' own samples, with a gradient to the routers; ``run_macs`` (the
    logs') is what ran, and skips less. Per token there is no ``run_macs``, and ``macs`` is what ran."""
    model, tok = load_model(str(tiny_model_dir), dtype="float32", device="cpu")
    cls = plugins.load("pruner", "wide")
    pruner = cls(cls.Config(ffn_group_size=16, router_rank=8))
    pruner.prepare(model, RunContext(model_config=model.config, tokenizer=tok, seed=0))
    model.train()
    ids = torch.randint(2, 300, (4, 6), generator=torch.Generator().manual_seed(0))
    rates = {}
    for name, rule in (("per-token", None), ("union", Consensus(quorum=0.0))):
        set_consensus(model, rule)
        seed_everything(3)  # the same Gumbel samples: the same own decisions
        model(ids)
        rates[name] = rho = pruner.batch_fractions()
        if name == "union":
            assert "run_macs" in rho and not rho["run_macs"].requires_grad
            assert rho["run_macs"] < rho["macs"]
            rho["macs"].backward()
            routers = [proj.router for _, proj in routed_projections(model) if proj.router is not None]
            assert any(p.grad is not None and p.grad.abs().sum() > 0 for r in routers for p in r.parameters())
        else:
            assert "run_macs" not in rho
    torch.testing.assert_close(rates["union"]["macs"], rates["per-token"]["macs"])
    set_consensus(model, None)


def _saved_wide_run(tiny_model_dir, tmp_path, training=(), progress=None):
    from compresskit.api import apply

    run = tmp_path / "run"
    recipe = {
        "model": {"name_or_path": str(tiny_model_dir), "dtype": "float32", "device": "cpu"},
        "pruner": {"name": "wide", "config": {"ffn_group_size": 16, "router_rank": 8}},
        "training": list(training),
        "evaluation": {"tasks": ["piqa"], "limit": 2, "batch_size": 2, "max_length": 512, "compare_dense": False},
        "output": {"dir": str(run)},
    }
    apply(recipe, progress=progress)
    return run


@pytest.mark.slow
def test_eval_scores_a_saved_run_under_consensus(tiny_model_dir, tmp_path, capsys):
    """``compresskit eval RUN --option consensus.KEY=VALUE``: each evaluation batch decides together (the teacher-forced
    simulation), the rule is recorded, and a unanimous quorum skips more than per-token routing."""
    import json

    from compresskit.cli import main

    run = _saved_wide_run(tiny_model_dir, tmp_path)
    common = ["eval", str(run / "model"), "--tasks", "perplexity", "--batch-size", "4", "--engine", "transformers"]
    common += ["--perplexity-docs", "3", "--max-length", "64"]
    out = {}
    for name, extra in (("own", []), ("agreed", ["--option", "consensus.quorum=1.0"])):
        assert main([*common, *extra, "--output", str(tmp_path / name)]) == 0, capsys.readouterr().err
        out[name] = json.loads((tmp_path / name / "results.json").read_text())
    assert out["agreed"]["recipe"]["options"] == {"consensus": {"quorum": 1.0}}
    assert "options" not in out["own"]["recipe"]
    assert out["agreed"]["sparsity"]["macs"] > out["own"]["sparsity"]["macs"]
    assert out["agreed"]["metrics"]["perplexity"] != out["own"]["metrics"]["perplexity"]


def test_the_rule_a_run_was_trained_under_is_its_last_stage_s():
    """``trained_rule``: the rule of the last training stage (None where that stage ran per token); the pruner's
    ``trained_options`` give it as the executor setting whose ``--option`` text gives the rule back."""
    from compresskit.options import configured_executor, option_text, parse_option
    from compresskit_wide.consensus import trained_rule
    from compresskit_wide.pruner import WidePruner

    ruled = {"name": "lora", "config": {"consensus": {"quorum": 0.0, "follow": 1.25, "attention_share": "own"}}}
    plain = {"name": "router", "config": {"consensus": None}}
    assert trained_rule({"training": [plain, ruled]}) == Consensus(quorum=0.0, follow=1.25, attention_share="own")
    assert trained_rule({"training": [ruled, plain]}) is None
    assert trained_rule({"training": []}) is None and trained_rule(None) is None
    assert WidePruner.trained_options({"training": [ruled, plain]}) == {}
    for rule in (
        Consensus(quorum=0.0, follow=1.25, attention_share="own"),
        Consensus(),
        Consensus(over="tile", tile=32, budget=0.6),
    ):
        recipe = {"training": [{"name": "lora", "config": {"consensus": rule.model_dump(mode="json")}}]}
        text = option_text(WidePruner.trained_options(recipe))
        assert configured_executor(WidePruner, parse_option(text)).config.consensus == rule, text


@pytest.mark.slow
def test_a_run_trained_under_a_rule_says_so_where_it_is_scored_per_token(tiny_model_dir, tmp_path, capsys):
    """A run whose last training stage ran a rule in its loop, scored per token (by its own evaluation, or by
    ``compresskit eval`` without ``--option``), says so in one line with the ``--option`` value that
    scores it as trained; scored under that rule it does not."""
    from compresskit.cli import main
    from compresskit.progress import Progress

    rule = {"quorum": 0.0, "follow": 1.25}
    stage = {"name": "router", "config": {"steps": 1, "batch_size": 2, "seq_len": 16, "consensus": rule}}
    logged = []

    class Recording(Progress):
        def log(self, message: str) -> None:
            logged.append(message)

    run = _saved_wide_run(tiny_model_dir, tmp_path, training=[stage], progress=Recording())
    said = "its last training stage ran it with settings it is not scored with here"
    assert [line for line in logged if said in line] == [
        f"run {run}: {said} (consensus None), where such a model may do worse (--option "
        "consensus.quorum=0.0,consensus.follow=1.25 scores it as it was trained)"
    ]
    common = ["eval", str(run / "model"), "--tasks", "perplexity", "--batch-size", "2", "--engine", "transformers"]
    common += ["--perplexity-docs", "2", "--max-length", "32"]
    assert main(common) == 0
    err = " ".join(capsys.readouterr().err.split())
    assert f"{run / 'model'}: {said}" in err and "--option consensus.quorum=0.0,consensus.follow=1.25 scores" in err
    assert main([*common, "--option", "consensus.quorum=0.0,consensus.follow=1.25"]) == 0
    assert said not in " ".join(capsys.readouterr().err.split())


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--option", "consensus.quorum=0.5"], "is no saved run of a method, so it has no settings of one"),
        (["--option", "consensus.budget"], "'consensus.budget' is no KEY=VALUE pair"),
        (["--consensus", "quorum=0.5"], "--option consensus.quorum=0.5"),
    ],
)
def test_eval_refuses_consensus_it_cannot_run(tiny_model_dir, capsys, argv, message):
    from compresskit.cli import main

    assert main(["eval", str(tiny_model_dir), "--tasks", "perplexity", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_consensus_is_a_training_option_of_the_wide_pruner_only(tiny_model_dir, tmp_path):
    from compresskit.errors import RecipeError
    from compresskit.recipe import load_recipe

    recipe = {
        "model": {"name_or_path": str(tiny_model_dir)},
        "pruner": {"name": "static-width"},
        "training": [{"name": "lora", "config": {"steps": 1, "consensus": {"quorum": 0.5}}}],
        "output": {"dir": str(tmp_path / "out")},
    }
    with pytest.raises(RecipeError, match=r"training.0.config.consensus"):
        load_recipe(recipe)
    recipe["pruner"] = {"name": "wide"}
    recipe["training"][0]["config"]["consensus"]["budget"] = 1.5
    with pytest.raises(RecipeError, match=r"training.0.config.consensus.budget"):
        load_recipe(recipe)


@pytest.mark.parametrize("gradient", ["own", "set"])
def test_a_router_stage_trains_with_consensus_and_leaves_per_token_routing(tiny_model_dir, tmp_path, gradient):
    """The stage's rule runs in its loop only (with either gradient): the saved run routes per token until a
    runtime or an evaluation asks for consensus."""
    from compresskit import load

    config = {"steps": 2, "batch_size": 4, "seq_len": 16, "consensus": {"quorum": 0.5}, "consensus_gradient": gradient}
    run = _saved_wide_run(tiny_model_dir, tmp_path, training=[{"name": "router", "config": config}])
    model, _, _ = load(run / "model")
    assert all(p.rule is None for _, p in routed_projections(model))


@pytest.mark.slow
def test_a_lora_stage_learns_under_consensus_with_the_routers_frozen(tiny_model_dir, tmp_path):
    """``recipes/study/wide-smollm2-50-lora-*.yaml``: routers trained per token, then a LoRA stage with the rule
    in its loop and ``train_pruner_params: false``. The routers come out as the router stage left them, the
    adapters learn, the stage's losses are not those of the same stage per token (the rule ran), and its loss
    holds the sparsity term: without it the adapters learnt to make the frozen routers run more groups (on
    SmolLM2 the MACs skipped fell from 0.25 to 0.14 over the stage). The term counts the tokens' own decisions;
    what the rule ran is logged beside it (``sparsity_run_macs``)."""
    import json

    from compresskit import load

    router = {"name": "router", "config": {"steps": 2, "batch_size": 4, "seq_len": 16}}
    lora = {"steps": 2, "batch_size": 4, "seq_len": 16, "train_pruner_params": False}
    runs = {"router": _saved_wide_run(tiny_model_dir, tmp_path / "router", training=[router])}
    for name, rule in (("per-token", {}), ("follow", {"consensus": {"quorum": 0.0, "follow": 1.0}})):
        stages = [router, {"name": "lora", "config": {**lora, **rule}}]
        runs[name] = _saved_wide_run(tiny_model_dir, tmp_path / name, training=stages)
    routers = {}
    for name, run in runs.items():
        model, _, _ = load(run / "model")
        routers[name] = router_state_dict(model, "")
        if name != "router":
            adapters = [p for n, p in model.named_parameters() if "lora_B" in n]
            assert adapters and any(p.abs().sum() > 0 for p in adapters), name  # B starts at zero
    for name in ("per-token", "follow"):
        assert routers[name].keys() == routers["router"].keys()
        assert all(torch.equal(routers[name][k], v) for k, v in routers["router"].items()), name
    losses = {}
    for name in ("per-token", "follow"):
        stages = {s["stage"]: s["history"] for s in json.loads((runs[name] / "results.json").read_text())["training"]}
        losses[name] = [h["lm_loss"] for h in stages["lora"]]
        assert all(h["loss"] != h["lm_loss"] for h in stages["router"] + stages["lora"]), name
        assert all(("sparsity_run_macs" in h) == (name == "follow") for h in stages["lora"]), name
    assert len(losses["follow"]) == 2 and losses["follow"] != losses["per-token"]


def test_bench_times_each_consensus_rule_beside_per_token_routing(capsys, tmp_path):
    """``compresskit bench --shape NAME --option consensus.KEY=VALUE``: a row per rule, on the same routed model,
    each with the sparsity of what ran; a pruner whose runtime takes no setting is one line and exit 2."""
    import json

    from compresskit.cli import main

    out = tmp_path / "bench"
    argv = ["bench", "--shape", "tiny", "--prompt", "16", "--new-tokens", "3", "--repeats", "1", "--batch", "4"]
    argv += ["--transformers", "off", "--option", "consensus.quorum=1.0"]
    argv += ["--option", "consensus.quorum=0,consensus.budget=0.25,consensus.share=own"]
    assert main([*argv, "--output", str(out)]) == 0, capsys.readouterr().err
    rows = {r["model"]: r for r in json.loads((out / "bench.json").read_text())["results"]}
    agreed, capped = rows["consensus (quorum 1.0)"], rows["consensus (quorum 0.0, budget 0.25, share own)"]
    assert agreed["sparsity_macs"] > rows["compressed"]["sparsity_macs"]  # only what every token wants
    assert capped["sparsity_macs"] > 0.6  # at most a quarter of the groups, and only the token's own
    assert main(["bench", "--shape", "tiny", "--method", "dynamic-depth", "--option", "consensus.quorum=0.5"]) == 2
    assert "executor depth-skip: consensus: unknown key 'consensus'" in capsys.readouterr().err
    assert main([*argv[:-2], "--option", "consensus.quorum=2"]) == 2
    assert "consensus.quorum" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------
# tile-coherent routing (over: tile): the tokens of each tile of a sequence share one set


def test_tile_coherent_rule_is_batch_consensus_within_each_tile():
    """``over: tile`` against a loop: each tile of ``tile`` positions of each sequence decides as a batch of its
    real tokens would at one position (ragged lengths, padding, a last tile cut short)."""
    gen = torch.Generator().manual_seed(0)
    margin = torch.randint(-8, 9, (3, 37, 6), generator=gen).float() / 4
    own, valid = margin >= 0, torch.rand(3, 37, generator=gen) > 0.2
    for budget, quorum, share in itertools.product([1.0, 0.5, 0.2], [0.0, 0.5], ["set", "own"]):
        rule = Consensus(over="tile", tile=16, budget=budget, quorum=quorum, share=share)
        got = consensus_execute(margin, own, valid, rule)
        want = own.clone()
        for b, start in itertools.product(range(3), range(0, 37, 16)):
            idx = [i for i in range(start, min(start + 16, 37)) if valid[b, i]]
            if len(idx) > 1:
                batch_rule = Consensus(budget=budget, quorum=quorum, share=share)
                alone = consensus_execute(margin[b, idx][:, None], own[b, idx][:, None], None, batch_rule)
                want[b, idx] = alone[:, 0]
        assert torch.equal(got[valid], want[valid]), (budget, quorum, share)
    # the union of a tile's choices (quorum 0, no cap), each token its own within it: per-token routing exactly
    union = Consensus(over="tile", tile=16, quorum=0.0, share="own")
    assert torch.equal(consensus_execute(margin, own, valid, union)[valid], own[valid])


def test_a_tile_size_off_the_kernels_tiles_is_refused():
    with pytest.raises(ValueError, match="give a multiple of 16 \\(e.g. 16\\), not 20"):
        Consensus(over="tile", tile=20)
    with pytest.raises(ValueError, match="tile"):
        Consensus(over="tile", tile=8)
    with pytest.raises(ValueError, match="over"):
        Consensus(over="sequence")


@pytest.mark.parametrize("share", ["set", "own"])
def test_runtime_blocks_under_tile_coherent_routing_match_the_routed_modules(tiny_model_dir, share):
    """WIDE's runtime blocks under ``over: tile`` give the routed modules' logits under the same rule: a prompt
    of three tiles (the last one short) decides tile by tile, even alone; a decode step (one token a tile)
    decides per token."""
    model, pruner = _wide_model(tiny_model_dir)
    executor = _executor(over="tile", tile=16, quorum=0.5, budget=0.5, share=share)
    fast = Runtime(model, executor=executor, compile=False, graphs=False)
    plain = Runtime(model, executor=_executor(), compile=False, graphs=False)
    ids = torch.randint(2, 300, (2, 40), generator=torch.Generator().manual_seed(0))
    caches = [rt.new_cache(2, 41) for rt in (fast, plain)]
    got, per_token = (rt.forward(ids, c) for rt, c in zip((fast, plain), caches, strict=True))
    executor.convert(model)
    with torch.no_grad():
        want = model(ids).logits
        alone = model(ids[:1]).logits  # a sequence's tiles are its own: batch mates change nothing
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(alone, want[:1], rtol=1e-5, atol=1e-5)
    assert not torch.allclose(got, per_token, atol=1e-3)
    set_consensus(model, None)
    # a decode step, one token a tile, decides per token: from the same cache, the plain blocks' step
    twin = copy.deepcopy(caches[0])
    token = torch.tensor([7, 8])
    torch.testing.assert_close(fast.decode(token, caches[0]), plain.decode(token, twin), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("share", ["set", "own"])
def test_tile_coherent_routing_on_the_kernels(tiny_model_dir, monkeypatch, share):
    """``over: tile`` on the Triton kernels (in the CPU interpreter without a GPU, natively on one): the router kernels
    give margins, the consensus kernel decides each tile, down and o read each tile's set (the tile reduction:
    two sequences of 20 tokens, tiles of 16 and 4), and the prompt's logits are the routed modules'."""
    from compresskit_wide.kernels import ops

    tiles = []
    reduce = ops.triton_tile_reduce_gemm
    monkeypatch.setattr(ops, "triton_tile_reduce_gemm", lambda *a, **k: tiles.append(k) or reduce(*a, **k))
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model, pruner = _wide_model(tiny_model_dir)
    model = model.to(device)
    pruner.reset_sparsity(model)
    executor = _executor("triton", over="tile", tile=16, quorum=0.0, budget=0.5, share=share)
    fast = Runtime(model, executor=executor, compile=False, graphs=False)
    ids = torch.randint(2, 300, (2, 20), generator=torch.Generator().manual_seed(4)).to(device)
    got = fast.forward(ids, fast.new_cache(2, 21))
    assert len(tiles) == 2 * model.config.num_hidden_layers  # o and down of every layer
    assert all(k == {"tile": 16, "tokens": 20, "rows_agree": False} for k in tiles)  # each row's own groups read
    executor.convert(model)
    with torch.no_grad():
        want = model(ids).logits
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    set_consensus(model, None)


def _quality_script():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "benchmarks" / "consensus_quality.py"
    spec = importlib.util.spec_from_file_location("consensus_quality", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_quality_script_scores_a_tile_rule_once_and_each_batch_rule_per_batch():
    """``benchmarks/consensus_quality.py``'s plan: per token once a run, a batch rule at every batch size, a
    tile rule (which shares within a sequence) once, at the largest batch; ``--only`` keeps a run to its rules.
    Its table gives each row against its own run's per-token score and against the first run's."""
    q = _quality_script()
    rules = dict(map(q.parse_rule, ["maj=quorum=0.5", "t64=over=tile,tile=64,quorum=0,follow=1.0"]))
    assert rules["t64"] == {"over": "tile", "tile": "64", "quorum": 0.0, "follow": 1.0}
    cells = q.plan({"a": "A", "b": "B"}, rules, {"b": ["t64"]}, [4, 8], None)
    assert [(c["run"], c["rule_name"], c["batch"]) for c in cells] == [
        ("a", "per-token", 16), ("a", "maj", 4), ("a", "maj", 8), ("a", "t64", 8),
        ("b", "per-token", 16), ("b", "t64", 8),
    ]  # fmt: skip
    row = {"code_ppl": 1.0, "legal_ppl": 1.0, "piqa_acc": 0.5, "next_sentence_acc": 0.5, "zero_shot_avg": 0.5}
    rows = [
        {**row, "run": "a", "rule": "per-token", "batch": 16, "held_out_ppl": 50.0, "macs_skipped": 0.4},
        {**row, "run": "b", "rule": "per-token", "batch": 16, "held_out_ppl": 100.0, "macs_skipped": 0.4},
        {**row, "run": "b", "rule": "t64", "batch": 4, "held_out_ppl": 200.0, "macs_skipped": 0.3},
    ]
    last = q.markdown(rows, {"date": "today"}).strip().splitlines()[-1]
    assert last.startswith("| b | t64 | 4 | 200.00 | 2.000 | 4.000 |")


def test_quality_script_replots_a_table_from_its_file_or_folder(tmp_path, capsys, monkeypatch):
    """``--replot`` takes a quality.json or its folder and writes the table and plot beside it; a missing file
    or one that is no such table is one error line and exit 2."""
    import json
    import sys

    q = _quality_script()
    row = {"code_ppl": 1.0, "legal_ppl": 1.0, "piqa_acc": 0.5, "next_sentence_acc": 0.5, "zero_shot_avg": 0.5}
    rows = [
        {**row, "run": "a", "rule": "per-token", "batch": 16, "held_out_ppl": 50.0, "macs_skipped": 0.4},
        {**row, "run": "a", "rule": "maj", "batch": 8, "held_out_ppl": 60.0, "macs_skipped": 0.3},
    ]
    (tmp_path / "quality.json").write_text(json.dumps({"meta": {"date": "today"}, "rows": rows}))
    for given in (tmp_path, tmp_path / "quality.json"):
        monkeypatch.setattr(sys, "argv", ["consensus_quality.py", "--replot", str(given)])
        q.main()
        assert "| a | maj | 8 | 60.00 |" in (tmp_path / "quality.md").read_text()
        assert (tmp_path / "quality.png").stat().st_size > 0
    (tmp_path / "other.json").write_text(json.dumps([1, 2]))
    for bad, message in ((tmp_path / "none.json", "cannot read"), (tmp_path / "other.json", "is no quality table")):
        monkeypatch.setattr(sys, "argv", ["consensus_quality.py", "--replot", str(bad)])
        with pytest.raises(SystemExit) as exit_info:
            q.main()
        assert exit_info.value.code == 2
        err = capsys.readouterr().err
        assert message in err and "Traceback" not in err


@pytest.mark.parametrize("rule", [Consensus(quorum=0.5), Consensus(over="tile", tile=16, quorum=0.0, budget=0.5)])
def test_the_set_gradient_is_the_mean_of_the_voters(tiny_model_dir, rule):
    """``consensus_gradient: set``: the same forward as ``own`` (the shared set), and each voter's soft decision
    gets the mean over its position's (or tile's) real voters of what the loss says of each token's group,
    where ``own`` gives it its own token's; a position with one real voter keeps its own gradient."""
    model, tok = load_model(str(tiny_model_dir), dtype="float32", device="cpu")
    cls = plugins.load("pruner", "wide")
    cls(cls.Config(ffn_group_size=16, router_rank=8)).prepare(
        model, RunContext(model_config=model.config, tokenizer=tok, seed=0)
    )
    proj = next(p for _, p in routed_projections(model) if p.router is not None)
    gen = torch.Generator().manual_seed(3)
    b, t, g = 4, 20, proj.groups
    logits = torch.randn(b, t, g, 2, generator=gen)
    soft = torch.rand(b, t, g, generator=gen, requires_grad=True)
    valid = torch.ones(b, t)
    valid[1:, -1] = 0.0  # the batch rule's last position: one real voter
    weight = torch.randn(b, t, g, generator=gen)
    out, grads = {}, {}
    for gradient in ("own", "set"):
        set_consensus(model, rule, gradient)
        execute = (soft > 0.5).float() + soft - soft.detach()
        soft.grad = None
        out[gradient] = proj.rule.agree(logits, execute, valid)
        (out[gradient] * weight).sum().backward()
        grads[gradient] = soft.grad.clone()
    torch.testing.assert_close(out["own"], out["set"], rtol=0, atol=0)
    torch.testing.assert_close(grads["own"], weight)
    real = valid[..., None]  # a real voter gets its set's mean over the real voters; a padded token its own
    if rule.over == "batch":
        want = torch.where(real > 0, (weight * real).sum(0, keepdim=True) / real.sum(0, keepdim=True), weight)
        want[:, -1] = weight[:, -1]  # one real voter there: per-token routing, its own gradient
    else:  # each sequence's tiles (positions 0-15, 16-19), every one with several real voters
        means = [
            ((weight[:, lo:hi] * real[:, lo:hi]).sum(1, keepdim=True) / real[:, lo:hi].sum(1, keepdim=True)).expand(
                -1, hi - lo, -1
            )
            for lo, hi in ((0, 16), (16, 20))
        ]
        want = torch.where(real > 0, torch.cat(means, 1), weight)
    torch.testing.assert_close(grads["set"], want)
    with pytest.raises(ValueError, match="gradient must be"):
        set_consensus(model, rule, "mean")
    set_consensus(model, None)


def test_a_stage_takes_the_set_gradient_only_with_a_shared_set(tiny_model_dir, tmp_path):
    """``consensus_gradient: set`` needs ``consensus`` with ``share: set`` for every router (one line naming the
    field); at its default the field stays out of the resolved recipe, so earlier runs keep their hash."""
    from compresskit.errors import RecipeError
    from compresskit.recipe import load_recipe

    stage = {"name": "router", "config": {"steps": 1, "consensus_gradient": "set"}}
    recipe = {
        "model": {"name_or_path": str(tiny_model_dir)},
        "pruner": {"name": "wide"},
        "training": [stage],
        "output": {"dir": str(tmp_path / "out")},
    }
    with pytest.raises(RecipeError, match=r"consensus_gradient: set .* needs consensus with share: set \(given: no"):
        load_recipe(recipe)
    stage["config"]["consensus"] = {"quorum": 0.5, "share": "own"}
    with pytest.raises(RecipeError, match=r"given: consensus share: own"):
        load_recipe(recipe)
    stage["config"]["consensus"] = {"quorum": 0.5, "attention_share": "own"}  # the attention routers' own
    with pytest.raises(RecipeError, match=r"given: consensus attention_share: own"):
        load_recipe(recipe)
    stage["config"]["consensus"] = {"quorum": 0.5, "share": "set"}
    assert load_recipe(recipe).to_dict()["training"][0]["config"]["consensus_gradient"] == "set"
    stage["config"].pop("consensus_gradient")
    assert "consensus_gradient" not in load_recipe(recipe).to_dict()["training"][0]["config"]
