"""VM images: a TOML file that says what machine to build and what to run in it.

Why: a run should be named by a file (reviewable, diffable, replayable with its seed)
rather than by a Python script. Every field is checked before anything is built, and
every bad field gets an error naming the file and the field. Format (README, "VM images"):

    name = "microvm-mmio"            # required, text
    description = "..."              # optional
    seed = 0                         # optional default seed (0 .. 2**64-1)

    [machine]                        # optional
    memory = "256M"                  # bytes, or text with K/M/G; page multiple, 2 MiB .. 3 GiB
    vcpus = 1                        # 1 .. 64 (the machine runs guest tasks on one)
    exit_cost_ns = 1000              # virtual cost of a trapped MMIO access

    [accelerator]                    # required
    mode = "emulated"                # "emulated" | "passthrough" | "vdpa" | "sriov-vf"
    transport = "mmio"               # "mmio" | "pci" (passthrough: "pci" only)
    spare = 1                        # vdpa only: extra host functions under vp_vdpa with
                                     # no device (`virtaccel vdpa dev add`, a move), 0 .. 8
    parent = "pf"                    # vdpa only: "pf" (a VA-1 function each) or "vf"
                                     # (VFs of one card, a VF per VM then the spares)
    [accelerator.config]             # optional Va1Config fields (ints), e.g.
    num_compute_units = 4

    [program]                        # optional
    entry = "virtaccel.guests.mlp:main"   # module:function
    [program.args]                   # keyword arguments, called as entry(os, seed=, **args)
    batch = 64

SR-IOV tenants (mode = "sriov-vf"): one host with one VA-1 card; the host's PF driver
enables one VF per [[tenant]], provisions it through the admin queue and binds it to
vfio-pci; each tenant is a VM of its own ([machine] gives every VM's defaults) with its
VF assigned by VFIO passthrough, running its program (seed: the tenant's, derived from
the image seed and the VF number):

    [accelerator]
    mode = "sriov-vf"                # transport is "pci"
    total_vfs = 64                   # optional: the card's TotalVFs (1 .. 64)
    [accelerator.config]             # optional Va1Config fields of the card
    [accelerator.resources]          # default VF resources (hwspec.va1.VF_RESOURCES names)
    device_memory = "64M"            # sizes as bytes or text; the rest integers
    weight = 1

    [[tenant]]                       # 1 .. total_vfs of them; VF n is the n-th
    name = "alice"                   # the VM's name (unique)
    memory = "32M"                   # optional, overrides machine.memory
    resources = { weight = 2 }       # optional, overrides accelerator.resources
    entry = "virtaccel.guests.tenant:checked_gemm"   # optional, overrides program.entry
    args = { count = 16 }            # optional, merged over program.args

Guest driver features (docs/driver.md "Feature choice"), any mode: the optional virtio
features the guest's VA-1 driver may accept; the device then offers all of them, so the
run negotiates exactly this set (what the device offers of it). Without [guest] the
driver accepts its defaults (indirect, event_idx) from a device offering those:

    [guest]
    features = ["packed", "event_idx"]      # exactly these (any of: indirect, event_idx,
                                            # packed, in_order, notification_data,
                                            # ring_reset); [] = none
    # exclude_features = ["packed"]         # or: every one of them but these
    cmdline = "va1.watchdog_ns=4000000000"  # the guest kernel's command line (every VM's):
                                            # the VA-1 driver's parameters (docs/driver.md,
                                            # "Parameters")

Fault plans (docs/faults.md), any mode: one [[faults]] table per entry, checked by
vmm.faults' rules; `function` is the image's name (its VM), or for sriov-vf a tenant's
name, vf<N> or a VF's PCI name:

    [[faults]]
    name = "lost-irq"                # optional; the trace names the entry by it
    function = "tenant3"
    action = "drop_interrupt"        # see docs/faults.md for every action
    after = 5                        # trigger: at_ns = T | after = N | probability = p
    on = "interrupt"                 # with after/probability: submission, command, kick,
                                     # interrupt or dma
    # delay_ns = 20000               # delay_interrupt, delay_mmio_exit (duplicate: optional)
"""
from __future__ import annotations

