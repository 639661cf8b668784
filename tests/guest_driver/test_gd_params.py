"""The driver's parameters from the kernel command line (guest_driver.params): defaults,
values, other drivers' tokens ignored, and every bad token refused by name; a kernel
booted with a bad one binds no device and says why."""
from __future__ import annotations

import pytest

from gd_fakes import make_machine
from guest_driver.boot import boot
from guest_driver.params import POLL_NS, WATCHDOG_NS, DriverParams, ParamError, parse_cmdline
from guest_driver.testing_breaks import KNOWN


def test_defaults_and_values() -> None:
    assert parse_cmdline("") == DriverParams(POLL_NS, WATCHDOG_NS, frozenset())
    p = parse_cmdline("quiet va1.poll_ns=500000 root=/dev/vda va1.watchdog_ns=0x100000 "
                      "va1.break=recovery/no-watchdog,recovery/no-lost-irq-poll")
    assert (p.poll_ns, p.watchdog_ns) == (500_000, 0x100000)
    assert p.breaks == {"recovery/no-watchdog", "recovery/no-lost-irq-poll"}
    assert parse_cmdline(p.cmdline()) == p and DriverParams().cmdline() == ""
    assert set(KNOWN) >= p.breaks
    assert not p.poll_wait and parse_cmdline("va1.poll_wait=0") == DriverParams()
    polled = parse_cmdline("va1.poll_wait=1")
    assert polled.poll_wait and parse_cmdline(polled.cmdline()) == polled


@pytest.mark.parametrize("cmdline,message", [
    ("va1.nope=1", "the va1 driver has no parameter 'nope'"),
    ("va1.poll_ns", "no value"),
    ("va1.poll_ns=fast", "not an integer"),
    ("va1.watchdog_ns=0", "out of range"),
    ("va1.watchdog_ns=-5", "out of range"),
    ("va1.break=recovery/everything", "unknown breakage 'recovery/everything'"),
    ("va1.poll_wait=yes", "poll_wait='yes': 0 or 1"),
])
def test_bad_tokens_are_named(cmdline: str, message: str) -> None:
    with pytest.raises(ParamError, match=message):
        parse_cmdline(cmdline)


def test_a_bad_parameter_binds_nothing_and_says_why() -> None:
    k, _ = make_machine()
    k.cmdline = "va1.poll_ns=soon"
    gos = boot(k)
    assert gos.devices == {}
    assert len(gos.probe_errors) == 1 and "va1.poll_ns='soon'" in gos.probe_errors[0]


def test_parameters_reach_the_driver() -> None:
    k, _ = make_machine()
    k.cmdline = "va1.watchdog_ns=7000000 va1.break=recovery/no-watchdog"
    dev = boot(k).devices["/dev/accel/accel0"]
    assert dev.watchdog_ns == 7_000_000 and dev.poll_ns == POLL_NS
    assert dev.breaks == {"recovery/no-watchdog"}
