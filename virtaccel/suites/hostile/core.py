"""The hostile-guest suite's vocabulary: scenarios, verdicts and what a scenario sees."""
from __future__ import annotations

import enum
import random
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:
    from ...session import Session
    from .raw import Bump, RawVa1

ATTACHMENTS = ("mmio", "pci", "vfio", "sriov", "vdpa")
PCI_LIKE = frozenset({"pci", "vfio", "sriov", "vdpa"})   # vdpa: its virtio-pci frontend
ALL = frozenset(ATTACHMENTS)


class Verdict(enum.Enum):
    """As hostile-guest suites report them, best first."""
    PASS = "PASS"        # handled: the function carried on, nothing fenced
    REJECT = "REJECT"    # refused or fenced (error status, NEEDS_RESET); a reset brings it back
    WEDGED = "WEDGED"    # the function does not come back, or a victim stopped
    FAIL = "FAIL"        # an exception escaped, memory outside the attacker's reach
                         # changed, a victim's result is wrong, or a rule broken in the open

    @property
    def bad(self) -> bool:
        return self in (Verdict.WEDGED, Verdict.FAIL)


class Setup(enum.Enum):
    LIVE = "live"        # the attacker's function is up: queues, a FLAT context
    RAW = "raw"          # found and reset, nothing negotiated
    HOST = "host"        # the program is the VMM's user of the VFIO uAPI (a host task)


@dataclass
class Attack:
    """What a scenario program is handed: its own raw device and RAM, a seeded RNG, and
    a way to report a rule the device broke that the guest can see (a breach)."""
    kernel: Any
    dev: "RawVa1"
    alloc: "Bump"
    rng: random.Random
    attach: str
    session: "Session"
    ctx: int | None = None
    breaches: list[tuple[str, str]] = field(default_factory=list)
    statuses: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    probe_features: int | None = None   # the features the after-reset probe brings up
                                        # with (None: the raw driver's BASE_FEATURES)

    def breach(self, rule: str, message: str) -> None:
        self.breaches.append((rule, message))

    def note(self, text: str) -> None:
        self.notes.append(text)

    def sleep(self, ns: int) -> None:
        self.kernel.sched.sleep(ns)

    def now(self) -> int:
        return int(self.kernel.sched.now_ns())


Program = Callable[..., object]
"""(attack) -> anything; the result is ignored (lambdas may bind defaults)."""


@dataclass(frozen=True)
class Scenario:
    """One hostile guest: `program(attack)` runs in the attacker VM while a victim does
    checked work. `rule` is the spec rule it exercises (docs/spec.md, virtio 1.x)."""
    name: str
    category: str
    rule: str
    program: Program
    attachments: frozenset[str] = ALL
    setup: Setup = Setup.LIVE
    doc: str = ""
    prepare: Callable[["Session"], None] | None = None   # test hook: after launch
    # Va1Config fields of the session's functions (e.g. virtio_features: the options a
    # scenario needs offered); empty: the default function
    device_config: tuple[tuple[str, int], ...] = ()

    def __post_init__(self) -> None:
        if not self.doc:
            text = (self.program.__doc__ or "").strip().splitlines()
            doc = text[0] if text else self.name.split("/", 1)[-1].replace("-", " ")
            object.__setattr__(self, "doc", doc)

    def applies(self, attach: str) -> bool:
        return attach in self.attachments


@dataclass
class Result:
    """One scenario on one attachment."""
    scenario: str
    category: str
    attach: str
    verdict: Verdict
    rule: str                                   # the rule the verdict is about
    reason: str
    observed: list[str] = field(default_factory=list)   # rules/statuses the device logged
    notes: list[str] = field(default_factory=list)      # what the hostile program saw
    virtual_ns: int = 0
    wall_s: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        return {"scenario": self.scenario, "category": self.category, "attach": self.attach,
                "verdict": self.verdict.value, "rule": self.rule, "reason": self.reason,
                "observed": list(self.observed), "notes": list(self.notes),
                "virtual_ns": self.virtual_ns,
                "wall_s": round(self.wall_s, 4)}
