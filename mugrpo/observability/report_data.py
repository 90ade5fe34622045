"""Reading run directories into the series and tables that ``mugrpo report`` draws and prints.

A run's ``metrics.jsonl`` holds three kinds of records (written by :mod:`mugrpo.training.trainer` and
:mod:`mugrpo.evaluation.evaluate`): ``update`` (one per optimizer update: ``loss/*``, ``optim/*``),
``stage`` (one per stage: ``reward/*`` of the stage's rollouts, ``perf/*_s`` phase times) and
``eval`` (``eval/*``, ``perf/eval_s``). ``time_s`` is wall-clock since the run started,
continued across resumes. A warm start (:mod:`mugrpo.warmstart.phase`: a ``mugrpo sft`` run, or
``RUN_DIR/warmstart/`` of an RL run) writes ``sft_data`` (its data's counts) and ``sft`` records (one
per step: ``sft/loss``, ``sft/num_tokens``); :func:`warmstart_summary` reads them.

Definitions used by the report (each one is a choice, stated once here):
- **training clock** = ``time_s`` minus the evaluation seconds spent up to that moment, so runs
  that evaluate more often (e.g. GRPO with many short stages) are not charged for it.
- A stage's **reward** measures its behaviour policy: the one after ``update - update_in_stage``
  updates. It is placed on the clock when the stage's data was ready, i.e. when its first
  update began (``time_s - perf/update_s`` of that update record).
- **Time to reach a level**: the training clock of the first point whose value is >= the level.
- A resumed run may log an update (or stage, or eval) twice; the last record of each wins.

No plotting and no markdown here (that is :mod:`mugrpo.observability.report`); nothing here writes files.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional


from mugrpo.config import ConfigError, read_run_config
from mugrpo.errors import UserError
from mugrpo.observability.loggers import read_metrics
from mugrpo.run_dir import RunDir

PHASES = ("sync", "generate", "score", "optimize", "eval", "checkpoint")
"""Stage-time categories: ``perf/{phase}_s`` keys of stage records (absent keys count as 0)."""

DRIFT_KEYS = ("loss/ratio_mean_neg", "loss/ratio_mean_pos", "loss/veto_token_frac", "loss/veto_seq_frac",
              "loss/clip_frac_low", "loss/clip_frac_high", "loss/kl_behavior", "loss/ess_frac")
"""Per-update diagnostics plotted against the update index within the stage (staleness)."""

POSITION_KEYS = ("loss/ratio_mean_neg", "loss/ratio_mean_pos", "loss/veto_token_frac", "loss/first_trigger_pos",
                 "loss/kl_behavior")
"""The per-update diagnostics tabulated against the update's position in its stage (:func:`by_position`)."""


ENV_END_KEYS = ("env/num_done", "env/num_turn_limit", "env/num_length", "env/num_overflow", "env/num_env_error",
                "env/num_env_timeout", "env/num_env_bad_output")
"""How multi-turn trajectories ended (stage records of runs with an environment; docs/MULTITURN.md)."""


class ReportError(UserError, ValueError):
    """A run directory the report cannot use; the message says why."""


@dataclass
class Run:
    label: str
    path: Path
    config: dict
    updates: list[dict] = field(default_factory=list)
    stages: list[dict] = field(default_factory=list)
    evals: list[dict] = field(default_factory=list)
    warmstart: Optional[dict] = None
    """:func:`warmstart_summary` of the run's warm start (its own for a ``mugrpo sft`` run), or None."""

    @property
    def preset(self) -> str:
        return str(self.config.get("preset", "?"))

    @property
    def updates_per_stage(self) -> Optional[int]:
        if self.stages:  # the longest: adaptive stages (schedule.adaptive) may end before mu
            return max(int(s["update_in_stage"]) for s in self.stages)
        return (self.config.get("schedule") or {}).get("updates_per_stage")


