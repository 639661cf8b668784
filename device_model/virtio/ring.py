"""What every device-side virtqueue hands the device, whatever its layout (virtio 1.x
§2.7 split, §2.8 packed): checked descriptor chains in, used buffers out.

A device (VA-1's `Va1Device`) programs against `DeviceRing` and never sees where the
descriptors, the driver area or the device area are or how they are laid out; the
layouts live in their own modules and `ring_factory.make_device_ring` picks one from
the negotiated features.
"""
from __future__ import annotations

from typing import NamedTuple, Protocol

from ..errors import DeviceModelError
from ..ports import DmaFault, DmaPort

_U64 = 1 << 64


class RingError(DeviceModelError):
    """The driver broke a ring rule of spec §4: the ring is unusable until reset."""

    def __init__(self, rule: str, message: str) -> None:
        super().__init__(f"{rule}: {message}")
        self.rule = rule
        self.message = message


class Descriptor(NamedTuple):
    """One buffer of a chain, after the chain was checked (a tuple: one is made per
    buffer of every request)."""
    addr: int
    length: int
    write: bool


class DescriptorChain:
    """A checked request: readable buffers, then writable ones, and their byte totals
    (`readable_len`, `writable_len`: the walk that made the chain adds them up as it
    goes, or they are summed here). Never changed once made."""

    __slots__ = ("head", "readable", "writable", "ring", "readable_len", "writable_len")

    def __init__(self, head: int, readable: list[Descriptor] | None = None,
                 writable: list[Descriptor] | None = None, ring: object | None = None,
                 readable_len: int = -1, writable_len: int = -1) -> None:
        self.head = head
        self.readable: list[Descriptor] = [] if readable is None else readable
        self.writable: list[Descriptor] = [] if writable is None else writable
        self.ring = ring   # the ring that gave it out (a RING_RESET makes another)
        if readable_len < 0:
            readable_len = 0
            for d in self.readable:
                readable_len += d.length
        if writable_len < 0:
            writable_len = 0
            for d in self.writable:
                writable_len += d.length
        self.readable_len = readable_len
        self.writable_len = writable_len

    def __repr__(self) -> str:
        return (f"DescriptorChain(head={self.head}, readable={self.readable}, "
                f"writable={self.writable})")

    def read(self, dma: DmaPort, limit: int) -> bytes:
        """Gather up to `limit` readable bytes (raises DmaFault)."""
        if len(self.readable) == 1:   # the usual request: one buffer
            d = self.readable[0]
            n = min(limit, d.length)
            return dma.read(d.addr, n) if n > 0 else b""
        parts: list[bytes] = []
        left = limit
        for d in self.readable:
            if left <= 0:
                break
            n = min(left, d.length)
            if n:
                parts.append(dma.read(d.addr, n))
            left -= n
        return b"".join(parts)

    def write(self, dma: DmaPort, data: bytes) -> int:
        """Scatter `data` over the writable buffers; returns the bytes written.

        Every target is checked before the first byte is written, so a fault writes
        nothing (raises DmaFault)."""
        n = len(data)
        if len(self.writable) == 1 and 0 < n <= self.writable[0].length:
            addr = self.writable[0].addr   # the usual reply: one buffer that holds it all
            dma.view(addr, n)   # probe, as below
            dma.write(addr, data)
            return n
        plan: list[tuple[int, int, int]] = []
        pos = 0
        for d in self.writable:
            if pos >= len(data):
                break
            n = min(d.length, len(data) - pos)
            if n:
                plan.append((d.addr, pos, n))
            pos += n
        for addr, _, n in plan:
            dma.view(addr, n)  # probe: raises DmaFault before anything is written
        mv = memoryview(data)
        for addr, off, n in plan:
            dma.write(addr, mv[off:off + n])
        return pos


def ring_read(dma: DmaPort, addr: int, length: int, what: str) -> bytes:
    """Ring memory read by either layout: a range past 2^64 or a DMA fault is a RingError
    (ring/addr-overflow, ring/dma) naming `what`."""
    if addr + length > _U64:
        raise RingError("ring/addr-overflow", f"{what} at {addr:#x}+{length} overflows")
    try:
        return dma.read(addr, length)
    except DmaFault as e:
        raise RingError("ring/dma", f"{what}: {e}") from None


def ring_write(dma: DmaPort, addr: int, data: bytes, what: str) -> None:
    """Ring memory write by either layout (errors as ring_read's)."""
    if addr + len(data) > _U64:
        raise RingError("ring/addr-overflow", f"{what} at {addr:#x} overflows")
    try:
        dma.write(addr, data)
    except DmaFault as e:
        raise RingError("ring/dma", f"{what}: {e}") from None


class DeviceRing(Protocol):
    """The device side of one virtqueue, after DRIVER_OK."""

    @property
    def ready(self) -> bool:
        """The driver enabled this queue before DRIVER_OK."""
        ...

    def pending(self, dma: DmaPort) -> int:
        """Chains the driver made available that the device has not taken (checked)."""
        ...

    def pop(self, dma: DmaPort) -> DescriptorChain | None:
        """The next available chain, fully checked, or None. Raises RingError."""
        ...

    def push_used(self, dma: DmaPort, head: int, length: int) -> None:
        """Give chain `head` back with `length` bytes written. Raises RingError."""
        ...

    def needs_interrupt(self, dma: DmaPort) -> bool:
        """After pushing used entries: should the driver be interrupted?"""
        ...

    def check_notification(self, dma: DmaPort, next_off: int, next_wrap: int) -> None:
        """VIRTIO_F_NOTIFICATION_DATA: the driver's notification says where its next
        available entry goes; raise RingError (notify/data) when the ring does not
        hold that."""
        ...
