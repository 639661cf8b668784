"""Seed exploration: run an image over many seeds with fault plans, check the invariants,
shrink every failure to a minimal plan that replays it (docs/faults.md, "Explore").

Why: a fault that breaks the driver one seed in a thousand is found only by running a
thousand seeds, and is fixed only once it replays from a seed and a short plan. Each
seed is one job, a pure function of (image, seed, plan, breakages): the same job gives
the same verdict in this process, in a local worker process or on a Dask worker, so the
report does not depend on where or in what order the jobs ran.

Executors: in this process (jobs = 1), local worker processes (concurrent.futures'
ProcessPoolExecutor, spawned: no forked guest threads), or a Dask cluster by address
(`distributed.Client`): an existing engine, no distribution layer of our own.
"""
from __future__ import annotations

import dataclasses
import json
import random
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Sequence

from guest_driver.testing_breaks import KNOWN as KNOWN_BREAKS
from vmm.faults import EVENT_KINDS, IMPLEMENTED, FaultEntry, FaultPlan, FaultPlanError

from ..images import VmImage, check_plan, run_image
from .invariants import DEFAULT_WAIT_BOUND_NS, Breach, Invariants

DEFAULT_TIME_LIMIT_NS = 20_000_000_000
"""Virtual time at which a run's guest waits are ended (vmm.machine.VirtualTimeLimit):
a driver whose recovery is broken may keep time moving while a fence never signals, and
the run must still end with a verdict (a hung wait). Four wait bounds: a healthy run of
the shipped images ends far sooner."""

RANDOM_AFTER_MAX = 8
RANDOM_DELAY_NS = (1_000, 200_000)
RANDOM_DURATION_NS = (50_000, 2_000_000)   # vf_stop always, iommu_unmap half the time
_RANDOM_ACTIONS = ("drop_interrupt", "delay_interrupt", "duplicate_interrupt",
                   "fail_dma_read", "fail_dma_write", "delay_mmio_exit", "flr",
                   "hang_engine", "needs_reset", "vf_reset", "vf_stop", "iommu_unmap",
                   "kill_process")
"""Actions random plans draw from: every one of vmm.faults.IMPLEMENTED, each drawn only
where the image's attachment can take it (images.check_plan's rules)."""


@dataclass(frozen=True)
class Job:
    """One seed of a campaign: everything its verdict depends on."""
    image: VmImage                        # with faults=None: the plan is `entries`
    seed: int
    entries: tuple[FaultEntry, ...]
    breaks: tuple[str, ...] = ()          # guest_driver.testing_breaks names
    wait_bound_ns: int = DEFAULT_WAIT_BOUND_NS
    shrink: bool = True
    time_limit_ns: int = DEFAULT_TIME_LIMIT_NS


@dataclass
class SeedResult:
    """What one seed gave: its breaches, and when it failed the minimal plan."""
    seed: int
    plan: list[dict[str, Any]]
    injected: int
    breaches: list[dict[str, Any]] = field(default_factory=list)
    minimal: list[dict[str, Any]] | None = None
    minimal_breaches: list[dict[str, Any]] | None = None
    shrink_runs: int = 0
    breaks: tuple[str, ...] = ()

    @property
    def ok(self) -> bool:
        return not self.breaches

    def as_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"seed": self.seed, "ok": self.ok, "injected": self.injected,
                             "breaches": self.breaches, "plan": self.plan}
        if self.minimal is not None:
            d.update(minimal_plan=self.minimal, minimal_breaches=self.minimal_breaches,
                     minimal_plan_toml=plan_toml(self.minimal, self.seed, self.breaks),
                     shrink_runs=self.shrink_runs)
        return d


