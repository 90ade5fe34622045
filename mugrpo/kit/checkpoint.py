"""Checkpoints and the final HF export: a trained model's state, written and read whole.

Layout of a run directory (its names: :class:`mugrpo.run_dir.RunDir`; claiming, locking and resuming
it: :mod:`mugrpo.kit.lifecycle`)::

    config.yaml                    resolved config (written once, at start)
    .lock                          held (flock) by the process training in the directory
    metrics.jsonl                  one line per update and per stage
    stages/stage_KKK/              the stage's data: shards, completion marker, generation metrics,
                                   readable jsonl (file names: mugrpo.run_dir.shard_path and below)
    checkpoints/ckpt_UUUUUU/       model.safetensors (the trained parameters: all of them, or the LoRA
                                   adapters), optimizer.pt, scheduler.pt, rng_rank{R}.pt,
                                   trainer_state.json, config.yaml (the config it was trained with)
    final_model/                   HF folder: AutoModelForCausalLM.from_pretrained(...) loads it
                                   (LoRA merged in); with LoRA also adapter/, a peft adapter folder

A checkpoint is written into a temporary folder, fsynced, then renamed: a folder named ``ckpt_*``
is always complete. The newest ``keep_last`` are kept. It holds the model, optimizer and LR
schedule, every RNG state, and the phase's position (its :class:`RunState`: the global step, and for RL
the stage and the update within it, :class:`mugrpo.stages.state.RLState`); RL's stage data is on disk
already, so resuming mid-stage never regenerates. A resume checks RUN_DIR/config.yaml
(plus any ``key=value`` overrides) against the config stored in the newest checkpoint, and loads the
newest checkpoint that is readable, warning about any newer one that is not.

Model and optimizer are stored whole (optimizer state keyed by parameter name), whatever the number
of processes: under FSDP2 they are gathered one tensor at a time and only rank 0 keeps them, and on
load rank 0 reads them and scatters each tensor into the shards (:mod:`mugrpo.kit.distributed`). So a
run may resume on a different number of processes (its stage data permitting, see
``distributed.load_stage_shards``).
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from mugrpo.config import Config, dump_yaml
from mugrpo.faults import maybe_die
from mugrpo.kit import distributed as dist
from mugrpo.models import lora
from mugrpo.run_dir import (CONFIG_FILE, DiskFullError, RunDir, RunDirError, remove_stale_temporaries, resume_command,
                            size_text, write_failure)


@dataclass
class RunState:
    """What every phase's resume needs besides weights, optimizer and RNG states: the global step (the
    checkpoint cadence counts it) and the non-finite steps. A phase with more position extends it (RL:
    :class:`mugrpo.stages.state.RLState`); a checkpoint stores the fields of the state's class, and a load
    fills the class it is given with the fields it has (a field it lacks keeps its default; one it does not
    know, e.g. the stage a warm start's checkpoint held before issue 39, is ignored)."""

    update: int = 0
    """Global optimizer steps done."""
    bad_update_streak: int = 0
    num_skipped_updates: int = 0
    elapsed_s: float = 0.0
    """Wall-clock of earlier sessions of this run (so ``time_s`` continues across resumes)."""

    def checkpoint_name(self) -> str:
        """The checkpoint folder's name: the global step first (the newest sorts last); a phase without
        stages is one stage (``s000``) whose steps are all its updates, as its folders were always named."""
        return f"ckpt_{self.update:06d}_s000_u{self.update:05d}"

    def describe(self) -> str:
        return f"update {self.update}"


def state_from_saved(saved: dict, state_type: type = RunState) -> RunState:
    """A ``state_type`` from a checkpoint's ``trainer_state.json`` (see :class:`RunState` for the fields)."""
    fields = {f.name for f in dataclasses.fields(state_type)}
    return state_type(**{k: v for k, v in saved.items() if k in fields})

ADAPTER_DIR = "adapter"
"""final_model/adapter/: the LoRA adapter as a peft folder (LoRA runs only)."""


def _rng_state() -> dict:
    import numpy as np

    state = {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict) -> None:
    import numpy as np

    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _full_state_dict(items) -> dict[str, torch.Tensor]:
    """``items`` ((name, full tensor or None) pairs, a collective under FSDP2) on CPU; empty on ranks
    that only take part (None tensors)."""
    return {name: t.cpu().contiguous() for name, t in items if t is not None}


def save(run_dir: Path, policy, optimizer, scheduler, state, cfg: Config, world, elapsed_s: float) -> Path:
    """Write checkpoint ``ckpt_<update>`` atomically and prune old ones; returns its folder.

    A full disk raises :class:`DiskFullError` (after removing the partial folder) instead of a raw
    ``torch.save`` traceback: the write goes to a temporary folder first, so earlier checkpoints are
    intact and ``--resume`` continues from the last one."""
    try:
        return _save(run_dir, policy, optimizer, scheduler, state, cfg, world, elapsed_s)
    except (OSError, RuntimeError) as exc:
        cause = write_failure(exc)
        if cause is None:
            raise
        if world.is_main:
            remove_stale_temporaries(run_dir)
        last = sorted(RunDir(run_dir).checkpoints.glob("ckpt_*"))
        raise DiskFullError(
            f"{cause} while writing a checkpoint in {RunDir(run_dir).checkpoints} ({exc}). Nothing was lost: "
            "the partial checkpoint was removed and "
            + (f"the last complete one, {last[-1].name}, is intact" if last else "no earlier checkpoint was touched")
            + f". Free some space, then continue with: {resume_command(run_dir)}") from exc


def _save(run_dir: Path, policy, optimizer, scheduler, state, cfg: Config, world, elapsed_s: float) -> Path:
    root = RunDir(run_dir).checkpoints
    name = state.checkpoint_name()
    final = root / name
    # Collectives under FSDP2: every rank takes part, rank 0 keeps the gathered tensors.
    model_sd = _full_state_dict(dist.trained_items(policy, keep=world.is_main))
    optim_sd = dist.full_optimizer_state(policy, optimizer, keep=world.is_main)
    tmp = root / f".tmp-{name}"
    if world.is_main:
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
    dist.barrier()
    torch.save({"rng": _rng_state()}, tmp / f"rng_rank{world.rank}.pt")
    if world.is_main:
        save_file(model_sd, str(tmp / "model.safetensors"))
        torch.save({"optimizer": optim_sd}, tmp / "optimizer.pt")
        torch.save({"scheduler": scheduler.state_dict()}, tmp / "scheduler.pt")
        trainer_state = {**dataclasses.asdict(state), "elapsed_s": elapsed_s, "world_size": world.size}
        (tmp / "trainer_state.json").write_text(json.dumps(trainer_state, indent=1))
        (tmp / CONFIG_FILE).write_text(dump_yaml(cfg))  # what a resume is checked against
    dist.barrier()
    maybe_die("checkpoint_write")
    if world.is_main:
        for f in tmp.iterdir():
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())
        if final.exists():  # the same position saved twice (e.g. interrupted right after a stage save)
            shutil.rmtree(final)
        os.replace(tmp, final)
        _fsync_dir(root)
        for old in sorted(p for p in root.glob("ckpt_*"))[:-cfg.checkpoint.keep_last]:
            shutil.rmtree(old, ignore_errors=True)
    dist.barrier()
    return final


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


