"""The launcher: one place that builds a machine, its host, its VMs and each VM's
accelerator attachment, and owns the run's seed and trace.

Why: every tool (CLI verbs, benchmarks, suites, tests) needs "a machine with these VMs
and this attachment, run these guest programs"; building it by hand in each repeats the
order of construction that the trace digest depends on. A Session is that order, once.

    with Session(attach="mmio", seed=3) as s:      # built on enter, closed on exit
        result = s.run(program)                    # program(os) in the VM's guest task
    print(s.digest())

Attachments: "mmio" and "pci" (a VA-1 emulated for each VM), "vfio" (a host VA-1
function assigned to each VM by VFIO passthrough), "sriov" (one host card, one VF per
VM, each provisioned through the admin queue and assigned by VFIO).

Lifecycle (`SessionState`): NEW -> launch() -> READY <-> RUNNING (inside run_tasks)
-> close() -> CLOSED; a launch that fails leaves FAILED with everything it built
released. A method called in a state that does not allow it raises SessionStateError
naming the method and the state. Inspection (digest, trace, now_ns, vms) works in
every state after launch, so a closed session can still be read.
"""
from __future__ import annotations

import dataclasses
import enum
import functools
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, ClassVar, Iterable, Mapping, Sequence, TypeVar

from device_model import Va1Config
from device_model.va1.config import DEFAULT_VIRTIO_FEATURES, VIRTIO_OPTIONS
from guest_driver.kernel import GuestKernel
from guest_driver.params import (DEFAULT_OPTIONAL, FEATURE_NAMES, ParamError, feature_mask,
                                  feature_names, features_token, parse_cmdline)
from guest_driver.uapi import GuestOS
from hwspec.va1 import VfResources
from vmm.faults import FaultInjector, FaultPlan, FaultPlanError, fault_targets
from vmm.host import CardFactory, Host, HostPciFunction, PfDriverFactory
from vmm.machine import GuestTask, Machine
from vmm.trace import Trace, TraceEvent
from vmm.vm import Vm

from .errors import LaunchError, SessionStateError

if TYPE_CHECKING:
    from .images import VmImage

ATTACHMENTS = ("mmio", "pci", "vfio", "sriov", "vdpa")
VDPA_TRANSPORTS = ("pci", "mmio")
DEFAULT_MEMORY = 256 << 20
Program = Callable[[GuestOS], Any]
_F = TypeVar("_F", bound=Callable[..., Any])


class SessionState(enum.Enum):
    NEW = "new"            # configured; nothing built
    READY = "ready"        # machine, host and VMs built; tasks may be spawned and run
    RUNNING = "running"    # inside run_tasks
    CLOSED = "closed"      # VMs and host released; still readable
    FAILED = "failed"      # launch raised; whatever it built was released


def _requires(*states: SessionState) -> Callable[[_F], _F]:
    """Guard: the method runs only in `states`, else SessionStateError."""
    def wrap(fn: _F) -> _F:
        @functools.wraps(fn)
        def guarded(self: "Session", *args: Any, **kwargs: Any) -> Any:
            if self.state not in states:
                allowed = " or ".join(s.value for s in states)
                raise SessionStateError(f"Session.{fn.__name__}() needs state {allowed}; "
                                        f"the session is {self.state.value}")
            return fn(self, *args, **kwargs)
        return guarded  # type: ignore[return-value]
    return wrap


GUEST_FEATURES = tuple(FEATURE_NAMES)
"""Names of the optional virtio features a guest's VA-1 driver can be told to accept."""
DEFAULT_GUEST_FEATURES = tuple(feature_names(DEFAULT_OPTIONAL))


def tenant_seed(seed: int, vf: int) -> int:
    """The data seed of the program on VF `vf` in a run seeded `seed`."""
    return (seed * 1_000_003 + vf) % (1 << 63)


@dataclass(frozen=True)
class VmSpec:
    """One VM of a session: its name (a trace source prefix), RAM, for "sriov" the
    resources its VF is provisioned with (None: the session's), and its guest kernel's
    command line, added after the session's (driver parameters, docs/driver.md)."""
    name: str
    memory: int = DEFAULT_MEMORY
    resources: VfResources | None = None
    cmdline: str = ""


