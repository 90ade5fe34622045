"""What the benchmarks' figures share: a grid, a legend where there is something to label, the
layout and the file."""

from __future__ import annotations

from pathlib import Path


def finish(fig, axes, path: Path, legend_size: int = 8) -> None:
    """Grid and legend on each of ``axes``, then lay ``fig`` out and save it to ``path`` (90 dpi)."""
    for ax in axes:
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=legend_size)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    print(f"wrote {path}")
