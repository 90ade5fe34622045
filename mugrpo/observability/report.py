"""The ``mugrpo report`` verb: PNG figures and a markdown summary comparing runs.

``mugrpo report RUN_DIR [RUN_DIR ...] --out DIR`` writes into DIR:

- ``reward.png``: stage reward vs training clock and vs update, one line per run;
- ``eval.png``: the held-out metric (``--eval-key``, default greedy accuracy) likewise;
- ``drift_<run>.png``: in-stage drift per run, E[rho|A<0], E[rho|A>0], veto and clip fractions,
  KL(pi_b || pi_theta), ESS, against the update index within the stage, one line per stage;
- ``stage_time.png``: each stage's wall-clock split into sync / generate / score / optimise /
  eval / checkpoint / other, stacked bars, one panel per run, plus the run totals;
- ``summary.md`` (and ``summary.json`` with the same numbers, unrounded): headline numbers, time
  per phase, the training clock each run needed to first reach given levels, with speed-ups
  relative to the first run, and the drift diagnostics and held-out metric against the position
  in the stage (:func:`mugrpo.observability.report_data.by_position`), and each run's warm start (a
  ``mugrpo sft`` run, or ``RUN_DIR/warmstart/``): steps, first and last loss, trained tokens, wall-clock.

The numbers come from :mod:`mugrpo.observability.report_data` (where the definitions are stated); this module
only draws and formats. matplotlib is imported lazily with the Agg backend (no display needed).
"""

from __future__ import annotations

import json
import math
import os
import re
from pathlib import Path

from mugrpo.observability import report_data as rd
from mugrpo.observability.loggers import json_safe

_COLORS = ("tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple", "tab:brown", "tab:pink", "tab:gray")
_PHASE_COLORS = {"sync": "tab:purple", "generate": "tab:blue", "score": "tab:cyan", "optimize": "tab:orange",
                 "eval": "tab:green", "checkpoint": "tab:brown", "other": "lightgray"}
MAX_STAGE_LINES = 12
MAX_STAGE_BARS = 48


def add_arguments(p) -> None:
    p.add_argument("runs", nargs="+", metavar="RUN_DIR", help="run directories; the first is the baseline for ratios")
    p.add_argument("--out", required=True, help="output folder for the PNGs and summary.md")
    p.add_argument("--labels", help="comma-separated names for the runs (default: folder names)")
    p.add_argument("--levels", help="comma-separated reward levels for the time-to-reach table "
                                    "(default: 25/50/75/100%% of the way from the highest start to the lowest best)")
    p.add_argument("--eval-levels", help="levels for the eval-metric table (default: derived like --levels)")
    p.add_argument("--eval-key", help="eval metric to plot and tabulate (default: eval/greedy_acc if logged)")
    p.add_argument("--title", default="mugrpo report", help="heading of summary.md")
    p.add_argument("--dpi", type=int, default=80, help="figure resolution (default 80: small PNGs)")


def run(args) -> int:
    import sys

    labels = [s.strip() for s in args.labels.split(",")] if args.labels else None
    try:
        if labels and len(labels) != len(args.runs):
            raise rd.ReportError(f"--labels has {len(labels)} names for {len(args.runs)} runs")
        runs = [rd.load_run(path, labels[i] if labels else None) for i, path in enumerate(args.runs)]
        levels = _floats(args.levels, "--levels")
        eval_levels = _floats(args.eval_levels, "--eval-levels")
        _check_out_folder(Path(args.out))
    except rd.ReportError as exc:
        print(f"mugrpo: error: {exc}", file=sys.stderr)
        return 2
    _unique_labels(runs)
    written = write_report(runs, Path(args.out), levels=levels, eval_levels=eval_levels, eval_key=args.eval_key,
                           title=args.title, dpi=args.dpi)
    print(f"[mugrpo] report written to {args.out}: {', '.join(p.name for p in written)}")
    return 0


def _check_out_folder(out: Path) -> None:
    """ReportError unless ``out`` can be the report's folder: an existing folder, or one that can be made."""
    if out.exists() and not out.is_dir():
        raise rd.ReportError(f"--out {out}: is a file; the report writes a folder of figures and summaries "
                             "there, so give a folder path")
    parent = out
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir() or not os.access(parent, os.W_OK | os.X_OK):
        raise rd.ReportError(f"--out {out}: cannot be written ({parent} is not a writable folder)")


def _floats(text, flag):
    if text is None:
        return None
    try:
        return [float(x) for x in text.split(",") if x.strip()]
    except ValueError as exc:
        raise rd.ReportError(f"{flag} {text!r}: expected comma-separated numbers") from exc


