"""Test doubles for the guest driver: a fake guest kernel and a small fake VA-1 device.

The fake device is written from docs/spec.md (not from the driver), only as far as the
tests need: virtio-mmio v2 registers, split-ring walking (incl. indirect), controlq,
eventq and submitqs with command buffers of NOP, FILL (logged) and SIGNAL, EVENT_IDX interrupt suppression,
and hooks to misbehave (bad used entries, NEEDS_RESET, refusing features, holding work).
"""
from __future__ import annotations

import errno
import heapq
import struct
from dataclasses import dataclass, field
from typing import Callable, Iterator

import numpy as np

from guest_driver.kernel import MsiMessage, PciHostBridge, PlatformDevice, RamRange
from hwspec import pci as P
from hwspec import isa as I
from hwspec import va1 as A
from hwspec import virtio as V
from hwspec import virtio_mmio as R

RAM_BASE = 0x4000_0000
RAM_SIZE = 8 << 20


class FakeMemory:
    def __init__(self, base: int = RAM_BASE, size: int = RAM_SIZE) -> None:
        self.base, self.size = base, size
        self.buf = bytearray(size)
        self.np = np.frombuffer(self.buf, dtype=np.uint8)

    def _off(self, gpa: int, n: int) -> int:
        if gpa < self.base or gpa + n > self.base + self.size or n < 0:
            raise ValueError(f"guest memory [{gpa:#x}, {gpa + n:#x}) out of range")
        return gpa - self.base

    def read(self, gpa: int, length: int) -> bytes:
        o = self._off(gpa, length)
        return bytes(self.buf[o:o + length])

    def write(self, gpa: int, data) -> None:
        data = bytes(memoryview(data).cast("B")) if not isinstance(data, (bytes, bytearray)) \
            else data
        o = self._off(gpa, len(data))
        self.buf[o:o + len(data)] = data

    def view(self, gpa: int, length: int) -> np.ndarray:
        o = self._off(gpa, length)
        return self.np[o:o + length]

    def u16(self, gpa: int) -> int:
        return struct.unpack("<H", self.read(gpa, 2))[0]

    def put16(self, gpa: int, v: int) -> None:
        self.write(gpa, struct.pack("<H", v & 0xFFFF))


class FakeSched:
    """Virtual clock + event list; the blocking task drives events itself."""

    def __init__(self) -> None:
        self.now = 0
        self._seq = 0
        self._heap: list[tuple[int, int, Callable[[], None]]] = []
        self.waits: list[str] = []

    def now_ns(self) -> int:
        return self.now

    def at(self, delay: int, fn: Callable[[], None]) -> None:
        self._seq += 1
        heapq.heappush(self._heap, (self.now + delay, self._seq, fn))

    def run_next(self) -> bool:
        if not self._heap:
            return False
        t, _, fn = heapq.heappop(self._heap)
        self.now = max(self.now, t)
        fn()
        return True

    def run_all(self, limit: int = 100000) -> None:
        for _ in range(limit):
            if not self.run_next():
                return
        raise AssertionError("event loop did not settle")

    def wait_until(self, cond, timeout_ns, what) -> bool:
        self.waits.append(what)
        deadline = None if timeout_ns is None else self.now + timeout_ns
        while True:
            if cond():
                return True
            if not self._heap:
                if deadline is None:
                    raise AssertionError(f"guest task would hang forever in wait: {what}")
                self.now = deadline
                return bool(cond())
            if deadline is not None and self._heap[0][0] > deadline:
                self.now = deadline
                return bool(cond())
            self.run_next()

    def sleep(self, ns: int) -> None:
        end = self.now + ns
        while self._heap and self._heap[0][0] <= end:
            self.run_next()
        self.now = end


class FakeTrace:
    def __init__(self) -> None:
        self.events: list[tuple[str, dict]] = []

    def emit(self, kind: str, **fields: object) -> None:
        for k, v in fields.items():
            assert isinstance(v, (int, str)), f"trace field {k}={v!r} not int/str"
        self.events.append((kind, fields))

    def of(self, kind: str) -> list[dict]:
        return [f for k, f in self.events if k == kind]


