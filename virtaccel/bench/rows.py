"""Benchmark rows: a measured value, its baseline from the same run, the ratio and its target.

A row is computed from raw timings only (no measuring here), so tests can feed fake
timings. Three shapes:

- `speed_row`: value and baseline are wall seconds for the same work; ratio is
  baseline / value (1.0 = as fast as the baseline), target is a lower bound.
- `rate_row`: value and baseline are rates (per second); ratio is value / baseline,
  target is a lower bound.
- `cost_row`: value and baseline are costs (seconds); ratio is value / baseline, target
  is an upper bound (e.g. "at most 10x the bare ring").
"""
from __future__ import annotations

import json
import math
import statistics
from dataclasses import asdict, dataclass, field
from typing import Any, Iterable, Sequence

ROW_FIELDS = ("name", "value", "baseline", "ratio", "target", "op", "unit", "met", "note")


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


def speed_row(name: str, value_s: float, baseline_s: float, target: float, note: str = "",
              reps: int = 0) -> Row:
    """Same work timed both ways; ratio = baseline / value, met when >= target."""
    ratio = _ratio(baseline_s, value_s)
    return Row(name, value_s, baseline_s, ratio, target, ">=", "s", _met(ratio, target, ">="),
               note, reps)


def rate_row(name: str, value: float, baseline: float, target: float, unit: str,
             note: str = "", reps: int = 0) -> Row:
    """Throughputs; ratio = value / baseline, met when >= target."""
    ratio = _ratio(value, baseline)
    return Row(name, value, baseline, ratio, target, ">=", unit, _met(ratio, target, ">="),
               note, reps)


def cost_row(name: str, value_s: float, baseline_s: float, target: float, unit: str = "s",
             note: str = "", reps: int = 0) -> Row:
    """Costs; ratio = value / baseline, met when <= target."""
    ratio = _ratio(value_s, baseline_s)
    return Row(name, value_s, baseline_s, ratio, target, "<=", unit, _met(ratio, target, "<="),
               note, reps)


def missing_row(name: str, target: float, op: str, unit: str, note: str) -> Row:
    """A row that could not be measured yet (the note says why)."""
    return Row(name, None, None, None, target, op, unit, False, note)


def best(samples: Sequence[float]) -> float:
    """Best-of-N (the minimum): the least disturbed repetition."""
    if not samples:
        raise ValueError("no samples")
    return min(samples)


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


TABLE_COLUMNS = ("row", "value", "baseline", "ratio", "target", "met", "note")


def table_rows(rows: Iterable[Row]) -> list[tuple[str, ...]]:
    """The cells of the bench table, one tuple per row (TABLE_COLUMNS)."""
    return [(r.name, _fmt(r.value, r.unit), _fmt(r.baseline, r.unit),
             "-" if r.ratio is None else f"{r.ratio:.3f}", f"{r.op} {r.target:g}",
             "yes" if r.met else "NO", r.note) for r in rows]


def format_table(rows: Iterable[Row]) -> str:
    """The bench table as plain text (rich, no terminal codes)."""
    import io

    from rich import box
    from rich.console import Console
    from rich.table import Table
    t = Table(box=box.SIMPLE, show_edge=False, pad_edge=False)
    for c in TABLE_COLUMNS:
        t.add_column(c, justify="right" if c in ("value", "baseline", "ratio") else "left",
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
