"""Fault plans on real sessions: each implemented action happens where the hardware
would fail (MSI port, line, DMA port, MMIO exit, PCI config), is traced, and replays
from the seed. The driver's recovery from lost interrupts is asserted here; the
multi-tenant recovery tests are in tests/tenants/test_driver_recovery.py."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from guest_driver.kernel import GuestKernel
from userspace_runtime import DeviceError
from virtaccel import Session, SessionState, SessionStateError
from virtaccel.guests import mlp
from virtaccel.images import ImageError, parse_image, run_image
from vmm.faults import FaultEntry, FaultPlan, FaultPlanError
from vmm.trace import TraceEvent

SEED = 20261124
SMALL = {"batch": 4, "sizes": (16, 32, 8)}
MEMORY = 32 << 20


def small_mlp(os_: Any) -> Any:
    return mlp.main(os_, seed=SEED, **SMALL)


def run(attach: str, *entries: FaultEntry, seed: int = SEED,
        program: Any = small_mlp) -> tuple[Session, Any, BaseException | None]:
    plan = FaultPlan(entries) if entries else None
    s = Session(attach=attach, seed=seed, memory=MEMORY, keep_trace=True, faults=plan)
    with s:
        task = s.spawn(program, name="prog")
        s.run_tasks()
    return s, task.result, task.error


def events(s: Session, kind: str, source: str | None = None) -> list[TraceEvent]:
    return [e for e in s.trace.events
            if e.kind == kind and (source is None or e.source == source)]


def injected(s: Session) -> list[TraceEvent]:
    evs = events(s, "fault_injected", "faults")
    assert evs, f"seed {s.seed}: no fault injected"
    return evs


def device_source(s: Session) -> str:
    return {"pci": "vm0.va1pci.1", "mmio": "vm0.va1.0"}.get(s.attach, "host.01:00.0")


def replays(attach: str, *entries: FaultEntry, program: Any = small_mlp) -> str:
    """Two runs of the same seed and plan give the same digest; returns it."""
    a, _, _ = run(attach, *entries, program=program)
    b, _, _ = run(attach, *entries, program=program)
    assert a.digest() == b.digest(), f"seed {SEED}"
    assert [e.fields for e in injected(a)] == [e.fields for e in injected(b)]
    return a.digest()


# -- interrupts ---------------------------------------------------------------------------


def three_mlps(os_: Any) -> list[Any]:
    return [small_mlp(os_) for _ in range(3)]


def polls(s: Session) -> list[TraceEvent]:
    """The driver's polls after a lost interrupt (its `irq_polled` events)."""
    return [e for e in s.trace.events if e.kind == "irq_polled"]


@pytest.mark.parametrize("attach", ["pci", "vfio"])
def test_drop_interrupt_loses_one_msi_and_the_driver_polls_it(attach: str) -> None:
    lost = FaultEntry("vm0", "drop_interrupt", after=12, on="interrupt", name="lost")
    s, result, error = run(attach, lost)
    (ev,) = injected(s)
    assert dict(ev.fields) == {"entry": "lost", "action": "drop_interrupt", "function": "vm0",
                               "vector": ev.get("vector")}
    sent = len(events(s, "irq", device_source(s)))
    assert len(events(s, "msi_send", "vm0.irq")) == sent - 1, f"seed {SEED}"
    # The lost interrupt answered a control request: the driver's recovery timer finds
    # the answer unreaped within two periods (1 ms each) and polls it; no reset, no 1 s
    # control timeout.
    assert error is None and result["ok"] is True, f"seed {SEED}"
    (poll,) = polls(s)
    assert poll.get("completions") == 1 and ev.t_ns < poll.t_ns <= ev.t_ns + 2_000_000
    assert not [e for e in events(s, "reset") if e.source == "vm0.kernel"]
    assert s.now_ns() < 10_000_000
    clean, _, _ = run(attach)
    assert s.digest() != clean.digest()
    assert replays(attach, lost) == s.digest()


def test_drop_of_a_completion_interrupt_is_polled_and_event_idx_rearmed() -> None:
    """Issue 10 regression: with EVENT_IDX one lost MSI wedged its submit queue for good
    (the device never interrupted it again, the driver never polled). Now the poll reaps
    the completion and moves used_event, so the device interrupts that queue again."""
    s, result, error = run("pci", FaultEntry("vm0", "drop_interrupt", after=1, on="submission"),
                           program=three_mlps)
    assert error is None and all(r["ok"] for r in result), f"seed {SEED}"
    (ev,) = injected(s)
    (poll,) = polls(s)
    assert poll.get("completions") == 1 and ev.t_ns < poll.t_ns <= ev.t_ns + 2_000_000
    vector = ev.get("vector")
    later = [e for e in events(s, "msi", "vm0.irq")
             if e.get("vector") == vector and e.t_ns > poll.t_ns]
    assert later, f"seed {SEED}: the queue's vector never fired after the poll"
    sig = [(e.get("context"), e.get("fence")) for e in events(s, "fence_signal")]
    assert len(sig) == len(set(sig)) == len(events(s, "submit_end"))


