"""The saturating multi-tenant scenario behind `virtaccel tenants`.

N VFs with scheduling weights W1..WN, one tenant VM each. Every tenant runs checked
GEMMs (virtaccel.guests.tenant) on all its submit queues, `depth` submissions in flight on
each, for `duration_ns` of virtual time: the device is saturated, so what each VF gets
is what the card's weighted fair queueing gives it. With an aggressor K, tenant K floods
instead (every queue at the driver's maximum depth, heavier submissions) and the others
run closed-loop (one submission at a time, latency-sensitive); the same run without the
aggressor gives each victim's baseline latency.

Measured per VF (virtual time only): device time inside the measurement window (the
span in which every tenant was submitting), commands and submissions completed, p50/p99
completion latency (fence end - submit, in the guest's clock), whether every result's
checksum is numpy's. Across VFs: Jain's fairness index over device time, and each
VF's share against its weight's target share.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Sequence

from device_model import Va1Config
from hwspec.va1 import VfResources

from ..errors import ScenarioError
from ..guests.tenant import checked_gemm
from ..session import tenant_seed
from ..testing.tenants import TenantBed, check_victim, jain, percentile

__all__ = ["DEFAULT_DURATION_NS", "Scenario", "ScenarioError", "ScenarioResult", "VfRow",
           "format_table", "parse_weights", "run_scenario", "run_tenants"]

DEFAULT_DURATION_NS = 1_000_000
FLOOD_DEPTH = 64           # per queue: 128 descriptors of a 256-entry ring


@dataclass(frozen=True)
class Scenario:
    vfs: int
    weights: tuple[int, ...]
    aggressor: int | None = None       # 1-based VF number
    seed: int = 0
    duration_ns: int = DEFAULT_DURATION_NS
    queues: int = 4                    # submit queues each tenant uses (and is given)
    depth: int = 2                     # in flight per queue (saturating tenants)
    m: int = 32
    k: int = 32
    n: int = 32
    reps: int = 2                      # GEMMs per submission
    compute_units: int = 4
    memory: int = 8 << 20              # guest RAM per tenant VM
    device_memory: int = 16 << 20      # per VF
    total_vfs: int = 64
    exec_quantum_ns: int = 2_000      # short: an aggressor yields within ~4 commands

    def check(self) -> None:
        if not 1 <= self.vfs <= self.total_vfs:
            raise ScenarioError(f"--vfs {self.vfs}: the card has 1 .. {self.total_vfs} VFs (TotalVFs)")
        if len(self.weights) != self.vfs:
            raise ScenarioError(f"--weights has {len(self.weights)} weights for {self.vfs} VFs: "
                                "give one weight per VF")
        bad = [w for w in self.weights if not 1 <= w <= 0xFFFF_FFFF]
        if bad:
            raise ScenarioError(f"--weights: {bad[0]} is not a weight (an integer >= 1)")
        if self.aggressor is not None and not 1 <= self.aggressor <= self.vfs:
            raise ScenarioError(f"--aggressor {self.aggressor}: VFs are numbered 1 .. {self.vfs}")
        if self.aggressor is not None and self.vfs < 2:
            raise ScenarioError("--aggressor needs at least 2 VFs (an aggressor and a victim)")
        if self.duration_ns <= 0:
            raise ScenarioError(f"duration {self.duration_ns} ns must be > 0")


@dataclass
class VfRow:
    vf: int
    weight: int
    role: str                  # "tenant", "victim" or "aggressor"
    device_ns: int             # device time inside the window
    device_ns_total: int       # all device time (VF_STATS through the admin queue)
    commands: int              # commands completed (all)
    completed: int             # submissions completed (all)
    p50_ns: int
    p99_ns: int
    correct: bool
    share: float = 0.0
    target: float = 0.0
    share_error: float = 0.0   # (share - target) / target
    solo_p99_ns: int | None = None
    p99_ratio: float | None = None


@dataclass
class ScenarioResult:
    scenario: Scenario
    rows: list[VfRow]
    jain: float
    window_ns: tuple[int, int]
    virtual_ns: int
    digest: str
    baseline: "ScenarioResult | None" = None
    notes: list[str] = field(default_factory=list)

    @property
    def max_share_error(self) -> float:
        return max(abs(r.share_error) for r in self.rows)

    def as_dict(self) -> dict[str, Any]:
        return {
            "scenario": {**asdict(self.scenario), "weights": list(self.scenario.weights)},
            "vfs": [asdict(r) for r in self.rows],
            "jain": self.jain,
            "max_share_error": self.max_share_error,
            "window_ns": list(self.window_ns),
            "virtual_ns": self.virtual_ns,
            "trace_digest": self.digest,
            "all_correct": all(r.correct for r in self.rows),
        }


def _program(sc: Scenario, vf: int, role: str) -> Any:
    seed = tenant_seed(sc.seed, vf)
    if role == "aggressor":
        queues, depth, reps = sc.queues, FLOOD_DEPTH, sc.reps * 4
    elif role == "victim":
        queues, depth, reps = 1, 1, sc.reps
    else:
        queues, depth, reps = sc.queues, sc.depth, sc.reps
    return lambda os_: checked_gemm(os_, seed, m=sc.m, k=sc.k, n=sc.n,
                                    duration_ns=sc.duration_ns, queues=queues, depth=depth,
                                    reps=reps)


def run_scenario(sc: Scenario, *, with_aggressor: bool = True) -> ScenarioResult:
    """Run once (with the aggressor when there is one and `with_aggressor`)."""
    sc.check()
    res = [VfResources(device_memory=sc.device_memory, num_submit_queues=sc.queues,
                       max_contexts=4, weight=w, exec_quantum_ns=sc.exec_quantum_ns)
           for w in sc.weights]
    roles = {}
    for vf in range(1, sc.vfs + 1):
        if sc.aggressor is None:
            roles[vf] = "tenant"
        else:
            roles[vf] = "aggressor" if vf == sc.aggressor else "victim"
    bed = TenantBed(sc.vfs, seed=sc.seed, resources=res, memory=sc.memory,
                    card_config=Va1Config(num_compute_units=sc.compute_units),
                    total_vfs=sc.total_vfs, keep_intervals=True)
    try:
        programs = [None if roles[vf] == "aggressor" and not with_aggressor
                    else _program(sc, vf, roles[vf]) for vf in range(1, sc.vfs + 1)]
        results = bed.run(programs)
        by_vf = {r.index: r for r in results}
        stats = {vf: bed.pf_driver().stats(vf) for vf in range(1, sc.vfs + 1)}
        starts = [int(r.result["start_ns"]) for r in results if isinstance(r.result, dict)]
        lo = max(starts) if starts else 0
        hi = min(starts) + sc.duration_ns if starts else 0
        notes = []
        if hi <= lo:
            notes.append("tenants did not overlap: the window is empty")
            hi = lo
        rows: list[VfRow] = []
        for vf in range(1, sc.vfs + 1):
            f = bed.monitor.functions[vf]
            r = by_vf.get(vf)
            if r is None:  # the idle aggressor of a baseline run
                continue
            if r.error is not None:
                notes.append(f"VF {vf}: {type(r.error).__name__}: {r.error}")
            lat = r.result.get("latencies_ns", []) if isinstance(r.result, dict) else []
            rows.append(VfRow(
                vf=vf, weight=sc.weights[vf - 1], role=roles[vf],
                device_ns=f.device_ns_in(lo, hi), device_ns_total=int(stats[vf]["device_time_ns"]),
                commands=f.commands, completed=f.submissions,
                p50_ns=percentile(lat, 50), p99_ns=percentile(lat, 99),
                correct=check_victim(r.result, tenant_seed(sc.seed, vf))))
        total = sum(row.device_ns for row in rows) or 1
        wsum = sum(row.weight for row in rows)
        for row in rows:
            row.share = row.device_ns / total
            row.target = row.weight / wsum
            row.share_error = (row.share - row.target) / row.target
        return ScenarioResult(sc, rows, jain([r.device_ns for r in rows]), (lo, hi),
                              bed.machine.now_ns(), bed.machine.trace.digest(), notes=notes)
    finally:
        bed.close()


def run_tenants(sc: Scenario) -> ScenarioResult:
    """The scenario; with an aggressor, also the baseline run without it, and each
    victim's p99 against its baseline p99."""
    result = run_scenario(sc)
    if sc.aggressor is not None:
        base = run_scenario(sc, with_aggressor=False)
        solo = {r.vf: r.p99_ns for r in base.rows}
        for r in result.rows:
            if r.vf in solo:
                r.solo_p99_ns = solo[r.vf]
                r.p99_ratio = r.p99_ns / solo[r.vf] if solo[r.vf] else None
        result.baseline = base
    return result


