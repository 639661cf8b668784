"""Suspend, resume and a live move of a running tenant's vdpa device: its in-flight
work and everything it submits afterwards complete, checked against numpy."""
from __future__ import annotations

from typing import Any

from virtaccel import Session
from virtaccel.guests import tenant

SEED = 11
WORK: dict[str, Any] = {"count": 64, "queues": 2, "depth": 3, "m": 32, "k": 64, "n": 32}


def _tenant(seed: int) -> Any:
    return lambda os_: tenant.checked_gemm(os_, seed, **WORK)


def _counter(s: Session, source_prefix: str) -> list[int]:
    done = [0]

    def watch(ev: Any) -> None:
        if ev.kind == "submit_end" and ev.source.startswith(source_prefix):
            done[0] += 1
    s.watch(watch)
    return done


def test_live_move_from_one_vf_to_another_completes_in_flight_and_later_work() -> None:
    with Session(attach="vdpa", seed=SEED, spare=1, vdpa_parent="vf") as s:
        host = s.host
        assert host is not None
        assert list(host.vdpa.mgmtdevs) == ["pci/0000:01:00.1", "pci/0000:01:00.2"]  # VF 1, 2
        old_parent = host.vdpa.device("vdpa0").parent
        done_old = _counter(s, "host.01:00.1")
        done_new = _counter(s, "host.01:00.2")
        seen: dict[str, Any] = {}

        def mover() -> None:
            s.machine.wait_until(lambda: done_old[0] >= 10, None, "some work done")
            migration = old_parent.migration
            assert migration is not None
            seen["in_flight"] = not migration.quiescent
            seen["before"] = done_old[0]
            seen["name"] = s.move_vdpa("pci/0000:01:00.2")
            seen["drained"] = done_old[0]

        task = s.spawn(_tenant(s.seed), name="tenant")
        s.spawn_host(mover, "mover")
        s.run_tasks()
        assert task.error is None, task.error
        result = task.result
    assert seen["in_flight"] is True                # work was in flight when it moved
    assert seen["drained"] > seen["before"]         # SUSPEND finished it on the old one
    assert done_new[0] > 0                          # later work ran on the new function
    assert done_old[0] + done_new[0] == WORK["count"]
    assert result["completions"] == WORK["count"] and result["ok"]
    assert tenant.verify(result, SEED)              # every result is numpy's
    assert seen["name"] == "vdpa0~1"
    assert set(host.vdpa.devices) == {"vdpa0~1"}
    assert host.vdpa.mgmtdevs["pci/0000:01:00.1"].device is None


def test_suspend_stops_taking_work_and_resume_goes_on() -> None:
    with Session(attach="vdpa", seed=SEED) as s:
        done = _counter(s, "host.01:00.0")
        seen: dict[str, int] = {}

        def pauser() -> None:
            s.machine.wait_until(lambda: done[0] >= 4, None, "some work done")
            backend = s.vm.vdpa[0].backend
            bases = backend.suspend()
            seen["at_suspend"] = done[0]
            seen["submitq_base"] = bases[2] + bases[3]
            s.machine.sleep(2_000_000)               # 2 ms of virtual time, suspended
            seen["after_sleep"] = done[0]
            backend.resume()

        task = s.spawn(_tenant(s.seed), name="tenant")
        s.spawn_host(pauser, "pauser")
        s.run_tasks()
        assert task.error is None, task.error
    assert seen["after_sleep"] == seen["at_suspend"]   # nothing new taken while suspended
    assert seen["submitq_base"] == seen["at_suspend"]  # bases = what was taken = completed
    assert task.result["completions"] == WORK["count"]
    assert tenant.verify(task.result, SEED)
