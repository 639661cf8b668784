#!/usr/bin/env python3
"""The least row (d)'s null round trip could cost in this Python: a yardstick, not a stack.

Row (d) of `virtaccel bench` times one NOP through every hop of the stack. This script
makes the same hops with the least Python each can take and prints its time against the
bench's bare ring, in the same run: the stream writes the NOP to a HOST buffer and fills
the SUBMIT argument (the real cffi struct of the uAPI); the device file checks the
argument's type, looks up the context and buffer, checks the range and copies the bytes;
the driver keeps a check per exact bytes, takes a copy slot, writes the request and a
three-descriptor chain and publishes it, arms its watchdog and kicks; the MMIO exit
reaches the device; the device pops the chain, checks each descriptor's bounds, reads
the request, decodes the command (kept per bytes), schedules the end in a heap;
completion writes the response and the used entry and raises the line; the guest's wait
delivers the interrupt, reads the ISR, writes the ACK, reaps, signals the fence, and
WAIT fills its argument. Every hop emits the stack's 16 trace events, of the same
sources and kinds, through the real `vmm.trace` (same tracers, same digest machinery);
most carry fewer fields than the stack's (no engine or times on the device's, no task or
reason on wait and wake, no exit flag on MMIO).

What it leaves out is everything that makes the stack a strict, fault-injectable model:
named rules for every field, DMA ports and the IOMMU, fault hooks, several contexts and
queues, the engine's scheduling, deferred work. So the stack can approach this number
but not reach it. Run from the repository root:

    .venv/bin/python tools/null_floor.py [--reps 15]
"""
from __future__ import annotations

import argparse
import heapq
import json
import statistics
import struct
import time
from typing import Any, Callable

import _cffi_backend

from guest_driver import uapi
from virtaccel.bench.ring import BareRing, round_trip
from vmm.scheduler import Scheduler
from vmm.trace import Trace

_DESC = struct.Struct("<QIHH")
_U16 = struct.Struct("<H")
_USED = struct.Struct("<II")
_REQ = struct.Struct("<IIQQ")
_RESP = struct.Struct("<IIQQ")
_RING = 256
_DESC_AT, _AVAIL_AT, _USED_AT = 0x1000, 0x3000, 0x4000
_SLOTS_AT, _HOST_AT = 0x10000, 0x80000
_NOTIFY, _ISR, _ACK = 0x50, 0x60, 0x64
_SUBMIT_T = uapi.ffi.typeof("struct drm_va1_submit *")
_WAIT_T = uapi.ffi.typeof("struct drm_va1_wait *")
_SUBMIT, _WAIT = 1, 2
_typeof = _cffi_backend.typeof   # as the stack's device file asks it (no declaration parse)


