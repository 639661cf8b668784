"""VFIO passthrough of a VA-1 function end to end: the real device (VirtioPciFunction
over Va1Device) on the host behind the IOMMU, the real guest driver and runtime."""
from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from guest_driver import uapi
from hwspec import pci as P
from hwspec import va1, virtio
from hwspec import virtio_pci as VP
from userspace_runtime import Device, DeviceError
from virtaccel import Session
from virtaccel.guests import mlp

SEED = 20261121
ARGS: dict[str, Any] = {"batch": 16, "sizes": (64, 128, 32)}


def run_mlp(attach: str, seed: int = SEED) -> tuple[dict[str, Any], Session]:
    """The MLP guest in one VM with a VA-1 attached as `attach`; its result and the
    (closed, still readable) session."""
    with Session(attach=attach, seed=seed, keep_trace=True) as s:
        result = s.run(lambda os_: mlp.main(os_, seed=seed, **ARGS), name="mlp")
    return dict(result), s


def test_mlp_identical_over_mmio_emulated_pci_emulated_and_passthrough() -> None:
    r_mmio = run_mlp("mmio")[0]
    r_pci = run_mlp("pci")[0]
    r_pt = run_mlp("vfio")[0]
    assert r_mmio["ok"] is True
    assert r_mmio == r_pci == r_pt  # same numbers, same device time, bit for bit


def test_passthrough_doorbells_are_direct_and_msix_table_writes_trap() -> None:
    _, s = run_mlp("vfio")
    machine, vm, host = s.machine, s.vm, s.host
    bar = vm.passthrough[0].slot.mapped[0][0]
    notify = (bar + va1.PCI_NOTIFY_OFFSET, bar + va1.PCI_NOTIFY_OFFSET + 0x1000)
    table = (bar + va1.PCI_MSIX_TABLE_OFFSET, bar + va1.PCI_MSIX_TABLE_OFFSET + 0x1000)
    writes = [e for e in machine.trace.events if e.kind == "mmio_write" and e.source == "vm0.cpu"]
    doorbells = [w for w in writes if notify[0] <= int(w.get("addr")) < notify[1]]  # type: ignore[arg-type]
    table_writes = [w for w in writes if table[0] <= int(w.get("addr")) < table[1]]  # type: ignore[arg-type]
    assert doorbells and all(w.get("exit") is False for w in doorbells)
    assert table_writes and all(w.get("exit") is True for w in table_writes)
    assert vm.mmio.direct_accesses > 0
    assert host is not None and host.msi.delivered > 0  # interrupts came the host way
    assert vm.irqchip.unknown_msi == []


def test_passthrough_run_is_deterministic() -> None:
    d1 = run_mlp("vfio", 3)[1].digest()
    d2 = run_mlp("vfio", 3)[1].digest()
    d3 = run_mlp("vfio", 4)[1].digest()
    assert d1 == d2 != d3


def test_ring_aimed_at_the_functions_own_bar_is_refused_without_reentry() -> None:
    """A guest points the controlq rings at the function's own BAR: the device's DMA
    goes through the IOMMU, which maps only guest RAM, so it faults; the device does
    not dispatch to its own registers, and flags NEEDS_RESET."""
    s = Session(attach="vfio", seed=SEED, keep_trace=True).launch()
    machine, vm, host = s.machine, s.vm, s.host
    assert host is not None
    pt = vm.passthrough[0]
    hf = pt.host_function
    ecam = vm.kernel.pci_hosts[0].ecam_base + P.ecam_offset(0, pt.slot.dev, 0)
    mm = vm.mmio
    mm.write(ecam + P.COMMAND, 2, P.COMMAND_MEMORY | P.COMMAND_MASTER)
    bar = pt.slot.mapped[0][0]
    common = bar + va1.PCI_COMMON_CFG_OFFSET
    mm.write(common + VP.COMMON_STATUS, 1, 0)
    mm.write(common + VP.COMMON_STATUS, 1, virtio.STATUS_ACKNOWLEDGE | virtio.STATUS_DRIVER)
    mm.write(common + VP.COMMON_GFSELECT, 4, 1)
    mm.write(common + VP.COMMON_GF, 4, (1 << (virtio.F_VERSION_1 - 32)) | (1 << (virtio.F_ACCESS_PLATFORM - 32)))
    mm.write(common + VP.COMMON_GFSELECT, 4, 0)
    mm.write(common + VP.COMMON_GF, 4, 0)
    mm.write(common + VP.COMMON_STATUS, 1, virtio.STATUS_ACKNOWLEDGE | virtio.STATUS_DRIVER | virtio.STATUS_FEATURES_OK)
    assert mm.read(common + VP.COMMON_STATUS, 1) & virtio.STATUS_FEATURES_OK
    mm.write(common + VP.COMMON_Q_SELECT, 2, va1.CONTROLQ)
    mm.write(common + VP.COMMON_Q_SIZE, 2, 16)
    for lo, addr in ((VP.COMMON_Q_DESCLO, bar), (VP.COMMON_Q_AVAILLO, bar + 0x1000),
                     (VP.COMMON_Q_USEDLO, bar + 0x2000)):
        mm.write(common + lo, 4, addr & 0xFFFF_FFFF)
        mm.write(common + lo + 4, 4, addr >> 32)
    mm.write(common + VP.COMMON_Q_ENABLE, 2, 1)
    mm.write(common + VP.COMMON_STATUS, 1, virtio.STATUS_ACKNOWLEDGE | virtio.STATUS_DRIVER
             | virtio.STATUS_FEATURES_OK | virtio.STATUS_DRIVER_OK)
    n_cpu = len([e for e in machine.trace.events if e.source == "vm0.cpu"])
    faults0 = host.iommu.fault_count
    mm.write(bar + va1.PCI_NOTIFY_OFFSET + va1.CONTROLQ * va1.PCI_NOTIFY_OFF_MULTIPLIER, 2, va1.CONTROLQ)
    machine.sleep(100_000)
    assert host.iommu.fault_count > faults0
    assert all(bar <= f.iova < bar + va1.PCI_BAR_SIZE for f in list(host.iommu.faults)[-(host.iommu.fault_count - faults0):])
    assert hf.dma.bytes_written == 0 and hf.dma.bytes_read == 0
    # the only accesses to the BAR are the guest's own (the notify write): no re-entry
    cpu = [e for e in machine.trace.events if e.source == "vm0.cpu"]
    assert len(cpu) == n_cpu + 1
    assert mm.read(common + VP.COMMON_STATUS, 1) & virtio.STATUS_DEVICE_NEEDS_RESET
    s.close()


