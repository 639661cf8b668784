"""Fault plans: every bad entry is refused when the plan is made, naming the entry and
the field; good ones keep what they were given."""
from __future__ import annotations

import math
from typing import Any

import pytest

from vmm.errors import VmmError
from vmm.faults import (ACTIONS, EVENT_KINDS, IMPLEMENTED, PLANNED, FaultEntry, FaultPlan,
                        FaultPlanError, fault_seed)


def entry(**kw: Any) -> dict[str, Any]:
    base: dict[str, Any] = {"function": "vm0", "action": "drop_interrupt", "after": 1,
                            "on": "interrupt"}
    base.update(kw)
    return {k: v for k, v in base.items() if v is not None}


def refused(raw: dict[str, Any], field: str | None, words: str, index: int = 1) -> FaultPlanError:
    """The plan [good entry, raw] is refused at entry 1, naming `field`."""
    with pytest.raises(FaultPlanError) as info:
        FaultPlan([entry(), raw])
    e = info.value
    assert (e.index, e.field) == (index, field), str(e)
    assert words in str(e), str(e)
    assert f"faults[{index}]" in str(e)
    return e


def test_a_good_plan_keeps_its_entries_and_labels() -> None:
    plan = FaultPlan([entry(name="lost"), FaultEntry("vf2", "delay_interrupt", at_ns=5,
                                                     delay_ns=100),
                      entry(action="fail_dma_read", after=None, probability=0.25, on="dma")])
    assert len(plan) == 3
    assert [plan.label(i) for i in range(3)] == ["lost", "faults[1]", "faults[2]"]
    assert plan.entries[1] == FaultEntry("vf2", "delay_interrupt", at_ns=5, delay_ns=100)
    assert plan.entries[2].probability == 0.25 and plan.entries[2].event_kind == "dma"
    assert plan.entries[0].as_dict() == {"function": "vm0", "action": "drop_interrupt",
                                         "after": 1, "on": "interrupt", "name": "lost"}
    assert FaultPlan([plan.entries[0].as_dict()]).entries == plan.entries[:1]


def test_vocabulary() -> None:
    assert set(IMPLEMENTED) | set(PLANNED) == set(ACTIONS)
    assert EVENT_KINDS == ("submission", "command", "kick", "interrupt", "dma")
    assert issubclass(FaultPlanError, VmmError) and issubclass(FaultPlanError, ValueError)


def test_unknown_action() -> None:
    refused(entry(action="explode"), "action", "unknown action 'explode'")


def test_every_action_is_implemented() -> None:
    assert PLANNED == () and len(set(IMPLEMENTED)) == len(IMPLEMENTED) == 13


def test_parameters_only_where_they_mean_something() -> None:
    refused(entry(action="vf_reset", duration_ns=5), "duration_ns", "takes no duration_ns")
    refused(entry(action="vf_stop", duration_ns=0), "duration_ns", "1 .. 2**63-1")
    refused(entry(action="flr", iova=0), "iova", "takes no iova")
    refused(entry(action="iommu_unmap", iova=0x1000), "length", "go together")
    refused(entry(action="iommu_unmap", length=0x1000), "iova", "go together")
    refused(entry(action="iommu_unmap", iova=0x1001, length=0x1000), "iova", "aligned")
    refused(entry(action="iommu_unmap", iova=0x1000, length=0), "length", "positive multiple")
    refused(entry(action="iommu_unmap", iova=(1 << 64) - 0x1000, length=0x2000), "length",
            "overflows 64 bits")
    refused(entry(action="hang_engine", process=1), "process", "only kill_process")
    refused(entry(action="kill_process", process=0), "process", "N >= 1")
    refused(entry(action="kill_process", process="1"), "process", "must be an integer")
    ok = FaultPlan([entry(action="iommu_unmap", iova=0x2000, length=0x3000, duration_ns=9),
                    entry(action="vf_stop", duration_ns=100), entry(action="kill_process",
                                                                    process=2)])
    assert ok.entries[0].as_dict()["iova"] == 0x2000 and ok.entries[2].process == 2


def test_negative_time() -> None:
    refused(entry(after=None, on=None, at_ns=-1), "at_ns", "-1")


def test_after_zero() -> None:
    refused(entry(after=0), "after", "N >= 1")


def test_unknown_event_kind() -> None:
    refused(entry(on="doorbell"), "on", "unknown event kind 'doorbell'")


def test_both_at_ns_and_after() -> None:
    refused(entry(at_ns=10), "after", "at_ns and after given")


def test_no_trigger() -> None:
    refused(entry(after=None, on=None), None, "no trigger")


def test_on_missing_with_after_and_given_with_at_ns() -> None:
    refused(entry(on=None), "on", "missing")
    refused(entry(after=None, at_ns=5), "on", "only with after or probability")


@pytest.mark.parametrize("p", [1.5, -0.1, math.nan])
def test_probability_outside_0_1(p: float) -> None:
    refused(entry(after=None, probability=p), "probability", "outside [0, 1]")


@pytest.mark.parametrize("p", [0, 0.0, 1, 1.0])
def test_probability_bounds_are_allowed(p: float) -> None:
    assert FaultPlan([entry(after=None, probability=p)]).entries[0].probability == p


@pytest.mark.parametrize("action", ["delay_interrupt", "delay_mmio_exit"])
def test_delays_need_delay_ns(action: str) -> None:
    refused(entry(action=action), "delay_ns", "missing")
    refused(entry(action=action, delay_ns=0), "delay_ns", "1 ..")


def test_delay_ns_only_where_it_means_something() -> None:
    refused(entry(action="fail_dma_read", delay_ns=5), "delay_ns", "takes no delay_ns")
    assert FaultPlan([entry(action="duplicate_interrupt", delay_ns=0)]).entries[0].delay_ns == 0


def test_names_are_unique() -> None:
    with pytest.raises(FaultPlanError, match=r"faults\[1\] \('x'\)\.name: used by another"):
        FaultPlan([entry(name="x"), entry(name="x")])


def test_table_keys_and_types_are_checked() -> None:
    refused(entry(colour="red"), "colour", "unknown key")
    refused(entry(after="3"), "after", "must be an integer")
    refused(entry(after=True), "after", "must be an integer")
    refused(entry(after=None, probability="half"), "probability", "must be a number")
    refused(entry(function=3), "function", "must be text")
    refused({"action": "flr", "at_ns": 0}, "function", "missing")
    refused({"function": "vm0", "at_ns": 0}, "action", "missing")
    refused(entry(function=" "), "function", "missing")


def test_check_functions_names_the_entry() -> None:
    plan = FaultPlan([entry(), entry(function="nope", name="n")])
    with pytest.raises(FaultPlanError, match=r"faults\[1\] \('n'\)\.function: no function 'nope'"):
        plan.check_functions(lambda f: f == "vm0")


def test_fault_seed_is_its_own_stream() -> None:
    assert fault_seed(0) != 0 and fault_seed(1) != fault_seed(2)
    assert fault_seed(7) == fault_seed(7)
