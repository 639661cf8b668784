"""tools/null_floor.py, the yardstick of row (d): it must make the hops the stack makes,
or its time says nothing about the stack's."""
from __future__ import annotations

import importlib.util
import sys
from collections import Counter
from pathlib import Path
from types import ModuleType

import userspace_runtime as rt
from guest_driver.uapi import GuestOS
from virtaccel.session import Session
from vmm.trace import TraceEvent

TOOL = Path(__file__).resolve().parents[2] / "tools" / "null_floor.py"


def _tool() -> ModuleType:
    spec = importlib.util.spec_from_file_location("null_floor", TOOL)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules["null_floor"] = mod
    spec.loader.exec_module(mod)
    return mod


def _stack_events(n: int) -> Counter[tuple[str, str]]:
    """(source, kind) of every trace event of `n` null round trips of the stack."""
    seen: Counter[tuple[str, str]] = Counter()
    on = [False]

    def watch(ev: TraceEvent) -> None:
        if on[0]:
            seen[ev.source, ev.kind] += 1

    def program(os_: GuestOS) -> None:
        with rt.Device(os_) as dev:
            s = dev.create_context().create_stream()
            nop = rt.CommandBufferBuilder()
            nop.nop()
            for _ in range(3):
                s.enqueue(nop)
                s.synchronize()
            on[0] = True
            for _ in range(n):
                s.enqueue(nop)
                s.synchronize()
            on[0] = False

    with Session(attach="mmio") as session:
        session.machine.trace.watch(watch)
        session.run(program, name="floor")
    return seen


def test_the_floor_emits_the_trace_events_of_the_stack_per_round_trip() -> None:
    """The same events, by source and kind, as many of each."""
    floor = _tool().Floor()
    for _ in range(3):
        floor.enqueue_and_synchronize(bytes(8))
    seen: Counter[tuple[str, str]] = Counter()
    floor.trace.watch(lambda ev: seen.update([(ev.source, ev.kind)]))
    for _ in range(10):
        floor.enqueue_and_synchronize(bytes(8))
    stack = _stack_events(10)
    assert sum(stack.values()) == 160
    assert seen == stack


def test_the_floor_completes_every_round_trip_and_leaves_its_ring_empty() -> None:
    floor = _tool().Floor()
    for _ in range(300):   # more than the ring's 256 entries: descriptors come back
        floor.enqueue_and_synchronize(bytes(8))
    assert floor.last_used == floor.used_idx == floor.avail_idx == 300
    assert not floor.inflight and not floor.fences and floor.timer is None
    assert len(floor.free) == 256


def test_measure_reports_the_floor_against_the_bare_ring() -> None:
    r = _tool().measure(reps=1, stack_loops=5, bare_loops=5)
    assert r["floor_us"] > 0 and r["bare_ring_us"] > 0
    assert abs(r["ratio"] - r["floor_us"] / r["bare_ring_us"]) < 0.2  # of unrounded times
