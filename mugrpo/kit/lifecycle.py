"""A run's lifecycle, one component for every kind of run and every phase: its hold on the run
directory from the first piece of work to the last write, and the order of a phase's steps.

:class:`RunLifecycle` (a context manager) owns, for ``mugrpo train`` (kinds ``rl`` and ``replay``),
``mugrpo sft`` (``sft``) and the warm start inside a train run (``warmstart``):

- the claim: the directory checked free (a new run) or read (a resume), its config and kind written
  (:data:`mugrpo.run_dir.RUN_KINDS`), and the lock; a resume of another kind of run is refused before
  anything is written, naming the command that resumes it;
- the stop handler (:mod:`mugrpo.stopping`), adopted from the CLI, which installs it before its first
  heavy import, and held until the last write; the stop points between a phase's steps;
- the command a user is told to run (:func:`mugrpo.run_dir.resume_command`: right for the kind);
- the way out: whatever it is, registered objects are closed in order and the lock released; a new
  run that failed with an error keeps nothing it wrote unless that holds work to resume
  (:meth:`mugrpo.run_dir.RunDir.holds_work`), so the corrected command can be run again; a stop
  (:class:`~mugrpo.stopping.Interrupted`), a full disk (:class:`~mugrpo.run_dir.DiskFullError`: its
  message gives the resume command) and a resume keep everything.

A phase (RL: :class:`mugrpo.training.trainer.Trainer`; the warm start:
:class:`mugrpo.warmstart.phase.WarmStart`; both :class:`Phase`) runs inside one context,
``with life.phase() as run: run.run(phase)`` (:class:`PhaseRun`), which takes it through its order:
a stop point and the claim (a resume, or a run that claims first) or the check that the directory is
free; once the phase is built, the resume (stale temporaries removed, the newest loadable checkpoint,
the metric records beyond it dropped by the phase's rule) or, for a new run, the claim; the phase's
start; the one loop around the step, for both phases (:meth:`PhaseRun.steps`): a checkpoint every
``checkpoint_every`` global steps, at the end of each of the phase's units (RL: a stage; the warm start:
the whole phase) and on a stop, which then ends the run; the final export.

Also here, for the CLI: :func:`resume_config` (the config a resumed run trains with) and the checks
behind it. Not here: what a checkpoint holds (:mod:`mugrpo.kit.checkpoint`), the steps themselves,
evaluation, stage data.
"""

from __future__ import annotations

import fcntl
import json
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Protocol

from mugrpo import stopping
from mugrpo.config import (Config, ConfigError, dump_yaml, from_dict, parse_override, read_config_file,
                           read_run_config, resume_safe_keys, set_value, to_dict, validate)
from mugrpo.faults import maybe_die
from mugrpo.kit import checkpoint as ckpt
from mugrpo.kit import distributed as dist
from mugrpo.kit.checkpoint import RunState
from mugrpo.run_dir import (CONFIG_FILE, DiskFullError, RunDir, RunDirError, atomic_write_text,
                            remove_stale_temporaries, resume_command)

RESUME_SAFE_KEYS = resume_safe_keys()  # the fields marked resume_safe in mugrpo.config.schema
"""Keys (or, ending in '.', whole sections) that a resume may change: they do not alter the experiment."""

VERB_KINDS = {"rl": ("rl", "replay"), "replay": ("rl", "replay"), "sft": ("sft",), "warmstart": ("warmstart",)}
"""The recorded kinds a run of each kind may resume (``mugrpo train --resume`` continues a replay too)."""


