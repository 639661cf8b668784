"""The machine's event trace: every layer reports what happened, in virtual time.

The digest is a SHA-256 over a canonical text line per event, so two runs with the
same seed print the same digest exactly when they did the same things in the same order
at the same virtual times. Events may also be kept (for exports) and watched.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True)
class TraceEvent:
    t_ns: int
    source: str
    kind: str
    fields: tuple[tuple[str, object], ...]

    def get(self, name: str, default: object = None) -> object:
        for key, value in self.fields:
            if key == name:
                return value
        return default


def _canon(value: object) -> str:
    if isinstance(value, bool) or value is None or isinstance(value, (int, str)):
        return repr(value)
    if isinstance(value, float):
        return value.hex()
    if isinstance(value, (tuple, list)):
        return "[" + ",".join(_canon(v) for v in value) + "]"
    if hasattr(value, "__index__"):
        return repr(int(value))  # numpy ints, IntEnums
    raise TypeError(f"trace field of type {type(value).__name__} is not deterministic")


class Trace:
    def __init__(self, clock: Callable[[], int], keep: bool = False) -> None:
        self._clock = clock
        self._hash = hashlib.sha256()
        self.keep = keep
        self.events: list[TraceEvent] = []
        self.count = 0
        self._watchers: list[Callable[[TraceEvent], None]] = []

    def watch(self, fn: Callable[[TraceEvent], None]) -> None:
        self._watchers.append(fn)

    def emit(self, source: str, kind: str, fields: dict[str, object]) -> None:
        t = self._clock()
        items = tuple(sorted(fields.items()))
        line = f"{t} {source} {kind} " + " ".join(f"{k}={_canon(v)}" for k, v in items) + "\n"
        self._hash.update(line.encode())
        self.count += 1
        if self.keep or self._watchers:
            event = TraceEvent(t, source, kind, items)
            if self.keep:
                self.events.append(event)
            for fn in self._watchers:
                fn(event)

    def digest(self) -> str:
        return self._hash.hexdigest()

    def tracer(self, source: str) -> "SourceTracer":
        return SourceTracer(self, source)


class SourceTracer:
    """A Tracer (device_model.ports / guest_driver.kernel protocol) bound to one source."""

    __slots__ = ("_trace", "source")

    def __init__(self, trace: Trace, source: str) -> None:
        self._trace = trace
        self.source = source

    def emit(self, kind: str, **fields: object) -> None:
        self._trace.emit(self.source, kind, fields)


def write_chrome_trace(trace: Trace, path: str) -> dict[str, object]:
    """Write a kept trace as Chrome trace-event JSON (Perfetto); see vmm.trace_export."""
    from .trace_export import write_chrome_trace as _write
    return _write(trace, path)