def _unique_labels(runs: list[rd.Run]) -> None:
    seen: dict[str, int] = {}
    for run in runs:
        seen[run.label] = seen.get(run.label, 0) + 1
        if seen[run.label] > 1:
            run.label = f"{run.label}-{seen[run.label]}"


def write_report(runs: list[rd.Run], out: Path, levels=None, eval_levels=None, eval_key=None,
                 title: str = "mugrpo report", dpi: int = 80) -> list[Path]:
    """Write every figure, summary.md and summary.json into ``out``; return the files written."""
    import matplotlib

    matplotlib.use("Agg")
    out.mkdir(parents=True, exist_ok=True)
    keys = rd.eval_keys(runs)
    eval_key = eval_key or (keys[0] if keys else None)
    rewards = [rd.reward_series(r) for r in runs]
    evals = [rd.eval_series(r, eval_key) for r in runs] if eval_key else []
    levels = levels if levels is not None else rd.default_levels(rewards)
    eval_levels = eval_levels if eval_levels is not None else (rd.default_levels(evals) if evals else [])
    written = [_curves(runs, rewards, "reward/mean (stage rollouts)", out / "reward.png", dpi)]
    if evals and any(s.values for s in evals):
        written.append(_curves(runs, evals, f"{eval_key} (held-out)", out / "eval.png", dpi))
    for run in runs:
        if run.updates:
            written.append(_drift(run, out / f"drift_{_slug(run.label)}.png", dpi))
    if any(run.stages for run in runs):
        written.append(_stage_time(runs, out / "stage_time.png", dpi))
    data = {
        "runs": [rd.summary(r, eval_key) for r in runs],
        "stage_time_totals": {r.label: _totals(r) for r in runs},
        "eval_key": eval_key,
        "reward_levels": _reach_table(runs, rewards, levels),
        "eval_levels": _reach_table(runs, evals, eval_levels) if evals else [],
        "by_position": {r.label: rd.by_position(r, eval_key) for r in runs},
        "environments": {r.label: e for r in runs if (e := rd.environment_summary(r)) is not None},
        "async": {r.label: a for r in runs if (a := rd.async_summary(r)) is not None},
        "warmstart": {r.label: r.warmstart for r in runs if r.warmstart is not None},
    }
    (out / "summary.json").write_text(json.dumps(json_safe(data), indent=1) + "\n")
    (out / "summary.md").write_text(_markdown(title, runs, data, [p.name for p in written]))
    return written + [out / "summary.json", out / "summary.md"]


def _totals(run: rd.Run) -> dict[str, float]:
    totals: dict[str, float] = {}
    for row in rd.stage_times(run):
        for key, v in row.items():
            totals[key] = totals.get(key, 0.0) + v
    return totals


def _reach_table(runs, series, levels) -> list[dict]:
    """Per level: each run's (clock s, update) of first reaching it, and speed-ups vs the first run."""
    rows = []
    for level in levels:
        reach = [rd.first_reach(s, level) for s in series]
        base = reach[0]
        speedups = {}
        for run, r in zip(runs[1:], reach[1:]):
            ok = base is not None and r is not None and r[0] > 0
            speedups[run.label] = base[0] / r[0] if ok else math.nan
        rows.append({"level": level,
                     "clock_s": {run.label: (r[0] if r else math.nan) for run, r in zip(runs, reach)},
                     "update": {run.label: (r[1] if r else math.nan) for run, r in zip(runs, reach)},
                     "speedup_vs_first": speedups})
    return rows


# ---------------------------------------------------------------------------------------------
# Figures.


def _time_unit(seconds: float) -> tuple[float, str]:
    if not seconds or math.isnan(seconds) or seconds < 600:
        return 1.0, "s"
    return (60.0, "min") if seconds < 3 * 3600 else (3600.0, "h")


