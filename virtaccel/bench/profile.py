"""cProfile sections collected across guest threads, reduced to the top functions.

cProfile profiles one thread; guest code (and the event loop it drives) runs in guest
task threads, so each task opens its own section and the sections are merged.
"""
from __future__ import annotations

import cProfile
import os
import pstats
import threading
import time
from contextlib import contextmanager
from typing import Any, Iterator

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _where(key: tuple[str, int, str]) -> str:
    file, line, func = key
    if file == "~":
        return func  # a builtin, e.g. "<built-in method numpy.core...>"
    if file.startswith(_ROOT + os.sep):
        file = os.path.relpath(file, _ROOT)
    elif "site-packages" in file:
        file = file.split("site-packages" + os.sep, 1)[1]
    return f"{file}:{line}({func})"


class ProfileSet:
    """Profiles of several sections (any threads), merged on demand."""

    def __init__(self, cprofile: bool = True) -> None:
        self.profiles: list[cProfile.Profile] = []
        self._lock = threading.Lock()
        self.cprofile = cprofile  # False: sections only time phases (no cProfile overhead)
        self.phases = PhaseRecorder()

    def attach(self, machine: Any) -> None:
        """Record wall time between the machine's trace events (see PhaseRecorder); only
        when not under cProfile, whose overhead would distort those times (and a
        watcher would add its own calls to the profile)."""
        if not self.cprofile:
            self.phases.attach(machine)

    def mark(self, name: str) -> None:
        self.phases.mark(name)

    @contextmanager
    def section(self) -> Iterator[None]:
        """Profile the enclosed code in the current thread."""
        if not self.cprofile:
            yield
            return
        prof = cProfile.Profile()
        prof.enable()
        try:
            yield
        finally:
            prof.disable()
            with self._lock:
                self.profiles.append(prof)

    def top(self, n: int = 12) -> dict[str, Any]:
        """The `n` functions with most own time and with most cumulative time, and own
        time summed per layer (percent of the profiled CPU time). Time a thread spends
        blocked handing the CPU to another guest task (lock acquire) is left out and
        reported as `blocked_in_handoff_s`."""
        if not self.profiles:
            return {"tottime": [], "cumtime": [], "by_layer": {},
                    "phases": self.phases.segments()}
        st = pstats.Stats(self.profiles[0])
        for p in self.profiles[1:]:
            st.add(p)
        raw: dict[Any, Any] = st.stats  # type: ignore[attr-defined]
        # A guest thread blocked handing the CPU to another task is not doing work: its
        # lock waits are reported apart and left out of the percentages.
        blocked = sum(v[2] for k, v in raw.items() if layer_of(k) == "thread handoff")
        raw = {k: v for k, v in raw.items() if layer_of(k) != "thread handoff"}
        total = sum(v[2] for v in raw.values()) or 1.0
        entries = [{"function": _where(k), "ncalls": int(v[1]), "tottime": round(v[2], 6),
                    "cumtime": round(v[3], 6), "tottime_pct": round(100 * v[2] / total, 1)}
                   for k, v in raw.items()]
        layers: dict[str, float] = {}
        for k, v in raw.items():
            layer = layer_of(k)
            layers[layer] = layers.get(layer, 0.0) + v[2]
        by_layer = {k: round(100 * v / total, 1)
                    for k, v in sorted(layers.items(), key=lambda kv: -kv[1])}
        by_tot = sorted(entries, key=lambda e: -e["tottime"])[:n]
        by_cum = sorted(entries, key=lambda e: -e["cumtime"])[:n]
        return {"tottime": by_tot, "cumtime": by_cum, "by_layer": by_layer,
                "total_s": round(total, 6), "blocked_in_handoff_s": round(blocked, 6),
                "phases": self.phases.segments()}


LAYERS = ("device_model", "guest_driver", "userspace_runtime", "hwspec")


def layer_of(key: tuple[str, int, str]) -> str:
    """Which part of the stack a profiled function belongs to (own time only)."""
    file, _line, func = key
    if file == "~":
        if "acquire" in func and "lock" in func:
            return "thread handoff"
        if "numpy" in func or "matmul" in func or "copyto" in func:
            return "numpy (math, copies)"
        return "builtins"
    rel = os.path.relpath(file, _ROOT) if file.startswith(_ROOT + os.sep) else file
    top = rel.split(os.sep, 1)[0]
    if top in LAYERS:
        return top
    if top == "vmm":
        if rel.endswith("trace.py"):
            return "vmm trace (digest)"
        return "vmm" if not rel.startswith(os.path.join("vmm", "bench")) else "bench harness"
    if "numpy" in rel:
        return "numpy (python side)"
    if "cffi" in rel:
        return "cffi"
    return "stdlib/other"


@contextmanager
def maybe(profiles: ProfileSet | None) -> Iterator[None]:
    """`profiles.section()` if profiling, else nothing."""
    if profiles is None:
        yield
    else:
        with profiles.section():
            yield


class PhaseRecorder:
    """Wall time between consecutive trace events: where a round trip's time goes.

    Attached to a machine it stamps `perf_counter()` at every trace event; `mark(name)`
    adds a stamp from the benchmark itself (e.g. "app" before a submission and "return"
    after its wait). `segments()` sums the wall time of each (event -> next event) pair
    between a "begin" mark and the following "end" mark, per iteration.
    """

    def __init__(self) -> None:
        self.stamps: list[tuple[str, float]] = []
        self.active = False
        self.iterations = 0

    def attach(self, machine: Any) -> None:
        machine.trace.watch(self._on_event)

    def _on_event(self, ev: Any) -> None:
        if self.active:
            short = ev.source.split(".", 1)[1] if "." in ev.source else ev.source
            self.stamps.append((f"{short}:{ev.kind}", time.perf_counter()))

    def mark(self, name: str) -> None:
        """`begin` starts an iteration, `end` closes it; other names are plain stamps."""
        now = time.perf_counter()
        if name == "begin":
            self.active = True
            self.iterations += 1
        if self.active:
            self.stamps.append((f"bench:{name}", now))
        if name == "end":
            self.active = False
            self.stamps.append(("|", now))

    def segments(self, n: int = 12) -> list[dict[str, Any]]:
        """The `n` costliest (from -> to) pairs: mean microseconds per iteration."""
        sums: dict[str, float] = {}
        counts: dict[str, int] = {}
        for (a, ta), (b, tb) in zip(self.stamps, self.stamps[1:]):
            if a == "|" or b == "|":
                continue
            key = f"{a} -> {b}"
            sums[key] = sums.get(key, 0.0) + (tb - ta)
            counts[key] = counts.get(key, 0) + 1
        it = max(self.iterations, 1)
        total = sum(sums.values()) or 1.0
        ranked = sorted(sums.items(), key=lambda kv: -kv[1])[:n]
        return [{"segment": k, "us_per_iter": round(1e6 * v / it, 2),
                 "count_per_iter": round(counts[k] / it, 2), "pct": round(100 * v / total, 1)}
                for k, v in ranked]
