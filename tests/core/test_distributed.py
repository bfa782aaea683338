"""Training on several ranks (FSDP2 under torchrun), on the CPU with the gloo backend and two
processes: the sharding plan, two ranks training what one process with twice the accumulation trains,
a sharded checkpoint's save / resume round trip, and a failing rank that is named, not a hang."""

from __future__ import annotations

import json
import os
import socket

import pytest
import torch
import torch.multiprocessing as mp
from safetensors.torch import load_file

from compresskit.cli import main

pytestmark = pytest.mark.filterwarnings("ignore")


def _recipe(tiny_model_dir, out, **train):
    return {
        "model": {"name_or_path": str(tiny_model_dir), "dtype": "float32", "device": "cpu"},
        "pruner": {"name": "toy-router", "config": {"groups": 6, "rank": 8}},
        "training": [
            {"name": "router", "config": {"steps": 3, "batch_size": 2, "seq_len": 32, **train}},
            {"name": "lora", "config": {"steps": 2, "batch_size": 2, "seq_len": 32, "r": 2, "merge": True, **train}},
        ],
        "evaluation": {"tasks": ["perplexity"], "perplexity_docs": 1, "compare_dense": False, "max_length": 128},
        "output": {"dir": str(out)},
    }


def _write(path, recipe):
    import yaml

    path.write_text(yaml.safe_dump(recipe))
    return str(path)


@pytest.mark.slow
def test_two_ranks_train_what_one_process_with_twice_the_accumulation_trains(tiny_model_dir, tmp_path, capsys):
    """``apply --nproc 2`` (torchrun, gloo, FSDP2) with ``grad_accum: 1`` against one process with
    ``grad_accum: 2``: the same micro-batches with the same noise, so the same losses and the same
    trained routers and merged weights, up to the order of float sums; the artefact is the same kind."""
    two = _write(tmp_path / "two.yaml", _recipe(tiny_model_dir, tmp_path / "two", grad_accum=1))
    one = _write(tmp_path / "one.yaml", _recipe(tiny_model_dir, tmp_path / "one", grad_accum=2))
    assert main(["apply", two, "--nproc", "2"]) == 0, capsys.readouterr().err
    assert main(["apply", one]) == 0, capsys.readouterr().err
    res = {k: json.loads((tmp_path / k / "results.json").read_text()) for k in ("one", "two")}
    for a, b in zip(res["one"]["training"], res["two"]["training"], strict=True):
        assert a["tokens"] == b["tokens"] == a["steps"] * 2 * 2 * 32
        for x, y in zip(a["history"], b["history"], strict=True):
            assert x["loss"] == pytest.approx(y["loss"], rel=1e-4, abs=1e-5)
    routers = {k: load_file(str(tmp_path / k / "model" / "pruner.safetensors")) for k in ("one", "two")}
    assert routers["one"].keys() == routers["two"].keys()
    for name, value in routers["one"].items():
        torch.testing.assert_close(routers["two"][name], value, rtol=1e-4, atol=1e-5)
    files = sorted(p.name for p in (tmp_path / "two" / "model").iterdir())
    assert files == sorted(p.name for p in (tmp_path / "one" / "model").iterdir())
    merged = {k: load_file(str(tmp_path / k / "model" / "stage1-lora.safetensors")) for k in ("one", "two")}
    for name, value in merged["one"].items():
        torch.testing.assert_close(merged["two"][name], value, rtol=1e-4, atol=1e-5)
    assert res["two"]["metrics"]["perplexity"]["token_perplexity"] == pytest.approx(
        res["one"]["metrics"]["perplexity"]["token_perplexity"], rel=1e-3
    )


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spawn(fn, *args, world: int = 2):
    port = _free_port()
    mp.start_processes(fn, args=(world, port, *args), nprocs=world, join=True, start_method="spawn")


