"""The transport-agnostic virtio device interface (rust-vmm `VirtioDevice` shape).

A transport (virtio-mmio today, virtio-pci later) owns registers, status and interrupts;
the device owns its queues' meaning. They meet here: the transport asks for identity,
features, queue sizes and config bytes, and at DRIVER_OK hands the device its rings
(built by `ring_factory.make_device_ring`) and a `VirtioInterrupt` to signal through.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Protocol, Sequence

from .ring import DeviceRing


class VirtioInterrupt(Protocol):
    """What a device may ask of its transport once activated."""

    def signal_used(self, queue_index: int) -> None:
        """The device returned buffers on `queue_index` and wants the driver told."""
        ...

    def signal_config_change(self) -> None:
        """The device configuration (or status, e.g. NEEDS_RESET) changed."""
        ...

    def needs_reset(self, rule: str, message: str) -> None:
        """The driver broke a ring rule: set DEVICE_NEEDS_RESET and raise a
        configuration-change interrupt. The device has already stopped its queues."""
        ...


class VirtioDevice(ABC):
    """Device half of a virtio function, ignorant of the transport."""

    @property
    @abstractmethod
    def device_id(self) -> int: ...

    @property
    @abstractmethod
    def vendor_id(self) -> int:
        """Transport-visible vendor (virtio-mmio VendorID)."""

    @abstractmethod
    def avail_features(self) -> int:
        """Feature bits offered (64-bit)."""

    @abstractmethod
    def ack_features(self, features: int) -> None:
        """Called at a successful FEATURES_OK with the accepted subset."""

    @abstractmethod
    def queue_max_sizes(self) -> Sequence[int]:
        """Maximum size of each queue, by queue index."""

    @abstractmethod
    def read_config(self, offset: int, length: int) -> bytes:
        """Bytes of device configuration; reads past the end give zeros."""

    @property
    @abstractmethod
    def config_generation(self) -> int: ...

    @abstractmethod
    def activate(self, queues: Sequence[DeviceRing], interrupt: VirtioInterrupt) -> None:
        """DRIVER_OK: start serving `queues` (all of them, ready or not), each the
        device side of a ring of the negotiated layout."""

    @abstractmethod
    def notify(self, queue_index: int) -> None:
        """The driver made buffers available on a ready queue. Never raises."""

    def notify_data(self, queue_index: int, next_off: int, next_wrap: int) -> None:
        """A notification with VIRTIO_F_NOTIFICATION_DATA: where the driver's next
        available entry goes (split: the avail index's low 15 bits and bit 15; packed:
        the descriptor offset and the wrap counter). Never raises. A device that does
        not check the data treats it as a plain notification."""
        self.notify(queue_index)

    def reset_queue(self, queue_index: int) -> bool:
        """VIRTIO_F_RING_RESET after DRIVER_OK: stop using queue `queue_index` and forget
        its state; its buffers in flight are never given back. False when the device
        refuses (it has set DEVICE_NEEDS_RESET, naming the rule broken). Never raises."""
        return False

    def enable_queue(self, queue_index: int, ring: DeviceRing) -> None:
        """A queue reset by `reset_queue` was enabled again: serve `ring` on it."""
        return None

    @abstractmethod
    def reset(self) -> None:
        """Forget all driver state; after return no DMA is issued (spec §8)."""

    def set_bus_master(self, enabled: bool) -> None:
        """PCI Command.Bus Master of the function changed (a transport without one, like
        virtio-mmio, never calls this: the device may always master the bus). While it
        is off the device must issue no memory request, hence no DMA and no MSI."""
        return None
