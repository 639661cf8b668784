"""The suite's self-test: it can fail. Each deliberate breakage of the device
(device_model.testing_breaks) is switched on in turn, the scenarios that should catch it
run, and at least one must turn FAIL or WEDGED; the same scenarios run with it off must
all be PASS or REJECT (docs/hostile.md, "Self-test")."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from device_model.testing_breaks import KNOWN, breaking

from .catalogue import catalogue, select
from .core import Result
from .runner import run_suite


@dataclass(frozen=True)
class Breakage:
    """A device breakage and the scenarios (name prefixes) that should catch it, on the
    attachments where they run (first: the default)."""
    name: str
    scenarios: tuple[str, ...]
    attachments: tuple[str, ...]

    @property
    def doc(self) -> str:
        return KNOWN[self.name]


BREAKAGES: tuple[Breakage, ...] = (
    Breakage("ring/skip-index-range", ("ring/head-range", "ring/next-range",
                                       "ring/indirect-next-range"),
             ("mmio", "pci", "vfio", "sriov")),
    Breakage("ring/skip-avail-idx-check", ("ring/avail-jump-0x11",),
             ("mmio", "pci", "vfio", "sriov")),
    Breakage("ring/skip-write-before-read", ("ring/write-before-read",),
             ("mmio", "pci", "vfio", "sriov")),
    Breakage("status/allow-any-transition", ("status/ack-to", "status/driver-to",
                                             "status/driver-ok-to"),
             ("mmio", "pci", "vfio", "sriov")),
    Breakage("cmd/skip-partition-check", ("cmd/fill-past-end", "cmd/fill-far", "cmd/d2d-",
                                          "cmd/gemm-c-far", "cmd/conv-far", "cmd/softmax-far"),
             ("sriov", "mmio", "pci", "vfio")),
    Breakage("cmd/skip-dtype-check", ("cmd/gemm-bad-dtype",), ("mmio", "pci", "vfio", "sriov")),
    Breakage("ctx/ignore-address-space", ("ctx/cross-context-read",),
             ("sriov", "mmio", "pci", "vfio")),
    Breakage("ctx/no-fault-on-error", ("cmd/faulted-context-keeps-submitting",),
             ("mmio", "pci", "vfio", "sriov")),
    Breakage("write/early-signal", ("time/signal-before-its-end",),
             ("mmio", "pci", "vfio", "sriov")),
    Breakage("reset/keep-pending-work", ("status/reset-with-work-in-flight",
                                         "pci/flr-with-work-in-flight"),
             ("pci", "mmio", "vfio", "sriov")),
    Breakage("pci/ignore-bus-master", ("pci/bus-master-off-with-wait-parked",),
             ("pci", "vfio", "sriov")),
)


@dataclass
class Catch:
    """One breakage on one attachment: what it turned bad, and the control run."""
    breakage: str
    attach: str
    caught: list[Result] = field(default_factory=list)     # FAIL/WEDGED with the break on
    runs: int = 0
    control_bad: list[Result] = field(default_factory=list)  # FAIL/WEDGED with it off
    wall_s: float = 0.0

    @property
    def ok(self) -> bool:
        return bool(self.caught) and not self.control_bad

    def as_dict(self) -> dict[str, Any]:
        return {"breakage": self.breakage, "doc": KNOWN[self.breakage], "attach": self.attach,
                "scenarios": self.runs, "ok": self.ok,
                "caught": [{"scenario": r.scenario, "verdict": r.verdict.value, "rule": r.rule,
                            "reason": r.reason} for r in self.caught],
                "control_bad": [r.as_dict() for r in self.control_bad],
                "wall_s": round(self.wall_s, 3)}


@dataclass
class SelfTestReport:
    seed: int
    catches: list[Catch] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)   # breakages no chosen attachment runs
    wall_s: float = 0.0

    @property
    def ok(self) -> bool:
        return bool(self.catches) and all(c.ok for c in self.catches)

    def as_dict(self) -> dict[str, Any]:
        return {"seed": self.seed, "ok": self.ok, "wall_s": round(self.wall_s, 3),
                "breakages": [c.as_dict() for c in self.catches], "skipped": list(self.skipped)}


def run_self_test(attachments: Sequence[str] | None = None, seed: int = 0, *,
                  breakages: Sequence[Breakage] = BREAKAGES,
                  progress: Callable[[Catch], None] | None = None) -> SelfTestReport:
    """Each breakage on its default attachment (or on each of `attachments` it applies
    to): its scenarios with the break on, then with it off."""
    wall0 = time.perf_counter()
    report = SelfTestReport(seed)
    scs = catalogue()
    for b in breakages:
        where = [b.attachments[0]] if attachments is None else \
            [a for a in attachments if a in b.attachments]
        if not where:
            report.skipped.append(b.name)
            continue
        chosen = select(scs, names=b.scenarios)
        for attach in where:
            t0 = time.perf_counter()
            with breaking(b.name):
                on = run_suite(chosen, [attach], seed)
            off = run_suite(chosen, [attach], seed)
            c = Catch(b.name, attach, [r for r in on.results if r.verdict.bad],
                      len(on.results), [r for r in off.results if r.verdict.bad],
                      time.perf_counter() - t0)
            report.catches.append(c)
            if progress is not None:
                progress(c)
    report.wall_s = time.perf_counter() - wall0
    return report