def _join(rank: int, world: int, port: int, timeout_s: int = 60):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    os.environ["LOCAL_RANK"] = str(rank)
    torch.set_num_threads(1)
    from compresskit import distributed

    return distributed.init(timeout_s, "cpu")


def _routed_tiny(model_dir: str):
    from compresskit import plugins
    from compresskit.interfaces import RunContext
    from compresskit.modeling import load_model

    model, tok = load_model(model_dir, dtype="float32", device="cpu")
    cls = plugins.load("pruner", "toy-router")
    pruner = cls(cls.Config(groups=6, rank=8))
    torch.manual_seed(0)  # the same routers on every rank (as apply seeds them)
    pruner.prepare(model, RunContext(model_config=model.config, tokenizer=tok, seed=0))
    return model, tok, pruner


def _sharding_plan(rank, world, port, model_dir, out):
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    from compresskit import distributed

    ranks = _join(rank, world, port)
    model, _, pruner = _routed_tiny(model_dir)
    full = {n: tuple(p.shape) for n, p in model.named_parameters()}
    distributed.shard(model, ranks)
    units = [n for n, m in model.named_modules() if isinstance(m, FSDPModule)]
    local = {n: p.to_local().numel() for n, p in model.named_parameters() if isinstance(p, DTensor)}
    routers = sum(p.numel() for p in pruner.trainable_parameters(model))  # DTensors report the global size
    if ranks.main:
        torch.save({"units": units, "full": full, "local": local, "routers": routers}, out)
    distributed.close()


