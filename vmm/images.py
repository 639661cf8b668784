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
    mode = "emulated"                # "emulated" | "passthrough"
    transport = "mmio"               # "mmio" | "pci" (passthrough: "pci" only)
    [accelerator.config]             # optional Va1Config fields (ints), e.g.
    num_compute_units = 4

    [program]                        # optional
    entry = "userspace_runtime.workloads.mlp:main"   # module:function
    [program.args]                   # keyword arguments, called as entry(os, seed=, **args)
    batch = 64
"""
from __future__ import annotations

import dataclasses
import importlib
import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

DEFAULT_PROGRAM = "userspace_runtime.workloads.mlp:main"
MODES = ("emulated", "passthrough")
TRANSPORTS = ("mmio", "pci")
PAGE = 4096
MIN_MEMORY = 2 << 20
MAX_MEMORY = 3 << 30   # guest RAM sits below the 32-bit MMIO hole (0xC0000000)
_ENTRY = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*:[A-Za-z_][A-Za-z0-9_]*$")
_SIZE = re.compile(r"^\s*(\d+)\s*([KMG]i?B?|B)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "B": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


class ImageError(ValueError):
    """A VM image that cannot be used; the message names the file and the field."""


@dataclass(frozen=True)
class AcceleratorSpec:
    mode: str = "emulated"
    transport: str = "mmio"
    config: dict[str, int] = field(default_factory=dict)


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
    c.keys(doc, "", ("name", "description", "seed", "machine", "accelerator", "program"))
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
        raw = c.typed(machine["memory"], "machine.memory", (int, str), "a size (bytes or text like \"256M\")")
        try:
            memory = parse_size(raw)
        except ValueError as e:
            raise c.fail("machine.memory", str(e)) from None
        if memory % PAGE or not MIN_MEMORY <= memory <= MAX_MEMORY:
            raise c.fail("machine.memory", f"{memory} bytes: must be a multiple of {PAGE} "
                                           f"between {MIN_MEMORY} and {MAX_MEMORY}")
    vcpus = c.int_range(machine.get("vcpus", 1), "machine.vcpus", 1, 64)
    exit_cost = c.int_range(machine.get("exit_cost_ns", 1000), "machine.exit_cost_ns", 0, 10**9)

    if "accelerator" not in doc:
        raise c.fail("accelerator", "missing (mode and transport of the VA-1 to attach)")
    acc = c.table(doc, "accelerator", "")
    c.keys(acc, "accelerator.", ("mode", "transport", "config"))
    mode = c.typed(acc.get("mode", "emulated"), "accelerator.mode", str, "text")
    if mode not in MODES:
        raise c.fail("accelerator.mode", f"unknown mode {mode!r} (one of: {', '.join(MODES)})")
    transport = c.typed(acc.get("transport", "pci" if mode == "passthrough" else "mmio"),
                        "accelerator.transport", str, "text")
    if transport not in TRANSPORTS:
        raise c.fail("accelerator.transport", f"unknown transport {transport!r} "
                                              f"(one of: {', '.join(TRANSPORTS)})")
    if mode == "passthrough" and transport != "pci":
        raise c.fail("accelerator.transport", "passthrough assigns a PCI function: transport must be \"pci\"")
    cfg = c.table(acc, "config", "accelerator.")
    from device_model import Va1Config
    known = tuple(f.name for f in dataclasses.fields(Va1Config))
    c.keys(cfg, "accelerator.config.", known)
    for k, v in cfg.items():
        c.typed(v, f"accelerator.config.{k}", int, "an integer")
    try:
        Va1Config(**cfg)
    except (TypeError, ValueError) as e:
        raise c.fail("accelerator.config", str(e)) from None

    prog = c.table(doc, "program", "")
    c.keys(prog, "program.", ("entry", "args"))
    entry = c.typed(prog.get("entry", DEFAULT_PROGRAM), "program.entry", str, "text")
    if not _ENTRY.match(entry):
        raise c.fail("program.entry", f"{entry!r} is not \"module:function\" "
                                      "(e.g. \"userspace_runtime.workloads.mlp:main\")")
    args = dict(c.table(prog, "args", "program."))
    if "seed" in args:
        raise c.fail("program.args.seed", "the seed is given by the image's seed or --seed")
    return VmImage(path, name, description, seed, memory, vcpus, exit_cost,
                   AcceleratorSpec(mode, transport, dict(cfg)), entry, args)


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
    module_name, func_name = image.entry.split(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ImageError(f"{image.path}: program.entry: cannot import {module_name!r}: {e}") from None
    fn = getattr(module, func_name, None)
    if not callable(fn):
        raise ImageError(f"{image.path}: program.entry: {module_name!r} has no function {func_name!r}")
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

    @property
    def ok(self) -> bool:
        return self.error is None and isinstance(self.result, dict) and self.result.get("ok") is True


def build_vm(image: VmImage, machine: Any) -> tuple[Any, Any]:
    """Build the image's VM (and host, for passthrough) on `machine`: (vm, host|None)."""
    from device_model import Va1Config

    from .host import Host
    from .vm import Vm
    vm = Vm(machine, image.name, ram_size=image.memory, exit_cost_ns=image.exit_cost_ns)
    config = Va1Config(**image.accelerator.config)
    host = None
    acc = image.accelerator
    if acc.mode == "emulated" and acc.transport == "mmio":
        vm.attach_va1_mmio(config)
    elif acc.mode == "emulated":
        vm.attach_va1_pci(config)
    else:
        host = Host(machine)
        vm.attach_va1_passthrough(host, host.add_va1(config))
    return vm, host


def run_image(image: VmImage, seed: int | None = None, keep_trace: bool = False) -> ImageRun:
    """Boot the image, run its program as program(os, seed=seed, **args) in a guest task."""
    from .machine import Machine
    program = resolve_program(image)
    seed = image.seed if seed is None else seed
    machine = Machine(seed, keep_trace=keep_trace)
    vm, _host = build_vm(image, machine)
    args = dict(image.args)
    task = vm.spawn_program(lambda os_: program(os_, seed=seed, **args), name=image.name)
    try:
        machine.run_tasks()
    finally:
        vm.close()
    return ImageRun(image, seed, task.result, task.error, machine.now_ns(), machine.trace.digest(),
                    vm.mmio.exits, vm.mmio.direct_accesses, list(machine.trace.events))