def test_drop_interrupt_on_a_level_line_is_polled_and_the_line_works_again() -> None:
    s, result, error = run("mmio", FaultEntry("vm0", "drop_interrupt", after=1, on="submission"))
    (ev,) = injected(s)
    assert ev.get("line") == 5
    assert error is None and result["ok"] is True, f"seed {SEED}"
    (poll,) = polls(s)
    # the poll ACKed InterruptStatus: the device dropped its line, the next used
    # buffer raised it again
    rises = [e.t_ns for e in events(s, "irq_line", "vm0.irq") if e.get("level") is True]
    assert any(t > poll.t_ns for t in rises), f"seed {SEED}"


@pytest.mark.parametrize("attach", ["pci", "sriov"])
def test_delay_interrupt_delivers_the_message_later(attach: str) -> None:
    late = FaultEntry("vm0", "delay_interrupt", delay_ns=40_000, after=1, on="submission")
    s, result, error = run(attach, late)
    assert error is None and result["ok"] is True, f"seed {SEED}"
    (ev,) = injected(s)
    assert ev.get("delay_ns") == 40_000
    vector = ev.get("vector")
    source = "host.msi" if attach == "sriov" else "vm0.irq"
    kind = "host_msi" if attach == "sriov" else "msi_send"
    times = [e.t_ns for e in events(s, kind, source) if e.get("vector") == vector]
    assert ev.t_ns not in times and ev.t_ns + 40_000 in times
    assert replays(attach, late) == s.digest()


def test_delay_interrupt_on_a_level_line_raises_it_later() -> None:
    late = FaultEntry("vm0", "delay_interrupt", delay_ns=30_000, after=1, on="submission")
    s, result, error = run("mmio", late)
    assert error is None and result["ok"] is True, f"seed {SEED}"
    (ev,) = injected(s)
    rises = [e.t_ns for e in events(s, "irq_line", "vm0.irq") if e.get("level") is True]
    assert ev.t_ns not in rises and ev.t_ns + 30_000 in rises


def test_duplicate_interrupt_delivers_the_message_twice() -> None:
    twice = FaultEntry("vm0", "duplicate_interrupt", after=1, on="submission", delay_ns=5_000)
    s, result, error = run("pci", twice)
    assert error is None and result["ok"] is True, f"seed {SEED}"
    (ev,) = injected(s)
    vector = ev.get("vector")
    sends = [e.t_ns for e in events(s, "msi_send", "vm0.irq") if e.get("vector") == vector]
    assert ev.t_ns in sends and ev.t_ns + 5_000 in sends
    assert len(events(s, "msi_send", "vm0.irq")) == len(events(s, "irq", "vm0.va1pci.1")) + 1
    handled = [e.t_ns for e in events(s, "msi", "vm0.irq") if e.get("vector") == vector]
    assert any(t > ev.t_ns + 5_000 for t in handled)   # the copy ran the handler again
    assert replays("pci", twice) == s.digest()


# -- DMA ----------------------------------------------------------------------------------


@pytest.mark.parametrize("attach", ["mmio", "sriov"])
def test_fail_dma_read_fails_the_submission_with_dma_fault(attach: str) -> None:
    """Armed at the submission's start, the fault hits the device's read of the command
    buffer: the submission completes with DMA_FAULT, the program sees it."""
    bad = FaultEntry("vm0", "fail_dma_read", after=1, on="submission", name="cmdbuf")
    s, _, error = run(attach, bad)
    assert isinstance(error, DeviceError) and "DMA_FAULT" in str(error), f"seed {SEED}"
    (ev,) = injected(s)
    assert ev.get("action") == "fail_dma_read" and ev.get("length") == 352
    assert [e.get("status") for e in events(s, "submit_end")] == ["DMA_FAULT"]
    if attach == "sriov":   # refused as an IOMMU fault: logged and traced by the IOMMU
        assert s.host is not None
        (fault,) = s.host.iommu.faults
        assert (fault.iova, fault.length, fault.write) == (ev.get("iova"), 352, False)
        assert "cmdbuf" in fault.reason
    assert replays(attach, bad) == s.digest()