def load_run(path: str | Path, label: Optional[str] = None) -> Run:
    path = Path(path)
    metrics = RunDir(path).metrics
    if not metrics.is_file():
        raise ReportError(f"{path}: no metrics.jsonl, so it is not a mugrpo run directory (or it has not started)")
    try:
        config = read_run_config(path, str(path), required=False)
    except ConfigError as exc:
        raise ReportError(f"{path}: {exc}") from exc
    try:
        records = read_metrics(metrics)
    except (OSError, UnicodeDecodeError) as exc:
        raise ReportError(f"{metrics}: cannot be read as text ({exc}); it is not a mugrpo metrics file") from exc
    warm = warmstart_summary(path, records) or warmstart_summary(RunDir(path).warmstart)
    records = dedupe([r for r in records if isinstance(r, dict) and r.get("kind") in ("update", "stage", "eval")])
    if not records and warm is None:
        raise ReportError(f"{metrics}: no metric records (the file is empty, or no line is a JSON record of kind "
                          "update, stage, eval or sft); leave this run out of the report, or check the file")
    run = Run(label or path.resolve().name, path, config or {}, warmstart=warm)
    for r in records:
        {"update": run.updates, "stage": run.stages, "eval": run.evals}.get(r.get("kind"), []).append(r)
    return run


def warmstart_summary(path: Path, records: Optional[list] = None) -> Optional[dict]:
    """The warm start whose metrics are ``path``'s (``records``: already read), or None without ``sft``
    records: ``num_steps`` (the last step), ``loss_first`` / ``loss_last`` (``sft/loss`` of the first
    and last steps), ``num_tokens`` (trained tokens, summed over steps), ``wall_s`` (the last step's
    ``time_s``), ``data`` (``warmstart.data`` of its config), ``num_steps_planned`` and the
    ``sft_data`` counts (``num_demonstrations`` ...; with rejection sampling ``num_total``, ``num_stages``)."""
    if records is None:
        metrics = RunDir(path).metrics
        if not metrics.is_file():
            return None
        try:
            records = read_metrics(metrics)
        except (OSError, UnicodeDecodeError):
            return None
    records = [r for r in records if isinstance(r, dict)]
    steps = sorted(dedupe([r for r in records if r.get("kind") == "sft"]), key=lambda r: r.get("update") or 0)
    if not steps:
        return None
    data = next((r for r in reversed(records) if r.get("kind") == "sft_data"), {})
    try:
        config = read_run_config(path, str(path), required=False)
    except (ConfigError, UserError):
        config = {}
    return {"path": str(path), "data": (config.get("warmstart") or {}).get("data"),
            "num_steps": max(int(r["update"]) for r in steps), "loss_first": value(steps[0], "sft/loss"),
            "loss_last": value(steps[-1], "sft/loss"), "num_tokens": sum(value(r, "sft/num_tokens") for r in steps),
            "wall_s": value(steps[-1], "time_s"), "num_steps_planned": data.get("num_steps"),
            **{k: v for k, v in data.items() if k.startswith("num_") and k != "num_steps"
               and isinstance(v, (int, float))}}


def dedupe(records: list[dict]) -> list[dict]:
    """Keep the last record per (kind, position), ordered by position (a resume re-logs some)."""
    latest: dict[tuple, dict] = {}
    for r in records:
        position = r.get("stage") if r.get("kind") == "stage" else r.get("update")
        latest[(r.get("kind"), position)] = r
    return sorted(latest.values(), key=lambda r: (float(r.get("time_s") or 0.0)))


def value(record: dict, key: str) -> float:
    """The record's value for ``key`` as a float; NaN when absent or null."""
    v = record.get(key)
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else math.nan


def eval_seconds_before(run: Run, t: float) -> float:
    """Evaluation seconds that finished at or before wall-clock ``t``."""
    return sum(value(e, "perf/eval_s") for e in run.evals if e["time_s"] <= t + 1e-9 and e.get("perf/eval_s"))


