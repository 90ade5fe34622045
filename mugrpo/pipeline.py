"""The kinds of run, as commands start them: RL, a replay, a warm start alone, or a warm start then RL.

This is the one place that knows a run may have two phases. :func:`train` (``mugrpo train``,
:func:`mugrpo.api.train`) runs the warm start of a run with ``warmstart.data`` as a sub-run in
``RUN_DIR/warmstart/`` (kind ``warmstart``: its own config, metrics, checkpoints and final model,
skipped once that final model exists, resumed by resuming the run), then RL from its final model;
:func:`sft` (``mugrpo sft``) runs the warm start alone. The two phases are peers below this module
(:mod:`mugrpo.training.trainer`, :mod:`mugrpo.warmstart.phase`) on one trainer kit (:mod:`mugrpo.kit`);
neither imports the other. The run holds its directory through one
:class:`~mugrpo.kit.lifecycle.RunLifecycle` that records the kind of run, names the right resume command
and takes each phase through its order (``with life.phase() as run``); this module only says which
phases run, in which order.
"""

from __future__ import annotations

from pathlib import Path

from mugrpo.config import Config, ConfigError, from_dict, read_run_config, to_dict
from mugrpo.faults import maybe_die
from mugrpo.kit import distributed as dist
from mugrpo.kit.lifecycle import RunLifecycle, check_resume_compatible
from mugrpo.rollout.tasks import Task
from mugrpo.run_dir import RunDir
from mugrpo.training import trainer
from mugrpo.warmstart import phase


def train(cfg: Config, run_dir: Path, resume: bool = False, task: Task | None = None,
          replay: str | Path | None = None) -> Path:
    """Run (or resume) a training run in ``run_dir``; returns the final model folder.

    With ``warmstart.data`` the warm start runs first (or is resumed, or found done) and RL starts from
    its final model. ``task``: one built from data given in Python; ``replay``: a run whose stages this
    run trains on (:func:`mugrpo.training.trainer.train`)."""
    world = dist.init(cfg.parallel.timeout_s)
    rd = RunDir(dist.broadcast_object(run_dir))  # rank 0's: a default name holds the time, which ranks may not share
    kind = "replay" if replay is not None else "rl"
    warm = cfg.warmstart.data is not None
    # A new run with a warm start claims its directory first: the warm start is work a resume must find.
    with RunLifecycle(rd, cfg, kind, resume, world, claim_first=warm) as life:  # a resume of an sft run stops here
        model_path = None
        if warm:
            with life.phase():
                model_path = warm_start(cfg, rd)
            maybe_die("phase_end")
        with life.phase() as run:  # a stop between the warm start and RL: the resume starts RL
            return trainer.train(cfg, run, task=task, replay=replay, model_path=model_path)


def sft(cfg: Config, run_dir: Path, resume: bool = False, rows: list | None = None) -> Path:
    """Run (or resume) a warm-start-only run (``mugrpo sft``); returns its final model folder."""
    return phase.sft(cfg, run_dir, resume=resume, rows=rows, kind="sft")


def warm_start(cfg: Config, run_dir: RunDir) -> str:
    """Run, resume or skip the warm start of the RL run in ``run_dir``; returns the folder RL starts from.

    The sub-run ``RUN_DIR/warmstart/`` trains with the RL run's config. Skipped when its final model
    exists; resumed when it was started. Refused (ConfigError naming the key) when the sub-run found
    there was trained from another ``model.name``, or with other settings."""
    sub = RunDir(run_dir.warmstart)
    if sub.config.is_file():
        _check_same_warm_start(cfg, sub)
    if (sub.final_model / "config.json").is_file():  # the export is atomic: a complete folder
        print(f"[mugrpo] warm start done earlier: RL starts from {sub.final_model}")
        return str(sub.final_model)
    final = phase.sft(cfg, sub.path, resume=sub.config.is_file(), kind="warmstart")
    print(f"[mugrpo] warm start done: RL starts from {final}")
    return str(final)


def _check_same_warm_start(cfg: Config, sub: RunDir) -> None:
    saved = read_run_config(sub.path, f"the warm start in {sub.path}")
    base = saved.get("model", {}).get("name")
    if base != cfg.model.name:
        raise ConfigError(f"model.name={cfg.model.name!r}, but the warm start in {sub.path} was trained from "
                          f"model.name={base!r}: the RL run must start from the model its warm start trained. Set "
                          f"model.name={base!r}, or delete {sub.path} to warm-start {cfg.model.name!r} afresh")
    check_resume_compatible(to_dict(from_dict(saved)), to_dict(cfg), f"the warm start's config ({sub.config})")