def test_fail_dma_write_refuses_the_access() -> None:
    bad = FaultEntry("vm0", "fail_dma_write", after=1, on="submission")
    s, _, error = run("pci", bad)
    assert isinstance(error, DeviceError) and "DMA_FAULT" in str(error), f"seed {SEED}"
    (ev,) = injected(s)
    assert ev.get("action") == "fail_dma_write"
    assert events(s, "submit_end")[0].get("status") == "DMA_FAULT"


def test_fail_dma_write_on_the_used_ring_breaks_the_ring() -> None:
    """The Nth DMA of the function: here a write of the used ring, which the device
    turns into NEEDS_RESET; the driver resets the function and the program still ends
    right (this ring break happens before any submission)."""
    s, result, error = run("pci", FaultEntry("vm0", "fail_dma_write", after=300, on="dma"))
    (ev,) = injected(s)
    assert ev.get("length") == 2
    assert len(events(s, "ring_broken")) == 1
    assert events(s, "reset", "vm0.va1pci.1")
    assert error is None and result["ok"] is True, f"seed {SEED}"


# -- MMIO exits ---------------------------------------------------------------------------


def exit_costs(kernel: GuestKernel) -> list[int]:
    """The virtual time of ten trapped reads of the virtio-mmio magic register."""
    base = kernel.platform_devices[0].base
    costs = []
    for _ in range(10):
        t0 = kernel.sched.now_ns()
        kernel.mmio.read(base, 4)
        costs.append(kernel.sched.now_ns() - t0)
    return costs


def test_delay_mmio_exit_adds_to_one_exit() -> None:
    slow = FaultEntry("vm0", "delay_mmio_exit", delay_ns=7_000, at_ns=0, name="slow")
    for plan in (FaultPlan([slow]), None):
        s = Session(attach="mmio", seed=SEED, memory=MEMORY, keep_trace=True, faults=plan)
        with s:
            task = s.spawn_kernel(exit_costs)
            s.run_tasks()
        assert task.error is None
        if plan is None:
            assert task.result == [1000] * 10
        else:
            assert sorted(task.result) == [1000] * 9 + [8000], f"seed {SEED}"
            (ev,) = injected(s)
            assert ev.get("entry") == "slow" and ev.get("delay_ns") == 7_000


# -- FLR ----------------------------------------------------------------------------------


@pytest.mark.parametrize("attach", ["pci", "sriov"])
def test_flr_resets_the_function_from_the_host(attach: str) -> None:
    reset = FaultEntry("vf1" if attach == "sriov" else "vm0", "flr", after=5, on="interrupt")
    s, _, error = run(attach, reset)
    (ev,) = injected(s)
    assert ev.get("function") == "vm0" and ev.get("action") == "flr"
    flrs = events(s, "flr")
    assert flrs[0].t_ns == ev.t_ns   # (sriov: the guest's recovery resets the VF again)
    # The driver finds out only when a control request times out: its context is lost.
    assert isinstance(error, OSError) and "device reset" in str(error), f"seed {SEED}"
    assert replays(attach, reset) == s.digest()


def test_flr_keeps_the_bars_decoding() -> None:
    s = Session(attach="pci", seed=SEED, memory=MEMORY,
                faults=FaultPlan([FaultEntry("vm0", "flr", at_ns=0)]))
    with s:
        fn = s.vm.pci_accelerators[0].function
        fn.config_write(0x04, 2, 0x6)            # memory decoding and bus mastering on
        bar_before = fn.config_read(0x10, 4)
        s.machine.sched.run_until_time(10)
        assert fn.config_read(0x10, 4) == bar_before and bar_before != 0
        assert fn.config_read(0x04, 2) & 0x6 == 0x6
        assert s.vm.pci_accelerators[0].device.active is False
        assert s.injector is not None and [f.action for f in s.injector.injected] == ["flr"]


# -- triggers, RNG, zero cost -------------------------------------------------------------


def test_a_plan_that_never_fires_changes_nothing() -> None:
    """Hooks installed, probability 0: same trace as with no plan (the plan's RNG is its
    own, nothing is traced until a fault happens)."""
    never = [FaultEntry("vm0", a, probability=0, on=k) for a, k in
             [("drop_interrupt", "interrupt"), ("fail_dma_read", "dma"),
              ("fail_dma_write", "kick"), ("delay_interrupt", "command")]]
    never[3] = FaultEntry("vm0", "delay_interrupt", probability=0, on="command", delay_ns=1)
    s, result, _ = run("pci", *never)
    clean, result0, _ = run("pci")
    assert s.digest() == clean.digest() and result == result0
    assert s.injector is not None
    counts = s.injector.counts("vm0")
    assert counts["interrupt"] > 0 and counts["dma"] > 0 and counts["kick"] > 0
    assert counts["command"] == 10


