"""Chrome trace-event JSON (what Perfetto and chrome://tracing open) from a kept Trace.

Layout, all in VIRTUAL time (ts and dur in microseconds):
- one process per VM (tracks: cpu = MMIO accesses, irq = interrupt lines, kernel = the
  guest driver's kicks, reaps, waits and fences, iommu = IOMMU faults);
- one process per device function (source `<vm>.va1.<n>` and any other device source):
  one track per engine with submission spans ("X") and, nested inside, one span per
  command; a `device` track with the device's instants (irq, ctrl, faults, resets);
- one `machine` process with a track per guest task: the task's life as a span and
  its waits (wait -> wake) as spans inside it.
Everything else becomes an instant event ("i", thread scope) on its source's track.
Spans on one track nest properly: a span that would partially overlap the span it
starts in is clipped to that span's end (args.clipped = true), which only a device
reset in the middle of a submission can cause.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Iterable

from vmm.trace import Trace, TraceEvent

VM_TRACKS = ("cpu", "irq", "kernel", "iommu")
_SPAN_KINDS = ("submit_start", "submit_end", "cmd")


@dataclass
class _Process:
    pid: int
    name: str
    tids: dict[str, int] = field(default_factory=dict)

    def tid(self, track: str) -> int:
        if track not in self.tids:
            self.tids[track] = len(self.tids) + 1
        return self.tids[track]


def _us(ns: int) -> float:
    return ns / 1000.0


def _jsonable(key: str, value: object) -> object:
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return value
    if isinstance(value, float):
        return value
    if isinstance(value, int) or hasattr(value, "__index__"):
        v = int(value)
        return hex(v) if key in ("addr", "iova", "base") else v
    if isinstance(value, (tuple, list)):
        return [_jsonable(key, v) for v in value]
    return str(value)


def _args(ev: TraceEvent, drop: tuple[str, ...] = ()) -> dict[str, object]:
    return {k: _jsonable(k, v) for k, v in ev.fields if k not in drop}


class _Builder:
    def __init__(self) -> None:
        self.procs: dict[str, _Process] = {}
        self.events: list[dict[str, Any]] = []
        self.open_waits: dict[str, list[TraceEvent]] = {}
        self.open_tasks: dict[str, TraceEvent] = {}
        self.open_subs: dict[tuple[str, int], TraceEvent] = {}
        self.last_ns = 0

    def proc(self, name: str) -> _Process:
        if name not in self.procs:
            self.procs[name] = _Process(len(self.procs) + 1, name)
        return self.procs[name]

    def where(self, source: str) -> tuple[_Process, str]:
        """(process, track) of an event's source."""
        if source == "machine":
            return self.proc("machine"), "machine"
        head, _, tail = source.rpartition(".")
        if head and tail in VM_TRACKS:
            return self.proc(head), tail
        return self.proc(source), "device"

    def span(self, proc: _Process, track: str, name: str, start_ns: int, end_ns: int,
             args: dict[str, object]) -> None:
        self.events.append({"ph": "X", "name": name, "cat": track, "pid": proc.pid,
                            "tid": proc.tid(track), "ts": _us(start_ns),
                            "dur": _us(max(end_ns - start_ns, 0)), "args": args})

    def instant(self, proc: _Process, track: str, ev: TraceEvent, name: str | None = None
                ) -> None:
        self.events.append({"ph": "i", "s": "t", "name": name or ev.kind, "cat": track,
                            "pid": proc.pid, "tid": proc.tid(track), "ts": _us(ev.t_ns),
                            "args": _args(ev)})

    def add(self, ev: TraceEvent) -> None:
        self.last_ns = max(self.last_ns, ev.t_ns)
        proc, track = self.where(ev.source)
        if ev.source == "machine":
            self.machine(proc, ev)
        elif track == "device" and ev.kind in _SPAN_KINDS:
            self.device_span(proc, ev)
        else:
            self.instant(proc, track, ev)

    def machine(self, proc: _Process, ev: TraceEvent) -> None:
        task = str(ev.get("task", ""))
        if ev.kind == "task_start":
            self.open_tasks[task] = ev
            proc.tid(f"task {task}")
        elif ev.kind == "task_end" and task in self.open_tasks:
            start = self.open_tasks.pop(task)
            self.span(proc, f"task {task}", f"task {task}", start.t_ns, ev.t_ns, _args(ev))
        elif ev.kind == "wait":
            self.open_waits.setdefault(task, []).append(ev)
        elif ev.kind == "wake" and self.open_waits.get(task):
            start = self.open_waits[task].pop()
            args = _args(start)
            args["ok"] = ev.get("ok")
            self.span(proc, f"task {task}", f"wait {ev.get('what')}", start.t_ns, ev.t_ns, args)
        else:
            self.instant(proc, f"task {task}" if task else "machine", ev)

    def device_span(self, proc: _Process, ev: TraceEvent) -> None:
        engine = ev.get("engine", -1)
        engine = int(engine) if isinstance(engine, int) else -1
        track = f"engine {engine}" if engine >= 0 else "device"
        if engine < 0:  # refused or aborted before reaching an engine
            self.instant(proc, track, ev)
            return
        start_ns, end_ns = ev.get("start_ns"), ev.get("end_ns")
        if ev.kind == "cmd" and isinstance(start_ns, int) and isinstance(end_ns, int):
            self.span(proc, track, str(ev.get("opcode")), start_ns, end_ns,
                      _args(ev, ("start_ns", "end_ns")))
        elif ev.kind == "submit_start":
            key = (proc.name, engine)
            if key in self.open_subs:  # never ended (reset): close it where this begins
                self.close_sub(proc, key, ev.t_ns, {"ended": False})
            self.open_subs[key] = ev
        elif ev.kind == "submit_end":
            key = (proc.name, engine)
            begin = self.open_subs.pop(key, None)
            start = start_ns if isinstance(start_ns, int) else ev.t_ns
            end = end_ns if isinstance(end_ns, int) else ev.t_ns
            args = _args(ev, ("start_ns", "end_ns"))
            self.span(proc, track, self.sub_name(ev), start, end, args)
            del begin

    @staticmethod
    def sub_name(ev: TraceEvent) -> str:
        return f"submit ctx{ev.get('context')} q{ev.get('queue')} fence{ev.get('fence')}"

    def close_sub(self, proc: _Process, key: tuple[str, int], end_ns: int,
                  extra: dict[str, object]) -> None:
        ev = self.open_subs.pop(key)
        args = _args(ev, ("start_ns",))
        args.update(extra)
        self.span(proc, f"engine {key[1]}", self.sub_name(ev), ev.t_ns, end_ns, args)

    def finish(self) -> None:
        """Close what never ended (at the last event's time), then enforce nesting."""
        for key in list(self.open_subs):
            self.close_sub(self.procs[key[0]], key, self.last_ns, {"ended": False})
        m = self.procs.get("machine")
        if m is not None:
            for task, stack in self.open_waits.items():
                for w in stack:
                    self.span(m, f"task {task}", f"wait {w.get('what')}", w.t_ns, self.last_ns,
                              {**_args(w), "ended": False})
            for task, ev in self.open_tasks.items():
                self.span(m, f"task {task}", f"task {task}", ev.t_ns, self.last_ns,
                          {"ended": False})


