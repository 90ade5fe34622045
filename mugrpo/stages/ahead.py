"""Stages generated ahead (``schedule.async_stages`` = k >= 1, docs/ALGORITHM.md section 3c).

:class:`AheadStages` is a stage source (:mod:`mugrpo.stages.sources`) around the run's
:class:`~mugrpo.stages.generation.GeneratedStages`: while the trainer optimises stage s, one
background thread generates stages s + 1 .. s + k, each from a :class:`PolicySnapshot` (a CPU copy
of the weights) taken at the start of stage s on the trainer's thread. Stage s's data therefore
comes from the policy as of stage max(0, s - k)'s start: its **policy lag** (``stage/policy_lag_*``)
is at most k stages. Every sequence records its policy version (:attr:`StageData.policy_versions`).
Nothing else changes: the loss takes its ratios against the stored behaviour log-probs, so the
veto and the corrections see the lag as staleness; the stage is persisted (and read back on
resume) exactly as a synchronous one.

The engine is any engine behind :mod:`mugrpo.rollout.engines` (in process or remote): the
generating thread pushes the snapshot through the usual ``weights_loaded`` block. The trainer's
evaluations use the same engine: :class:`SharedEngine` makes the two take turns (a lock held from
``wake`` to ``sleep``, i.e. one stage's generation or one evaluation).

Idle time, per stage record (interval I_s: from the previous stage record, or this session's first
request for a stage, to this record; :class:`IdleLedger`):

- ``perf/trainer_idle_frac`` = seconds the trainer's thread waited for the generator in I_s (for a
  stage's data, or for the engine before an evaluation) / |I_s|;
- ``perf/engine_idle_frac`` = seconds in I_s during which the generating thread had no stage to
  generate / |I_s| (an evaluation the trainer runs meanwhile is not counted as engine work).

What a resume promises: bitwise equality with the uninterrupted run. A stage in flight when the
run ends is lost (a stage is complete once its shards are marked, :mod:`mugrpo.stages.store`), and
the resumed run regenerates it from the weights it was meant to come from: stage t is requested at
stage max(0, t - k)'s start (its version). When the run resumes at that very stage's start those
are its own weights; otherwise they come from the stage's **behaviour snapshot**, which a stop (or
any end of the run that closes this source) writes into the in-flight stage's folder
(``behavior_weights.safetensors``, :func:`mugrpo.run_dir.snapshot_path`) and which is removed once
the stage is complete. So a SIGTERM anywhere, a mid-stage checkpoint it writes included, resumes to
the same weights. Only a process killed outright (SIGKILL, a crash) while a stage is in flight and
the checkpoint resumed is not that stage's version's start loses the snapshot: the stage is then
generated from the resumed weights, its version (and ``stage/policy_lag_*``) says so, and a line at
resume names the stage and what changed.

Not here: what a stage is and how it is generated (:mod:`mugrpo.stages.generation`); the loop
(:mod:`mugrpo.training.trainer`). Limits: one process (the generating thread's collectives would
interleave with the trainer's); not with ``--replay`` (nothing to generate) nor
``loss.behavior_logprobs=trainer`` (:mod:`mugrpo.config.rules`).
"""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass
from typing import Callable, Optional

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from mugrpo.config import ConfigError
from mugrpo.observability.progress import Progress
from mugrpo.kit import distributed as dist
from mugrpo.run_dir import atomic_write, snapshot_path, write_failure
from mugrpo.stages.data import StageData
from mugrpo.stages.shards import is_complete
from mugrpo.stages.sources import build_stage_source
from mugrpo.stages.state import RLState


