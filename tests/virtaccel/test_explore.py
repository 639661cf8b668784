"""Invariants (suites.invariants) and seed exploration (suites.explore, `virtaccel
explore`): a clean run keeps every invariant, each breach kind is named when forced, a
failure shrinks to the one fault that breaks, and the report is the same whatever
--jobs or the engine (local processes, a Dask LocalCluster)."""
from __future__ import annotations

import json
import tomllib
from pathlib import Path
from typing import Any

import pytest

from virtaccel import Session
from virtaccel.cli import main
from virtaccel.images import load_image
from virtaccel.suites.explore import check_breaks, explore, plan_toml, run_once
from virtaccel.suites.invariants import BREACH_KINDS, Invariants
from vmm.faults import FaultEntry, FaultPlan
from vmm.trace import TraceEvent

TINY = """\
name = "tenants-2"
description = "two small tenants, for explore tests"
seed = 0
[machine]
memory = "16M"
[accelerator]
mode = "sriov-vf"
transport = "pci"
[accelerator.config]
num_compute_units = 2
[accelerator.resources]
device_memory = "8M"
num_submit_queues = 1
max_contexts = 2
[program]
entry = "virtaccel.guests.tenant:checked_gemm"
[program.args]
count = 4
depth = 2
m = 16
k = 16
n = 16
[[tenant]]
name = "t1"
[[tenant]]
name = "t2"
"""

DROP = FaultEntry("t1", "drop_interrupt", after=6, on="interrupt", name="drop")
HARMLESS = (
    FaultEntry("t2", "delay_interrupt", after=2, on="interrupt", delay_ns=5000, name="late"),
    FaultEntry("t2", "duplicate_interrupt", after=3, on="interrupt", name="twice"),
    FaultEntry("t1", "delay_interrupt", after=1, on="kick", delay_ns=3000, name="slow"),
)


@pytest.fixture()
def tiny(tmp_path: Path) -> Path:
    p = tmp_path / "tenants-2.toml"
    p.write_text(TINY)
    return p


# -- invariants -----------------------------------------------------------------------------


def test_clean_run_keeps_every_invariant(tiny: Path) -> None:
    breaches, injected = run_once(load_image(tiny), 3, ())
    assert breaches == [] and injected == 0


def test_harmless_faults_keep_every_invariant(tiny: Path) -> None:
    breaches, injected = run_once(load_image(tiny), 3, HARMLESS)
    assert injected == 3
    assert breaches == [], [str(b) for b in breaches]


def _ev(t: int, source: str, kind: str, **fields: object) -> TraceEvent:
    return TraceEvent(t, source, kind, tuple(fields.items()))


@pytest.fixture()
def watcher() -> Any:
    """An Invariants on a launched two-VM session, fed events by hand (forced breaches)."""
    s = Session(attach="pci", vms=["a", "b"], memory=16 << 20, seed=1).launch()
    inv = Invariants(s, wait_bound_ns=1000)
    yield inv
    s.close()


def kinds(inv: Invariants, **kw: Any) -> list[str]:
    return [b.kind for b in inv.check(**kw)]


def test_fresh_watcher_has_no_breach(watcher: Invariants) -> None:
    assert watcher.check() == [] and watcher.victims == ["a", "b"]


def test_double_signal(watcher: Invariants) -> None:
    for t in (10, 20):
        watcher(_ev(t, "a.kernel", "fence_signal", context=1, fence=1, status=0))
    assert kinds(watcher) == ["double_signal"]
    assert "context 1 fence 1 signalled again" in str(watcher.check()[0])


def test_unnamed_status(watcher: Invariants) -> None:
    watcher(_ev(10, "a.kernel", "fence_signal", context=1, fence=1, status=999))
    assert kinds(watcher) == ["unnamed_status"]


def test_lost_fence_gap_wait_and_device_completion(watcher: Invariants) -> None:
    dev = next(src for src, vm in watcher._device.items() if vm == "a")
    watcher(_ev(10, "a.kernel", "fence_signal", context=1, fence=2, status=0))
    watcher(_ev(11, "a.kernel", "wait", what="fence", context=1, fence=3))
    watcher(_ev(12, dev, "submit_start", queue=2, context=1, fence=4))
    watcher(_ev(13, dev, "submit_end", queue=2, context=1, fence=4, status="OK"))
    got = watcher.check()
    assert [b.kind for b in got] == ["lost_fence"] * 3
    assert "fences 1 never signalled" in got[0].detail
    assert "fence 3 waited on" in got[1].detail
    assert "completed 1 submission(s) with fence 4" in got[2].detail


