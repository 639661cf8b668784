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


class DmaWindow:
    """The device's cache of one port view around the buffers it last reached
    (ports.DmaPort's optional ring_view): a buffer access inside it goes through the
    view instead of a DMA call. A port hands a view out only for memory that passes
    every check of read, write and view() for as long as its view_epoch is unchanged,
    so such an access is one the DMA call would have made without a fault; anything
    else (a port without views, a fault plan watching, a range the port will not view,
    another epoch) takes the DMA call with all its checks.

    Users test a hit inline, `dma is w.dma and dma.view_epoch == w.epoch and w.lo <=
    addr and addr + n <= w.hi` (`dma` is only ever a port with a view_epoch), and call
    `cover` only on a miss; the view is `w.mem`, offset 0 = `w.lo`."""

    __slots__ = ("dma", "epoch", "lo", "hi", "mem")

    SPAN = 2 << 20
    """Asked for first: the aligned 2 MiB around an access, so the next buffers fit too."""

    def __init__(self) -> None:
        self.dma: object = None
        self.epoch = -1
        self.lo = self.hi = 0
        self.mem = memoryview(b"")

    def cover(self, dma: DmaPort, addr: int, n: int) -> bool:
        """Make the window cover [addr, addr+n) if the port offers a view of it (then
        True); False: the caller makes the DMA call. Asks no more than two views."""
        epoch = getattr(dma, "view_epoch", None)
        if epoch is None or n <= 0 or addr < 0 or addr + n > _U64:
            return False
        span = self.SPAN
        lo, hi = addr & -span, -(-(addr + n) // span) * span
        mem = dma.ring_view(lo, hi - lo) if hi <= _U64 else None  # type: ignore[attr-defined]
        if mem is None:
            lo, hi = addr, addr + n
            mem = dma.ring_view(addr, n)  # type: ignore[attr-defined]
            if mem is None:
                return False
        self.dma, self.epoch, self.lo, self.hi, self.mem = dma, epoch, lo, hi, mem
        return True


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

    def read(self, dma: DmaPort, limit: int, win: DmaWindow | None = None) -> bytes:
        """Gather up to `limit` readable bytes (raises DmaFault); `win`: the caller's
        DmaWindow, through which a single buffer inside it is read."""
        if len(self.readable) == 1:   # the usual request: one buffer
            addr, n, _ = self.readable[0]
            if n > limit:
                n = limit
            if n <= 0:
                return b""
            w = win
            if w is not None and (dma is w.dma and dma.view_epoch == w.epoch  # type: ignore[attr-defined]
                                  and w.lo <= addr and addr + n <= w.hi
                                  or w.cover(dma, addr, n)):
                return w.mem[addr - w.lo:addr - w.lo + n].tobytes()
            return dma.read(addr, n)
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

    def write(self, dma: DmaPort, data: bytes, win: DmaWindow | None = None) -> int:
        """Scatter `data` over the writable buffers; returns the bytes written (a single
        buffer inside the caller's DmaWindow `win` is written through it).

        Every target is checked before the first byte is written, so a fault writes
        nothing (raises DmaFault)."""
        n = len(data)
        if len(self.writable) == 1 and 0 < n <= self.writable[0].length:
            addr = self.writable[0].addr   # the usual reply: one buffer that holds it all
            w = win
            if w is not None and (dma is w.dma and dma.view_epoch == w.epoch  # type: ignore[attr-defined]
                                  and w.lo <= addr and addr + n <= w.hi
                                  or w.cover(dma, addr, n)):
                w.mem[addr - w.lo:addr - w.lo + n] = data
                return n
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

    @property
    def drained(self) -> bool:
        """After a pop that returned a chain: True when a pop now, with nothing written
        to the ring since, would return None and change nothing (so the caller may skip
        it); False when that is not known."""
        ...

    def push_used(self, dma: DmaPort, head: int, length: int) -> None:
        """Give chain `head` back with `length` bytes written. Raises RingError."""
        ...

    def needs_interrupt(self, dma: DmaPort) -> bool:
        """After pushing used entries: should the driver be interrupted?"""
        ...

    def push_used_interrupt(self, dma: DmaPort, head: int, length: int) -> bool:
        """push_used(dma, head, length), then needs_interrupt(dma), in one call."""
        ...

    def check_notification(self, dma: DmaPort, next_off: int, next_wrap: int) -> None:
        """VIRTIO_F_NOTIFICATION_DATA: the driver's notification says where its next
        available entry goes; raise RingError (notify/data) when the ring does not
        hold that."""
        ...