def test_vfio_reset_with_requests_in_flight_aborts_every_fence_and_stops_dma() -> None:
    """The guest FLRs the function (DEVCTL.BCR_FLR, trapped by the VMM: VFIO_DEVICE_RESET)
    with GEMMs in flight: no DMA for the function after it, and after the driver's
    recovery every fence completes ABORTED; the function then works again."""
    s = Session(attach="vfio", seed=SEED, keep_trace=True).launch()
    vm, host = s.vm, s.host
    assert host is not None
    pt = vm.passthrough[0]
    hf = pt.host_function
    seen: dict[str, Any] = {}

    def program(os_: uapi.GuestOS) -> dict[str, Any]:
        dev = Device(os_)
        ctx = dev.create_context()
        stream = ctx.create_stream()
        a = ctx.alloc((512, 512), np.float32)
        c = ctx.alloc((512, 512), np.float32)
        stream.fill(a, 1.0)
        stream.synchronize()
        fences = []
        for _ in range(3):
            stream.gemm(a, a, c)
            fences.append(stream.flush())
        seen["fences"] = fences
        ecam = vm.kernel.pci_hosts[0].ecam_base + P.ecam_offset(0, pt.slot.dev, 0)
        exp = pt.endpoint.config_read(P.CAPABILITY_LIST, 1)
        while exp and pt.endpoint.config_read(exp, 1) != P.CAP_ID_EXP:
            exp = pt.endpoint.config_read(exp + 1, 1)
        assert exp
        vm.kernel.mmio.write(ecam + exp + P.EXP_DEVCTL, 2, P.EXP_DEVCTL_BCR_FLR)
        seen["dma_at_reset"] = (hf.dma.bytes_read, hf.dma.bytes_written)
        vm.kernel.sched.sleep(50_000_000)  # far longer than the GEMMs would take
        seen["dma_later"] = (hf.dma.bytes_read, hf.dma.bytes_written)
        os_.devices["/dev/accel/accel0"].recover("function level reset")  # type: ignore[attr-defined]
        with pytest.raises(DeviceError):
            stream.synchronize()
        seen["statuses"] = [s.status for s in stream.submissions]
        return mlp.main(os_, seed=SEED, **ARGS)

    with s:
        result = s.run(program, name="flr")
    assert host.functions[hf.name].group is not None
    assert seen["dma_at_reset"] == seen["dma_later"]
    assert seen["statuses"][-3:] == [va1.Status.ABORTED] * 3
    assert result["ok"] is True


@pytest.mark.parametrize("where", ["past_ram", "own_bar"])
def test_command_buffer_at_unmapped_iova_fails_the_request_and_logs_an_iommu_fault(where: str) -> None:
    """A submission whose command buffer lies outside guest RAM (past its end, or on the
    function's own BAR, so outside every mapping the VMM made): the request completes
    DMA_FAULT, the IOMMU logs the fault for this function's requester ID, nothing
    reaches the BAR, and the function goes on working."""
    s = Session(attach="vfio", seed=SEED, memory=64 << 20, keep_trace=True).launch()
    host = s.host
    assert host is not None
    pt = s.vm.passthrough[0]
    hf = pt.host_function
    bad_iova = 0x1_0000_0000  # 4 GiB: past the 64 MiB of RAM, never mapped

    def program(os_: uapi.GuestOS) -> dict[str, Any]:
        nonlocal bad_iova
        drv = os_.devices["/dev/accel/accel0"]  # type: ignore[attr-defined]
        if where == "own_bar":
            bad_iova = pt.slot.mapped[0][0] + va1.PCI_COMMON_CFG_OFFSET
        ctx = drv.create_context()
        fence = drv.submit(ctx, 0, bad_iova, 64)
        assert drv.wait_fence(fence, 10**9)
        return {"status": fence.status, "after": mlp.main(os_, seed=SEED, **ARGS)}

    with s:
        result = s.run(program, name="badbuf")
    assert result["status"] == va1.Status.DMA_FAULT
    faults = [f for f in host.iommu.faults if f.iova == bad_iova]
    assert faults and faults[0].requester_id == hf.requester_id and not faults[0].write
    assert result["after"]["ok"] is True
