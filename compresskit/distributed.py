"""Training on several GPUs of one host with PyTorch's own engine: FSDP2 (``fully_shard``), launched
by torchrun (``compresskit apply --nproc N`` runs ``torch.distributed.run`` for you).

Every rank runs the recipe's pipeline up to training, each on its own device: the same model, the same
pruner attached with the same seed. The frozen backbone is then sharded, one FSDP unit per decoder
layer and one for the rest; each rank trains on its share of every optimiser step's micro-batches
(rank ``r`` of ``N`` takes micro-batches ``r, r + N, ...`` of the one-process order, each with its own
seeded noise, so N ranks with ``grad_accum: g`` compute what one process with ``g * N`` does), FSDP
averaging the gradients. Checkpoints are sharded (``torch.distributed.checkpoint``). After the last
stage the trained model's full state goes to rank 0, which rebuilds the model unsharded and runs the
rest (saving, speed, evaluation) alone: the same artefact as a one-GPU run. Progress and logs come from
rank 0; an error on any rank is reported with its rank, and a collective that waits longer than
``distributed.timeout_s`` fails instead of hanging.

The CLI imports this module at its start, so torch (and the core modules that import it) are imported
inside the functions that use them: ``--help`` stays fast.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # (the CLI imports this module before it imports torch)
    import torch
    from torch import nn


@dataclass(frozen=True)
class Ranks:
    """This process's place: ``rank`` of ``world``, on ``device``."""

    rank: int
    world: int
    device: torch.device

    @property
    def main(self) -> bool:
        return self.rank == 0


def launched() -> bool:
    """Whether this process is one of several started by torchrun."""
    return int(os.environ.get("WORLD_SIZE", "1")) > 1


def init(timeout_s: int, device: str = "auto") -> Ranks:
    """Join the process group torchrun set up (NCCL on GPUs, gloo on CPUs), with ``timeout_s`` on
    every collective; each rank takes the GPU of its local rank."""
    import torch
    import torch.distributed as dist

    local = int(os.environ.get("LOCAL_RANK", "0"))
    cuda = torch.cuda.is_available() and device != "cpu"
    if cuda:
        torch.cuda.set_device(local)
    if not dist.is_initialized():
        dist.init_process_group(backend="nccl" if cuda else "gloo", timeout=datetime.timedelta(seconds=timeout_s))
    return Ranks(dist.get_rank(), dist.get_world_size(), torch.device("cuda", local) if cuda else torch.device("cpu"))


def close() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


def barrier() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()


def shard(model: nn.Module, ranks: Ranks) -> nn.Module:
    """Shard ``model`` in place over the ranks: each decoder layer one FSDP2 unit, the rest (embedding,
    final norm, LM head) the root's."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from compresskit.modeling import decoder_layers

    mesh = init_device_mesh(ranks.device.type, (ranks.world,))
    for layer in decoder_layers(model):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def is_sharded(model: nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


def mean(value: float) -> float:
    """The mean of ``value`` over the ranks (for logs)."""
    import torch
    import torch.distributed as dist

    if not dist.is_initialized():
        return value
    t = torch.tensor([value], dtype=torch.float64, device=_collective_device())
    dist.all_reduce(t)
    return float(t.item()) / dist.get_world_size()


def maximum(value: int) -> int:
    """The largest ``value`` over the ranks."""
    import torch
    import torch.distributed as dist

    if not dist.is_initialized():
        return value
    t = torch.tensor([value], dtype=torch.int64, device=_collective_device())
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t.item())


def _collective_device() -> torch.device:
    import torch
    import torch.distributed as dist

    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The sharded ``model``'s whole state on rank 0, on the CPU (empty on the other ranks): a
    collective, gathered one unit at a time."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def save_checkpoint(directory, model: nn.Module, optimizer, meta: dict, ranks: Ranks) -> None:
    """A sharded checkpoint of the trained parameters and the optimiser in ``directory`` (each rank
    writes its shards), and ``meta`` (step, history, scheduler, rank count) from rank 0; the directory
    appears whole (written beside it, then renamed)."""
    import shutil
    from pathlib import Path

    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    directory = Path(directory)
    tmp = directory.with_name(directory.name + ".tmp")
    if ranks.main:
        shutil.rmtree(tmp, ignore_errors=True)
    barrier()
    params, optim = get_state_dict(model, optimizer, options=StateDictOptions(ignore_frozen_params=True))
    dcp.save({"params": params, "optimizer": optim}, checkpoint_id=str(tmp))
    if ranks.main:
        torch.save({**meta, "world": ranks.world}, tmp / "meta.pt")
        shutil.rmtree(directory, ignore_errors=True)
        os.replace(tmp, directory)
    barrier()


def load_checkpoint(directory, model: nn.Module, optimizer, ranks: Ranks) -> dict:
    """Load what :func:`save_checkpoint` wrote into the sharded ``model`` and ``optimizer``; returns
    its ``meta``. A checkpoint of another rank count is an error (the steps' batches would differ)."""
    from pathlib import Path

    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

    from compresskit.errors import ArtifactError

    directory = Path(directory)
    try:
        meta = torch.load(directory / "meta.pt", map_location="cpu", weights_only=False)
    except Exception as exc:
        raise ArtifactError(f"{directory}: unreadable training checkpoint ({type(exc).__name__}: {exc})") from None
    if meta.get("world") != ranks.world:
        raise ArtifactError(
            f"{directory}: checkpoint written by {meta.get('world')} rank(s), resumed on {ranks.world}; resume with "
            f"--nproc {meta.get('world')}, or delete {directory.parent} to restart the stage"
        )
    opts = StateDictOptions(ignore_frozen_params=True)
    params, optim = get_state_dict(model, optimizer, options=opts)
    state = {"params": params, "optimizer": optim}
    dcp.load(state, checkpoint_id=str(directory))
    # (the frozen backbone is not in the checkpoint; dcp.load has failed on any trained tensor missing)
    loading = StateDictOptions(ignore_frozen_params=True, strict=False)
    set_state_dict(
        model, optimizer, model_state_dict=state["params"], optim_state_dict=state["optimizer"], options=loading
    )
    return meta
