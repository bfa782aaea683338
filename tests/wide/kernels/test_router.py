"""The fused routing decision against ``decide(GroupRouter(x))``."""

import pytest
import torch

pytest.importorskip("triton")

from kernel_helpers import DEVICE  # noqa: E402

from compresskit.routing import GroupRouter, decide  # noqa: E402
from compresskit_wide.kernels.gemm_reduce import torch_router_shares  # noqa: E402
from compresskit_wide.kernels.router import (  # noqa: E402
    torch_router_decide,
    torch_router_decide_from_shares,
    triton_router_decide,
    triton_router_decide_from_shares,
)

pytestmark = pytest.mark.triton


@pytest.mark.parametrize("m", [1, 3, 17, 40])
@pytest.mark.parametrize(
    ("d", "rank", "groups"), [(200, 8, 3), (96, 32, 8), pytest.param(64, 5, 130, marks=pytest.mark.slow)]
)
@pytest.mark.parametrize("bias", [0.0, 50.0, -50.0])
@pytest.mark.parametrize(("split", "block_g"), [(None, None), (1, None), (3, 16), (3, 128)])
def test_matches_the_router_and_decide(m, d, rank, groups, bias, split, block_g):
    """D no multiple of the K step, a rank below tl.dot's 16 and above it, more groups than a
    program's block; biases that make every group execute (+50), none (-50) or about half (0); in
    one launch, with D in three shares, with the default split; 16 groups a program or 128."""
    torch.manual_seed(m + d + groups)
    router = GroupRouter(d, groups, rank).to(DEVICE)
    with torch.no_grad():
        router.up.bias.view(groups, 2)[:, 0] = bias  # the execute logits
    x = torch.randn(2, m, d, device=DEVICE)
    ref = decide(router(x), sample=False, tau=1.0).reshape(2 * m, groups)
    args = (x.reshape(2 * m, d), router.down.weight, router.down.bias, router.up.weight, router.up.bias)
    assert torch.equal(torch_router_decide(*args), ref)
    got = triton_router_decide(*args, split=split, block_g=block_g)
    assert got.dtype == torch.float32 and torch.equal(got, ref)
    # the other shape of the deciding launch than the default at these sizes (a program a token block)
    assert torch.equal(triton_router_decide(*args, split=split, block_g=block_g, finish="tile"), ref)
    if split is None:  # as a bool mask (what the executor asks for)
        assert torch.equal(torch_router_decide(*args, as_bool=True), ref.bool())
        as_bool = triton_router_decide(*args, block_g=block_g, as_bool=True)
        assert as_bool.dtype == torch.bool and torch.equal(as_bool, ref.bool())
    if bias:
        assert torch.all(got == (1.0 if bias > 0 else 0.0))


@pytest.mark.parametrize("m", [3, 40, 130])
@pytest.mark.parametrize(("block_m", "block_k", "split"), [(32, 16, None), (64, 32, 2), (128, 64, 1)])
@pytest.mark.parametrize("finish", ["tile", "token"])
def test_token_and_column_blocks(m, block_m, block_k, split, finish):
    """Larger token blocks and other K steps (the prefill launch shapes): the same decisions, with a
    partial token block and D in one or more shares, decided by a program a token block or a token."""
    torch.manual_seed(m + block_m)
    router = GroupRouter(200, 12, 8).to(DEVICE)
    x = torch.randn(m, 200, device=DEVICE)
    ref = decide(router(x), sample=False, tau=1.0)
    args = (x, router.down.weight, router.down.bias, router.up.weight, router.up.bias)
    got = triton_router_decide(*args, split=split, block_m=block_m, block_k=block_k, finish=finish, as_bool=True)
    assert torch.equal(got, ref.bool())


