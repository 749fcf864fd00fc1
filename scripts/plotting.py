"""Figures of the measuring scripts, drawn with matplotlib (`pip install -e ".[plots]"`): over seeds, the mean as a
line, the seed-to-seed range (min to max) as a band, and each seed as a thin line."""

from __future__ import annotations

import os
import statistics
from typing import Any

Curve = list[tuple[float, float]]  # (x, y) points of one seed


def pyplot() -> Any:
    """matplotlib's pyplot on the file-only Agg backend, or an exit that names the extra to install."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as err:
        raise SystemExit('--plot draws with matplotlib: pip install -e ".[plots]"') from err
    return plt


def seed_band(axes: Any, curves: dict[int, Curve], label: str, colour: str) -> None:
    """Draw the seeds' curves (the same x values each) on `axes`: thin lines, their min-max band, their mean."""
    xs = [x for x, _ in next(iter(curves.values()))]
    for seed, points in curves.items():
        if [x for x, _ in points] != xs:
            raise ValueError(f"{label}: seed {seed} has points at other x values than the first seed")
    columns = list(zip(*([y for _, y in points] for points in curves.values()), strict=True))
    for points in curves.values():
        axes.plot(xs, [y for _, y in points], color=colour, linewidth=0.7, alpha=0.45)
    lows, highs = [min(column) for column in columns], [max(column) for column in columns]
    seeds = ", ".join(str(seed) for seed in curves)
    axes.fill_between(xs, lows, highs, color=colour, alpha=0.2, linewidth=0, label=f"{label}, min-max (seeds {seeds})")
    axes.plot(xs, [statistics.fmean(column) for column in columns], color=colour, linewidth=2.2, label=f"{label}, mean")


def save(figure: Any, path: str) -> None:
    """Write `figure` as a PNG at `path` (its folder made if needed) and close it."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    figure.savefig(path, dpi=130, bbox_inches="tight", metadata={"Software": None})
    pyplot().close(figure)
