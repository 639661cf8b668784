"""The VA-1 driver's parameters, read from the guest kernel's command line.

Why: as with a Linux module's parameters (`va1.watchdog_ns=...` on the kernel command
line), a test sets how the driver recovers without touching its code: the recovery timer's
period, the submission watchdog's bound, and deliberate breakages (`testing_breaks`).
Tokens without the `va1.` prefix belong to other drivers and are ignored; a `va1.` token
that names no parameter, or a value out of range, is refused with an error naming it (the
driver then binds nothing, as a module whose parameters are rejected does not load).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from hwspec import va1 as A

from .errors import GuestDriverError
from .testing_breaks import KNOWN as KNOWN_BREAKS

# Recovery timer (docs/driver.md "Recovery"): while anything is in flight the driver
# looks every POLL_NS for used buffers left unreaped for a whole period (a lost
# interrupt: it polls) and for a submit queue with no completion for WATCHDOG_NS (it
# checks the device and resets it). WATCHDOG_NS is twice the device's default
# preemption timeout, the longest a legal command runs (§13).
POLL_NS = 1_000_000
WATCHDOG_NS = 2 * A.DEFAULT_PREEMPTION_TIMEOUT_NS
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

    def cmdline(self) -> str:
        """These parameters as kernel command-line tokens (defaults left out)."""
        out = []
        if self.poll_ns != POLL_NS:
            out.append(f"{PREFIX}poll_ns={self.poll_ns}")
        if self.watchdog_ns != WATCHDOG_NS:
            out.append(f"{PREFIX}watchdog_ns={self.watchdog_ns}")
        if self.breaks:
            out.append(f"{PREFIX}break={','.join(sorted(self.breaks))}")
        return " ".join(out)


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
    poll, watchdog, breaks = POLL_NS, WATCHDOG_NS, frozenset[str]()
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
        else:
            raise ParamError(f"kernel parameter {token!r}: the va1 driver has no parameter "
                             f"{name!r} (it has poll_ns, watchdog_ns, break)")
    return DriverParams(poll, watchdog, breaks)