def test_the_deciding_launch_follows_the_token_count(monkeypatch):
    """A program a token up to ``policy.ROUTER_TOKEN_FINISH_MAX_M`` tokens, a program a token block beyond;
    both decide the same, whichever the policy's bound."""
    from compresskit_wide.kernels import policy
    from compresskit_wide.kernels.router import router_finish

    bound = policy.ROUTER_TOKEN_FINISH_MAX_M
    assert (router_finish(1), router_finish(bound), router_finish(bound + 1)) == ("token", "token", "tile")
    torch.manual_seed(3)
    router = GroupRouter(96, 20, 8).to(DEVICE)
    x = torch.randn(33, 96, device=DEVICE)
    args = (x, router.down.weight, router.down.bias, router.up.weight, router.up.bias)
    ref = decide(router(x), sample=False, tau=1.0).bool()
    for bound in (32, 33):  # 33 tokens past the bound, then at it
        monkeypatch.setattr(policy, "ROUTER_TOKEN_FINISH_MAX_M", bound)
        assert router_finish(33) == ("tile" if bound == 32 else "token")
        assert torch.equal(triton_router_decide(*args, as_bool=True), ref)


def test_validates_its_tensors():
    x, wd, bd = torch.zeros(2, 8), torch.zeros(4, 8), torch.zeros(4)
    with pytest.raises(ValueError, match="router tensors do not fit"):
        triton_router_decide(x, wd, bd, torch.zeros(6, 4), torch.zeros(5))
    with pytest.raises(ValueError, match="router tensors do not fit"):
        triton_router_decide(x, wd.half(), bd, torch.zeros(6, 4), torch.zeros(6))
    with pytest.raises(ValueError, match="split must be >= 1, got 0"):
        triton_router_decide(x, wd, bd, torch.zeros(6, 4), torch.zeros(6), split=0)
    with pytest.raises(ValueError, match="block_g must be a power of two >= 16, got 24"):
        triton_router_decide(x, wd, bd, torch.zeros(6, 4), torch.zeros(6), block_g=24)
    with pytest.raises(ValueError, match="block_m must be a power of two >= 16, got 8"):
        triton_router_decide(x, wd, bd, torch.zeros(6, 4), torch.zeros(6), block_m=8)
    with pytest.raises(ValueError, match="finish must be one of tile, token, got 'row'"):
        triton_router_decide(x, wd, bd, torch.zeros(6, 4), torch.zeros(6), finish="row")


@pytest.mark.parametrize("m", [1, 3, 16])
@pytest.mark.parametrize(("d", "rank", "groups"), [(200, 8, 3), (96, 32, 40), (64, 5, 130)])
@pytest.mark.parametrize("bias", [0.0, 50.0, -50.0])
@pytest.mark.parametrize(
    "block_g", [pytest.param(1, marks=pytest.mark.slow), 32]
)  # (1: a program a group, slow in the interpreter)
def test_decides_from_shares_as_the_router(m, d, rank, groups, bias, block_g):
    """The decision's launch alone, from the bottleneck's shares (as the reduction kernel before it
    writes them): ``decide(GroupRouter(x))`` wherever a group's two logits are not within fp32
    rounding of each other; all groups on (+50) and off (-50) exactly."""
    torch.manual_seed(m + d + groups + 2)
    router = GroupRouter(d, groups, rank).to(DEVICE)
    with torch.no_grad():
        router.up.bias.view(groups, 2)[:, 0] = bias
    x = torch.randn(m, d, device=DEVICE)
    logits = router(x)
    ref = decide(logits, sample=False, tau=1.0).bool()
    clear = (logits[..., 1] - logits[..., 0]).abs() > 1e-4 * (1 + logits.abs().amax(-1))
    shares = torch_router_shares(x, router.down.weight)
    tail = (router.down.bias, router.up.weight, router.up.bias)
    for got in (
        torch_router_decide_from_shares(shares, *tail, as_bool=True),
        triton_router_decide_from_shares(shares, *tail, block_g=block_g, as_bool=True),
    ):
        assert got.dtype == torch.bool and torch.equal(got[clear], ref[clear])
    assert clear.float().mean() > 0.98
    as_float = triton_router_decide_from_shares(shares, *tail)
    assert as_float.dtype == torch.float32
    if bias:
        assert torch.all(as_float == (1.0 if bias > 0 else 0.0))


def test_the_decision_from_shares_validates_its_tensors():
    shares, bd, wu, bu = torch.zeros(3, 2, 4), torch.zeros(4), torch.zeros(6, 4), torch.zeros(6)
    with pytest.raises(ValueError, match="router tensors do not fit"):
        triton_router_decide_from_shares(shares, bd[:3], wu, bu)
    with pytest.raises(ValueError, match="router tensors do not fit"):
        triton_router_decide_from_shares(shares.double(), bd, wu, bu)
    with pytest.raises(ValueError, match="block_g must be a power of two >= 1, got 3"):
        triton_router_decide_from_shares(shares, bd, wu, bu, block_g=3)


