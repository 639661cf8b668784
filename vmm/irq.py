"""A VM's interrupt controller: level-triggered lines from devices to guest handlers.

A device raises a line; after the delivery latency the interrupt is queued and its
handler runs in guest context at the guest's next wait. A line still high after its
handler returns is delivered again (level semantics), after the latency once more.
"""
from __future__ import annotations

from typing import Callable

from .machine import Machine, PendingIrq

STORM_LIMIT = 100_000


class IrqError(ValueError):
    pass


class Line(PendingIrq):
    def __init__(self, chip: "InterruptController", number: int) -> None:
        self.chip = chip
        self.number = number
        self.level = False
        self.handler: Callable[[], None] | None = None
        self.name = ""
        self.scheduled = False
        self.queued = False
        self.delivered = 0
        self.storm = 0
        self.disabled = False

    # device side (device_model.ports.IrqLine)
    def set_level(self, level: bool) -> None:
        level = bool(level)
        if level == self.level:
            return
        self.level = level
        self.chip.trace.emit(self.chip.source, "irq_line", {"line": self.number, "level": level})
        if level:
            self._arm()

    def _arm(self) -> None:
        if self.scheduled or self.queued or self.handler is None or self.disabled:
            return
        self.scheduled = True
        self.chip.machine.sched.schedule(self.chip.latency_ns, self._fire, f"irq{self.number}")

    def _fire(self) -> None:
        self.scheduled = False
        if self.level and self.handler is not None and not self.queued:
            self.queued = True
            self.chip.machine.pend_irq(self)

    # guest side, in guest context
    def deliver(self) -> None:
        self.queued = False
        if not self.level or self.handler is None or self.disabled:
            return
        self.delivered += 1
        self.chip.trace.emit(self.chip.source, "irq", {"line": self.number})
        self.handler()
        if self.level:
            self.storm += 1
            if self.storm > STORM_LIMIT:
                self.disabled = True
                self.chip.trace.emit(self.chip.source, "irq_storm", {"line": self.number})
                return
            self._arm()
        else:
            self.storm = 0


class InterruptController:
    """Implements guest_driver.kernel.IrqChip for the guest and hands lines to devices."""

    def __init__(self, machine: Machine, source: str, lines: int = 64, latency_ns: int = 200) -> None:
        self.machine = machine
        self.trace = machine.trace
        self.source = source
        self.latency_ns = latency_ns
        self._lines = [Line(self, n) for n in range(lines)]

    def line(self, number: int) -> Line:
        if not 0 <= number < len(self._lines):
            raise IrqError(f"interrupt line {number} does not exist (0..{len(self._lines) - 1})")
        return self._lines[number]

    def request_irq(self, line: int, handler: Callable[[], None], name: str) -> None:
        ln = self.line(line)
        if ln.handler is not None:
            raise IrqError(f"interrupt line {line} already has handler {ln.name!r}")
        ln.handler, ln.name, ln.disabled, ln.storm = handler, name, False, 0
        if ln.level:
            ln._arm()

    def free_irq(self, line: int) -> None:
        ln = self.line(line)
        ln.handler, ln.name = None, ""
