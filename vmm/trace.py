"""The machine's event trace: every layer reports what happened, in virtual time.

The digest is a SHA-256 over the events' canonical encoding (virtual time, source, kind
and fields in the order the emitter gave them), so two runs with the same seed print the
same digest exactly when they did the same things in the same order at the same virtual
times. Events are hashed in batches: emitting is a tuple append on the hot path. Events
may also be kept (for exports) and watched.

The canonical encoding of a batch is its pickle (protocol 5) written in *fast mode*: no
memo, so the bytes depend only on the values and their types, never on object identity
(which strings happen to be the same object), and never on str hashes (randomized per
process). Field values are restricted to plain types (`_check`), so the encoding is the
same in every process of the same Python. It is about 6x cheaper than repr().
"""
from __future__ import annotations

import hashlib
import io
import pickle
import weakref
from dataclasses import dataclass
from itertools import chain
from typing import Callable

from .scheduler import Scheduler


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
_PLAIN_SET = frozenset(_PLAIN)
_BATCH = 4096


def encode_batch(events: list) -> bytes:  # type: ignore[type-arg]
    """The canonical bytes of a batch of events (see the module doc)."""
    buf = io.BytesIO()
    p = pickle.Pickler(buf, 5)
    p.fast = True  # no memo: identity-independent output
    p.dump(events)
    return buf.getvalue()


def _check(value: object) -> None:
    """Only plain values (their canonical encoding is the same in every run and every
    process) may reach the digest."""
    if isinstance(value, _PLAIN):
        return
    if isinstance(value, tuple):
        for v in value:
            _check(v)
        return
    if hasattr(value, "__index__"):
        return  # numpy integers: their repr is stable
    raise TypeError(f"trace field of type {type(value).__name__} is not deterministic")


class _CalledClock:
    """Any other clock, read as a scheduler's is (`._now`)."""

    __slots__ = ("_clock",)

    def __init__(self, clock: Callable[[], int]) -> None:
        self._clock = clock

    @property
    def _now(self) -> int:
        return self._clock()


class Trace:
    def __init__(self, clock: Callable[[], int], keep: bool = False) -> None:
        self._clock = clock
        # Emitters read the time as `._now`: straight from the scheduler when the clock
        # is a scheduler's now_ns (the machine's: no call per event), else through a
        # property that calls the clock.
        owner = getattr(clock, "__self__", None)
        self._sched: Scheduler | _CalledClock = owner if isinstance(owner, Scheduler) and \
            getattr(clock, "__func__", None) is Scheduler.now_ns else _CalledClock(clock)
        self._hash = hashlib.sha256()
        # Canonical entries not hashed yet. Emptied in place, never replaced: emitters
        # keep a reference to it.
        self._pending: list[tuple] = []  # type: ignore[type-arg]
        self._extra = 0  # events in _pending beyond one per entry (emit_each batches)
        self._hashed = 0  # events hashed so far
        self._keep = keep
        self.events: list[TraceEvent] = []
        self._watchers: list[Callable[[TraceEvent], None]] = []
        # Whether an event must also become a TraceEvent (kept or watched).
        self._observed = keep
        # A source tracer calls _appended once its pending list reaches this length: at
        # a full batch, or at every event while observed (one test on the hot path for
        # both). Each tracer keeps a copy (`_set_observed` updates them all).
        self._limit = 0 if keep else _BATCH
        self._tracers: weakref.WeakSet[SourceTracer] = weakref.WeakSet()

    @property
    def keep(self) -> bool:
        return self._keep

    @keep.setter
    def keep(self, value: bool) -> None:
        self._keep = value
        self._set_observed(value or bool(self._watchers))

    def _set_observed(self, observed: bool) -> None:
        """Whether events become TraceEvents (kept or watched), for this trace and the
        copy of its `_limit` every source tracer keeps."""
        self._observed = observed
        self._limit = 0 if observed else _BATCH
        for t in self._tracers:
            t._limit = self._limit

    @property
    def count(self) -> int:
        """Events emitted so far."""
        return self._hashed + len(self._pending) + self._extra

    def watch(self, fn: Callable[[TraceEvent], None]) -> None:
        self._watchers.append(fn)
        self._set_observed(True)

    def _observe(self, event: TraceEvent) -> None:
        if self._keep:
            self.events.append(event)
        for fn in self._watchers:
            fn(event)

    def emit(self, source: str, kind: str, fields: dict[str, object]) -> None:
        t = self._sched._now
        for value in fields.values():
            if type(value) not in _PLAIN_SET:
                _check(value)
        fields = dict(fields)  # a snapshot: the caller may reuse its dict
        pending = self._pending
        pending.append((t, source, kind, fields))
        if len(pending) >= self._limit:
            self._appended()

    def _appended(self) -> None:
        """An entry (of emit or a source tracer) made the pending list reach `_limit`:
        hash a full batch, then show the event to the observers."""
        pending = self._pending
        t, source, kind, fields = pending[-1]
        if len(pending) >= _BATCH:
            self._flush()
        if self._observed:
            self._observe(TraceEvent(t, source, kind, tuple(fields.items())))

    def _flush(self) -> None:
        pending = self._pending
        if pending:
            self._hash.update(encode_batch(pending))
            self._hashed += len(pending) + self._extra
            pending.clear()
            self._extra = 0

    def digest(self) -> str:
        self._flush()
        return self._hash.hexdigest()

    def tracer(self, source: str) -> "SourceTracer":
        return SourceTracer(self, source)


