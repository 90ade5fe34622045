"""A run's lifecycle, one component for every kind of run: its hold on the run directory from the
first piece of work to the last write.

:class:`RunLifecycle` (a context manager) owns, for ``mugrpo train`` (kinds ``rl`` and ``replay``),
``mugrpo sft`` (``sft``) and the warm start inside a train run (``warmstart``):

- the claim: the directory checked free (a new run) or read (a resume), its config and kind written
  (:data:`mugrpo.run_dir.RUN_KINDS`), and the lock; a resume of another kind of run is refused before
  anything is written, naming the command that resumes it;
- the stop handler (:mod:`mugrpo.stopping`), adopted from the CLI, which installs it before its first
  heavy import, and held until the last write; :meth:`RunLifecycle.stop_point` between phases;
- resume (:meth:`RunLifecycle.resume_state`: stale temporaries removed, the newest loadable
  checkpoint, the metrics beyond it dropped, with the evaluator's own rule for the evaluation at the
  resumed update, a pending stage-end evaluation included), the checkpoint cadence and the stop after a
  step (:meth:`RunLifecycle.after_step`), checkpoints (:meth:`RunLifecycle.save`) and the final export
  (:meth:`RunLifecycle.export`);
- the command a user is told to run (:func:`mugrpo.run_dir.resume_command`: right for the kind);
- the way out: whatever it is, registered objects are closed in order and the lock released; a new
  run that failed with an error keeps nothing it wrote unless that holds work to resume (a checkpoint,
  stage data, a warm start), so the corrected command can be run again; a stop
  (:class:`~mugrpo.stopping.Interrupted`), a full disk (:class:`~mugrpo.run_dir.DiskFullError`: its
  message gives the resume command) and a resume keep everything.

Also here, for the CLI: :func:`resume_config` (the config a resumed run trains with) and the checks
behind it. Not here: what a checkpoint holds (:mod:`mugrpo.kit.checkpoint`), the loops.
"""

from __future__ import annotations

import fcntl
import json
import shutil
import tempfile
import time
from pathlib import Path
from typing import Callable

from mugrpo import stopping
from mugrpo.config import (Config, ConfigError, dump_yaml, from_dict, parse_override, read_config_file,
                           read_run_config, resume_safe_keys, set_value, to_dict, validate)
from mugrpo.evaluation.schedule import evaluates_at_start
from mugrpo.kit import checkpoint as ckpt
from mugrpo.kit import distributed as dist
from mugrpo.kit.checkpoint import RunState
from mugrpo.run_dir import (CONFIG_FILE, SHARDS_FILE, DiskFullError, RunDir, RunDirError, atomic_write_text,
                            remove_stale_temporaries, resume_command)

RESUME_SAFE_KEYS = resume_safe_keys()  # the fields marked resume_safe in mugrpo.config.schema
"""Keys (or, ending in '.', whole sections) that a resume may change: they do not alter the experiment."""

VERB_KINDS = {"rl": ("rl", "replay"), "replay": ("rl", "replay"), "sft": ("sft",), "warmstart": ("warmstart",)}
"""The recorded kinds a run of each kind may resume (``mugrpo train --resume`` continues a replay too)."""


