"""scripts/plotting.py: the seeds' band and mean; the recorded side by side redraws (scripts/trl_side_by_side.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("matplotlib")

import plotting  # scripts/ is on the path (conftest)
import trl_side_by_side

RECORDED = Path(__file__).resolve().parents[2] / "docs" / "data" / "trl_side_by_side.json"


def test_the_band_spans_the_seeds_and_the_thick_line_is_their_mean():
    axes = plotting.pyplot().figure().add_subplot()
    curves = {0: [(0.0, 0.1), (5.0, 0.5)], 1: [(0.0, 0.3), (5.0, 0.2)], 2: [(0.0, 0.2), (5.0, 0.9)]}
    plotting.seed_band(axes, curves, "ours", "tab:blue")

    assert len(axes.lines) == 4  # a thin line per seed, then the mean
    assert list(axes.lines[-1].get_xdata()) == [0.0, 5.0]
    assert list(axes.lines[-1].get_ydata()) == pytest.approx([0.2, 1.6 / 3])
    (band,) = axes.collections
    corners = {(round(float(x), 6), round(float(y), 6)) for x, y in band.get_paths()[0].vertices}
    assert {(0.0, 0.1), (0.0, 0.3), (5.0, 0.2), (5.0, 0.9)} <= corners  # min and max at each x
    assert not {(0.0, 0.2), (5.0, 0.5)} & corners  # the middle seed is inside, not an edge
    labels = axes.get_legend_handles_labels()[1]
    assert labels == ["ours, min-max (seeds 0, 1, 2)", "ours, mean"]


def test_seeds_measured_at_other_steps_are_refused():
    axes = plotting.pyplot().figure().add_subplot()
    with pytest.raises(ValueError, match="seed 1 has points at other x values"):
        plotting.seed_band(axes, {0: [(0.0, 0.1), (5.0, 0.5)], 1: [(0.0, 0.3), (10.0, 0.2)]}, "ours", "tab:blue")


def test_the_recorded_side_by_side_redraws(tmp_path):
    runs = trl_side_by_side.load_runs(str(RECORDED))
    assert sorted(runs) == [(impl, seed) for impl in ("ours", "trl") for seed in range(5)]
    # docs/migrating-from-trl.md's table: TRL seed 1 ends at 0.765 after 941 s, ours seed 3 at 0.710 after 478 s
    assert runs["trl", 1][-1] == {"step": 30, "accuracy": 0.765, "train_s": 941.0}
    assert runs["ours", 3][-1] == {"step": 30, "accuracy": 0.71, "train_s": 478.0}
    out = tmp_path / "side_by_side.png"
    trl_side_by_side.plot(runs, str(out), steps=30)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
