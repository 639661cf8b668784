"""Chrome trace-event export: schema, per-track nesting, and the demo's GEMM spans."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from virtaccel.cli import main
from virtaccel.cli.demo import run_demo
from vmm.machine import Machine
from vmm.trace import Trace, TraceEvent
from virtaccel.trace_export import write_chrome_trace
from virtaccel.trace_export import chrome_trace, nesting_problems

PHASES = {"X", "i", "M"}


def _ev(t: int, source: str, kind: str, **fields: object) -> TraceEvent:
    return TraceEvent(t, source, kind, tuple(sorted(fields.items())))


def _names(doc: dict, pid: int, tid: int) -> dict[str, str]:
    meta = {(e["pid"], e["tid"], e["name"]): e["args"] for e in doc["traceEvents"]
            if e["ph"] == "M"}
    return {"process": meta[(pid, 0, "process_name")]["name"],
            "thread": meta[(pid, tid, "thread_name")]["name"]}


@pytest.fixture(scope="module")
def demo_doc(tmp_path_factory: pytest.TempPathFactory) -> dict:
    path = tmp_path_factory.mktemp("trace") / "demo.json"
    report = run_demo(seed=0, trace_path=str(path))
    assert report.ok
    doc: dict = json.loads(path.read_text())
    assert doc["otherData"]["trace_digest"] == report.digest
    return doc


def test_demo_trace_schema(demo_doc: dict) -> None:
    events = demo_doc["traceEvents"]
    assert events and demo_doc["displayTimeUnit"] == "ns"
    for e in events:
        assert {"ph", "ts", "pid", "tid", "name"} <= set(e), e
        assert e["ph"] in PHASES
        assert isinstance(e["ts"], (int, float)) and e["ts"] >= 0
        assert isinstance(e["pid"], int) and isinstance(e["tid"], int)
        if e["ph"] == "X":
            assert isinstance(e["dur"], (int, float)) and e["dur"] >= 0
        if e["ph"] == "i":
            assert e["s"] == "t"
    assert nesting_problems(demo_doc) == []


def test_demo_trace_has_gemm_spans_inside_a_submission_on_an_engine_track(
        demo_doc: dict) -> None:
    spans = [e for e in demo_doc["traceEvents"] if e["ph"] == "X"]
    gemms = [e for e in spans if e["name"] == "GEMM"]
    assert len(gemms) == 2
    for g in gemms:
        names = _names(demo_doc, g["pid"], g["tid"])
        assert names == {"process": "vm0.va1.0", "thread": "engine 0"}
        subs = [s for s in spans if s["name"].startswith("submit ")
                and (s["pid"], s["tid"]) == (g["pid"], g["tid"])]
        assert any(s["ts"] <= g["ts"] and g["ts"] + g["dur"] <= s["ts"] + s["dur"] + 1e-9
                   for s in subs)
        assert g["dur"] > 0


def test_demo_trace_has_instants_and_guest_waits(demo_doc: dict) -> None:
    events = demo_doc["traceEvents"]
    kinds = {e["name"] for e in events if e["ph"] == "i"}
    assert {"mmio_read", "mmio_write", "kick", "irq", "reap"} <= kinds
    waits = [e for e in events if e["ph"] == "X" and e["name"].startswith("wait ")]
    assert waits
    assert all(_names(demo_doc, w["pid"], w["tid"])["thread"] == "task mlp" for w in waits)
    mmio = next(e for e in events if e["name"] == "mmio_write")
    assert _names(demo_doc, mmio["pid"], mmio["tid"]) == {"process": "vm0", "thread": "cpu"}
    assert mmio["args"]["addr"].startswith("0x")


def test_keeping_the_trace_does_not_change_the_digest(tmp_path: Path) -> None:
    assert run_demo(seed=5, trace_path=str(tmp_path / "t.json")).digest == run_demo(seed=5).digest


def test_partial_overlaps_are_clipped_so_tracks_nest() -> None:
    evs = [
        _ev(0, "vm0.va1.0", "submit_start", engine=0, context=1, queue=2, fence=1,
            start_ns=0),
        _ev(10, "vm0.va1.0", "cmd", opcode="GEMM", engine=0, queue=2, offset=0,
            start_ns=0, end_ns=10),
        # a command that would run past its submission's end (as after a reset)
        _ev(30, "vm0.va1.0", "cmd", opcode="NOP", engine=0, queue=2, offset=8,
            start_ns=10, end_ns=30),
        _ev(20, "vm0.va1.0", "submit_end", engine=0, context=1, queue=2, fence=1,
            status="OK", start_ns=0, end_ns=20),
        _ev(40, "vm0.va1.0", "submit_start", engine=0, context=1, queue=2, fence=2,
            start_ns=40),  # never ends
        _ev(50, "machine", "wait", task="t", what="x", timeout=-1),  # never woken
    ]
    doc = chrome_trace(evs)
    assert nesting_problems(doc) == []
    nop = next(e for e in doc["traceEvents"] if e["name"] == "NOP")
    assert nop["args"]["clipped"] is True and nop["ts"] + nop["dur"] == pytest.approx(0.02)
    open_sub = next(e for e in doc["traceEvents"] if e["name"] == "submit ctx1 q2 fence2")
    assert open_sub["args"]["ended"] is False


def test_nesting_checker_finds_partial_overlap_and_missing_fields() -> None:
    bad = {"traceEvents": [
        {"ph": "X", "name": "a", "pid": 1, "tid": 1, "ts": 0, "dur": 10},
        {"ph": "X", "name": "b", "pid": 1, "tid": 1, "ts": 5, "dur": 10},
        {"ph": "X", "name": "c", "pid": 1, "tid": 2, "ts": 5, "dur": 10},  # other track
        {"ph": "i", "name": "d", "pid": 1, "ts": 0},
    ]}
    problems = nesting_problems(bad)
    assert len(problems) == 2
    assert any("'b'" in p for p in problems) and any("tid" in p for p in problems)


def test_write_needs_a_kept_trace(tmp_path: Path) -> None:
    t = Trace(lambda: 0)
    with pytest.raises(ValueError, match="keep_trace"):
        write_chrome_trace(t, str(tmp_path / "x.json"))
    m = Machine(0, keep_trace=True)
    doc = write_chrome_trace(m.trace, str(tmp_path / "x.json"))
    assert json.loads((tmp_path / "x.json").read_text()) == doc


def test_demo_cli_trace_option(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "cli.json"
    assert main(["demo", "--trace", str(path)]) == 0
    assert str(path) in capsys.readouterr().out
    assert nesting_problems(json.loads(path.read_text())) == []
