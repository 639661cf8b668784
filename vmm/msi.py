"""Message-signalled interrupts: the one place an MSI message is delivered.

An MSI is a DWORD write of `data` to `address` in the interrupt window (x86:
0xFEE00000, `hwspec.pci.MSI_ADDRESS_BASE`); the data names a vector. `MsiDomain` is
what receives such writes. It owns the vectors (`first`..`last`, the lowest free one
is allocated) and, for every message:

1. decodes it: the address must be in the window, the data must fit the vector field
   (when the domain has one), the vector must be allocated, and a vector allocated for
   one requester ID accepts messages from that requester only (interrupt remapping:
   a function whose MSI-X table was reprogrammed cannot raise another's interrupts);
2. a refused message is logged (`unknown`, an `UnknownMsi` with the reason) and
   traced, never raised: it comes from a device someone programmed, possibly wrongly;
3. an accepted one is counted (`delivered`), traced, and handed to its vector
   (`MsiTarget.fire`).

Two users, which differ only in what a vector does with an accepted message:

- a VM's interrupt controller (`vmm.irq.InterruptController`, vectors `MsiVector`):
  the vector is pended and its handler runs in guest context at the guest's next wait;
- the host (`HostMsiDomain` below, vectors `HostMsiVector`): the vector's callback runs
  synchronously, inside the device event that sent the message (the vfio-pci driver's
  callbacks signal eventfds; the host kernel's pend a handler for its waiting task).

Devices send through a `RequesterMsiPort` (device_model.ports.MsiPort), which stamps the
sender's requester ID on every message, as an MSI write on PCIe carries it.
"""
from __future__ import annotations

import errno
from dataclasses import dataclass, field
from typing import Callable, ClassVar, Generic, Protocol, TypeVar

from device_model.ports import Tracer
from guest_driver.kernel import MsiMessage
from hwspec.pci import MSI_ADDRESS_BASE, MSI_ADDRESS_SIZE

from .iommu import format_bdf

HOST_MSI_FIRST = 0x30
HOST_MSI_LAST = 0xEF
# With interrupt remapping the message data is a handle into the remapping table, not
# a CPU vector: a host with many VFs (64 VFs x 5 MSI-X vectors) needs more than one
# CPU's 192 vectors. Host() uses this much larger space.
HOST_MSI_REMAPPED_LAST = 0x30 + 0x4000


@dataclass(frozen=True)
class UnknownMsi:
    """A message a domain refused: no such vector, outside the window, or blocked."""
    address: int
    data: int
    reason: str


class MsiTarget(Protocol):
    """One allocated vector as the domain sees it."""

    @property
    def requester_id(self) -> int | None:
        """The only requester whose messages it accepts (None: any)."""
        ...

    @property
    def trace_fields(self) -> dict[str, object]:
        """Fields after `vector` in the domain's accepted-message trace event."""
        ...

    def fire(self) -> None:
        """An accepted message for this vector (inside the sender's event)."""
        ...


T = TypeVar("T", bound=MsiTarget)


class MsiDomain(Generic[T]):
    """Vectors `first`..`last` and the delivery of messages to them (module docstring).

    Subclasses name their trace events (`refused_kind`, `accepted_kind`) and may bound
    the data to a vector field (`vector_mask`)."""

    refused_kind: ClassVar[str]
    accepted_kind: ClassVar[str]
    vector_mask: ClassVar[int | None] = None

    def __init__(self, tracer: Tracer, name: str, first: int, last: int) -> None:
        self.tracer = tracer
        self.name = name
        self.first, self.last = first, last
        self._vectors: dict[int, T] = {}
        self.unknown: list[UnknownMsi] = []
        self.delivered = 0

    # -- vectors ------------------------------------------------------------------------

    def add_vector(self, make: Callable[[int], T]) -> int:
        """Allocate the lowest free vector as `make(vector)` and return its number;
        OSError(ENOSPC) when all are taken."""
        for v in range(self.first, self.last + 1):
            if v not in self._vectors:
                self._vectors[v] = make(v)
                return v
        raise OSError(errno.ENOSPC, f"{self.name}: all MSI vectors "
                                    f"{self.first}..{self.last} are allocated")

    def remove_vector(self, vector: int) -> T | None:
        """Free `vector`; what it was (None: it was not allocated)."""
        return self._vectors.pop(vector, None)

    def vector(self, vector: int) -> T | None:
        return self._vectors.get(vector)

    def allocated(self) -> int:
        return len(self._vectors)

    # -- messages -----------------------------------------------------------------------

    def port(self, requester_id: int | None) -> "RequesterMsiPort":
        """Where a device with `requester_id` (None: one with no ID) sends its messages."""
        return RequesterMsiPort(self, requester_id)

    def decode(self, requester_id: int | None, address: int, data: int) -> tuple[T | None, str]:
        """The vector a message from `requester_id` raises, or None and why not."""
        if not MSI_ADDRESS_BASE <= address < MSI_ADDRESS_BASE + MSI_ADDRESS_SIZE:
            return None, f"address {address:#x} is outside the MSI window"
        if self.vector_mask is not None and data & ~self.vector_mask:
            return None, f"data {data:#x} has bits above the vector"
        target = self._vectors.get(data)
        if target is None:
            return None, self.no_vector_reason(data)
        owner = target.requester_id
        if owner is not None and owner != requester_id:
            who = "no requester" if requester_id is None else format_bdf(requester_id)
            return None, f"vector {data} belongs to {format_bdf(owner)}, not {who} (remapping)"
        return target, ""

    def deliver(self, requester_id: int | None, address: int, data: int) -> None:
        """A DWORD write of `data` to `address` from `requester_id` reached the window."""
        target, reason = self.decode(requester_id, address, data)
        if target is None:
            self.unknown.append(UnknownMsi(address, data, reason))
            self.tracer.emit(self.refused_kind, address=address, data=data, reason=reason,
                             **self.refused_fields(requester_id))
            return
        self.delivered += 1
        self.tracer.emit(self.accepted_kind, vector=data, **target.trace_fields)
        target.fire()

    def no_vector_reason(self, data: int) -> str:
        return f"vector {data} is not allocated"

    def refused_fields(self, requester_id: int | None) -> dict[str, object]:
        """Fields after `reason` in the refused-message trace event."""
        return {}


