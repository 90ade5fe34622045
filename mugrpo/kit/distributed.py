"""Everything multi-process lives here: process groups, collectives, the stage-data split, FSDP2.

Launched by ``torchrun`` (``WORLD_SIZE`` > 1) the trainer runs data-parallel; launched plainly,
every function here is the single-process identity.

- Generation: rank r generates shard r of the stage, the prompts ``indices[r::W]`` with whole
  groups, so advantages are exactly the single-process ones. Each rank persists its shard
  (``rollouts_rank{r}.safetensors``); rank 0 then writes ``shards.json``, which marks the stage
  complete.
- Optimisation: update u's minibatch is, for every shard s, the groups
  ``update_groups(n_s, P / S, u, ...)`` of that shard (P prompts per update, S shards). A rank
  processes the shards it owns (s % W == rank), so the union over ranks is a fixed function of
  the stage data and of u, whoever processes it: N ranks make the same update as one process
  that reads all S shards (``tests/kit/test_distributed.py`` checks it through a resume of a
  2-process run in one process). The token-mean denominator is summed over ranks by the trainer.
- The policy is sharded with FSDP2 (``fully_shard`` per decoder layer, then the root), applied
  here to a model that knows nothing about it. Gradients are averaged over ranks by FSDP, so the
  trainer scales each rank's share of the global loss by W.
- Weights leave the shards one full parameter at a time (``full_state_items``): engine sync and
  checkpoints never hold more than one gathered parameter beyond what the receiver keeps.
- Checkpoints hold world-size-independent state (full trained parameters, full optimizer state
  keyed by parameter name); loading scatters each tensor from rank 0 into the shards. With LoRA the
  trained parameters are the adapters; the frozen base is reloaded from the model folder.

Nothing here knows about the loss, tasks or engines.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as tdist

from mugrpo.models import lora


@dataclass(frozen=True)
class World:
    rank: int = 0
    size: int = 1
    local_rank: int = 0

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def init(timeout_s: float = 3600.0) -> World:
    """Join the torchrun process group if launched by torchrun; else a world of one.

    On CUDA the group has NCCL for GPU tensors and gloo for CPU tensors (CPU-offloaded shards,
    small metric reductions); on CPU it is gloo alone.
    """
    size = int(os.environ.get("WORLD_SIZE", "1"))
    if size == 1:
        return World()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if not tdist.is_initialized():
        if torch.cuda.is_available():
            torch.cuda.set_device(local_rank)
        backend = "cuda:nccl,cpu:gloo" if torch.cuda.is_available() else "gloo"
        tdist.init_process_group(backend=backend, timeout=timedelta(seconds=timeout_s))
        atexit.register(_shutdown)
    return World(rank=tdist.get_rank(), size=tdist.get_world_size(), local_rank=local_rank)


def _shutdown() -> None:
    if tdist.is_initialized():
        tdist.destroy_process_group()


def _active() -> bool:
    return tdist.is_available() and tdist.is_initialized() and tdist.get_world_size() > 1


def _device() -> torch.device:
    """Where small collectives run: CPU whenever the group has gloo."""
    if _active() and "gloo" not in str(tdist.get_backend()):
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


def max_over_ranks(value: int) -> int:
    if not _active():
        return value
    out = torch.tensor([value], dtype=torch.int64, device=_device())
    tdist.all_reduce(out, op=tdist.ReduceOp.MAX)
    return int(out[0])


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


def sum_named_over_ranks(values: dict[str, float]) -> dict[str, float]:
    """Sum named numbers over ranks; the ranks may hold different keys (a missing key counts 0),
    e.g. environment metrics only some ranks' trajectories reported."""
    if not _active():
        return dict(values)
    parts = [None] * tdist.get_world_size()
    tdist.all_gather_object(parts, sorted(values))
    keys = sorted(set().union(*parts))
    flat = sum_over_ranks(torch.tensor([float(values.get(k, 0.0)) for k in keys], dtype=torch.float64))
    return dict(zip(keys, flat.tolist()))


