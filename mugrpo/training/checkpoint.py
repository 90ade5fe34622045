"""Run directories, checkpoints, the final HF export, and clean stops on SIGINT/SIGTERM.

Layout of a run directory (its names: :class:`mugrpo.run_dir.RunDir`)::

    config.yaml                    resolved config (written once, at start)
    .lock                          held (flock) by the process training in the directory
    metrics.jsonl                  one line per update and per stage
    stages/stage_KKK/              the stage's data: shards, completion marker, generation metrics,
                                   readable jsonl (file names: mugrpo.training.data.shard_path and below)
    checkpoints/ckpt_UUUUUU/       model.safetensors (the trained parameters: all of them, or the LoRA
                                   adapters), optimizer.pt, scheduler.pt, rng_rank{R}.pt,
                                   trainer_state.json, config.yaml (the config it was trained with)
    final_model/                   HF folder: AutoModelForCausalLM.from_pretrained(...) loads it
                                   (LoRA merged in); with LoRA also adapter/, a peft adapter folder

A checkpoint is written into a temporary folder, fsynced, then renamed: a folder named ``ckpt_*``
is always complete. The newest ``keep_last`` are kept. It holds the model, optimizer and LR
schedule, every RNG state, and the position (stage, update, update within the stage); the stage's
data is on disk already, so resuming mid-stage never regenerates. A resume checks RUN_DIR/config.yaml
(plus any ``key=value`` overrides) against the config stored in the newest checkpoint, and loads the
newest checkpoint that is readable, warning about any newer one that is not.

Model and optimizer are stored whole (optimizer state keyed by parameter name), whatever the number
of processes: under FSDP2 they are gathered one tensor at a time and only rank 0 keeps them, and on
load rank 0 reads them and scatters each tensor into the shards (:mod:`mugrpo.training.distributed`). So a
run may resume on a different number of processes (its stage data permitting, see
``distributed.load_stage_shards``).
"""

from __future__ import annotations

import dataclasses
import errno
import fcntl
import json
import os
import random
import shutil
import signal
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from mugrpo.errors import UserError
from mugrpo.training import distributed as dist
from mugrpo.models import lora
from mugrpo.config import (Config, ConfigError, dump_yaml, from_dict, parse_override, read_config_file,
                           read_run_config, resume_safe_keys, set_value, to_dict, validate)
from mugrpo.run_dir import (CONFIG_FILE, LOCK_FILE, SHARDS_FILE, RunDir, RunDirError,  # noqa: F401 (re-exported)
                            atomic_write_text)
from mugrpo.faults import maybe_die


@dataclass
class RunState:
    """Everything positional that a resume needs besides weights, optimizer and RNG states."""

    stage: int = 0
    update_in_stage: int = 0
    """Updates already done in ``stage`` (0 = the stage's data may not exist yet)."""
    update: int = 0
    """Global optimizer updates done."""
    bad_update_streak: int = 0
    num_skipped_updates: int = 0
    elapsed_s: float = 0.0
    """Wall-clock of earlier sessions of this run (so ``time_s`` continues across resumes)."""
    stage_first_log_ratio: float | None = None
    """The stage's first update's ``loss/log_ratio_abs_mean`` (its ``stage/engine_logprob_mismatch``),
    kept so that a resume past that update still logs it; None before the stage's first update."""
    eval_pending: bool = False
    """A stop abandoned the stage-end evaluation at ``update``: the resumed run runs it at its start."""

# Keys whose change makes a resumed run a different experiment (checked by --resume).
RESUME_SAFE_KEYS = resume_safe_keys()  # the fields marked resume_safe in mugrpo.config.schema
"""Keys (or, ending in '.', whole sections) that a resume may change: they do not alter the experiment."""


class Interrupted(Exception):
    """Training stopped on SIGINT/SIGTERM after checkpointing."""

    def __init__(self, run_dir: Path, verb: str = "train"):
        super().__init__(f"training stopped cleanly and checkpointed. Resume with: mugrpo {verb} --resume {run_dir}")
        self.run_dir = run_dir


def check_run_dir_free(run_dir: Path) -> None:
    if Path(run_dir).is_dir() and any(Path(run_dir).iterdir()):
        raise RunDirError(f"run directory {str(run_dir)!r} is not empty. To continue that run: "
                          f"mugrpo train --resume {run_dir}; to start afresh, choose a new --run-dir "
                          "or delete the old one")