class MsiReceiver(Protocol):
    def deliver(self, requester_id: int | None, address: int, data: int) -> None: ...


class MsiFaultHook(Protocol):
    """What a fault plan (vmm.faults) plugs into a sender's port: it takes every
    message and decides whether, when and how often `port.pass_on` delivers it."""

    def msi(self, port: "RequesterMsiPort", address: int, data: int) -> None: ...


class RequesterMsiPort:
    """device_model.ports.MsiPort of one sender: its messages carry its requester ID."""

    __slots__ = ("domain", "requester_id", "fault_hook")

    def __init__(self, domain: MsiReceiver, requester_id: int | None) -> None:
        self.domain = domain
        self.requester_id = requester_id
        self.fault_hook: MsiFaultHook | None = None   # None unless a fault plan is installed

    def send(self, address: int, data: int) -> None:
        if self.fault_hook is not None:
            self.fault_hook.msi(self, address, data)
            return
        self.domain.deliver(self.requester_id, address, data)

    def pass_on(self, address: int, data: int) -> None:
        """Deliver a message past the fault hook (the hook's own sends)."""
        self.domain.deliver(self.requester_id, address, data)


# -- the host's domain ----------------------------------------------------------------------


@dataclass
class HostMsiVector:
    """A host vector: a callback run synchronously when a message is accepted."""
    callback: Callable[[], None]
    name: str
    requester_id: int | None = None
    trace_fields: dict[str, object] = field(init=False)

    def __post_init__(self) -> None:
        self.trace_fields = {"name": self.name}

    def fire(self) -> None:
        self.callback()


class HostMsiDomain(MsiDomain[HostMsiVector]):
    """Host interrupt vectors -> callbacks, with interrupt remapping.

    Each function sends through its own port (`port(requester_id)`), so every message
    carries its requester ID. A vector allocated for one requester only fires for
    messages from that requester: anything else is blocked and logged (an
    interrupt-remapping fault). A message runs its vector's callback synchronously,
    inside the device event that sent it."""

    refused_kind = "host_msi_blocked"
    accepted_kind = "host_msi"

    def __init__(self, tracer: Tracer, first: int = HOST_MSI_FIRST, last: int = HOST_MSI_LAST,
                 name: str = "host MSI domain") -> None:
        super().__init__(tracer, name, first, last)

    def alloc(self, callback: Callable[[], None], name: str,
              requester_id: int | None = None) -> MsiMessage:
        """A free vector for `callback`, accepted only from `requester_id` when given."""
        v = self.add_vector(lambda _: HostMsiVector(callback, name, requester_id))
        return MsiMessage(MSI_ADDRESS_BASE, v)

    def free(self, msg: MsiMessage) -> None:
        self.remove_vector(msg.data)

    def send(self, address: int, data: int) -> None:
        """A message with no requester ID (host-internal); only unowned vectors fire."""
        self.deliver(None, address, data)

    def no_vector_reason(self, data: int) -> str:
        return "no such host vector"

    def refused_fields(self, requester_id: int | None) -> dict[str, object]:
        return {"requester": "" if requester_id is None else format_bdf(requester_id)}
