"""PCI bus scan, BAR sizing, capability walks, enable and function-level reset.

Written from the PCI Local Bus 3.0 and PCIe base specs, behaving as Linux does
(drivers/pci/probe.c, pci.c). The firmware (VMM) already assigned BAR addresses; the
guest keeps them. Every loop over device-provided data is bounded, so a malformed
function costs a probe error, never a hang.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from hwspec import pci as P

from ..kernel import GuestKernel, PciHostBridge
from .config import Bdf, ConfigSpace, PciError

MAX_CAPS = 48                 # Linux PCI_FIND_CAP_TTL
MAX_EXT_CAPS = (P.CFG_SPACE_EXP_SIZE - P.CFG_SPACE_SIZE) // 8
CAP_MIN_OFFSET = 0x40         # capabilities live after the type-0 header
DEVICES_PER_BUS = 32
FUNCTIONS_PER_DEVICE = 8
FLR_WAIT_NS = 100_000_000     # PCIe base spec §6.6.2: 100 ms before the first request
FLR_READY_POLL_NS = 1_000_000
FLR_READY_TIMEOUT_NS = 1_000_000_000
_HEADER_LAYOUT_MASK = 0x7F


@dataclass(frozen=True)
class Bar:
    """One implemented BAR (a 64-bit BAR occupies index and index+1)."""
    index: int
    address: int      # assigned by the firmware; 0 = not assigned
    size: int
    is_io: bool = False
    is_64bit: bool = False
    prefetchable: bool = False


@dataclass(frozen=True)
class Capability:
    id: int
    offset: int


@dataclass
class PciFunction:
    """One function found by the scan, with its parsed config space."""
    bdf: Bdf
    cfg: ConfigSpace
    vendor_id: int
    device_id: int
    revision: int
    class_code: int   # base class << 16 | subclass << 8 | prog-if
    header_type: int
    bars: dict[int, Bar] = field(default_factory=dict)
    caps: list[Capability] = field(default_factory=list)
    ext_caps: list[Capability] = field(default_factory=list)

    def find_cap(self, cap_id: int) -> int | None:
        """Config offset of the first capability with this id."""
        return next((c.offset for c in self.caps if c.id == cap_id), None)

    def find_caps(self, cap_id: int) -> list[int]:
        return [c.offset for c in self.caps if c.id == cap_id]

    def find_ext_cap(self, cap_id: int) -> int | None:
        return next((c.offset for c in self.ext_caps if c.id == cap_id), None)

    def bar(self, index: int) -> Bar:
        """A usable memory BAR (implemented and assigned) or PciError."""
        bar = self.bars.get(index)
        if bar is None:
            raise PciError(f"{self.bdf}: BAR{index} is not implemented")
        if bar.is_io:
            raise PciError(f"{self.bdf}: BAR{index} is an I/O BAR, a memory BAR is needed")
        if bar.address == 0:
            raise PciError(f"{self.bdf}: BAR{index} was not assigned an address")
        return bar

    def __str__(self) -> str:
        return f"{self.bdf} [{self.vendor_id:04x}:{self.device_id:04x}]"


@dataclass
class ScanResult:
    functions: list[PciFunction] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)  # one line per function skipped


def scan_host(kernel: GuestKernel, host: PciHostBridge, segment: int = 0) -> ScanResult:
    """Enumerate bus_start..bus_end, devices 0..31, functions 0..7 (fn > 0 only behind a
    multi-function fn 0). Malformed functions are skipped with an error line."""
    result = ScanResult()
    if not 0 <= host.bus_start <= host.bus_end <= 0xFF:
        result.errors.append(f"pci host bridge @{host.ecam_base:#x}: bad bus range "
                             f"{host.bus_start}..{host.bus_end}")
        return result
    for bus in range(host.bus_start, host.bus_end + 1):
        for dev in range(DEVICES_PER_BUS):
            for fn in range(FUNCTIONS_PER_DEVICE):
                bdf = Bdf(segment, bus, dev, fn)
                cfg = ConfigSpace(kernel.mmio, host.ecam_base, bdf)
                vendor = cfg.read16(P.VENDOR_ID)
                if vendor in (0xFFFF, 0x0000):
                    if fn == 0:
                        break  # no function 0: no device in this slot
                    continue
                header = cfg.read8(P.HEADER_TYPE)
                try:
                    result.functions.append(read_function(cfg, host))
                except PciError as e:
                    result.errors.append(f"pci {bdf}: {e}")
                if fn == 0 and not header & P.HEADER_TYPE_MULTI_FUNCTION:
                    break
    return result


def read_function(cfg: ConfigSpace, host: PciHostBridge | None = None) -> PciFunction:
    """Identity, BARs and capability lists of one present function."""
    ident = cfg.read32(P.VENDOR_ID)
    cls = cfg.read32(P.REVISION_ID)
    header = cfg.read8(P.HEADER_TYPE)
    fn = PciFunction(cfg.bdf, cfg, ident & 0xFFFF, ident >> 16, cls & 0xFF, cls >> 8,
                     header)
    if header & _HEADER_LAYOUT_MASK != P.HEADER_TYPE_NORMAL:
        return fn  # bridges: identity only; their secondary buses are in the scanned range
    fn.bars = size_bars(cfg, host)
    fn.caps = walk_caps(cfg)
    if any(c.id == P.CAP_ID_EXP for c in fn.caps):
        fn.ext_caps = walk_ext_caps(cfg)
    return fn


def size_bars(cfg: ConfigSpace, host: PciHostBridge | None = None) -> dict[int, Bar]:
    """Size every BAR: save, write all-ones, read the mask, restore. Decoding is off in
    COMMAND meanwhile (as Linux does), so the all-ones address never decodes."""
    cmd = cfg.read16(P.COMMAND)
    decode = P.COMMAND_MEMORY | P.COMMAND_IO
    if cmd & decode:
        cfg.write16(P.COMMAND, cmd & ~decode)
    try:
        return _size_bars(cfg, host)
    finally:
        if cmd & decode:
            cfg.write16(P.COMMAND, cmd)


def _probe_reg(cfg: ConfigSpace, reg: int) -> tuple[int, int]:
    orig = cfg.read32(reg)
    cfg.write32(reg, 0xFFFFFFFF)
    mask = cfg.read32(reg)
    cfg.write32(reg, orig)
    return orig, mask


def _size_bars(cfg: ConfigSpace, host: PciHostBridge | None) -> dict[int, Bar]:
    bars: dict[int, Bar] = {}
    i = 0
    while i < P.NUM_BARS:
        reg = P.BASE_ADDRESS_0 + 4 * i
        orig, mask = _probe_reg(cfg, reg)
        index = i
        i += 1
        if mask == 0 and orig == 0:
            continue  # not implemented
        if orig & P.BASE_ADDRESS_SPACE_IO:
            io_mask = mask & ~0x3 & 0xFFFFFFFF
            if io_mask and not io_mask & 0xFFFF0000:
                io_mask |= 0xFFFF0000  # 16-bit I/O decoder
            size = io_mask & -io_mask
            if size == 0:
                raise PciError(f"BAR{index} (I/O) reports size 0 (mask {mask:#010x})")
            bars[index] = Bar(index, orig & ~0x3 & 0xFFFFFFFF, size, is_io=True)
            continue
        mem_type = orig & P.BASE_ADDRESS_MEM_TYPE_MASK
        prefetch = bool(orig & P.BASE_ADDRESS_MEM_PREFETCH)
        addr = orig & P.BASE_ADDRESS_MEM_MASK
        full_mask = mask & P.BASE_ADDRESS_MEM_MASK
        width = 32
        if mem_type == P.BASE_ADDRESS_MEM_TYPE_64:
            if index + 1 >= P.NUM_BARS:
                raise PciError(f"BAR{index} is 64-bit but has no upper register")
            hi_orig, hi_mask = _probe_reg(cfg, reg + 4)
            i += 1
            addr |= hi_orig << 32
            full_mask |= hi_mask << 32
            width = 64
        elif mem_type != P.BASE_ADDRESS_MEM_TYPE_32:
            raise PciError(f"BAR{index} has reserved memory type {mem_type >> 1} "
                           f"(value {orig:#010x})")
        size = full_mask & -full_mask
        if size == 0:
            raise PciError(f"BAR{index} reports size 0 (value {orig:#010x}, "
                           f"mask {mask:#010x})")
        all_ones = (1 << width) - 1
        if full_mask | (size - 1) != all_ones:
            raise PciError(f"BAR{index} sizing mask {full_mask:#x} is not contiguous")
        if addr & (size - 1):
            raise PciError(f"BAR{index} address {addr:#x} is not aligned to its size "
                           f"{size:#x}")
        if addr and host is not None and not (
                host.mem_base <= addr and addr + size <= host.mem_base + host.mem_size):
            raise PciError(f"BAR{index} [{addr:#x}, +{size:#x}) is outside the host "
                           f"bridge memory window [{host.mem_base:#x}, +{host.mem_size:#x})")
        bars[index] = Bar(index, addr, size, is_64bit=width == 64, prefetchable=prefetch)
    return bars


def walk_caps(cfg: ConfigSpace) -> list[Capability]:
    """The capability list: at most MAX_CAPS entries, each pointer dword-aligned and at
    or above 0x40; a revisited entry is a loop."""
    if not cfg.read16(P.STATUS) & P.STATUS_CAP_LIST:
        return []
    caps: list[Capability] = []
    seen: set[int] = set()
    ptr = cfg.read8(P.CAPABILITY_LIST)
    where = "capabilities pointer"
    while ptr:
        if ptr & 3 or ptr < CAP_MIN_OFFSET:
            raise PciError(f"{where} {ptr:#04x} is not a dword-aligned offset >= "
                           f"{CAP_MIN_OFFSET:#x}: malformed capability list")
        if ptr in seen:
            raise PciError(f"capability list loops back to {ptr:#04x} after "
                           f"{len(caps)} entries")
        if len(caps) >= MAX_CAPS:
            raise PciError(f"capability list has more than {MAX_CAPS} entries")
        seen.add(ptr)
        cap_id = cfg.read8(ptr + P.CAP_LIST_ID)
        if cap_id == 0xFF:
            raise PciError(f"capability at {ptr:#04x} reads all-ones")
        caps.append(Capability(cap_id, ptr))
        where = f"next pointer of capability {cap_id:#04x} at {ptr:#04x}:"
        ptr = cfg.read8(ptr + P.CAP_LIST_NEXT)
    return caps


def walk_ext_caps(cfg: ConfigSpace) -> list[Capability]:
    """The extended capability list from 0x100 (PCIe functions only), loop-safe."""
    caps: list[Capability] = []
    seen: set[int] = set()
    pos = P.EXT_CAP_START
    while True:
        header = cfg.read32(pos)
        if header in (0, 0xFFFFFFFF):
            if pos == P.EXT_CAP_START:
                return caps  # no extended capabilities (or no extended config space)
            raise PciError(f"extended capability at {pos:#05x} reads {header:#010x}")
        if pos in seen:
            raise PciError(f"extended capability list loops back to {pos:#05x}")
        if len(caps) >= MAX_EXT_CAPS:
            raise PciError(f"extended capability list has more than {MAX_EXT_CAPS} entries")
        seen.add(pos)
        caps.append(Capability(header & 0xFFFF, pos))
        nxt = header >> 20
        if nxt == 0:
            return caps
        if nxt & 3 or nxt < P.EXT_CAP_START:
            raise PciError(f"extended capability {header & 0xFFFF:#06x} at {pos:#05x}: next "
                           f"pointer {nxt:#05x} is not a dword-aligned offset >= "
                           f"{P.EXT_CAP_START:#x}")
        pos = nxt


def enable_device(fn: PciFunction) -> None:
    """Memory decoding and bus mastering on (pci_enable_device + pci_set_master)."""
    cmd = fn.cfg.read16(P.COMMAND)
    want = cmd | P.COMMAND_MEMORY | P.COMMAND_MASTER
    if want != cmd:
        fn.cfg.write16(P.COMMAND, want)


def disable_device(fn: PciFunction) -> None:
    cmd = fn.cfg.read16(P.COMMAND)
    fn.cfg.write16(P.COMMAND, cmd & ~(P.COMMAND_MEMORY | P.COMMAND_MASTER))


def function_level_reset(kernel: GuestKernel, fn: PciFunction) -> None:
    """FLR through the PCIe capability (pcie_flr): set DEVCTL.BCR_FLR, wait 100 ms of
    virtual time, wait until the function answers again, restore COMMAND and BARs
    (FLR clears them). MSI-X state must be restored by its owner. Sleeps: task context."""
    cfg = fn.cfg
    exp = fn.find_cap(P.CAP_ID_EXP)
    if exp is None:
        raise PciError(f"{fn.bdf}: no PCI Express capability, so no FLR")
    if not cfg.read32(exp + P.EXP_DEVCAP) & P.EXP_DEVCAP_FLR:
        raise PciError(f"{fn.bdf}: function does not support FLR (DEVCAP.FLR clear)")
    saved_cmd = cfg.read16(P.COMMAND)
    saved_bars = [cfg.read32(P.BASE_ADDRESS_0 + 4 * i) for i in range(P.NUM_BARS)]
    devctl = cfg.read16(exp + P.EXP_DEVCTL)
    cfg.write16(exp + P.EXP_DEVCTL, devctl | P.EXP_DEVCTL_BCR_FLR)
    kernel.sched.sleep(FLR_WAIT_NS)
    waited = 0
    while cfg.read16(P.VENDOR_ID) == 0xFFFF:
        if waited >= FLR_READY_TIMEOUT_NS:
            raise PciError(f"{fn.bdf}: not responding {FLR_READY_TIMEOUT_NS // 1_000_000} ms "
                           "after FLR")
        kernel.sched.sleep(FLR_READY_POLL_NS)
        waited += FLR_READY_POLL_NS
    for i, value in enumerate(saved_bars):
        cfg.write32(P.BASE_ADDRESS_0 + 4 * i, value)
    cfg.write16(P.COMMAND, saved_cmd)