def test_probability_draws_replay_with_the_seed_and_vary_with_it() -> None:
    p = FaultEntry("vm0", "delay_interrupt", probability=0.5, on="interrupt", delay_ns=3_000)

    def fired(seed: int) -> list[int]:
        s, result, error = run("pci", p, seed=seed)
        assert error is None and result["ok"] is True, f"seed {seed}"
        return [e.t_ns for e in events(s, "fault_injected")]

    a, b = fired(SEED), fired(SEED)
    assert a == b and 0 < len(a)
    assert any(fired(seed) != a for seed in (SEED + 1, SEED + 2))


def test_at_ns_arms_the_fault_at_that_time() -> None:
    s, _, _ = run("pci", FaultEntry("vm0", "delay_interrupt", at_ns=200_000, delay_ns=1_000))
    (ev,) = injected(s)
    assert ev.t_ns >= 200_000
    after = [e.t_ns for e in events(s, "irq", "vm0.va1pci.1") if e.t_ns >= 200_000]
    assert after[0] == ev.t_ns          # the first interrupt once the fault is armed


def test_after_n_kicks() -> None:
    s, _, _ = run("pci", FaultEntry("vm0", "delay_mmio_exit", after=3, on="kick",
                                    delay_ns=2_500))
    assert s.injector is not None and s.injector.counts("vm0")["kick"] > 3
    assert injected(s)[0].get("delay_ns") == 2_500


# -- bad plans are refused before the run -------------------------------------------------


def test_unknown_function_is_refused_when_the_session_is_made() -> None:
    with pytest.raises(FaultPlanError, match=r"faults\[0\]\.function: no function 'vm9'"):
        Session(attach="pci", faults=FaultPlan([FaultEntry("vm9", "flr", at_ns=0)]))
    with pytest.raises(FaultPlanError, match="no function 'vf3'"):
        Session(attach="sriov", vms=2, faults=FaultPlan([FaultEntry("vf3", "flr", at_ns=0)]))
    with pytest.raises(FaultPlanError, match="no function '0000:01:00.0'"):
        Session(attach="pci", faults=FaultPlan([FaultEntry("0000:01:00.0", "flr", at_ns=0)]))


def test_unknown_pci_name_is_refused_at_launch_with_nothing_left_running() -> None:
    s = Session(attach="vfio", memory=MEMORY,
                faults=FaultPlan([FaultEntry("0000:07:00.0", "flr", at_ns=0)]))
    with pytest.raises(FaultPlanError, match=r"no function '0000:07:00.0' in this session"):
        s.launch()
    assert s.state is SessionState.FAILED and s.vms[0].closed


def test_a_pci_name_names_the_assigned_function() -> None:
    s = Session(attach="vfio", memory=MEMORY,
                faults=FaultPlan([FaultEntry("0000:01:00.0", "flr", at_ns=0)]))
    with s:
        s.machine.sched.run_until_time(s.now_ns() + 1)
        assert s.injector is not None and s.injector.injected[0].function == "vm0"


@pytest.mark.parametrize("action,extra", [("flr", {}), ("duplicate_interrupt", {})])
def test_actions_the_attachment_cannot_take_are_refused(action: str, extra: dict[str, int]
                                                        ) -> None:
    s = Session(attach="mmio", memory=MEMORY,
                faults=FaultPlan([FaultEntry("vm0", action, at_ns=0, **extra)]))
    with pytest.raises(FaultPlanError, match=r"faults\[0\]\.action"):
        s.launch()
    assert s.state is SessionState.FAILED


def test_a_time_already_past_is_refused() -> None:
    s = Session(attach="sriov", memory=MEMORY,
                faults=FaultPlan([FaultEntry("vf1", "flr", at_ns=10)]))
    with pytest.raises(FaultPlanError, match=r"at_ns: 10 ns is already past"):
        s.launch()