class FakeIrq:
    def __init__(self) -> None:
        self.handlers: dict[int, Callable[[], None]] = {}
        self.msi: dict[int, tuple[Callable[[], None], str]] = {}  # data (vector) -> handler
        self.msi_capacity = 200
        self.msi_allocs = 0
        self.msi_frees = 0

    def alloc_msi(self, handler, name) -> MsiMessage:
        if len(self.msi) >= self.msi_capacity:
            raise OSError(errno.ENOSPC, "no free MSI vectors")
        vec = next(v for v in range(0x30, 0x100) if v not in self.msi)
        self.msi[vec] = (handler, name)
        self.msi_allocs += 1
        return MsiMessage(P.MSI_ADDRESS_BASE | (vec << 12), vec)

    def free_msi(self, msg: MsiMessage) -> None:
        assert msg.data in self.msi, f"free_msi of unallocated {msg}"
        assert msg.address == P.MSI_ADDRESS_BASE | (msg.data << 12)
        del self.msi[msg.data]
        self.msi_frees += 1

    def request_irq(self, line, handler, name) -> None:
        assert line not in self.handlers
        self.handlers[line] = handler

    def free_irq(self, line) -> None:
        self.handlers.pop(line)


class FakeBus:
    """MMIO bus recording every access."""

    def __init__(self) -> None:
        self.regions: list[tuple[int, int, object]] = []
        self.log: list[tuple[str, int, int, int]] = []

    def add(self, base: int, size: int, dev) -> None:
        self.regions.append((base, size, dev))

    def _find(self, addr: int):
        for base, size, dev in self.regions:
            if base <= addr < base + size:
                return dev, addr - base
        raise AssertionError(f"MMIO access to unmapped {addr:#x}")

    def read(self, addr: int, size: int) -> int:
        dev, off = self._find(addr)
        v = dev.mmio_read(off, size)
        self.log.append(("r", addr, size, v))
        return v

    def write(self, addr: int, size: int, value: int) -> None:
        dev, off = self._find(addr)
        self.log.append(("w", addr, size, value))
        dev.mmio_write(off, size, value)


class FakeKernel:
    def __init__(self) -> None:
        self.memory = FakeMemory()
        self.mmio = FakeBus()
        self.irq = FakeIrq()
        self.sched = FakeSched()
        self.trace = FakeTrace()
        self.ram = RamRange(RAM_BASE, RAM_SIZE)
        self.platform_devices: tuple[PlatformDevice, ...] = ()
        self.pci_hosts: tuple[PciHostBridge, ...] = ()
        self.cmdline = ""
        self.msi_log: list[tuple[int, int]] = []
        self.stray_msi: list[tuple[int, int]] = []

    def msi_write(self, address: int, data: int) -> None:
        """A device's MSI write: the handler runs at the guest's next wait (edge)."""
        self.msi_log.append((address, data))

        def deliver() -> None:
            h = self.irq.msi.get(data)
            if h is None or address != P.MSI_ADDRESS_BASE | (data << 12):
                self.stray_msi.append((address, data))
                return
            h[0]()
        self.sched.at(0, deliver)

    def attach(self, dev: "FakeVA1", base: int, irq: int) -> None:
        self.mmio.add(base, R.REGION_SIZE, dev)
        self.platform_devices += (PlatformDevice("virtio,mmio", base, R.REGION_SIZE, irq),)
        dev.raise_irq = lambda: self.sched.at(0, lambda: self._deliver(irq, dev))

    def _deliver(self, irq: int, dev: "FakeVA1") -> None:
        if dev.isr and irq in self.irq.handlers:
            self.irq.handlers[irq]()


# ------------------------------------------------------------------------------------------
OFFERED = ((1 << V.F_VERSION_1) | (1 << V.F_ACCESS_PLATFORM) | (1 << V.F_RING_INDIRECT_DESC)
           | (1 << V.F_RING_EVENT_IDX) | (1 << A.F_FP16) | (1 << A.F_TIMESTAMP))


@dataclass
class Q:
    num_max: int
    num: int = 0
    ready: int = 0
    desc: int = 0
    drv: int = 0
    dev: int = 0
    last_avail: int = 0
    used_idx: int = 0
    pending: list = field(default_factory=list)  # eventq buffers / submitq FIFO
    busy_until: int = 0


class DeviceBroken(Exception):
    pass