def discard_failed_start(run_dir: Path, keep_dir: bool) -> bool:
    """After a new run failed with an error: delete what it wrote if that holds nothing to resume (no
    stage data, no checkpoint), so the corrected command can simply be run again; a resume could not
    take the correction when it changes the experiment. Only for a directory the run found empty
    (``keep_dir``: it existed then, so only its contents go). Returns True if it deleted."""
    run_dir = Path(run_dir)
    warm = RunDir(RunDir(run_dir).warmstart)  # a warm start's checkpoints or final model are work to resume
    if not run_dir.is_dir() or any(RunDir(run_dir).checkpoints.glob("ckpt_*")) or any(
            RunDir(run_dir).stages.glob(f"stage_*/{SHARDS_FILE}")) or any(warm.checkpoints.glob("ckpt_*")) or (
            warm.final_model.is_dir()):
        return False
    for path in (list(run_dir.iterdir()) if keep_dir else [run_dir]):
        shutil.rmtree(path) if path.is_dir() else path.unlink()
    return True


def prepare_run_dir(run_dir: Path, cfg: Config, resume: bool, is_main: bool = True) -> None:
    run_dir = Path(run_dir)
    if resume:
        read_run_config(run_dir, f"--resume {run_dir}")  # RunDirError: not a run directory
        return
    if is_main:
        check_run_dir_free(run_dir)
        try:
            run_dir.mkdir(parents=True, exist_ok=True)
            with tempfile.NamedTemporaryFile(dir=run_dir):
                pass
        except OSError as exc:
            raise RunDirError(f"run directory {str(run_dir)!r} is not writable ({exc.strerror}); "
                              "choose another --run-dir") from exc
        atomic_write_text(RunDir(run_dir).config, dump_yaml(cfg))
    dist.barrier()


ADAPTER_DIR = "adapter"
"""final_model/adapter/: the LoRA adapter as a peft folder (LoRA runs only)."""


def lock_run_dir(run_dir: Path, world):
    """Take an exclusive lock on ``run_dir`` for as long as the returned file stays open (rank 0 holds
    it; None on other ranks). A second process on the same run directory gets RunDirError."""
    error, handle = None, None
    if world.is_main:
        try:
            handle = open(RunDir(run_dir).lock, "a")
        except OSError as exc:
            error = f"run directory {str(run_dir)!r} is not writable ({exc.strerror}); choose another --run-dir"
        else:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                handle.close()
                handle = None
                error = (f"run directory {str(run_dir)!r} is in use by another mugrpo process; wait for it to "
                         "end (or stop it) before resuming, or choose another --run-dir")
    error = dist.broadcast_object(error)
    if error:
        raise RunDirError(error)
    return handle


def remove_stale_temporaries(run_dir: Path) -> list[Path]:
    """Delete what an interrupted write left behind in ``run_dir``; returns the removed paths.

    Only with the run directory locked: the names are those of :func:`mugrpo.training.data.atomic_write`
    (``.NAME.tmp-PID``) and of the checkpoint and final-model folders built before their rename
    (``.tmp-NAME``), in the folders mugrpo writes them to.
    """
    run_dir = Path(run_dir)
    folders = [run_dir, RunDir(run_dir).checkpoints, *sorted(RunDir(run_dir).stages.glob("stage_*"))]
    removed = []
    for folder in folders:
        if not folder.is_dir():
            continue
        for path in folder.iterdir():
            if path.name.startswith(".tmp-") or (path.name.startswith(".") and ".tmp-" in path.name):
                shutil.rmtree(path) if path.is_dir() else path.unlink()
                removed.append(path)
    return removed


def resume_config(run_dir: Path, overrides: list[str]) -> Config:
    """The config a resumed run trains with: RUN_DIR/config.yaml, then ``key=value`` overrides.

    The result is compared with the config the newest checkpoint was trained with (the run
    directory's own config.yaml for a run without one yet): resume-safe keys
    (:data:`RESUME_SAFE_KEYS`) may differ and are applied; any other difference is refused,
    whether it comes from an override or from an edit of the file.
    """
    run_dir = Path(run_dir)
    path = RunDir(run_dir).config
    values = read_run_config(run_dir, f"--resume {run_dir}")
    cfg = _config_from_file(values, path)
    for text in overrides:  # applied on top of the saved config, not the defaults
        set_value(cfg, *parse_override(text))
    validate(cfg)
    trained = _trained_config(run_dir)
    # Compared with today's defaults filled in, so runs saved before a new config key existed still resume.
    reference = _config_from_file(*trained) if trained else _config_from_file(values, path)
    source = f"the config the run was trained with ({trained[1]})" if trained else f"{path}"
    check_resume_compatible(to_dict(reference), to_dict(cfg), source)
    return cfg


