"""What a virtio device driver needs from a transport (virtio 1.x §3, §4.1, §4.2).

The VA-1 driver is written against `VirtioTransport` only, so the same bring-up,
fences, recovery and device file run over virtio-mmio and virtio-pci. Interrupt wiring
is the transport's business: it calls the driver's `InterruptHandler` with what may
have happened (a configuration change, used buffers on some queues).
"""
from __future__ import annotations

from typing import Callable, Optional, Protocol, Sequence

from hwspec import virtio as V
from hwspec.layout import Layout

from ..errors import GuestDriverError

# handler(config_changed, queues): queues None = any queue may have used buffers.
InterruptHandler = Callable[[bool, Optional[Sequence[int]]], None]


class TransportError(GuestDriverError, RuntimeError):
    """The device is not usable through this transport (named reason in the message)."""


class ProbeError(TransportError):
    """Not a (supported) virtio device here, or its description is malformed."""


class FeaturesRefused(TransportError):
    """The device left FEATURES_OK clear after the driver wrote it."""


class VirtioTransport(Protocol):
    """One virtio function as the driver sees it, whatever the bus."""

    @property
    def name(self) -> str:
        """For messages: "virtio-mmio@0x10000000", "virtio-pci 0000:00:03.0"."""
        ...

    def probe(self) -> int:
        """Identify the function; return its virtio device id (0 = no device)."""
        ...

    def read_status(self) -> int: ...

    def reset(self) -> None:
        """Write 0 to the status and read back until 0. Must not wait (IRQ context)."""
        ...

    def add_status(self, bits: int) -> None: ...

    def fail(self) -> None: ...

    def negotiate(self, wanted: int, required: int = ...) -> int:
        """Accept wanted & offered, set FEATURES_OK, check it stuck; return accepted."""
        ...

    def read_config(self, layout: Layout) -> dict[str, int]:
        """Read the device config consistently (generation before == after)."""
        ...

    def config_generation(self) -> int: ...

    def queue_num_max(self, index: int) -> int: ...

    def setup_interrupts(self, queues: Sequence[int], handler: InterruptHandler,
                         name: str) -> None:
        """Wire interrupts for these queues and config changes; called at every
        (re)initialisation after FEATURES_OK and before any setup_queue. Resources are
        taken on the first call and kept; the device-side routing is redone each time
        (a reset forgets it)."""
        ...

    def setup_queue(self, index: int, num: int, desc: int, driver: int, device: int) -> None:
        """Program and enable one queue; before DRIVER_OK."""
        ...

    def notify(self, index: int, data: int | None = None) -> None:
        """Notify queue `index`; `data` (NOTIFICATION_DATA): the ring's 16 bits that
        follow the queue index (virtio 1.x §2.9)."""
        ...

    def reset_queue(self, index: int) -> None:
        """VIRTIO_F_RING_RESET: reset queue `index` alone and wait (bounded, without
        sleeping) until the device reports it done. Raises TransportError."""
        ...

    def reenable_queue(self, index: int, num: int, desc: int, driver: int,
                       device: int) -> None:
        """After reset_queue, at DRIVER_OK: route its interrupt again, program it and
        enable it (virtio 1.x §2.6.1.2)."""
        ...

    def free_interrupts(self) -> None:
        """Give back what setup_interrupts took (idempotent)."""
        ...

    def poll_interrupt(self) -> bool:
        """What the interrupt handler does before calling the driver, for a driver that
        polls because an interrupt was lost: virtio-mmio reads and ACKs InterruptStatus
        (so the device drops its line and the next used buffer raises it again),
        virtio-pci in shared-vector mode reads the ISR. Returns whether a configuration
        change was pending. Interrupt context."""
        ...

    def restore_after_reset(self) -> None:
        """After a reset the driver did not start: set up again what the reset cleared
        outside the virtio registers (PCI: COMMAND and MSI-X: disable, table, enable),
        before setup_interrupts routes the queues. Interrupt context."""
        ...

    def interrupts_broken(self) -> str | None:
        """Why the function can no longer interrupt the driver (e.g. MSI-X disabled by a
        reset the driver did not start), or None. Interrupt context."""
        ...


class FeatureWindow(Protocol):
    """The primitives feature negotiation is built from (both transports have them)."""

    @property
    def name(self) -> str: ...

    def device_features(self) -> int: ...

    def write_driver_features(self, features: int) -> None: ...

    def add_status(self, bits: int) -> None: ...

    def read_status(self) -> int: ...


def negotiate(t: FeatureWindow, wanted: int, required: int) -> int:
    """virtio 1.x §3.1.1 steps 4-6: accept, FEATURES_OK, read back."""
    offered = t.device_features()
    missing = required & ~offered
    if missing:
        raise FeaturesRefused(f"{t.name}: device does not offer required "
                              f"features {bits_str(missing)} (offered {offered:#x})")
    accepted = offered & wanted
    t.write_driver_features(accepted)
    t.add_status(V.STATUS_FEATURES_OK)
    status = t.read_status()
    if not status & V.STATUS_FEATURES_OK:
        raise FeaturesRefused(f"{t.name}: device refused features "
                              f"{accepted:#x} ({bits_str(accepted)}): FEATURES_OK stayed clear "
                              f"(status {status:#x})")
    return accepted


RESET_QUEUE_POLL_LIMIT = 1000  # reads of the queue reset register before giving up


def notify_value(index: int, data: int | None) -> int:
    """The value a notification writes: the queue index, or with NOTIFICATION_DATA the
    le32 {vqn: 16, next_off: 15, next_wrap: 1}."""
    return index if data is None else index | (data & 0xFFFF) << V.NOTIFY_DATA_OFF_SHIFT


def bits_str(mask: int) -> str:
    return "{" + ",".join(str(b) for b in range(64) if mask >> b & 1) + "}"


def check_queue_size(name: str, index: int, num: int, num_max: int) -> None:
    if num_max == 0:
        raise TransportError(f"{name}: queue {index} does not exist")
    if num > num_max or num <= 0 or num & (num - 1):
        raise TransportError(f"{name}: queue {index} size {num} "
                             f"invalid (max {num_max}, power of two)")