def sum_metrics(summed: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """All-reduce every [numerator, denominator] metric pair in one collective."""
    if not _active():
        return summed
    keys = sorted(summed)
    flat = sum_over_ranks(torch.stack([summed[k] for k in keys]))
    return {k: flat[i] for i, k in enumerate(keys)}



def generation_share(indices: list, world: World) -> list:
    """This rank's share of the stage's sampled prompts: whole groups, ``indices[rank::W]``."""
    return indices[world.rank::world.size]


# ---------------------------------------------------------------------------------------------
# FSDP2, applied from outside.


def train_device(world: World) -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", world.local_rank)
    return torch.device("cpu")


def prepare_model(policy: torch.nn.Module, cfg, world: World):
    """Activation checkpointing if asked; with several ranks shard with FSDP2, else move to the device."""
    device = train_device(world)
    if cfg.parallel.activation_checkpointing:
        apply_activation_checkpointing(policy)
    if world.size > 1:
        apply_fsdp(policy, cfg.parallel)  # fully_shard moves each shard (and the buffers) to the device
    else:
        policy.to(device)
        if cfg.parallel.mixed_precision != "none" or cfg.parallel.cpu_offload:
            print("[mugrpo] note: parallel.mixed_precision and parallel.cpu_offload apply to multi-process "
                  "(FSDP2) runs; a single process ignores them (use train.autocast=bf16)")
    policy.train()
    return policy, device


def prepare_frozen(model: torch.nn.Module, cfg, world: World) -> torch.nn.Module:
    """A no-grad model (the KL reference): sharded like the policy, regathered at every forward."""
    model.requires_grad_(False).eval()
    if world.size > 1:
        apply_fsdp(model, cfg.parallel, reshard_root=True)
    else:
        model.to(train_device(world))
    return model


def apply_fsdp(model: torch.nn.Module, pc, reshard_root: bool = False) -> torch.nn.Module:
    """``fully_shard`` each decoder layer, then the root (the standard FSDP2 recipe).

    ``pc`` is the ``parallel`` config section. The root keeps its parameters (embeddings, final
    norm, LM head) gathered from forward to backward unless ``reshard_root``: backward needs them
    first, so resharding them would only add an all-gather.
    """
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    mp = MixedPrecisionPolicy()
    if pc.mixed_precision == "bf16":
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    offload = CPUOffloadPolicy(pin_memory=torch.cuda.is_available()) if pc.cpu_offload else OffloadPolicy()
    for layer in _decoder_layers(model):
        fully_shard(layer, mp_policy=mp, offload_policy=offload, reshard_after_forward=pc.reshard_after_forward)
    fully_shard(model, mp_policy=mp, offload_policy=offload, reshard_after_forward=True if reshard_root else None)
    model._mugrpo_defer_grad_sync = pc.defer_grad_sync  # read by no_sync_unless_last
    return model


def apply_activation_checkpointing(model: torch.nn.Module) -> None:
    """Recompute every decoder layer in backward (non-reentrant ``torch.utils.checkpoint``).

    The layer's ``forward`` is wrapped in place rather than the layer in a wrapper module, so
    parameter names (and with them engine sync, checkpoints and the HF export) are unchanged.
    Under FSDP2 the layer's pre-backward hook gathers its parameters before the recompute runs.
    """
    from torch.utils.checkpoint import checkpoint

    for layer in _decoder_layers(model):
        inner = layer.forward

        @functools.wraps(inner)
        def forward(*args, _inner=inner, **kwargs):
            return checkpoint(_inner, *args, use_reentrant=False, **kwargs)

        layer.forward = forward


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
    return any(_is_dtensor(p) for p in model.parameters())


def _is_dtensor(t) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def _full(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor behind a (possibly sharded) tensor; a collective for a DTensor.

    A CPU-offloaded shard is first copied to its mesh's device, so NCCL does the gathering.
    """
    if not _is_dtensor(t):
        return t
    mesh_type = t.device_mesh.device_type
    if t.device.type != mesh_type:
        t = t.to(torch.device(mesh_type, torch.cuda.current_device()) if mesh_type == "cuda" else mesh_type)
    return t.full_tensor()


def full_state_items(model: torch.nn.Module, keep: bool = True):
    """(HF name, full tensor) for every weight of the plain HF model, one at a time: bounded peak
    memory under FSDP2. With LoRA adapters these are the merged weights under the base model's names
    (:func:`mugrpo.models.lora.merged_items`): what the engine, evaluation and the export get.

    Every rank must consume the whole iterator (each item is a collective). With ``keep=False``
    the gathered tensor is dropped at once and None is yielded (ranks that only take part).
    """
    if lora.has_lora(model):
        yield from lora.merged_items(model, _full, keep)
        return
    for name, param in model.named_parameters():
        tensor = _full(param.detach())
        yield name, tensor if keep else None


def trained_items(model: torch.nn.Module, keep: bool = True):
    """(name, full tensor) for every parameter the optimizer trains (``requires_grad``), under the
    model's own names: what a checkpoint holds (all weights in full fine-tuning, the adapters with
    LoRA). A collective per item, like :func:`full_state_items`."""
    for name, param in model.named_parameters():
        if param.requires_grad:
            tensor = _full(param.detach())
            yield name, tensor if keep else None


def adapter_items(model: torch.nn.Module, keep: bool = True):
    """The LoRA adapters gathered whole, under peft's checkpoint keys (:func:`mugrpo.models.lora.adapter_items`)."""
    yield from lora.adapter_items(model, _full, keep)


@contextlib.contextmanager
def no_sync_unless_last(model: torch.nn.Module, last: bool):
    """With ``parallel.defer_grad_sync``, skip FSDP2's reduce-scatter on all but the last micro-batch.

    Otherwise every micro-batch's gradients are reduce-scattered at once (the sum over micro-batches
    is then accumulated in the sharded gradients), so no rank ever holds a full gradient copy.
    """
    if not (is_sharded(model) and getattr(model, "_mugrpo_defer_grad_sync", False)):
        yield
        return
    model.set_requires_gradient_sync(last)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)


