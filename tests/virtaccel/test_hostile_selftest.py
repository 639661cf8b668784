"""`virtaccel hostile --self-test`: every deliberate breakage of the device turns some
scenario FAIL or WEDGED, and the same scenarios are PASS/REJECT with it off."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from device_model import DeviceModelError
from device_model.testing_breaks import BREAKS, KNOWN, breaking
from virtaccel.cli import main
from virtaccel.suites.hostile.catalogue import catalogue, select
from virtaccel.suites.hostile.selftest import BREAKAGES, run_self_test


def test_every_breakage_is_caught_and_nothing_is_caught_with_it_off() -> None:
    report = run_self_test(seed=0)
    assert len(BREAKAGES) >= 10 and {b.name for b in BREAKAGES} == set(KNOWN)
    assert [c.breakage for c in report.catches] == [b.name for b in BREAKAGES]
    for c in report.catches:
        assert c.caught, f"{c.breakage} on {c.attach}: no scenario turned FAIL or WEDGED"
        assert not c.control_bad, f"{c.breakage} off: {[r.reason for r in c.control_bad]}"
        assert all(r.verdict.bad for r in c.caught)
    assert report.ok and not report.skipped and BREAKS == set()


def test_a_breakage_with_its_switch_off_leaves_its_scenarios_pass_or_reject() -> None:
    """The switch is the only difference: the catching scenarios, run directly."""
    from virtaccel.suites.hostile import run_suite
    scs = select(catalogue(), names=["ctx/cross-context-read", "time/signal-before-its-end"])
    off = run_suite(scs, ["mmio"], seed=0)
    assert {r.verdict.value for r in off.results} <= {"PASS", "REJECT"}
    with breaking("ctx/ignore-address-space", "write/early-signal"):
        on = run_suite(scs, ["mmio"], seed=0)
    assert {r.scenario: r.rule for r in on.results if r.verdict.bad} == {
        "ctx/cross-context-read": "ctx/address-space",
        "time/signal-before-its-end": "time/early-write"}
    assert BREAKS == set()


def test_an_unknown_breakage_is_refused_by_name_and_changes_nothing() -> None:
    with pytest.raises(DeviceModelError, match="'ring/no-such-rule'.*known: "):
        with breaking("ctx/no-fault-on-error", "ring/no-such-rule"):
            pass   # pragma: no cover
    assert BREAKS == set()


def test_breaks_are_restored_when_the_body_raises() -> None:
    with pytest.raises(RuntimeError):
        with breaking("pci/ignore-bus-master"):
            assert BREAKS == {"pci/ignore-bus-master"}
            raise RuntimeError("body")
    assert BREAKS == set()


def test_self_test_on_an_attachment_skips_what_does_not_apply() -> None:
    report = run_self_test(["mmio"], seed=0,
                           breakages=[b for b in BREAKAGES if b.name in
                                      ("pci/ignore-bus-master", "ctx/no-fault-on-error")])
    assert report.skipped == ["pci/ignore-bus-master"]
    assert [(c.breakage, c.attach) for c in report.catches] == [("ctx/no-fault-on-error",
                                                                  "mmio")]
    assert report.ok


def test_cli_self_test(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "s.json"
    assert main(["hostile", "--self-test", "--attach", "pci", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "self-test passed" in text and "pci/bus-master-off-with-wait-parked" in text
    doc = json.loads(out.read_text())
    assert doc["ok"] is True
    assert {b["breakage"] for b in doc["breakages"]} == {b.name for b in BREAKAGES}
    assert all(b["attach"] == "pci" and b["caught"] for b in doc["breakages"])


@pytest.mark.parametrize("argv, what", [
    (["--category", "split ring"], "--category"),
    (["--scenario", "ring/"], "--scenario"),
    (["--html", "x.html"], "--html"),
    (["--attach", "vdpa"], "--attach"),
])
def test_cli_self_test_bad_arguments_exit_2(argv: list[str], what: str,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["hostile", "--self-test", *argv]) == 2
    err = capsys.readouterr().err
    assert what in err and len(err.strip().splitlines()) == 1
