"""The hostile guest's own virtio driver: registers, rings and requests written by hand.

Why not the project's driver: a hostile guest kernel does not follow any driver's
rules, and the suite must not inherit the driver's bugs or its checks. This is the
minimum a guest kernel needs to reach a VA-1 function (find it, negotiate, lay out split
rings in its RAM, make a context, submit a command buffer, poll the used ring), written
from hwspec alone, with every layer open for a scenario to scribble on.

Nothing here uses interrupts: completions are polled with virtual-time timeouts, so a
device that never answers costs a bounded wait, never a hung guest.
"""
from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from hwspec import isa
from hwspec import pci as P
from hwspec import va1 as A
from hwspec import virtio as V
from hwspec import virtio_mmio as R
from hwspec import virtio_pci as VP

POLL_TIMEOUT_NS = 2_000_000      # a request the device does not answer in 2 ms: lost
QUEUE_SIZE = 16
BASE_FEATURES = 1 << V.F_VERSION_1 | 1 << V.F_ACCESS_PLATFORM | 1 << V.F_RING_INDIRECT_DESC


class Bump:
    """Page allocator over the guest RAM the firmware gives the kernel (never frees)."""

    def __init__(self, base: int, size: int) -> None:
        self.base, self.end, self.next = base, base + size, base

    def alloc(self, size: int, align: int = 4096) -> int:
        addr = -(-self.next // align) * align
        if addr + size > self.end:
            raise MemoryError(f"hostile guest: {size} bytes past the end of its RAM")
        self.next = addr + size
        return addr


# -- transports ---------------------------------------------------------------------------

class RawTransport:
    """A virtio transport driven by hand (the registers a scenario may also poke)."""

    kind = ""

    def __init__(self, kernel: Any) -> None:
        self.kernel = kernel
        self.mmio = kernel.mmio

    def status(self) -> int: raise NotImplementedError
    def set_status(self, value: int) -> None: raise NotImplementedError
    def device_features(self) -> int: raise NotImplementedError
    def set_driver_features(self, features: int) -> None: raise NotImplementedError
    def read_config(self, off: int, size: int) -> int: raise NotImplementedError
    def queue_max(self, index: int) -> int: raise NotImplementedError
    def setup_queue(self, index: int, size: int, desc: int, avail: int, used: int) -> None:
        raise NotImplementedError
    def notify(self, index: int) -> None: raise NotImplementedError
    def notify_value(self, index: int, value: int) -> None:
        """A notification carrying `value` whole (NOTIFICATION_DATA: le32 {vqn, next_off,
        next_wrap})."""
        raise NotImplementedError
    def queue_reset(self, index: int) -> None:
        """Write 1 to the queue reset register of queue `index` (RING_RESET)."""
        raise NotImplementedError

    def restore(self) -> None:
        """Put back what a scenario may have broken below virtio (PCI: BAR, command)."""

    def function_reset(self) -> bool:
        """A reset stronger than status 0 (PCIe FLR); False if the transport has none."""
        return False


class MmioRaw(RawTransport):
    kind = "mmio"

    def __init__(self, kernel: Any, base: int) -> None:
        super().__init__(kernel)
        self.base = base

    def rd(self, off: int, size: int = 4) -> int:
        return int(self.mmio.read(self.base + off, size))

    def wr(self, off: int, value: int, size: int = 4) -> None:
        self.mmio.write(self.base + off, size, value)

    def status(self) -> int:
        return self.rd(R.STATUS)

    def set_status(self, value: int) -> None:
        self.wr(R.STATUS, value)

    def device_features(self) -> int:
        out = 0
        for sel in (0, 1):
            self.wr(R.DEVICE_FEATURES_SEL, sel)
            out |= self.rd(R.DEVICE_FEATURES) << (32 * sel)
        return out

    def set_driver_features(self, features: int) -> None:
        for sel in (0, 1):
            self.wr(R.DRIVER_FEATURES_SEL, sel)
            self.wr(R.DRIVER_FEATURES, features >> (32 * sel) & 0xFFFF_FFFF)

    def read_config(self, off: int, size: int) -> int:
        return self.rd(R.CONFIG + off, size)

    def queue_max(self, index: int) -> int:
        self.wr(R.QUEUE_SEL, index)
        return self.rd(R.QUEUE_NUM_MAX)

    def setup_queue(self, index: int, size: int, desc: int, avail: int, used: int) -> None:
        self.wr(R.QUEUE_SEL, index)
        self.wr(R.QUEUE_NUM, size)
        for lo, addr in ((R.QUEUE_DESC_LOW, desc), (R.QUEUE_DRIVER_LOW, avail),
                         (R.QUEUE_DEVICE_LOW, used)):
            self.wr(lo, addr & 0xFFFF_FFFF)
            self.wr(lo + 4, addr >> 32)
        self.wr(R.QUEUE_READY, 1)

    def notify(self, index: int) -> None:
        self.wr(R.QUEUE_NOTIFY, index)

    def notify_value(self, index: int, value: int) -> None:
        self.wr(R.QUEUE_NOTIFY, value & 0xFFFF_FFFF)

    def queue_reset(self, index: int) -> None:
        self.wr(R.QUEUE_SEL, index)
        self.wr(R.QUEUE_RESET, 1)


class PciRaw(RawTransport):
    """A virtio-pci function found on the VM's ECAM; the VA-1 layout of BAR 0 is known
    (hwspec.va1), so no capability walk is needed to reach it."""

    kind = "pci"

    def __init__(self, kernel: Any, ecam: int, bus: int, dev: int, fn: int) -> None:
        super().__init__(kernel)
        self.cfg_base = ecam + P.ecam_offset(bus, dev, fn)
        self.bdf = (bus, dev, fn)
        self.bar_lo = self.cfg_read(P.BASE_ADDRESS_0, 4)
        self.bar_hi = self.cfg_read(P.BASE_ADDRESS_0 + 4, 4)
        self.bar = (self.bar_lo & P.BASE_ADDRESS_MEM_MASK) | self.bar_hi << 32
        self.command0 = self.cfg_read(P.COMMAND, 2)
        self.msix_cap = self._find_cap(P.CAP_ID_MSIX)
        self.exp_cap = self._find_cap(P.CAP_ID_EXP)
        self.pci_cfg_cap = self._find_vndr(VP.CAP_PCI_CFG)
        self.cfg_write(P.COMMAND, 2, self.command0 | P.COMMAND_MEMORY | P.COMMAND_MASTER)

    # config space through ECAM
    def cfg_read(self, reg: int, size: int) -> int:
        return int(self.mmio.read(self.cfg_base + reg, size))

    def cfg_write(self, reg: int, size: int, value: int) -> None:
        self.mmio.write(self.cfg_base + reg, size, value)

    def _caps(self) -> list[tuple[int, int]]:
        out: list[tuple[int, int]] = []
        off = self.cfg_read(P.CAPABILITY_LIST, 1) & 0xFC
        while off and len(out) < 48:
            out.append((self.cfg_read(off, 1), off))
            off = self.cfg_read(off + 1, 1) & 0xFC
        return out

    def _find_cap(self, cap_id: int) -> int | None:
        return next((off for cid, off in self._caps() if cid == cap_id), None)

    def _find_vndr(self, cfg_type: int) -> int | None:
        for cid, off in self._caps():
            if cid == P.CAP_ID_VNDR and self.cfg_read(off + 3, 1) == cfg_type:
                return off
        return None

    # BAR 0
    def common(self, off: int) -> int:
        return self.bar + A.PCI_COMMON_CFG_OFFSET + off

    def crd(self, off: int, size: int) -> int:
        return int(self.mmio.read(self.common(off), size))

    def cwr(self, off: int, size: int, value: int) -> None:
        self.mmio.write(self.common(off), size, value)

    def status(self) -> int:
        return self.crd(VP.COMMON_STATUS, 1)

    def set_status(self, value: int) -> None:
        self.cwr(VP.COMMON_STATUS, 1, value)

    def device_features(self) -> int:
        out = 0
        for sel in (0, 1):
            self.cwr(VP.COMMON_DFSELECT, 4, sel)
            out |= self.crd(VP.COMMON_DF, 4) << (32 * sel)
        return out

    def set_driver_features(self, features: int) -> None:
        for sel in (0, 1):
            self.cwr(VP.COMMON_GFSELECT, 4, sel)
            self.cwr(VP.COMMON_GF, 4, features >> (32 * sel) & 0xFFFF_FFFF)

    def read_config(self, off: int, size: int) -> int:
        return int(self.mmio.read(self.bar + A.PCI_DEVICE_CFG_OFFSET + off, size))

    def queue_max(self, index: int) -> int:
        self.cwr(VP.COMMON_Q_SELECT, 2, index)
        return self.crd(VP.COMMON_Q_SIZE, 2)

    def setup_queue(self, index: int, size: int, desc: int, avail: int, used: int) -> None:
        self.cwr(VP.COMMON_Q_SELECT, 2, index)
        self.cwr(VP.COMMON_Q_SIZE, 2, size)
        for lo, addr in ((VP.COMMON_Q_DESCLO, desc), (VP.COMMON_Q_AVAILLO, avail),
                         (VP.COMMON_Q_USEDLO, used)):
            self.cwr(lo, 4, addr & 0xFFFF_FFFF)
            self.cwr(lo + 4, 4, addr >> 32)
        self.cwr(VP.COMMON_Q_ENABLE, 2, 1)

    def notify_addr(self, index: int) -> int:
        return self.bar + A.PCI_NOTIFY_OFFSET + index * A.PCI_NOTIFY_OFF_MULTIPLIER

    def notify(self, index: int) -> None:
        self.mmio.write(self.notify_addr(index), 2, index)

    def notify_value(self, index: int, value: int) -> None:
        self.mmio.write(self.notify_addr(index), 4, value & 0xFFFF_FFFF)

    def queue_reset(self, index: int) -> None:
        self.cwr(VP.COMMON_Q_SELECT, 2, index)
        self.cwr(VP.COMMON_Q_RESET, 2, 1)

    def restore(self) -> None:
        self.cfg_write(P.BASE_ADDRESS_0, 4, self.bar_lo)
        self.cfg_write(P.BASE_ADDRESS_0 + 4, 4, self.bar_hi)
        self.cfg_write(P.COMMAND, 2, self.command0 | P.COMMAND_MEMORY | P.COMMAND_MASTER)

    def function_reset(self) -> bool:
        if self.exp_cap is None:
            return False
        self.cfg_write(self.exp_cap + P.EXP_DEVCTL, 2, P.EXP_DEVCTL_BCR_FLR)
        self.kernel.sched.sleep(1_000_000)
        self.restore()
        return True


def find_transport(kernel: Any) -> RawTransport:
    """The first VA-1 function the firmware describes: a virtio-mmio platform device,
    else a PCI function with the VA-1 vendor and device id on the first ECAM."""
    for pdev in kernel.platform_devices:
        if pdev.compatible == "virtio,mmio":
            return MmioRaw(kernel, pdev.base)
    for host in kernel.pci_hosts:
        for dev in range(32):
            base = host.ecam_base + P.ecam_offset(host.bus_start, dev, 0)
            ident = int(kernel.mmio.read(base + P.VENDOR_ID, 4))
            if ident & 0xFFFF == A.PCI_VENDOR_ID and ident >> 16 == A.PCI_DEVICE_ID:
                return PciRaw(kernel, host.ecam_base, host.bus_start, dev, 0)
    raise LookupError("hostile guest: no VA-1 function on this VM")


# -- split ring, driver side --------------------------------------------------------------

Buf = tuple[int, int, bool]     # (guest address, length, device-writable)


class RawQueue:
    """One split virtqueue laid out in guest RAM; every field open for scribbling."""

    def __init__(self, kernel: Any, index: int, size: int, desc: int, avail: int,
                 used: int) -> None:
        self.kernel, self.mem = kernel, kernel.memory
        self.index, self.size = index, size
        self.desc, self.avail, self.used = desc, avail, used
        self.avail_idx = 0
        self.last_used = 0
        self.free = 0

    def write_desc(self, i: int, addr: int, length: int, flags: int, nxt: int,
                   table: int | None = None) -> None:
        base = self.desc if table is None else table
        self.mem.write(base + V.DESC.size * i, struct.pack(V.DESC.format, addr & (2**64 - 1),
                                                          length & 0xFFFF_FFFF,
                                                          flags & 0xFFFF, nxt & 0xFFFF))

    def put_avail(self, head: int) -> None:
        """Put `head` in the next avail slot and publish it."""
        slot = self.avail + V.AVAIL_HEADER + V.AVAIL_ELEM * (self.avail_idx % self.size)
        self.mem.write(slot, (head & 0xFFFF).to_bytes(2, "little"))
        self.set_avail_idx(self.avail_idx + 1)

    def set_avail_idx(self, value: int) -> None:
        self.avail_idx = value & 0xFFFF
        self.mem.write(self.avail + 2, self.avail_idx.to_bytes(2, "little"))

    def add(self, bufs: Sequence[Buf]) -> int:
        """A chain of consecutive descriptors; returns its head (not yet published)."""
        head = self.free
        for n, (addr, length, write) in enumerate(bufs):
            i = (head + n) % self.size
            last = n == len(bufs) - 1
            flags = (V.DESC_F_WRITE if write else 0) | (0 if last else V.DESC_F_NEXT)
            self.write_desc(i, addr, length, flags, (i + 1) % self.size)
        self.free = (head + len(bufs)) % self.size
        return head

    def used_idx(self) -> int:
        return int.from_bytes(self.mem.read(self.used + 2, 2), "little")

    def wait_used(self, timeout_ns: int = POLL_TIMEOUT_NS) -> tuple[int, int] | None:
        """The next used element (id, len), or None if none came within the timeout."""
        if not self.kernel.sched.wait_until(lambda: self.used_idx() != self.last_used,
                                            timeout_ns, f"hostile used ring {self.index}"):
            return None
        slot = self.used + V.USED_HEADER + V.USED_ELEM.size * (self.last_used % self.size)
        elem = struct.unpack(V.USED_ELEM.format, self.mem.read(slot, V.USED_ELEM.size))
        self.last_used = (self.last_used + 1) & 0xFFFF
        return int(elem[0]), int(elem[1])


class RawPackedQueue:
    """One packed virtqueue laid out in guest RAM (virtio 1.x §2.8), by hand: the slot and
    wrap counter of the next descriptor, the used position, and every field open for
    scribbling. A request's buffer id is its head slot (unique while in flight)."""

    def __init__(self, kernel: Any, index: int, size: int, desc: int, avail: int,
                 used: int) -> None:
        self.kernel, self.mem = kernel, kernel.memory
        self.index, self.size = index, size
        self.desc, self.avail, self.used = desc, avail, used   # ring, driver / device event
        self.slot, self.wrap = 0, 1
        self.used_slot, self.used_wrap = 0, 1
        self.slots: dict[int, int] = {}                         # buffer id -> slots taken

    def write_desc(self, slot: int, addr: int, length: int, bid: int, flags: int) -> None:
        self.mem.write(self.desc + V.PACKED_DESC.size * slot,
                       struct.pack(V.PACKED_DESC.format, addr & (2**64 - 1),
                                   length & 0xFFFF_FFFF, bid & 0xFFFF, flags & 0xFFFF))

    def avail_flags(self, write: bool = False, nxt: bool = False,
                    wrap: int | None = None) -> int:
        """AVAIL = the wrap counter, USED = its inverse (§2.8.1)."""
        w = self.wrap if wrap is None else wrap
        return ((V.DESC_F_AVAIL if w else V.DESC_F_USED) | (V.DESC_F_WRITE if write else 0)
                | (V.DESC_F_NEXT if nxt else 0))

    def add(self, bufs: Sequence[Buf], bid: int | None = None) -> tuple[int, int]:
        """Write a list of descriptors, the head's flags left 0; returns (head slot, head
        flags) for put_avail."""
        head = self.slot
        bid = head if bid is None else bid
        head_flags = 0
        for n, (addr, length, write) in enumerate(bufs):
            flags = self.avail_flags(write, n < len(bufs) - 1)
            if n == 0:
                head_flags = flags
                flags = 0
            self.write_desc(self.slot, addr, length, bid, flags)
            self.advance()
        self.slots[bid & 0xFFFF] = len(bufs)
        return head, head_flags

    def advance(self, n: int = 1) -> None:
        for _ in range(n):
            self.slot += 1
            if self.slot == self.size:
                self.slot, self.wrap = 0, self.wrap ^ 1

    def put_avail(self, token: tuple[int, int]) -> None:
        """Make the list available: its head's flags last."""
        head, flags = token
        self.mem.write(self.desc + V.PACKED_DESC.size * head + V.PACKED_DESC.offsets["flags"],
                       struct.pack("<H", flags))

    def set_event(self, off_wrap: int, flags: int) -> None:
        """The driver event suppression structure (read by the device)."""
        self.mem.write(self.avail, struct.pack(V.PACKED_EVENT.format, off_wrap & 0xFFFF,
                                               flags & 0xFFFF))

    def next_data(self) -> int:
        """NOTIFICATION_DATA: next_off | next_wrap << 15."""
        return self.slot | self.wrap << 15

    def _used(self) -> bool:
        raw = self.mem.read(self.desc + V.PACKED_DESC.size * self.used_slot, V.PACKED_DESC.size)
        flags = struct.unpack(V.PACKED_DESC.format, raw)[3]
        w = self.used_wrap
        return bool((flags >> V.PACKED_DESC_F_USED & 1) == w
                    and (flags >> V.PACKED_DESC_F_AVAIL & 1) == w)

    def wait_used(self, timeout_ns: int = POLL_TIMEOUT_NS) -> tuple[int, int] | None:
        """The next used descriptor (id, len), or None if none came within the timeout."""
        if not self.kernel.sched.wait_until(self._used, timeout_ns,
                                            f"hostile packed ring {self.index}"):
            return None
        raw = self.mem.read(self.desc + V.PACKED_DESC.size * self.used_slot, V.PACKED_DESC.size)
        _, length, bid, _ = struct.unpack(V.PACKED_DESC.format, raw)
        self.used_slot += self.slots.pop(bid, 1)
        if self.used_slot >= self.size:
            self.used_slot -= self.size
            self.used_wrap ^= 1
        return int(bid), int(length)


# -- the VA-1 function ------------------------------------------------------------------

@dataclass
class SubmitResult:
    status: int
    error_offset: int
    start_ns: int
    end_ns: int

    @property
    def name(self) -> str:
        return status_name(self.status)


def status_name(code: int) -> str:
    return A.Status(code).name if code in A.Status._value2member_map_ else str(code)


class RawVa1:
    """Bring-up, contexts and submissions on one VA-1 function, by hand."""

    def __init__(self, kernel: Any, transport: RawTransport, alloc: Bump) -> None:
        self.kernel, self.t, self.alloc = kernel, transport, alloc
        self.mem = kernel.memory
        self.queues: dict[int, Any] = {}   # RawQueue, or RawPackedQueue with RING_PACKED
        self.features = 0
        self.num_submitqs = 0
        self.fence = 0

    def sleep(self, ns: int) -> None:
        self.kernel.sched.sleep(ns)

    def reset(self) -> bool:
        """Status 0, then wait (bounded) for it to read 0 (virtio 1.x §2.4)."""
        self.t.set_status(0)
        self.queues.clear()
        return bool(self.kernel.sched.wait_until(lambda: self.t.status() == 0, 1_000_000,
                                                 "hostile reset"))

    def negotiate(self, features: int = BASE_FEATURES) -> bool:
        self.t.set_status(V.STATUS_ACKNOWLEDGE)
        self.t.set_status(V.STATUS_ACKNOWLEDGE | V.STATUS_DRIVER)
        self.features = features & self.t.device_features()
        self.t.set_driver_features(self.features)
        self.t.set_status(V.STATUS_ACKNOWLEDGE | V.STATUS_DRIVER | V.STATUS_FEATURES_OK)
        return bool(self.t.status() & V.STATUS_FEATURES_OK)

    @property
    def packed(self) -> bool:
        return bool(self.features >> V.F_RING_PACKED & 1)

    def make_queue(self, index: int, size: int = QUEUE_SIZE) -> Any:
        if self.packed:
            ring = self.alloc.alloc(V.packed_ring_size(size), 16)
            events = self.alloc.alloc(2 * V.PACKED_EVENT.size, 4)
            self.mem.write(ring, bytes(V.packed_ring_size(size)))
            self.mem.write(events, bytes(2 * V.PACKED_EVENT.size))
            pq = RawPackedQueue(self.kernel, index, size, ring, events,
                                events + V.PACKED_EVENT.size)
            self.queues[index] = pq
            return pq
        desc = self.alloc.alloc(V.desc_table_size(size))
        avail = self.alloc.alloc(V.avail_ring_size(size))
        used = self.alloc.alloc(V.used_ring_size(size))
        for addr, n in ((desc, V.desc_table_size(size)), (avail, V.avail_ring_size(size)),
                        (used, V.used_ring_size(size))):
            self.mem.write(addr, bytes(n))
        q = RawQueue(self.kernel, index, size, desc, avail, used)
        self.queues[index] = q
        return q

    def bring_up(self, features: int = BASE_FEATURES, *, driver_ok: bool = True,
                 queues: int | None = None,
                 before_ok: Callable[["RawVa1"], None] | None = None) -> bool:
        """Reset, negotiate, set up controlq, eventq and every submit queue, DRIVER_OK."""
        if not self.reset() or not self.negotiate(features):
            return False
        self.num_submitqs = self.t.read_config(A.CONFIG.offsets["num_submit_queues"], 4)
        count = A.FIRST_SUBMITQ + min(self.num_submitqs, 16) if queues is None else queues
        for i in range(count):
            size = min(QUEUE_SIZE, self.t.queue_max(i) or QUEUE_SIZE)
            q = self.make_queue(i, size)
            self.t.setup_queue(i, size, q.desc, q.avail, q.used)
        if before_ok is not None:
            before_ok(self)
        if driver_ok:
            self.t.set_status(V.STATUS_ACKNOWLEDGE | V.STATUS_DRIVER | V.STATUS_FEATURES_OK
                              | V.STATUS_DRIVER_OK)
            return bool(self.t.status() & V.STATUS_DRIVER_OK)
        return True

    def needs_reset(self) -> bool:
        return bool(self.t.status() & V.STATUS_DEVICE_NEEDS_RESET)

    def buffer(self, data: bytes | int) -> int:
        """Guest RAM holding `data` (or that many zero bytes)."""
        raw = bytes(data) if isinstance(data, int) else data
        addr = self.alloc.alloc(max(len(raw), 8), 64)
        self.mem.write(addr, raw)
        return addr

    def request(self, qi: int, bufs: Sequence[Buf], *, notify: bool = True,
                timeout_ns: int = POLL_TIMEOUT_NS) -> tuple[int, int] | None:
        q = self.queues[qi]
        q.put_avail(q.add(bufs))
        if notify:
            self.kick(qi)
        return q.wait_used(timeout_ns)  # type: ignore[no-any-return]

    def kick(self, qi: int) -> None:
        """Notify queue `qi`, with the right data when NOTIFICATION_DATA was negotiated."""
        if self.features >> V.F_NOTIFICATION_DATA & 1:
            q = self.queues[qi]
            data = q.next_data() if isinstance(q, RawPackedQueue) else q.avail_idx
            self.t.notify_value(qi, qi | data << 16)
        else:
            self.t.notify(qi)

    def ctrl(self, type_: int, context_id: int = 0, flags: int = 0,
             reserved: int = 0) -> tuple[int, int] | None:
        """A controlq request: (status, context id), or None when it was not answered."""
        req = self.buffer(struct.pack(A.CTRL_REQ.format, type_, context_id, flags, reserved))
        resp = self.buffer(A.STATS_RESP.size)
        got = self.request(A.CONTROLQ, [(req, A.CTRL_REQ.size, False),
                                        (resp, A.STATS_RESP.size, True)])
        if got is None:
            return None
        st, cid = struct.unpack_from(A.CTRL_RESP.format, self.mem.read(resp, A.CTRL_RESP.size))
        return int(st), int(cid)

    def create_context(self, flat: bool = True) -> int | None:
        r = self.ctrl(A.CtrlType.CONTEXT_CREATE, 0, A.CTX_CREATE_FLAT if flat else 0)
        if r is None or r[0] != A.Status.OK:
            return None
        return r[1]

    def submit_raw(self, ctx: int, addr: int, length: int, *, queue: int = A.FIRST_SUBMITQ,
                   flags: int = 0, reserved: int = 0, notify: bool = True,
                   timeout_ns: int = POLL_TIMEOUT_NS) -> SubmitResult | None:
        self.fence += 1
        req = self.buffer(struct.pack(A.SUBMIT_REQ.format, ctx, flags, addr, length, reserved,
                                      self.fence))
        resp = self.buffer(A.SUBMIT_RESP.size)
        got = self.request(queue, [(req, A.SUBMIT_REQ.size, False),
                                   (resp, A.SUBMIT_RESP.size, True)], notify=notify,
                           timeout_ns=timeout_ns)
        if got is None:
            return None
        st, off, _, start, end = struct.unpack(A.SUBMIT_RESP.format,
                                               self.mem.read(resp, A.SUBMIT_RESP.size))
        return SubmitResult(int(st), int(off), int(start), int(end))

    def submit(self, ctx: int, cmdbuf: bytes, **kw: Any) -> SubmitResult | None:
        return self.submit_raw(ctx, self.buffer(cmdbuf), len(cmdbuf), **kw)


# -- command words ----------------------------------------------------------------------

def cmd(opcode: int, flags: int = 0, length: int | None = None, **fields: Any) -> bytes:
    """One command: header + payload from the ISA layout (unnamed fields 0); `length`
    overrides the header's length field (the payload is still the layout's)."""
    layout = isa.PAYLOAD.get(isa.Opcode(opcode)) if opcode in isa.Opcode._value2member_map_ \
        else None
    payload = b""
    if layout is not None and layout.names:
        payload = struct.pack(layout.format, *[fields.get(n, 0) for n in layout.names])
    size = isa.HEADER.size + len(payload)
    return struct.pack(isa.HEADER.format, opcode & 0xFFFF, flags & 0xFFFF,
                       (size if length is None else length) & 0xFFFF_FFFF) + payload


def probe_round_trip(dev: RawVa1, pattern: int = 0x5AFE_C0DE,
                     features: int = BASE_FEATURES) -> str | None:
    """A minimal bring-up (with `features`) and a FILL + DMA_D2H through a fresh context;
    None when the function answered right, else what went wrong."""
    if not dev.bring_up(features):
        return f"bring-up failed (status {dev.t.status():#x})"
    ctx = dev.create_context()
    if ctx is None:
        return "CONTEXT_CREATE was not answered OK"
    host = dev.buffer(256)
    res = dev.submit(ctx, cmd(isa.Opcode.FILL, dst=0, size=256, pattern=pattern)
                     + cmd(isa.Opcode.DMA_D2H, src=0, dst=host, size=256))
    if res is None:
        return "probe submission not answered"
    if res.status != A.Status.OK:
        return f"probe submission failed: {res.name}"
    got = dev.mem.read(host, 256)
    if got != struct.pack("<I", pattern) * 64:
        return "probe data wrong"
    return None