def _config_from_file(values: dict, path: Path) -> Config:
    try:
        return from_dict(values)
    except ConfigError as exc:
        raise ConfigError(f"{path}: {exc}") from exc


def _trained_config(run_dir: Path) -> tuple[dict, Path] | None:
    """(values, file) of the config stored in the newest checkpoint that has a readable one."""
    for folder in reversed(sorted(RunDir(run_dir).checkpoints.glob("ckpt_*"))):
        try:
            values = read_config_file(folder / CONFIG_FILE)
        except ConfigError:  # a checkpoint written before configs were stored, or a damaged one
            continue
        if values:
            return values, folder / CONFIG_FILE
    return None


def check_resume_compatible(saved: dict, current: dict, source: str = "the run's own config") -> None:
    """Raise RunDirError naming every key that differs between the saved and the requested config."""
    def flat(d, prefix=""):
        out = {}
        for k, v in d.items():
            if isinstance(v, dict) and k != "params":
                out.update(flat(v, f"{prefix}{k}."))
            else:
                out[f"{prefix}{k}"] = v
        return out

    a, b = flat(saved), flat(current)
    def safe(key: str) -> bool:
        return any(key == k or (k.endswith(".") and key.startswith(k)) for k in RESUME_SAFE_KEYS)

    diff = [k for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k) and not safe(k)]
    if diff:
        detail = ", ".join(f"{k}: {a.get(k)!r} -> {b.get(k)!r}" for k in diff)
        raise RunDirError(f"--resume with a config (config.yaml plus key=value overrides) that differs from "
                          f"{source} ({detail}). A resumed run must be the same experiment; only "
                          f"{', '.join(RESUME_SAFE_KEYS)} may change. Undo those changes, or start a new run for "
                          "different settings")


def truncate_metrics(path: Path, state, eval_cfg) -> None:
    """Drop metric lines from beyond the checkpoint being resumed, so no update or evaluation is logged
    twice: records past ``state.update``, and the evaluation at ``state.update`` itself when the resumed
    run evaluates it again at its start (:func:`evaluated_again_at_start`; ``eval_cfg``: the resumed
    run's ``eval`` section). Without a checkpoint
    (``state.update`` 0) the run starts over, so nothing of it is kept."""
    if not Path(path).is_file():
        return
    again = evaluates_at_start(eval_cfg, state)
    kept = []
    for line in Path(path).read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:  # a line torn by the kill
            continue
        if record.get("kind") == "stage":
            keep = record["stage"] < state.stage
        elif record.get("kind") == "eval" and record.get("update", 0) == state.update:
            keep = not again
        else:
            keep = record.get("update", 0) <= state.update
        if keep:
            kept.append(line)
    atomic_write_text(Path(path), "".join(f"{line}\n" for line in kept))


def evaluated_again_at_start(eval_cfg, update: int) -> bool:
    """Whether a run resumed at ``update`` evaluates that update again when it starts (the evaluator's
    own rule, :func:`mugrpo.training.evaluator.due_in_loop`, run before the first update of every
    session). The evaluation a stage end ran (``eval.every_stages``) is not repeated."""
    from mugrpo.training.evaluator import due_in_loop

    return bool(eval_cfg.num_items) and due_in_loop(eval_cfg, update)


def evaluates_at_start(eval_cfg, state) -> bool:
    """Whether a run resumed at ``state`` evaluates ``state.update`` when it starts: when the in-loop
    rule asks (:func:`evaluated_again_at_start`) or a stop abandoned that stage end's evaluation."""
    return bool(eval_cfg.num_items) and (state.eval_pending or evaluated_again_at_start(eval_cfg, state.update))


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


class DiskFullError(UserError, OSError):
    """The disk filled up while a checkpoint (or a stage's data) was written; the message says
    nothing was lost and how to continue."""


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
            + f". Free some space, then continue with: mugrpo train --resume {run_dir}") from exc