class Phase(Protocol):
    """What a phase gives the lifecycle that runs it (:meth:`PhaseRun.run`)."""

    state: RunState
    """The phase's position; replaced by the resumed one (a fresh instance of its class without a checkpoint)."""
    t_start: float
    """The phase's clock origin (``time.perf_counter()`` less the earlier sessions' seconds), set by :meth:`start`."""
    total_steps: int
    """The global step the phase ends at."""
    checkpoint_every: int | None
    """A checkpoint every this many global steps (0/None: only at units' ends and on a stop)."""

    def checkpointed(self) -> tuple[Any, Any, Any]:
        """(policy, optimizer, scheduler): what a checkpoint saves and a resume loads."""

    def kept_after_resume(self, record: dict) -> bool:
        """Whether a resumed run at ``self.state`` keeps this metric record (the others are dropped)."""

    def on_claim(self) -> None:
        """A new run has just claimed its directory: write what the phase records at its start."""

    def start(self, run: "PhaseRun") -> None:
        """Open the logger, print what the run does, set the clock; anything that runs before the first step."""

    def step(self) -> bool:
        """One optimizer step (``state.update`` counts it), logged; True when it ends one of the phase's units."""

    def end_unit(self) -> None:
        """Close the unit the last step ended (checkpointed right after)."""

    def more(self) -> bool:
        """Whether work remains that a stop would abandon (the loop ends at ``total_steps`` regardless)."""

    def finish(self) -> Any:
        """The phase's end checks; returns the tokenizer to export the model with, or None for no export."""

    def close(self) -> None:
        """Release what the phase holds (the lifecycle calls it on the way out, whatever the way)."""


class RunLifecycle:
    """One run's hold on its directory (see the module docstring). ``kind``: what this command runs;
    ``claim_first``: claim the directory at the first phase's start, not once its model has loaded (a run
    whose first phase is a warm start: its work is what a resume must find)."""

    def __init__(self, run_dir: RunDir, cfg, kind: str, resume: bool, world, claim_first: bool = False):
        self.run_dir, self.cfg, self.kind, self.resume, self.world = run_dir, cfg, kind, resume, world
        self.claim_first = claim_first
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

    def phase(self) -> "PhaseRun":
        """The context one phase runs in (:class:`PhaseRun`)."""
        return PhaseRun(self)

    def check_kind(self) -> None:
        """Refuse to resume a run of another kind (before anything is written), naming its own command."""
        recorded = self.run_dir.kind() or _inferred_kind(self.run_dir)
        if recorded is not None and recorded not in VERB_KINDS[self.kind]:
            raise RunDirError(f"{self.run_dir.path} is a {recorded} run, not one this command continues; nothing "
                              f"was written. Continue it with: {resume_command(self.run_dir.path, recorded)}")

    def _check_free(self) -> None:
        """A new run that claims its directory late (after its model loads): fail early if it is taken."""
        if not self.resume:
            check_run_dir_free(self.run_dir.path)

    def _claim(self) -> None:
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

    def _stop_point(self) -> None:
        """A safe point between a phase's steps: stop now if a stop was requested (every rank alike)."""
        if dist.max_over_ranks(int(self.stopper.requested)):
            raise stopping.Interrupted(self.run_dir.path if self.claimed else None, self.kind)

    def _stop_requested(self) -> bool:
        """Whether a stop was requested on any rank. Ranks may see a signal a step apart: all stop after the
        step one of them saw it in (the checkpoint is a collective; a rank saving alone would wait in it
        until parallel.timeout_s)."""
        return dist.max_over_ranks(int(self.stopper.requested)) > 0

    def close_at_exit(self, close: Callable[[], None]) -> None:
        """Run ``close()`` when the lifecycle ends (before the unlock)."""
        self._closers.append(close)

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