@dataclass
class Report:
    """A campaign's verdict: the same whatever --jobs or the engine."""
    image: str
    name: str
    seeds: tuple[int, int]
    random_faults: int
    plan: list[dict[str, Any]]
    breaks: tuple[str, ...]
    results: list[SeedResult]
    shrink_limit: int | None = None

    @property
    def unshrunk(self) -> list[int]:
        """Failing seeds left without a minimal plan (past `shrink_limit`)."""
        return [r.seed for r in self.failures if r.minimal is None]

    @property
    def failures(self) -> list[SeedResult]:
        return [r for r in self.results if not r.ok]

    @property
    def ok(self) -> bool:
        return not self.failures

    def as_dict(self) -> dict[str, Any]:
        kinds: dict[str, int] = {}
        for r in self.failures:
            for b in r.breaches:
                kinds[b["kind"]] = kinds.get(b["kind"], 0) + 1
        return {"image": self.image, "name": self.name,
                "seeds": {"start": self.seeds[0], "stop": self.seeds[1]},
                "random_faults": self.random_faults, "plan": self.plan,
                "breaks": list(self.breaks), "runs": len(self.results),
                "faults_injected": sum(r.injected for r in self.results),
                "failed_seeds": [r.seed for r in self.failures], "breach_kinds": kinds,
                "shrink_limit": self.shrink_limit, "unshrunk_seeds": self.unshrunk,
                "ok": self.ok, "failures": [r.as_dict() for r in self.failures]}


# -- plans --------------------------------------------------------------------------------


def named(entries: Iterable[FaultEntry]) -> tuple[FaultEntry, ...]:
    """Every entry with a name (faults[i] for an unnamed one): the trace keeps naming an
    entry the same way once others are removed by the shrinker."""
    return tuple(e if e.name else dataclasses.replace(e, name=f"faults[{i}]")
                 for i, e in enumerate(entries))


def random_entries(image: VmImage, seed: int, n: int) -> tuple[FaultEntry, ...]:
    """`n` entries drawn for `seed` from a generator of their own (the same seed draws
    the same plan anywhere), each on one of the image's functions, with an implemented
    action its attachment can take and an `after` trigger."""
    rng = random.Random(f"virtaccel-explore:{seed}")
    functions = [t.name for t in image.tenants] or [image.name]
    actions = [a for a in _RANDOM_ACTIONS if a in IMPLEMENTED and _fits(image, a)]
    out: list[FaultEntry] = []
    for i in range(n):
        action = rng.choice(actions)
        delay = duration = None
        if action in ("delay_interrupt", "delay_mmio_exit"):
            delay = rng.randint(*RANDOM_DELAY_NS)
        if action == "vf_stop" or (action == "iommu_unmap" and rng.random() < 0.5):
            duration = rng.randint(*RANDOM_DURATION_NS)
        out.append(FaultEntry(function=rng.choice(functions), action=action,
                              after=rng.randint(1, RANDOM_AFTER_MAX), on=rng.choice(EVENT_KINDS),
                              delay_ns=delay, duration_ns=duration, name=f"random{i}"))
    return tuple(out)


def _fits(image: VmImage, action: str) -> bool:
    """Whether images.check_plan lets `action` run on this image's functions."""
    try:
        check_plan(image, FaultPlan([FaultEntry(function=(image.tenants[0].name if image.tenants
                                                          else image.name),
                                                action=action, after=1, on="command")]))
    except FaultPlanError:
        return False
    return True


def plan_toml(entries: Sequence[dict[str, Any]], seed: int | None = None,
              breaks: Sequence[str] = ()) -> str:
    """A plan as [[faults]] tables: `virtaccel explore --faults` and VM images read it."""
    lines = []
    if seed is not None:
        brk = f" --break {','.join(breaks)}" if breaks else ""
        lines.append(f"# replays seed {seed}: virtaccel explore IMAGE --seeds {seed}:{seed + 1} "
                     f"--faults THIS.toml{brk}")
    for e in entries:
        lines.append("[[faults]]")
        for k, v in e.items():
            lines.append(f"{k} = {json.dumps(v) if isinstance(v, str) else repr(v)}")
        lines.append("")
    return "\n".join(lines) if entries else "\n".join(lines + ["# no fault: fails without one", ""])


# -- one seed -------------------------------------------------------------------------------


