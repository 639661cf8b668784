"""A device write to guest memory is not observable before its command's modelled end
(spec §6 "Write visibility"): a guest polling the fence word of a SIGNAL, the word a
TIMESTAMP writes and the destination of a DMA_D2H, with the guest's virtual clock, sees
each value appear exactly at the end_ns of that command's `cmd` trace event, never
before, on a single-function mmio device and on SR-IOV VFs sharing a card."""
from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from guest_driver import uapi as U
from userspace_runtime import DriverFile
from userspace_runtime.commands import CommandBufferBuilder
from virtaccel import Session
from virtaccel.testing.tenants import TenantBed
from vmm.iommu import format_bdf
from vmm.trace import TraceEvent

SEED = 11
SIG, TS, D2H = 4096, 4096 + 64, 4096 + 128     # offsets in the host buffer
WATCHED = {"SIGNAL": SIG, "TIMESTAMP": TS, "DMA_D2H": D2H}


def poller(os_: Any, fill_bytes: int = 1 << 20) -> dict[str, Any]:
    """Submit FILL, SIGNAL, FILL, TIMESTAMP, FILL, DMA_D2H, FILL and poll the three
    words the device writes, waking on every change, until all have changed."""
    acc = DriverFile.open(os_, "/dev/accel/accel0")
    ctx = acc.context_create()
    h, iova = acc.bo_create(1 << 16, U.BO_HOST)
    dh, daddr = acc.bo_create(fill_bytes, U.BO_DEVICE)
    view = acc.mmap(h, 1 << 16)
    cb = CommandBufferBuilder()
    cb.fill(daddr, fill_bytes, 0x01010101)
    cb.signal(iova + SIG, 7)
    cb.fill(daddr, fill_bytes, 0x02020202)
    cb.timestamp(iova + TS)
    cb.fill(daddr, fill_bytes, 0x03030303)
    cb.dma_d2h(daddr, iova + D2H, 8)
    cb.fill(daddr, fill_bytes, 0x04040404)
    raw = cb.bytes()
    view[:len(raw)] = np.frombuffer(raw, np.uint8)
    sched = os_.kernel.sched

    def word(off: int) -> int:
        return int(view[off:off + 8].view(np.uint64)[0])

    seen: dict[str, int] = {}
    values: dict[str, int] = {}
    fence = acc.submit(ctx, 0, h, 0, len(raw))

    def changed() -> bool:
        return any(name not in seen and word(off) for name, off in WATCHED.items())

    while len(seen) < len(WATCHED):
        sched.wait_until(changed, 1_000, "poll")       # a poll every us, or at a change
        for name, off in WATCHED.items():
            if name not in seen and word(off):
                seen[name], values[name] = sched.now_ns(), word(off)
    w = acc.wait(ctx, fence, -1)
    assert w is not None
    return {"seen": seen, "values": values, "status": w.status, "end_ns": w.end_ns,
            "woke_ns": sched.now_ns()}


def _cmd_ends(events: list[TraceEvent], source: str) -> dict[str, tuple[int, int]]:
    out = {}
    for e in events:
        if e.source == source and e.kind == "cmd" and e.get("opcode") in WATCHED:
            out[str(e.get("opcode"))] = (int(e.get("start_ns")), int(e.get("end_ns")))  # type: ignore[call-overload]
    return out


def _check(result: dict[str, Any], ends: dict[str, tuple[int, int]]) -> None:
    assert result["status"] == 0 and set(ends) == set(WATCHED), (result, ends)
    for name, (start, end) in ends.items():
        at = result["seen"][name]
        assert at >= end, f"seed {SEED}: {name} visible at {at}, before its end {end}"
        assert at == end, f"seed {SEED}: {name} visible at {at}, its end is {end}"
    assert result["values"]["SIGNAL"] == 7
    assert result["values"]["TIMESTAMP"] == ends["TIMESTAMP"][0]    # its start time
    assert result["values"]["DMA_D2H"] == 0x0303030303030303
    assert result["woke_ns"] >= result["end_ns"]


def test_device_writes_land_at_their_end_time_on_mmio() -> None:
    with Session(attach="mmio", seed=SEED, keep_trace=True) as s:
        result = s.run(poller)
        _check(result, _cmd_ends(s.trace.events, "vm0.va1.0"))


@pytest.mark.parametrize("units", [1, 4])
def test_device_writes_land_at_their_end_time_on_shared_vfs(units: int) -> None:
    from device_model import Va1Config
    with TenantBed(2, seed=SEED, keep_trace=True,
                   card_config=Va1Config(num_compute_units=units)) as bed:
        results = bed.run([poller, lambda os_: poller(os_, 1 << 19)])
        events = bed.session.trace.events
        for r in results:
            assert r.error is None, f"seed {SEED}: {r.vm}: {r.error!r}"
            source = f"{bed.host.name}.{format_bdf(bed.vf(r.index).requester_id)}"
            _check(r.result, _cmd_ends(events, source))