# ---------------------------------------------------------------------------------------------
# World-size-independent checkpoint state: gather on save, scatter from rank 0 on load.


def _param_names(model: torch.nn.Module, optimizer) -> list[tuple[str, torch.nn.Parameter]]:
    names = {id(p): n for n, p in model.named_parameters()}
    return [(names[id(p)], p) for group in optimizer.param_groups for p in group["params"]]


def full_optimizer_state(model: torch.nn.Module, optimizer, keep: bool) -> dict | None:
    """The optimizer's state with every tensor gathered whole and keyed by parameter name.

    The same on any number of ranks, so a run may resume on another number of processes. Built
    directly from ``optimizer.state`` (``torch.distributed.checkpoint.state_dict`` would run a
    zero-lr ``step()`` on a fresh optimizer to create its state, which moves Adam's step count).
    Only ranks with ``keep`` hold the result (CPU tensors); the others return None.
    """
    named = _param_names(model, optimizer)
    state = {}
    for name, param in named:
        entry = {}
        for key, value in sorted(optimizer.state.get(param, {}).items()):
            if isinstance(value, torch.Tensor):
                value = _full(value)  # a collective: every rank gathers, only ``keep`` ranks hold on
                value = value.detach().cpu().clone() if keep else None  # a copy: the next step changes the live one
            entry[key] = value
        if entry and keep:
            state[name] = entry
    if not keep:
        return None
    names = {id(p): n for n, p in named}
    groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": [names[id(p)] for p in g["params"]]}
              for g in optimizer.param_groups]
    return {"format": "full-by-name", "state": state, "param_groups": groups}


@torch.no_grad()
def load_full_optimizer_state(model: torch.nn.Module, optimizer, saved: dict | None) -> None:
    """Inverse of :func:`full_optimizer_state`; ``saved`` is needed on rank 0 only."""
    named = _param_names(model, optimizer)
    skeleton = None
    if saved is not None:
        skeleton = {"param_groups": saved["param_groups"],
                    "state": {n: {k: isinstance(v, torch.Tensor) and v.dim() > 0 for k, v in e.items()}
                              for n, e in saved["state"].items()}}
    skeleton = broadcast_object(skeleton)
    scalars = broadcast_object(None if saved is None else {
        n: {k: v for k, v in e.items() if not (isinstance(v, torch.Tensor) and v.dim() > 0)}
        for n, e in saved["state"].items()})
    index = {n: i for i, (n, _) in enumerate(named)}
    state = {}
    for name, param in named:
        if name not in skeleton["state"]:
            continue
        entry = dict(scalars[name])
        for key, is_tensor in skeleton["state"][name].items():
            if is_tensor:
                entry[key] = _scatter_like(param, None if saved is None else saved["state"][name][key])
        state[index[name]] = entry
    groups = [{**g, "params": [index[n] for n in g["params"]]} for g in skeleton["param_groups"]]
    optimizer.load_state_dict({"state": state, "param_groups": groups})


@torch.no_grad()
def load_full_params(model: torch.nn.Module, get_tensor) -> None:
    """Copy full weights into the (possibly sharded) parameters; ``get_tensor(name)`` on rank 0 only.

    One parameter at a time: rank 0 reads it and scatters the shards (``distribute_tensor``). Only
    the trained parameters (:func:`trained_items`); frozen ones (a LoRA base) keep their loaded values.
    """
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        value = _scatter_like(param, get_tensor(name) if get_tensor is not None else None)
        if _is_dtensor(param):
            param.to_local().copy_(value.to_local())
        else:
            param.copy_(value)


def _scatter_like(param: torch.Tensor, full: torch.Tensor | None) -> torch.Tensor:
    """``full`` (given on rank 0) laid out like ``param``: this rank's shard if sharded, else whole."""
    if not _is_dtensor(param):
        if full is None:
            raise ValueError("a full tensor is needed when the parameter is not sharded")
        return full.to(param.device, param.dtype)
    from torch.distributed.tensor import distribute_tensor

    mesh = param.device_mesh
    device = torch.device("cuda", torch.cuda.current_device()) if mesh.device_type == "cuda" else torch.device("cpu")
    if full is None:
        full = torch.empty(param.shape, dtype=param.dtype, device=device)
    if tuple(full.shape) != tuple(param.shape):
        raise ValueError(f"checkpoint tensor has shape {tuple(full.shape)}, the model expects {tuple(param.shape)}")
    shard = distribute_tensor(full.to(device, param.dtype), mesh, param.placements)
    return shard.to(param.device) if shard.device != param.device else shard
