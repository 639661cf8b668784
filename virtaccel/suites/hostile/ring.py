"""Split-ring scenarios (virtio 1.x §2.7, VA-1 spec §4): descriptor tables, avail and
used rings written by hand on the attacker's own queues."""
from __future__ import annotations

import struct
from typing import Callable

from hwspec import isa
from hwspec import va1 as A
from hwspec import virtio as V

from .core import Attack, Scenario, Setup
from .raw import BASE_FEATURES, QUEUE_SIZE, RawQueue, cmd

CAT = "split ring"
SETTLE_NS = 200_000
UNBACKED = 0x7_0000_0000          # far past any VM's RAM, never mapped
WRAP = (1 << 64) - 0x10

QUEUES = {"controlq": A.CONTROLQ, "submitq": A.FIRST_SUBMITQ}
# Ring rules whose breach the device must answer with DEVICE_NEEDS_RESET (spec §4): a
# scenario breaking one of them checks the status bit, so a device that lets the chain
# through is caught even when nothing else goes wrong.
FENCING = frozenset({"ring/head-range", "ring/next-range", "ring/write-before-read",
                     "ring/avail-idx-jump"})


def _submit_bufs(a: Attack) -> tuple[int, int]:
    """A well-formed submission (request, response) whose command buffer is a NOP."""
    cb = a.dev.buffer(cmd(isa.Opcode.NOP))
    req = a.dev.buffer(struct.pack(A.SUBMIT_REQ.format, a.ctx or 1, 0, cb, 8, 0, 99))
    resp = a.dev.buffer(A.SUBMIT_RESP.size)
    return req, resp


def _ctrl_bufs(a: Attack) -> tuple[int, int]:
    req = a.dev.buffer(struct.pack(A.CTRL_REQ.format, A.CtrlType.GET_STATS, 0, 0, 0))
    resp = a.dev.buffer(A.STATS_RESP.size)
    return req, resp


def _bufs(a: Attack, qi: int) -> tuple[int, int, int, int]:
    req, resp = _ctrl_bufs(a) if qi == A.CONTROLQ else _submit_bufs(a)
    rlen = A.CTRL_REQ.size if qi == A.CONTROLQ else A.SUBMIT_REQ.size
    wlen = A.STATS_RESP.size if qi == A.CONTROLQ else A.SUBMIT_RESP.size
    return req, rlen, resp, wlen


def _kick(a: Attack, q: RawQueue, head: int | None) -> None:
    if head is not None:
        q.put_avail(head)
    a.dev.t.notify(q.index)
    q.wait_used(SETTLE_NS)


Craft = Callable[[Attack, RawQueue, int, int, int, int], int | None]
"""(attack, queue, req, req len, resp, resp len) -> the head to publish (None: the
craft published by itself)."""


def _ring(name: str, rule: str, doc: str, craft: Craft, queues: tuple[str, ...] = ("submitq",),
          features: int = BASE_FEATURES) -> list[Scenario]:
    out = []
    for qname in queues:
        qi = QUEUES[qname]

        def program(a: Attack, qi: int = qi) -> None:
            if features != BASE_FEATURES:
                a.dev.bring_up(features)
                a.ctx = a.dev.create_context()
            q = a.dev.queues[qi]
            req, rlen, resp, wlen = _bufs(a, qi)
            head = craft(a, q, req, rlen, resp, wlen)
            _kick(a, q, head)
            if rule in FENCING and not a.dev.needs_reset():
                a.breach(rule, f"no DEVICE_NEEDS_RESET after a chain breaking {rule} (spec §4)")
        out.append(Scenario(f"ring/{name}/{qname}", CAT, rule, program, doc=doc))
    return out


def _chain(q: RawQueue, descs: list[tuple[int, int, int, int]], start: int = 0) -> int:
    for i, (addr, length, flags, nxt) in enumerate(descs):
        q.write_desc(start + i, addr, length, flags, nxt)
    return start


def _loop(n: int) -> Craft:
    def craft(a: Attack, q: RawQueue, req: int, rlen: int, resp: int, wlen: int) -> int:
        descs = [(req, rlen, V.DESC_F_NEXT, (i + 1) % n) for i in range(n)]
        return _chain(q, descs)
    return craft


def _next_to(nxt: int) -> Craft:
    def craft(a: Attack, q: RawQueue, req: int, rlen: int, resp: int, wlen: int) -> int:
        return _chain(q, [(req, rlen, V.DESC_F_NEXT, nxt)])
    return craft