class PhaseRun:
    """One phase inside a :class:`RunLifecycle`: entered, a stop point and the claim (a resume, or a run
    that claims first) or the check that a new run's directory is free; :meth:`run` takes a built phase
    through the rest of its order (the module docstring)."""

    def __init__(self, life: RunLifecycle):
        self.life = life
        self.checkpoint_s = 0.0
        """Seconds this phase has spent writing checkpoints (a phase reads it to time its units)."""

    @property
    def run_dir(self) -> RunDir:
        return self.life.run_dir

    @property
    def world(self):
        return self.life.world

    @property
    def resume(self) -> bool:
        return self.life.resume

    @property
    def stopper(self) -> stopping.GracefulStop:
        return self.life.stopper

    def __enter__(self) -> "PhaseRun":
        life = self.life
        life._stop_point()  # a stop during the imports, the data's loading, or between two phases
        if life.resume or life.claim_first:
            life._claim()  # before any work: a second process on this run directory stops here
        else:
            life._check_free()
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        return False

    def run(self, phase: Phase) -> Path:
        """Resume or claim, start, train and export ``phase``; returns the final model folder."""
        life = self.life
        maybe_die("model_loaded")
        life.close_at_exit(phase.close)
        if life.resume:
            self._resume(phase)
        else:
            life._stop_point()  # a stop while the model loaded: a new run has written nothing yet
            life._claim()  # a new run: only now that the phase has loaded, so a failed start leaves nothing
            phase.on_claim()
        life._stop_point()  # a stop during the start: nothing trained yet, the resume starts here
        phase.start(self)
        life._stop_point()  # a stop during the start's work (RL's starting evaluation: the resume runs it)
        self.steps(phase)
        tokenizer = phase.finish()
        if tokenizer is not None:
            ckpt.export_hf(phase.checkpointed()[0], tokenizer, self.run_dir.final_model, self.world)
        return self.run_dir.final_model

    def steps(self, phase: Phase) -> None:
        """The loop around the step, one for every phase: steps until ``phase.total_steps``; a checkpoint at
        each unit's end, every ``phase.checkpoint_every`` global steps, and on a stop, which then raises
        Interrupted (a stop at the last step, with nothing left to abandon, lets the phase end)."""
        state, every = phase.state, phase.checkpoint_every
        while state.update < phase.total_steps:
            if phase.step():
                phase.end_unit()
                self.save(phase)
                stop = phase.more() and self.life._stop_requested()
            else:
                stop = self.life._stop_requested()
                if stop or (every and state.update % every == 0):
                    self.save(phase)
            if stop:
                raise stopping.Interrupted(self.run_dir.path)

    def save(self, phase: Phase) -> None:
        """Checkpoint ``phase`` now (its clock gives the run's seconds so far)."""
        t = time.perf_counter()
        policy, optimizer, scheduler = phase.checkpointed()
        ckpt.save(self.run_dir.path, policy, optimizer, scheduler, phase.state, self.life.cfg, self.world,
                  elapsed_s=t - phase.t_start)
        self.checkpoint_s += time.perf_counter() - t

    def _resume(self, phase: Phase) -> None:
        """Load the newest checkpoint (if any) into the phase, and drop the metric records beyond it (all of
        them without one: the run starts over)."""
        world = self.world
        if world.is_main:
            for path in remove_stale_temporaries(self.run_dir.path):
                print(f"[mugrpo] removed {path}, left by an interrupted write")
        policy, optimizer, scheduler = phase.checkpointed()
        fresh = type(phase.state)
        phase.state = ckpt.load_latest(self.run_dir.path, policy, optimizer, scheduler, world, fresh) or fresh()
        if world.is_main:
            truncate_metrics(self.run_dir.metrics, phase.state.update, phase.kept_after_resume)


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
    if not run_dir.is_dir() or RunDir(run_dir).holds_work():
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


def truncate_metrics(path: Path, update: int, keep: Callable[[dict], bool]) -> None:
    """Drop the metric lines of a resumed run that ``keep`` (the phase's rule: the records up to the
    checkpoint, without any the resumed run writes again) refuses, and lines torn by a kill. Without a
    checkpoint (``update`` 0) the run starts over, so nothing of it is kept (the same rule for every phase)."""
    if not Path(path).is_file():
        return
    if update == 0:
        Path(path).unlink()
        return
    kept = []
    for line in Path(path).read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:  # a line torn by the kill
            continue
        if keep(record):
            kept.append(line)
    atomic_write_text(Path(path), "".join(f"{line}\n" for line in kept))