def _curves(runs, series, ylabel: str, path: Path, dpi: int) -> Path:
    import matplotlib.pyplot as plt

    longest = max((max(s.clock_s) for s in series if s.clock_s), default=0.0)
    scale, unit = _time_unit(longest)
    fig, (ax_t, ax_u) = plt.subplots(1, 2, figsize=(10, 3.6), dpi=dpi)
    for i, (run, s) in enumerate(zip(runs, series)):
        color = _COLORS[i % len(_COLORS)]
        ax_t.plot([t / scale for t in s.clock_s], s.values, marker="o", ms=3, color=color, label=run.label)
        ax_u.plot(s.updates, s.values, marker="o", ms=3, color=color, label=run.label)
    ax_t.set_xlabel(f"training clock ({unit}, evaluation excluded)")
    ax_u.set_xlabel("optimizer update (policy evaluated)")
    for ax in (ax_t, ax_u):
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
    ax_u.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def _drift(run: rd.Run, path: Path, dpi: int) -> Path:
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    stages = sorted({int(u["stage"]) for u in run.updates})
    if len(stages) > MAX_STAGE_LINES:  # evenly spaced subset, first and last included
        step = (len(stages) - 1) / (MAX_STAGE_LINES - 1)
        stages = sorted({stages[round(i * step)] for i in range(MAX_STAGE_LINES)})
    cmap = plt.get_cmap("viridis")
    fig, axes = plt.subplots(2, 4, figsize=(14, 5.6), dpi=dpi)
    for ax, key in zip(axes.flat, rd.DRIFT_KEYS):
        by_stage = rd.drift_by_stage(run, key)
        for j, stage in enumerate(stages):
            xs, ys = by_stage.get(stage, ([], []))
            # viridis up to 0.85: its yellow end is unreadable on white
            ax.plot(xs, ys, color=cmap(0.85 * j / max(1, len(stages) - 1)), lw=1.2, label=f"stage {stage}")
        ax.set_title(_DRIFT_TITLES.get(key, key), fontsize=9)
        ax.set_xlabel("update within stage (staleness)", fontsize=8)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.tick_params(labelsize=7)
        ax.grid(alpha=0.3)
    axes.flat[0].legend(fontsize=6, ncol=2)
    fig.suptitle(f"{run.label}: in-stage drift (mu = {run.updates_per_stage})", fontsize=10)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


_DRIFT_TITLES = {"loss/ratio_mean_neg": "E[rho | A<0]", "loss/ratio_mean_pos": "E[rho | A>0]",
                 "loss/veto_token_frac": "vetoed token frac", "loss/veto_seq_frac": "vetoed response frac",
                 "loss/clip_frac_low": "clip frac (low bound)", "loss/clip_frac_high": "clip frac (high bound)",
                 "loss/kl_behavior": "KL(pi_b || pi_theta) (k3)", "loss/ess_frac": "ESS / n of the ratios"}


def _stage_time(runs, path: Path, dpi: int) -> Path:
    import matplotlib.pyplot as plt

    phases = [*rd.PHASES, "other"]
    fig, axes = plt.subplots(1, len(runs) + 1, figsize=(4.2 * (len(runs) + 1), 3.8), dpi=dpi, squeeze=False)
    for ax, run in zip(axes[0], runs):
        rows = rd.stage_times(run)
        names = [str(i) for i in range(len(rows))]
        if len(rows) > MAX_STAGE_BARS:  # consecutive stages binned: mean per stage within each bin
            size = math.ceil(len(rows) / MAX_STAGE_BARS)
            names = [f"{i}" for i in range(0, len(rows), size)]
            rows = [{p: sum(r[p] for r in rows[i:i + size]) / len(rows[i:i + size]) for p in phases}
                    for i in range(0, len(rows), size)]
        bottom = [0.0] * len(rows)
        for p in phases:
            heights = [r[p] for r in rows]
            ax.bar(names, heights, bottom=bottom, color=_PHASE_COLORS[p], label=p)
            bottom = [b + h for b, h in zip(bottom, heights)]
        ax.set_title(f"{run.label}: seconds per stage", fontsize=9)
        ax.set_xlabel("stage" + (" (binned, mean)" if len(rd.stage_times(run)) > MAX_STAGE_BARS else ""))
        ax.set_ylabel("seconds")
        ax.set_ylim(bottom=0)
        ax.tick_params(labelsize=7)
    ax = axes[0][-1]
    bottom = [0.0] * len(runs)
    for p in phases:
        heights = [_totals(run).get(p, 0.0) for run in runs]
        ax.bar([run.label for run in runs], heights, bottom=bottom, color=_PHASE_COLORS[p], label=p)
        bottom = [b + h for b, h in zip(bottom, heights)]
    ax.set_title("total seconds per run", fontsize=9)
    ax.set_ylim(bottom=0)
    ax.tick_params(labelsize=7)
    handles, names = ax.get_legend_handles_labels()
    fig.legend(handles[::-1], names[::-1], fontsize=8, loc="center right")
    fig.tight_layout(rect=(0, 0, 0.9, 1))
    fig.savefig(path)
    plt.close(fig)
    return path


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", text)


# ---------------------------------------------------------------------------------------------
# Markdown.


def _num(v, fmt: str = "{:.3f}") -> str:
    return "—" if v is None or (isinstance(v, float) and math.isnan(v)) else fmt.format(v)


