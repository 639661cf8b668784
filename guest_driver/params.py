"""The VA-1 driver's parameters, read from the guest kernel's command line.

Why: as with a Linux module's parameters (`va1.watchdog_ns=...` on the kernel command
line), a test sets how the driver behaves without touching its code: the optional virtio
features it may accept (bring-up of each combination), the recovery timer's period, the
submission watchdog's bound, and deliberate breakages (`testing_breaks`).
Tokens without the `va1.` prefix belong to other drivers and are ignored; a `va1.` token
that names no parameter, or a value out of range, is refused with an error naming it (the
driver then binds nothing, as a module whose parameters are rejected does not load).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable

from hwspec import va1 as A
from hwspec import virtio as V

from .errors import GuestDriverError
from .testing_breaks import KNOWN as KNOWN_BREAKS
from .virtio.ring_factory import RING_FEATURES

# Recovery timer (docs/driver.md "Recovery"): while anything is in flight the driver
# looks every POLL_NS for used buffers left unreaped for a whole period (a lost
# interrupt: it polls) and for a submit queue with no completion for WATCHDOG_NS (it
# checks the device and resets it). WATCHDOG_NS is twice the device's default
# preemption timeout, the longest a legal command runs (§13).
POLL_NS = 1_000_000
WATCHDOG_NS = 2 * A.DEFAULT_PREEMPTION_TIMEOUT_NS
# Optional virtio features the driver can use, by the names `va1.features=` (and an image
# or the launcher) gives them (docs/driver.md "Feature choice"); it accepts
# DEFAULT_OPTIONAL unless told otherwise, so a default run negotiates what it always has.
FEATURE_NAMES = {"indirect": V.F_RING_INDIRECT_DESC, "event_idx": V.F_RING_EVENT_IDX,
                 "packed": V.F_RING_PACKED, "in_order": V.F_IN_ORDER,
                 "notification_data": V.F_NOTIFICATION_DATA, "ring_reset": V.F_RING_RESET}
OPTIONAL_FEATURES = RING_FEATURES | (1 << V.F_RING_RESET)
DEFAULT_OPTIONAL = (1 << V.F_RING_INDIRECT_DESC) | (1 << V.F_RING_EVENT_IDX)
PREFIX = "va1."
MAX_NS = 3_600_000_000_000   # an hour of virtual time


class ParamError(GuestDriverError, ValueError):
    """A `va1.` kernel parameter that names nothing, or whose value is out of range."""


@dataclass(frozen=True)
class DriverParams:
    """What the driver was loaded with (docs/driver.md, "Parameters")."""
    poll_ns: int = POLL_NS
    watchdog_ns: int = WATCHDOG_NS
    breaks: frozenset[str] = field(default_factory=frozenset)
    optional: int = DEFAULT_OPTIONAL     # OPTIONAL_FEATURES bits it may accept
    poll_wait: bool = False              # fence waits poll the used ring, interrupts off

    def cmdline(self) -> str:
        """These parameters as kernel command-line tokens (defaults left out)."""
        out = []
        if self.poll_ns != POLL_NS:
            out.append(f"{PREFIX}poll_ns={self.poll_ns}")
        if self.watchdog_ns != WATCHDOG_NS:
            out.append(f"{PREFIX}watchdog_ns={self.watchdog_ns}")
        if self.breaks:
            out.append(f"{PREFIX}break={','.join(sorted(self.breaks))}")
        if self.optional != DEFAULT_OPTIONAL:
            out.append(features_token(feature_names(self.optional)))
        if self.poll_wait:
            out.append(f"{PREFIX}poll_wait=1")
        return " ".join(out)


def feature_mask(names: Iterable[str]) -> int:
    """The feature bits of `names` (FEATURE_NAMES): ParamError naming an unknown one."""
    if isinstance(names, str):
        raise ParamError(f"features {names!r}: give a list of names")
    mask = 0
    for name in names:
        if name not in FEATURE_NAMES:
            raise ParamError(f"unknown feature {name!r} (known: {', '.join(FEATURE_NAMES)})")
        mask |= 1 << FEATURE_NAMES[name]
    return mask


def feature_names(mask: int) -> list[str]:
    """The FEATURE_NAMES of the bits set in `mask`, in table order."""
    return [n for n, bit in FEATURE_NAMES.items() if mask >> bit & 1]


def features_token(names: Iterable[str]) -> str:
    """The command-line token that lets the driver accept exactly `names`."""
    return f"{PREFIX}features={','.join(names)}"


def _ns(name: str, value: str) -> int:
    try:
        n = int(value, 0)
    except ValueError:
        raise ParamError(f"kernel parameter {PREFIX}{name}={value!r}: not an integer") from None
    if not 0 < n <= MAX_NS:
        raise ParamError(f"kernel parameter {PREFIX}{name}={n}: out of range "
                         f"(1 .. {MAX_NS} ns)")
    return n


def parse_cmdline(cmdline: str) -> DriverParams:
    """The driver's parameters on `cmdline`; ParamError naming the first bad token."""
    poll, watchdog, breaks, optional = POLL_NS, WATCHDOG_NS, frozenset[str](), DEFAULT_OPTIONAL
    poll_wait = False
    for token in cmdline.split():
        if not token.startswith(PREFIX):
            continue
        name, eq, value = token[len(PREFIX):].partition("=")
        if not eq:
            raise ParamError(f"kernel parameter {token!r}: no value (write {token}=VALUE)")
        if name == "poll_ns":
            poll = _ns(name, value)
        elif name == "watchdog_ns":
            watchdog = _ns(name, value)
        elif name == "break":
            names = [n for n in value.split(",") if n]
            unknown = [n for n in names if n not in KNOWN_BREAKS]
            if unknown:
                raise ParamError(f"kernel parameter {PREFIX}break: unknown breakage "
                                 f"{', '.join(map(repr, unknown))} (known: "
                                 f"{', '.join(sorted(KNOWN_BREAKS))})")
            breaks = frozenset(names)
        elif name == "features":
            try:
                optional = feature_mask([n for n in value.split(",") if n])
            except ParamError as e:
                raise ParamError(f"kernel parameter {PREFIX}features: {e}") from None
        elif name == "poll_wait":
            if value not in ("0", "1"):
                raise ParamError(f"kernel parameter {PREFIX}poll_wait={value!r}: 0 or 1")
            poll_wait = value == "1"
        else:
            raise ParamError(f"kernel parameter {token!r}: the va1 driver has no parameter "
                             f"{name!r} (it has poll_ns, watchdog_ns, break, features, "
                             f"poll_wait)")
    return DriverParams(poll, watchdog, breaks, optional, poll_wait)
