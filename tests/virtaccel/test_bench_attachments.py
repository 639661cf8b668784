"""The attachments the benchmarks run on, at tiny sizes: (c) on a host VA-1 function
assigned by VFIO passthrough, (f) on SR-IOV VFs, one per VM (structure only: no timing
is asserted)."""
from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from device_model import Va1Config
from guest_driver import uapi
from virtaccel.bench import Sizes
from virtaccel import Session
from virtaccel.bench.cases import _vm_workload, dma, sriov_fleet, vm_scaling


def test_vfio_session_does_its_dma_through_the_assigned_host_function() -> None:
    nbytes = 64 << 10
    seen: dict[str, Any] = {}

    def program(os_: uapi.GuestOS) -> bool:
        import userspace_runtime as rt
        with rt.Device(os_) as dev:
            ctx = dev.create_context()
            buf = ctx.alloc((nbytes // 4,), np.float32)
            x = np.arange(nbytes // 4, dtype=np.float32)
            s = ctx.create_stream()
            s.upload(buf, x)
            out = s.download(buf)
            s.synchronize()
            ok = bool(np.array_equal(out.result(), x))
            ctx.destroy()
        return ok

    with Session(attach="vfio", memory=32 << 20,
                 config=Va1Config(device_memory_size=8 << 20)) as s:
        assert s.run(program) is True
        vm = s.vm
        seen["mmio"] = list(vm.accelerators)
        (pt,) = vm.passthrough
        hf = pt.host_function
        seen["dma"] = (hf.dma.bytes_read, hf.dma.bytes_written)
        seen["group"] = hf.group is not None and hf.group.container is pt.container
    assert seen["mmio"] == []  # no emulated VA-1: the guest drives the assigned function
    # ring and request reads go through the host function's IommuDma (bulk H2D is a view)
    assert seen["dma"][0] > 0 and seen["dma"][1] >= nbytes
    assert seen["group"] is True


def test_session_rejects_an_unknown_attachment() -> None:
    with pytest.raises(ValueError, match="attach 'iommu'"):
        Session(attach="iommu")


def test_sriov_fleet_gives_each_vm_its_own_vf_and_iommu_domain() -> None:
    sz = Sizes.smoke()
    with sriov_fleet(3, sz) as fleet:
        assert [vf.vf_index for vf in fleet.vfs] == [1, 2, 3]
        assert [vm.passthrough[0].host_function for vm in fleet.vms] == fleet.vfs
        assert all(vm.accelerators == [] for vm in fleet.vms)
        domains = [fleet.host.iommu.domain_of(vf.requester_id) for vf in fleet.vfs]
        assert None not in domains and len({id(d) for d in domains}) == 3
        tasks = fleet.run_all([_vm_workload(i) for i in range(3)])
        assert [t.result["ok"] for t in tasks] == [True] * 3
        assert all(vf.dma.bytes_read > 0 and vf.dma.bytes_written > 0 for vf in fleet.vfs)
        assert fleet.host.iommu.fault_count == 0
        with pytest.raises(ValueError, match="1 programs for 3 VMs"):
            fleet.run_all([_vm_workload(0)])


def test_dma_and_scaling_rows_name_their_attachments() -> None:
    sz = Sizes.smoke()
    rows = dma(sz)
    assert [r.name for r in rows] == ["c_dma_h2d_0.0625MiB", "c_dma_d2h_0.0625MiB"]
    assert all("VFIO passthrough" in r.note and r.value and r.baseline for r in rows)
    row = vm_scaling(sz)
    assert row.name == "f_per_vm_2v1" and row.value and row.baseline
    assert "SR-IOV" in row.note and "one VF per VM" in row.note