def run_once(image: VmImage, seed: int, entries: Sequence[FaultEntry],
             breaks: Sequence[str] = (), wait_bound_ns: int = DEFAULT_WAIT_BOUND_NS,
             time_limit_ns: int = DEFAULT_TIME_LIMIT_NS) -> tuple[list[Breach], int]:
    """Run `image` at `seed` with the plan `entries`, its guests booted with the driver
    breakages `breaks` (`va1.break=` on their command line); the breaches and the number
    of faults injected."""
    cmdline = image.cmdline
    if breaks:
        cmdline = " ".join(p for p in (cmdline, f"va1.break={','.join(breaks)}") if p)
    img = dataclasses.replace(image, faults=FaultPlan(entries) if entries else None,
                              cmdline=cmdline)
    watchers: list[Invariants] = []

    def attach(session: Any) -> None:
        watchers.append(Invariants(session, wait_bound_ns=wait_bound_ns))

    try:
        run = run_image(img, seed, on_launch=attach, time_limit_ns=time_limit_ns)
    except Exception as e:  # noqa: BLE001 - the machine itself failed: a verdict too
        done = watchers[0].check() if watchers else []
        return done + [Breach("run_error", image.name, 0, f"{type(e).__name__}: {e}")], 0
    inv = watchers[0]
    return inv.check(_results(image, run.result)), inv.injected


def _results(image: VmImage, result: Any) -> dict[str, bool]:
    if not isinstance(result, dict):
        return {image.name: False}
    tenants = result.get("tenants")
    if image.tenants and isinstance(tenants, dict):
        return {name: isinstance(r, dict) and r.get("ok") is True for name, r in tenants.items()}
    return {image.name: result.get("ok") is True}