_CHECKPOINT_FILES = ("trainer_state.json", "model.safetensors", "optimizer.pt", "scheduler.pt", "rng_rank0.pt")


def _unreadable(path: Path) -> str | None:
    """Why the checkpoint folder ``path`` cannot be loaded (naming the file), or None if it can.

    Reads every file's header or pickle (tensors memory-mapped, not copied), so a truncated or
    missing file shows here rather than half-way through a load."""
    for name in _CHECKPOINT_FILES:
        file = path / name
        try:
            if name.endswith(".json"):
                json.loads(file.read_text())
            elif name.endswith(".safetensors"):
                with safe_open(str(file), "pt") as f:
                    f.keys()
            else:
                torch.load(file, weights_only=False, mmap=True)
        except Exception as exc:  # noqa: BLE001 - any failure to read means "do not load this one"
            return f"{file}: {' '.join(str(exc).split()) or type(exc).__name__}"
    return None


def _newest_loadable(run_dir: Path, world) -> Path | None:
    """The newest checkpoint that can be loaded, warning about each newer one that cannot (rank 0
    decides and broadcasts). None when there is no checkpoint; RunDirError when none is loadable."""
    choice, bad = None, []
    if world.is_main:
        for path in reversed(sorted(RunDir(run_dir).checkpoints.glob("ckpt_*"))):
            why = _unreadable(path)
            if why is None:
                choice = str(path)
                break
            bad.append(why)
            print(f"[mugrpo] warning: checkpoint {path.name} cannot be loaded ({why}); trying an older one")
    choice, bad = dist.broadcast_object((choice, bad))
    if choice is None and bad:
        raise RunDirError(f"no checkpoint of {run_dir} can be loaded ({'; '.join(bad)}). The run cannot be "
                          "resumed; start a new run (or restore a checkpoint from a backup)")
    return Path(choice) if choice else None