import dataclasses
import importlib
import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from guest_driver.params import ParamError, parse_cmdline
from vmm.faults import FaultPlan, FaultPlanError

from .errors import ImageError
from .session import tenant_seed

__all__ = ["ImageError", "ImageRun", "VmImage", "load_image", "parse_image", "run_image",
           "tenant_seed"]

DEFAULT_PROGRAM = "virtaccel.guests.mlp:main"
MODES = ("emulated", "passthrough", "sriov-vf", "vdpa")
MAX_SPARE = 8
MAX_TOTAL_VFS = 64
TRANSPORTS = ("mmio", "pci")
PAGE = 4096
MIN_MEMORY = 2 << 20
MAX_MEMORY = 3 << 30   # guest RAM sits below the 32-bit MMIO hole (0xC0000000)
_ENTRY = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*:[A-Za-z_][A-Za-z0-9_]*$")
_SIZE = re.compile(r"^\s*(\d+)\s*([KMG]i?B?|B)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "B": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


@dataclass(frozen=True)
class AcceleratorSpec:
    mode: str = "emulated"
    transport: str = "mmio"
    config: dict[str, int] = field(default_factory=dict)
    resources: dict[str, int] = field(default_factory=dict)   # sriov-vf: default VF resources
    total_vfs: int | None = None                               # sriov-vf: the card's TotalVFs
    spare: int = 0             # vdpa: extra host functions with a management device only
    parent: str = "pf"         # vdpa: "pf" (a VA-1 function each) or "vf" (VFs of one card)


@dataclass(frozen=True)
class TenantImage:
    """One tenant VM of an sriov-vf image: VF `index` (1-based) assigned to it."""
    index: int
    name: str
    memory: int
    resources: dict[str, int]    # merged: accelerator.resources, then the tenant's
    entry: str
    args: dict[str, Any]


@dataclass(frozen=True)
class VmImage:
    path: str
    name: str
    description: str = ""
    seed: int = 0
    memory: int = 256 << 20
    vcpus: int = 1
    exit_cost_ns: int = 1000
    accelerator: AcceleratorSpec = field(default_factory=AcceleratorSpec)
    entry: str = DEFAULT_PROGRAM
    args: dict[str, Any] = field(default_factory=dict)
    tenants: tuple[TenantImage, ...] = ()
    faults: "FaultPlan | None" = None     # [[faults]]; None: no plan
    cmdline: str = ""                     # [guest] cmdline: every guest kernel's
    guest_features: tuple[str, ...] | None = None   # [guest]; None: the driver's defaults


class _Checker:
    def __init__(self, path: str) -> None:
        self.path = path

    def fail(self, where: str, msg: str) -> ImageError:
        return ImageError(f"{self.path}: {where}: {msg}")

    def keys(self, table: dict[str, Any], where: str, allowed: tuple[str, ...]) -> None:
        for k in table:
            if k not in allowed:
                raise self.fail(f"{where}{k}" if where else k,
                                f"unknown key (allowed here: {', '.join(allowed)})")

    def typed(self, value: Any, where: str, want: type | tuple[type, ...], what: str) -> Any:
        if isinstance(value, bool) and bool not in (want if isinstance(want, tuple) else (want,)):
            raise self.fail(where, f"must be {what}, not a boolean")
        if not isinstance(value, want):
            raise self.fail(where, f"must be {what}, not {type(value).__name__} {value!r}")
        return value

    def table(self, doc: dict[str, Any], key: str, where: str) -> dict[str, Any]:
        value = doc.get(key, {})
        return self.typed(value, f"{where}{key}", dict, "a table")  # type: ignore[no-any-return]

    def int_range(self, value: Any, where: str, lo: int, hi: int) -> int:
        self.typed(value, where, int, "an integer")
        if not lo <= value <= hi:
            raise self.fail(where, f"{value} is outside {lo} .. {hi}")
        return int(value)


def parse_size(text: str | int) -> int:
    """Bytes from an int or '256M', '1G', '512KiB', '4096'."""
    if isinstance(text, bool):
        raise ValueError("a boolean is not a size")
    if isinstance(text, int):
        return text
    m = _SIZE.match(text)
    if not m:
        raise ValueError(f"{text!r} is not a size (bytes, or a number with K, M or G)")
    unit = (m.group(2) or "").upper().rstrip("B").rstrip("I")
    return int(m.group(1)) * _UNITS[unit]


def parse_image(doc: dict[str, Any], path: str = "<image>") -> VmImage:
    """Check a parsed TOML document field by field and build the VmImage."""
    c = _Checker(path)
    c.keys(doc, "", ("name", "description", "seed", "machine", "accelerator", "program", "tenant",
                     "faults", "guest"))
    if "name" not in doc:
        raise c.fail("name", "missing (every image has a name)")
    name = c.typed(doc["name"], "name", str, "text")
    if not name.strip():
        raise c.fail("name", "must not be empty")
    description = c.typed(doc.get("description", ""), "description", str, "text")
    seed = c.int_range(doc.get("seed", 0), "seed", 0, (1 << 64) - 1)

    machine = c.table(doc, "machine", "")
    c.keys(machine, "machine.", ("memory", "vcpus", "exit_cost_ns"))
    memory = 256 << 20
    if "memory" in machine:
        memory = _memory(c, machine["memory"], "machine.memory")
    vcpus = c.int_range(machine.get("vcpus", 1), "machine.vcpus", 1, 64)
    exit_cost = c.int_range(machine.get("exit_cost_ns", 1000), "machine.exit_cost_ns", 0, 10**9)

    if "accelerator" not in doc:
        raise c.fail("accelerator", "missing (mode and transport of the VA-1 to attach)")
    acc = c.table(doc, "accelerator", "")
    c.keys(acc, "accelerator.", ("mode", "transport", "config", "resources", "total_vfs",
                                 "spare", "parent"))
    mode = c.typed(acc.get("mode", "emulated"), "accelerator.mode", str, "text")
    if mode not in MODES:
        raise c.fail("accelerator.mode", f"unknown mode {mode!r} (one of: {', '.join(MODES)})")
    transport = c.typed(acc.get("transport", "pci" if mode in ("passthrough", "sriov-vf") else "mmio"),
                        "accelerator.transport", str, "text")
    if transport not in TRANSPORTS:
        raise c.fail("accelerator.transport", f"unknown transport {transport!r} "
                                              f"(one of: {', '.join(TRANSPORTS)})")
    if mode in ("passthrough", "sriov-vf") and transport != "pci":
        raise c.fail("accelerator.transport", f"{mode} assigns a PCI function: transport must be \"pci\"")
    spare, parent = 0, "pf"
    if mode == "vdpa":
        spare = c.int_range(acc.get("spare", 0), "accelerator.spare", 0, MAX_SPARE)
        parent = c.typed(acc.get("parent", "pf"), "accelerator.parent", str, "text")
        if parent not in ("pf", "vf"):
            raise c.fail("accelerator.parent", f"{parent!r}: \"pf\" (a VA-1 function) or "
                                               "\"vf\" (a VF of one card)")
    else:
        for key in ("spare", "parent"):
            if key in acc:
                raise c.fail(f"accelerator.{key}", "only for mode = \"vdpa\"")
    if mode != "sriov-vf":
        for key in ("resources", "total_vfs"):
            if key in acc:
                raise c.fail(f"accelerator.{key}", "only for mode = \"sriov-vf\"")
        if "tenant" in doc:
            raise c.fail("tenant", "[[tenant]] tables are only for mode = \"sriov-vf\"")
    cfg = c.table(acc, "config", "accelerator.")
    from device_model import Va1Config
    from device_model.va1.config import ConfigError
    known = tuple(f.name for f in dataclasses.fields(Va1Config))
    c.keys(cfg, "accelerator.config.", known)
    for k, v in cfg.items():
        c.typed(v, f"accelerator.config.{k}", int, "an integer")
    try:
        Va1Config(**cfg)
    except ConfigError as e:
        raise c.fail(f"accelerator.config.{e.field}", e.problem) from None
    except (TypeError, ValueError) as e:
        raise c.fail("accelerator.config", str(e)) from None

    prog = c.table(doc, "program", "")
    c.keys(prog, "program.", ("entry", "args"))
    entry = c.typed(prog.get("entry", DEFAULT_PROGRAM), "program.entry", str, "text")
    if not _ENTRY.match(entry):
        raise c.fail("program.entry", f"{entry!r} is not \"module:function\" "
                                      "(e.g. \"virtaccel.guests.mlp:main\")")
    args = dict(c.table(prog, "args", "program."))
    if "seed" in args:
        raise c.fail("program.args.seed", "the seed is given by the image's seed or --seed")
    resources: dict[str, int] = {}
    total_vfs: int | None = None
    tenants: tuple[TenantImage, ...] = ()
    if mode == "sriov-vf":
        if "total_vfs" in acc:
            total_vfs = c.int_range(acc["total_vfs"], "accelerator.total_vfs", 1, MAX_TOTAL_VFS)
        resources = _resources(c, c.table(acc, "resources", "accelerator."), "accelerator.resources.")
        tenants = _tenants(c, doc, memory, resources, entry, args, total_vfs or MAX_TOTAL_VFS)
    faults = _faults(c, doc, mode, transport, name, tenants)
    guest = c.table(doc, "guest", "")
    guest_features = _guest_features(c, guest)
    cmdline = c.typed(guest.get("cmdline", ""), "guest.cmdline", str, "text")
    try:
        parse_cmdline(cmdline)
    except ParamError as e:
        raise c.fail("guest.cmdline", str(e)) from None
    return VmImage(path, name, description, seed, memory, vcpus, exit_cost,
                   AcceleratorSpec(mode, transport, dict(cfg), resources, total_vfs, spare,
                                   parent),
                   entry, args, tenants, faults, cmdline, guest_features)


def _guest_features(c: _Checker, guest: dict[str, Any]) -> tuple[str, ...] | None:
    """[guest] features = [...] (exactly these optional features) or exclude_features =
    [...] (every optional feature but these); neither: the driver's defaults (None)."""
    from .session import GUEST_FEATURES
    c.keys(guest, "guest.", ("features", "exclude_features", "cmdline"))
    if "features" in guest and "exclude_features" in guest:
        raise c.fail("guest", "give features or exclude_features, not both")
    for key in ("features", "exclude_features"):
        if key not in guest:
            continue
        names = guest[key]
        if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
            raise c.fail(f"guest.{key}", "must be a list of feature names")
        for i, n in enumerate(names):
            if n not in GUEST_FEATURES:
                raise c.fail(f"guest.{key}[{i}]", f"unknown feature {n!r} (known: "
                                                 f"{', '.join(GUEST_FEATURES)})")
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise c.fail(f"guest.{key}", f"{', '.join(dup)} repeated")
        if key == "features":
            return tuple(names)
        return tuple(n for n in GUEST_FEATURES if n not in names)
    return None


def _faults(c: _Checker, doc: dict[str, Any], mode: str, transport: str, name: str,
            tenants: tuple[TenantImage, ...]) -> FaultPlan | None:
    """[[faults]]: each entry checked by vmm.faults' rules; its function must be the
    image's VM (its name), or a tenant's name, vf<N> or a VF's PCI name."""
    raw = doc.get("faults")
    if raw is None:
        return None
    if not isinstance(raw, list) or not all(isinstance(t, dict) for t in raw):
        raise c.fail("faults", "must be an array of tables ([[faults]])")
    try:
        plan = FaultPlan(raw)
        _check_plan_functions(plan, mode, transport, name, tenants)
    except FaultPlanError as e:
        where = f"faults[{e.index}]" + (f".{e.field}" if e.field else "")
        raise c.fail(where, e.problem) from None
    return plan


def check_plan(image: VmImage, plan: FaultPlan) -> None:
    """FaultPlanError naming the first entry of `plan` that cannot run on `image` (a
    function it does not have, an action its attachment cannot take)."""
    acc = image.accelerator
    _check_plan_functions(plan, acc.mode, acc.transport, image.name, image.tenants)


def _check_plan_functions(plan: FaultPlan, mode: str, transport: str, name: str,
                          tenants: tuple[TenantImage, ...]) -> None:
    if tenants:
        known = {t.name for t in tenants} | {f"vf{t.index}" for t in tenants}
        plan.check_functions(lambda f: f in known or f.startswith("0000:"))
    else:
        plan.check_functions(lambda f: f == name or (mode in ("passthrough", "vdpa")
                                                     and f.startswith("0000:")))
        for i, e in enumerate(plan.entries):
            if e.action in ("vf_reset", "vf_stop"):
                raise FaultPlanError(i, e.name, "action",
                                     f"{e.action} is an admin command of an SR-IOV VF's "
                                     "PF; this image has no VF (mode sriov-vf)")
            if e.action == "flr" and mode == "vdpa":
                raise FaultPlanError(i, e.name, "action",
                                     "flr: the guest's function is the VMM's vDPA frontend; "
                                     "an FLR of the hardware under it is not a guest event "
                                     "(use needs_reset)")
            if e.action == "iommu_unmap" and mode not in ("passthrough", "vdpa"):
                raise FaultPlanError(i, e.name, "action",
                                     "iommu_unmap needs a function behind the IOMMU; "
                                     "this image's emulated function has none")
        if transport == "mmio" and mode != "vdpa":
            for i, e in enumerate(plan.entries):
                if e.action in ("flr", "duplicate_interrupt"):
                    raise FaultPlanError(i, e.name, "action",
                                         f"{e.action} needs a PCI function with MSI-X; "
                                         "this image attaches virtio-mmio")


def _memory(c: _Checker, raw: Any, where: str) -> int:
    c.typed(raw, where, (int, str), "a size (bytes or text like \"256M\")")
    try:
        memory = parse_size(raw)
    except ValueError as e:
        raise c.fail(where, str(e)) from None
    if memory % PAGE or not MIN_MEMORY <= memory <= MAX_MEMORY:
        raise c.fail(where, f"{memory} bytes: must be a multiple of {PAGE} "
                            f"between {MIN_MEMORY} and {MAX_MEMORY}")
    return memory


def _resources(c: _Checker, table: dict[str, Any], where: str) -> dict[str, int]:
    """VF resources: hwspec.va1.VF_RESOURCES names; device_memory may be a size text."""
    from hwspec.va1 import VfResources
    names = VfResources.field_names()
    c.keys(table, where, names)
    out: dict[str, int] = {}
    for k, v in table.items():
        if k == "device_memory":
            c.typed(v, where + k, (int, str), "a size (bytes or text like \"64M\")")
            try:
                v = parse_size(v)
            except ValueError as e:
                raise c.fail(where + k, str(e)) from None
        lo, hi = _vf_limits()[k]
        out[k] = c.int_range(v, where + k, lo, hi)
    mem = out.get("device_memory")
    if mem is not None and mem % _PARTITION_ALIGN:
        raise c.fail(where + "device_memory", f"{mem} bytes: must be a multiple of 1 MiB")
    return out


_PARTITION_ALIGN = 1 << 20


def _vf_limits() -> dict[str, tuple[int, int]]:
    """The range of every VF resource the PF accepts (datasheet §11): the field's width
    in va1_vf_resources, narrowed by its rule."""
    from hwspec import va1
    width = {"Q": (1 << 64) - 1, "I": (1 << 32) - 1}
    limits = {name: (1, width[code]) for name, code in va1.VF_RESOURCES.fields}
    limits["num_submit_queues"] = (1, va1.MAX_SUBMIT_QUEUES_PER_FUNCTION)
    limits["priority"] = (0, va1.MAX_PRIORITY)
    limits["device_memory"] = (_PARTITION_ALIGN, width["Q"])
    return limits


def _tenants(c: _Checker, doc: dict[str, Any], memory: int, resources: dict[str, int],
             entry: str, args: dict[str, Any], total_vfs: int) -> tuple[TenantImage, ...]:
    raw = doc.get("tenant")
    if raw is None:
        raise c.fail("tenant", "missing: an sriov-vf image has one [[tenant]] table per VF")
    if not isinstance(raw, list) or not all(isinstance(t, dict) for t in raw):
        raise c.fail("tenant", "must be an array of tables ([[tenant]])")
    if not 1 <= len(raw) <= total_vfs:
        raise c.fail("tenant", f"{len(raw)} tenants: 1 .. {total_vfs} (the card's TotalVFs)")
    out: list[TenantImage] = []
    seen: set[str] = set()
    for i, t in enumerate(raw, start=1):
        w = f"tenant[{i - 1}]."
        c.keys(t, w, ("name", "memory", "resources", "entry", "args"))
        tname = c.typed(t.get("name", f"tenant{i}"), w + "name", str, "text")
        if not tname.strip() or not re.match(r"^[A-Za-z0-9_.-]+$", tname):
            raise c.fail(w + "name", f"{tname!r}: letters, digits, '_', '.', '-' only")
        if tname in seen:
            raise c.fail(w + "name", f"{tname!r} is used by another tenant")
        seen.add(tname)
        mem = _memory(c, t["memory"], w + "memory") if "memory" in t else memory
        res = dict(resources)
        res.update(_resources(c, c.table(t, "resources", w), w + "resources."))
        tentry = c.typed(t.get("entry", entry), w + "entry", str, "text")
        if not _ENTRY.match(tentry):
            raise c.fail(w + "entry", f"{tentry!r} is not \"module:function\"")
        targs = dict(args)
        targs.update(c.table(t, "args", w))
        if "seed" in targs:
            raise c.fail(w + "args.seed", "the seed is given by the image's seed or --seed")
        out.append(TenantImage(i, tname, mem, res, tentry, targs))
    return tuple(out)


def load_image(path: str | Path) -> VmImage:
    """Read and check an image file (ImageError on any problem)."""
    p = Path(path)
    try:
        raw = p.read_bytes()
    except OSError as e:
        raise ImageError(f"{p}: cannot read: {e.strerror or e}") from None
    try:
        doc = tomllib.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as e:
        raise ImageError(f"{p}: not UTF-8 text: {e}") from None
    except tomllib.TOMLDecodeError as e:
        raise ImageError(f"{p}: not valid TOML: {e}") from None
    return parse_image(doc, str(p))


def resolve_program(image: VmImage) -> Callable[..., Any]:
    """Import the image's `module:function` (ImageError naming what is missing)."""
    return resolve_entry(image.path, image.entry, "program.entry")


def resolve_entry(path: str, entry: str, where: str) -> Callable[..., Any]:
    """Import `module:function` (ImageError naming the file, the field and what is missing)."""
    module_name, func_name = entry.split(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ImageError(f"{path}: {where}: cannot import {module_name!r}: {e}") from None
    fn = getattr(module, func_name, None)
    if not callable(fn):
        raise ImageError(f"{path}: {where}: {module_name!r} has no function {func_name!r}")
    return fn  # type: ignore[no-any-return]


@dataclass
class ImageRun:
    """What one run of an image gave."""
    image: VmImage
    seed: int
    result: Any
    error: BaseException | None
    virtual_ns: int
    digest: str
    exits: int
    direct_accesses: int
    trace_events: list[Any] = field(default_factory=list)
    # (trace source, rule, message) of every driver rule the device logged, in order:
    # transport violations and the ring rules that set DEVICE_NEEDS_RESET
    violations: list[tuple[str, str, str]] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.error is None and isinstance(self.result, dict) and self.result.get("ok") is True


def run_image(image: VmImage, seed: int | None = None, keep_trace: bool = False, *,
              card_factory: Any = None, pf_driver_factory: Any = None,
              on_launch: Callable[[Any], Any] | None = None,
              time_limit_ns: int | None = None) -> ImageRun:
    """Boot the image, run its program as program(os, seed=seed, **args) in a guest task
    (sriov-vf: every tenant VM's program, each in its own guest task, seeded per VF; the
    result is {"ok": all ok, "tenants": {name: result}}). `on_launch(session)` is called
    once the session is launched, before any guest task is spawned (a watcher such as
    suites.invariants.Invariants goes in there). `time_limit_ns`: a guest wait still
    going at that virtual time ends in vmm.machine.VirtualTimeLimit."""
    from .errors import LaunchError
    from .session import Session
    seed = image.seed if seed is None else seed
    if image.tenants:
        programs = [resolve_entry(image.path, t.entry, f"tenant[{t.index - 1}].entry")
                    for t in image.tenants]
        names = [t.name for t in image.tenants]
        arglists = [dict(t.args) for t in image.tenants]
    else:
        programs = [resolve_program(image)]
        names = [image.name]
        arglists = [dict(image.args)]
    session = Session.from_image(image, seed=seed, keep_trace=keep_trace,
                                 card_factory=card_factory, pf_driver_factory=pf_driver_factory,
                                 time_limit_ns=time_limit_ns)
    try:
        session.launch()
    except LaunchError as e:
        cause = e.__cause__
        reason = cause.strerror if isinstance(cause, OSError) and cause.strerror else cause
        raise ImageError(f"{image.path}: accelerator: {reason or e}") from None
    violations: list[tuple[str, str, str]] = []

    def watch(ev: Any) -> None:
        if ev.kind in ("violation", "ring_broken"):
            violations.append((ev.source, str(ev.get("rule")), str(ev.get("message"))))
    with session:
        session.watch(watch)
        if on_launch is not None:
            on_launch(session)
        tasks = [session.spawn(_bind(prog, session.program_seed(i), args), vm=i, name=name)
                 for i, (prog, name, args) in enumerate(zip(programs, names, arglists))]
        session.run_tasks()
    if not image.tenants:
        task = tasks[0]
        result, error = task.result, task.error
    else:
        result, error = _tenant_results(image, session, tasks, programs)
    return ImageRun(image, seed, result, error, session.now_ns(), session.digest(),
                    session.exits, session.direct_accesses, list(session.trace.events),
                    violations)


def _bind(program: Callable[..., Any], seed: int, args: dict[str, Any]
          ) -> Callable[[Any], Any]:
    """The guest program as the image calls it: program(os, seed=seed, **args)."""
    return lambda os_: program(os_, seed=seed, **args)


def _tenant_results(image: VmImage, session: Any, tasks: list[Any], programs: list[Any]
                    ) -> tuple[dict[str, Any], BaseException | None]:
    """{"ok", "tenants": {name: result}}, each checked by its program's `verify`."""
    results: dict[str, Any] = {}
    error: BaseException | None = None
    ok = True
    for i, (t, task, prog) in enumerate(zip(image.tenants, tasks, programs)):
        if task.error is not None:
            results[t.name] = {"ok": False, "error": f"{type(task.error).__name__}: {task.error}"}
            error = error or task.error
            ok = False
            continue
        r = task.result
        verify = getattr(prog, "verify", None)
        if isinstance(r, dict) and verify is not None:
            r = dict(r)
            r["correct"] = bool(verify(r, session.program_seed(i)))
            r["ok"] = bool(r.get("ok")) and r["correct"]
        ok = ok and isinstance(r, dict) and r.get("ok") is True
        results[t.name] = r
    return {"ok": ok, "tenants": results}, error
