"""What the device model needs from the platform it is plugged into.

The VMM implements these; the device never sees a VM, a guest or a driver. Device DMA
goes through `DmaPort` (which applies the IOMMU where there is one), time through
`Clock`, interrupts through `IrqLine`, observations through `Tracer`.
"""
from __future__ import annotations

from typing import Callable, Protocol

import numpy as np

from .errors import DeviceModelError


class DmaFault(DeviceModelError):
    """A device DMA to an address that is not backed or not mapped. Nothing was touched."""

    def __init__(self, iova: int, length: int, write: bool, reason: str) -> None:
        self.iova = iova
        self.length = length
        self.write = write
        self.reason = reason
        kind = "write" if write else "read"
        super().__init__(f"DMA {kind} of {length} bytes at IOVA {iova:#x}: {reason}")


class DmaPort(Protocol):
    def read(self, iova: int, length: int) -> bytes:
        """Copy `length` bytes out of host memory; raises DmaFault."""
        ...

    def write(self, iova: int, data: bytes | bytearray | memoryview | np.ndarray) -> None:
        """Copy bytes into host memory; raises DmaFault (and then writes nothing)."""
        ...

    def view(self, iova: int, length: int) -> np.ndarray:
        """A writable zero-copy uint8 view of host memory; raises DmaFault."""
        ...

    # Optional (looked up with getattr; the VMM's emulated-attachment port has them):
    # view_epoch: int
    #     Changes whenever views handed out by ring_view may no longer be used.
    # def ring_view(self, iova: int, length: int) -> memoryview | None:
    #     A byte view of [iova, iova+length) that ring fields and buffers may be read
    #     and written through, in place of read/write, while view_epoch is unchanged;
    #     None when the port wants every access (a range not all backed, or not readable
    #     and writable, a fault plan watching). While a view is valid, read, write,
    #     view and probe_view of any part of its range pass every check.
    # def probe_view(self, iova: int, length: int) -> None:
    #     Raises the DmaFault view() would, without making the view.


class Timer(Protocol):
    def cancel(self) -> None: ...


class Clock(Protocol):
    def now_ns(self) -> int: ...

    def schedule(self, delay_ns: int, callback: Callable[[], None], label: str) -> Timer:
        """Run `callback` after `delay_ns` of virtual time (>= 0)."""
        ...

    def next_event_ns(self) -> int | None:
        """Virtual time of the earliest pending event, if any: work that ends no later
        than this can be carried out at once without anyone being able to tell."""
        ...

    # Optional (looked up with getattr; the VMM's scheduler has it):
    # def horizon_ns(self) -> int | None:
    #     The earliest time anybody else can observe anything (next event, a running
    #     guest's resume, waiting guests' deadlines); None: unbounded. A clock without
    #     it is treated as next_event_ns(), with None meaning "stop here".


class IrqLine(Protocol):
    def set_level(self, level: bool) -> None:
        """Level-triggered line: the interrupt controller delivers while it is high."""
        ...


class Tracer(Protocol):
    def emit(self, kind: str, **fields: object) -> None: ...

    # Optional (looked up with getattr; the VMM's tracer has it):
    # def emit_each(self, kind: str, names: tuple[str, ...], rows: list[tuple]) -> None:
    #     One event per row, all at the current time, in order; the same events as
    #     emit(kind, **dict(zip(names, row))) for each row.
    # def emit_plain(self, kind: str, fields: dict[str, object]) -> None:
    #     emit(kind, **fields) for values that are plain by construction (ints the
    #     device numbered or unpacked, strs from its own tables) or whose exact type
    #     (int, str, bool) the caller has just tested; `fields` is a fresh dict per
    #     call, in field order, and is kept. Reach it through `plain_emitter`.


def plain_emitter(tracer: Tracer) -> Callable[[str, dict[str, object]], None]:
    """The tracer's emit_plain when it has one, else its emit taking the same dict."""
    plain = getattr(tracer, "emit_plain", None)
    if plain is not None:
        return plain  # type: ignore[no-any-return]
    emit = tracer.emit

    def emit_fields(kind: str, fields: dict[str, object]) -> None:
        emit(kind, **fields)
    return emit_fields


class NullTracer:
    def emit(self, kind: str, **fields: object) -> None:
        return None

    def emit_plain(self, kind: str, fields: dict[str, object]) -> None:
        return None


class DevicePorts:
    """The platform side of one device function, bundled for construction."""

    def __init__(self, dma: DmaPort, clock: Clock, tracer: Tracer | None = None) -> None:
        self.dma = dma
        self.clock = clock
        self.tracer: Tracer = tracer if tracer is not None else NullTracer()


class MsiPort(Protocol):
    """Where a PCI function's MSI/MSI-X messages go: a DWORD write of `data` to
    `address`. The platform routes it (to a VM's interrupt controller, or to the host's,
    which signals a VFIO eventfd)."""

    def send(self, address: int, data: int) -> None: ...
