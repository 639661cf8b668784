"""A PCI host bridge: an ECAM config window, firmware BAR assignment, BAR decoding.

Why: a guest finds a PCI function the way it does on real hardware, by reading config
space through ECAM, and reaches its registers through BARs at addresses the firmware
chose. The same bridge serves an emulated function (the device model's PciFunction)
and a passed-through one (a VFIO-backed endpoint); it only needs the PciFunction
contract, plus, optionally, `bar_regions(index)`: how a BAR is split into pieces mapped
straight into the guest (direct: no exit) and pieces that trap.

- ECAM: config access to bus/dev/fn/reg goes to the function in that slot. An empty
  slot, a bad access size, a misaligned access, reads all-ones; writes are dropped.
- Firmware (`assign_bars`): sizes every BAR through config writes of all-ones, places
  it naturally aligned (64-bit BARs in the 64-bit window, 32-bit ones below 4 GiB) and
  writes the BAR registers. COMMAND.MEMORY is left for the guest driver to set.
- Decoding: after a config write that touches COMMAND or a BAR register, the bridge
  reads COMMAND and the BARs back and (re)maps each BAR on the VM bus while memory
  decoding is on. A BAR that would overlap another region is not mapped; the conflict
  is logged in `conflicts` and traced.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Protocol, Sequence

from device_model.pci.api import BarInfo, PciFunction
from guest_driver.kernel import PciHostBridge
from hwspec import pci as P

from ..bus import BusError, MmioBus, MmioHandler
from ..errors import VmmError
from ..trace import SourceTracer

ALL_ONES32 = 0xFFFF_FFFF
U64 = 1 << 64
BAR_REGS_END = P.BASE_ADDRESS_0 + 4 * P.NUM_BARS


class PciError(VmmError, ValueError):
    """A bad request to the host bridge (slot taken, window exhausted). Nothing changed."""


@dataclass(frozen=True)
class BarRegion:
    """A piece of a BAR as the VM bus maps it: [offset, offset + size) of the BAR."""
    offset: int
    size: int
    handler: MmioHandler
    direct: bool = False


class BarWindow:
    """MMIO handler for a piece of a BAR: forwards to the function's bar_read/bar_write
    (an emulated, trapped access)."""

    def __init__(self, function: PciFunction, index: int, base: int = 0) -> None:
        self.function = function
        self.index = index
        self.base = base

    def read(self, offset: int, size: int) -> int:
        return self.function.bar_read(self.index, self.base + offset, size)

    def write(self, offset: int, size: int, value: int) -> None:
        self.function.bar_write(self.index, self.base + offset, size, value)


class SplitBars(Protocol):
    """Optional: a function that says how its BARs are mapped (passthrough)."""

    def bar_regions(self, index: int) -> Sequence[BarRegion]: ...


@dataclass(frozen=True)
class SizedBar:
    """What firmware learnt about a BAR through the config protocol."""
    index: int
    size: int
    is_64bit: bool
    prefetchable: bool


@dataclass
class PciSlot:
    bus: int
    dev: int
    fn: int
    function: PciFunction
    name: str
    mapped: dict[int, tuple[int, list[int]]] = field(default_factory=dict)  # bar -> (addr, bus bases)

    @property
    def bdf(self) -> int:
        return self.bus << 8 | self.dev << 3 | self.fn

    @property
    def address(self) -> str:
        return f"{self.bus:02x}:{self.dev:02x}.{self.fn}"


@dataclass(frozen=True)
class BarConflict:
    slot: str
    bar: int
    address: int
    reason: str


def size_bar_registers(function: PciFunction, base: int) -> list[tuple[int, int, bool, bool]]:
    """Size the six BAR registers from config offset `base` (the type-0 header's, or the
    VF BARs of an SR-IOV capability) as firmware does: write all-ones, read the mask
    back, restore. Each memory BAR that decodes gives (index, size, is_64bit,
    prefetchable); unimplemented and IO BARs are skipped (VA-1 has no IO BARs)."""
    out: list[tuple[int, int, bool, bool]] = []
    i = 0
    while i < P.NUM_BARS:
        reg = base + 4 * i
        orig = function.config_read(reg, 4)
        function.config_write(reg, 4, ALL_ONES32)
        lo = function.config_read(reg, 4)
        function.config_write(reg, 4, orig)
        if lo == 0 or lo & P.BASE_ADDRESS_SPACE_IO:
            i += 1
            continue
        is64 = lo & P.BASE_ADDRESS_MEM_TYPE_MASK == P.BASE_ADDRESS_MEM_TYPE_64
        mask = lo & P.BASE_ADDRESS_MEM_MASK
        if is64 and i + 1 < P.NUM_BARS:
            orig_hi = function.config_read(reg + 4, 4)
            function.config_write(reg + 4, 4, ALL_ONES32)
            hi = function.config_read(reg + 4, 4)
            function.config_write(reg + 4, 4, orig_hi)
            mask |= hi << 32
            size = (~mask + 1) & (U64 - 1)
        else:
            size = (~mask + 1) & ALL_ONES32
        if size:  # 0 exactly when the mask is 0
            out.append((i, size, bool(is64), bool(lo & P.BASE_ADDRESS_MEM_PREFETCH)))
        i += 2 if is64 else 1
    return out


def size_bars(function: PciFunction) -> list[SizedBar]:
    """Size each memory BAR as firmware does: write all-ones, read the mask back,
    restore. IO BARs are skipped (VA-1 has none)."""
    return [SizedBar(*bar) for bar in size_bar_registers(function, P.BASE_ADDRESS_0)]


def read_bar_address(function: PciFunction, bar: BarInfo | SizedBar) -> int:
    reg = P.BASE_ADDRESS_0 + 4 * bar.index
    addr = function.config_read(reg, 4) & P.BASE_ADDRESS_MEM_MASK
    if bar.is_64bit:
        addr |= function.config_read(reg + 4, 4) << 32
    return addr


def write_bar_address(function: PciFunction, bar: BarInfo | SizedBar, addr: int) -> None:
    reg = P.BASE_ADDRESS_0 + 4 * bar.index
    function.config_write(reg, 4, addr & ALL_ONES32)
    if bar.is_64bit:
        function.config_write(reg + 4, 4, addr >> 32)


class _Window:
    """A bump allocator for naturally aligned BARs."""

    def __init__(self, base: int, size: int, what: str) -> None:
        self.base, self.size, self.what = base, size, what
        self.cursor = base

    def place(self, size: int) -> int:
        addr = -(-self.cursor // size) * size
        if addr + size > self.base + self.size:
            raise PciError(f"{self.what} [{self.base:#x}, {self.base + self.size:#x}) has no room "
                           f"for a BAR of {size:#x} bytes")
        self.cursor = addr + size
        return addr


class PciHost:
    """One PCI segment of a machine: ECAM at `ecam_base` for buses [0, buses), BARs
    from a 64-bit window and a 32-bit window."""

    def __init__(self, bus: MmioBus, tracer: SourceTracer, name: str = "pci0", *,
                 ecam_base: int = 0xE000_0000, buses: int = 1,
                 mem_base: int = 0x80_0000_0000, mem_size: int = 0x80_0000_0000,
                 mem32_base: int = 0xC000_0000, mem32_size: int = 0x1000_0000) -> None:
        if not 1 <= buses <= 256:
            raise PciError(f"{name}: {buses} buses: 1..256 expected")
        self.bus = bus
        self.trace = tracer
        self.name = name
        self.ecam_base = ecam_base
        self.buses = buses
        self.mem_base, self.mem_size = mem_base, mem_size
        self._win64 = _Window(mem_base, mem_size, f"{name} 64-bit MMIO window")
        self._win32 = _Window(mem32_base, mem32_size, f"{name} 32-bit MMIO window")
        self.slots: dict[tuple[int, int, int], PciSlot] = {}
        self.conflicts: list[BarConflict] = []
        self.bad_accesses = 0
        # (bus, dev, fn) -> called after every config write to that slot (reg, size):
        # how the host's SR-IOV platform follows VF MSE and the VF BAR registers.
        self.config_hooks: dict[tuple[int, int, int], Callable[[int, int], None]] = {}
        bus.add(ecam_base, buses << P.ECAM_BUS_SHIFT, self, name=f"{name}.ecam")

    def info(self) -> PciHostBridge:
        """What the firmware tells the guest (ACPI MCFG)."""
        return PciHostBridge(self.ecam_base, 0, self.buses - 1, self.mem_base, self.mem_size)

    # -- slots --------------------------------------------------------------------------

    def add(self, function: PciFunction, dev: int, fn: int = 0, bus: int = 0,
            name: str = "") -> PciSlot:
        if not (0 <= bus < self.buses and 0 <= dev < 32 and 0 <= fn < 8):
            raise PciError(f"{self.name}: no slot {bus}:{dev}.{fn} (buses 0..{self.buses - 1}, "
                           "dev < 32, fn < 8)")
        key = (bus, dev, fn)
        if key in self.slots:
            raise PciError(f"{self.name}: slot {bus:02x}:{dev:02x}.{fn} is taken by "
                           f"{self.slots[key].name!r}")
        slot = PciSlot(bus, dev, fn, function, name or f"{self.name}.{bus:02x}:{dev:02x}.{fn}")
        self.slots[key] = slot
        self.trace.emit("pci_add", slot=slot.address, name=slot.name)
        return slot

    def remove(self, slot: PciSlot) -> None:
        """Hot-unplug: unmap the slot's BARs and empty it."""
        for index in list(slot.mapped):
            self._unmap(slot, index)
        if self.slots.get((slot.bus, slot.dev, slot.fn)) is slot:
            del self.slots[(slot.bus, slot.dev, slot.fn)]
            self.trace.emit("pci_remove", slot=slot.address)

    def slot_at(self, bus: int, dev: int, fn: int) -> PciSlot | None:
        return self.slots.get((bus, dev, fn))

    def assign_bars(self, slot: PciSlot) -> dict[int, int]:
        """Firmware: size and place every BAR of `slot`, largest first; returns
        {bar index: address}. Memory decoding stays off."""
        f = slot.function
        cmd = f.config_read(P.COMMAND, 2)
        f.config_write(P.COMMAND, 2, cmd & ~P.COMMAND_MEMORY)  # no decoding while sizing
        placed: dict[int, int] = {}
        for bar in sorted(size_bars(f), key=lambda b: (-b.size, b.index)):
            win = self._win64 if bar.is_64bit else self._win32
            addr = win.place(max(bar.size, 4096))
            write_bar_address(f, bar, addr)
            placed[bar.index] = addr
            self.trace.emit("bar_assign", slot=slot.address, bar=bar.index, address=addr,
                            size=bar.size)
        f.config_write(P.COMMAND, 2, cmd & ~P.COMMAND_MEMORY)
        self._update_decoding(slot)
        return placed

    def allocate(self, size: int, is_64bit: bool = True) -> int:
        """Firmware: reserve a naturally aligned range of `size` bytes (a power of two) in
        the 64-bit or 32-bit window, e.g. for the VF BARs of an SR-IOV capability."""
        win = self._win64 if is_64bit else self._win32
        return win.place(max(size, 4096))

    # -- ECAM (an MmioHandler on the VM bus) ----------------------------------------------

    def _decode(self, offset: int, size: int) -> tuple[PciSlot | None, int, bool]:
        bus = offset >> P.ECAM_BUS_SHIFT
        dev = offset >> P.ECAM_DEV_SHIFT & 0x1F
        fn = offset >> P.ECAM_FN_SHIFT & 0x7
        reg = offset & 0xFFF
        ok = size in (1, 2, 4) and reg % size == 0 and bus < self.buses
        return self.slots.get((bus, dev, fn)), reg, ok

    def read(self, offset: int, size: int) -> int:
        slot, reg, ok = self._decode(offset, size)
        if not ok:
            self.bad_accesses += 1
            return (1 << (8 * size)) - 1
        if slot is None:
            return (1 << (8 * size)) - 1
        return slot.function.config_read(reg, size) & ((1 << (8 * size)) - 1)

    def write(self, offset: int, size: int, value: int) -> None:
        slot, reg, ok = self._decode(offset, size)
        if not ok:
            self.bad_accesses += 1
            return
        if slot is None:
            return
        slot.function.config_write(reg, size, value)
        end = reg + size
        if (reg < P.COMMAND + 2 and end > P.COMMAND) or (reg < BAR_REGS_END and end > P.BASE_ADDRESS_0):
            self._update_decoding(slot)
        hook = self.config_hooks.get((slot.bus, slot.dev, slot.fn))
        if hook is not None:
            hook(reg, size)

    # -- BAR decoding ---------------------------------------------------------------------

    def _regions(self, slot: PciSlot, bar: BarInfo) -> Sequence[BarRegion]:
        split = getattr(slot.function, "bar_regions", None)
        if split is not None:
            regions: Sequence[BarRegion] = split(bar.index)
            return regions
        return (BarRegion(0, bar.size, BarWindow(slot.function, bar.index)),)

    def _unmap(self, slot: PciSlot, index: int) -> None:
        addr, bases = slot.mapped.pop(index)
        for b in bases:
            self.bus.remove(b)
        self.trace.emit("bar_unmap", slot=slot.address, bar=index, address=addr)

    def _update_decoding(self, slot: PciSlot) -> None:
        f = slot.function
        enabled = bool(f.config_read(P.COMMAND, 2) & P.COMMAND_MEMORY)
        want: dict[int, tuple[int, BarInfo]] = {}
        if enabled:
            for bar in f.bars():
                addr = read_bar_address(f, bar)
                if addr and addr + bar.size <= U64 and addr % bar.size == 0:
                    want[bar.index] = (addr, bar)
        for index in list(slot.mapped):
            if index not in want or want[index][0] != slot.mapped[index][0]:
                self._unmap(slot, index)
        for index, (addr, bar) in sorted(want.items()):
            if index in slot.mapped:
                continue
            bases: list[int] = []
            try:
                for r in self._regions(slot, bar):
                    kind = "direct" if r.direct else "trap"
                    self.bus.add(addr + r.offset, r.size, r.handler,
                                 name=f"{slot.name}.bar{index}+{r.offset:#x}.{kind}", direct=r.direct)
                    bases.append(addr + r.offset)
            except BusError as e:
                for b in bases:
                    self.bus.remove(b)
                self.conflicts.append(BarConflict(slot.address, index, addr, str(e)))
                self.trace.emit("bar_conflict", slot=slot.address, bar=index, address=addr)
                continue
            slot.mapped[index] = (addr, bases)
            self.trace.emit("bar_map", slot=slot.address, bar=index, address=addr, size=bar.size)