@dataclass
class CommandTimes:
    """Device time of every command, in completion order, from the trace's "cmd" events."""
    commands: list[tuple[str, int]] = field(default_factory=list)   # (opcode, device ns)

    def __call__(self, ev: TraceEvent) -> None:
        if ev.kind == "cmd":
            start, end = ev.get("start_ns"), ev.get("end_ns")
            if isinstance(start, int) and isinstance(end, int):
                self.commands.append((str(ev.get("opcode")), end - start))

    @property
    def total_ns(self) -> int:
        return sum(ns for _, ns in self.commands)


class Session:
    """A machine with its host, VMs and attachments (module docstring)."""

    # Called with every new Session: how the pytest plugin names the seeds of a failing
    # test's sessions.
    observers: ClassVar[list[Callable[["Session"], None]]] = []

    def __init__(self, *, attach: str = "mmio", seed: int = 0,
                 vms: int | Sequence[VmSpec | str] = 1, memory: int = DEFAULT_MEMORY,
                 exit_cost_ns: int = 1000, config: Va1Config | None = None,
                 resources: VfResources | None = None, keep_trace: bool = False,
                 card_factory: CardFactory | None = None,
                 pf_driver_factory: PfDriverFactory | None = None,
                 card_options: Mapping[str, Any] | None = None,
                 faults: FaultPlan | None = None, cmdline: str = "",
                 time_limit_ns: int | None = None,
                 guest_features: Iterable[str] | None = None, transport: str | None = None,
                 spare: int = 0, vdpa_parent: str = "pf") -> None:
        """`cmdline`: every guest kernel's command line (the VA-1 driver's `va1.*`
        parameters, checked here). `time_limit_ns`: virtual time past which a guest wait
        ends in vmm.machine.VirtualTimeLimit (None: no limit). `guest_features`: the
        optional virtio features the guest's driver may accept (`va1.features=` on the
        command line; None: its defaults), with every one offered by the device.
        `transport` ("pci" or "mmio"), `spare` (extra vdpa parents) and `vdpa_parent`
        ("pf" or "vf"): for attach="vdpa" only."""
        if attach not in ATTACHMENTS:
            raise ValueError(f"attach {attach!r}: one of {', '.join(ATTACHMENTS)}")
        if attach == "vdpa":
            transport = "pci" if transport is None else transport
            if transport not in VDPA_TRANSPORTS:
                raise ValueError(f"transport {transport!r} for a vdpa attachment: one of "
                                 f"{', '.join(VDPA_TRANSPORTS)}")
        elif transport is not None:
            raise ValueError(f"transport={transport!r} is for attach='vdpa' only (attach "
                             f"{attach!r} names its transport itself)")
        self.transport = transport
        if not isinstance(spare, int) or isinstance(spare, bool) or not 0 <= spare <= 8 \
                or (spare and attach != "vdpa"):
            raise ValueError(f"spare={spare!r}: 0 .. 8 extra vdpa parents, attach='vdpa' only")
        self.spare = spare
        if vdpa_parent not in ("pf", "vf") or (vdpa_parent == "vf" and attach != "vdpa"):
            raise ValueError(f"vdpa_parent={vdpa_parent!r}: 'pf' (a VA-1 function each) or "
                             "'vf' (VFs of one card), attach='vdpa' only")
        self.vdpa_parent = vdpa_parent
        try:
            self.guest_features = (None if guest_features is None
                                   else feature_names(feature_mask(guest_features)))
        except ParamError as e:
            raise ValueError(f"guest_features: {e}") from None
        if self.guest_features is not None and (
                config is None or config.virtio_features == DEFAULT_VIRTIO_FEATURES):
            # a bring-up run: the device offers every optional feature, the guest's
            # driver picks (a config that sets virtio_features keeps its own offer)
            config = dataclasses.replace(config or Va1Config(), virtio_features=VIRTIO_OPTIONS)
        if not isinstance(seed, int) or isinstance(seed, bool) or not 0 <= seed < 1 << 64:
            raise ValueError(f"seed {seed!r} is outside 0 .. 2**64-1")
        if time_limit_ns is not None and (isinstance(time_limit_ns, bool)
                                          or not isinstance(time_limit_ns, int)
                                          or time_limit_ns <= 0):
            raise ValueError(f"time_limit_ns={time_limit_ns!r}: a positive number of ns")
        self.attach = attach
        self.seed = seed
        self.specs = self._specs(vms, memory)
        self.cmdline = cmdline
        for spec in self.specs:
            try:
                parse_cmdline(self._cmdline(spec))
            except ParamError as e:
                raise ValueError(f"VM {spec.name!r}: {e}") from None
        self.time_limit_ns = time_limit_ns
        self.exit_cost_ns = exit_cost_ns
        self.config = config
        self.resources = resources
        self.keep_trace = keep_trace
        self.card_factory = card_factory
        self.pf_driver_factory = pf_driver_factory
        self.card_options = dict(card_options or {})
        self.faults: FaultPlan | None = None
        self.injector: FaultInjector | None = None
        if faults is not None:
            self._check_faults(faults)
            self.faults = faults
        self.image: "VmImage | None" = None
        self.state = SessionState.NEW
        self._machine: Machine | None = None
        self.host: Host | None = None
        self.pf: HostPciFunction | None = None
        self.vfs: list[HostPciFunction] = []
        self.vms: list[Vm] = []
        self.tasks: list[GuestTask] = []
        self.wall_s = 0.0
        for observe in list(Session.observers):
            observe(self)

    def _specs(self, vms: int | Sequence[VmSpec | str], memory: int) -> tuple[VmSpec, ...]:
        if isinstance(vms, bool):
            raise ValueError(f"vms={vms}: give a count or a list of VMs")
        if isinstance(vms, int):
            if vms < 1:
                raise ValueError(f"vms={vms}: a session has at least one VM")
            if vms == 1:
                return (VmSpec("vm0", memory),)
            first = 1 if self.attach == "sriov" else 0   # VM n holds VF n
            return tuple(VmSpec(f"vm{i}", memory) for i in range(first, first + vms))
        specs = tuple(VmSpec(v, memory) if isinstance(v, str) else v for v in vms)
        if not specs:
            raise ValueError("vms=[]: a session has at least one VM")
        names = [s.name for s in specs]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ValueError(f"VM names must be unique: {', '.join(dup)} repeated")
        return specs

    def _cmdline(self, spec: VmSpec) -> str:
        """The VM's kernel command line: the session's, the chosen features, the VM's."""
        features = None if self.guest_features is None else features_token(self.guest_features)
        return " ".join(p for p in (self.cmdline, features, spec.cmdline) if p)

    def _check_faults(self, plan: FaultPlan) -> None:
        """Refuse a plan naming no VM of this session (nor vf<N> of an "sriov" one)
        before anything is built; PCI names ("0000:01:00.1") are resolved at launch."""
        if not isinstance(plan, FaultPlan):
            raise TypeError(f"faults={plan!r}: give a vmm.faults.FaultPlan")
        names = {s.name for s in self.specs}
        if self.attach == "sriov":
            names |= {f"vf{n}" for n in range(1, len(self.specs) + 1)}
        pci_names = self.attach in ("vfio", "sriov", "vdpa")
        plan.check_functions(lambda f: f in names or (pci_names and f.startswith("0000:")))

    @classmethod
    def from_image(cls, image: "str | Path | VmImage", *, seed: int | None = None,
                   keep_trace: bool = False, card_factory: CardFactory | None = None,
                   pf_driver_factory: PfDriverFactory | None = None,
                   time_limit_ns: int | None = None) -> "Session":
        """A session built as the VM image says (a path, or a loaded VmImage); its seed
        is `seed`, else the image's. Its programs run with `run_programs()`."""
        from .images import VmImage, load_image
        img = image if isinstance(image, VmImage) else load_image(image)
        acc = img.accelerator
        attach = {"emulated": acc.transport, "passthrough": "vfio", "sriov-vf": "sriov",
                  "vdpa": "vdpa"}[acc.mode]
        if attach == "sriov":
            specs: list[VmSpec] = [VmSpec(t.name, t.memory, VfResources(**t.resources))
                                   for t in img.tenants]
        else:
            specs = [VmSpec(img.name, img.memory)]
        options = {"total_vfs": acc.total_vfs} if acc.total_vfs is not None else {}
        s = cls(attach=attach, seed=img.seed if seed is None else seed, vms=specs,
                exit_cost_ns=img.exit_cost_ns, config=Va1Config(**acc.config),
                keep_trace=keep_trace, card_factory=card_factory,
                pf_driver_factory=pf_driver_factory, card_options=options,
                faults=img.faults, cmdline=img.cmdline, time_limit_ns=time_limit_ns,
                guest_features=img.guest_features,
                transport=acc.transport if attach == "vdpa" else None,
                spare=acc.spare, vdpa_parent=acc.parent)
        s.image = img
        return s

    # -- lifecycle ------------------------------------------------------------------------

    @_requires(SessionState.NEW)
    def launch(self) -> "Session":
        """Build the machine, host and every VM with its attachment."""
        self._machine = Machine(self.seed, keep_trace=self.keep_trace,
                                time_limit_ns=self.time_limit_ns)
        try:
            if self.attach == "sriov":
                self._build_sriov()
            elif self.attach == "vdpa" and self.vdpa_parent == "vf":
                self._build_vdpa_vfs()
            else:
                for i, spec in enumerate(self.specs):
                    self._build_vm(i, spec)
                for k in range(self.spare if self.attach == "vdpa" else 0):
                    host = self.host or self._new_host()
                    host.vdpa.register(host.add_va1(self.config, dev=len(self.specs) + k))
        except Exception as e:
            self._release()
            self.state = SessionState.FAILED
            raise LaunchError(f"{self.attach} attachment: {e}") from e
        if self.faults is not None:
            try:
                self._install(self.faults)
            except FaultPlanError:
                self._release()
                self.state = SessionState.FAILED
                raise
        self.state = SessionState.READY
        return self

    def _install(self, plan: FaultPlan) -> None:
        self.injector = FaultInjector(self.machine, plan, fault_targets(self.vms, self.host))
        self.faults = plan

    @_requires(SessionState.READY)
    def install_faults(self, plan: FaultPlan) -> FaultInjector:
        """Install a fault plan on a launched session, before its guests run (a session
        takes one plan; `Session(faults=)` installs it at launch). FaultPlanError
        naming the entry, with nothing installed, when the plan cannot run here."""
        if self.injector is not None:
            raise SessionStateError("Session.install_faults(): a fault plan is already "
                                    "installed")
        if self.tasks:
            raise SessionStateError("Session.install_faults(): guest tasks were already "
                                    "spawned; install the plan before them")
        self._check_faults(plan)
        self._install(plan)
        assert self.injector is not None
        return self.injector

    def _new_vm(self, spec: VmSpec) -> Vm:
        vm = Vm(self.machine, spec.name, ram_size=spec.memory, exit_cost_ns=self.exit_cost_ns,
                cmdline=self._cmdline(spec))
        self.vms.append(vm)
        return vm

    def _new_host(self) -> Host:
        host = self.host = Host(self.machine)
        if self.pf_driver_factory is not None:
            host.pf_driver_factory = self.pf_driver_factory
        return host

    def _build_vm(self, index: int, spec: VmSpec) -> None:
        vm = self._new_vm(spec)
        if self.attach == "mmio":
            vm.attach_va1_mmio(self.config)
        elif self.attach == "pci":
            vm.attach_va1_pci(self.config)
        elif self.attach == "vdpa":
            host = self.host or self._new_host()
            mgmt = host.vdpa.register(host.add_va1(self.config, dev=index))
            device = host.vdpa.dev_add(f"vdpa{index}", mgmt.handle)
            assert self.transport is not None
            vm.attach_va1_vdpa(host, device.name, self.transport)
        else:
            host = self.host or self._new_host()
            vm.attach_va1_passthrough(host, host.add_va1(self.config, dev=index))

    def _build_sriov(self) -> None:
        host = self._new_host()
        self.pf = host.add_va1_card(self.config, card_factory=self.card_factory,
                                    **self.card_options)
        per_vm = [s.resources or self.resources for s in self.specs]
        resources = None if all(r is None for r in per_vm) else \
            [r if r is not None else VfResources() for r in per_vm]
        self.vfs = host.enable_sriov(len(self.specs), resources, pf=self.pf)
        for spec, vf in zip(self.specs, self.vfs):
            self._new_vm(spec).attach_va1_passthrough(host, vf)

    def _build_vdpa_vfs(self) -> None:
        """One card, a VF per VM plus the spares, each under vp_vdpa (not vfio-pci);
        VM i gets a vdpa device on VF i+1."""
        host = self._new_host()
        self.pf = host.add_va1_card(self.config, card_factory=self.card_factory,
                                    **self.card_options)
        n = len(self.specs) + self.spare
        per_vm = [s.resources or self.resources for s in self.specs] + [self.resources] * self.spare
        resources = None if all(r is None for r in per_vm) else \
            [r if r is not None else VfResources() for r in per_vm]
        self.vfs = host.enable_sriov(n, resources, pf=self.pf, bind=False)
        mgmts = [host.vdpa.register(vf) for vf in self.vfs]
        for i, spec in enumerate(self.specs):
            device = host.vdpa.dev_add(f"vdpa{i}", mgmts[i].handle)
            assert self.transport is not None
            self._new_vm(spec).attach_va1_vdpa(host, device.name, self.transport)

    def _release(self) -> None:
        for vm in self.vms:
            vm.close()
        if self.host is not None:
            self.host.close()

    def close(self) -> None:
        """Release every VM's assigned functions and RAM, then the host. Idempotent."""
        if self.state in (SessionState.CLOSED, SessionState.FAILED, SessionState.NEW):
            if self.state is SessionState.NEW:
                self.state = SessionState.CLOSED
            return
        if self.state is SessionState.RUNNING:
            raise SessionStateError("Session.close() needs state ready; the session is "
                                    "running (called from a guest task?)")
        self._release()
        self.state = SessionState.CLOSED

    def __enter__(self) -> "Session":
        if self.state is SessionState.NEW:
            self.launch()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- what was built -----------------------------------------------------------------

    @property
    def machine(self) -> Machine:
        if self._machine is None:
            raise SessionStateError("Session.machine needs state ready; the session is new "
                                    "(call launch() or use it in a with statement)")
        return self._machine

    @property
    def vm(self) -> Vm:
        """The session's only VM (SessionStateError if it has several)."""
        if len(self.vms) != 1:
            raise SessionStateError(f"Session.vm: the session has {len(self.vms)} VMs; "
                                    "use vms[i] or vm_named(name)")
        return self.vms[0]

    def vm_named(self, name: str) -> Vm:
        for vm in self.vms:
            if vm.name == name:
                return vm
        raise KeyError(f"no VM named {name!r} (have {', '.join(v.name for v in self.vms)})")

    @property
    def trace(self) -> Trace:
        return self.machine.trace

    def digest(self) -> str:
        return self.machine.trace.digest()

    def now_ns(self) -> int:
        return self.machine.now_ns()

    @property
    def exits(self) -> int:
        """Trapped MMIO accesses of every VM."""
        return sum(vm.mmio.exits for vm in self.vms)

    @property
    def direct_accesses(self) -> int:
        """MMIO accesses to regions mapped straight into a guest (no exit)."""
        return sum(vm.mmio.direct_accesses for vm in self.vms)

    def program_seed(self, vm: int = 0) -> int:
        """The data seed for the program of VM `vm` (0-based): the session's seed for a
        single VM, a per-VF seed for each VM of an "sriov" session."""
        if self.attach == "sriov":
            return tenant_seed(self.seed, vm + 1)
        return self.seed

    def watch(self, callback: Callable[[TraceEvent], None]) -> None:
        """Call `callback(event)` for every trace event from now on."""
        self.machine.trace.watch(callback)

    def command_times(self) -> CommandTimes:
        """A watcher collecting every command's device time from now on."""
        times = CommandTimes()
        self.watch(times)
        return times

    def write_trace(self, path: str) -> dict[str, object]:
        """Write the kept trace as Chrome trace-event JSON (needs keep_trace=True)."""
        from .trace_export import write_chrome_trace
        return write_chrome_trace(self.machine.trace, path)

    # -- vDPA ---------------------------------------------------------------------------

    @_requires(SessionState.READY, SessionState.RUNNING)
    def move_vdpa(self, mgmtdev: str, *, vm: int | str | Vm | None = None,
                  name: str | None = None) -> str:
        """Live-move `vm`'s vdpa device to a new device on `mgmtdev` (a spare parent's
        "pci/<bdf>"): suspend, bases and state, set up on the new function, switch, kick
        (vmm.vdpa.migrate). Call it from a host task while guests run, or between runs.
        Returns the new device's name."""
        if self.attach != "vdpa":
            raise SessionStateError(f"Session.move_vdpa(): attach is {self.attach!r}, not vdpa")
        from vmm.vdpa.migrate import move
        target = self._vm(vm)
        att = target.vdpa[0]
        if name is None:
            base, _, n = att.device_name.partition("~")
            name = f"{base}~{int(n or 0) + 1}"
        move(target, att, mgmtdev, name)
        return name

    # -- running guests -----------------------------------------------------------------

    def _vm(self, vm: int | str | Vm | None) -> Vm:
        if vm is None:
            return self.vm
        if isinstance(vm, Vm):
            return vm
        if isinstance(vm, str):
            return self.vm_named(vm)
        if not 0 <= vm < len(self.vms):
            raise IndexError(f"VM index {vm}: the session has {len(self.vms)} VMs")
        return self.vms[vm]

    @_requires(SessionState.READY)
    def spawn(self, program: Program, *, vm: int | str | Vm | None = None,
              name: str | None = None) -> GuestTask:
        """A guest task in `vm` (index, name or Vm; default the only one) that boots its
        kernel, then runs `program(os)`; it runs at the next run_tasks()."""
        task = self._vm(vm).spawn_program(program, name)
        self.tasks.append(task)
        return task

    @_requires(SessionState.READY)
    def spawn_kernel(self, program: Callable[[GuestKernel], Any], *,
                     vm: int | str | Vm | None = None, name: str | None = None) -> GuestTask:
        """A guest task in `vm` that runs `program(kernel)` on the bare guest kernel
        services (RAM, MMIO and config accessors, interrupts, waits) without booting the
        project's driver: how a hostile or home-grown guest kernel drives the device."""
        target = self._vm(vm)
        task = self.machine.spawn(lambda: program(target.kernel),
                                  name or f"{target.name}.kernel", target.domain)
        self.tasks.append(task)
        return task

    @_requires(SessionState.READY)
    def spawn_host(self, fn: Callable[[], Any], name: str = "host") -> GuestTask:
        """A host task (PF management, say) that runs alongside the guests."""
        task = self.machine.spawn(fn, name)
        self.tasks.append(task)
        return task

    @_requires(SessionState.READY)
    def run_tasks(self) -> list[GuestTask]:
        """Run every spawned task to its end (check each task's .error and .result)."""
        self.state = SessionState.RUNNING
        wall0 = time.perf_counter()
        try:
            self.machine.run_tasks()
        finally:
            self.wall_s += time.perf_counter() - wall0
            self.state = SessionState.READY
        return list(self.tasks)

    def run(self, program: Program, *, vm: int | str | Vm | None = None,
            name: str | None = None) -> Any:
        """Run `program(os)` in `vm` to its end and return its result; the guest's
        exception is raised here unchanged."""
        task = self.spawn(program, vm=vm, name=name)
        self.run_tasks()
        if task.error is not None:
            raise task.error
        return task.result

    def run_all(self, programs: Sequence[Program | None], *,
                names: Iterable[str | None] | None = None) -> list[GuestTask]:
        """programs[i] in VM i (None: that VM idles), all run together to the end."""
        if len(programs) != len(self.vms):
            raise ValueError(f"{len(programs)} programs for {len(self.vms)} VMs")
        names_ = list(names) if names is not None else [None] * len(programs)
        tasks = [self.spawn(p, vm=i, name=n)
                 for i, (p, n) in enumerate(zip(programs, names_)) if p is not None]
        self.run_tasks()
        return tasks
