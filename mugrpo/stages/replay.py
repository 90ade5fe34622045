"""Replay: train a fresh run on the stage data another run saved, instead of generating it.

``mugrpo train --replay SOURCE_RUN_DIR`` (``mugrpo.train(..., replay=...)``): stage k of the new run
is stage k of the source, read from ``SOURCE/stages/stage_KKK`` (docs/ALGORITHM.md section 5d). So
several losses, corrections or deltas can be compared on identical stale rollouts. Ratios are
always taken against the STORED behaviour log-probs (the engine's, or the trainer's recompute
stored with them), whatever policy the new run has reached by then.

Here: the checks that the source can be replayed by this run (:func:`check_source`, at start,
each refusal a :class:`ReplayError` naming the key), the check of a stage's prompts against this
run's tokenizer and prompt format (:func:`check_prompts`), and the copy of one stage into the new
run's own stage folder (:func:`copy_stage`), after which the stage is an ordinary persisted stage:
a resumed replay reads its own copy and never the source again. A source file deleted or damaged
mid-run is a :class:`ReplayError` naming the file. Not here: when the trainer calls these.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

from mugrpo.config import Config, ConfigError, from_dict, read_run_config
from mugrpo.config.plan import make_plan
from mugrpo.errors import UserError
from mugrpo.run_dir import (SHARDS_FILE, STAGE_METRICS_FILE, DiskFullError, RunDir, RunDirError, atomic_write,
                            resume_command, shard_path, size_text, text_path, write_failure)
from mugrpo.stages.data import StageData, StageDataError
from mugrpo.stages.shards import read_shard


def stage_dir(run_dir: Path, stage: int) -> Path:
    return RunDir(run_dir).stage(stage)

MATCH_KEYS = {
    "model.name": "the model: the stored behaviour log-probs are its",
    "rollout.group_size": "the group size: the stored advantages are normalised within groups of this size",
    "rollout.temperature": "the sampling temperature: log-probs are taken at it",
    "task.kind": "the task", "task.name": "the task", "task.params": "the task", "task.seed": "the task",
    "task.size": "the task", "task.eval_size": "the task",
    "task.instruction": "the prompt format", "task.few_shot": "the prompt format",
    "task.system_prompt": "the prompt format",
    "task.env": "the environment: the stored trajectories interleave its turns",
    "task.env_args": "the environment: the stored trajectories interleave its turns",
    "task.tools": "the tools: the prompt describes them and the trajectories call them",
    "task.rewards": "the rewards: a replay trains on the source's stored rewards and advantages and never "
                    "scores again, so another reward would be silently ignored",
    "task.reward_fn": "the reward: a replay trains on the source's stored rewards and advantages and never "
                      "scores again, so another reward would be silently ignored",
    "loss.adv_std_scale": "the stored advantages were computed with it",
    "loss.adv_eps": "the stored advantages were computed with it",
    "loss.drop_zero_var_groups": "the stored stage data was filtered with it",
}
"""Keys whose value must be the same in the source run and the new run, and why."""


class ReplayError(UserError, ValueError):
    """A replay source that cannot be used by this run; the message names the key or the file."""


@dataclass(frozen=True)
class ReplaySource:
    run_dir: Path
    config: Config
    stages: tuple[int, ...]
    """The source's complete stages 0, 1, ... (consecutive from 0)."""


def _get(cfg, dotted: str):
    value = cfg
    for part in dotted.split("."):
        value = getattr(value, part)
    return value


def _same_path(a: str, b: str) -> bool:
    """Two names (``model.name``, ``task.name``) that are paths of the same local folder or file, e.g.
    through a link."""
    pa, pb = Path(str(a)).expanduser(), Path(str(b)).expanduser()
    return pa.exists() and pb.exists() and pa.resolve() == pb.resolve()


def complete_stages(run_dir: Path) -> tuple[int, ...]:
    """Stages 0..k-1 of ``run_dir`` whose completion marker lists at least one shard and every listed
    shard exists (a marker listing none marks no data: never a complete, empty stage)."""
    out, k = [], 0
    while True:
        folder = stage_dir(run_dir, k)
        try:
            num_shards = int(json.loads((folder / SHARDS_FILE).read_text())["num_shards"])
        except (OSError, ValueError, KeyError, TypeError):
            break
        if num_shards < 1 or not all(shard_path(folder, s).is_file() for s in range(num_shards)):
            break
        out.append(k)
        k += 1
    return tuple(out)