def test_hung_wait_over_the_bound_and_forever(watcher: Invariants) -> None:
    watcher(_ev(0, "machine", "wait", task="a", what="x", timeout=-1))
    watcher(_ev(5000, "machine", "wake", task="a", what="x", ok=True))
    watcher(_ev(6000, "machine", "wait", task="b", what="y", timeout=-1))
    watcher(_ev(6100, "machine", "wake", task="b", what="y", ok=False))
    watcher(_ev(7000, "machine", "wait", task="b", what="sleep", timeout=10**6))
    watcher(_ev(10**6 + 7000, "machine", "wake", task="b", what="sleep", ok=False))
    got = watcher.check()
    assert [(b.kind, b.where) for b in got] == [("hung_wait", "a"), ("hung_wait", "b")]
    assert "5000 ns (bound 1000 ns)" in got[0].detail and "forever" in got[1].detail


def test_victims_error_failed_stalled(watcher: Invariants) -> None:
    dev_b = next(src for src, vm in watcher._device.items() if vm == "b")
    watcher(_ev(1, "faults", "fault_injected", entry="x", action="flr", function="a"))
    watcher(_ev(2, "a.kernel", "fence_signal", context=1, fence=1, status=1))   # faulted VM
    watcher(_ev(3, "b.kernel", "fence_signal", context=1, fence=1, status=8))   # victim
    watcher(_ev(4, dev_b, "submit_start", queue=2, context=1, fence=2))
    watcher(_ev(5, "machine", "task_end", task="b", ok=False))
    assert watcher.victims == ["b"]
    got = watcher.check(results={"a": False, "b": False})
    assert [b.kind for b in got] == ["victim_error", "victim_stalled", "victim_failed",
                                     "victim_failed"]
    assert all(b.where == "b" for b in got)
    assert "DMA_FAULT" in got[0].detail


def test_driver_violation_only_for_the_projects_driver() -> None:
    s = Session(attach="pci", vms=["a", "b"], memory=16 << 20, seed=1).launch()
    try:
        inv = Invariants(s, foreign=["b"])
        for vm, src in sorted((vm, src) for src, vm in inv._device.items()):
            inv(_ev(1, src, "violation", rule="2.1.2", message="written while DRIVER_OK"))
        assert [(b.kind, b.where) for b in inv.check()] == [("driver_violation", "a")]
    finally:
        s.close()


def test_violations_between_a_reset_behind_the_driver_and_its_recovery_are_excused(
        watcher: Invariants) -> None:
    dev = next(src for src, vm in watcher._device.items() if vm == "a")
    watcher(_ev(1, "faults", "fault_injected", entry="f", action="flr", function="a"))
    watcher(_ev(2, dev, "violation", rule="queue/not-ready", message="notify(2)"))
    assert watcher.check() == [] and watcher.excused_violations == 1
    watcher(_ev(3, "a.kernel", "reset", dev="accel0"))
    watcher(_ev(4, dev, "violation", rule="queue/not-ready", message="notify(2)"))
    assert kinds(watcher) == ["driver_violation"]   # after the driver's reset: its own


def test_every_breach_kind_is_documented() -> None:
    doc = Path(__file__).resolve().parents[2].joinpath("docs", "faults.md").read_text()
    for k in BREACH_KINDS:
        assert f"`{k}`" in doc, k


def test_bad_watcher_arguments() -> None:
    s = Session(attach="pci", memory=16 << 20).launch()
    try:
        with pytest.raises(ValueError, match="wait_bound_ns 0"):
            Invariants(s, wait_bound_ns=0)
        with pytest.raises(ValueError, match="foreign VMs nope"):
            Invariants(s, foreign=["nope"])
        with pytest.raises(ValueError, match="unknown breakage 'x'"):
            check_breaks(["x"])
        assert check_breaks([NO_POLL, NO_WATCHDOG, NO_POLL]) == BROKEN
    finally:
        s.close()


# -- explore --------------------------------------------------------------------------------

# The driver's recovery of a lost interrupt, broken on purpose (guest_driver.testing_breaks):
# no used-ring poll and no watchdog, so a dropped interrupt leaves its fence unsignalled.
NO_POLL, NO_WATCHDOG = "recovery/no-lost-irq-poll", "recovery/no-watchdog"
BROKEN = (NO_POLL, NO_WATCHDOG)


