"""The device-side, host-side and guest-side fault actions on real sessions (hang_engine,
needs_reset, vf_reset, vf_stop, iommu_unmap, kill_process): each happens through the
port the hardware or host would use, is traced naming its entry, and the stack's answer
is pinned. Where the current driver does not recover (the recovery slice), the run is
bounded in virtual time and the fault's effect is what is asserted; the other tenant is
always checked correct."""
from __future__ import annotations

from typing import Any

import pytest

from userspace_runtime import DeviceError, DriverError
from virtaccel import Session, SessionState
from virtaccel.guests import mlp
from vmm.faults import FaultEntry, FaultPlan, FaultPlanError
from vmm.trace import TraceEvent

SEED = 20261124
MEMORY = 32 << 20


def small_mlp(os_: Any) -> Any:
    return mlp.main(os_, seed=SEED, batch=4, sizes=(16, 32, 8))


def run(attach: str, *entries: FaultEntry, vms: int = 1
        ) -> tuple[Session, list[tuple[Any, BaseException | None]]]:
    s = Session(attach=attach, seed=SEED, memory=MEMORY, keep_trace=True, vms=vms,
                faults=FaultPlan(entries))
    with s:
        tasks = [s.spawn(small_mlp, vm=i, name=f"prog{i}") for i in range(vms)]
        s.run_tasks()
    return s, [(t.result, t.error) for t in tasks]


def events(s: Session, kind: str, source: str | None = None) -> list[TraceEvent]:
    return [e for e in s.trace.events
            if e.kind == kind and (source is None or e.source == source)]


def one_injected(s: Session, action: str) -> TraceEvent:
    evs = events(s, "fault_injected", "faults")
    assert [e.get("action") for e in evs] == [action], f"seed {SEED}"
    return evs[0]


def victim_ok(outcome: tuple[Any, BaseException | None]) -> None:
    result, error = outcome
    assert error is None and result["ok"] is True, f"seed {SEED}: victim {error!r}"


def digest_of(attach: str, *entries: FaultEntry, vms: int = 1) -> str:
    return run(attach, *entries, vms=vms)[0].digest()


# -- hang_engine ------------------------------------------------------------------------


@pytest.mark.parametrize("attach", ["mmio", "pci"])
def test_hang_engine_fails_the_command_at_the_preemption_timeout(attach: str) -> None:
    hang = FaultEntry("vm0", "hang_engine", after=1, on="submission", name="stuck")
    s, [(_, error)] = run(attach, hang)
    ev = one_injected(s, "hang_engine")
    assert ev.get("entry") == "stuck"
    (h,) = events(s, "cmd_hang")
    (t,) = events(s, "cmd_timeout")
    # The device's own timeout machinery ends it: 1 s (the default) after its start.
    assert h.t_ns >= ev.t_ns and t.get("end_ns") - t.get("start_ns") == 1_000_000_000
    assert (t.get("offset"), t.t_ns) == (h.get("offset"), h.get("end_ns"))
    assert isinstance(error, DeviceError) and "TIMEOUT" in str(error), f"seed {SEED}"
    assert [e.get("status") for e in events(s, "submit_end")] == ["TIMEOUT"]
    assert digest_of(attach, hang) == s.digest()


def test_hang_engine_on_one_vf_leaves_the_other_tenant_running() -> None:
    s, [hung, victim] = run("sriov", FaultEntry("vf1", "hang_engine", after=1,
                                                on="submission"), vms=2)
    one_injected(s, "hang_engine")
    assert isinstance(hung[1], DeviceError) and "TIMEOUT" in str(hung[1]), f"seed {SEED}"
    victim_ok(victim)


# -- needs_reset ------------------------------------------------------------------------


@pytest.mark.parametrize("attach", ["mmio", "pci", "vfio"])
def test_needs_reset_sets_the_bit_and_the_driver_resets_the_function(attach: str) -> None:
    bad = FaultEntry("vm0", "needs_reset", after=1, on="submission")
    s, [(_, error)] = run(attach, bad)
    ev = one_injected(s, "needs_reset")
    (broken,) = events(s, "ring_broken")
    assert broken.t_ns == ev.t_ns and broken.get("rule") == "device/internal"
    assert "faults[0]" in broken.get("message")
    (reset,) = [e for e in events(s, "reset") if e.source == "vm0.kernel"]
    assert "DEVICE_NEEDS_RESET" in reset.get("reason") and reset.t_ns > ev.t_ns
    # The work in flight completes with an error, never silently.
    assert isinstance(error, DeviceError) and "ABORTED" in str(error), f"seed {SEED}"