class SourceTracer:
    """A Tracer (device_model.ports / guest_driver.kernel protocol) bound to one source."""

    __slots__ = ("_trace", "source", "_pending", "_sched", "_limit", "__weakref__")

    def __init__(self, trace: Trace, source: str) -> None:
        self._trace = trace
        self.source = source
        self._pending = trace._pending
        self._sched = trace._sched
        self._limit = trace._limit   # the trace's, kept up to date by it
        trace._tracers.add(self)

    def emit(self, kind: str, **fields: object) -> None:
        # Trace.emit's checks and append, without its snapshot: the pending entry holds
        # the kwargs dict itself (fresh per call, never mutated): it pickles in order.
        for value in fields.values():
            if type(value) not in _PLAIN_SET:
                _check(value)
        pending = self._pending
        pending.append((self._sched._now, self.source, kind, fields))
        if len(pending) >= self._limit:
            self._trace._appended()

    def emit_plain(self, kind: str, fields: dict[str, object]) -> None:
        """emit(kind, **fields) for an emitter whose field values are plain by
        construction: values it made itself (a bool, an int it numbered), or whose
        exact type (int, str, bool) it has just tested; anything else must go through
        emit(), which checks every value. `fields` is kept: a fresh dict per call, in
        field order."""
        pending = self._pending
        pending.append((self._sched._now, self.source, kind, fields))
        if len(pending) >= self._limit:
            self._trace._appended()

    def emit_each(self, kind: str, names: tuple[str, ...], rows: list[tuple]) -> None:  # type: ignore[type-arg]
        """One event per row (fields `names` = the row's values), all at the current
        time, in order: the same events as emit() in a loop, for a fraction of the cost
        (device_model.ports.Tracer's optional batch form). Their canonical entry is
        one (t, source, kind, names, rows) for the whole call: every row is in it."""
        if not _PLAIN_SET.issuperset(map(type, chain.from_iterable(rows))):
            for row in rows:
                for value in row:
                    _check(value)
        tr = self._trace
        t = self._sched._now
        pending = self._pending
        pending.append((t, self.source, kind, names, tuple(rows)))
        tr._extra += len(rows) - 1
        if len(pending) + tr._extra >= _BATCH:
            tr._flush()
        if tr._observed:
            for row in rows:
                tr._observe(TraceEvent(t, self.source, kind, tuple(zip(names, row))))
