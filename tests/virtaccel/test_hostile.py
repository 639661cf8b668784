"""`virtaccel hostile`: the verdict logic on fakes, the CLI on every attachment, and the
whole catalogue on mmio (the other three attachments: `make campaign`)."""
from __future__ import annotations

import json
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import pytest

from hwspec import isa
from virtaccel.cli import main
from virtaccel.suites.hostile import Attack, Scenario, Setup, Verdict, run_scenario, run_suite
from virtaccel.suites.hostile.catalogue import CATEGORIES, catalogue, select
from virtaccel.suites.hostile.raw import cmd
from virtaccel.suites.hostile.report import to_html

# Scenarios that FAIL or WEDGE today because of issue 11's device/driver defects, fixed
# elsewhere: (scenario, attachment) -> defect number. Remove an entry when its fix lands
# (test_full_catalogue fails on an entry that no longer fails, so the list stays true).
KNOWN_DEFECTS: dict[tuple[str, str], int] = {}


def _sc(program: Any, name: str = "test/fake", setup: Setup = Setup.LIVE) -> Scenario:
    return Scenario(name, "accelerator", "test/rule", program, setup=setup)


# -- verdict logic -----------------------------------------------------------------------------

def test_a_handled_scenario_passes() -> None:
    def storm(a: Attack) -> None:
        for _ in range(50):
            a.dev.t.notify(2)
    r = run_scenario(_sc(storm), "mmio", seed=1)
    assert r.verdict is Verdict.PASS and r.rule == "test/rule"
    assert "function works" in r.reason and r.virtual_ns > 0


def test_a_refused_command_is_a_reject_naming_its_status() -> None:
    def bad_opcode(a: Attack) -> None:
        assert a.ctx is not None
        a.dev.submit(a.ctx, cmd(0x7F))
    r = run_scenario(_sc(bad_opcode), "pci", seed=2)
    assert r.verdict is Verdict.REJECT and r.rule == "cmd:BAD_OPCODE"
    assert "cmd:BAD_OPCODE" in r.observed


def test_a_broken_ring_is_a_reject_with_needs_reset() -> None:
    r = run_scenario(next(s for s in catalogue() if s.name == "ring/loop-self/submitq"), "mmio")
    assert r.verdict is Verdict.REJECT and r.rule == "ring/loop"
    assert r.reason.startswith("NEEDS_RESET")


def test_a_function_that_never_comes_back_is_wedged() -> None:
    def wedge(a: Attack) -> None:
        device = a.session.vms[0].accelerators[0].device
        setattr(device, "notify", lambda index: None)   # the fake: it stops answering
    r = run_scenario(_sc(wedge), "mmio", seed=3)
    assert r.verdict is Verdict.WEDGED and "does not come back" in r.reason


def test_a_victim_that_stops_is_wedged_and_the_run_ends() -> None:
    def stop_victim(a: Attack) -> None:
        setattr(a.session.vms[1].pci_accelerators[0].device, "notify", lambda index: None)
    r = run_scenario(_sc(stop_victim), "pci", seed=4, budget_ns=5_000_000)
    assert r.verdict is Verdict.WEDGED and r.reason.startswith("hung: victim")
    assert r.virtual_ns >= 5_000_000


def test_an_exception_escaping_from_the_device_is_a_fail() -> None:
    def boom(index: int) -> None:
        raise RuntimeError("kernel blew up")

    def raise_in_device(a: Attack) -> None:
        setattr(a.session.vms[0].accelerators[0].device, "notify", boom)
        a.dev.t.notify(2)
    r = run_scenario(_sc(raise_in_device), "mmio", seed=5)
    assert r.verdict is Verdict.FAIL and r.rule == "isolation/exception"
    assert "RuntimeError: kernel blew up" in r.reason and "attacker" in r.reason


def test_an_exception_in_the_victim_is_a_fail() -> None:
    def boom(index: int) -> None:
        raise MemoryError("numpy")

    def poison_victim(a: Attack) -> None:
        setattr(a.session.vms[1].accelerators[0].device, "notify", boom)
    r = run_scenario(_sc(poison_victim), "mmio", seed=6)
    assert r.verdict is Verdict.FAIL and "into the victim" in r.reason