def shrink(job: Job, kinds: set[str]) -> tuple[tuple[FaultEntry, ...], list[Breach], int]:
    """Delta debugging by removal: drop a chunk of entries (halves first, then smaller
    chunks down to single entries) whenever the run still breaks one of `kinds`. The
    result is a plan no single removal keeps failing, its breaches and the runs taken."""
    current = job.entries
    breaches: list[Breach] = []
    runs = 0
    n = 2
    while current:
        size = -(-len(current) // n)
        for start in range(0, len(current), size):
            trial = current[:start] + current[start + size:]
            got, _ = run_once(job.image, job.seed, trial, job.breaks, job.wait_bound_ns,
                              job.time_limit_ns)
            runs += 1
            if any(b.kind in kinds for b in got):
                current, breaches = trial, got
                n = max(n - 1, 2)
                break
        else:
            if size == 1:
                break
            n = min(n * 2, len(current))
    return current, breaches, runs


def explore_seed(job: Job) -> SeedResult:
    """One seed's verdict (a pure function of the job: any worker gives the same)."""
    breaches, injected = run_once(job.image, job.seed, job.entries, job.breaks,
                                  job.wait_bound_ns, job.time_limit_ns)
    res = SeedResult(job.seed, [e.as_dict() for e in job.entries], injected,
                     [b.as_dict() for b in breaches], breaks=job.breaks)
    if breaches and job.shrink:
        if job.entries:
            minimal, got, runs = shrink(job, {b.kind for b in breaches})
            if len(minimal) == len(job.entries):
                got = breaches
        else:
            minimal, got, runs = (), breaches, 0
        res.minimal = [e.as_dict() for e in minimal]
        res.minimal_breaches = [b.as_dict() for b in got]
        res.shrink_runs = runs
    return res


# -- a campaign -------------------------------------------------------------------------------


def make_jobs(image: VmImage, seeds: range, plan: FaultPlan | None, random_faults: int,
              breaks: Sequence[str] = (), wait_bound_ns: int = DEFAULT_WAIT_BOUND_NS,
              time_limit_ns: int = DEFAULT_TIME_LIMIT_NS, shrink: bool = True) -> list[Job]:
    """One job per seed: the plan's entries, then `random_faults` drawn for the seed.
    The image's own [[faults]] are the plan when no other is given."""
    base = plan.entries if plan is not None else (image.faults.entries if image.faults else ())
    bare = dataclasses.replace(image, faults=None)
    jobs = []
    for s in seeds:
        entries = named(tuple(base) + random_entries(image, s, random_faults))
        check_plan(image, FaultPlan(entries))
        jobs.append(Job(bare, s, entries, tuple(breaks), wait_bound_ns, shrink, time_limit_ns))
    return jobs


def run_jobs(jobs: Sequence[Job], *, workers: int = 1, cluster: str | None = None,
             progress: Callable[[SeedResult], None] | None = None) -> list[SeedResult]:
    """Every job's result, in job order, whichever executor ran them."""
    results: dict[int, SeedResult] = {}
    if cluster is not None:
        from distributed import Client, as_completed
        with Client(cluster, set_as_default=False) as client:  # type: ignore[no-untyped-call]
            futures = client.map(explore_seed, list(jobs), pure=False)
            index = {f.key: i for i, f in enumerate(futures)}
            for fut in as_completed(futures, loop=client.loop):  # type: ignore[no-untyped-call]
                r = fut.result()
                results[index[fut.key]] = r
                if progress is not None:
                    progress(r)
    elif workers <= 1 or len(jobs) <= 1:
        for i, job in enumerate(jobs):
            results[i] = explore_seed(job)
            if progress is not None:
                progress(results[i])
    else:
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor, as_completed as done
        ctx = multiprocessing.get_context("spawn")
        with ProcessPoolExecutor(max_workers=min(workers, len(jobs)), mp_context=ctx) as pool:
            pending = {pool.submit(explore_seed, job): i for i, job in enumerate(jobs)}
            for fut in done(pending):
                results[pending[fut]] = fut.result()
                if progress is not None:
                    progress(results[pending[fut]])
    return [results[i] for i in range(len(jobs))]


def check_breaks(names: Iterable[str]) -> tuple[str, ...]:
    """The driver breakage names (guest_driver.testing_breaks), checked, without repeats:
    ValueError naming an unknown one."""
    out: list[str] = []
    for n in names:
        if n not in KNOWN_BREAKS:
            raise ValueError(f"unknown breakage {n!r} (known: {', '.join(sorted(KNOWN_BREAKS))})")
        if n not in out:
            out.append(n)
    return tuple(out)


def explore(image: VmImage, seeds: range, *, plan: FaultPlan | None = None,
            random_faults: int = 0, breaks: Sequence[str] = (), workers: int = 1,
            cluster: str | None = None, wait_bound_ns: int = DEFAULT_WAIT_BOUND_NS,
            time_limit_ns: int = DEFAULT_TIME_LIMIT_NS, shrink_limit: int | None = None,
            progress: Callable[[SeedResult], None] | None = None) -> Report:
    """Run the campaign (module docstring) and report it. Every failing seed is shrunk
    to a minimal plan, or only the first `shrink_limit` of them in seed order (the same
    seeds whatever the executor: they are shrunk in a second pass)."""
    breaks = check_breaks(breaks)
    if time_limit_ns <= wait_bound_ns:
        raise ValueError(f"time limit {time_limit_ns} ns must exceed the wait bound "
                         f"{wait_bound_ns} ns (a hung wait must be seen before the run ends)")
    if shrink_limit is not None and shrink_limit < 0:
        raise ValueError(f"shrink_limit {shrink_limit}: >= 0")
    one_pass = shrink_limit is None
    jobs = make_jobs(image, seeds, plan, random_faults, breaks, wait_bound_ns, time_limit_ns,
                     shrink=one_pass)
    results = run_jobs(jobs, workers=workers, cluster=cluster, progress=progress)
    if not one_pass:
        failing = [i for i, r in enumerate(results) if not r.ok][:shrink_limit]
        again = run_jobs([dataclasses.replace(jobs[i], shrink=True) for i in failing],
                         workers=workers, cluster=cluster)
        for i, r in zip(failing, again):
            results[i] = r
    base = plan.entries if plan is not None else (image.faults.entries if image.faults else ())
    return Report(image.path, image.name, (seeds.start, seeds.stop), random_faults,
                  [e.as_dict() for e in named(base)], tuple(breaks), results, shrink_limit)