@dataclass(frozen=True)
class PolicySnapshot:
    """The behaviour weights of the stages requested at one stage's start: CPU copies, so the trainer
    may go on updating the policy while the generating thread pushes them."""

    version: int
    """The stage at whose start they were taken (after a resume mid-stage: the stage they are in)."""
    tensors: dict[str, torch.Tensor]
    at_start: bool = True
    """Taken at the start of stage ``version`` (False: mid-stage weights standing in for a lost
    snapshot after a kill; never saved, since they are not what any stage was meant to come from)."""

    @classmethod
    def take(cls, policy, version: int, at_start: bool = True) -> "PolicySnapshot":
        return cls(version, {name: t.detach().to("cpu", copy=True) for name, t in dist.full_state_items(policy)},
                   at_start)

    def save(self, stage_dir) -> None:
        """Write it as the behaviour snapshot of the (in-flight) stage in ``stage_dir``."""
        tensors = {name: t.contiguous() for name, t in self.tensors.items()}
        atomic_write(snapshot_path(stage_dir), lambda tmp: save_file(tensors, str(tmp),
                                                                     metadata={"version": str(self.version)}))

    @classmethod
    def load(cls, stage_dir, version: int) -> Optional["PolicySnapshot"]:
        """The behaviour snapshot saved for the stage in ``stage_dir`` if it is of ``version``, else None."""
        path = snapshot_path(stage_dir)
        if not path.is_file():
            return None
        try:
            with safe_open(str(path), framework="pt") as f:
                if (f.metadata() or {}).get("version") != str(version):
                    return None
                return cls(version, {name: f.get_tensor(name) for name in f.keys()})
        except Exception as exc:  # noqa: BLE001 - a damaged file: the stage falls back (and says so)
            print(f"[mugrpo] warning: {path} is unreadable ({type(exc).__name__}: {exc}); ignored")
            return None


class IdleLedger:
    """Who waited, per stage interval (module docstring). The trainer's thread adds its waits; the
    generating thread marks when it has nothing to do; :meth:`close` ends an interval. ``clock``:
    seconds (time.perf_counter; a test gives its own)."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter):
        self.clock = clock
        self._lock = threading.Lock()
        self._start: Optional[float] = None
        self._wait_s = self._idle_s = 0.0
        self._idle_since: Optional[float] = None
        """Start of the generator's current idle period, or of the interval if later; None: busy."""

    def open(self) -> None:
        """Begin the first interval (the first request for a stage), if not yet begun."""
        with self._lock:
            if self._start is None:
                self._start = self.clock()

    def add_trainer_wait(self, seconds: float) -> None:
        with self._lock:
            self._wait_s += seconds

    def engine_idle(self) -> None:
        with self._lock:
            self._idle_since = self.clock()

    def engine_busy(self) -> None:
        with self._lock:
            if self._idle_since is not None:  # never before the interval's start (close moves it)
                self._idle_s += self.clock() - self._idle_since
            self._idle_since = None

    def close(self) -> dict:
        """End the current interval and begin the next; the interval's seconds and fractions."""
        with self._lock:
            now = self.clock()
            start = self._start if self._start is not None else now
            if self._idle_since is not None:
                self._idle_s += now - max(self._idle_since, start)
                self._idle_since = now
            wall, wait, idle = now - start, self._wait_s, self._idle_s
            self._start, self._wait_s, self._idle_s = now, 0.0, 0.0
        return {"perf/stage_wall_s": wall, "perf/trainer_wait_s": wait, "perf/engine_idle_s": idle,
                "perf/trainer_idle_frac": wait / wall if wall > 0 else 0.0,
                "perf/engine_idle_frac": idle / wall if wall > 0 else 0.0}


class SharedEngine:
    """An engine the generating thread and the trainer's evaluations take turns on: ``wake`` takes
    the lock (counting the trainer's wait for it), ``sleep`` gives it back, so a weight push and the
    generation after it are never interleaved with another's. Everything else is the engine's."""

    def __init__(self, engine):
        self._engine, self._lock = engine, threading.Lock()
        self.ledger = IdleLedger()
        self.trainer_thread = threading.current_thread()

    def __getattr__(self, name):
        return getattr(self._engine, name)

    def wake(self) -> None:
        t0 = time.perf_counter()
        self._lock.acquire()
        if threading.current_thread() is self.trainer_thread:
            self.ledger.add_trainer_wait(time.perf_counter() - t0)
        try:
            self._engine.wake()
        except BaseException:
            self._lock.release()
            raise

    def load_weights(self, named_tensors) -> None:
        try:
            self._engine.load_weights(named_tensors)
        except BaseException:  # weights_loaded does not reach sleep() when the push fails
            self._lock.release()
            raise

    def sleep(self) -> None:
        try:
            self._engine.sleep()
        finally:
            self._lock.release()


