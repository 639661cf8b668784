"""Issue 13: the hostile suite's packed-ring category on every attachment: each bad input
ends in DEVICE_NEEDS_RESET with exactly its rule, and the function works again on a
packed ring after a reset (REJECT; never WEDGED, never FAIL)."""
from __future__ import annotations

import pytest

from virtaccel.suites.hostile import Verdict, run_scenario
from virtaccel.suites.hostile.catalogue import CATEGORIES, catalogue, select

PACKED = select(catalogue(), categories=["packed ring"])


def test_the_category_covers_the_issue_list() -> None:
    assert "packed ring" in CATEGORIES
    rules = {s.rule for s in PACKED}
    assert rules >= {"ring/packed-avail-flags", "ring/packed-id-in-flight",
                     "ring/packed-id-range", "ring/packed-chain-flags", "ring/indirect-next",
                     "ring/indirect-nested", "ring/indirect-len", "ring/packed-chain-len",
                     "ring/write-before-read", "ring/event-flags", "ring/event-off-range",
                     "notify/data", "queue/reset-not-enabled", "queue/reset-busy"}


@pytest.mark.parametrize("attach", ["mmio", "pci", "vfio", "sriov"])
def test_every_packed_scenario_is_fenced_with_its_rule_and_comes_back(attach: str) -> None:
    for sc in PACKED:
        r = run_scenario(sc, attach, seed=0)
        assert r.verdict is Verdict.REJECT, (sc.name, r.verdict, r.reason)
        assert r.rule == sc.rule and r.observed == [sc.rule], (sc.name, r.observed)
        assert r.reason.startswith("NEEDS_RESET") and "back after status 0" in r.reason, \
            (sc.name, r.reason)