def train_clock(run: Run, t: float) -> float:
    return t - eval_seconds_before(run, t)


@dataclass
class Series:
    """One curve: y against the global update index and against the training clock (seconds)."""

    updates: list[float]
    clock_s: list[float]
    values: list[float]


def reward_series(run: Run, key: str = "reward/mean") -> Series:
    """Stage rewards at the stage's behaviour policy (see the module docstring for placement)."""
    first_update = {}
    for u in run.updates:
        first_update.setdefault(u["stage"], u)
    xs, ts, ys = [], [], []
    for s in run.stages:
        u = first_update.get(s["stage"])
        if u is not None:
            t_ready = u["time_s"] - value(u, "perf/update_s")
        else:  # no update record (e.g. a truncated log): fall back to the stage's own phase times
            t_ready = s["time_s"] - sum(value(s, f"perf/{p}_s") for p in ("optimize", "eval") if s.get(f"perf/{p}_s"))
        xs.append(float(s["update"] - s["update_in_stage"]))
        ts.append(train_clock(run, t_ready))
        ys.append(value(s, key))
    return Series(xs, ts, ys)


def eval_series(run: Run, key: str) -> Series:
    return Series([float(e["update"]) for e in run.evals], [train_clock(run, e["time_s"]) for e in run.evals],
                  [value(e, key) for e in run.evals])


def eval_keys(runs: list[Run]) -> list[str]:
    """Accuracy-like ``eval/*`` keys present in any run (greedy first)."""
    keys = {k for run in runs for e in run.evals for k in e
            if k.startswith(("eval/greedy", "eval/avg_at", "eval/pass_at"))}
    return sorted(keys, key=lambda k: (not k.startswith("eval/greedy"), k))


def first_reach(series: Series, level: float) -> Optional[tuple[float, float]]:
    """(training clock s, update) of the first point >= ``level``, or None if never reached."""
    for t, x, y in zip(series.clock_s, series.updates, series.values):
        if not math.isnan(y) and y >= level:
            return t, x
    return None


def default_levels(series: list[Series], fractions=(0.25, 0.5, 0.75, 1.0)) -> list[float]:
    """Levels every run reaches: from the highest starting value to the lowest best value."""
    starts = [next((y for y in s.values if not math.isnan(y)), math.nan) for s in series]
    bests = [max((y for y in s.values if not math.isnan(y)), default=math.nan) for s in series]
    if not series or any(math.isnan(v) for v in starts + bests):
        return []
    lo, hi = max(starts), min(bests)
    if hi <= lo:
        return [hi]
    return [lo + f * (hi - lo) for f in fractions]


def stage_times(run: Run) -> list[dict[str, float]]:
    """Per stage: seconds per phase (``PHASES``), ``other`` (the rest of the stage's wall-clock:
    e.g. checkpoints when not timed, logging) and ``total``."""
    out, previous = [], 0.0
    for s in run.stages:
        total = s["time_s"] - previous
        previous = s["time_s"]
        row = {p: value(s, f"perf/{p}_s") if s.get(f"perf/{p}_s") is not None else 0.0 for p in PHASES}
        row["other"] = max(0.0, total - sum(row.values()))
        row["total"] = total
        out.append(row)
    return out


def drift_by_stage(run: Run, key: str) -> dict[int, tuple[list[int], list[float]]]:
    """stage -> (update index within the stage, value) for a per-update diagnostic."""
    out: dict[int, tuple[list[int], list[float]]] = {}
    for u in run.updates:
        xs, ys = out.setdefault(int(u["stage"]), ([], []))
        xs.append(int(u["update_in_stage"]))
        ys.append(value(u, key))
    return out