def shared_engine(engine, async_stages: int):
    """The engine as the run uses it: shared between the generating thread and evaluations when
    stages are generated ahead, itself otherwise."""
    return SharedEngine(engine) if async_stages else engine


class _Stop:
    """The stop the generating thread sees: the run's (a signal) or the source's own (closing)."""

    def __init__(self, source: "AheadStages"):
        self.source = source

    @property
    def requested(self) -> bool:
        outer = self.source.stopper
        return self.source.closing or bool(outer is not None and outer.requested)

    def __getattr__(self, name):  # run_dir and the rest: the run's stopper's
        return getattr(self.source.stopper, name)


class AheadStages:
    """The stage source of ``schedule.async_stages`` = k (module docstring).

    ``inner``: the run's :class:`~mugrpo.stages.generation.GeneratedStages` (its engine a
    :class:`SharedEngine`); ``plan``: the schedule (which stages exist, where each starts);
    ``policy``: the trainer's model, copied at each stage's start."""

    def __init__(self, inner, plan, k: int, policy):
        self.inner, self.plan, self.k, self.policy = inner, plan, k, policy
        self.ledger: IdleLedger = inner.engine.ledger
        self.stopper = None
        self.closing = False
        self._jobs: queue.Queue = queue.Queue()
        self._results: dict[int, object] = {}
        self._done = threading.Condition()
        self._requested: set[int] = set()
        self._pending: dict[int, Optional[PolicySnapshot]] = {}
        """The snapshot of each requested stage not yet handed to the trainer (None: on disk)."""
        self._thread: Optional[threading.Thread] = None

    # The trainer's side. ----------------------------------------------------------------------

    def stage(self, state, stopper=None) -> tuple[StageData, dict]:
        """Stage ``state.stage``'s data (waiting for it if it is still being generated), after
        requesting the stages up to ``state.stage + k`` not yet requested, each from the weights of
        its version (module docstring)."""
        self.stopper = stopper
        self.ledger.open()
        if self._thread is None:
            self._thread = threading.Thread(target=self._generate_loop, name="mugrpo-ahead", daemon=True)
            self._thread.start()
        s = state.stage
        wanted = [t for t in range(s, s + self.k + 1) if t not in self._requested and self._may_exist(state, t)]
        snapshots = self._snapshots(state, wanted)
        for t in wanted:  # in stage order: the thread generates them in that order
            self._requested.add(t)
            self._pending[t] = snapshots[t]
            self._jobs.put((self._future_state(state, t), snapshots[t]))
        t0 = time.perf_counter()
        result = self._wait(s)
        self.ledger.add_trainer_wait(time.perf_counter() - t0)
        if isinstance(result, BaseException):
            raise result
        self._pending.pop(s, None)
        snapshot_path(self.inner.store.stage_dir(s)).unlink(missing_ok=True)  # the stage is complete
        data, metrics = result
        return data, {**metrics, **lag_metrics(data.versions(s), s)}

    def _snapshots(self, state, wanted: list[int]) -> dict[int, Optional[PolicySnapshot]]:
        """The weights each of the ``wanted`` stages is generated from (None: complete on disk): stage t's
        version is max(0, t - k); the policy's own weights at that stage's start, else the snapshot a stop
        saved. Without either (a kill), the policy's weights now, said in a line."""
        s, here, now, lost = state.stage, None, None, []
        out: dict[int, Optional[PolicySnapshot]] = {}
        for t in wanted:
            stage_dir = self.inner.store.stage_dir(t)
            version = max(0, t - self.k)
            if is_complete(stage_dir):
                out[t] = None
            elif version == s and state.update_in_stage == 0:
                out[t] = here = here or PolicySnapshot.take(self.policy, s)
            elif (saved := PolicySnapshot.load(stage_dir, version)) is not None:
                out[t] = saved
            else:
                out[t] = now = now or PolicySnapshot.take(self.policy, s, at_start=False)
                lost.append((t, version))
        if lost:
            where = f"stage {s}'s start" if state.update_in_stage == 0 else \
                f"stage {s} after {state.update_in_stage} of its updates"
            print("[mugrpo] resume: " + "; ".join(
                f"stage {t} was in flight from the weights of stage {v}'s start, which were not saved (the run was "
                f"killed, not stopped): it is generated from the weights resumed ({where}), its policy lag "
                f"{t - s} instead of {t - v} (stage/policy_lag_*)" for t, v in lost)
                + "; from here the run differs from an uninterrupted one")
        return out

    def stage_end_metrics(self) -> dict:
        """The stage interval's idle seconds and fractions (the trainer calls it as it logs the stage)."""
        return self.ledger.close()

    def close(self) -> None:
        """Stop the generating thread (within a decode step) and wait for it: before the engine closes.
        Then save the snapshot of each stage left in flight, so that a resume generates it from the
        same weights (module docstring)."""
        self.closing = True
        if self._thread is not None:
            self._jobs.put(None)
            self._thread.join()
        for t, snapshot in sorted(self._pending.items()):
            stage_dir = self.inner.store.stage_dir(t)
            if snapshot is None or not snapshot.at_start or is_complete(stage_dir):
                continue
            try:
                snapshot.save(stage_dir)
            except Exception as exc:  # noqa: BLE001 - the run is ending anyway: its resume falls back, and says so
                print(f"[mugrpo] warning: could not save the weights stage {t} is generated from "
                      f"({write_failure(exc) or exc}); a resume generates it from the resumed weights")

    def _wait(self, stage: int):
        with self._done:
            self._done.wait_for(lambda: stage in self._results or "error" in self._results)
            return self._results.pop(stage) if stage in self._results else self._results["error"]

    def _may_exist(self, state, t: int) -> bool:
        """Whether stage ``t`` can still be trained on: its earliest start is before the budget's end."""
        return t == state.stage or self._earliest_start(state, t) < self.plan.total_updates

    def _earliest_start(self, state, t: int) -> int:
        """Stage ``t``'s first update: exact for fixed stages; for adaptive ones the earliest possible
        (each stage in between as short as allowed), so dynamic sampling sizes it for the most updates."""
        per_stage = self.plan.updates_per_stage if self.plan.num_stages is not None else self.plan.min_updates_per_stage
        return state.update - state.update_in_stage + (t - state.stage) * per_stage

    def _future_state(self, state, t: int) -> RLState:
        if t == state.stage:
            return state
        return RLState(stage=t, update=self._earliest_start(state, t))

    # The generating thread. -------------------------------------------------------------------

    def _generate_loop(self) -> None:
        stop = _Stop(self)
        while True:
            self.ledger.engine_idle()
            job = self._jobs.get()
            self.ledger.engine_busy()
            if job is None or self.closing:
                return
            future, snapshot = job
            try:
                result = self.inner.stage(future, stop, snapshot=snapshot)
            except BaseException as exc:  # handed to the trainer when it asks for this stage (or a later one)
                with self._done:
                    self._results["error"] = exc
                    self._done.notify_all()
                return
            with self._done:
                self._results[future.stage] = result
                self._done.notify_all()