def test_shrinks_to_the_one_fault_that_breaks(tiny: Path) -> None:
    """With the driver's lost-interrupt recovery broken, of four faults only the dropped
    interrupt breaks an invariant (its fence is never signalled, its wait hangs until the
    run's time limit); the shrinker keeps it alone, and its TOML replays the failure."""
    image = load_image(tiny)
    plan = FaultPlan(HARMLESS[:1] + (DROP,) + HARMLESS[1:])
    report = explore(image, range(0, 2), plan=plan, breaks=BROKEN)
    assert report.failures and [r.seed for r in report.failures] == [0, 1]
    for r in report.failures:
        assert [e["name"] for e in r.minimal or []] == ["drop"], f"seed {r.seed}"
        assert {b["kind"] for b in r.breaches} >= {"lost_fence", "hung_wait"}
        assert all(b["where"] == "t1" for b in r.breaches)    # t2, the victim, is fine
    again = explore(image, range(0, 1), plan=FaultPlan(
        [FaultEntry(**e) for e in report.failures[0].minimal or []]), breaks=BROKEN)
    assert not again.ok
    assert again.failures[0].breaches == report.failures[0].minimal_breaches


@pytest.mark.parametrize("breaks,fault", [
    (("recovery/no-abort-on-reset",), FaultEntry("t1", "flr", after=3, on="command")),
    (("recovery/no-abort-on-reset",), FaultEntry("t1", "needs_reset", after=3, on="command")),
    ((NO_WATCHDOG,), FaultEntry("t1", "flr", after=3, on="command")),
    (BROKEN, DROP),
], ids=lambda v: v.action if isinstance(v, FaultEntry) else "+".join(v))
def test_each_driver_breakage_loses_a_fence_the_real_driver_keeps(
        tiny: Path, breaks: tuple[str, ...], fault: FaultEntry) -> None:
    """Each recovery breakage (va1.break=, guest_driver.testing_breaks) is seen by the
    invariants under a fault it should have recovered from, and only on the faulted
    tenant; the real driver keeps every invariant under the same fault."""
    image = load_image(tiny)
    broken, injected = run_once(image, 0, (fault,), breaks)
    assert injected == 1
    assert {b.kind for b in broken} == {"lost_fence", "hung_wait"}, [str(b) for b in broken]
    assert all(b.where.startswith("t1") for b in broken), [str(b) for b in broken]
    assert run_once(image, 0, (fault,)) == ([], 1)


def test_a_bad_driver_parameter_is_refused_before_the_run(tmp_path: Path) -> None:
    from virtaccel.images import ImageError
    bad = tmp_path / "bad.toml"
    bad.write_text(TINY + '[guest]\ncmdline = "va1.watchdog_ns=never"\n')
    with pytest.raises(ImageError, match=r"guest.cmdline: kernel parameter va1.watchdog_ns="):
        load_image(bad)
    with pytest.raises(ValueError, match="VM 'vm0': kernel parameter 'va1.x=1'"):
        Session(attach="mmio", cmdline="va1.x=1")
    with pytest.raises(ValueError, match="time_limit_ns=0"):
        Session(attach="mmio", time_limit_ns=0)


def test_an_image_passes_its_cmdline_to_every_guest(tmp_path: Path) -> None:
    good = tmp_path / "good.toml"
    good.write_text(TINY + '[guest]\ncmdline = "va1.watchdog_ns=9000000"\n')
    image = load_image(good)
    assert image.cmdline == "va1.watchdog_ns=9000000"
    with Session.from_image(image) as s:
        assert [vm.kernel.cmdline for vm in s.vms] == ["va1.watchdog_ns=9000000"] * 2


def test_without_the_breakage_the_harmless_plan_passes(tiny: Path) -> None:
    report = explore(load_image(tiny), range(0, 2), plan=FaultPlan(HARMLESS))
    assert report.ok and report.as_dict()["faults_injected"] == 6


def test_random_plans_are_seeded(tiny: Path) -> None:
    from virtaccel.suites.explore import random_entries
    image = load_image(tiny)
    a, b = random_entries(image, 7, 5), random_entries(image, 7, 5)
    assert a == b and len(a) == 5 and a != random_entries(image, 8, 5)
    FaultPlan(a)   # valid
    assert all(e.function in ("t1", "t2") for e in a)


def cli(argv: list[str], capsys: Any) -> tuple[int, str, str]:
    code = main(argv)
    out, err = capsys.readouterr()
    return code, out, err


def test_cli_report_is_the_same_whatever_jobs(tiny: Path, tmp_path: Path, capsys: Any) -> None:
    docs = []
    for jobs in ("1", "2"):
        out = tmp_path / f"j{jobs}.json"
        code, _, _ = cli(["explore", str(tiny), "--seeds", "0:4", "--random-faults", "3",
                          "--break", ",".join(BROKEN), "--jobs", jobs, "--json", str(out)],
                         capsys)
        docs.append(out.read_text())
        assert code == (0 if json.loads(docs[-1])["ok"] else 1)
    assert docs[0] == docs[1]
    doc = json.loads(docs[0])
    assert doc["runs"] == 4 and doc["faults_injected"] > 0


