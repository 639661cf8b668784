"""The guest kernel services a driver is given by the machine it runs in.

Declared here (typing.Protocol) and implemented by the VMM. A driver reaches its device
only through these: guest physical memory, MMIO accessors, interrupt lines, and waits.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Protocol

import numpy as np


class PhysMemory(Protocol):
    """Guest physical memory. Out-of-range accesses raise ValueError naming the range."""

    def read(self, gpa: int, length: int) -> bytes: ...

    def write(self, gpa: int, data: bytes | bytearray | memoryview | np.ndarray) -> None: ...

    def view(self, gpa: int, length: int) -> np.ndarray:
        """Writable zero-copy uint8 view."""
        ...


class MmioAccessor(Protocol):
    """Loads and stores to guest physical MMIO space (1, 2, 4 or 8 bytes, little-endian)."""

    def read(self, addr: int, size: int) -> int: ...

    def write(self, addr: int, size: int, value: int) -> None: ...


@dataclass(frozen=True)
class MsiMessage:
    """What a device must write to raise one MSI/MSI-X interrupt (x86: address in the
    0xFEE00000 window, data carries the vector)."""
    address: int
    data: int


class IrqChip(Protocol):
    def request_irq(self, line: int, handler: Callable[[], None], name: str) -> None:
        """Handlers run in interrupt context: they must not wait."""
        ...

    def free_irq(self, line: int) -> None: ...

    def alloc_msi(self, handler: Callable[[], None], name: str) -> MsiMessage:
        """A new message-signalled interrupt; the handler runs in interrupt context.
        Raises OSError(ENOSPC) when the vectors are exhausted."""
        ...

    def free_msi(self, msg: MsiMessage) -> None: ...


class KernelTimer(Protocol):
    """A one-shot timer (Linux's hrtimer): cancel() before it fires makes it a no-op."""

    def cancel(self) -> None: ...


_GUEST_STATE_ATTR = "_reads_guest_state_only"


class _GuestStateCond:
    """A callable that cannot carry the mark itself (a bound method), wrapped."""

    __slots__ = ("fn", _GUEST_STATE_ATTR)

    def __init__(self, fn: Callable[[], bool]) -> None:
        self.fn = fn
        setattr(self, _GUEST_STATE_ATTR, True)

    def __call__(self) -> bool:
        return self.fn()


def guest_state(cond: Callable[[], bool]) -> Callable[[], bool]:
    """Mark a wait condition as reading only state this guest kernel's own code changes:
    its tasks, interrupt handlers and timers (a fence signalled by the interrupt path, a
    request completed by it). Not device registers, not memory a device writes (a used
    ring polled in the condition), not virtual time. Like Linux's wait_event after a
    wake_up, the machine may then re-check it only after such code ran instead of at
    every step, which keeps a machine of many guests cheap. Unmarked conditions are
    checked at every step. Returns `cond` (marked)."""
    try:
        setattr(cond, _GUEST_STATE_ATTR, True)
        return cond
    except AttributeError:
        return _GuestStateCond(cond)


class GuestStateCondition:
    """Base of objects that are their own wait condition (`__call__`) and read only
    guest-kernel state, as `guest_state` means it: every instance is marked by its class,
    so a wait on one needs neither a closure nor a `guest_state` call."""

    __slots__ = ()

    def __call__(self) -> bool:
        raise NotImplementedError


setattr(GuestStateCondition, _GUEST_STATE_ATTR, True)


def reads_guest_state_only(cond: Callable[[], bool]) -> bool:
    """Whether `cond` was marked by guest_state."""
    return getattr(cond, _GUEST_STATE_ATTR, False) is True


class GuestScheduler(Protocol):
    def now_ns(self) -> int: ...

    def start_timer(self, delay_ns: int, fn: Callable[[], None], what: str) -> KernelTimer:
        """Run fn once, `delay_ns` of virtual time from now, in interrupt context (it
        must not wait), as an interrupt handler runs. A timer that fires does nothing
        anybody else can observe until fn does something. Optional at run time: a
        kernel without it (a test fake) gets drivers that run no timers."""
        ...

    def wait_until(self, cond: Callable[[], bool], timeout_ns: int | None, what: str) -> bool:
        """Block the calling guest task until cond() holds (True) or the virtual
        timeout passes (False). The only place, with sleep, a guest task gives up the CPU."""
        ...

    def sleep(self, ns: int) -> None: ...


class Tracer(Protocol):
    def emit(self, kind: str, **fields: object) -> None: ...

    # Optional (looked up with getattr, by `plain_emitter`; the VMM's tracer has it):
    # def emit_plain(self, kind: str, fields: dict[str, object]) -> None:
    #     emit(kind, **fields) for values whose exact type (int, str, bool) the emitter
    #     fixed or has just tested: no per-value check. `fields` is kept (a fresh dict).


PlainEmit = Callable[[str, dict[str, object]], None]
_PLAIN_TYPES = (int, str, bool)


def plain_emitter(tracer: Tracer, *fixed: object) -> PlainEmit:
    """`emit_plain(kind, fields)` of `tracer` for an emitter that builds its events from
    `fixed` (values it holds for its lifetime, e.g. its device name) and from values of
    an exact plain type it made or tested. A tracer without `emit_plain`, or a fixed
    value of another type, gets `emit` (which checks every value)."""
    plain: PlainEmit | None = getattr(tracer, "emit_plain", None)
    if plain is not None and all(type(v) in _PLAIN_TYPES for v in fixed):
        return plain

    def emit(kind: str, fields: dict[str, object]) -> None:
        tracer.emit(kind, **fields)
    return emit


@dataclass(frozen=True)
class PlatformDevice:
    """A device the firmware describes (device tree / kernel command line), e.g. virtio-mmio."""
    compatible: str  # "virtio,mmio"
    base: int
    size: int
    irq: int


@dataclass(frozen=True)
class RamRange:
    """Guest RAM the kernel may allocate from (DMA-coherent, identity-mapped)."""
    base: int
    size: int


@dataclass(frozen=True)
class PciHostBridge:
    """A PCI segment the firmware describes (ACPI MCFG): ECAM config window, bus range,
    and the memory window the firmware assigned BARs from."""
    ecam_base: int
    bus_start: int
    bus_end: int
    mem_base: int
    mem_size: int


class GuestKernel(Protocol):
    """Everything a driver is handed. The driver only reads these, so they are read-only
    properties: a VMM may provide each as a plain attribute or as a property."""

    @property
    def memory(self) -> PhysMemory: ...

    @property
    def mmio(self) -> MmioAccessor: ...

    @property
    def irq(self) -> IrqChip: ...

    @property
    def sched(self) -> GuestScheduler: ...

    @property
    def trace(self) -> Tracer: ...

    @property
    def ram(self) -> RamRange: ...

    @property
    def platform_devices(self) -> tuple[PlatformDevice, ...]: ...

    @property
    def pci_hosts(self) -> tuple[PciHostBridge, ...]: ...

    @property
    def cmdline(self) -> str:
        """The kernel command line: drivers read their parameters from it (params.py)."""
        ...