@pytest.mark.parametrize("m", [1, 3, 40])
@pytest.mark.parametrize("groups", [3, 40, pytest.param(130, marks=pytest.mark.slow)])
@pytest.mark.parametrize("bias", [0.0, 50.0, -50.0])
def test_both_launches_count_their_decision(m, groups, bias):
    """With ``counts`` each deciding launch adds its tokens and their executed groups to what the
    counters held (several group blocks and token blocks a launch, all on, all off), as the
    reference counting does; the decision itself is unchanged."""
    from compresskit_wide.kernels.router import torch_count

    torch.manual_seed(m + groups)
    router = GroupRouter(72, groups, 8).to(DEVICE)
    with torch.no_grad():
        router.up.bias.view(groups, 2)[:, 0] = bias
    x = torch.randn(m, 72, device=DEVICE)
    args = (router.down.weight, router.down.bias, router.up.weight, router.up.bias)
    shares = torch_router_shares(x, router.down.weight)
    start = torch.tensor([5.0, 7.0], dtype=torch.float64, device=DEVICE)
    for decide_counted, decide_plain in (
        *(
            (
                lambda c, f=finish: triton_router_decide(x, *args, block_g=16, finish=f, as_bool=True, counts=c),
                lambda f=finish: triton_router_decide(x, *args, block_g=16, finish=f, as_bool=True),
            )
            for finish in ("tile", "token")
        ),
        (
            lambda c: triton_router_decide_from_shares(shares, *args[1:], block_g=16, as_bool=True, counts=c),
            lambda: triton_router_decide_from_shares(shares, *args[1:], block_g=16, as_bool=True),
        ),
    ):
        counts, want = start.clone(), start.clone()
        got = decide_counted(counts)
        assert torch.equal(got, decide_plain())
        torch_count(got, want)
        assert torch.equal(counts, want) and want[0] == 5 + m
        if bias:
            assert want[1] == 7 + (m * groups if bias > 0 else 0)


def test_counts_are_validated():
    x, wd, bd, wu, bu = torch.zeros(2, 8), torch.zeros(4, 8), torch.zeros(4), torch.zeros(6, 4), torch.zeros(6)
    for bad in (torch.zeros(2), torch.zeros(3, dtype=torch.float64), torch.zeros(4, dtype=torch.float64)[::2]):
        with pytest.raises(ValueError, match=r"counts must be a contiguous float64 \[2\]"):
            triton_router_decide(x, wd, bd, wu, bu, counts=bad)
        with pytest.raises(ValueError, match=r"counts must be a contiguous float64 \[2\]"):
            triton_router_decide_from_shares(torch.zeros(3, 2, 4), bd, wu, bu, counts=bad)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize(
    ("m", "d", "groups", "rank"), [(1, 72, 40, 8), (3, 100, 7, 8), (16, 64, 130, 8), (1, 4096, 112, 32)]
)
def test_the_decision_with_the_add_and_norm(dtype, m, d, groups, rank):
    """``router_norm_from_shares``: the decision of the shares, ``x + delta`` exactly as the add
    rounds, Llama's RMSNorm of it, and the counts, in one launch (D no power of two, one group
    block and several, and Llama-3.1-8B's FFN router: 4,096 wide, 256 shares, rank 32). (bf16 on the
    GPU only: the interpreter rounds it by truncation.)"""
    if dtype == torch.bfloat16 and str(DEVICE) == "cpu":
        pytest.skip("bf16 rounding differs in Triton's interpreter")
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    from compresskit_wide.kernels.router import (
        torch_count,
        torch_router_norm_from_shares,
        triton_router_norm_from_shares,
    )

    torch.manual_seed(m + d)
    router = GroupRouter(d, groups, rank).to(DEVICE)
    x, delta = (torch.randn(m, d, device=DEVICE).to(dtype) for _ in range(2))
    w = (1 + torch.randn(d, device=DEVICE) / 4).to(dtype)
    shares = torch_router_shares(x + delta, router.down.weight)
    args = (shares, router.down.bias, router.up.weight, router.up.bias, x, delta, w, 1e-5)
    want_execute, want_x, want_h = torch_router_norm_from_shares(*args)
    llama_norm = LlamaRMSNorm(d, eps=1e-5).to(DEVICE, dtype)  # the norm the kernel stands in for
    llama_norm.weight.data.copy_(w)
    assert torch.equal(want_h, llama_norm(want_x))
    counts, want_counts = (torch.full((2,), 3.0, dtype=torch.float64, device=DEVICE) for _ in range(2))
    execute, x_new, h = triton_router_norm_from_shares(*args, block_g=16, counts=counts)
    torch_count(want_execute, want_counts)
    assert execute.dtype == torch.bool and torch.equal(execute, want_execute)
    assert torch.equal(x_new, want_x) and torch.equal(counts, want_counts)
    torch.testing.assert_close(h, want_h, rtol=1e-3, atol=1e-3)  # (the mean of squares in another order)
    assert torch.equal(triton_router_norm_from_shares(*args)[0], want_execute)  # not counting


