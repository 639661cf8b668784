"""A tiny fake platform for device tests: guest memory DMA, a virtual clock, an IRQ line,
a recording tracer. Written for the tests only; the VMM has its own."""
from __future__ import annotations

import heapq
from typing import Callable

import numpy as np

from device_model.ports import DmaFault


class FakeDma:
    """Guest RAM [base, base+size) as a numpy array; anything else faults."""

    def __init__(self, base: int = 0x4000_0000, size: int = 8 << 20) -> None:
        self.base = base
        self.size = size
        self.mem = np.zeros(size, dtype=np.uint8)
        self.log: list[tuple[str, int, int]] = []   # every device access
        self.holes: list[tuple[int, int]] = []       # unmapped ranges inside RAM
        # Set to an int to offer ports.DmaPort's optional ring views (None: no views).
        self.view_epoch: int | None = None

    def _off(self, iova: int, length: int, write: bool) -> int:
        off = iova - self.base
        if length < 0 or off < 0 or off + length > self.size:
            raise DmaFault(iova, length, write, "outside guest RAM")
        for lo, hi in self.holes:
            if iova < hi and iova + length > lo and length > 0:
                raise DmaFault(iova, length, write, "unmapped")
        return off

    def read(self, iova: int, length: int) -> bytes:
        self.log.append(("read", iova, length))  # attempts count as DMA too
        off = self._off(iova, length, False)
        return self.mem[off:off + length].tobytes()

    def write(self, iova: int, data: object) -> None:
        if isinstance(data, np.ndarray):
            buf = np.ascontiguousarray(data).reshape(-1).view(np.uint8)
        else:
            buf = np.frombuffer(bytes(data), dtype=np.uint8)  # type: ignore[call-overload]
        self.log.append(("write", iova, len(buf)))
        off = self._off(iova, len(buf), True)
        self.mem[off:off + len(buf)] = buf

    def ring_view(self, iova: int, length: int) -> memoryview | None:
        try:
            off = self._off(iova, length, False)
        except DmaFault:
            return None
        return memoryview(self.mem)[off:off + length]

    def probe_view(self, iova: int, length: int) -> None:
        self._off(iova, length, False)

    def view(self, iova: int, length: int) -> np.ndarray:
        self.log.append(("view", iova, length))
        off = self._off(iova, length, False)
        return self.mem[off:off + length]

    # guest (driver) side accessors: not logged
    def g_read(self, gpa: int, length: int) -> bytes:
        off = gpa - self.base
        return self.mem[off:off + length].tobytes()

    def g_write(self, gpa: int, data: bytes) -> None:
        off = gpa - self.base
        self.mem[off:off + len(data)] = np.frombuffer(data, dtype=np.uint8)


class FakeTimer:
    def __init__(self) -> None:
        self.cancelled = False

    def cancel(self) -> None:
        self.cancelled = True


class FakeClock:
    """Events ordered by (time, sequence)."""

    def __init__(self) -> None:
        self.now = 0
        self.seq = 0
        self.heap: list[tuple[int, int, Callable[[], None], FakeTimer, str]] = []

    def now_ns(self) -> int:
        return self.now

    def schedule(self, delay_ns: int, callback: Callable[[], None], label: str) -> FakeTimer:
        assert delay_ns >= 0
        t = FakeTimer()
        heapq.heappush(self.heap, (self.now + delay_ns, self.seq, callback, t, label))
        self.seq += 1
        return t

    def _prune(self) -> None:
        while self.heap and self.heap[0][3].cancelled:
            heapq.heappop(self.heap)

    def next_event_ns(self) -> int | None:
        self._prune()
        return self.heap[0][0] if self.heap else None

    def pending(self) -> int:
        self._prune()
        return sum(1 for e in self.heap if not e[3].cancelled)

    def step(self) -> bool:
        self._prune()
        if not self.heap:
            return False
        when, _, cb, _, _ = heapq.heappop(self.heap)
        self.now = max(self.now, when)
        cb()
        return True

    def run(self, until: int | None = None, max_events: int = 1_000_000) -> None:
        for _ in range(max_events):
            self._prune()
            if not self.heap or (until is not None and self.heap[0][0] > until):
                break
            self.step()
        if until is not None:
            self.now = max(self.now, until)

    def advance(self, ns: int) -> None:
        self.run(until=self.now + ns)


class FakeIrq:
    def __init__(self) -> None:
        self.level = False
        self.history: list[bool] = []

    def set_level(self, level: bool) -> None:
        self.level = level
        self.history.append(level)


class RecordingTracer:
    def __init__(self) -> None:
        self.events: list[tuple[str, dict[str, object]]] = []

    def emit(self, kind: str, **fields: object) -> None:
        for v in fields.values():
            assert isinstance(v, (int, str)), (kind, fields)
        self.events.append((kind, dict(fields)))

    def kinds(self, kind: str) -> list[dict[str, object]]:
        return [f for k, f in self.events if k == kind]
