"""Fault plans on a vdpa attachment: the faults hit the function under vhost-vdpa (its
MSI port, its DMA port, its fault port), the guest's driver sees them through the
frontend as on any other attachment, and an FLR is refused with the reason."""
from __future__ import annotations

from typing import Any

import pytest

from userspace_runtime import DeviceError
from virtaccel import Session
from virtaccel.guests import mlp
from vmm.faults import FaultEntry, FaultPlan, FaultPlanError

SEED = 20261124
SMALL = {"batch": 4, "sizes": (16, 32, 8)}


def run(transport: str, entry: FaultEntry) -> tuple[Session, Any, BaseException | None]:
    s = Session(attach="vdpa", transport=transport, seed=SEED, memory=32 << 20,
                keep_trace=True, faults=FaultPlan([entry]))
    with s:
        task = s.spawn(lambda os_: mlp.main(os_, seed=SEED, **SMALL), name="prog")
        s.run_tasks()
    return s, task.result, task.error


def injected(s: Session) -> list[Any]:
    return [e for e in s.trace.events if e.kind == "fault_injected"]


@pytest.mark.parametrize("transport", ["pci", "mmio"])
def test_dropped_interrupt_is_polled_by_the_driver(transport: str) -> None:
    s, result, error = run(transport, FaultEntry("vm0", "drop_interrupt", after=12,
                                                 on="interrupt"))
    assert len(injected(s)) == 1
    assert error is None and result["ok"] is True, f"seed {SEED}"
    assert [e for e in s.trace.events if e.kind == "irq_polled"]


def test_delayed_interrupt_arrives_later() -> None:
    s, result, error = run("pci", FaultEntry("vm0", "delay_interrupt", delay_ns=40_000,
                                             after=1, on="submission"))
    (ev,) = injected(s)
    assert error is None and result["ok"] is True, f"seed {SEED}"
    host_msis = [e.t_ns for e in s.trace.events if e.kind == "host_msi"]
    assert ev.t_ns + 40_000 in host_msis


def test_failed_dma_read_fails_the_submission() -> None:
    s, _, error = run("mmio", FaultEntry("vm0", "fail_dma_read", after=1, on="submission"))
    assert isinstance(error, DeviceError) and "DMA_FAULT" in str(error), f"seed {SEED}"
    assert s.host is not None and len(s.host.iommu.faults) == 1


def test_needs_reset_reaches_the_guest_through_the_config_eventfd() -> None:
    s, _, error = run("pci", FaultEntry("vm0", "needs_reset", after=1, on="submission"))
    assert len(injected(s)) == 1
    assert [e for e in s.trace.events if e.kind == "vdpa_needs_reset"]
    resets = [e for e in s.trace.events if e.kind == "reset" and e.source == "vm0.kernel"]
    assert resets and "DEVICE_NEEDS_RESET" in resets[0].get("reason")
    assert isinstance(error, DeviceError) and "ABORTED" in str(error), f"seed {SEED}"


def test_flr_is_refused_on_a_vdpa_function() -> None:
    with pytest.raises(FaultPlanError) as e:
        Session(attach="vdpa", faults=FaultPlan([FaultEntry("vm0", "flr", at_ns=0)])).launch()
    assert "vhost-vdpa" in str(e.value) and "needs_reset" in str(e.value)
