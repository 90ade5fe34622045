"""Everything multi-process lives here: process-group set-up, collectives, and applying FSDP2.

Launched by ``torchrun`` (``WORLD_SIZE`` > 1) the trainer runs data-parallel: each rank generates
its share of whole prompt groups with its own engine and trains on its share of every update's
minibatch; the policy is sharded with FSDP2 (``fully_shard``), applied here to a model that knows
nothing about it. Launched plainly, every function is the single-process identity.

Nothing here knows about the loss, tasks or engines.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass

import torch
import torch.distributed as tdist


@dataclass(frozen=True)
class World:
    rank: int = 0
    size: int = 1
    local_rank: int = 0

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def init() -> World:
    """Join the torchrun process group if launched by torchrun; else a world of one."""
    size = int(os.environ.get("WORLD_SIZE", "1"))
    if size == 1:
        return World()
    if not tdist.is_initialized():
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        tdist.init_process_group(backend=backend)
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank)
    return World(rank=tdist.get_rank(), size=tdist.get_world_size(), local_rank=local_rank)


def _active() -> bool:
    return tdist.is_available() and tdist.is_initialized() and tdist.get_world_size() > 1


def _device() -> torch.device:
    if _active() and tdist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def barrier() -> None:
    if _active():
        tdist.barrier()


def broadcast_object(obj):
    if not _active():
        return obj
    box = [obj]
    tdist.broadcast_object_list(box, src=0)
    return box[0]


def sum_over_ranks(t: torch.Tensor) -> torch.Tensor:
    if not _active():
        return t
    out = t.detach().clone().to(_device())
    tdist.all_reduce(out)
    return out.to(t.device)


def mean_over_ranks(num, count) -> float:
    """sum(num) / sum(count) over ranks, as a float."""
    pair = torch.tensor([float(num), float(count)], dtype=torch.float64)
    pair = sum_over_ranks(pair)
    return float(pair[0] / pair[1]) if pair[1] > 0 else float("nan")


def gather_cat(t: torch.Tensor) -> torch.Tensor:
    """Concatenate a 1-D tensor over ranks (in rank order); sizes may differ."""
    if not _active():
        return t
    parts = [None] * tdist.get_world_size()
    tdist.all_gather_object(parts, t.cpu())
    return torch.cat(parts)


def sum_metrics(summed: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """All-reduce every [numerator, denominator] metric pair in one collective."""
    if not _active():
        return summed
    keys = sorted(summed)
    flat = sum_over_ranks(torch.stack([summed[k] for k in keys]))
    return {k: flat[i] for i, k in enumerate(keys)}


def train_device(world: World) -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", world.local_rank)
    return torch.device("cpu")


def prepare_model(policy: torch.nn.Module, cfg, world: World):
    """Move the policy to its device and, with several ranks, shard it with FSDP2."""
    device = train_device(world)
    policy.to(device)
    if world.size > 1:
        apply_fsdp(policy, cfg)
    policy.train()
    return policy, device


def apply_fsdp(model: torch.nn.Module, cfg) -> torch.nn.Module:
    """``fully_shard`` each decoder layer, then the root (the standard FSDP2 recipe)."""
    from torch.distributed.fsdp import fully_shard

    layers = _decoder_layers(model)
    for layer in layers:
        fully_shard(layer)
    fully_shard(model)
    return model


def _decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    for path in ("model.layers", "transformer.h", "gpt_neox.layers", "model.decoder.layers"):
        obj = model
        try:
            for part in path.split("."):
                obj = getattr(obj, part)
        except AttributeError:
            continue
        return list(obj)
    raise ValueError(f"cannot find the decoder layers of {type(model).__name__} to shard")


def is_sharded(model: torch.nn.Module) -> bool:
    return any(hasattr(p, "full_tensor") for p in model.parameters())


def full_state_items(model: torch.nn.Module):
    """(HF name, full tensor) for every parameter, one at a time: bounded peak memory under FSDP2."""
    for name, param in model.named_parameters():
        tensor = param.detach()
        if hasattr(tensor, "full_tensor"):
            tensor = tensor.full_tensor()
        yield name, tensor


@contextlib.contextmanager
def no_sync_unless_last(model: torch.nn.Module, last: bool):
    """Skip FSDP2's gradient reduce-scatter on all but the last micro-batch of an update."""
    setter = getattr(model, "set_requires_gradient_sync", None)
    if setter is None or not is_sharded(model):
        yield
        return
    setter(last)
    try:
        yield
    finally:
        setter(True)
