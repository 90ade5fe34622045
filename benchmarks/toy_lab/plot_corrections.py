"""The figure and table of the corrections comparison (:mod:`benchmarks.toy_lab.corrections`).

    PYTHONPATH=. python -m benchmarks toy_lab_plot_corrections [RESULTS_JSON]

Left: final held-out pass@1 per method at each lr (bar = mean over seeds, dots = seeds, dashed line =
the warm start). Middle: KL(pi_b || pi_theta) (k3, per token) against the update's position in the
stage, at the hottest lr. Right: the fraction of tokens each method removed from the loss (veto or
correction mask), by position, at the hottest lr. Curves are means over seeds, smoothed by a running
mean over 4 updates.
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

from benchmarks.suite import read_figures
from benchmarks.toy_lab.corrections import METHODS, OUT, OWN_DATA, masked_frac


def _curve(runs, key_fn, width=4):
    n = min(len(r["updates"]) for r in runs)
    mean = [statistics.fmean(key_fn(r["updates"][i]) for r in runs) for i in range(n)]
    return [statistics.fmean(mean[max(0, i - width + 1):i + 1]) for i in range(n)]


def table(result: dict) -> str:
    rows = ["| method | lr | seeds | final pass@1 (per seed) | KL by quarter of the stage "
            "| tokens masked (mean / last quarter) | PPO clip binds | CISPO weight capped |", "|---|---|---|---|---|---|---|---|"]
    for key, s in sorted(result["summary"].items(), key=lambda kv: (-kv[1]["lr"], -kv[1]["final_pass1"]["mean"])):
        f = s["final_pass1"]
        kl = " / ".join(f"{q['mean']:.3f}" for q in s["kl_by_quarter"])
        pct = lambda st: "-" if st is None else f"{100 * st['mean']:.2f}%"  # noqa: E731
        rows.append(f"| {s['method']} | {s['lr']:g} | {s['num_seeds']} | {f['mean']:.3f} ± {f['std']:.3f} "
                    f"({', '.join(f's{k} {v:.3f}' for k, v in zip(s['seeds'], f['values']))}) | {kl} | "
                    f"{pct(s['masked_frac'])} / {pct(s['masked_frac_last_quarter'])} | {pct(s['ppo_clip_frac'])} | "
                    f"{pct(s['cispo_clipped_frac'])} |")
    return "\n".join(rows)


def plot(path: Path = OUT) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    result = read_figures(path)
    runs = result["runs"]
    lrs = sorted({r["lr"] for r in runs}, reverse=True)
    names = [m for m in [*METHODS, *OWN_DATA] if any(r["name"] == m for r in runs)]
    colors = {m: plt.cm.tab10(i % 10) for i, m in enumerate(names)}
    fig, axes = plt.subplots(1, 3, figsize=(17, 4.8))
    ax = axes[0]
    width = 0.8 / max(len(lrs), 1)
    for j, lr in enumerate(lrs):
        for i, m in enumerate(names):
            finals = [statistics.fmean(p["pass1"] for p in r["eval"][-2:]) for r in runs
                      if r["name"] == m and r["lr"] == lr]
            if not finals:
                continue
            x = i + (j - (len(lrs) - 1) / 2) * width
            ax.bar(x, statistics.fmean(finals), width, color=colors[m], alpha=1.0 if j == 0 else 0.45,
                   label=f"lr {lr:g}" if i == 0 else None, edgecolor="k" if j == 0 else "none")
            ax.plot([x] * len(finals), finals, "k.", ms=4)
    ax.axhline(statistics.fmean(r["eval"][0]["pass1"] for r in runs), color="gray", ls="--", lw=1)
    ax.set_xticks(range(len(names)), names, rotation=45, ha="right")
    ax.set_ylabel("final held-out pass@1")
    ax.set_title("final pass@1 (dark: hot lr, light: paper's S x lr)")
    ax.legend(fontsize=8)
    hot = [r for r in runs if r["lr"] == lrs[0]]
    for ax, fn, title in ((axes[1], lambda u: u.get("loss/kl_behavior") or 0.0, "KL(pi_b || pi_theta) per token"),
                          (axes[2], masked_frac, "tokens removed from the loss (veto / mask)")):
        for m in names:
            rs = [r for r in hot if r["name"] == m]
            if rs:
                ax.plot(_curve(rs, fn), color=colors[m], label=m)
        ax.set_xlabel("update's position in the stage (= staleness)")
        ax.set_title(f"{title}, lr {lrs[0]:g}")
    axes[1].set_yscale("log")
    axes[2].legend(fontsize=7, ncol=2)
    fig.tight_layout()
    out = Path(path).with_suffix(".png")
    fig.savefig(out, dpi=110)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("results", nargs="?", type=Path, default=OUT, help="a results JSON (default: the committed one)")
    p = ap.parse_args(argv).results
    print(plot(p))
    print(table(read_figures(p)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