def check_source(source_dir: str | Path, cfg: Config, world_size: int = 1) -> ReplaySource:
    """The replay source, after every check this run can make before training (ReplayError otherwise).

    A mugrpo run directory (config.yaml, ``stages/stage_000`` complete), the keys of
    :data:`MATCH_KEYS` equal to this run's, as many prompts per stage as this run's plan draws, and
    (fixed stages) a complete source stage for each of this run's stages. With
    ``loss.behavior_logprobs=trainer`` the source must have stored trainer log-probs (checked per
    stage when it is copied).
    """
    source = Path(source_dir).expanduser()
    where = f"replay source {str(source)!r}"
    if not source.is_dir():
        raise ReplayError(f"{where} is not a directory; give the run directory of an earlier mugrpo run")
    try:
        values = read_run_config(source, where)
    except RunDirError as exc:
        raise ReplayError(str(exc)) from exc
    try:
        src_cfg = from_dict(values)
    except ConfigError as exc:
        raise ReplayError(f"{where}: its config.yaml cannot be used ({exc})") from exc
    stages = complete_stages(source)
    if not stages:
        raise ReplayError(f"{where} holds no complete stage (stages/stage_000/{SHARDS_FILE} listing at least one "
                          "shard, and its shards); replay needs a run that generated at least one stage")
    for key, why in MATCH_KEYS.items():
        mine, theirs = _get(cfg, key), _get(src_cfg, key)
        if key in ("model.name", "task.name") and _same_path(mine, theirs):
            continue
        if mine != theirs:
            raise ReplayError(f"{where}: {key} is {theirs!r} there but {mine!r} here ({why}); set {key}={theirs!r} "
                              "or replay another run")
    mine, theirs = make_plan(cfg, world_size), make_plan(src_cfg, world_size)
    if mine.prompts_per_stage != theirs.prompts_per_stage:
        raise ReplayError(f"{where}: its stages hold {theirs.prompts_per_stage} prompts each but this run's plan "
                          f"draws {mine.prompts_per_stage} per stage (rollout.prompts_per_stage, or "
                          "schedule.prompts_per_update x the stage length); make them equal")
    if cfg.schedule.adaptive == "none":
        if mine.num_stages > len(stages):
            raise ReplayError(f"{where} holds {len(stages)} complete stage(s) but this run has {mine.num_stages} "
                              f"(schedule.num_stages); stage {len(stages)} is missing there")
    return ReplaySource(source, src_cfg, stages)


def load_source_stage(source: ReplaySource, stage: int, shard: int, marker: dict | None = None) -> StageData:
    """Shard ``shard`` of the source's stage ``stage``; ReplayError naming the file if it is gone or damaged,
    or (``marker``: the stage's parsed shards.json) its bytes are not the ones recorded there."""
    path = shard_path(stage_dir(source.run_dir, stage), shard)
    try:
        return read_shard(stage_dir(source.run_dir, stage), shard, marker or {})
    except StageDataError as exc:
        raise ReplayError(f"replay source file {path} cannot be read ({exc.__cause__ or exc}): it was deleted or "
                          "damaged after this run started. Restore it, or start the run again with another "
                          "--replay source") from exc


def check_prompts(data: StageData, prompt_ids_of, path: Path) -> None:
    """Each stored prompt must be what this run's tokenizer and prompt format make of its item.

    ``prompt_ids_of(item_index) -> list[int]``: this run's tokenisation (chat template, instruction,
    few-shot turns, system prompt). A difference means another tokenizer (vocabulary, chat template)
    or another prompt format than the source's, which the config keys alone cannot show.
    """
    for g, (item, stored) in enumerate(zip(data.item_indices, data.prompts)):
        mine = list(prompt_ids_of(item))
        if mine[len(mine) - len(stored):] != list(stored):  # a tail: task.prompt_too_long=truncate keeps one
            raise ReplayError(f"replay source file {path}: group {g} (item {item}) was tokenised to {len(stored)} "
                              f"ids there but this run's tokenizer and prompt format give {len(mine)} different ones; "
                              "the tokenizer (model.name's vocabulary or chat template) or the prompt format "
                              "(task.instruction / task.few_shot / task.system_prompt) differs from the source's")


