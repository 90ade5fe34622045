"""Figures of the toy lab from its results JSON (matplotlib only; small PNGs meant for the repo).

Files are named after the JSON (``toy_lab.json`` -> ``toy_lab_presets.png`` ...):

- ``toy_lab_presets.png``: held-out pass@1 vs update for the five presets (mean over seeds, band =
  min..max over seeds, thin lines = seeds), the drift from the behaviour policy (k3 KL) and
  E[rho | A < 0] per update (the paper's collapse signature).
- ``toy_lab_scopes.png``: the same for the veto scopes, with the vetoed and trigger token fractions.
- ``toy_lab_delta.png``: final and peak pass@1 against delta.
- With the ``adaptive`` group run, its experiments join the presets figure.

``python -m benchmarks toy_lab_plot [results.json]`` redraws them and prints the summary table.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks.suite import RESULTS, read_figures  # noqa: E402

COLORS = {"grpo": "black", "grpo-stale": "tab:gray", "grpo-stale-relaxed": "tab:red", "m2po": "tab:orange",
          "mu-grpo": "tab:blue", "veto=trigger": "tab:purple", "veto=sequence": "tab:green",
          "veto=suffix_nontrigger": "tab:cyan", "adaptive-kl=0.01": "tab:green", "adaptive-kl=0.03": "tab:olive"}


def _curves(runs, name, x_key, y_key, series):
    xs, ys = None, []
    for r in runs:
        if r["name"] != name:
            continue
        pts = [(p[x_key], p.get(y_key)) for p in r[series] if p.get(y_key) is not None]
        if not pts:
            continue
        x, y = zip(*pts)
        xs = x if xs is None or len(x) < len(xs) else xs
        ys.append(y)
    if not ys:
        return None, None
    n = min(len(y) for y in ys)
    return np.array(xs[:n]), np.array([y[:n] for y in ys])


def _smooth(y, k):
    if k <= 1 or y.shape[-1] < k:
        return y
    kernel = np.ones(k) / k
    return np.array([np.convolve(row, kernel, mode="valid") for row in y])


def _panel(ax, runs, names, x_key, y_key, series, ylabel, log=False, smooth=1, labels=None):
    for name in names:
        x, y = _curves(runs, name, x_key, y_key, series)
        if x is None:
            continue
        y = _smooth(y, smooth)
        x = x[smooth - 1:] if smooth > 1 and len(x) >= smooth else x
        color = COLORS.get(name)
        label = (labels or {}).get(name, name) + (f" (n={len(y)})" if len(y) > 1 else "")
        ax.plot(x, y.mean(0), color=color, label=label, lw=1.8)
        if len(y) > 1:
            ax.fill_between(x, y.min(0), y.max(0), color=color, alpha=0.15, lw=0)
            for row in y:
                ax.plot(x, row, color=color, lw=0.5, alpha=0.4)
    ax.set_ylabel(ylabel)
    ax.set_xlabel("optimizer update")
    if log:
        ax.set_yscale("log")
    ax.grid(alpha=0.3)


def _stage_lines(ax, result):
    size = result["size"]
    mu = size["total_updates"] // size["stale_stages"]
    for k in range(1, size["stale_stages"]):
        ax.axvline(k * mu, color="k", ls=":", lw=0.8)


def plot_all(path: Path) -> list[Path]:
    result = read_figures(path)
    runs = result["runs"]
    names = {r["name"] for r in runs}
    out_dir = Path(path).parent
    written = []
    size = result["size"]
    mu = size["total_updates"] // size["stale_stages"]
    title = (f"toy lab: {result['warmstart']['num_params'] / 1e6:.1f}M char model, {size['total_updates']} updates, "
             f"stale mu={mu}, lr={size['lr']:g}")

    presets = [n for n in ("grpo", "grpo-stale", "grpo-stale-relaxed", "m2po", "mu-grpo") if n in names]
    presets += sorted(n for n in names if n.startswith("adaptive-"))  # the adaptive group, beside its presets
    scopes = [n for n in ("grpo-stale-relaxed", "veto=trigger", "mu-grpo", "veto=suffix_nontrigger", "veto=sequence")
              if n in names]
    groups = [("presets", presets, [("loss/kl_behavior", "KL(pi_b || pi_theta) per token (k3, log)", True),
                                    ("loss/ratio_mean_neg", "E[rho | A<0]", False)]),
              ("scopes", scopes, [("loss/veto_token_frac", "vetoed token fraction", False),
                                  ("loss/trigger_frac", "trigger token fraction", False)])]
    labels = {"grpo-stale-relaxed": "none (grpo-stale-relaxed)", "mu-grpo": "suffix (mu-grpo)"}
    for group, members, diagnostics in groups:
        if len(members) < 2:
            continue
        fig, axes = plt.subplots(1, 1 + len(diagnostics), figsize=(5 * (1 + len(diagnostics)), 3.8))
        names_for = labels if group == "scopes" else None
        _panel(axes[0], runs, members, "update", "pass1", "eval", "held-out pass@1 (T=1)", labels=names_for)
        for ax, (key, label, log) in zip(axes[1:], diagnostics):
            _panel(ax, runs, members, "update", key, "updates", label, log=log, smooth=3, labels=names_for)
        for ax in axes:
            _stage_lines(ax, result)
        axes[0].legend(fontsize=7)
        fig.suptitle(title + ("" if group == "presets" else "; veto scopes (all relaxed clip [0, 5])"), fontsize=9)
        fig.tight_layout()
        target = out_dir / f"{Path(path).stem}_{group}.png"
        fig.savefig(target, dpi=72)
        plt.close(fig)
        written.append(target)

    summary = result.get("summary", {})
    deltas = sorted((float(n.split("=")[1]), n) for n in summary if n.startswith("delta="))
    if deltas and "mu-grpo" in summary:
        deltas = sorted(deltas + [(1e-4, "mu-grpo")])
        fig, ax = plt.subplots(figsize=(5.5, 3.8))
        for key, marker, label in (("final_pass1", "o", "final"), ("peak_pass1", "^", "peak")):
            m = [summary[n][key]["mean"] for _, n in deltas]
            lo = [summary[n][key]["min"] for _, n in deltas]
            hi = [summary[n][key]["max"] for _, n in deltas]
            d = [x for x, _ in deltas]
            ax.errorbar(d, m, yerr=[np.subtract(m, lo), np.subtract(hi, m)], marker=marker, capsize=3, label=label)
        for name, color in (("grpo", "black"), ("grpo-stale-relaxed", "tab:red")):
            if name in summary:
                ax.axhline(summary[name]["final_pass1"]["mean"], color=color, ls="--", lw=1,
                           label=f"{name} final")
        ax.set_xscale("log")
        ax.set_xlabel("veto delta (suffix scope)")
        ax.set_ylabel("held-out pass@1")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        ax.set_title("mu-grpo: delta sweep (mean, bars = min..max over seeds)", fontsize=9)
        fig.tight_layout()
        target = out_dir / f"{Path(path).stem}_delta.png"
        fig.savefig(target, dpi=80)
        plt.close(fig)
        written.append(target)
    return written


def markdown_summary(path: Path) -> str:
    """The results table of docs/BENCHMARKS.md: one row per experiment, mean +- std over seeds."""
    result = read_figures(path)

    def fmt(stat, scale=1.0, digits=3):
        if not stat:
            return "-"
        return f"{stat['mean'] * scale:.{digits}f} ± {stat['std'] * scale:.{digits}f}"

    rows = ["| experiment | seeds | final pass@1 | peak pass@1 | drop from peak | E[rho given A<0], last 8 updates | "
            "vetoed tokens (mean) |", "|---|---|---|---|---|---|---|"]
    for name, s in result["summary"].items():
        rows.append(f"| {name} | {s['num_seeds']} | {fmt(s['final_pass1'])} | {fmt(s['peak_pass1'])} | "
                    f"{fmt(s['drop_from_peak'])} | {fmt(s.get('late_ratio_mean_neg'))} | "
                    f"{fmt(s['veto_token_frac_mean'], 100, 2)}% |")
    start = result["runs"][0]["eval"][0]["pass1"] if result["runs"] else float("nan")
    return f"Initial pass@1 (the warm start): {start:.3f}\n\n" + "\n".join(rows)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("results", nargs="?", type=Path, default=RESULTS / "toy_lab.json", help="a results JSON (default: the committed one)")
    target = ap.parse_args(argv).results
    for p in plot_all(target):
        print(p)
    print(markdown_summary(target))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