def test_cli_prints_seed_and_minimal_plan(tiny: Path, tmp_path: Path, capsys: Any) -> None:
    plan = tmp_path / "plan.toml"
    plan.write_text(plan_toml([e.as_dict() for e in (DROP,) + HARMLESS]))
    plans = tmp_path / "plans"
    plans.mkdir()
    code, out, err = cli(["explore", str(tiny), "--seeds", "0:1", "--faults", str(plan),
                          "--jobs", "1", "--plans", str(plans), "--break", ",".join(BROKEN)],
                         capsys)
    assert code == 1, err
    assert "--- seed 0: minimal plan ---" in out and 'name = "drop"' in out
    written = (plans / "seed-0.toml").read_text()
    assert 'action = "drop_interrupt"' in written and "delay" not in written
    assert f"--break {NO_POLL},{NO_WATCHDOG}" in written.splitlines()[0]   # how to replay
    code, out, _ = cli(["explore", str(tiny), "--seeds", "0:1", "--faults",
                        str(plans / "seed-0.toml"), "--jobs", "1", "--break", ",".join(BROKEN)],
                       capsys)
    assert code == 1 and "1 failing seeds" in out
    code, out, _ = cli(["explore", str(tiny), "--seeds", "0:1", "--faults",
                        str(plans / "seed-0.toml"), "--jobs", "1"], capsys)
    assert code == 0 and "every invariant held" in out     # the real driver recovers


def test_cluster_run_equals_the_local_run(tiny: Path) -> None:
    """The same campaign on a Dask LocalCluster (in-process workers) reports the same."""
    distributed = pytest.importorskip("distributed")
    image = load_image(tiny)
    args: dict[str, Any] = {"random_faults": 3, "breaks": BROKEN}
    local = explore(image, range(0, 4), **args).as_dict()
    with distributed.LocalCluster(processes=False, n_workers=2, threads_per_worker=1,
                                  dashboard_address=None) as cluster:
        remote = explore(image, range(0, 4), cluster=cluster.scheduler_address,
                         **args).as_dict()
    assert remote == local
    assert local["runs"] == 4


BAD_PLANS = {
    "unknown action": ('[[faults]]\nfunction = "t1"\naction = "explode"\nat_ns = 0\n',
                       "unknown action 'explode'"),
    "no such function": ('[[faults]]\nfunction = "t9"\naction = "flr"\nat_ns = 0\n',
                         "no function 't9'"),
    "probability": ('[[faults]]\nfunction = "t1"\naction = "drop_interrupt"\n'
                    'probability = 1.5\non = "interrupt"\n', "outside [0, 1]"),
    "not toml": ("[[faults\n", "not valid TOML"),
    "other key": ('seed = 3\n', "unknown key 'seed'"),
}


@pytest.mark.parametrize("argv,message", [
    (["--seeds", "5:3"], "--seeds '5:3': empty range"),
    (["--seeds", "a:b"], "--seeds 'a:b': A and B must be integers"),
    (["--seeds", "4"], "--seeds '4': give A:B"),
    (["--seeds", "0:18446744073709551617"], "seeds are 0 .. 2**64-1"),
    (["--seeds", "0:1", "--faults", "/nonexistent/plan.toml"], "cannot read"),
    (["--seeds", "0:1", "--break", "nope"], "unknown breakage 'nope'"),
    (["--seeds", "0:1", "--wait-bound-ns", "100", "--time-limit-ns", "100"],
     "--time-limit-ns 100: must exceed the wait bound"),
    (["--seeds", "0:1", "--shrink", "-1"], "--shrink"),
    (["--seeds", "0:1", "--jobs", "0"], "--jobs: 0 is outside 1 .. 1024"),
    (["--seeds", "0:1", "--plans", "/nonexistent"], "--plans /nonexistent: not a directory"),
])
def test_bad_input_is_one_line_exit_2(tiny: Path, capsys: Any, argv: list[str],
                                      message: str) -> None:
    code, out, err = cli(["explore", str(tiny)] + argv, capsys)
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and message in err, err


@pytest.mark.parametrize("case", sorted(BAD_PLANS))
def test_bad_plan_is_one_line_exit_2(tiny: Path, tmp_path: Path, capsys: Any,
                                     case: str) -> None:
    text, message = BAD_PLANS[case]
    plan = tmp_path / "bad.toml"
    plan.write_text(text)
    code, out, err = cli(["explore", str(tiny), "--seeds", "0:1", "--faults", str(plan)],
                         capsys)
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and message in err and str(plan) in err, err


