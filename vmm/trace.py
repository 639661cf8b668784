"""The machine's event trace: every layer reports what happened, in virtual time.

The digest is a SHA-256 over the events' canonical text (virtual time, source, kind and
fields in the order the emitter gave them), so two runs with the same seed print the
same digest exactly when they did the same things in the same order at the same virtual
times. Events are hashed in batches: emitting is a tuple append on the hot path. Events
may also be kept (for exports) and watched.
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


_PLAIN = (int, str, bool, float, type(None))
_BATCH = 4096


def _check(value: object) -> None:
    """Only values whose repr is the same in every run may reach the digest."""
    if isinstance(value, _PLAIN):
        return
    if isinstance(value, tuple):
        for v in value:
            _check(v)
        return
    if hasattr(value, "__index__"):
        return  # numpy integers: their repr is stable
    raise TypeError(f"trace field of type {type(value).__name__} is not deterministic")


class Trace:
    def __init__(self, clock: Callable[[], int], keep: bool = False) -> None:
        self._clock = clock
        self._hash = hashlib.sha256()
        self._pending: list[tuple[int, str, str, tuple[tuple[str, object], ...]]] = []
        self.keep = keep
        self.events: list[TraceEvent] = []
        self.count = 0
        self._watchers: list[Callable[[TraceEvent], None]] = []

    def watch(self, fn: Callable[[TraceEvent], None]) -> None:
        self._watchers.append(fn)

    def emit(self, source: str, kind: str, fields: dict[str, object]) -> None:
        t = self._clock()
        items = tuple(fields.items())
        for _, value in items:
            if type(value) not in _PLAIN:
                _check(value)
        pending = self._pending
        pending.append((t, source, kind, items))
        if len(pending) >= _BATCH:
            self._flush()
        self.count += 1
        if self.keep or self._watchers:
            event = TraceEvent(t, source, kind, items)
            if self.keep:
                self.events.append(event)
            for fn in self._watchers:
                fn(event)

    def _flush(self) -> None:
        if self._pending:
            self._hash.update(repr(self._pending).encode())
            self._pending = []

    def digest(self) -> str:
        self._flush()
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