def test_install_faults_once_and_before_the_guests() -> None:
    plan = FaultPlan([FaultEntry("vm0", "drop_interrupt", after=1000, on="interrupt")])
    with pytest.raises(SessionStateError, match="needs state ready"):
        Session(attach="pci").install_faults(plan)
    with Session(attach="pci", memory=MEMORY) as s:
        with pytest.raises(FaultPlanError, match="no function 'vm7'"):
            s.install_faults(FaultPlan([FaultEntry("vm7", "flr", at_ns=0)]))
        assert s.injector is None
        injector = s.install_faults(plan)
        assert s.injector is injector and s.faults is plan
        with pytest.raises(SessionStateError, match="already installed"):
            s.install_faults(plan)
    with Session(attach="pci", memory=MEMORY) as s:
        s.spawn(small_mlp)
        with pytest.raises(SessionStateError, match="already spawned"):
            s.install_faults(plan)
    with pytest.raises(TypeError, match="FaultPlan"):
        Session(attach="pci", faults=[FaultEntry("vm0", "flr", at_ns=0)])  # type: ignore[arg-type]


# -- VM images ----------------------------------------------------------------------------


def image(**faults: Any) -> dict[str, Any]:
    return {"name": "box", "seed": SEED, "machine": {"memory": "32M"},
            "accelerator": {"mode": "emulated", "transport": "pci"},
            "program": {"args": {"batch": 4, "sizes": [16, 32, 8]}},
            "faults": [dict({"function": "box", "action": "fail_dma_read", "after": 1,
                             "on": "submission"}, **faults)]}


def test_image_faults_run_and_replay() -> None:
    img = parse_image(image(name="cmdbuf"))
    assert img.faults is not None and img.faults.entries[0].name == "cmdbuf"
    a = run_image(img, keep_trace=True)
    assert isinstance(a.error, DeviceError) and "DMA_FAULT" in str(a.error)
    hits = [e for e in a.trace_events if e.kind == "fault_injected"]
    assert [e.get("entry") for e in hits] == ["cmdbuf"]
    assert run_image(img).digest == a.digest


@pytest.mark.parametrize("fields,where,words", [
    ({"action": "melt"}, "faults[0].action", "unknown action"),
    ({"action": "vf_reset"}, "faults[0].action", "has no VF"),
    ({"action": "iommu_unmap"}, "faults[0].action", "behind the IOMMU"),
    ({"action": "kill_process", "process": 0}, "faults[0].process", "N >= 1"),
    ({"after": -2}, "faults[0].after", "N >= 1"),
    ({"on": "tick"}, "faults[0].on", "unknown event kind"),
    ({"at_ns": 5}, "faults[0].after", "at_ns and after"),
    ({"after": None, "on": None, "at_ns": -5}, "faults[0].at_ns", "0 .. 2**63-1"),
    ({"after": None, "probability": 2.0}, "faults[0].probability", "outside [0, 1]"),
    ({"action": "delay_interrupt"}, "faults[0].delay_ns", "missing"),
    ({"function": "other"}, "faults[0].function", "no function 'other'"),
    ({"speed": 3}, "faults[0].speed", "unknown key"),
])
def test_image_fault_errors_name_the_file_and_the_field(fields: dict[str, Any], where: str,
                                                        words: str) -> None:
    doc = image(**fields)
    doc["faults"][0] = {k: v for k, v in doc["faults"][0].items() if v is not None}
    with pytest.raises(ImageError) as info:
        parse_image(doc, "box.toml")
    assert str(info.value).startswith(f"box.toml: {where}: "), str(info.value)
    assert words in str(info.value)


def test_image_faults_must_be_an_array_of_tables_and_fit_the_attachment() -> None:
    doc = image()
    doc["faults"] = {"function": "box"}
    with pytest.raises(ImageError, match=r"box.toml: faults: must be an array of tables"):
        parse_image(doc, "box.toml")
    doc = image(action="flr")
    doc["accelerator"]["transport"] = "mmio"
    with pytest.raises(ImageError, match=r"faults\[0\].action: flr needs a PCI function"):
        parse_image(doc, "box.toml")


def test_sriov_image_faults_name_tenants_or_vfs(tmp_path: Path) -> None:
    doc = {"name": "t2", "machine": {"memory": "16M"},
           "accelerator": {"mode": "sriov-vf", "resources": {"device_memory": "8M"}},
           "tenant": [{"name": "alice"}, {"name": "bob"}],
           "faults": [{"function": "bob", "action": "flr", "at_ns": 10**9},
                      {"function": "vf1", "action": "drop_interrupt", "probability": 0.1,
                       "on": "interrupt"}]}
    img = parse_image(doc, "t2.toml")
    assert img.faults is not None and len(img.faults) == 2
    doc["faults"][1]["function"] = "vf3"
    with pytest.raises(ImageError, match=r"t2.toml: faults\[1\].function: no function 'vf3'"):
        parse_image(doc, "t2.toml")
