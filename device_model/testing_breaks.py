"""Deliberate breakages of the device, for the hostile suite's self-test only.

`virtaccel hostile --self-test` proves its scenarios can fail: it switches one of the
breakages below on, runs the scenarios that should catch it, and checks they turn FAIL
or WEDGED (docs/hostile.md, "Self-test"). Each name weakens one real check of the model
at one place. `BREAKS` is empty unless a test or the self-test fills it (through
`breaking`): nothing a guest or a VMM does reaches it, and with it empty each guarded
check costs one test of an empty set's truth.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

from .errors import DeviceModelError

KNOWN: dict[str, str] = {
    "ring/skip-index-range": "split ring: a head or `next` index >= the queue size (or the "
                             "indirect table's entries) is followed instead of breaking the "
                             "ring (ring/head-range, ring/next-range)",
    "ring/skip-avail-idx-check": "split ring: avail.idx moving more than the queue size past "
                                 "the device's index is not refused (ring/avail-idx-jump)",
    "ring/skip-write-before-read": "split ring: a readable descriptor after a writable one is "
                                   "accepted (ring/write-before-read)",
    "status/allow-any-transition": "device status: a write that clears a bit or sets bits out "
                                   "of order takes effect (status/clear-bit, status/order)",
    "cmd/skip-partition-check": "command validation: a device operand outside the function's "
                                "memory is not refused with OUT_OF_BOUNDS (the memory view's "
                                "own bound still holds, so the command fails later)",
    "cmd/skip-dtype-check": "command validation: an unknown dtype is not refused with BAD_DTYPE",
    "ctx/ignore-address-space": "context address spaces: a non-FLAT context's device addresses "
                                "are used as function addresses, its mappings ignored",
    "ctx/no-fault-on-error": "a failed submission does not fault its context (CONTEXT_FAULTED "
                             "never follows)",
    "write/early-signal": "virtual time: a command that writes guest memory (SIGNAL, "
                          "TIMESTAMP, DMA_D2H) is applied ahead of its end time",
    "reset/keep-pending-work": "status 0 and FLR: the function's queued and running work is "
                               "not dropped",
    "pci/ignore-bus-master": "PCI Command: clearing Bus Master Enable does not stop the "
                             "function's memory requests",
}

BREAKS: set[str] = set()
"""The breakages switched on now (names of KNOWN); empty outside the self-test."""


def check_names(names: tuple[str, ...] | list[str]) -> None:
    """Raise DeviceModelError naming every unknown breakage."""
    unknown = [n for n in names if n not in KNOWN]
    if unknown:
        raise DeviceModelError(f"unknown device breakage {', '.join(map(repr, unknown))}; "
                               f"known: {', '.join(sorted(KNOWN))}")


@contextmanager
def breaking(*names: str) -> Iterator[None]:
    """Switch `names` on for the body (only for devices' checks made meanwhile), then
    back to what was on before."""
    check_names(list(names))
    before = set(BREAKS)
    BREAKS.update(names)
    try:
        yield
    finally:
        BREAKS.clear()
        BREAKS.update(before)
