"""Figures and tables of the long toy lab (``toy_lab_long.json``), in the style of the paper's Figures 2-3.

- ``toy_lab_long_presets.png``: held-out pass@1 over updates for every experiment of the ``long``
  group (mean over seeds, band = min..max, thin lines = seeds), the drift KL(pi_b || pi_theta) and
  E[rho | A<0] over updates.
- ``toy_lab_long_staleness.png``: the per-update diagnostics against the update's position in its
  stage (its staleness), one line per stale experiment, stage 1 solid and stage 2 dashed, mean over
  seeds with a min..max band: E[rho | A<0], E[rho | A>0], the vetoed token fraction, the trigger
  fraction (at each run's delta), the first trigger position, KL(pi_b || pi_theta).
- ``toy_lab_long_lr.png``: the ``long_paper`` group (S x lr = the paper's) next to the same presets
  at the grid's lr: pass@1 and E[rho | A<0].

Also :func:`rollout_table`: generation seconds per generated token, grpo's small refreshes against
a stale run's whole-stage generation, per seed (same process, same seed, back to back).

``python -m benchmarks toy_lab_plot_long [results.json]`` redraws them and prints the tables.
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks.suite import RESULTS, read_figures  # noqa: E402
from benchmarks.toy_lab.plot import _panel, _stage_lines, markdown_summary  # noqa: E402

COLORS = {"grpo": "black", "grpo-stale": "tab:gray", "grpo-stale-relaxed": "tab:red", "m2po": "tab:orange",
          "mu-grpo": "tab:blue", "veto=trigger": "tab:purple", "delta=0.01": "tab:green", "delta=0.001": "tab:cyan"}
STALENESS_PANELS = (("loss/ratio_mean_neg", "E[rho | A<0], log", True), ("loss/ratio_mean_pos", "E[rho | A>0], log", True),
                    ("loss/veto_token_frac", "vetoed token fraction", False),
                    ("loss/trigger_frac", "trigger token fraction", False),
                    ("loss/first_trigger_pos", "first trigger position (tokens)", False),
                    ("loss/kl_behavior", "KL(pi_b || pi_theta), k3, log", True))


def _by_position(runs, name, key, stage, mu):
    """[seeds, mu] array of ``key`` at positions 0..mu-1 of stage ``stage`` (NaN where missing)."""
    rows = []
    for r in runs:
        if r["name"] != name:
            continue
        row = np.full(mu, np.nan)
        for u in r["updates"]:
            pos, k = (u["update"] - 1) % mu, (u["update"] - 1) // mu
            if k == stage and u.get(key) is not None:
                row[pos] = u[key]
        rows.append(row)
    return np.array(rows)


def _nan_smooth(y, k):
    """Running mean over ``k`` updates that skips NaN (updates whose minibatch had no such token)."""
    if k <= 1:
        return y
    out = np.full_like(y, np.nan)
    for j in range(y.shape[-1]):
        window = y[..., max(0, j - k + 1): j + 1]
        with np.errstate(all="ignore"):
            out[..., j] = np.nanmean(window, -1)
    return out


def plot_staleness(result, out: Path, smooth: int = 4) -> Path:
    runs, size = result["runs"], result["size"]
    mu = size["total_updates"] // size["stale_stages"]
    names = [n for n in COLORS if n != "grpo" and any(r["name"] == n for r in runs)]
    fig, axes = plt.subplots(2, 3, figsize=(15, 7.5))
    x = np.arange(mu)
    for ax, (key, label, log) in zip(axes.flat, STALENESS_PANELS):
        for name in names:
            for stage, ls in ((0, "-"), (1, "--")):
                y = _nan_smooth(_by_position(runs, name, key, stage, mu), smooth)
                if y.size == 0 or np.all(np.isnan(y)):
                    continue
                with np.errstate(all="ignore"):
                    m = np.nanmean(y, 0)
                ax.plot(x, m, color=COLORS[name], ls=ls, lw=1.4,
                        label=f"{name} (n={len(y)})" if stage == 0 else None)
                if len(y) > 1:
                    ax.fill_between(x, np.nanmin(y, 0), np.nanmax(y, 0), color=COLORS[name], alpha=0.08, lw=0)
        ax.set_xlabel("update's position in its stage (staleness)")
        ax.set_ylabel(label)
        if log:
            ax.set_yscale("log")
        ax.grid(alpha=0.3)
    axes.flat[2].legend(fontsize=7)
    stages = "; stage 1 solid, stage 2 dashed" if size["stale_stages"] > 1 else ""
    fig.suptitle(f"long toy lab: per-update diagnostics vs staleness, mu={mu}, lr={size['lr']:g}{stages}; mean over "
                 f"seeds of a running mean over {smooth} updates, band = min..max over seeds", fontsize=9)
    fig.tight_layout()
    fig.savefig(out, dpi=72)
    plt.close(fig)
    return out


def plot_all(path: Path) -> list[Path]:
    path = Path(path)
    result = read_figures(path)
    runs, size = result["runs"], result["size"]
    mu = size["total_updates"] // size["stale_stages"]
    written = []
    grid = [r for r in runs if r.get("group") == "long"]
    names = [n for n in COLORS if any(r["name"] == n for r in grid)]
    if names:
        fig, axes = plt.subplots(1, 3, figsize=(15, 3.8))
        _panel(axes[0], grid, names, "update", "pass1", "eval", "held-out pass@1 (T=1)")
        _panel(axes[1], grid, names, "update", "loss/kl_behavior", "updates", "KL(pi_b || pi_theta), k3", log=True,
               smooth=3)
        _panel(axes[2], grid, names, "update", "loss/ratio_mean_neg", "updates", "E[rho | A<0], log", log=True)
        for ax in axes:
            _stage_lines(ax, result)
            for line in ax.get_lines():
                line.set_color(COLORS.get(line.get_label().split(" (")[0], line.get_color()))
        axes[0].legend(fontsize=7)
        fig.suptitle(f"long toy lab: {result['warmstart']['num_params'] / 1e6:.1f}M char model, chain sums "
                     f"(median answer {result['warmstart']['target_chars']['median']} tokens), "
                     f"{size['total_updates']} updates, stale mu={mu}, lr={size['lr']:g}", fontsize=9)
        fig.tight_layout()
        written.append(path.parent / f"{path.stem}_presets.png")
        fig.savefig(written[-1], dpi=72)
        plt.close(fig)
        written.append(plot_staleness({**result, "runs": grid}, path.parent / f"{path.stem}_staleness.png"))
    paper = [r for r in runs if r.get("group") == "long_paper"]
    if paper:
        fig, axes = plt.subplots(1, 2, figsize=(11, 3.8))
        both = paper + [r for r in grid if r["name"] + "@paper-lr" in {p["name"] for p in paper}]
        pnames = sorted({r["name"] for r in both})
        _panel(axes[0], both, pnames, "update", "pass1", "eval", "held-out pass@1 (T=1)")
        _panel(axes[1], both, pnames, "update", "loss/ratio_mean_neg", "updates", "E[rho | A<0]", smooth=3)
        for ax in axes:
            _stage_lines(ax, result)
            for line in ax.get_lines():
                name = line.get_label().split(" (")[0]
                if name.split("@")[0] in COLORS:
                    line.set_color(COLORS[name.split("@")[0]])
                if name.endswith("@paper-lr"):
                    line.set_linestyle("--")
            for band in ax.collections:  # min..max bands: no label, so grey them out
                band.set_color("0.5")
                band.set_alpha(0.1)
        axes[0].legend(fontsize=7)
        fig.suptitle(f"long toy lab: lr {size['paper_lr']:g} (S x lr = {mu * size['paper_lr']:.1e}, dashed) vs "
                     f"lr {size['lr']:g} (S x lr = {mu * size['lr']:.1e}, solid)", fontsize=9)
        fig.tight_layout()
        written.append(path.parent / f"{path.stem}_lr.png")
        fig.savefig(written[-1], dpi=72)
        plt.close(fig)
    return written


def rollout_table(path: Path) -> str:
    """Generation s per generated token: grpo (mu = 4 refreshes) vs each stale run of the same seed."""
    result = read_figures(path)

    def per_token(run):
        gen_s = sum(s.get("perf/generate_s") or 0 for s in run["stages"])
        toks = sum((s.get("stage/num_sequences") or 0) * (s.get("stage/response_len_mean") or 0)
                   for s in run["stages"])
        return gen_s / toks if toks else None, gen_s, toks, len(run["stages"])

    rows = ["| run (seed) | stages | generated tokens | generate s | ms per generated token | grpo / this |",
            "|---|---|---|---|---|---|"]
    ratios = {}
    for r in result["runs"]:
        if r.get("group") != "long":
            continue
        ref = next((g for g in result["runs"] if g["name"] == "grpo" and g["seed"] == r["seed"]
                    and g.get("group") == "long"), None)
        pt, gen_s, toks, n = per_token(r)
        ratio = per_token(ref)[0] / pt if ref and pt else None
        if r["name"] != "grpo" and ratio:
            ratios.setdefault(r["name"], []).append(ratio)
        rows.append(f"| {r['name']} ({r['seed']}) | {n} | {toks:.0f} | {gen_s:.1f} | {1e3 * pt:.3f} | "
                    f"{'-' if ratio is None else f'{ratio:.2f}x'} |")
    lines = ["| stale run | grpo's s per token / its s per token, mean (min..max over seeds) |", "|---|---|"]
    lines += [f"| {n} | {statistics.fmean(v):.2f}x ({min(v):.2f}..{max(v):.2f}, n={len(v)}) |" for n, v in ratios.items()]
    return "\n".join(rows) + "\n\n" + "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("results", nargs="?", type=Path, default=RESULTS / "toy_lab_long.json", help="a results JSON (default: the committed one)")
    target = ap.parse_args(argv).results
    for p in plot_all(target):
        print(p)
    print(markdown_summary(target))
    print()
    print(rollout_table(target))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