def by_position(run: Run, eval_key: Optional[str] = None, max_rows: int = 16) -> list[dict]:
    """Each :data:`POSITION_KEYS` diagnostic and the held-out ``eval_key`` against the position in the stage.

    Position p = updates made since the stage's behaviour snapshot: an update record's
    ``update_in_stage`` (its ratios were taken with the policy p updates past the snapshot) and an
    evaluation's ``update_in_stage`` (the policy it evaluated, p updates past it; an evaluation at a
    stage's end has p = the stage's length). Values are averaged over stages (NaN ones left out); with
    more than ``max_rows`` positions, consecutive positions share a row (``first``..``last``).
    """
    points = [(int(u["update_in_stage"]), u) for u in run.updates]
    if eval_key:
        points += [(int(e["update_in_stage"]), e) for e in run.evals if e.get("update_in_stage") is not None]
    if not points:
        return []
    width = math.ceil((max(p for p, _ in points) + 1) / max_rows)
    rows = []
    for first in range(0, max(p for p, _ in points) + 1, width):
        inside = [r for p, r in points if first <= p < first + width]
        updates = [r for r in inside if r.get("kind") == "update"]
        evals = [r for r in inside if r.get("kind") == "eval"]
        row = {"first": first, "last": first + width - 1, "num_updates": len(updates), "num_evals": len(evals)}
        for key, records in [*((k, updates) for k in POSITION_KEYS), *([(eval_key, evals)] if eval_key else [])]:
            values = [v for r in records if not math.isnan(v := value(r, key))]
            row[key] = sum(values) / len(values) if values else math.nan
        rows.append(row)
    return rows


def summary(run: Run, eval_key: Optional[str]) -> dict:
    """The headline numbers of one run (NaN where the run has no such record)."""
    rewards = reward_series(run)
    evals = eval_series(run, eval_key) if eval_key else Series([], [], [])
    last_time = max((r["time_s"] for r in run.updates + run.stages + run.evals), default=math.nan)
    finite = [y for y in rewards.values if not math.isnan(y)]
    finite_eval = [y for y in evals.values if not math.isnan(y)]
    return {
        "label": run.label, "path": str(run.path), "preset": run.preset,
        "updates_per_stage": run.updates_per_stage, "num_stages": len(run.stages),
        "num_updates": max((u["update"] for u in run.updates), default=0),
        "wall_clock_s": last_time, "eval_s": eval_seconds_before(run, last_time) if run.evals else 0.0,
        "train_clock_s": train_clock(run, last_time) if not math.isnan(last_time) else math.nan,
        "reward_first": finite[0] if finite else math.nan, "reward_last": finite[-1] if finite else math.nan,
        "reward_best": max(finite) if finite else math.nan,
        "eval_first": finite_eval[0] if finite_eval else math.nan,
        "eval_last": finite_eval[-1] if finite_eval else math.nan,
        "eval_best": max(finite_eval) if finite_eval else math.nan,
    }


def async_summary(run: Run) -> Optional[dict]:
    """A run with stages generated ahead (``schedule.async_stages``, docs/ALGORITHM.md section 3c), or
    None for a synchronous one: the policy lag over its stages (``policy_lag_mean`` weighted by the
    stages' sequences) and the idle fractions over the whole run, i.e. the summed waits and idle
    seconds over the summed stage intervals (not a mean of the stages' fractions); ``by_stage``: each
    stage's own."""
    stages = [s for s in run.stages if s.get("perf/stage_wall_s") is not None]
    if not stages:
        return None
    wall = sum(value(s, "perf/stage_wall_s") for s in stages)
    weights = [value(s, "stage/num_sequences") if s.get("stage/num_sequences") else 1.0 for s in stages]
    lag_mean = sum(w * value(s, "stage/policy_lag_mean") for w, s in zip(weights, stages)) / sum(weights)
    return {
        "async_stages": (run.config.get("schedule") or {}).get("async_stages"),
        "num_stages": len(stages), "wall_s": wall,
        "policy_lag_max": max(value(s, "stage/policy_lag_max") for s in stages), "policy_lag_mean": lag_mean,
        "trainer_idle_frac": sum(value(s, "perf/trainer_wait_s") for s in stages) / wall if wall > 0 else math.nan,
        "engine_idle_frac": sum(value(s, "perf/engine_idle_s") for s in stages) / wall if wall > 0 else math.nan,
        "by_stage": [{"stage": s["stage"], **{k: value(s, f"{ns}/{k}") for ns, k in (
            ("stage", "policy_lag_max"), ("stage", "policy_lag_mean"), ("perf", "trainer_idle_frac"),
            ("perf", "engine_idle_frac"), ("perf", "stage_wall_s"))}} for s in stages],
    }