def load_latest(run_dir: Path, policy, optimizer, scheduler, world, state_type: type = RunState):
    """Restore model, optimizer, schedule and RNGs from the newest loadable checkpoint; return its state, a
    ``state_type`` (None without a checkpoint)."""

    path = _newest_loadable(run_dir, world)
    if path is None:  # died before the first stage ended: the initial state is a pure function of the config
        if world.is_main:
            print(f"[mugrpo] --resume {run_dir}: no checkpoint yet; restarting from the initial weights "
                  "(stage data already on disk is reused)")
        return None
    saved = json.loads((path / "trainer_state.json").read_text())
    # Rank 0 reads model and optimizer and scatters them into the shards, one tensor at a time.
    if world.is_main:
        with safe_open(str(path / "model.safetensors"), "pt") as f:
            dist.load_full_params(policy, f.get_tensor)
        optim_sd = torch.load(path / "optimizer.pt", weights_only=False, mmap=True)["optimizer"]
    else:
        dist.load_full_params(policy, None)
        optim_sd = None
    dist.load_full_optimizer_state(policy, optimizer, optim_sd)
    scheduler.load_state_dict(torch.load(path / "scheduler.pt", weights_only=False)["scheduler"])
    rng_path = path / f"rng_rank{world.rank}.pt"  # absent when resuming on more processes than saved
    _set_rng_state(torch.load(rng_path if rng_path.is_file() else path / "rng_rank0.pt", weights_only=False)["rng"])
    state = state_from_saved(saved, state_type)
    if world.is_main:
        print(f"[mugrpo] resumed from {path.name}: {state.describe()}")
    return state


def export_hf(policy, tokenizer, target: Path, world) -> None:
    """Save the policy as one HF folder (full weights gathered under FSDP2), atomically.

    With LoRA the folder holds the merged weights under the base model's names (a plain HF model)
    and, in ``adapter/``, the adapter alone as a peft folder. A full disk raises
    :class:`DiskFullError` saying how much to free, after removing the partial folder: the run's
    last checkpoint is written before the export, so resuming the run (the run folder is ``target``'s
    parent; :func:`mugrpo.run_dir.resume_command`) only exports again."""
    state_dict = _full_state_dict(dist.full_state_items(policy, keep=world.is_main))
    adapter = _full_state_dict(dist.adapter_items(policy, keep=world.is_main)) if lora.has_lora(policy) else None
    if not world.is_main:
        dist.barrier()
        return
    target = Path(target)
    tmp = target.with_name(f".tmp-{target.name}")
    try:
        shutil.rmtree(tmp, ignore_errors=True)
        policy.save_pretrained(tmp, state_dict=state_dict)
        tokenizer.save_pretrained(tmp)
        if adapter is not None:
            lora.save_adapter(policy, adapter, tmp / ADAPTER_DIR)
        if target.exists():
            shutil.rmtree(target)
        os.replace(tmp, target)
    except Exception as exc:
        cause = write_failure(exc)
        if cause is None:
            raise
        shutil.rmtree(tmp, ignore_errors=True)
        weights = sum(t.numel() * t.element_size() for sd in (state_dict, adapter or {}) for t in sd.values())
        raise DiskFullError(
            f"{cause} while writing the final model to {target} ({exc}). Nothing was lost: the partial folder "
            f"was removed and training is done (its last checkpoint is intact). Free at least {size_text(weights)} "
            f"(the model's weights) on that disk, e.g. older runs' checkpoints, then write the final model with: "
            f"{resume_command(target.parent)}") from exc
    finally:
        dist.barrier()