def walk_chain(mem: FakeMemory, q_desc: int, num: int, head: int, indirect_ok: bool):
    """Device-side descriptor walk (spec §4): returns (readable, writable) segment lists."""
    readable: list[tuple[int, int]] = []
    writable: list[tuple[int, int]] = []
    if head >= num:
        raise DeviceBroken("ring/head-range")
    table, tnum, idx, count, in_indirect = q_desc, num, head, 0, False
    while True:
        addr, ln, flags, nxt = struct.unpack(V.DESC.format, mem.read(table + 16 * idx, 16))
        count += 1
        if count > tnum:
            raise DeviceBroken("ring/loop")
        if flags & V.DESC_F_INDIRECT:
            if not indirect_ok:
                raise DeviceBroken("ring/indirect-not-negotiated")
            if in_indirect:
                raise DeviceBroken("ring/indirect-nested")
            if flags & V.DESC_F_NEXT:
                raise DeviceBroken("ring/indirect-next")
            if ln == 0 or ln % 16:
                raise DeviceBroken("ring/indirect-len")
            table, tnum, idx, count, in_indirect = addr, ln // 16, 0, 0, True
            continue
        if flags & V.DESC_F_WRITE:
            writable.append((addr, ln))
        else:
            if writable:
                raise DeviceBroken("ring/write-before-read")
            readable.append((addr, ln))
        if not flags & V.DESC_F_NEXT:
            return readable, writable
        if nxt >= tnum:
            raise DeviceBroken("ring/next-range")
        idx = nxt


def vring_need_event(ev: int, new: int, old: int) -> bool:
    return ((new - ev - 1) & 0xFFFF) < ((new - old) & 0xFFFF)