def environment_summary(run: Run) -> Optional[dict]:
    """A run's multi-turn totals over its stages, or None for a run without an environment.

    Counts (``env/num_*``, tool counts such as ``env/tool_calls``) are summed over stages; the end
    reasons also as fractions of all trajectories; ``turns_mean`` and ``env_token_frac`` (environment
    tokens / all response tokens) are over all trajectories; ``veto_by_turn``: each
    ``loss/veto_token_frac_turn{k}`` and ``loss/first_trigger_turn`` averaged over updates (NaN ones
    left out); ``by_stage``: the same per stage (:func:`environment_stage`), to show change.
    """
    stages = [s for s in run.stages if "env/num_done" in s]
    if not stages:
        return None
    counts: dict[str, float] = {}
    for s in stages:
        for key, v in s.items():
            if key.startswith("env/") and not key.endswith(("_mean", "_frac")) and not math.isnan(value(s, key)):
                counts[key] = counts.get(key, 0.0) + value(s, key)
    num = sum(counts.get(k, 0.0) for k in ENV_END_KEYS)
    tokens = counts.get("env/num_policy_tokens", 0.0) + counts.get("env/num_env_tokens", 0.0)
    turns = sum(value(s, "env/turns_mean") * sum(value(s, k) for k in ENV_END_KEYS) for s in stages)
    by_turn: dict[str, float] = {}
    keys = sorted({k for u in run.updates for k in u if k.startswith("loss/veto_token_frac_turn")},
                  key=lambda k: int(k.rsplit("turn", 1)[1]))
    for key in ["loss/first_trigger_turn", *keys]:
        values = [v for u in run.updates if not math.isnan(v := value(u, key))]
        by_turn[key] = sum(values) / len(values) if values else math.nan
    return {"num_trajectories": num, "counts": counts,
            "end_frac": {k.removeprefix("env/num_"): counts.get(k, 0.0) / num if num else math.nan
                         for k in ENV_END_KEYS},
            "turns_mean": turns / num if num else math.nan,
            "env_token_frac": counts.get("env/num_env_tokens", 0.0) / tokens if tokens else math.nan,
            "veto_by_turn": by_turn, "by_stage": [environment_stage(s) for s in stages]}


def environment_stage(s: dict) -> dict:
    """One stage record's multi-turn numbers: its trajectories, end fractions, turns mean, environment
    token fraction, environment reward mean and tool counts (``env/tool_*``)."""
    def count(key: str) -> float:  # a count an older run did not log is 0, as in the totals
        v = value(s, key)
        return 0.0 if math.isnan(v) else v

    num = sum(count(k) for k in ENV_END_KEYS)
    tokens = count("env/num_policy_tokens") + count("env/num_env_tokens")
    return {"stage": s.get("stage"), "num_trajectories": num,
            "end_frac": {k.removeprefix("env/num_"): count(k) / num if num else math.nan for k in ENV_END_KEYS},
            "turns_mean": value(s, "env/turns_mean"), "reward_mean": value(s, "env/reward_mean"),
            "env_token_frac": count("env/num_env_tokens") / tokens if tokens else math.nan,
            "tools": {k: value(s, k) if k.endswith("_frac") else count(k) for k in s if k.startswith("env/tool_")}}