def test_needs_reset_on_a_function_not_live_is_skipped_and_traced() -> None:
    s = Session(attach="pci", seed=SEED, memory=MEMORY, keep_trace=True,
                faults=FaultPlan([FaultEntry("vm0", "needs_reset", at_ns=0)]))
    with s:
        s.machine.sched.run_until_time(s.now_ns() + 10)
        assert s.injector is not None and s.injector.injected == []
    (skip,) = events(s, "fault_skipped")
    assert "not live" in skip.get("reason")


# -- vf_reset / vf_stop -----------------------------------------------------------------


def test_vf_reset_goes_through_the_pf_drivers_admin_queue() -> None:
    """Known failure (issue 10): VF_RESET clears the VF's MSI-X behind VFIO and the
    guest never reprograms it: its fence never signals (bounded: the machine sees the
    wait can never end). The other tenant is unaffected."""
    s, [hit, victim] = run("sriov", FaultEntry("vf1", "vf_reset", after=1, on="submission"),
                           vms=2)
    ev = one_injected(s, "vf_reset")
    assert ev.get("vf") == 1 and ev.get("function") == "vm1"
    (admin,) = events(s, "vf_reset", "host.pf-01:00.0")
    assert admin.get("vf") == 1 and admin.t_ns >= ev.t_ns
    assert events(s, "flr", "host.01:00.1")[0].t_ns == admin.t_ns
    # The driver's recovery finds the VF reset behind it (its MSI-X state cleared behind
    # VFIO), sets it up again and completes the fence in flight ABORTED, exactly once.
    assert isinstance(hit[1], DeviceError) and "ABORTED" in str(hit[1]), f"seed {SEED}"
    assert events(s, "function_restored"), f"seed {SEED}"
    victim_ok(victim)
    assert s.injector is not None and s.injector.task is not None
    assert s.injector.task.error is None and s.injector.failures == []


def test_vf_stop_with_a_duration_resumes_and_the_work_completes() -> None:
    stop = FaultEntry("vf2", "vf_stop", after=1, on="submission", duration_ns=100_000)
    s, outcomes = run("sriov", stop, vms=2)
    ev = one_injected(s, "vf_stop")
    (stopped,) = events(s, "vf_stop", "host.pf-01:00.0")
    (resumed,) = events(s, "vf_resume", "host.pf-01:00.0")
    (cleared,) = events(s, "fault_cleared")
    assert resumed.t_ns - stopped.t_ns >= 100_000 and cleared.t_ns == resumed.t_ns
    assert ev.get("function") == "vm2"
    for o in outcomes:
        victim_ok(o)
    assert digest_of("sriov", stop, vms=2) == s.digest()


def test_vf_stop_for_good_ends_in_the_drivers_watchdog() -> None:
    """A VF stopped and never resumed: the driver's submission watchdog finds no progress,
    resets the function and completes the fence ABORTED; the other tenant finishes."""
    s, [hit, victim] = run("sriov", FaultEntry("vf1", "vf_stop", after=1, on="submission"),
                           vms=2)
    one_injected(s, "vf_stop")
    assert events(s, "vf_resume") == []
    assert isinstance(hit[1], DeviceError) and "ABORTED" in str(hit[1]), f"seed {SEED}"
    assert events(s, "watchdog"), f"seed {SEED}"
    victim_ok(victim)


@pytest.mark.parametrize("attach", ["pci", "vfio", "mmio"])
@pytest.mark.parametrize("action", ["vf_reset", "vf_stop"])
def test_vf_actions_are_refused_off_sriov(attach: str, action: str) -> None:
    s = Session(attach=attach, memory=MEMORY,
                faults=FaultPlan([FaultEntry("vm0", action, at_ns=0, name="vfr")]))
    with pytest.raises(FaultPlanError, match=r"faults\[0\] \('vfr'\)\.action: 'vm0' is not "
                                             r"an SR-IOV VF"):
        s.launch()
    assert s.state is SessionState.FAILED


# -- iommu_unmap ------------------------------------------------------------------------


