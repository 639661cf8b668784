"""A failure inside the device (a kernel raising MemoryError or a bug) lands only on the
function whose command met it: that command fails DEVICE_ERROR, its context is faulted,
its compute unit is released, and no guest task (the attacker's, a victim's, whichever
drives the clock) ever sees the exception. Victims in other VFs keep completing with
numpy's results. Covered on SR-IOV (TenantBed) and on single-function mmio devices."""
from __future__ import annotations

import dataclasses
import errno
from typing import Any, Callable

import numpy as np
import pytest

from device_model.ports import DmaPort
from device_model.va1 import commands as C
from device_model.va1.device import Va1Device
from guest_driver import uapi as U
from hwspec.isa import Opcode
from hwspec.va1 import Status
from userspace_runtime import DriverFile
from userspace_runtime.commands import CommandBufferBuilder
from virtaccel import Session
from virtaccel.guests.tenant import checked_gemm, guest_now
from virtaccel.images import tenant_seed
from virtaccel.testing.tenants import TenantBed, check_victim, run_attack

from .conftest import SEED

BOOM = 0x0B0B0B0B          # the FILL pattern whose kernel fails
ATTACKER = 2
VICTIMS = {"duration_ns": 400_000, "depth": 1}


def fail_fill_on(monkeypatch: pytest.MonkeyPatch, dma: DmaPort,
                 exc: Callable[[], Exception]) -> None:
    """FILL with pattern BOOM raises on the function whose DMA port is `dma` only."""
    real = C.OPS[Opcode.FILL]

    def execute(cmd: C.Command, port: DmaPort, start_ns: int) -> None:
        if port is dma and cmd.value == BOOM:
            raise exc()
        real.execute(cmd, port, start_ns)

    monkeypatch.setitem(C.OPS, Opcode.FILL, dataclasses.replace(real, execute=execute))


def failing_tenant(os_: Any, seed: int = 0) -> dict[str, Any]:
    """Submit one FILL whose kernel fails; then check the context is faulted and that a
    fresh context still works."""
    acc = DriverFile.open(os_, "/dev/accel/accel0")
    ctx = acc.context_create()
    h, iova = acc.bo_create(1 << 16, U.BO_HOST)
    dh, daddr = acc.bo_create(1 << 20, U.BO_DEVICE)
    view = acc.mmap(h, 1 << 16)
    t0 = guest_now(os_)
    cb = CommandBufferBuilder()
    cb.nop()
    cb.fill(daddr, 1 << 20, BOOM)
    cb.signal(iova + 4096, 1)
    raw = cb.bytes()
    view[:len(raw)] = np.frombuffer(raw, np.uint8)
    fence = acc.submit(ctx, 0, h, 0, len(raw))
    w = acc.wait(ctx, fence, -1)
    assert w is not None
    try:
        acc.submit(ctx, 0, h, 0, 8)
        after = "accepted"
    except OSError as e:
        after = errno.errorcode.get(e.errno or 0, str(e.errno))
    ctx2 = acc.context_create()
    cb = CommandBufferBuilder()
    cb.fill(daddr, 4096, 0x01010101)
    cb.dma_d2h(daddr, iova + 8192, 16)
    raw = cb.bytes()
    view[:len(raw)] = np.frombuffer(raw, np.uint8)
    w2 = acc.wait(ctx2, acc.submit(ctx2, 0, h, 0, len(raw)), -1)
    assert w2 is not None
    return {"ok": True, "status": w.status, "offset": w.error_offset, "after": after,
            "signalled": int(view[4096:4104].view(np.uint64)[0]),
            "fresh": w2.status, "fresh_data": bytes(view[8192:8208]).hex(),
            "attack_ns": t0, "done_ns": guest_now(os_)}


@pytest.mark.parametrize("exc", [lambda: MemoryError("Unable to allocate 64.0 GiB"),
                                 lambda: RuntimeError("kernel bug")],
                         ids=["MemoryError", "RuntimeError"])
def test_a_failing_kernel_in_one_vf_stays_in_that_vf(
        make_bed: Callable[..., TenantBed], monkeypatch: pytest.MonkeyPatch,
        exc: Callable[[], Exception]) -> None:
    bed = make_bed(3, compute_units=1)         # one compute unit: every VF shares it
    att = bed.vf(ATTACKER).device
    assert isinstance(att, Va1Device)
    fail_fill_on(monkeypatch, att.dma, exc)
    out = run_attack(bed, ATTACKER, lambda os_: failing_tenant(os_, tenant_seed(SEED, ATTACKER)),
                     VICTIMS)
    for t in bed.tasks:
        assert t.error is None, f"seed {SEED}: {t.name} got {t.error!r}"
    r = out.attacker.result
    assert Status(r["status"]) is Status.DEVICE_ERROR, f"seed {SEED}: {r}"
    assert r["offset"] == 8 and r["signalled"] == 0     # nothing after the FILL ran
    assert r["after"] == "ECANCELED"                     # its context is faulted
    assert r["fresh"] == 0 and r["fresh_data"] == "01" * 16   # the VF runs on
    mon = bed.monitor.functions
    assert mon[ATTACKER].failed == {"DEVICE_ERROR": 1}   # its fence completed once
    assert out.all_victims_correct, f"seed {SEED}: {[v.result for v in out.victims]}"
    for v in out.victims:
        f = mon[v.index]
        assert f.ok == f.submissions > 0 and not f.failed, f"seed {SEED}: VF {v.index}"
        assert max(f.end_times) > r["attack_ns"], f"seed {SEED}: VF {v.index} stopped"
    assert att.processor.sched.engines == [None]         # the compute unit came back
    assert att.processor.fs.running == 0 and att.metrics.device_errors == 1
    for n in (1, 3):
        dev = bed.vf(n).device
        assert isinstance(dev, Va1Device) and dev.metrics.device_errors == 0


def test_a_failing_kernel_on_an_mmio_device_stays_in_its_vm(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Two VMs with a single-function mmio device each, on one clock: VM 0's device
    fails while VM 1's victim (or anybody) may be driving the clock."""
    seed = SEED
    with Session(attach="mmio", seed=seed, vms=2) as s:
        dev = s.vms[0].accelerators[0].device
        fail_fill_on(monkeypatch, dev.dma, lambda: MemoryError("numpy"))
        vseed = seed + 1
        s.spawn(lambda os_: failing_tenant(os_), vm=0, name="attacker")
        s.spawn(lambda os_: checked_gemm(os_, vseed, **VICTIMS), vm=1, name="victim")
        tasks = s.run_tasks()
        for t in tasks:
            assert t.error is None, f"seed {seed}: {t.name} got {t.error!r}"
        r = next(t.result for t in tasks if t.name == "attacker")
        victim = next(t.result for t in tasks if t.name == "victim")
        assert Status(r["status"]) is Status.DEVICE_ERROR and r["offset"] == 8
        assert r["after"] == "ECANCELED" and r["fresh"] == 0
        assert check_victim(victim, vseed), f"seed {seed}: {victim}"
        assert dev.processor.engines == [None] * len(dev.processor.engines)
        assert dev.metrics.device_errors == 1