def _table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows]) + "\n"


def _markdown(title: str, runs, data: dict, figures: list[str]) -> str:
    eval_key = data["eval_key"]
    parts = [f"# {title}\n",
             "Generated by `mugrpo report` from each run's `metrics.jsonl`. Training clock = wall-clock "
             "minus evaluation time. A stage's reward is that of its rollouts (the policy at the stage's "
             "start). Times in seconds.\n"]
    header = ["run", "preset", "mu", "stages", "updates", "wall-clock s", "eval s", "training clock s",
              "reward first", "reward last", "reward best"]
    if eval_key:
        header += [f"{eval_key} first", f"{eval_key} last", f"{eval_key} best"]
    rows = []
    for s in data["runs"]:
        row = [s["label"], s["preset"], _num(s["updates_per_stage"], "{}"), str(s["num_stages"]), str(s["num_updates"]),
               _num(s["wall_clock_s"], "{:.1f}"), _num(s["eval_s"], "{:.1f}"), _num(s["train_clock_s"], "{:.1f}"),
               _num(s["reward_first"]), _num(s["reward_last"]), _num(s["reward_best"])]
        if eval_key:
            row += [_num(s["eval_first"]), _num(s["eval_last"]), _num(s["eval_best"])]
        rows.append(row)
    parts += ["## Runs\n", _table(header, rows)]
    phases = [*rd.PHASES, "other", "total"]
    rows = [[label] + [_num(t.get(p, 0.0), "{:.1f}") for p in phases] for label, t in data["stage_time_totals"].items()]
    parts += ["## Time per phase (sum over stages, seconds)\n", _table(["run", *phases], rows)]
    parts += _async_section(data["async"])
    parts += _reach_section("reward/mean", data["reward_levels"], runs)
    if eval_key:
        parts += _reach_section(eval_key, data["eval_levels"], runs)
    parts += _position_section(data["by_position"], eval_key)
    parts += _environment_section(data["environments"])
    parts += _warmstart_section(data["warmstart"])
    parts += ["## Figures\n"] + [f"![{Path(f).stem}]({f})\n" for f in figures]
    return "\n".join(parts)


def _position_section(by_run: dict, eval_key) -> list[str]:
    """Diagnostics and held-out accuracy against the position in the stage (mean over stages)."""
    keys = [*rd.POSITION_KEYS, *([eval_key] if eval_key else [])]
    parts = ["## Drift against the position in the stage (mean over stages)\n",
             "Position p: updates since the stage's behaviour snapshot (an update's ratios, or an evaluated "
             "policy, p updates past it). n: update (and evaluation) records averaged.\n"]
    for label, rows in by_run.items():
        if not rows:
            continue
        table = [[f"{r['first']}" if r["first"] == r["last"] else f"{r['first']}-{r['last']}",
                  f"{r['num_updates']} ({r['num_evals']})", *(_num(r[k], "{:.4g}") for k in keys)] for r in rows]
        parts += [f"### {label}\n", _table(["p", "n", *keys], table)]
    return parts


def _async_section(runs: dict) -> list[str]:
    """Runs with stages generated ahead: the lag and who waited (docs/ALGORITHM.md section 3c)."""
    if not runs:
        return []
    rows = [[label, _num(a["async_stages"], "{}"), _num(a["policy_lag_max"], "{:.0f}"),
             _num(a["policy_lag_mean"], "{:.2f}"), _num(a["trainer_idle_frac"]), _num(a["engine_idle_frac"]),
             _num(a["wall_s"], "{:.1f}")]
            for label, a in runs.items()]
    return ["## Stages generated ahead\n",
            "Policy lag: stages between a stage and the policy version that generated it. Idle fractions: "
            "the trainer's waits for the generator, and the generator's time with nothing to generate, over "
            "the summed stage intervals. Generation overlaps optimisation here, so the phase times above add "
            "up to more than the wall-clock.\n",
            _table(["run", "async_stages", "lag max", "lag mean", "trainer idle frac", "engine idle frac",
                    "stage intervals s"], rows)]


