"""PNG plots of the paper's three views, one line per run (needs matplotlib)."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

from drbalance.ipc.private import make_dirs, write_private
from drbalance.report.metrics import RunData, sd_views, util_view

VIEWS = (
    ("sd_max_diff.png", "SD_max^diff (max SD - min SD)", "slow-down spread"),
    ("mean_sd.png", "mean SD of live apps", "mean slow-down"),
    ("mean_util.png", "mean GPU utilisation (%), 5 s mean", "mean GPU utilisation"),
)


def _pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise RuntimeError("plots need matplotlib: pip install 'drbalance[examples]' (or pip install matplotlib)") \
            from None
    return plt


def save_png(figure: Any, path: Path, dpi: int) -> None:
    """Write ``figure`` (a matplotlib Figure) to ``path`` as a PNG of ``dpi`` dots per inch: a new private file renamed
    over ``path`` (``write_private``), never written through a symbolic link someone planted there."""
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=dpi)
    write_private(path, buffer.getvalue())


def plot_runs(runs: list[RunData], out_dir: Path, step: float = 1.0) -> list[Path]:
    """Write sd_max_diff.png, mean_sd.png, mean_util.png and summary.png (all three) to ``out_dir``."""
    plt = _pyplot()
    make_dirs(out_dir)
    series = []
    for run in runs:
        times, diffs, means = sd_views(run, step)
        util_times, utils = util_view(run)
        series.append((run.label, (times, diffs), (times, means), (util_times, utils)))
    written = []
    figure, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    for index, (filename, ylabel, title) in enumerate(VIEWS):
        single, single_axis = plt.subplots(figsize=(7, 4.5))
        for axis in (single_axis, axes[index]):
            for label, *views in series:
                xs, ys = views[index]
                points = [(x, y) for x, y in zip(xs, ys) if y is not None]
                if points:
                    axis.plot([p[0] for p in points], [p[1] for p in points], label=label, linewidth=1.6)
            axis.set_xlabel("time since start (s)")
            axis.set_ylabel(ylabel)
            axis.set_title(title)
            axis.grid(True, alpha=0.3)
            axis.legend(loc="best")
            if index == 2:
                axis.set_ylim(0, 105)
            else:
                axis.set_ylim(bottom=0)
        single.tight_layout()
        path = out_dir / filename
        save_png(single, path, dpi=110)
        plt.close(single)
        written.append(path)
    figure.tight_layout()
    path = out_dir / "summary.png"
    save_png(figure, path, dpi=100)
    plt.close(figure)
    written.append(path)
    return written