class Floor:
    """One guest, one device, one queue: the hops of a null round trip and nothing else."""

    def __init__(self) -> None:
        self.sched = Scheduler()
        self.trace = Trace(self.sched.now_ns)
        tr = self.trace.tracer
        # The stack's sources (its first VM is vm0).
        self.t_kernel, self.t_cpu, self.t_dev = tr("vm0.kernel"), tr("vm0.cpu"), tr("vm0.va1.0")
        self.t_irq, self.t_machine = tr("vm0.irq"), tr("machine")
        self.mem = bytearray(1 << 20)
        self.view = memoryview(self.mem)
        self.heap: list[list[Any]] = []
        self.heap_seq = 0
        self.pending_irq: list[int] = []
        # device side
        self.last_avail = 0
        self.used_idx = 0
        self.decoded: dict[bytes, tuple[str, ...]] = {}
        self.isr = 0
        self.line = 0
        # driver side
        self.free = list(range(_RING))
        self.avail_idx = 0
        self.last_used = 0
        self.seq = 0
        self.inflight: dict[int, tuple[list[int], tuple[int, int, int], int, int]] = {}
        self.slots = list(range(_SLOTS_AT, _SLOTS_AT + 0x8000, 64))
        self.timer: list[Any] | None = None
        self.checked: dict[bytes, bool] = {}
        self.fences: dict[int, list[int]] = {}   # seq -> [done, status]
        # device file
        self.contexts = {1: object()}
        self.bos = {7: (_HOST_AT, 4096)}
        self.queued: list[bytes] = []
        self.results: list[tuple[int, int, int, int]] = []

    # -- machine --------------------------------------------------------------------
    def schedule(self, t: int, fn: Callable[[], None] | None) -> list[Any]:
        self.heap_seq += 1
        entry = [t, self.heap_seq, fn]
        heapq.heappush(self.heap, entry)
        return entry

    def run_until(self, t: int) -> None:
        heap = self.heap
        while heap and heap[0][0] <= t:
            entry = heapq.heappop(heap)
            self.sched._now = entry[0]
            if entry[2] is not None:
                entry[2]()

    def charge(self, ns: int) -> None:
        self.run_until(self.sched._now + ns)
        self.sched._now += ns

    def wait_until(self, cond: Callable[[], bool]) -> None:
        self.t_machine.emit_plain("wait", {"thread": 1})
        while not cond():
            self.run_until(self.sched._now + 1000)
            if self.pending_irq:
                self.pending_irq.clear()
                self.t_irq.emit_plain("irq", {"line": 5})
                self.interrupt()
        self.t_machine.emit_plain("wake", {"thread": 1})

    def guest_write(self, off: int, value: int) -> None:
        self.t_cpu.emit_plain("mmio_write", {"addr": 0x1000 + off, "size": 4, "value": value})
        if off == _NOTIFY:
            self.notified()
        elif off == _ACK:
            self.isr &= ~value
            self.set_line(0)
        self.charge(100)

    def guest_read(self, off: int) -> int:
        value = self.isr
        self.t_cpu.emit_plain("mmio_read", {"addr": 0x1000 + off, "size": 4, "value": value})
        self.charge(100)
        return value

    # -- device ---------------------------------------------------------------------
    def notified(self) -> None:
        mem = self.mem
        (idx,) = _U16.unpack_from(mem, _AVAIL_AT + 2)
        while self.last_avail != idx:
            (head,) = _U16.unpack_from(mem, _AVAIL_AT + 4 + 2 * (self.last_avail % _RING))
            self.last_avail = (self.last_avail + 1) & 0xFFFF
            chain = []
            i = head
            for _ in range(3):
                addr, length, flags, nxt = _DESC.unpack_from(mem, _DESC_AT + 16 * i)
                if addr + length > len(mem) or flags & ~7:
                    raise ValueError(f"descriptor {i} out of bounds")
                chain.append((addr, length))
                i = nxt
                if not flags & 1:
                    break
            ctx, queue, _cb, _cl = _REQ.unpack_from(mem, chain[0][0])
            cmd = bytes(self.view[chain[1][0]:chain[1][0] + chain[1][1]])
            if self.decoded.get(cmd) is None:
                self.decoded[cmd] = ("nop",)
            self.t_dev.emit_plain("submit_start", {"queue": queue, "head": head, "ctx": ctx})
            self.t_dev.emit_plain("cmd", {"op": 0, "offset": 0, "cost": 10})
            resp = chain[2][0]
            self.schedule(self.sched._now + 10, lambda: self.finish(head, resp))

    def finish(self, head: int, resp: int) -> None:
        self.t_dev.emit_plain("submit_end", {"queue": 0, "head": head, "status": 0})
        mem = self.mem
        _RESP.pack_into(mem, resp, 0, 0, 1, 2)
        _USED.pack_into(mem, _USED_AT + 4 + 8 * (self.used_idx % _RING), head, 24)
        self.used_idx = (self.used_idx + 1) & 0xFFFF
        _U16.pack_into(mem, _USED_AT + 2, self.used_idx)
        self.isr |= 1
        self.t_dev.emit_plain("irq", {"vector": 0})
        self.set_line(1)

    def set_line(self, level: int) -> None:
        if level != self.line:
            self.line = level
            self.t_irq.emit_plain("irq_line", {"line": 5, "level": level})
            if level:
                self.pending_irq.append(5)

    # -- driver ---------------------------------------------------------------------
    def submit(self, cmd: bytes) -> int:
        if self.checked.get(cmd) is None:
            self.checked[cmd] = True
        mem = self.mem
        slot = self.slots.pop()
        mem[slot:slot + len(cmd)] = cmd
        self.seq += 1
        fence = [0, 0]
        self.fences[self.seq] = fence
        req, resp = slot + 32, slot + 48
        _REQ.pack_into(mem, req, 1, 0, slot, len(cmd))
        free = self.free
        h0, h1, h2 = free.pop(), free.pop(), free.pop()
        _DESC.pack_into(mem, _DESC_AT + 16 * h0, req, 24, 1, h1)
        _DESC.pack_into(mem, _DESC_AT + 16 * h1, slot, len(cmd), 1, h2)
        _DESC.pack_into(mem, _DESC_AT + 16 * h2, resp, 24, 2, 0)
        _U16.pack_into(mem, _AVAIL_AT + 4 + 2 * (self.avail_idx % _RING), h0)
        self.avail_idx = (self.avail_idx + 1) & 0xFFFF
        _U16.pack_into(mem, _AVAIL_AT + 2, self.avail_idx)
        self.inflight[h0] = (fence, (h0, h1, h2), slot, resp)
        if self.timer is None:
            self.timer = self.schedule(self.sched._now + 10**9, None)
        self.t_kernel.emit_plain("kick", {"queue": 0, "avail": self.avail_idx})
        self.guest_write(_NOTIFY, 0)
        return self.seq

    def interrupt(self) -> None:
        self.guest_write(_ACK, self.guest_read(_ISR))
        mem = self.mem
        (idx,) = _U16.unpack_from(mem, _USED_AT + 2)
        while self.last_used != idx:
            head, length = _USED.unpack_from(mem, _USED_AT + 4 + 8 * (self.last_used % _RING))
            self.last_used = (self.last_used + 1) & 0xFFFF
            fence, heads, slot, resp = self.inflight.pop(head)
            self.free.extend(heads)
            self.t_kernel.emit_plain("reap", {"queue": 0, "head": head, "len": length})
            if not self.inflight and self.timer is not None:
                self.timer[2] = None
                self.timer = None
            status = _RESP.unpack_from(mem, resp)[0]
            fence[0], fence[1] = 1, status
            self.t_kernel.emit_plain("fence_signal", {"ctx": 1, "seq": self.seq, "status": status})
            self.slots.append(slot)

    def wait(self, seq: int) -> list[int]:
        fence = self.fences.pop(seq)
        self.t_kernel.emit_plain("wait", {"ctx": 1, "seq": seq})
        if not fence[0]:
            self.wait_until(lambda: bool(fence[0]))
        return fence

    # -- device file and runtime ----------------------------------------------------
    def ioctl(self, request: int, arg: Any) -> None:
        if request == _SUBMIT:
            # the integer fields of a cffi struct read as Python ints: no int() needed
            if _typeof(arg) is not _SUBMIT_T or self.contexts.get(
                    arg.context_id) is None or arg.queue >= 4:
                raise OSError("SUBMIT: bad argument")
            addr, size_max = self.bos[arg.cmdbuf_handle]
            off, size = arg.cmdbuf_offset, arg.cmdbuf_size
            if size == 0 or size % 8 or off + size > size_max:
                raise OSError("SUBMIT: bad range")
            arg.fence_seq = self.submit(bytes(self.view[addr + off:addr + off + size]))
        else:
            if _typeof(arg) is not _WAIT_T:
                raise OSError("WAIT: bad argument")
            fence = self.wait(arg.fence_seq)
            arg.status, arg.error_offset, arg.start_ns, arg.end_ns = fence[1], 0, 0, 0

    def enqueue_and_synchronize(self, cmd: bytes) -> None:
        self.queued.append(cmd)
        data = b"".join(self.queued)
        self.queued.clear()
        self.mem[_HOST_AT:_HOST_AT + len(data)] = data
        a: Any = uapi.ffi.new(_SUBMIT_T)
        a.context_id, a.queue, a.cmdbuf_handle = 1, 0, 7
        a.cmdbuf_offset, a.cmdbuf_size, a.buffer_count = 0, len(data), 0
        self.ioctl(_SUBMIT, a)
        w: Any = uapi.ffi.new(_WAIT_T)
        w.context_id, w.fence_seq, w.timeout_ns = 1, a.fence_seq, -1
        self.ioctl(_WAIT, w)
        result = (w.status, w.error_offset, w.start_ns, w.end_ns)   # ints, as cffi reads them
        if result[0] != 0:
            raise RuntimeError(f"NOP failed with status {result[0]}")
        self.results.append(result)
        if len(self.results) > 64:
            self.results.clear()


def measure(reps: int = 15, stack_loops: int = 300, bare_loops: int = 1000
            ) -> dict[str, float]:
    """Medians over `reps` alternating blocks: the floor's round trip and the bare ring's."""
    floor = Floor()
    nop = bytes(8)
    for _ in range(100):
        floor.enqueue_and_synchronize(nop)
    ring = BareRing()
    pc = time.perf_counter
    floor_t, bare_t = [], []
    for _ in range(reps):
        t0 = pc()
        for _ in range(bare_loops):
            round_trip(ring)
        bare_t.append((pc() - t0) / bare_loops)
        t0 = pc()
        for _ in range(stack_loops):
            floor.enqueue_and_synchronize(nop)
        floor_t.append((pc() - t0) / stack_loops)
    f, b = statistics.median(floor_t), statistics.median(bare_t)
    return {"floor_us": round(f * 1e6, 2), "bare_ring_us": round(b * 1e6, 2),
            "ratio": round(f / b, 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=15)
    print(json.dumps(measure(ap.parse_args().reps)))


if __name__ == "__main__":
    main()