def _enforce_nesting(events: list[dict[str, Any]]) -> None:
    """Clip spans that would partially overlap their enclosing span on a track."""
    by_track: dict[tuple[int, int], list[dict[str, Any]]] = {}
    for e in events:
        if e["ph"] == "X":
            by_track.setdefault((e["pid"], e["tid"]), []).append(e)
    for spans in by_track.values():
        spans.sort(key=lambda e: (e["ts"], -e["dur"]))
        stack: list[float] = []  # end times
        for e in spans:
            while stack and e["ts"] >= stack[-1]:
                stack.pop()
            end = e["ts"] + e["dur"]
            if stack and end > stack[-1]:
                e["dur"] = stack[-1] - e["ts"]
                e["args"]["clipped"] = True
                end = stack[-1]
            stack.append(end)


def chrome_trace(events: Iterable[TraceEvent], digest: str | None = None) -> dict[str, Any]:
    """The trace-event JSON document (a dict) of `events`."""
    b = _Builder()
    for ev in events:
        b.add(ev)
    b.finish()
    _enforce_nesting(b.events)
    meta: list[dict[str, Any]] = []
    for p in b.procs.values():
        meta.append({"ph": "M", "name": "process_name", "pid": p.pid, "tid": 0, "ts": 0,
                     "args": {"name": p.name}})
        meta.append({"ph": "M", "name": "process_sort_index", "pid": p.pid, "tid": 0, "ts": 0,
                     "args": {"sort_index": p.pid}})
        for track, tid in p.tids.items():
            meta.append({"ph": "M", "name": "thread_name", "pid": p.pid, "tid": tid, "ts": 0,
                         "args": {"name": track}})
            meta.append({"ph": "M", "name": "thread_sort_index", "pid": p.pid, "tid": tid,
                         "ts": 0, "args": {"sort_index": tid}})
    body = sorted(b.events, key=lambda e: (e["ts"], -e.get("dur", 0.0)))
    other: dict[str, Any] = {"clock": "virtual time (ts/dur in us)"}
    if digest is not None:
        other["trace_digest"] = digest
    return {"traceEvents": meta + body, "displayTimeUnit": "ns", "otherData": other}


def write_chrome_trace(trace: Trace | Iterable[TraceEvent], path: str) -> dict[str, Any]:
    """Write `trace` (a Trace made with keep=True, or its events) as Chrome trace JSON;
    returns the document."""
    if isinstance(trace, Trace):
        if not trace.keep:
            raise ValueError("write_chrome_trace needs a Trace that keeps its events: "
                             "make the machine with Machine(seed, keep_trace=True)")
        doc = chrome_trace(trace.events, trace.digest())
    else:
        doc = chrome_trace(trace)
    with open(path, "w") as f:
        json.dump(doc, f, separators=(",", ":"))
        f.write("\n")
    return doc


def nesting_problems(doc: dict[str, Any]) -> list[str]:
    """Every violation of the trace-event schema used here or of per-track nesting."""
    problems: list[str] = []
    tracks: dict[tuple[int, int], list[tuple[float, float, str]]] = {}
    for i, e in enumerate(doc.get("traceEvents", [])):
        for k in ("ph", "ts", "pid", "tid", "name"):
            if k not in e:
                problems.append(f"event {i} lacks {k!r}: {e}")
        if e.get("ph") == "X":
            if not isinstance(e.get("dur"), (int, float)) or e["dur"] < 0:
                problems.append(f"event {i}: X needs dur >= 0")
                continue
            tracks.setdefault((e["pid"], e["tid"]), []).append((e["ts"], e["ts"] + e["dur"],
                                                                e["name"]))
    for key, spans in tracks.items():
        spans.sort(key=lambda s: (s[0], -(s[1] - s[0])))
        stack: list[tuple[float, float, str]] = []
        for s in spans:
            while stack and s[0] >= stack[-1][1]:
                stack.pop()
            if stack and s[1] > stack[-1][1]:
                problems.append(f"track {key}: {s[2]!r} [{s[0]}, {s[1]}] overlaps "
                                f"{stack[-1][2]!r} [{stack[-1][0]}, {stack[-1][1]}]")
            stack.append(s)
    return problems