def copy_stage(source: ReplaySource, stage: int, dest_stage_dir: Path, *, need_trainer_logprobs: bool,
               prompt_ids_of=None) -> int:
    """Copy the source's stage ``stage`` into ``dest_stage_dir`` (each shard checked, then written
    atomically; the completion marker last, so an interrupted copy is redone on resume). Returns
    the number of groups copied. Run it on one process.

    A full disk raises :class:`mugrpo.kit.checkpoint.DiskFullError` saying how much to free,
    after removing the partial copy (``dest_stage_dir``, never marked complete): the resume it
    advises copies the stage again."""
    try:
        return _copy_stage(source, stage, dest_stage_dir, need_trainer_logprobs, prompt_ids_of)
    except OSError as exc:
        cause = write_failure(exc)
        if cause is None:
            raise
        shutil.rmtree(dest_stage_dir, ignore_errors=True)
        src = stage_dir(source.run_dir, stage)
        need = sum(p.stat().st_size for p in src.iterdir() if p.is_file())
        run = Path(dest_stage_dir).parent.parent  # RUN_DIR/stages/stage_KKK
        raise DiskFullError(
            f"{cause} while copying stage {stage} of the replay source into {dest_stage_dir} ({exc}). Nothing was "
            f"lost: the partial copy was removed (the source is untouched) and a resume copies the stage again. "
            f"Free at least {size_text(need)} (the source stage's files) on that disk, then continue with: "
            f"{resume_command(run)}") from exc


def _copy_stage(source: ReplaySource, stage: int, dest_stage_dir: Path, need_trainer_logprobs: bool,
                prompt_ids_of) -> int:
    src = stage_dir(source.run_dir, stage)
    if stage not in source.stages:
        raise ReplayError(f"replay source {str(source.run_dir)!r} has no complete stage {stage} ({src}/{SHARDS_FILE} "
                          "or a shard is missing); this run needs it")
    marker = src / SHARDS_FILE
    try:
        meta = json.loads(marker.read_text())
        num_shards = int(meta["num_shards"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ReplayError(f"replay source file {marker} cannot be read ({exc}): it was deleted or damaged after "
                          "this run started") from exc
    if num_shards < 1:
        raise ReplayError(f"replay source file {marker} lists no shards (num_shards={num_shards}), so stage {stage} "
                          "holds no data; it was damaged after this run started. Restore it, or replay another run")
    num_groups = 0
    for shard in range(num_shards):
        data = load_source_stage(source, stage, shard, meta)
        path = shard_path(src, shard)
        if need_trainer_logprobs and data.trainer_logprobs is None:
            raise ReplayError(f"replay source file {path} holds no trainer log-probs (the source ran with "
                              "loss.behavior_logprobs=engine); this run's loss.behavior_logprobs=trainer (or a "
                              "correction that needs them) cannot replay it")
        if prompt_ids_of is not None:
            check_prompts(data, prompt_ids_of, path)
        atomic_write(shard_path(dest_stage_dir, shard), lambda tmp, p=path: shutil.copyfile(p, tmp))
        num_groups += data.num_groups
    extras = [text_path(src, rank, num_shards) for rank in range(num_shards)] + [src / STAGE_METRICS_FILE]
    for extra in extras:  # the readable jsonl and the generation metrics, when the source wrote them
        if extra.is_file():
            atomic_write(Path(dest_stage_dir) / extra.name, lambda tmp, p=extra: shutil.copyfile(p, tmp))
    atomic_write(Path(dest_stage_dir) / SHARDS_FILE, lambda tmp: Path(tmp).write_text(json.dumps(meta)))
    return num_groups


def record_source(run_dir: Path, source: ReplaySource) -> None:
    """Remember the source in the new run's directory (RUN_DIR/replay.json), so a resumed replay keeps
    replaying it."""
    atomic_write(RunDir(run_dir).replay, lambda tmp: Path(tmp).write_text(
        json.dumps({"source": str(source.run_dir.resolve())}) + "\n"))


def recorded_source(run_dir: Path) -> Path | None:
    """The replay source recorded in ``run_dir`` (None: the run generates its own stages)."""
    path = RunDir(run_dir).replay
    if not path.is_file():
        return None
    try:
        return Path(json.loads(path.read_text())["source"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ReplayError(f"{path} cannot be read ({exc}); it names the run's replay source: restore it as "
                          '{"source": "/path/to/source_run"}') from exc
