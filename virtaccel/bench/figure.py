"""The bench figure: each row's ratio against its target, drawn with matplotlib.

matplotlib (Agg, no display needed) is imported only here and only when a figure is
written, so the table-only paths and `virtaccel --help` never pay for it. Y is a log
axis: a bar per row (its median ratio), green when the row meets its target and orange
when it does not, an error bar over the interquartile range of its runs' ratios, and the
target as a red line across the bar's slot.
"""
from __future__ import annotations

from typing import Sequence

from .rows import Row

MET = "#3caa3c"
MISSED = "#eb8c1e"
TARGET = "#c0392b"


def short_label(name: str) -> str:
    """a_gemm_f32_1024 -> a; the two DMA rows c_..._h2d/d2h -> c1/c2."""
    head = name.split("_")[0]
    return head + ("1" if "_h2d" in name else "2" if "_d2h" in name else "")


def write_figure(path: str, rows: Sequence[Row]) -> None:
    """Write the ratio-vs-target bar chart of `rows` as a PNG file."""
    import matplotlib
    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    fig = Figure(figsize=(max(4.0, 0.8 * len(rows) + 2), 3.6), dpi=100, layout="tight")
    ax = fig.add_subplot()
    xs = range(len(rows))
    ratios = [r.ratio if r.ratio is not None and r.ratio > 0 else float("nan") for r in rows]
    lo, hi = [], []
    for r, q in zip(rows, ratios):
        rs = r.spread.get("ratio")
        ok = rs is not None and q == q
        lo.append(max(q - rs["q1"], 0.0) if ok and rs else 0.0)
        hi.append(max(rs["q3"] - q, 0.0) if ok and rs else 0.0)
    ax.bar(xs, ratios, color=[MET if r.met else MISSED for r in rows], width=0.6,
           yerr=[lo, hi], capsize=3, error_kw={"elinewidth": 1, "ecolor": "#333333"})
    for x, r in zip(xs, rows):
        ax.hlines(r.target, x - 0.4, x + 0.4, colors=TARGET, linewidths=2)
    ax.set_yscale("log")
    ax.set_ylim(0.01, 100)
    ax.axhline(1.0, color="grey", linewidth=0.8)
    ax.set_xticks(list(xs), [short_label(r.name) for r in rows])
    ax.set_ylabel("ratio (vs baseline)")
    ax.set_title("virtaccel bench: median ratio (bar), IQR (whisker), target (red)",
                 fontsize=10)
    ax.grid(axis="y", which="major", color="#dddddd", linewidth=0.6)
    fig.savefig(path, format="png")