def _environment_section(envs: dict) -> list[str]:
    """Multi-turn runs: how trajectories ended, turns, the environment-token share, tool counts, and
    the veto by turn (docs/MULTITURN.md, docs/ALGORITHM.md section 6a). Nothing without an environment."""
    if not envs:
        return []
    reasons = [k.removeprefix("env/num_") for k in rd.ENV_END_KEYS]
    rows = [[label, _num(e["num_trajectories"], "{:.0f}"), _num(e["turns_mean"], "{:.2f}"),
             _num(e["env_token_frac"]), *(_num(e["end_frac"][r]) for r in reasons)] for label, e in envs.items()]
    parts = ["## Environments (multi-turn trajectories, all stages)\n",
             _table(["run", "trajectories", "turns mean", "env token frac", *(f"{r} frac" for r in reasons)], rows)]
    tool_keys = sorted({k for e in envs.values() for k in e["counts"] if k.startswith("env/tool_")})
    if tool_keys:
        rows = [[label, *(_num(e["counts"].get(k, math.nan), "{:.0f}") for k in tool_keys)]
                for label, e in envs.items()]
        parts += ["Tool calls (sums over stages):\n", _table(["run", *tool_keys], rows)]
    turn_keys = sorted({k for e in envs.values() for k in e["veto_by_turn"]})
    rows = [[label, *(_num(e["veto_by_turn"].get(k, math.nan), "{:.4g}") for k in turn_keys)]
            for label, e in envs.items()]
    parts += ["The veto by turn (mean over updates): the turn of a response's first trigger, and the vetoed share "
              "of each turn's policy tokens (the last turn column: that turn and later ones).\n",
              _table(["run", *turn_keys], rows)]
    return parts + _environment_stages(envs)


def _environment_stages(envs: dict) -> list[str]:
    """Per run, one row per stage: how the environment numbers change as the policy trains (the end
    reasons that occur in the run, turns, the environment-token share, its reward, tool counts)."""
    parts = ["### Environments by stage\n"]
    for label, e in envs.items():
        stages = e["by_stage"]
        reasons = [r for r in (k.removeprefix("env/num_") for k in rd.ENV_END_KEYS)
                   if r == "done" or any(s["end_frac"][r] > 0 for s in stages)]
        tools = sorted({k for s in stages for k in s["tools"]})
        rows = [[str(s["stage"]), _num(s["num_trajectories"], "{:.0f}"), _num(s["turns_mean"], "{:.2f}"),
                 _num(s["env_token_frac"]), _num(s["reward_mean"], "{:.4g}"), *(_num(s["end_frac"][r]) for r in reasons),
                 *(_num(s["tools"].get(k, math.nan), "{:.0f}") for k in tools)] for s in stages]
        parts += [f"{label}:\n", _table(["stage", "trajectories", "turns mean", "env token frac", "env reward mean",
                                         *(f"{r} frac" for r in reasons), *tools], rows)]
    return parts


def _warmstart_section(warm: dict) -> list[str]:
    """Runs with a warm start (``mugrpo sft``, or ``RUN_DIR/warmstart/``): its data, steps, first and last
    loss, trained tokens and wall-clock (docs/WARMSTART.md). Nothing without one."""
    if not warm:
        return []
    rows = [[label, str(w["data"]), _num(w.get("num_demonstrations"), "{:.0f}"), str(w["num_steps"]),
             _num(w["loss_first"], "{:.4f}"), _num(w["loss_last"], "{:.4f}"), _num(w["num_tokens"], "{:.0f}"),
             _num(w.get("num_truncated"), "{:.0f}"), _num(w.get("num_dropped"), "{:.0f}"), _num(w["wall_s"], "{:.1f}")]
            for label, w in warm.items()]
    return ["## Warm start (supervised, before RL)\n",
            "Loss: the step's mean NLL per trained token (`sft/loss`). Trained tokens: summed over steps. Examples: "
            "the demonstrations (or kept trajectories) the length rule was given; cut and dropped: by it.\n",
            _table(["run", "data", "examples", "steps", "loss first", "loss last", "trained tokens", "cut", "dropped",
                    "wall-clock s"], rows)]


def _reach_section(key: str, table: list[dict], runs) -> list[str]:
    if not table:
        return [f"## Training clock to first reach {key} levels\n", "No levels (no data, or no run improves).\n"]
    labels = [r.label for r in runs]
    header = ["level"] + [f"{lab} s (update)" for lab in labels] + [f"speed-up {lab} vs {labels[0]}" for lab in labels[1:]]
    rows = []
    for row in table:
        cells = [_num(row["level"], "{:.4g}")]
        for lab in labels:
            t, u = row["clock_s"][lab], row["update"][lab]
            cells.append("not reached" if math.isnan(t) else f"{t:.1f} ({u:.0f})")
        cells += [_num(row["speedup_vs_first"][lab], "{:.2f}x") for lab in labels[1:]]
        rows.append(cells)
    note = (f"Speed-up = {labels[0]}'s time / the run's time (> 1: faster than {labels[0]}).\n" if len(labels) > 1 else "")
    return [f"## Training clock to first reach {key} levels\n", _table(header, rows), note]
