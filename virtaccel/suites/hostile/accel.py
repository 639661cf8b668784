"""Accelerator scenarios (VA-1 spec §6-§8): command buffers, DMA and the IOMMU, context
address spaces, CALL, QoS flooding, and TOCTOU on a command buffer being read."""
from __future__ import annotations

import struct
from typing import Callable

from hwspec import isa
from hwspec import va1 as A

from .core import Attack, Scenario
from .raw import RawQueue, cmd

CAT = "accelerator"
O = isa.Opcode
UNMAPPED = 0x7_0000_0000
SETTLE_NS = 2_000_000
FAR = 1 << 40


def _shoot(raw: Callable[..., bytes], expect: str | None = None) -> Callable[[Attack], None]:
    """Submit one crafted buffer; `expect`: the status the datasheet gives it (a different
    completion status is a breach the guest sees)."""
    def program(a: Attack) -> None:
        assert a.ctx is not None
        r = a.dev.submit(a.ctx, raw(a), timeout_ns=SETTLE_NS)
        if r is not None:
            a.statuses.append(r.name)
            if expect is not None and r.name != expect:
                a.breach("cmd/status", f"completed {r.name}, the datasheet says {expect}")
    return program


def _mem(a: Attack) -> int:
    """The attacker function's device memory size (its config space)."""
    return int(a.dev.t.read_config(A.CONFIG.offsets["device_memory_size"], 4)) | \
        int(a.dev.t.read_config(A.CONFIG.offsets["device_memory_size"] + 4, 4)) << 32


