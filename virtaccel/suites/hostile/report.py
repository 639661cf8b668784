"""The report of a hostile run: the table rows by category and verdict, and a
self-contained HTML page a reviewer can open (no scripts, no external resources)."""
from __future__ import annotations

import html
from typing import Sequence

from .catalogue import CATEGORIES
from .core import Result, Verdict
from .runner import Report

VERDICTS = tuple(v.value for v in Verdict)
_COLOURS = {"PASS": "#1a7f37", "REJECT": "#9a6700", "WEDGED": "#bc4c00", "FAIL": "#cf222e"}


def summary_rows(report: Report) -> tuple[list[str], list[list[object]], list[list[object]]]:
    """Columns, one row per (attachment, category), and a totals row per attachment."""
    cols = ["attach", "category", "scenarios", *VERDICTS]
    rows: list[list[object]] = []
    totals: list[list[object]] = []
    counts = report.counts()
    for attach in report.attachments:
        per = counts.get(attach, {})
        tot = {v: 0 for v in VERDICTS}
        for cat in CATEGORIES:
            c = per.get(cat)
            if not c:
                continue
            rows.append([attach, cat, sum(c.values()), *[c.get(v, 0) for v in VERDICTS]])
            for v in VERDICTS:
                tot[v] += c.get(v, 0)
        if per:
            totals.append([attach, "all", sum(tot.values()), *[tot[v] for v in VERDICTS]])
    return cols, rows, totals


def bad_rows(report: Report) -> list[list[object]]:
    """One row per WEDGED or FAIL result: attach, scenario, verdict, rule, reason."""
    return [[r.attach, r.scenario, r.verdict.value, r.rule, r.reason]
            for r in report.results if r.verdict.bad]


def _cell(text: object) -> str:
    return html.escape(str(text), quote=True)


def to_html(report: Report, title: str = "virtaccel hostile") -> str:
    """One page: the summary, then a table per category with each scenario's verdict
    and rule on every attachment it ran on."""
    cols, rows, totals = summary_rows(report)
    attaches = list(report.attachments)
    by: dict[tuple[str, str], Result] = {(r.scenario, r.attach): r for r in report.results}
    out: list[str] = [
        "<!DOCTYPE html>", '<html lang="en"><head><meta charset="utf-8">',
        f"<title>{_cell(title)}</title>",
        "<style>body{font-family:system-ui,sans-serif;margin:2em;color:#1f2328}"
        "table{border-collapse:collapse;margin:0 0 2em}"
        "th,td{border:1px solid #d0d7de;padding:3px 8px;text-align:left;font-size:13px}"
        "th{background:#f6f8fa}td.n{text-align:right}"
        + "".join(f".v-{v}{{color:{c};font-weight:600}}" for v, c in _COLOURS.items())
        + "</style></head><body>",
        f"<h1>{_cell(title)}</h1>",
        f"<p>seed {report.seed}; attachments {_cell(', '.join(attaches))}; "
        f"{len(report.results)} scenario runs; {report.wall_s:.1f} s. Verdict: "
        f'<span class="v-{"PASS" if report.ok else "FAIL"}">'
        f'{"no WEDGED, no FAIL" if report.ok else "WEDGED or FAIL present"}</span></p>',
        "<h2>Summary</h2>", "<table><thead><tr>"
        + "".join(f"<th>{_cell(c)}</th>" for c in cols) + "</tr></thead><tbody>"]
    for row in rows + totals:
        out.append("<tr>" + "".join(
            f'<td class="n">{_cell(v)}</td>' if isinstance(v, int) else f"<td>{_cell(v)}</td>"
            for v in row) + "</tr>")
    out.append("</tbody></table>")
    scenarios: dict[str, list[str]] = {}
    for res in report.results:
        listed = scenarios.setdefault(res.category, [])
        if res.scenario not in listed:
            listed.append(res.scenario)
    for cat in CATEGORIES:
        names = scenarios.get(cat, [])
        if not names:
            continue
        out.append(f'<h2 id="{_cell(cat.replace(" ", "-"))}">{_cell(cat)} '
                   f"({len(names)} scenarios)</h2>")
        out.append("<table><thead><tr><th>scenario</th>"
                   + "".join(f"<th>{_cell(a)}</th>" for a in attaches)
                   + "<th>rule</th><th>reason</th></tr></thead><tbody>")
        for name in names:
            cells, rule, reason = [], "", ""
            for a in attaches:
                got = by.get((name, a))
                if got is None:
                    cells.append("<td>-</td>")
                    continue
                v = got.verdict.value
                cells.append(f'<td class="v-{v}">{v}</td>')
                if not rule or got.verdict.bad:
                    rule, reason = got.rule, got.reason
            out.append(f"<tr><td>{_cell(name)}</td>{''.join(cells)}<td>{_cell(rule)}</td>"
                       f"<td>{_cell(reason)}</td></tr>")
        out.append("</tbody></table>")
    out.append("</body></html>")
    return "\n".join(out) + "\n"


def categories_of(names: Sequence[str]) -> list[str]:
    """Check category names given by a user: the unknown ones."""
    return [n for n in names if n not in CATEGORIES]