class RunLifecycle:
    """One run's hold on its directory (see the module docstring). ``kind``: what this command runs."""

    def __init__(self, run_dir: RunDir, cfg, kind: str, resume: bool, world):
        self.run_dir, self.cfg, self.kind, self.resume, self.world = run_dir, cfg, kind, resume, world
        self.existed = run_dir.path.is_dir()  # a directory found (empty) keeps itself when a failed start is undone
        self.lock = None
        self._closers: list[Callable[[], None]] = []
        self._hold = stopping.hold()
        self.stopper: stopping.GracefulStop | None = None
        self._outer: tuple = (None, None)
        self._claimed = False

    def __enter__(self) -> "RunLifecycle":
        self.stopper = self._hold.__enter__()
        self._outer = (self.stopper.run_dir, self.stopper.kind)  # a warm start's lifecycle nests in its run's
        if self.resume:
            self.check_kind()
        return self

    def check_kind(self) -> None:
        """Refuse to resume a run of another kind (before anything is written), naming its own command."""
        recorded = self.run_dir.kind() or _inferred_kind(self.run_dir)
        if recorded is not None and recorded not in VERB_KINDS[self.kind]:
            raise RunDirError(f"{self.run_dir.path} is a {recorded} run, not one this command continues; nothing "
                              f"was written. Continue it with: {resume_command(self.run_dir.path, recorded)}")

    def check_free(self) -> None:
        """A new run that claims its directory late (after its model loads): fail early if it is taken."""
        if not self.resume:
            check_run_dir_free(self.run_dir.path)

    def claim(self) -> None:
        """Check (new run) or read (resume) the directory, write what a run starts with, and lock it;
        from here on a stop names this run's resume command. Idempotent."""
        if self._claimed:
            return
        prepare_run_dir(self.run_dir.path, self.cfg, self.resume, is_main=self.world.is_main)
        self.lock = lock_run_dir(self.run_dir.path, self.world)
        if self.world.is_main and (not self.resume or self.run_dir.kind() is None):
            self.run_dir.write_kind(self.kind)
        self.stopper.run_dir, self.stopper.kind = self.run_dir.path, self.kind
        self._claimed = True

    @property
    def claimed(self) -> bool:
        return self._claimed

    def stop_point(self) -> None:
        """A safe point between phases: stop now if a stop was requested (every rank alike)."""
        if dist.max_over_ranks(int(self.stopper.requested)):
            raise stopping.Interrupted(self.run_dir.path if self.claimed else None, self.kind)

    def after_step(self, count: int, every: int | None) -> tuple[bool, bool]:
        """After a phase's step ``count``: (stop now: a stop was requested on any rank; a checkpoint is
        due: every ``every`` steps, 0/None never). Ranks may see a signal a step apart: all stop after the
        step one of them saw it in (the checkpoint is a collective; a rank saving alone would wait in it
        until parallel.timeout_s). One rule for RL's updates and the warm start's steps."""
        stop = dist.max_over_ranks(int(self.stopper.requested)) > 0
        return stop, bool(every) and count % every == 0

    def close_at_exit(self, close: Callable[[], None]) -> None:
        """Run ``close()`` when the lifecycle ends (before the unlock)."""
        self._closers.append(close)

    # -- resume, checkpoints, export --------------------------------------------------------------

    def resume_state(self, policy, optimizer, scheduler, eval_cfg) -> RunState:
        """Load the newest checkpoint (if any) into the model side; drop the metric records beyond it
        (all of them without one: the run starts over). Returns the run state to continue from."""
        if self.world.is_main:
            for path in remove_stale_temporaries(self.run_dir.path):
                print(f"[mugrpo] removed {path}, left by an interrupted write")
        state = ckpt.load_latest(self.run_dir.path, policy, optimizer, scheduler, self.world) or RunState()
        if self.world.is_main:
            truncate_metrics(self.run_dir.metrics, state, eval_cfg)
        return state

    def save(self, policy, optimizer, scheduler, state: RunState, started: float) -> float:
        """Checkpoint now (``started``: the run's clock origin); returns the seconds it took."""
        t = time.perf_counter()
        ckpt.save(self.run_dir.path, policy, optimizer, scheduler, state, self.cfg, self.world,
                  elapsed_s=t - started)
        return time.perf_counter() - t

    def export(self, policy, tokenizer) -> Path:
        """Write the final HF model folder; returns it."""
        ckpt.export_hf(policy, tokenizer, self.run_dir.final_model, self.world)
        return self.run_dir.final_model

    def __exit__(self, exc_type, exc, tb) -> bool:
        failed_new_run = (isinstance(exc, Exception) and not self.resume and self._claimed
                          and not isinstance(exc, (stopping.Interrupted, DiskFullError)))
        try:
            for close in (*self._closers, self.lock and self.lock.close):
                if close:
                    close()
        finally:
            self.stopper.run_dir, self.stopper.kind = self._outer
            self._hold.__exit__(exc_type, exc, tb)
        if failed_new_run and discard_failed_start(self.run_dir.path, keep_dir=self.existed):
            print(f"[mugrpo] removed what this run wrote in {self.run_dir.path}: it failed before writing anything "
                  "to resume from, so the corrected command can be run again")
        return False


def _inferred_kind(run_dir: RunDir) -> str | None:
    """The kind of a run directory written before kinds were recorded: an sft run's log starts with
    its ``sft_data`` record; a directory with stages, a warm start or a replay source is a train run."""
    if any(p.exists() for p in (run_dir.stages, run_dir.warmstart, run_dir.replay)):
        return "rl"
    try:
        with open(run_dir.metrics) as fh:
            first = json.loads(fh.readline() or "{}")
    except (OSError, ValueError):
        return None
    return "sft" if str(first.get("kind", "")).startswith("sft") else None


def check_run_dir_free(run_dir: Path) -> None:
    if Path(run_dir).is_dir() and any(Path(run_dir).iterdir()):
        raise RunDirError(f"run directory {str(run_dir)!r} is not empty. To continue that run: "
                          f"{resume_command(run_dir)}; to start afresh, choose a new --run-dir "
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
    run evaluates it again at its start (:func:`~mugrpo.evaluation.schedule.evaluates_at_start`;
    ``eval_cfg``: the resumed run's ``eval`` section). Without a checkpoint (``state.update`` 0) the
    run starts over, so nothing of it is kept (the same rule for RL and the warm start)."""
    if not Path(path).is_file():
        return
    if state.update == 0:
        Path(path).unlink()
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


