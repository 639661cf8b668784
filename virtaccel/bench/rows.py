"""Benchmark rows: a measured value, its baseline from the same run, the ratio and its target.

A row is computed from raw timings only (no measuring here), so tests can feed fake
timings. Three shapes:

- `speed_row`: value and baseline are wall seconds for the same work; ratio is
  baseline / value (1.0 = as fast as the baseline), target is a lower bound.
- `rate_row`: value and baseline are rates (per second); ratio is value / baseline,
  target is a lower bound.
- `cost_row`: value and baseline are costs (seconds); ratio is value / baseline, target
  is an upper bound (e.g. "at most 10x the bare ring").

Each takes the samples of every run (or one number). Value and baseline are the medians
of their samples and the ratio is the ratio of those medians: the target applies to
it. `spread` gives each one's distribution over the runs (n, median, quartiles, min,
max) and the ratio's: the quartiles of the per-run ratios when value and baseline runs
are paired (same count, interleaved), else the band the quartiles of both allow.
"""
from __future__ import annotations

import json
import math
import statistics
from dataclasses import asdict, dataclass, field
from typing import Any, Iterable, Sequence

ROW_FIELDS = ("name", "value", "baseline", "ratio", "target", "op", "unit", "met", "note",
              "spread")
SPREAD_FIELDS = ("n", "median", "q1", "q3", "min", "max")
Samples = float | Sequence[float]


@dataclass
class Row:
    """One line of the benchmark table (and of bench.json)."""
    name: str
    value: float | None
    baseline: float | None
    ratio: float | None
    target: float
    op: str            # ">=" (ratio must reach target) or "<=" (must not exceed it)
    unit: str          # unit of value and baseline
    met: bool
    note: str = ""
    reps: int = 0
    profile: dict[str, Any] = field(default_factory=dict)
    # {"value": Spread, "baseline": Spread, "ratio": Spread + "paired"}, each a dict of
    # SPREAD_FIELDS (module docstring); empty for a row with no measurement.
    spread: dict[str, dict[str, Any]] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def _met(ratio: float | None, target: float, op: str) -> bool:
    if ratio is None or not math.isfinite(ratio):
        return False
    eps = 1e-9 * abs(target)  # a ratio equal to its target up to rounding meets it
    return ratio >= target - eps if op == ">=" else ratio <= target + eps


def _ratio(num: float, den: float) -> float | None:
    if den <= 0 or not math.isfinite(num) or not math.isfinite(den):
        return None
    return num / den


def _samples(x: Samples) -> list[float]:
    out = [float(x)] if isinstance(x, (int, float)) else [float(v) for v in x]
    if not out:
        raise ValueError("no samples")
    return out


def _quantile(srt: Sequence[float], q: float) -> float:
    """Linear interpolation between the closest ranks (numpy's default)."""
    pos = q * (len(srt) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(srt) - 1)
    return srt[lo] + (srt[hi] - srt[lo]) * (pos - lo)


def spread(samples: Sequence[float]) -> dict[str, Any]:
    """n, median, quartiles, min and max of `samples`."""
    srt = sorted(samples)
    if not srt:
        raise ValueError("no samples")
    return {"n": len(srt), "median": _quantile(srt, 0.5), "q1": _quantile(srt, 0.25),
            "q3": _quantile(srt, 0.75), "min": srt[0], "max": srt[-1]}


def _row(name: str, num: Samples, den: Samples, value: Samples, baseline: Samples,
         target: float, op: str, unit: str, note: str, reps: int,
         paired: bool | None = None) -> Row:
    """A row whose ratio is median(num) / median(den) (num, den: value and baseline in
    the order the ratio takes them)."""
    ns, ds = _samples(num), _samples(den)
    vs, bs = _samples(value), _samples(baseline)
    ratio = _ratio(median(ns), median(ds))
    if paired is None:
        paired = len(ns) == len(ds)
    paired = paired and len(ns) == len(ds) and len(ns) > 1
    if paired:
        per_run = [r for r in (_ratio(a, b) for a, b in zip(ns, ds)) if r is not None]
        rs = spread(per_run) if per_run else None
    else:
        n, d = spread(ns), spread(ds)
        lo, hi = _ratio(n["q1"], d["q3"]), _ratio(n["q3"], d["q1"])
        mn, mx = _ratio(n["min"], d["max"]), _ratio(n["max"], d["min"])
        rs = None if None in (lo, hi, mn, mx, ratio) else {
            "n": min(len(ns), len(ds)), "median": ratio, "q1": lo, "q3": hi, "min": mn,
            "max": mx}
    sp: dict[str, dict[str, Any]] = {"value": spread(vs), "baseline": spread(bs)}
    if rs is not None:
        sp["ratio"] = {**rs, "paired": paired}
    return Row(name, median(vs), median(bs), ratio, target, op, unit, _met(ratio, target, op),
               note, reps or len(vs), spread=sp)


def speed_row(name: str, value_s: Samples, baseline_s: Samples, target: float,
              note: str = "", reps: int = 0, paired: bool | None = None) -> Row:
    """Same work timed both ways; ratio = median baseline / median value, met when >=
    target. `paired`: run i of each was measured together (None: when the counts are
    equal)."""
    return _row(name, baseline_s, value_s, value_s, baseline_s, target, ">=", "s", note, reps,
                paired)