_TORCH_WRITE_FAILED = ("PytorchStreamWriter failed writing", "file write failed", "unexpected pos")
"""torch.save's zip writer reports a failed write as a RuntimeError with one of these, and no errno."""


def write_failure(exc: BaseException) -> str | None:
    """What went wrong, in words, when ``exc`` is a full disk (or torch's errno-less failed write, or
    another library's, e.g. safetensors', that only says it in its text); else None."""
    if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return "no space left on device" if exc.errno == errno.ENOSPC else "disk quota exceeded"
    if isinstance(exc, RuntimeError) and any(marker in str(exc) for marker in _TORCH_WRITE_FAILED):
        return "a write failed (torch gives no reason; almost always no space left on device)"
    for text in ("No space left on device", "Disk quota exceeded"):
        if text in str(exc):
            return text[0].lower() + text[1:]
    return None


def size_text(num_bytes: int) -> str:
    """``num_bytes`` for a person: "1.4 GB", "312 MB", "12 kB"."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6)):
        if num_bytes >= scale:
            return f"{num_bytes / scale:.{1 if num_bytes < 10 * scale else 0}f} {unit}"
    return f"{max(num_bytes // 1000, 1)} kB"


def _save(run_dir: Path, policy, optimizer, scheduler, state, cfg: Config, world, elapsed_s: float) -> Path:
    root = RunDir(run_dir).checkpoints
    name = f"ckpt_{state.update:06d}_s{state.stage:03d}_u{state.update_in_stage:05d}"
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


def load_latest(run_dir: Path, policy, optimizer, scheduler, world):
    """Restore model, optimizer, schedule and RNGs from the newest loadable checkpoint; return the RunState."""

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
    fields = {f.name for f in dataclasses.fields(RunState)}
    state = RunState(**{k: v for k, v in saved.items() if k in fields})
    if world.is_main:
        print(f"[mugrpo] resumed from {path.name}: stage {state.stage}, update {state.update} "
              f"({state.update_in_stage} done in this stage)")
    return state


def export_hf(policy, tokenizer, target: Path, world, verb: str = "train") -> None:
    """Save the policy as one HF folder (full weights gathered under FSDP2), atomically.

    With LoRA the folder holds the merged weights under the base model's names (a plain HF model)
    and, in ``adapter/``, the adapter alone as a peft folder. A full disk raises
    :class:`DiskFullError` saying how much to free, after removing the partial folder: the run's
    last checkpoint is written before the export, so ``mugrpo <verb> --resume`` (the run folder is
    ``target``'s parent) only exports again."""
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
            f"mugrpo {verb} --resume {target.parent}") from exc
    finally:
        dist.barrier()


class GracefulStop:
    """SIGINT/SIGTERM set ``requested``; the loop stops at its next safe point: an update is finished
    and checkpointed, a stage being generated is discarded (the last checkpoint is its start; a
    resume generates it again). The generation checks between the engine's decode steps (HF and
    vLLM), between turns, and after scoring (:mod:`mugrpo.training.generation`); an evaluation
    inside training checks between its decode steps too, and is then run by the resumed run
    (:class:`~mugrpo.training.evaluator.TrainingEvaluator`).

    A second signal aborts at once: a second SIGINT raises KeyboardInterrupt (as Ctrl-C does
    without this handler), a second SIGTERM ends the process by SIGTERM's default action, without
    a checkpoint; ``--resume`` continues from the last complete one (``run_dir``: named in the
    message)."""

    def __init__(self, run_dir: Path | None = None):
        self.requested = False
        self.run_dir = run_dir
        self._previous = {}
        for sig in (signal.SIGINT, signal.SIGTERM):
            try:
                self._previous[sig] = signal.signal(sig, self._handle)
            except ValueError:  # not the main thread: leave signals alone
                pass

    def _handle(self, signum, frame):
        name = signal.Signals(signum).name
        if self.requested:
            resume = f": mugrpo train --resume {self.run_dir}" if self.run_dir is not None else ""
            print(f"\n[mugrpo] second {name}: aborting at once, without a checkpoint; resume continues from the "
                  f"last complete checkpoint{resume}", flush=True)
            if signum == signal.SIGINT:
                raise KeyboardInterrupt
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        self.requested = True
        print(f"\n[mugrpo] {name} received: stopping at the next safe point (the current update is finished and "
              "checkpointed; a stage being generated is discarded and generated again on resume). Send it again "
              "(Ctrl-C again) to abort at once", flush=True)

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
