"""The test kit's pytest plugin: a failing test names the seed of every session it built."""
from __future__ import annotations

import pytest

pytest_plugins = ["pytester"]


def test_a_failing_test_reports_its_sessions_seeds(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        """
        from virtaccel import Session

        def test_fails(make_session):
            s = make_session(attach="pci", seed=4242, memory=8 << 20)
            Session(attach="mmio", seed=77, vms=["alpha"])   # never launched, still named
            assert s.state.value == "closed"

        def test_passes(make_session):
            assert make_session(seed=9).state.value == "ready"
        """)
    result = pytester.runpytest_inprocess("-p", "no:cacheprovider")
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines([
        "*virtaccel sessions (replay with these seeds)*",
        "pci session, VMs vm0: seed 4242",
        "mmio session, VMs alpha: seed 77",
    ])
    assert "seed 9" not in result.stdout.str()