def lag_metrics(versions: list[int], stage: int) -> dict:
    """``stage/policy_lag_max`` and ``_mean``: stage - version over the stage's sequences, in stages."""
    lags = [stage - v for v in versions] or [0]
    return {"stage/policy_lag_max": max(lags), "stage/policy_lag_mean": sum(lags) / len(lags)}


def build_ahead_source(cfg, plan, world, parts, policy, store, replay=None) -> AheadStages:
    """The run's source with ``schedule.async_stages`` >= 1: the generated stages (their progress bars
    off: the trainer's are on screen meanwhile) wrapped in :class:`AheadStages`. ``parts.engine``
    must be the :func:`shared_engine`. ConfigError for what it cannot combine with."""
    k = cfg.schedule.async_stages
    if replay is not None:
        raise ConfigError(f"schedule.async_stages={k} generates stages ahead, but --replay trains on another run's "
                          "stages, which generates nothing: drop --replay or set schedule.async_stages=0")
    if world.size > 1:
        raise ConfigError(f"schedule.async_stages={k} runs in one process for now, and this run has {world.size} "
                          "(torchrun): set schedule.async_stages=0, or train in one process")
    inner = build_stage_source(cfg, plan, world, parts, policy, store, Progress(enabled=False))
    return AheadStages(inner, plan, k, policy)