def test_memory_outside_the_attackers_reach_is_a_fail() -> None:
    def scribble(a: Attack) -> None:
        victim = a.session.vms[1].memory
        victim.write(victim.base + victim.size - 8, b"\xde\xad\xbe\xef" * 2)
    r = run_scenario(_sc(scribble), "vfio", seed=7)
    assert r.verdict is Verdict.FAIL and r.rule == "isolation/memory"
    assert "victim RAM (top)" in r.reason


def test_a_breach_seen_by_the_guest_is_a_fail_with_its_rule() -> None:
    r = run_scenario(_sc(lambda a: a.breach("x/rule", "seen")), "mmio")
    assert (r.verdict, r.rule, r.reason) == (Verdict.FAIL, "x/rule", "seen")


def test_a_bug_in_the_hostile_program_is_named_as_such() -> None:
    def buggy(a: Attack) -> None:
        raise KeyError("mine")
    r = run_scenario(_sc(buggy), "mmio")
    assert r.verdict is Verdict.FAIL and r.rule == "harness/program"


def test_the_same_seed_gives_the_same_results() -> None:
    scs = select(catalogue(), names=["qos/flood-gemm32", "status/reset-storm", "cmd/call-self"])
    a = [r.as_dict() for r in run_suite(scs, ["sriov"], seed=9).results]
    b = [r.as_dict() for r in run_suite(scs, ["sriov"], seed=9).results]
    for r in a + b:
        r.pop("wall_s")
    assert a == b and len(a) == 3


# -- the catalogue ------------------------------------------------------------------------------

def test_the_catalogue_is_broad() -> None:
    scs = catalogue()
    runs = {a: sum(s.applies(a) for s in scs) for a in ("mmio", "pci", "vfio", "sriov", "vdpa")}
    assert all(n >= 300 for n in runs.values()), runs
    assert {s.category for s in scs} == set(CATEGORIES)
    assert len({s.name for s in scs}) == len(scs)
    assert all(s.rule and s.doc for s in scs), [s.name for s in scs if not s.doc]


def _bad(results: list[Any]) -> dict[tuple[str, str], str]:
    return {(r.scenario, r.attach): f"{r.verdict.value} {r.rule}: {r.reason}"
            for r in results if r.verdict.bad}


@pytest.mark.parametrize("attach", [
    "mmio",
    # 3-20 s each: `make campaign` runs them (pytest -m campaign), `make test` does not.
    *[pytest.param(a, marks=pytest.mark.campaign) for a in ("pci", "vfio", "sriov", "vdpa")]])
def test_full_catalogue(attach: str) -> None:
    report = run_suite(catalogue(), [attach], seed=0)
    bad = _bad(report.results)
    known = {k for k in KNOWN_DEFECTS if k[1] == attach}
    unexpected = {k: v for k, v in bad.items() if k not in known}
    fixed = sorted(k for k in known if k not in bad)
    assert not unexpected, unexpected
    assert not fixed, f"fixed now: remove {fixed} from KNOWN_DEFECTS"


def test_vdpa_category_has_no_wedged_or_fail() -> None:
    """The hostile VMM of a vdpa device (vhost ioctls, IOTLB, eventfds, netlink) while a
    victim on another function works: every scenario PASS or REJECT."""
    report = run_suite([s for s in catalogue() if s.category == "vDPA"], ["vdpa"], seed=0)
    assert len(report.results) >= 35
    assert _bad(report.results) == {}
    assert not any("expected" in n for r in report.results for n in r.notes), \
        [(r.scenario, r.notes) for r in report.results if r.notes]


# -- the CLI -----------------------------------------------------------------------------------

SMOKE = "ring/loop-self,ring/avail-jump-0x11/submitq,status/ack-to-0x08,mmio/write8-status," \
        "pci/notify-wrong-value,admin/reset-victim-on-submitq,vfio/map-overlap,cmd/opcode-0x7f," \
        "toctou/cmdbuf-after-0ns,vdpa/iotlb-overlap"