def test_the_decision_with_the_norm_validates_its_tensors():
    from compresskit_wide.kernels.router import triton_router_norm_from_shares

    shares, bd, wu, bu = torch.zeros(3, 2, 4), torch.zeros(4), torch.zeros(6, 4), torch.zeros(6)
    x = torch.zeros(2, 8)
    with pytest.raises(ValueError, match="norm tensors do not fit 2 tokens' shares"):
        triton_router_norm_from_shares(shares, bd, wu, bu, x, x[:, :4], torch.zeros(8), 1e-5)
    with pytest.raises(ValueError, match="norm tensors do not fit 2 tokens' shares"):
        triton_router_norm_from_shares(shares, bd, wu, bu, x, x, torch.zeros(7), 1e-5)
    with pytest.raises(ValueError, match="router tensors do not fit"):
        triton_router_norm_from_shares(shares, bd[:3], wu, bu, x, x, torch.zeros(8), 1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize(
    ("m", "d", "groups", "rank"),
    [(1, 72, 40, 8), (17, 300, 7, 8), pytest.param(130, 256, 130, 5, marks=pytest.mark.slow)],
)
@pytest.mark.parametrize(("with_delta", "columns"), [(True, None), (False, None), (True, 48)])
def test_the_routers_own_shares(dtype, m, d, groups, rank, with_delta, columns):
    """``router_shares``: the first launch alone writes the shares of ``x + delta`` (the add rounded as the
    residual add rounds it), one a ``policy.ROUTER_SHARE_COLUMNS`` columns or the given ones (D no multiple of
    them; a share that is no whole number of K steps), for one token and a partial token block, a rank below
    ``tl.dot``'s 16; the decision from them, with the add and the norm, is the router's on ``x + delta``. (bf16
    on the GPU only: the interpreter rounds it by truncation.)"""
    if dtype == torch.bfloat16 and str(DEVICE) == "cpu":
        pytest.skip("bf16 rounding differs in Triton's interpreter")
    from compresskit_wide.kernels import policy
    from compresskit_wide.kernels.router import triton_router_norm_from_shares, triton_router_shares

    torch.manual_seed(m + d + rank)
    router = GroupRouter(d, groups, rank).to(DEVICE)
    x, delta = (torch.randn(m, d, device=DEVICE).to(dtype) for _ in range(2))
    summed = x + delta if with_delta else x
    w_down = router.down.weight.detach()
    got = triton_router_shares(x, w_down, delta if with_delta else None, columns=columns)
    width = columns or policy.ROUTER_SHARE_COLUMNS
    want = torch_router_shares(summed, w_down, width)
    assert got.shape == want.shape == (-(-d // width), m, rank)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    ref = decide(router(summed.float()), sample=False, tau=1.0).bool()
    norm_w = torch.ones(d, device=DEVICE, dtype=dtype)
    args = (router.down.bias, router.up.weight, router.up.bias, x, delta, norm_w, 1e-5)
    execute, x_new, _ = triton_router_norm_from_shares(got, *args)
    assert torch.equal(execute, ref) and torch.equal(x_new, x + delta)


@pytest.mark.parametrize("m", [3, 17, 300])
def test_the_routers_own_shares_step_a_power_of_two(monkeypatch, m):
    """With the GPU's tiles (not the interpreter's), the first launch's K step is a power of two that divides
    the share, whatever its width (Triton compiles no other ``tl.arange`` on the GPU)."""
    from compresskit_wide.kernels import router

    steps = []
    monkeypatch.setattr(router, "interpreted", lambda: False)
    monkeypatch.setattr(router, "_launch_partial", lambda x, delta, w, chunk, bm, bk: steps.append((chunk, bk)))
    x, w = torch.zeros(m, 512), torch.zeros(8, 512)
    for columns in (16, 48, 80, 96, 128, 256, 512):
        router.triton_router_shares(x, w, columns=columns)
    assert [c for c, _ in steps] == [16, 48, 80, 96, 128, 256, 512]
    for columns, step in steps:
        assert step >= 16 and step & (step - 1) == 0 and columns % step == 0, (columns, step)


def test_the_routers_own_shares_validate_their_tensors():
    from compresskit_wide.kernels.router import triton_router_shares

    x, w = torch.zeros(3, 64, device=DEVICE), torch.zeros(8, 64, device=DEVICE)
    with pytest.raises(ValueError, match=r"router shares' tensors do not fit \(x, w_down\[, delta\]\)"):
        triton_router_shares(x, w, x[:, :32])
    with pytest.raises(ValueError, match="router shares' tensors do not fit"):
        triton_router_shares(x, w[:, :32])
    with pytest.raises(ValueError, match="router shares' tensors do not fit"):
        triton_router_shares(x, w.half())
    with pytest.raises(ValueError, match="block_k must divide the share's 128 columns, got 256"):
        triton_router_shares(x, w, block_k=256)
    with pytest.raises(ValueError, match="block_k must divide the share's 48 columns, got 32"):
        triton_router_shares(x, w, columns=48, block_k=32)
    for columns in (0, 40):
        with pytest.raises(ValueError, match=f"columns must be a positive multiple of 16, got {columns}"):
            triton_router_shares(x, w, columns=columns)
    assert triton_router_shares(x[:0], w).shape == (1, 0, 8)  # no token: no launch


@pytest.mark.parametrize(
    ("m", "d", "groups", "rank"), [(1, 72, 40, 8), (5, 100, 7, 8), pytest.param(40, 64, 130, 5, marks=pytest.mark.slow)]
)
def test_each_launch_gives_the_margins_the_consensus_reads(m, d, groups, rank):
    """With ``margin`` the deciding launches store each group's execute-minus-skip logit (fp32, the
    sign the decision's), uncounted: the router, the decision from shares, and that with the norm."""
    from compresskit_wide.kernels.router import torch_router_norm_from_shares, triton_router_norm_from_shares

    torch.manual_seed(m + d)
    router = GroupRouter(d, groups, rank).to(DEVICE)
    x = torch.randn(m, d, device=DEVICE)
    logits = router(x)
    want = (logits[..., 0] - logits[..., 1]).detach()
    args = (x, router.down.weight, router.down.bias, router.up.weight, router.up.bias)
    shares = torch_router_shares(x, router.down.weight)
    sargs = (shares, router.down.bias, router.up.weight, router.up.bias)
    delta = torch.zeros_like(x)
    nargs = (*sargs, x - delta, delta, torch.ones(d, device=DEVICE), 1e-5)
    got = [
        torch_router_decide(*args, margin=True),
        triton_router_decide(*args, margin=True, as_bool=True),
        triton_router_decide(*args, margin=True, finish="tile"),
        torch_router_decide_from_shares(*sargs, margin=True),
        triton_router_decide_from_shares(*sargs, margin=True),
        torch_router_norm_from_shares(*nargs, margin=True)[0],
        triton_router_norm_from_shares(*nargs, margin=True)[0],
    ]
    for margin in got:
        assert margin.dtype == torch.float32
        torch.testing.assert_close(margin, want, rtol=1e-4, atol=1e-4)
        decided = triton_router_decide(*args, as_bool=True)
        sure = margin.abs() > 1e-4  # (a tie within rounding may fall either way)
        assert torch.equal((margin >= 0)[sure], decided[sure])
    with pytest.raises(ValueError, match="counts must be None"):
        triton_router_decide(*args, margin=True, counts=torch.zeros(2, dtype=torch.float64, device=DEVICE))