def test_unknown_image_is_one_line_exit_2(tmp_path: Path, capsys: Any) -> None:
    code, _, err = cli(["explore", str(tmp_path / "none.toml"), "--seeds", "0:1"], capsys)
    assert code == 2 and "cannot read" in err and err.count("\n") == 1


# -- the long campaign (make campaign) ------------------------------------------------------

# vm_images/plans/tenants-8-every-action.toml: one entry of every action of the issue.
EVERY_ACTION: list[dict[str, Any]] = tomllib.loads(
    (Path(__file__).resolve().parents[2] / "vm_images" / "plans"
     / "tenants-8-every-action.toml").read_text())["faults"]


TENANTS8 = Path(__file__).resolve().parents[2] / "vm_images" / "tenants-8.toml"


def test_the_every_action_plan_has_every_action_and_each_fires() -> None:
    """The campaign's plan is what its name says: every action of the vocabulary, and
    on seed 0 every entry is injected (none waits for an event that never comes)."""
    from dataclasses import replace

    from vmm.faults import ACTIONS
    from virtaccel.images import run_image
    plan = FaultPlan(EVERY_ACTION)
    assert sorted({e.action for e in plan.entries}) == sorted(ACTIONS)
    run = run_image(replace(load_image(TENANTS8), faults=plan), 0, keep_trace=True)
    fired = {ev.get("entry") for ev in run.trace_events if ev.kind == "fault_injected"}
    assert fired == {e.name for e in plan.entries}, "seed 0"


@pytest.mark.campaign
def test_campaign_tenants8_1000_seeds_every_action_keeps_every_invariant() -> None:
    """The issue's bar: 1000 seeds of tenants-8 with a plan of every implemented action,
    no invariant broken (every fence once, no hung wait, victims correct and going on)."""
    report = explore(load_image(TENANTS8), range(0, 1000), plan=FaultPlan(EVERY_ACTION),
                     workers=2)
    assert len(report.results) == 1000
    assert not report.failures, [(r.seed, [str(b) for b in r.breaches][:2])
                                 for r in report.failures[:5]]


@pytest.mark.campaign
def test_campaign_broken_recovery_is_found_and_shrunk(tmp_path: Path, capsys: Any) -> None:
    """The issue's bar, second half: the same 1000-seed command with the driver's recovery
    broken on purpose (no lost-interrupt poll, no watchdog) reports failing seeds, the
    first ones each with a minimal plan, shorter than the full one, that replays it, and
    that passes with the real driver."""
    plan = tmp_path / "every.toml"
    plan.write_text(plan_toml(EVERY_ACTION))
    out_json = tmp_path / "report.json"
    code, out, err = cli(["explore", str(TENANTS8), "--seeds", "0:1000", "--faults", str(plan),
                          "--jobs", "2", "--break", ",".join(BROKEN), "--shrink", "3",
                          "--json", str(out_json)], capsys)
    assert code == 1, err
    doc = json.loads(out_json.read_text())
    assert doc["failed_seeds"], "the broken recovery must break some seed"
    shrunk = [f for f in doc["failures"] if "minimal_plan" in f]
    assert len(shrunk) == min(3, len(doc["failed_seeds"]))
    image = load_image(TENANTS8)
    for f in shrunk:
        names = [e["name"] for e in f["minimal_plan"]]
        assert names and len(names) < len(EVERY_ACTION), (f["seed"], names)
        assert f"--- seed {f['seed']}: minimal plan ---" in out
        minimal = FaultPlan([FaultEntry(**e) for e in f["minimal_plan"]])
        again = explore(image, range(f["seed"], f["seed"] + 1), plan=minimal, breaks=BROKEN)
        assert not again.ok, f"seed {f['seed']}: minimal plan {names} does not replay"
        assert explore(image, range(f["seed"], f["seed"] + 1), plan=minimal).ok, f["seed"]


@pytest.mark.campaign
@pytest.mark.parametrize("entry", EVERY_ACTION, ids=lambda e: str(e["action"]))
def test_campaign_each_action_alone_200_seeds(entry: dict[str, Any]) -> None:
    """Each action on its own over 200 seeds of the saturated tenants-8 image: no fence
    lost or signalled twice, no hung wait, victims correct and still completing."""
    report = explore(load_image(TENANTS8), range(0, 200), plan=FaultPlan([entry]), workers=2)
    assert len(report.results) == 200
    assert not report.failures, [(r.seed, [str(b) for b in r.breaches][:2])
                                 for r in report.failures[:5]]