@pytest.mark.parametrize("attach", ["mmio", "pci", "vfio", "sriov", "vdpa"])
def test_cli_smoke(attach: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out, page = tmp_path / "h.json", tmp_path / "h.html"
    code = main(["hostile", "--attach", attach, "--scenario", SMOKE, "--seed", "3",
                 "--json", str(out), "--html", str(page)])
    text = capsys.readouterr().out
    assert code == 0, text
    doc = json.loads(out.read_text())
    names = {r["scenario"] for r in doc["results"]}
    assert {"ring/loop-self/controlq", "ring/loop-self/submitq", "cmd/opcode-0x7f"} <= names
    assert ("mmio/write8-status" in names) == (attach == "mmio")
    assert ("vfio/map-overlap" in names) == (attach in ("vfio", "sriov"))
    assert ("admin/reset-victim-on-submitq" in names) == (attach == "sriov")
    assert ("vdpa/iotlb-overlap" in names) == (attach == "vdpa")
    assert doc["ok"] is True and doc["seed"] == 3 and doc["attachments"] == [attach]
    assert sum(doc["totals"].values()) == doc["scenarios"] == len(doc["results"])
    loop = next(r for r in doc["results"] if r["scenario"] == "ring/loop-self/submitq")
    assert loop["verdict"] == "REJECT" and loop["rule"] == "ring/loop"
    assert "REJECT" in text and "split ring" in text and "wrote HTML" in text
    assert "<table>" in page.read_text()


def test_cli_exit_1_on_a_failing_scenario(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["hostile", "--attach", "pci", "--scenario", "pci/bus-master-off-with-wait"])
    text = capsys.readouterr().out
    assert code == (1 if ("pci/bus-master-off-with-wait-parked", "pci") in KNOWN_DEFECTS else 0)
    if code:
        assert "WEDGED and FAIL" in text and "pci/bus-master-dma" in text


def test_cli_json_on_stdout(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["hostile", "--attach", "mmio", "--scenario", "cmd/opcode-0x5",
                 "--json", "-"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert [r["verdict"] for r in doc["results"]] == ["REJECT"]


@pytest.mark.parametrize("argv, what", [
    (["--attach", "vhost"], "--attach"),
    (["--attach", ""], "--attach"),
    (["--category", "rings"], "--category"),
    (["--scenario", "nothing/like/this"], "no scenario matches"),
    (["--html", "/nonexistent-dir/x.html"], "--html"),
    (["--json", "/nonexistent-dir/x.json"], "--json"),
    (["--seed", "-1"], "--seed"),
])
def test_cli_bad_arguments_exit_2(argv: list[str], what: str,
                                  capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["hostile", *argv]) == 2
    err = capsys.readouterr().err
    assert what in err and len(err.strip().splitlines()) == 1


# -- the HTML page -----------------------------------------------------------------------------

class _Tables(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.stack: list[str] = []
        self.tables = 0
        self.h2: list[str] = []
        self._in_h2 = False

    def handle_starttag(self, tag: str, attrs: Any) -> None:
        if tag in ("meta",):
            return
        self.stack.append(tag)
        self.tables += tag == "table"
        self._in_h2 = tag == "h2"

    def handle_endtag(self, tag: str) -> None:
        assert self.stack and self.stack[-1] == tag, (self.stack[-3:], tag)
        self.stack.pop()
        self._in_h2 = False

    def handle_data(self, data: str) -> None:
        if self._in_h2:
            self.h2.append(data)


def test_html_report_is_one_well_formed_page_with_a_table_per_category() -> None:
    scs = select(catalogue(), names=["ring/loop-self", "mmio/write8-status", "cmd/opcode-0x5",
                                     "status/ack-to-0x08"])
    report = run_suite(scs, ["mmio", "pci"], seed=0)
    page = to_html(report, title="a <review> & more")
    p = _Tables()
    p.feed(page)
    p.close()
    assert p.stack == [] and p.tables == 1 + 4
    assert [h.split(" (")[0] for h in p.h2[1:]] == ["split ring", "status state machine",
                                                   "virtio-mmio registers", "accelerator"]
    assert "a &lt;review&gt; &amp; more" in page and "<script" not in page
    assert 'class="v-REJECT">REJECT' in page and "ring/loop" in page