class FakeVA1:
    """Fake VA-1 over virtio-mmio (device side, from the datasheet)."""

    LATENCY = 100
    CMD_NS = 500

    def __init__(self, kernel: FakeKernel, *, offered: int = OFFERED, nsq: int = 2,
                 num_max: int = 256, config: dict | None = None,
                 device_id: int = A.VIRTIO_DEVICE_ID) -> None:
        self.k = kernel
        self.mem = kernel.memory
        self.offered = offered
        self.device_id = device_id
        self.nsq = nsq
        self.num_max = num_max
        self.cfg = dict(num_submit_queues=nsq, num_compute_units=4,
                        device_memory_size=256 << 20, scratchpad_size=1 << 20,
                        max_cmdbuf_size=1 << 20, isa_version=A.ISA_VERSION,
                        dtype_mask=0b11, peak_flops=50 * 10**12, mem_bandwidth=10**12,
                        link_bandwidth=32 * 10**9, cmd_overhead_ns=500, max_contexts=64,
                        max_call_depth=8, reserved=0)
        if config:
            self.cfg.update(config)
        self.violations: list[str] = []
        self.raise_irq: Callable[[], None] = lambda: None
        # misbehaviour hooks
        self.refuse_features = False
        self.hold_submits = False
        self.corrupt_used: tuple[str, int] | None = None  # ("id"|"len", value) once
        self.ignore_ctrl = False
        self.corrupt_queue: int | None = None  # queue corrupt_used applies to (None: submitqs)
        self.corrupt_seq = False      # echo a wrong fence_seq in the next response
        self.stuck_reset = False      # Status never reads back 0 after a reset
        self.resets = 0
        self.fills: list[tuple[int, int, int, int]] = []   # (context, dst, size, pattern)
        self.cmdbufs: list[tuple[int, int, bytes]] = []     # (context, iova, bytes) read
        self.processed_after_reset: list[str] = []
        self.gen = 0
        self._reset_state()

    # ---- state ----
    def _reset_state(self) -> None:
        self.status = 0
        self.isr = 0
        self.dfsel = 0
        self.drvfsel = 0
        self.drvfeat = [0, 0]
        self.qsel = 0
        self.queues = [Q(self.num_max) for _ in range(2 + self.nsq)]
        self.contexts: dict[int, bool] = {}  # id -> faulted
        self.stats = dict(submissions=0, commands=0, device_time_ns=0, dma_bytes=0, faults=0)
        self.broken = False
        self.gen += 1  # pending timers from before a reset become no-ops

    @property
    def features(self) -> int:
        return self.drvfeat[0] | self.drvfeat[1] << 32

    def _violate(self, rule: str) -> None:
        self.violations.append(rule)

    # ---- registers ----
    def mmio_read(self, off: int, size: int) -> int:
        if off < R.CONFIG:
            if size != 4:
                self._violate("mmio/access-size")
                return 0
            q = self.queues[self.qsel] if self.qsel < len(self.queues) else None
            return {
                R.MAGIC_VALUE: R.MAGIC, R.VERSION: R.VERSION_MODERN, R.DEVICE_ID: self.device_id,
                R.VENDOR_ID: A.MMIO_VENDOR_ID,
                R.DEVICE_FEATURES: (self.offered >> (32 * self.dfsel)) & 0xFFFFFFFF
                if self.dfsel <= 1 else 0,
                R.QUEUE_NUM_MAX: q.num_max if q else 0,
                R.QUEUE_READY: q.ready if q else 0,
                R.INTERRUPT_STATUS: self.isr,
                R.STATUS: self.status if not self.stuck_reset else self.status | 1,
                R.CONFIG_GENERATION: 0,
            }.get(off, 0)
        cfgb = struct.pack(A.CONFIG.format, *(self.cfg[n] for n in A.CONFIG.names))
        o = off - R.CONFIG
        return int.from_bytes(cfgb[o:o + size].ljust(size, b"\0"), "little")

    def mmio_write(self, off: int, size: int, value: int) -> None:
        if off >= R.CONFIG:
            self._violate("config/write")
            return
        if size != 4:
            self._violate("mmio/access-size")
            return
        q = self.queues[self.qsel] if self.qsel < len(self.queues) else None
        if off == R.STATUS:
            self._write_status(value)
        elif off == R.DEVICE_FEATURES_SEL:
            self.dfsel = value
        elif off == R.DRIVER_FEATURES_SEL:
            self.drvfsel = value
        elif off == R.DRIVER_FEATURES:
            self._write_driver_features(value)
        elif off == R.QUEUE_SEL:
            self.qsel = value
        elif off in (R.QUEUE_NUM, R.QUEUE_READY, R.QUEUE_DESC_LOW, R.QUEUE_DESC_HIGH,
                     R.QUEUE_DRIVER_LOW, R.QUEUE_DRIVER_HIGH, R.QUEUE_DEVICE_LOW,
                     R.QUEUE_DEVICE_HIGH):
            if q is None:
                self._violate("queue/bad-select")
            elif self.status & V.STATUS_DRIVER_OK:
                self._violate("queue/after-driver-ok")
            elif off == R.QUEUE_NUM:
                if value == 0 or value > q.num_max or value & (value - 1):
                    self._violate("queue/size")
                else:
                    q.num = value
            elif off == R.QUEUE_READY:
                if value and (q.desc % 16 or q.drv % 2 or q.dev % 4):
                    self._violate("queue/alignment")
                else:
                    q.ready = value & 1
            else:
                name = {R.QUEUE_DESC_LOW: "desc", R.QUEUE_DESC_HIGH: "desc",
                        R.QUEUE_DRIVER_LOW: "drv", R.QUEUE_DRIVER_HIGH: "drv",
                        R.QUEUE_DEVICE_LOW: "dev", R.QUEUE_DEVICE_HIGH: "dev"}[off]
                cur = getattr(q, name)
                if off in (R.QUEUE_DESC_LOW, R.QUEUE_DRIVER_LOW, R.QUEUE_DEVICE_LOW):
                    setattr(q, name, (cur & ~0xFFFFFFFF) | value)
                else:
                    setattr(q, name, (cur & 0xFFFFFFFF) | value << 32)
        elif off == R.QUEUE_NOTIFY:
            if value >= len(self.queues) or not self.queues[value].ready:
                self._violate("queue/not-ready")
            else:
                gen = self.gen
                self.k.sched.at(self.LATENCY, lambda: gen == self.gen and self._process(value))
        elif off == R.INTERRUPT_ACK:
            self.isr &= ~value
        else:
            self._violate(f"unlisted-write/{off:#x}")

    def _write_driver_features(self, value: int) -> None:
        if self.status & V.STATUS_FEATURES_OK:
            self._violate("features/after-features-ok")
        elif self.drvfsel <= 1:
            self.drvfeat[self.drvfsel] = value

    def _write_status(self, value: int) -> None:
        if value == 0:
            self.resets += 1
            self._reset_state()
            return
        old = self.status
        if (old & ~value) & 0xFF:
            self._violate("status/clear-bit")
            return
        new = value
        if new & V.STATUS_FEATURES_OK and not old & V.STATUS_FEATURES_OK:
            if not new & V.STATUS_DRIVER:
                self._violate("status/order")
                return
            f = self.features
            if self.refuse_features or f & ~self.offered or not f >> V.F_VERSION_1 & 1:
                self._violate("features/not-offered")
                new &= ~V.STATUS_FEATURES_OK
        if new & V.STATUS_DRIVER_OK and not new & V.STATUS_FEATURES_OK:
            self._violate("status/order")
            return
        self.status = new

    # ---- misbehaviour ----
    def set_needs_reset(self, rule: str = "test") -> None:
        self.broken = True
        self.status |= V.STATUS_DEVICE_NEEDS_RESET
        self._signal_config()

    # ---- rings ----
    def _used(self, qi: int, head: int, ln: int) -> None:
        q = self.queues[qi]
        target = (qi == self.corrupt_queue if self.corrupt_queue is not None
                  else qi >= A.FIRST_SUBMITQ)
        if self.corrupt_used is not None and target:
            kind, val = self.corrupt_used
            self.corrupt_used = None
            if kind == "id":
                head = val
            else:
                ln = val
        slot = q.used_idx % q.num
        self.mem.write(q.dev + 4 + 8 * slot, struct.pack("<II", head, ln))
        old = q.used_idx
        q.used_idx = (q.used_idx + 1) & 0xFFFF
        self.mem.put16(q.dev + 2, q.used_idx)
        if self.features >> V.F_RING_EVENT_IDX & 1:
            ev = self.mem.u16(q.drv + 4 + 2 * q.num)
            need = vring_need_event(ev, q.used_idx, old)
        else:
            need = not self.mem.u16(q.drv) & V.AVAIL_F_NO_INTERRUPT
        if need:
            self._signal_queue(qi)

    def _signal_queue(self, qi: int) -> None:
        self.isr |= R.INT_VRING
        self.raise_irq()

    def _signal_config(self) -> None:
        self.isr |= R.INT_CONFIG
        self.raise_irq()

    def _avail_chains(self, qi: int) -> Iterator[tuple[int, list, list] | None]:
        """The chains the driver made available on queue `qi` (as of now), popped one
        by one as (head, readable, writable). A final None means the caller must stop
        at once: the device is broken or not live, or a chain was malformed (then it is
        a violation and the device sets DEVICE_NEEDS_RESET)."""
        if self.broken or not self.status & V.STATUS_DRIVER_OK:
            yield None
            return
        q = self.queues[qi]
        idx = self.mem.u16(q.drv + 2)
        while q.last_avail != idx:
            head = self.mem.u16(q.drv + 4 + 2 * (q.last_avail % q.num))
            q.last_avail = (q.last_avail + 1) & 0xFFFF
            if self.features >> V.F_RING_EVENT_IDX & 1:
                self.mem.put16(q.dev + 4 + 8 * q.num, q.last_avail)
            try:
                rd, wr = walk_chain(self.mem, q.desc, q.num, head,
                                    bool(self.features >> V.F_RING_INDIRECT_DESC & 1))
            except DeviceBroken as e:
                self._violate(str(e))
                self.set_needs_reset(str(e))
                yield None
                return
            yield head, rd, wr

    def _process(self, qi: int) -> None:
        for chain in self._avail_chains(qi):
            if chain is None:
                return
            head, rd, wr = chain
            if qi == A.CONTROLQ:
                if not self.ignore_ctrl:
                    self._control(head, rd, wr)
            elif qi == A.EVENTQ:
                self.queues[qi].pending.append((head, wr))
            else:
                self.queues[qi].pending.append((head, rd, wr))
        if qi >= A.FIRST_SUBMITQ:
            self._run_submitq(qi)

    def _gather(self, segs) -> bytes:
        return b"".join(self.mem.read(a, n) for a, n in segs)

    def _scatter(self, segs, data: bytes) -> int:
        done = 0
        for a, n in segs:
            chunk = data[done:done + n]
            if not chunk:
                break
            self.mem.write(a, chunk)
            done += len(chunk)
        return done

    def _control(self, head, rd, wr) -> None:
        req = self._gather(rd)
        if len(req) < A.CTRL_REQ.size:
            self._used(A.CONTROLQ, head, self._scatter(wr, struct.pack("<I", A.Status.BAD_REQUEST)))
            return
        typ, cid, flags, res = struct.unpack(A.CTRL_REQ.format, req[:16])
        if typ == A.CtrlType.CONTEXT_CREATE:
            if len(self.contexts) >= self.cfg["max_contexts"]:
                resp = struct.pack("<II", A.Status.NO_RESOURCES, 0)
            else:
                nid = next(i for i in range(1, 1 << 20) if i not in self.contexts)
                self.contexts[nid] = False
                resp = struct.pack("<II", A.Status.OK, nid)
        elif typ == A.CtrlType.CONTEXT_DESTROY:
            if cid in self.contexts:
                del self.contexts[cid]
                resp = struct.pack("<II", A.Status.OK, cid)
            else:
                resp = struct.pack("<II", A.Status.BAD_CONTEXT, cid)
        elif typ == A.CtrlType.GET_STATS:
            s = self.stats
            resp = struct.pack(A.STATS_RESP.format, A.Status.OK, 0, s["submissions"],
                               s["commands"], s["device_time_ns"], s["dma_bytes"], s["faults"])
        else:
            resp = struct.pack("<II", A.Status.BAD_ARG, 0)
        gen = self.gen
        self.k.sched.at(self.cfg["cmd_overhead_ns"],
                        lambda: gen == self.gen and self._used(A.CONTROLQ, head,
                                                               self._scatter(wr, resp)))

    def _post_event(self, cid: int, seq: int, status: int, off: int) -> None:
        q = self.queues[A.EVENTQ]
        if not q.pending:
            return
        head, wr = q.pending.pop(0)
        ev = struct.pack(A.EVENT.format, A.EventType.CONTEXT_FAULT, cid, seq, status, off)
        self._used(A.EVENTQ, head, self._scatter(wr, ev))

    def _run_submitq(self, qi: int) -> None:
        q = self.queues[qi]
        if self.hold_submits or not q.pending or q.busy_until > self.k.sched.now:
            return
        head, rd, wr = q.pending.pop(0)
        req = self._gather(rd)
        cid, flags, addr, ln, res, seq = struct.unpack(A.SUBMIT_REQ.format, req[:32])
        start = self.k.sched.now
        status, off, ncmd = A.Status.OK, A.NO_OFFSET, 0
        if cid not in self.contexts:
            status = A.Status.BAD_CONTEXT
        elif self.contexts[cid]:
            status = A.Status.CONTEXT_FAULTED
        else:
            buf = self.mem.read(addr, ln)
            self.cmdbufs.append((cid, addr, buf))
            pos = 0
            effects = []
            while pos < ln:
                opc, fl, length = struct.unpack_from(I.HEADER.format, buf, pos)
                if opc not in (I.Opcode.NOP, I.Opcode.FILL, I.Opcode.SIGNAL):
                    status, off = A.Status.BAD_OPCODE, pos
                    break
                want = 0 if opc == I.Opcode.NOP else I.command_length(I.Opcode(opc))
                if length < 8 or length % 8 or pos + length > ln or (want and length != want):
                    status, off = A.Status.BAD_LENGTH, pos
                    break
                if opc == I.Opcode.FILL:
                    dst, size, pattern, _ = struct.unpack_from("<QQII", buf, pos + 8)
                    effects.append(("fill", cid, dst, size, pattern))
                elif opc == I.Opcode.SIGNAL:
                    effects.append(("signal",) + struct.unpack_from("<QQ", buf, pos + 8))
                pos += length
                ncmd += 1
            if status == A.Status.OK:
                for e in effects:
                    if e[0] == "fill":
                        self.fills.append(e[1:])
                    else:
                        self.mem.write(e[1], struct.pack("<Q", e[2]))
        end = start + self.CMD_NS * max(ncmd, 1)
        q.busy_until = end
        gen = self.gen

        def finish() -> None:
            if gen != self.gen:
                return
            self.stats["submissions"] += 1
            self.stats["commands"] += ncmd
            echo = seq + 1 if self.corrupt_seq else seq
            self.corrupt_seq = False
            resp = struct.pack(A.SUBMIT_RESP.format, status, off, echo, start, end)
            self._used(qi, head, self._scatter(wr, resp))
            if status not in (A.Status.OK, A.Status.ABORTED, A.Status.BAD_CONTEXT,
                              A.Status.CONTEXT_FAULTED):
                self.contexts[cid] = True
                self.stats["faults"] += 1
                self._post_event(cid, seq, status, off)
            self._run_submitq(qi)
        self.k.sched.at(end - start, finish)

    def release_held(self) -> None:
        self.hold_submits = False
        for qi in range(A.FIRST_SUBMITQ, len(self.queues)):
            self._run_submitq(qi)


def make_machine(n: int = 1, **kw) -> tuple[FakeKernel, list[FakeVA1]]:
    k = FakeKernel()
    devs = []
    for i in range(n):
        d = FakeVA1(k, **kw)
        k.attach(d, 0x1000_0000 + i * 0x1000, 5 + i)
        devs.append(d)
    return k, devs


def nop_cmdbuf(ncmds: int) -> bytes:
    return b"".join(struct.pack(I.HEADER.format, I.Opcode.NOP, 0, 8) for _ in range(ncmds))


def bad_cmdbuf() -> bytes:
    return nop_cmdbuf(1) + struct.pack(I.HEADER.format, 0x7F, 0, 8)
