"""Reliability diagrams: accuracy against confidence per bin, the gap, the diagonal, the counts."""
from __future__ import annotations

import math
import os

from .metrics import CalibrationResult, ReliabilityData


def reliability_diagram(result: CalibrationResult | ReliabilityData, path: str | None = None, *,
                        title: str | None = None, ax=None):
    """Draw a reliability diagram; save it to ``path`` (PNG) when given. Returns the figure.

    Top panel: bars of per-bin accuracy, the gap to the bin's mean confidence (red), and the
    diagonal of perfect calibration; the ECE and RMS in the corner. Bottom panel: how many
    predictions fall in each bin (log scale), so a big gap over three samples reads as such.
    ``ax``: draw into these axes (one, or a (top, bottom) pair) of the caller's figure, whose layout is left to the
    caller (``fig.tight_layout()`` once every panel is drawn) unless ``path`` asks to save it.
    """
    from matplotlib.figure import Figure  # no pyplot: never switches the user's backend or leaks figures

    rel = result.reliability if isinstance(result, CalibrationResult) else result
    if rel is None:
        raise ValueError("this CalibrationResult has no reliability data")
    m = rel.n_bins
    width = 1.0 / m
    centers = [rel.edges[i] + width / 2 for i in range(m)]
    acc = [0.0 if math.isnan(a) else a for a in rel.accuracy]
    conf = [c if not math.isnan(c) else centers[i] for i, c in enumerate(rel.confidence)]
    filled = [c > 0 for c in rel.count]

    if ax is None:
        fig = Figure(figsize=(4.8, 5.6))
        top, bottom = fig.subplots(2, 1, sharex=True, gridspec_kw={"height_ratios": [3, 1]})
    else:
        top, bottom = ax if isinstance(ax, (tuple, list)) else (ax, None)
        fig = top.figure
    top.bar(centers, acc, width=width, edgecolor="black", color="#4c72b0", label="accuracy")
    gap_base = [min(a, c) if f else 0 for a, c, f in zip(acc, conf, filled)]
    gap_h = [abs(c - a) if f else 0 for a, c, f in zip(acc, conf, filled)]
    top.bar(centers, gap_h, bottom=gap_base, width=width, edgecolor="#c44e52", color="#c44e52", alpha=0.35,
            hatch="//", label="gap to confidence")
    top.plot([0, 1], [0, 1], "k--", lw=1, label="perfect calibration")
    top.set_xlim(0, 1)
    top.set_ylim(0, 1)
    top.set_ylabel("accuracy")
    top.legend(loc="upper left", fontsize=8)
    if isinstance(result, CalibrationResult):
        top.text(0.97, 0.05, f"ECE {result.ece:.3f}\nRMS {result.rms:.3f}\nacc {result.accuracy:.3f}  n={result.n}",
                 ha="right", va="bottom", transform=top.transAxes, fontsize=8,
                 bbox=dict(boxstyle="round", fc="white", alpha=0.8))
    if title:
        top.set_title(title, fontsize=10)
    if bottom is not None:
        bottom.bar(centers, rel.count, width=width, edgecolor="black", color="#8c8c8c")
        if any(c > 0 for c in rel.count):
            bottom.set_yscale("log")
        bottom.set_ylabel("count")
        bottom.set_xlabel("confidence")
    else:
        top.set_xlabel("confidence")
    if ax is None or path is not None:  # (axes of a figure the caller owns: its layout is the caller's, done once)
        fig.tight_layout()
    if path is not None:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        fig.savefig(path, dpi=120)
    return fig


def reliability_grid(results: dict, path: str | None = None, *, title: str | None = None):
    """Reliability diagrams side by side, one per entry of ``{name: CalibrationResult}`` (e.g. a model
    before and after smoothing, ATS, temperature scaling on one task), same axes. Returns the figure."""
    from matplotlib.figure import Figure

    if not results:
        raise ValueError("results is empty: pass {name: CalibrationResult}")
    n = len(results)
    fig = Figure(figsize=(3.6 * n, 5.0))
    axes = fig.subplots(2, n, sharex=True, squeeze=False, gridspec_kw={"height_ratios": [3, 1]})
    for j, (name, res) in enumerate(results.items()):
        reliability_diagram(res, ax=(axes[0][j], axes[1][j]), title=name)
        if j:
            axes[0][j].set_ylabel("")
            axes[1][j].set_ylabel("")
            leg = axes[0][j].get_legend()
            if leg is not None:
                leg.remove()
    if title:
        fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    if path is not None:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        fig.savefig(path, dpi=110)
    return fig