def rate_row(name: str, value: Samples, baseline: Samples, target: float, unit: str,
             note: str = "", reps: int = 0, paired: bool | None = None) -> Row:
    """Throughputs; ratio = median value / median baseline, met when >= target."""
    return _row(name, value, baseline, value, baseline, target, ">=", unit, note, reps,
                paired)


def cost_row(name: str, value_s: Samples, baseline_s: Samples, target: float,
             unit: str = "s", note: str = "", reps: int = 0,
             paired: bool | None = None) -> Row:
    """Costs; ratio = median value / median baseline, met when <= target."""
    return _row(name, value_s, baseline_s, value_s, baseline_s, target, "<=", unit, note,
                reps, paired)


def missing_row(name: str, target: float, op: str, unit: str, note: str) -> Row:
    """A row that could not be measured yet (the note says why)."""
    return Row(name, None, None, None, target, op, unit, False, note)


def median(samples: Sequence[float]) -> float:
    if not samples:
        raise ValueError("no samples")
    return float(statistics.median(samples))


def _fmt(x: float | None, unit: str = "") -> str:
    if x is None:
        return "-"
    if unit == "s":
        if x >= 1:
            return f"{x:.3f} s"
        if x >= 1e-3:
            return f"{x * 1e3:.3f} ms"
        return f"{x * 1e6:.2f} us"
    if abs(x) >= 1e5:
        return f"{x:.3g} {unit}".strip()
    return f"{x:.4g} {unit}".strip()


TABLE_COLUMNS = ("row", "value", "baseline", "ratio", "ratio IQR", "runs", "target", "met",
                 "note")


def _iqr(r: Row) -> str:
    rs = r.spread.get("ratio")
    return "-" if rs is None else f"{rs['q1']:.3f}-{rs['q3']:.3f}"


def _runs(r: Row) -> str:
    v, b = r.spread.get("value"), r.spread.get("baseline")
    return "-" if v is None or b is None else f"{v['n']}/{b['n']}"


def table_rows(rows: Iterable[Row]) -> list[tuple[str, ...]]:
    """The cells of the bench table, one tuple per row (TABLE_COLUMNS): value and
    baseline are medians, the ratio is theirs; the ratio's interquartile range and the
    number of value/baseline runs show the spread."""
    return [(r.name, _fmt(r.value, r.unit), _fmt(r.baseline, r.unit),
             "-" if r.ratio is None else f"{r.ratio:.3f}", _iqr(r), _runs(r),
             f"{r.op} {r.target:g}", "yes" if r.met else "NO", r.note) for r in rows]


RIGHT_COLUMNS = ("value", "baseline", "ratio", "ratio IQR", "runs")


def format_table(rows: Iterable[Row]) -> str:
    """The bench table as plain text (rich, no terminal codes)."""
    import io

    from rich import box
    from rich.console import Console
    from rich.table import Table
    t = Table(box=box.SIMPLE, show_edge=False, pad_edge=False)
    for c in TABLE_COLUMNS:
        t.add_column(c, justify="right" if c in RIGHT_COLUMNS else "left",
                     no_wrap=c != "note")
    for cells in table_rows(rows):
        t.add_row(*cells)
    buf = io.StringIO()
    Console(file=buf, width=240, markup=False, highlight=False, safe_box=True).print(t)
    return buf.getvalue().rstrip("\n")


def to_json(rows: Iterable[Row], meta: dict[str, Any] | None = None) -> str:
    """bench.json: {"rows": [...], "meta": {...}}."""
    return json.dumps({"rows": [r.to_json() for r in rows], "meta": meta or {}}, indent=2)


def validate_json(doc: Any) -> None:
    """ValueError unless `doc` is a bench.json document with well-formed rows."""
    if not isinstance(doc, dict) or not isinstance(doc.get("rows"), list):
        raise ValueError("bench.json must be an object with a list 'rows'")
    for i, r in enumerate(doc["rows"]):
        if not isinstance(r, dict):
            raise ValueError(f"row {i} is not an object")
        missing = [k for k in ROW_FIELDS if k not in r]
        if missing:
            raise ValueError(f"row {i} lacks {missing}")
        if not isinstance(r["name"], str) or not isinstance(r["met"], bool):
            raise ValueError(f"row {i}: name must be a string and met a bool")
        if r["op"] not in (">=", "<="):
            raise ValueError(f"row {i}: op must be '>=' or '<='")
        for k in ("value", "baseline", "ratio"):
            if r[k] is not None and not isinstance(r[k], (int, float)):
                raise ValueError(f"row {i}: {k} must be a number or null")
        sp = r["spread"]
        if not isinstance(sp, dict):
            raise ValueError(f"row {i}: spread must be an object")
        if r["value"] is not None and not {"value", "baseline"} <= set(sp):
            raise ValueError(f"row {i}: a measured row's spread needs value and baseline")
        for k, d in sp.items():
            if k not in ("value", "baseline", "ratio") or not isinstance(d, dict):
                raise ValueError(f"row {i}: spread.{k} is not one of value, baseline, ratio")
            bad = [f for f in SPREAD_FIELDS if not isinstance(d.get(f), (int, float))]
            if bad:
                raise ValueError(f"row {i}: spread.{k} lacks numbers {bad}")
            if not d["min"] <= d["q1"] <= d["median"] <= d["q3"] <= d["max"] and k != "ratio":
                raise ValueError(f"row {i}: spread.{k} is not ordered min<=q1<=median<=q3<=max")