def _head(head: int) -> Craft:
    def craft(a: Attack, q: RawQueue, req: int, rlen: int, resp: int, wlen: int) -> int:
        _chain(q, [(req, rlen, V.DESC_F_NEXT, 1), (resp, wlen, V.DESC_F_WRITE, 0)])
        return head
    return craft


def _descs(*shape: tuple[str, int, int]) -> Craft:
    """A chain from ("req"|"resp"|"unbacked"|"wrap", length or -1 = natural, flags)."""
    def craft(a: Attack, q: RawQueue, req: int, rlen: int, resp: int, wlen: int) -> int:
        descs = []
        for i, (what, length, flags) in enumerate(shape):
            addr = {"req": req, "resp": resp, "unbacked": UNBACKED, "wrap": WRAP}[what]
            natural = rlen if what == "req" else wlen
            last = i == len(shape) - 1
            descs.append((addr, natural if length < 0 else length,
                          flags | (0 if last else V.DESC_F_NEXT), i + 1))
        return _chain(q, descs)
    return craft


def _indirect(kind: str) -> Craft:
    def craft(a: Attack, q: RawQueue, req: int, rlen: int, resp: int, wlen: int) -> int:
        table = a.dev.alloc.alloc(16 * 8, 16)
        good = [(req, rlen, V.DESC_F_NEXT, 1), (resp, wlen, V.DESC_F_WRITE, 0)]
        entries, tlen, flags = good, 32, V.DESC_F_INDIRECT
        taddr = table
        if kind == "nested":
            entries = [(table, 32, V.DESC_F_INDIRECT, 0)]
            tlen = 16
        elif kind == "with-next":
            flags |= V.DESC_F_NEXT
        elif kind == "zero-len":
            tlen = 0
        elif kind == "odd-len":
            tlen = 24
        elif kind == "unbacked":
            taddr = UNBACKED
        elif kind == "wrap":
            taddr = WRAP
        elif kind == "loop":
            entries = [(req, rlen, V.DESC_F_NEXT, 1), (resp, wlen, V.DESC_F_NEXT, 0)]
        elif kind == "next-range":
            entries = [(req, rlen, V.DESC_F_NEXT, 9), (resp, wlen, V.DESC_F_WRITE, 0)]
        elif kind == "huge":
            tlen = 16 * 0x10000
        for i, (addr, length, fl, nxt) in enumerate(entries):
            q.write_desc(i, addr, length, fl, nxt, table=table)
        q.write_desc(0, taddr, tlen, flags, 1)
        return 0
    return craft


def _avail_jump(delta: int) -> Craft:
    def craft(a: Attack, q: RawQueue, req: int, rlen: int, resp: int, wlen: int) -> None:
        _chain(q, [(req, rlen, V.DESC_F_NEXT, 1), (resp, wlen, V.DESC_F_WRITE, 0)])
        q.set_avail_idx(q.avail_idx + delta)
        return None
    return craft


def _same_head_twice(a: Attack, q: RawQueue, req: int, rlen: int, resp: int, wlen: int) -> None:
    _chain(q, [(req, rlen, V.DESC_F_NEXT, 1), (resp, wlen, V.DESC_F_WRITE, 0)])
    q.put_avail(0)
    q.put_avail(0)
    q.put_avail(0)
    return None


def _whole_ring(a: Attack, q: RawQueue, req: int, rlen: int, resp: int, wlen: int) -> None:
    """Every descriptor is one two-buffer chain's head: size entries in flight at once."""
    for h in range(0, q.size, 2):
        q.write_desc(h, req, rlen, V.DESC_F_NEXT, h + 1)
        q.write_desc(h + 1, resp, wlen, V.DESC_F_WRITE, 0)
    for h in range(q.size):
        q.put_avail(h & ~1)
    return None