@pytest.mark.slow
def test_sharding_plan_is_one_unit_per_decoder_layer(tiny_model_dir, tmp_path):
    out = tmp_path / "plan.pt"
    _spawn(_sharding_plan, str(tiny_model_dir), str(out))
    plan = torch.load(out)
    layers = sorted({n.split(".")[2] for n in plan["full"] if n.startswith("model.layers.")}, key=int)
    assert plan["units"] == ["", *(f"model.layers.{i}" for i in layers)]  # the root holds the rest
    assert plan["local"].keys() == plan["full"].keys()  # every parameter sharded, routers included
    for name, shape in plan["full"].items():  # dim 0 split over two ranks (rank 0 holds the larger half)
        rest = int(torch.tensor(shape[1:]).prod()) if len(shape) > 1 else 1
        assert plan["local"][name] == -(-shape[0] // 2) * rest
    assert plan["routers"] > 0


def _train_and_resume(rank, world, port, model_dir, data_dir, out, interrupt_at):
    import dataclasses

    from compresskit import distributed
    from compresskit.data import DataModule
    from compresskit.interfaces import RunContext
    from compresskit.recipe import DataSection
    from compresskit.trainers import RouterTrainer, TrainStageConfig

    ranks = _join(rank, world, port)
    model, tok, pruner = _routed_tiny(model_dir)
    distributed.shard(model, ranks)
    data = DataModule.from_section(tok, DataSection())
    trainer = RouterTrainer(TrainStageConfig(steps=4, batch_size=2, seq_len=32, checkpoint_every=2))
    ctx = RunContext(model_config=model.config, tokenizer=tok, seed=3, work_dir=data_dir, ranks=ranks)
    if interrupt_at is not None:
        step_hook = pruner.on_train_step

        def stop(step, total):
            if step == interrupt_at:
                raise KeyboardInterrupt
            return step_hook(step, total)

        pruner.on_train_step = stop
        try:
            trainer.fit(model, pruner, data, ctx)
        except KeyboardInterrupt:
            pass
        pruner.on_train_step = step_hook
        model, tok, pruner = _routed_tiny(model_dir)  # a fresh process's model: nothing trained kept
        distributed.shard(model, ranks)
    summary = trainer.fit(model, pruner, data, dataclasses.replace(ctx))
    state = distributed.full_state_dict(model)
    if ranks.main:
        routers = {k: v for k, v in state.items() if ".router." in k}
        torch.save({"routers": routers, "history": summary.history, "tokens": summary.tokens}, out)
    distributed.close()


@pytest.mark.slow
def test_a_sharded_checkpoint_resumes_where_the_run_stopped(tiny_model_dir, tmp_path):
    """Stopped after step 3 of 4 (its last checkpoint: step 2), a rerun resumes from the sharded
    checkpoint and ends where an uninterrupted run ends."""
    whole, resumed = tmp_path / "whole.pt", tmp_path / "resumed.pt"
    _spawn(_train_and_resume, str(tiny_model_dir), str(tmp_path / "w1"), str(whole), None)
    _spawn(_train_and_resume, str(tiny_model_dir), str(tmp_path / "w2"), str(resumed), 3)
    assert (tmp_path / "w2" / "checkpoint" / "meta.pt").is_file()
    a, b = torch.load(whole), torch.load(resumed)
    assert [h["step"] for h in b["history"]] == [0, 1, 2, 3]
    for x, y in zip(a["history"], b["history"], strict=True):
        assert x["loss"] == pytest.approx(y["loss"], rel=1e-5)
    for name, value in a["routers"].items():
        torch.testing.assert_close(b["routers"][name], value)
    assert b["tokens"] == a["tokens"] > 0  # the steps before the stop counted too, over both ranks
    meta = torch.load(tmp_path / "w2" / "checkpoint" / "meta.pt", weights_only=False)
    assert meta["world"] == 2 and meta["step"] == 4 and meta["done"]


def _other_world(rank, world, port, model_dir, data_dir, out):
    from compresskit import distributed
    from compresskit.errors import ArtifactError

    ranks = _join(rank, world, port)
    model, _, _ = _routed_tiny(model_dir)
    distributed.shard(model, ranks)
    try:
        distributed.load_checkpoint(os.path.join(data_dir, "checkpoint"), model, None, ranks)
    except ArtifactError as exc:
        if ranks.main:
            with open(out, "w") as f:
                f.write(str(exc))
    distributed.close()


@pytest.mark.slow
def test_resuming_on_another_rank_count_is_a_clear_error(tiny_model_dir, tmp_path):
    ckpt = tmp_path / "w" / "checkpoint"
    ckpt.mkdir(parents=True)
    torch.save({"world": 3, "step": 2}, ckpt / "meta.pt")
    out = tmp_path / "err.txt"
    _spawn(_other_world, str(tiny_model_dir), str(tmp_path / "w"), str(out))
    assert "checkpoint written by 3 rank(s), resumed on 2; resume with --nproc 3" in out.read_text()


def _reductions(rank, world, port, out):
    from compresskit import distributed

    _join(rank, world, port)
    got = (distributed.maximum(10 * rank + 3), distributed.mean(float(10 * rank + 3)))
    if rank == 0:
        torch.save(got, out)
    distributed.close()


def test_reductions_over_ranks(tmp_path):
    """What the logs and summaries reduce over ranks: the largest value (a stage's peak memory) and the mean."""
    out = tmp_path / "got.pt"
    _spawn(_reductions, str(out))
    assert torch.load(out) == (13, 8.0)


def _failing_rank(rank, world, port, out):
    from compresskit import distributed

    _join(rank, world, port, timeout_s=10)
    if rank == 1:
        raise ValueError("rank 1 failed on purpose")
    try:
        distributed.barrier()  # rank 1 never arrives: the timeout fails it instead of hanging
    except Exception as exc:  # noqa: BLE001
        with open(out, "w") as f:
            f.write(type(exc).__name__)


def test_a_failing_rank_is_reported_and_the_others_do_not_hang(tmp_path):
    out = tmp_path / "rank0.txt"
    with pytest.raises(mp.ProcessRaisedException, match="rank 1 failed on purpose"):
        _spawn(_failing_rank, str(out))


def test_cli_errors_name_the_rank(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    code = main(["apply", str(tmp_path / "missing.yaml")])
    assert code == 2 and capsys.readouterr().err.startswith("rank 1 of 2: error:")