def format_table(res: ScenarioResult) -> str:
    """The human-readable table `virtaccel tenants` prints."""
    sc = res.scenario
    lines = [f"virtaccel tenants: {sc.vfs} VFs, weights {','.join(map(str, sc.weights))}, "
             f"{'aggressor VF ' + str(sc.aggressor) if sc.aggressor else 'no aggressor'}, "
             f"seed {sc.seed}, {sc.compute_units} compute units",
             f"window {res.window_ns[0]} .. {res.window_ns[1]} ns (virtual)"]
    head = (f"{'VF':>3} {'role':<9} {'weight':>6} {'device us':>10} {'share':>7} "
            f"{'target':>7} {'err':>7} {'cmds':>7} {'done':>6} {'p50 us':>8} {'p99 us':>8}")
    if sc.aggressor:
        head += f" {'solo p99':>9} {'x solo':>7}"
    head += "  correct"
    lines.append(head)
    for r in res.rows:
        line = (f"{r.vf:>3} {r.role:<9} {r.weight:>6} {r.device_ns / 1000:>10.1f} "
                f"{r.share:>7.3f} {r.target:>7.3f} {r.share_error:>+7.1%} {r.commands:>7} "
                f"{r.completed:>6} {r.p50_ns / 1000:>8.2f} {r.p99_ns / 1000:>8.2f}")
        if sc.aggressor:
            solo = "-" if r.solo_p99_ns is None else f"{r.solo_p99_ns / 1000:.2f}"
            ratio = "-" if r.p99_ratio is None else f"{r.p99_ratio:.2f}"
            line += f" {solo:>9} {ratio:>7}"
        line += f"  {'yes' if r.correct else 'NO'}"
        lines.append(line)
    lines.append(f"Jain's fairness index over device time: {res.jain:.4f}; "
                 f"largest share error {res.max_share_error:+.1%}")
    for n in res.notes:
        lines.append(f"note: {n}")
    return "\n".join(lines)


def parse_weights(text: str) -> tuple[int, ...]:
    """'1,2,4,8' -> (1, 2, 4, 8) (ScenarioError naming the bad item)."""
    out = []
    for item in text.split(","):
        item = item.strip()
        try:
            w = int(item, 0)
        except ValueError:
            raise ScenarioError(f"--weights: {item!r} is not an integer") from None
        if w < 1:
            raise ScenarioError(f"--weights: {w} is not a weight (an integer >= 1)")
        out.append(w)
    return tuple(out)


def equal_weights(n: int) -> Sequence[int]:
    return (1,) * n