def _relocate(area: str, where: str) -> Callable[[Attack], None]:
    """Re-do bring-up with one ring area somewhere hostile, then use the queue."""
    def program(a: Attack) -> None:
        def move(dev: object) -> None:
            q = a.dev.queues[A.FIRST_SUBMITQ]
            addrs = {"desc": q.desc, "avail": q.avail, "used": q.used}
            addrs[area] = {"unbacked": UNBACKED, "wrap": WRAP & ~0xF, "avail": q.avail & ~0xF,
                           "misaligned": addrs[area] + 2, "mmio": 0xD000_0000,
                           "zero": 0}[where]
            a.dev.t.setup_queue(q.index, q.size, addrs["desc"], addrs["avail"], addrs["used"])
        a.dev.bring_up(before_ok=move)
        a.ctx = a.dev.create_context()
        if a.ctx is not None:
            a.dev.submit(a.ctx, cmd(isa.Opcode.NOP), timeout_ns=SETTLE_NS)
    return program


def _queue_size(size: int) -> Callable[[Attack], None]:
    def program(a: Attack) -> None:
        def resize(dev: object) -> None:
            q = a.dev.queues[A.FIRST_SUBMITQ]
            a.dev.t.setup_queue(q.index, size, q.desc, q.avail, q.used)
        a.dev.bring_up(before_ok=resize)
        a.ctx = a.dev.create_context()
        if a.ctx is not None:
            a.dev.submit(a.ctx, cmd(isa.Opcode.NOP), timeout_ns=SETTLE_NS)
    return program


def _notify_storm(n: int) -> Callable[[Attack], None]:
    def program(a: Attack) -> None:
        for i in range(n):
            a.dev.t.notify(A.FIRST_SUBMITQ + i % 2)
    return program


def _eventq(kind: str) -> Callable[[Attack], None]:
    """Hostile eventq buffers, then a fault that needs an event posted."""
    def program(a: Attack) -> None:
        q = a.dev.queues[A.EVENTQ]
        buf = a.dev.buffer(64)
        if kind == "readable":
            q.put_avail(q.add([(buf, 64, False)]))
        elif kind == "short":
            q.put_avail(q.add([(buf, 4, True)]))
        elif kind == "unbacked":
            q.put_avail(q.add([(UNBACKED, 64, True)]))
        elif kind == "loop":
            q.write_desc(0, buf, 64, V.DESC_F_WRITE | V.DESC_F_NEXT, 0)
            q.put_avail(0)
        a.dev.t.notify(A.EVENTQ)
        if a.ctx is not None:
            a.dev.submit(a.ctx, cmd(0x7F), timeout_ns=SETTLE_NS)
    return program


def _used_overwrites(a: Attack) -> None:
    """The driver scribbles on the used ring and its own avail ring while requests fly."""
    q = a.dev.queues[A.FIRST_SUBMITQ]
    req, rlen, resp, wlen = _bufs(a, q.index)
    for i in range(4):
        q.put_avail(q.add([(req, rlen, False), (resp, wlen, True)]))
    a.dev.t.notify(q.index)
    a.dev.mem.write(q.used, b"\xff" * 64)
    a.dev.mem.write(q.avail + 4, b"\xff" * 8)
    a.sleep(SETTLE_NS)


