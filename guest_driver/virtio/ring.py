"""What a virtio driver needs of one virtqueue's driver side, whatever its layout
(virtio 1.x §2.7 split, §2.8 packed): requests in, used entries out, the three guest
addresses for the transport.

Drivers (the VA-1 driver, the admin queue) program against `DriverRing` and get their
rings from `ring_factory.make_driver_ring`; only the layout modules know where
descriptors and indices live. Written independently of the device side.
"""
from __future__ import annotations

from typing import Protocol, Sequence, TypeVar

from ..errors import GuestDriverError

T = TypeVar("T")

Segment = tuple[int, int]  # (IOVA, length)


class QueueFull(GuestDriverError):
    """Not enough free descriptors for this request right now (wait and retry)."""


class RingError(GuestDriverError, RuntimeError):
    """The device broke the ring protocol; the queue is unusable until reset."""


class DriverRing(Protocol[T]):
    """The driver side of one virtqueue; `T` is the caller's token per request."""

    index: int
    num: int
    features: int          # the ring features it was built for (ring_factory.ring_features)
    broken: str | None     # why the device broke the ring, or None
    # A layout whose device publishes a used index (split): the ring memory holding it
    # and its offset there; that u16 differs from `last_used` exactly when an unbroken
    # ring `has_used()`, so an interrupt handler looks at every ring without a call per
    # ring. None (packed: used entries are marked in the descriptors): ask `has_used()`;
    # `used_off` and `last_used` then mean nothing.
    used_view: memoryview | None
    used_off: int
    last_used: int

    @property
    def desc_addr(self) -> int: ...

    @property
    def driver_addr(self) -> int: ...

    @property
    def device_addr(self) -> int: ...

    @property
    def num_free(self) -> int:
        """Descriptors free now."""
        ...

    def reset(self) -> None:
        """Empty ring (after a device reset; tokens must have been drained)."""
        ...

    def release(self) -> None:
        """Give the ring memory back."""
        ...

    def descs_needed(self, nsegs: int) -> int:
        """Descriptors a request of `nsegs` segments takes."""
        ...

    def add(self, readable: Sequence[Segment], writable: Sequence[Segment], token: T) -> int:
        """Make one request available (not yet notified); its head id. Raises
        QueueFull, RingError (broken) or ValueError (a request that can never fit)."""
        ...

    def add_pair(self, raddr: int, rlen: int, waddr: int, wlen: int, token: T) -> bool:
        """`add` of the usual request, one readable and one writable segment, without
        the sequences (a layout may write it in one go), then `kick_prepare()`: whether
        the device must be notified. Raises as `add` does."""
        ...

    def kick_prepare(self) -> bool:
        """Whether the device must be notified of what was added since the last call."""
        ...

    def notification_data(self) -> int | None:
        """With NOTIFICATION_DATA, the 16 bits a notification carries after the queue
        index (where the next request goes); None without it."""
        ...

    def has_used(self) -> bool: ...

    def get_used(self) -> list[tuple[T, int]]:
        """Every used entry the device published, checked; a bad one sets `broken`."""
        ...

    def enable_interrupts(self) -> bool:
        """Ask for an interrupt at the next used entry; True if entries are pending."""
        ...

    def disable_interrupts(self) -> None:
        """Ask for no interrupt for used entries (the driver polls) until the next
        enable_interrupts."""
        ...

    def drain(self) -> list[T]:
        """Take back every request in flight (device reset)."""
        ...
