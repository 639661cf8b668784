"""A tenant that survives its device being reset under it, and the invariant checks of
driver recovery (issue 10): every fence it submitted completes exactly once, with OK
or a named status, and work goes on after the recovery."""
from __future__ import annotations

import errno
from collections import Counter
from typing import Any

import numpy as np

from guest_driver import uapi as U
from hwspec.va1 import Status
from userspace_runtime import DriverError, DriverFile
from userspace_runtime.commands import CommandBufferBuilder
from virtaccel.guests.tenant import checksum, gemm_inputs
from vmm.trace import TraceEvent

M, K, N = 16, 32, 16
WAIT_BOUND_NS = 20_000_000_000   # no WAIT may take longer (virtual): 10 x the watchdog


def resilient(seed: int, count: int = 24, depth: int = 4) -> Any:
    """Keep `depth` checked GEMMs in flight (saturating) until `count` completed OK;
    a fence that completes with an error is recorded and its GEMM submitted again; a
    context lost in a reset (ECANCELED) is destroyed and another created. Returns every
    (context, fence, status name, wait ns) and the checksums of the OK GEMMs by index."""

    def program(os_: Any) -> dict[str, Any]:
        acc = DriverFile.open(os_, "/dev/accel/accel0")
        sched = os_.kernel.sched
        sa, sb, sc = M * K * 4, K * N * 4, M * N * 4
        slots = []
        for _ in range(depth):
            h, iova = acc.bo_create(sa + sb + sc + 256, U.BO_HOST)
            d, daddr = acc.bo_create(sa + sb + sc, U.BO_DEVICE)
            slots.append((h, iova, acc.mmap(h, sa + sb + sc + 256), d, daddr))
        ctx = acc.context_create()
        fences: list[tuple[int, int, str, int]] = []
        sums: dict[int, int] = {}
        errors: list[str] = []
        todo = list(range(count))
        inflight: list[tuple[int, int, int, int]] = []   # (slot, index, ctx, fence)
        free = list(range(depth))
        old: list[int] = []

        def submit(slot: int, index: int) -> bool:
            nonlocal ctx
            h, iova, view, d, daddr = slots[slot]
            a, b = gemm_inputs(seed, index, M, K, N)
            view[:sa] = a.view(np.uint8).reshape(-1)
            view[sa:sa + sb] = b.view(np.uint8).reshape(-1)
            cb = CommandBufferBuilder()
            cb.dma_h2d(iova, daddr, sa + sb)
            cb.gemm(dtype="F32", m=M, n=N, k=K, a=daddr, b=daddr + sa, c=daddr + sa + sb)
            cb.dma_d2h(daddr + sa + sb, iova + sa + sb, sc)
            raw = cb.bytes()
            off = sa + sb + sc
            view[off:off + len(raw)] = np.frombuffer(raw, dtype=np.uint8)
            for _ in range(3):
                try:
                    fence = acc.submit(ctx, 0, h, off, len(raw), (d,))
                    inflight.append((slot, index, ctx, fence))
                    return True
                except DriverError as e:
                    if e.errno not in (errno.ECANCELED, errno.EIO, errno.ETIMEDOUT):
                        raise
                    errors.append(f"submit: {e}")
                    old.append(ctx)   # destroyed once its fences are waited for
                    try:
                        ctx = acc.context_create()
                    except DriverError as e2:
                        errors.append(f"create: {e2}")
            return False

        while todo or inflight:
            while free and todo:
                slot = free.pop(0)
                if not submit(slot, todo[0]):
                    free.insert(0, slot)
                    break
                todo.pop(0)
            if not inflight:
                raise RuntimeError(f"cannot submit: {errors[-3:]}")
            slot, index, c, fence = inflight.pop(0)
            t0 = sched.now_ns()
            w = acc.wait(c, fence, WAIT_BOUND_NS)
            took = sched.now_ns() - t0
            if w is None:
                fences.append((c, fence, "HUNG", took))
                raise RuntimeError(f"fence {c}/{fence} not signalled in {WAIT_BOUND_NS} ns")
            name = Status(w.status).name if w.status in Status._value2member_map_ \
                else str(w.status)
            fences.append((c, fence, name, took))
            free.append(slot)
            for o in [o for o in old if all(i[2] != o for i in inflight)]:
                old.remove(o)
                try:
                    acc.context_destroy(o)
                except DriverError as e2:
                    errors.append(f"destroy: {e2}")
            if w.status == Status.OK:
                view = slots[slot][2]
                sums[index] = checksum(view[sa + sb:sa + sb + sc].view(np.float32))
            else:
                todo.insert(0, index)
        stats = acc.stats()
        acc.close()
        return {"fences": fences, "sums": sums, "errors": errors, "stats": stats}
    return program


def expected_sums(seed: int, count: int) -> dict[int, int]:
    out = {}
    for i in range(count):
        a, b = gemm_inputs(seed, i, M, K, N)
        out[i] = checksum(a @ b)
    return out


def signals(events: list[TraceEvent], source: str) -> Counter[tuple[object, object]]:
    """fence_signal events of one guest kernel, by (context, fence)."""
    return Counter((e.get("context"), e.get("fence")) for e in events
                   if e.source == source and e.kind == "fence_signal")


def check_resilient(result: Any, seed: int, count: int) -> list[str]:
    """What is wrong with a resilient tenant's result (empty: nothing)."""
    bad = []
    if not isinstance(result, dict):
        return [f"no result: {result!r}"]
    if result["sums"] != expected_sums(seed, count):
        bad.append("checksums differ from numpy's")
    seen = Counter((c, f) for c, f, _, _ in result["fences"])
    if any(n != 1 for n in seen.values()):
        bad.append(f"a fence waited twice: {seen}")
    for c, f, name, took in result["fences"]:
        if name not in Status.__members__:
            bad.append(f"fence {c}/{f}: unnamed status {name}")
        if took > WAIT_BOUND_NS:
            bad.append(f"fence {c}/{f}: waited {took} ns")
    return bad
