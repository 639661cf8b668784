"""The host's PF driver (guest_driver.va1.pf) in host-kernel context: its rings in host
RAM behind the IOMMU, MSI from the host domain, provisioning through the admin queue,
run in main-thread mode or as a host task."""
from __future__ import annotations

import errno
from dataclasses import asdict

import pytest

from hwspec.va1 import VfResources
from vmm.host import Host
from vmm.host_kernel import HOST_KERNEL_RAM_BASE
from vmm.machine import Machine

SEED = 777


def test_pf_driver_probes_in_host_kernel_context_with_its_dma_confined() -> None:
    h = Host(Machine(SEED, keep_trace=True))
    pf = h.add_va1_card(total_vfs=4)
    drv = h.pf_driver()
    k = h.host_kernel()
    assert drv.drv.device.admin is not None           # the admin queue is up
    # the PF's DMA domain maps exactly the host-kernel RAM, at IOVA = host physical
    maps = k.dma_domain.mappings  # type: ignore[union-attr]
    assert [(m.iova, m.size) for m in maps] == [(HOST_KERNEL_RAM_BASE, k.memory.size)]
    assert pf.dma.bytes_read > 0 and pf.dma.bytes_written > 0   # rings were used
    assert h.msi.delivered > 0            # admin completions came as host MSIs
    assert h.pf_driver() is drv           # bound once


def test_enable_sriov_provisions_each_vf_through_the_admin_queue() -> None:
    h = Host(Machine(SEED, keep_trace=True))
    h.add_va1_card(total_vfs=8)
    res = [VfResources(device_memory=(8 + 8 * i) << 20, num_submit_queues=1 + i, max_contexts=2 + i,
                       weight=1 + i, priority=i % 2, exec_quantum_ns=10_000 * (i + 1),
                       preemption_timeout_ns=1_000_000 * (i + 1)) for i in range(3)]
    vfs = h.enable_sriov(3, res)
    drv = h.pf_driver()
    card = h.functions["0000:01:00.0"].device
    for n, (vf, r) in enumerate(zip(vfs, res), start=1):
        assert drv.get_resources(n) == r
        dev = card.vf_devices[n - 1]  # type: ignore[attr-defined]
        assert dev.config.device_memory_size == r.device_memory
        assert dev.config.num_submit_queues == r.num_submit_queues
    admin = [e for e in h.machine.trace.events if e.kind == "admin"]
    assert len([e for e in admin if e.get("opcode") == 0x0800]) == 3


def test_enable_sriov_as_a_host_task() -> None:
    m = Machine(SEED)
    h = Host(m)
    h.add_va1_card(total_vfs=4)
    task = m.spawn(lambda: [v.name for v in h.enable_sriov(2)], "host-pf")
    m.run_tasks()
    assert task.error is None and task.result == ["0000:01:00.1", "0000:01:00.2"]
    assert m.now_ns() >= 100_000_000    # the driver waited 100 ms after VF Enable


def test_stats_stop_resume_reset_and_bad_members() -> None:
    h = Host(Machine(SEED))
    h.add_va1_card(total_vfs=4)
    h.enable_sriov(2)
    drv = h.pf_driver()
    s = drv.stats(1)
    assert set(s) == {"submissions", "commands", "device_time_ns", "dma_bytes", "faults",
                      "preemptions", "timeouts"}
    drv.stop(2)
    drv.resume(2)
    drv.reset_vf(1)
    for bad in (0, 3, 65):
        with pytest.raises(OSError) as e:
            drv.stats(bad)
        assert e.value.errno == errno.EINVAL
    with pytest.raises(OSError) as e:
        drv.set_resources(1, asdict(VfResources(weight=0)))
    assert e.value.errno == errno.EINVAL
    assert drv.get_resources(1).weight == 1