@pytest.mark.parametrize("attach", ["vfio", "sriov"])
def test_iommu_unmap_of_the_next_dmas_pages_faults_that_dma(attach: str) -> None:
    gone = FaultEntry("vm0" if attach == "vfio" else "vf1", "iommu_unmap", after=1,
                      on="submission", name="gone")
    s, outcomes = run(attach, gone, vms=2 if attach == "sriov" else 1)
    ev = one_injected(s, "iommu_unmap")
    assert ev.get("unmapped") == ev.get("length") == 4096
    faults = events(s, "iommu_fault")
    assert faults and all(f.t_ns == ev.t_ns and "not mapped" in f.get("reason")
                          for f in faults)
    first = faults[0].get("iova")
    assert ev.get("iova") <= first < ev.get("iova") + 4096
    # The command buffer's read fails DMA_FAULT; the reply on the same page breaks the
    # ring and the driver resets the function.
    assert isinstance(outcomes[0][1], DeviceError) and "DMA_FAULT" in str(outcomes[0][1])
    assert events(s, "ring_broken")[0].get("rule") == "ring/dma"
    if attach == "sriov":
        victim_ok(outcomes[1])


def test_iommu_unmap_of_a_range_and_map_back_after_the_duration() -> None:
    s = Session(attach="vfio", seed=SEED, memory=MEMORY, keep_trace=True,
                faults=FaultPlan([FaultEntry("vm0", "iommu_unmap", at_ns=0, iova=0x200000,
                                             length=0x3000, duration_ns=5_000)]))
    with s:
        assert s.host is not None
        rid = s.vm.passthrough[0].host_function.requester_id
        domain = s.host.iommu.domain_of(rid)
        assert domain is not None
        before = domain.mapped_bytes()
        t0 = s.now_ns()
        s.machine.sched.run_until_time(t0 + 1)
        assert domain.mapped_bytes() == before - 0x3000 and domain.find(0x201000) is None
        s.machine.sched.run_until_time(t0 + 6_000)
        assert domain.mapped_bytes() == before and domain.find(0x201000) is not None
    (ev,) = events(s, "fault_injected")
    assert (ev.get("iova"), ev.get("length"), ev.get("unmapped")) == (0x200000, 0x3000, 0x3000)
    (cleared,) = events(s, "fault_cleared")
    assert cleared.get("mapped") == 0x3000 and cleared.t_ns == ev.t_ns + 5_000


@pytest.mark.parametrize("attach", ["mmio", "pci"])
def test_iommu_unmap_is_refused_without_an_iommu(attach: str) -> None:
    s = Session(attach=attach, memory=MEMORY,
                faults=FaultPlan([FaultEntry("vm0", "iommu_unmap", at_ns=0)]))
    with pytest.raises(FaultPlanError, match=r"faults\[0\]\.action: 'vm0' has no IOMMU"):
        s.launch()


# -- kill_process -----------------------------------------------------------------------


@pytest.mark.parametrize("attach", ["pci", "sriov"])
def test_kill_process_closes_the_programs_files_mid_submission(attach: str) -> None:
    kill = FaultEntry("vm0" if attach == "pci" else "vf1", "kill_process", after=1,
                      on="submission")
    vms = 2 if attach == "sriov" else 1
    s, outcomes = run(attach, kill, vms=vms)
    ev = one_injected(s, "kill_process")
    assert (ev.get("process"), ev.get("files")) == (1, 1)
    os_ = s.vms[0].programs[0]
    assert os_ is not None and getattr(os_, "killed") is True
    assert all(f.closed for f in getattr(os_, "files"))
    # The dead program's later calls find its file closed.
    error = outcomes[0][1]
    assert isinstance(error, DriverError) and error.errno == 9, f"seed {SEED}: {error!r}"
    if vms == 2:
        victim_ok(outcomes[1])
    assert digest_of(attach, kill, vms=vms) == s.digest()


def test_kill_process_of_a_program_that_never_ran_is_skipped() -> None:
    s, [(result, error)] = run("pci", FaultEntry("vm0", "kill_process", after=1,
                                                 on="submission", process=2))
    assert error is None and result["ok"] is True
    (skip,) = events(s, "fault_skipped")
    assert "no program 2" in skip.get("reason")


# -- no plan, no change ---------------------------------------------------------------


def test_device_actions_that_never_fire_change_nothing() -> None:
    never = [FaultEntry("vm0", a, probability=0, on="command")
             for a in ("hang_engine", "needs_reset")]
    assert digest_of("pci", *never) == digest_of("pci")