def catalogue() -> list[Scenario]:
    out: list[Scenario] = []

    def add(name: str, rule: str, raw: Callable[..., bytes], doc: str) -> None:
        out.append(Scenario(f"cmd/{name}", CAT, rule,
                            _shoot(raw, rule if rule in A.Status.__members__ else None),
                            doc=doc))

    for op in (0x05, 0x7F, 0x29, 0xFFFF):
        add(f"opcode-{op:#x}", "BAD_OPCODE", lambda a, op=op: cmd(op), f"opcode {op:#x}")
    for length in (0, 4, 12, 0xFFFF_FFF8):
        add(f"nop-length-{length:#x}", "TRUNCATED" if length > 8 else "BAD_LENGTH",
            lambda a, n=length: cmd(O.NOP, length=n), f"NOP with header length {length}")
    add("fill-length-short", "BAD_LENGTH", lambda a: cmd(O.FILL, length=16, dst=0, size=8),
        "FILL whose length leaves out its payload")
    add("gemm-truncated", "TRUNCATED", lambda a: cmd(O.GEMM, m=4, n=4, k=4)[:24],
        "GEMM cut short by the end of the buffer")
    add("gemm-bad-flags", "BAD_ARG", lambda a: cmd(O.GEMM, flags=0x80, m=4, n=4, k=4),
        "GEMM with unknown flags")
    add("fill-reserved", "BAD_ARG", lambda a: cmd(O.FILL, dst=0, size=8, reserved=1),
        "FILL with a reserved field set")
    # out of partition, overflows
    add("fill-past-end", "OUT_OF_BOUNDS", lambda a: cmd(O.FILL, dst=_mem(a) - 64, size=4096),
        "FILL across the end of the partition")
    add("fill-far", "OUT_OF_BOUNDS", lambda a: cmd(O.FILL, dst=FAR, size=64),
        "FILL at 1 TiB")
    add("fill-size-wraps", "OUT_OF_BOUNDS",
        lambda a: cmd(O.FILL, dst=64, size=(1 << 64) - 64), "FILL dst + size wraps 2^64")
    add("d2d-past-end", "OUT_OF_BOUNDS",
        lambda a: cmd(O.DMA_D2D, src=0, dst=_mem(a) - 8, size=4096), "DMA_D2D past the end")
    add("d2d-src-far", "OUT_OF_BOUNDS",
        lambda a: cmd(O.DMA_D2D, src=(1 << 64) - 8, dst=0, size=64), "DMA_D2D from 2^64-8")
    add("gemm-c-far", "OUT_OF_BOUNDS",
        lambda a: cmd(O.GEMM, m=4, n=4, k=4, a=0, b=0, c=FAR, alpha=1.0), "GEMM C at 1 TiB")
    add("gemm-dims-overflow", "BAD_SHAPE",
        lambda a: cmd(O.GEMM, m=0xFFFF_FFFF, n=0xFFFF_FFFF, k=0xFFFF_FFFF, alpha=1.0),
        "GEMM with 2^32-1 in every dimension")
    add("gemm-zero-dim", "BAD_SHAPE", lambda a: cmd(O.GEMM, m=0, n=4, k=4, alpha=1.0),
        "GEMM with m = 0")
    add("gemm-bad-dtype", "BAD_DTYPE", lambda a: cmd(O.GEMM, dtype=9, m=4, n=4, k=4),
        "GEMM with dtype 9")
    add("gemm-bad-activation", "BAD_ARG",
        lambda a: cmd(O.GEMM, activation=77, m=4, n=4, k=4, alpha=1.0), "GEMM activation 77")
    add("elementwise-count-huge", "BAD_ARG",
        lambda a: cmd(O.ELEMENTWISE, op=0, dtype=0, cols=1, count=1 << 62, a=0, b=0, out=0),
        "ELEMENTWISE over 2^62 elements")
    add("elementwise-bad-op", "BAD_ARG",
        lambda a: cmd(O.ELEMENTWISE, op=99, dtype=0, cols=1, count=4), "ELEMENTWISE op 99")
    add("conv-zero-stride", "BAD_SHAPE",
        lambda a: cmd(O.CONV2D, groups=1, n=1, c=1, h=4, w=4, k=1, r=1, s=1, stride_h=0,
                      stride_w=0, dilation_h=1, dilation_w=1), "CONV2D with stride 0")
    add("conv-far", "OUT_OF_BOUNDS",
        lambda a: cmd(O.CONV2D, groups=1, n=1, c=1, h=4, w=4, k=1, r=1, s=1, stride_h=1,
                      stride_w=1, dilation_h=1, dilation_w=1, y=FAR), "CONV2D output at 1 TiB")
    add("conv-groups-zero", "BAD_SHAPE",
        lambda a: cmd(O.CONV2D, groups=0, n=1, c=1, h=4, w=4, k=1, r=1, s=1, stride_h=1,
                      stride_w=1, dilation_h=1, dilation_w=1), "CONV2D with 0 groups")
    add("copy-stride-overflow", "BAD_SHAPE",
        lambda a: cmd(O.COPY, dtype=0, ndim=2, shape0=2, shape1=2,
                      src_stride0=(1 << 63), src_stride1=4, dst_stride0=8, dst_stride1=4),
        "COPY with a 2^63 source stride")
    add("copy-ndim-9", "BAD_ARG", lambda a: cmd(O.COPY, dtype=0, ndim=9, shape0=1),
        "COPY with 9 dimensions")
    add("softmax-far", "OUT_OF_BOUNDS",
        lambda a: cmd(O.SOFTMAX, dtype=0, rows=1, cols=16, x=0, y=FAR), "SOFTMAX output far")
    add("layernorm-zero", "BAD_SHAPE", lambda a: cmd(O.LAYERNORM, dtype=0, rows=0, cols=0),
        "LAYERNORM with no rows")
    add("reduce-bad-op", "BAD_ARG", lambda a: cmd(O.REDUCE, op=9, dtype=0, rows=1, cols=1),
        "REDUCE op 9")
    add("quantize-bad-dtype", "BAD_DTYPE",
        lambda a: cmd(O.QUANTIZE, dtype=0, int_dtype=0, count=4, scale=1.0),
        "QUANTIZE to a float dtype")
    # host IOVAs
    add("h2d-unmapped", "DMA_FAULT",
        lambda a: cmd(O.DMA_H2D, src=UNMAPPED, dst=0, size=4096), "DMA_H2D from unmapped IOVA")
    add("d2h-unmapped", "DMA_FAULT",
        lambda a: cmd(O.DMA_D2H, src=0, dst=UNMAPPED, size=4096), "DMA_D2H to unmapped IOVA")
    add("d2h-wraps", "DMA_FAULT",
        lambda a: cmd(O.DMA_D2H, src=0, dst=(1 << 64) - 64, size=4096), "DMA_D2H wraps 2^64")
    add("d2h-straddles-ram-end", "DMA_FAULT",
        lambda a: cmd(O.DMA_D2H, src=0, dst=a.kernel.ram.base + a.kernel.ram.size - 64,
                      size=4096), "DMA_D2H across the end of guest RAM")
    add("signal-unmapped", "DMA_FAULT", lambda a: cmd(O.SIGNAL, addr=1 << 63, value=1),
        "SIGNAL to 2^63")
    add("timestamp-unmapped", "BAD_OPCODE", lambda a: cmd(O.TIMESTAMP, addr=UNMAPPED),
        "TIMESTAMP (not negotiated) to an unmapped IOVA")
    add("wait-unmapped", "DMA_FAULT", lambda a: cmd(O.WAIT, addr=UNMAPPED, value=1),
        "WAIT on an unmapped IOVA")
    add("signal-into-own-ring", "PASS",
        lambda a: cmd(O.SIGNAL, addr=a.dev.queues[A.FIRST_SUBMITQ].used, value=(1 << 64) - 1),
        "SIGNAL over the attacker's own used ring (its own reach)")
    # CALL
    def call_self(a: Attack) -> bytes:
        addr = a.dev.alloc.alloc(64, 64)
        body = cmd(O.CALL, addr=addr, size=24)
        a.dev.mem.write(addr, body)
        return body
    add("call-self", "CALL_DEPTH", call_self, "a buffer that CALLs itself")

    def call_chain(a: Attack) -> bytes:
        depth = a.dev.t.read_config(A.CONFIG.offsets["max_call_depth"], 4)
        base = a.dev.alloc.alloc(64 * (depth + 3), 64)
        for i in range(depth + 2):
            a.dev.mem.write(base + 64 * i, cmd(O.CALL, addr=base + 64 * (i + 1), size=24))
        a.dev.mem.write(base + 64 * (depth + 2), cmd(O.NOP))
        return cmd(O.CALL, addr=base, size=24)
    add("call-too-deep", "CALL_DEPTH", call_chain, "CALLs nested one deeper than allowed")
    add("call-unmapped", "DMA_FAULT", lambda a: cmd(O.CALL, addr=UNMAPPED, size=64),
        "CALL into an unmapped IOVA")
    add("call-size-zero", "BAD_SHAPE", lambda a: cmd(O.CALL, addr=a.kernel.ram.base, size=0),
        "CALL of 0 bytes")
    add("call-size-odd", "BAD_SHAPE", lambda a: cmd(O.CALL, addr=a.kernel.ram.base, size=12),
        "CALL of 12 bytes")
    add("call-huge", "CMDBUF_TOO_LARGE",
        lambda a: cmd(O.CALL, addr=a.kernel.ram.base, size=0xFFFF_FFF8), "CALL of 4 GiB")

    def call_fanout(a: Attack) -> bytes:
        leaf = a.dev.alloc.alloc(1 << 16, 64)
        a.dev.mem.write(leaf, cmd(O.NOP, length=1 << 16) + bytes((1 << 16) - 8))
        return cmd(O.CALL, addr=leaf, size=1 << 16) * 200
    add("call-expansion", "CMDBUF_TOO_LARGE", call_fanout,
        "200 CALLs of a 64 KiB buffer (past the expansion bound)")

    # submissions
    def submit(ctx: int | None = None, length: int = 8, addr: int | None = None, flags: int = 0,
               reserved: int = 0) -> Callable[[Attack], None]:
        def program(a: Attack) -> None:
            buf = a.dev.buffer(cmd(O.NOP) * 4)
            r = a.dev.submit_raw((a.ctx or 0) if ctx is None else ctx,
                                 buf if addr is None else addr, length, flags=flags,
                                 reserved=reserved, timeout_ns=SETTLE_NS)
            if r is not None:
                a.statuses.append(r.name)
        return program
    for name, kw, rule in (("cmdbuf-len-0", {"length": 0}, "BAD_REQUEST"),
                           ("cmdbuf-len-odd", {"length": 12}, "BAD_REQUEST"),
                           ("cmdbuf-too-large", {"length": 0xFFFF_FFF8}, "CMDBUF_TOO_LARGE"),
                           ("cmdbuf-unmapped", {"addr": UNMAPPED}, "DMA_FAULT"),
                           ("cmdbuf-wraps", {"addr": (1 << 64) - 8, "length": 16}, "DMA_FAULT"),
                           ("context-0", {"ctx": 0}, "BAD_CONTEXT"),
                           ("context-unknown", {"ctx": 999}, "BAD_CONTEXT"),
                           ("context-max", {"ctx": 0xFFFF_FFFF}, "BAD_CONTEXT"),
                           ("submit-flags", {"flags": 1}, "BAD_REQUEST"),
                           ("submit-reserved", {"reserved": 1}, "BAD_REQUEST")):
        out.append(Scenario(f"cmd/{name}", CAT, rule, submit(**kw), doc=name.replace("-", " ")))

    def faulted_context(a: Attack) -> None:
        assert a.ctx is not None
        a.dev.submit(a.ctx, cmd(0x7F), timeout_ns=SETTLE_NS)
        for _ in range(5):
            r = a.dev.submit(a.ctx, cmd(O.NOP), timeout_ns=SETTLE_NS)
            if r is not None and r.status == A.Status.OK:
                a.breach("context/faulted", "a faulted context ran more work")
    out.append(Scenario("cmd/faulted-context-keeps-submitting", CAT, "CONTEXT_FAULTED",
                        faulted_context))

    # contexts
    def ctx_flood(a: Attack) -> None:
        for _ in range(A.DEFAULT_VF_MAX_CONTEXTS * 5):
            if a.dev.ctrl(A.CtrlType.CONTEXT_CREATE, 0, A.CTX_CREATE_FLAT, 0) is None:
                break
    out.append(Scenario("ctx/create-exhaust", CAT, "NO_RESOURCES", ctx_flood,
                        doc="create contexts until refused"))
    for name, args in (("destroy-unknown", (A.CtrlType.CONTEXT_DESTROY, 4242, 0, 0)),
                       ("create-bad-flags", (A.CtrlType.CONTEXT_CREATE, 0, 0xFF, 0)),
                       ("create-reserved", (A.CtrlType.CONTEXT_CREATE, 0, 0, 1)),
                       ("ctrl-type-99", (99, 0, 0, 0)),
                       ("stats-flags", (A.CtrlType.GET_STATS, 0, 1, 0))):
        out.append(Scenario(f"ctx/{name}", CAT, "BAD_REQUEST",
                            lambda a, args=args: a.dev.ctrl(*args) and None,
                            doc=name.replace("-", " ")))

    def ctx_map(va: int, pa: int, size: int, flags: int) -> Callable[[Attack], None]:
        def program(a: Attack) -> None:
            r = a.dev.ctrl(A.CtrlType.CONTEXT_CREATE, 0, 0, 0)
            if r is None:
                return
            cid = r[1]
            req = a.dev.buffer(struct.pack(A.CTX_MAP_REQ.format, A.CtrlType.CONTEXT_MAP, cid,
                                           flags, 0, va, pa, size))
            resp = a.dev.buffer(A.STATS_RESP.size)
            a.dev.request(A.CONTROLQ, [(req, A.CTX_MAP_REQ.size, False),
                                       (resp, A.STATS_RESP.size, True)])
            # then touch what should be out of reach through it
            a.dev.submit(cid, cmd(O.FILL, dst=va, size=min(size, 4096) or 8, pattern=0xBAD),
                         timeout_ns=SETTLE_NS)
        return program
    for name, va, pa, size, flags in (
            ("map-past-partition", 0, 0, FAR, 3), ("map-pa-far", 0, FAR, 4096, 3),
            ("map-wraps", (1 << 64) - 4096, 0, 8192, 3), ("map-unaligned", 12, 0, 4096, 3),
            ("map-zero-size", 0, 0, 0, 3), ("map-bad-flags", 0, 0, 4096, 0xFF),
            ("map-no-access", 0, 0, 4096, 0)):
        out.append(Scenario(f"ctx/{name}", CAT, "ctx/map", ctx_map(va, pa, size, flags),
                            doc=f"CONTEXT_MAP {name.replace('-', ' ')}"))

    def ctx_isolation(a: Attack) -> None:
        """Two non-FLAT contexts: the second names the first one's device range."""
        created = [a.dev.ctrl(A.CtrlType.CONTEXT_CREATE, 0, 0, 0) for _ in range(2)]
        if any(r is None or r[0] != A.Status.OK for r in created):
            return
        (_, c1), (_, c2) = created  # type: ignore[misc]
        req = a.dev.buffer(struct.pack(A.CTX_MAP_REQ.format, A.CtrlType.CONTEXT_MAP, c1,
                                       A.CTX_MAP_READ | A.CTX_MAP_WRITE, 0, 0, 1 << 20, 4096))
        a.dev.request(A.CONTROLQ, [(req, A.CTX_MAP_REQ.size, False),
                                   (a.dev.buffer(16), 16, True)])
        a.dev.submit(c1, cmd(O.FILL, dst=0, size=4096, pattern=0x5EC2E7), timeout_ns=SETTLE_NS)
        host = a.dev.buffer(4096)
        r = a.dev.submit(c2, cmd(O.DMA_D2H, src=0, dst=host, size=4096), timeout_ns=SETTLE_NS)
        if r is not None and r.status == A.Status.OK and \
                struct.pack("<I", 0x5EC2E7) in a.dev.mem.read(host, 4096):
            a.breach("ctx/address-space", "a context read another context's mapped memory")
    out.append(Scenario("ctx/cross-context-read", CAT, "ctx/address-space", ctx_isolation,
                        doc="a context reads a range mapped only into another context"))

    # QoS flooding
    def flood(gemm: int, per_queue: int) -> Callable[[Attack], None]:
        def program(a: Attack) -> None:
            assert a.ctx is not None
            cb = b"".join(cmd(O.GEMM, dtype=0, m=gemm, n=gemm, k=gemm, a=0,
                              b=gemm * gemm * 4, c=2 * gemm * gemm * 4, alpha=1.0)
                          for _ in range(8))
            cbuf = a.dev.buffer(cb)
            qs = [q for i, q in a.dev.queues.items() if i >= A.FIRST_SUBMITQ]
            for q in qs:
                for n in range(min(per_queue, q.size // 2)):
                    req = a.dev.buffer(struct.pack(A.SUBMIT_REQ.format, a.ctx, 0, cbuf, len(cb),
                                                   0, n))
                    resp = a.dev.buffer(A.SUBMIT_RESP.size)
                    q.put_avail(q.add([(req, A.SUBMIT_REQ.size, False),
                                       (resp, A.SUBMIT_RESP.size, True)]))
                a.dev.t.notify(q.index)
            a.sleep(1_000_000)
        return program
    for gemm, depth in ((64, 8), (128, 8), (32, 8)):
        out.append(Scenario(f"qos/flood-gemm{gemm}", CAT, "sched/fairness", flood(gemm, depth),
                            doc=f"every submit queue full of {gemm}^3 GEMMs"))

    def long_wait(a: Attack) -> None:
        assert a.ctx is not None
        flag = a.dev.buffer(8)
        for qi in (A.FIRST_SUBMITQ, A.FIRST_SUBMITQ + 1):
            if qi in a.dev.queues:
                a.dev.submit(a.ctx, cmd(O.WAIT, addr=flag, value=1), queue=qi, timeout_ns=1000)
        a.sleep(1_000_000)
    out.append(Scenario("qos/wait-forever", CAT, "sched/preemption", long_wait,
                        doc="WAITs that never complete on every queue"))

    def signal_early(a: Attack) -> None:
        """A SIGNAL after about 200 us of work, its word polled every microsecond: it
        must not be visible before the command's modelled end (defect 5)."""
        assert a.ctx is not None
        host = a.dev.buffer(8)
        work = b"".join(cmd(O.FILL, dst=4096 * (i % 64), size=4096, pattern=i)
                        for i in range(400))
        cb = work + cmd(O.SIGNAL, addr=host, value=1)
        q: RawQueue = a.dev.queues[A.FIRST_SUBMITQ]
        cbuf = a.dev.buffer(cb)
        req = a.dev.buffer(struct.pack(A.SUBMIT_REQ.format, a.ctx, 0, cbuf, len(cb), 0, 1))
        resp = a.dev.buffer(A.SUBMIT_RESP.size)
        q.put_avail(q.add([(req, A.SUBMIT_REQ.size, False), (resp, A.SUBMIT_RESP.size, True)]))
        a.dev.t.notify(q.index)
        seen = None
        for _ in range(5000):
            if a.dev.mem.read(host, 8) != bytes(8):
                seen = a.now()
                break
            a.sleep(1_000)
        if q.wait_used(SETTLE_NS) is None or seen is None:
            return
        _, _, _, start, end = struct.unpack(A.SUBMIT_RESP.format,
                                            a.dev.mem.read(resp, A.SUBMIT_RESP.size))
        if seen + 2_000 < end:
            a.breach("time/early-write", f"SIGNAL visible at {seen} ns, its submission ends "
                     f"at {end} ns")
    out.append(Scenario("time/signal-before-its-end", CAT, "time/early-write", signal_early,
                        doc="a SIGNAL must not be seen before its modelled end"))

    # TOCTOU: the command buffer and the request rewritten while the device reads them
    def toctou(delay_ns: int, target: str) -> Callable[[Attack], None]:
        def program(a: Attack) -> None:
            assert a.ctx is not None
            good = b"".join(cmd(O.FILL, dst=4096 * i, size=4096, pattern=i) for i in range(32))
            cbuf = a.dev.buffer(good)
            q: RawQueue = a.dev.queues[A.FIRST_SUBMITQ]
            req = a.dev.buffer(struct.pack(A.SUBMIT_REQ.format, a.ctx, 0, cbuf, len(good), 0, 1))
            resp = a.dev.buffer(A.SUBMIT_RESP.size)
            q.put_avail(q.add([(req, A.SUBMIT_REQ.size, False),
                               (resp, A.SUBMIT_RESP.size, True)]))
            a.dev.t.notify(q.index)
            if delay_ns:
                a.sleep(delay_ns)
            if target == "cmdbuf":
                bad = cmd(O.FILL, dst=FAR, size=1 << 40) * 32
                a.dev.mem.write(cbuf, bad[:len(good)])
            elif target == "request":
                a.dev.mem.write(req, struct.pack(A.SUBMIT_REQ.format, 4242, 1, UNMAPPED,
                                                 0xFFFF_FFF8, 1, 2))
            elif target == "descriptor":
                q.write_desc(0, UNMAPPED, 0xFFFF_FFFF, 0, 0)
            q.wait_used(SETTLE_NS)
        return program
    for delay in (0, 600, 5_000):
        for target in ("cmdbuf", "request", "descriptor"):
            out.append(Scenario(f"toctou/{target}-after-{delay}ns", CAT, "cmd/toctou",
                                toctou(delay, target),
                                doc=f"rewrite the {target} {delay} ns after the notify"))
    return out