def catalogue() -> list[Scenario]:
    both = ("controlq", "submitq")
    out: list[Scenario] = []
    out += _ring("loop-self", "ring/loop", "a descriptor whose next is itself", _loop(1), both)
    out += _ring("loop-2", "ring/loop", "two descriptors pointing at each other", _loop(2), both)
    out += _ring("loop-full", "ring/loop", "a cycle through the whole table",
                 _loop(QUEUE_SIZE), both)
    for nxt in (QUEUE_SIZE, 0xFFFF):
        out += _ring(f"next-range-{nxt:#x}", "ring/next-range", f"next = {nxt}",
                     _next_to(nxt), both)
    for head in (QUEUE_SIZE, QUEUE_SIZE + 1, 0xFFFF):
        out += _ring(f"head-range-{head:#x}", "ring/head-range", f"avail head {head}",
                     _head(head), both)
    out += _ring("zero-len-req", "BAD_REQUEST", "request descriptor of length 0",
                 _descs(("req", 0, 0), ("resp", -1, V.DESC_F_WRITE)), both)
    out += _ring("zero-len-resp", "BAD_REQUEST", "response descriptor of length 0",
                 _descs(("req", -1, 0), ("resp", 0, V.DESC_F_WRITE)), both)
    out += _ring("readable-only", "BAD_REQUEST", "no device-writable buffer",
                 _descs(("req", -1, 0)), both)
    out += _ring("writable-only", "BAD_REQUEST", "no device-readable buffer",
                 _descs(("resp", -1, V.DESC_F_WRITE)), both)
    out += _ring("short-req", "BAD_REQUEST", "request shorter than its structure",
                 _descs(("req", 4, 0), ("resp", -1, V.DESC_F_WRITE)), both)
    out += _ring("write-before-read", "ring/write-before-read",
                 "a readable descriptor after a writable one",
                 _descs(("resp", -1, V.DESC_F_WRITE), ("req", -1, 0)), both)
    out += _ring("buffer-unbacked", "ring/dma", "a buffer outside guest RAM",
                 _descs(("unbacked", 64, 0), ("resp", -1, V.DESC_F_WRITE)), both)
    out += _ring("buffer-wraps", "ring/addr-overflow", "a buffer wrapping 2^64",
                 _descs(("wrap", 64, 0), ("resp", -1, V.DESC_F_WRITE)), both)
    out += _ring("resp-unbacked", "ring/dma", "the response buffer outside guest RAM",
                 _descs(("req", -1, 0), ("unbacked", 64, V.DESC_F_WRITE)), both)
    out += _ring("huge-len", "ring/dma", "a 4 GiB descriptor",
                 _descs(("req", 0xFFFF_FFFF, 0), ("resp", -1, V.DESC_F_WRITE)))
    for kind in ("nested", "with-next", "zero-len", "odd-len", "unbacked", "wrap", "loop",
                 "next-range", "huge"):
        rule = {"nested": "ring/indirect-nested", "with-next": "ring/indirect-next",
                "zero-len": "ring/indirect-len", "odd-len": "ring/indirect-len",
                "unbacked": "ring/dma", "wrap": "ring/addr-overflow", "loop": "ring/loop",
                "next-range": "ring/next-range", "huge": "ring/dma"}[kind]
        out += _ring(f"indirect-{kind}", rule, f"indirect table: {kind}", _indirect(kind))
    out += _ring("indirect-not-negotiated", "ring/indirect-not-negotiated",
                 "INDIRECT without the feature", _indirect("ok"),
                 features=BASE_FEATURES & ~(1 << V.F_RING_INDIRECT_DESC))
    for delta in (QUEUE_SIZE + 1, 0x8000, 0xFFFF):
        out += _ring(f"avail-jump-{delta:#x}", "ring/avail-idx-jump",
                     f"avail.idx moved by {delta}", _avail_jump(delta), both)
    out += _ring("same-head-thrice", "ring/in-flight", "one head made available three times",
                 _same_head_twice)
    out += _ring("whole-ring", "ring/in-flight", "every descriptor in flight at once",
                 _whole_ring)
    for area in ("used", "avail", "desc"):
        for where in ("unbacked", "wrap", "mmio", "zero"):
            out.append(Scenario(f"ring/{area}-at-{where}", CAT,
                                "ring/dma" if where != "wrap" else "ring/addr-overflow",
                                _relocate({"used": "used", "avail": "avail",
                                           "desc": "desc"}[area], where),
                                setup=Setup.RAW, doc=f"{area} area at a {where} address"))
        out.append(Scenario(f"ring/{area}-misaligned", CAT, "queue/alignment",
                            _relocate(area, "misaligned"), setup=Setup.RAW,
                            doc=f"{area} area not aligned"))
    out.append(Scenario("ring/used-over-avail", CAT, "ring/overlap",
                        _relocate("used", "avail"), setup=Setup.RAW,
                        doc="the device area on top of the driver area"))
    out.append(Scenario("ring/desc-over-avail", CAT, "ring/overlap",
                        _relocate("desc", "avail"), setup=Setup.RAW,
                        doc="the descriptor table on top of the driver area"))
    for size in (0, 3, 100, 257, 0xFFFF):
        out.append(Scenario(f"ring/queue-size-{size}", CAT, "queue/size", _queue_size(size),
                            setup=Setup.RAW, doc=f"queue size {size}"))
    out.append(Scenario("ring/notify-storm", CAT, "queue/notify", _notify_storm(2000),
                        doc="2000 notifications with nothing available"))
    for kind in ("readable", "short", "unbacked", "loop"):
        out.append(Scenario(f"ring/eventq-{kind}", CAT,
                            "ring/loop" if kind == "loop" else "event/bad-buffer",
                            _eventq(kind), doc=f"eventq buffer {kind}, then a context fault"))
    out.append(Scenario("ring/scribble-used", CAT, "ring/used", _used_overwrites,
                        doc="the driver overwrites the used ring while requests fly"))
    return out
