"""Test doubles for PCI: an ECAM window, fake PCI functions (config space with caps,
BARs with the sizing protocol, MSI-X table, PCIe FLR) and a fake VA-1 over virtio-pci.

Written from the PCI/PCIe specs and virtio 1.x §4.1, not from the driver; only what the
tests need. The virtio side reuses FakeVA1's rings/requests, with a modern virtio-pci
register front end and MSI-X interrupts instead of the mmio line.
"""
from __future__ import annotations

import struct
from typing import Callable

from gd_fakes import FakeKernel, FakeVA1
from guest_driver.kernel import PciHostBridge
from hwspec import pci as P
from hwspec import va1 as A
from hwspec import virtio as V
from hwspec import virtio_pci as VP

ECAM_BASE = 0xE000_0000
MEM_BASE = 0x8000_0000
MEM_SIZE = 0x1000_0000


class FakeEcam:
    """MMIO handler for an ECAM window; empty slots read all-ones."""

    def __init__(self, host: PciHostBridge) -> None:
        self.host = host
        self.functions: dict[tuple[int, int, int], "FakePciFunction"] = {}
        self.log: list[tuple[str, tuple[int, int, int], int, int, int]] = []

    def _split(self, off: int) -> tuple[tuple[int, int, int], int]:
        bus = self.host.bus_start + (off >> P.ECAM_BUS_SHIFT)
        dev = (off >> P.ECAM_DEV_SHIFT) & 31
        fn = (off >> P.ECAM_FN_SHIFT) & 7
        return (bus, dev, fn), off & 0xFFF

    def mmio_read(self, off: int, size: int) -> int:
        bdf, reg = self._split(off)
        f = self.functions.get(bdf)
        v = f.cfg_read(reg, size) if f else (1 << (8 * size)) - 1
        self.log.append(("r", bdf, reg, size, v))
        return v

    def mmio_write(self, off: int, size: int, value: int) -> None:
        bdf, reg = self._split(off)
        self.log.append(("w", bdf, reg, size, value))
        f = self.functions.get(bdf)
        if f:
            f.cfg_write(reg, size, value)


class BarWindow:
    def __init__(self, fn: "FakePciFunction", index: int) -> None:
        self.fn, self.index = fn, index

    def mmio_read(self, off: int, size: int) -> int:
        return self.fn.bar_access(self.index, off, size, None)

    def mmio_write(self, off: int, size: int, value: int) -> None:
        self.fn.bar_access(self.index, off, size, value)


class FakePciFunction:
    """A type-0 function: config bytes with per-byte write masks, BAR registers that
    follow the sizing protocol, a linked capability list, MSI-X, optional FLR."""

    def __init__(self, k: FakeKernel, vendor: int, device: int, class_code: int = 0x120000,
                 header_type: int = 0, revision: int = 1) -> None:
        self.k = k
        self.cfg = bytearray(P.CFG_SPACE_EXP_SIZE)
        self.wmask = bytearray(P.CFG_SPACE_EXP_SIZE)
        struct.pack_into("<HH", self.cfg, 0, vendor, device)
        struct.pack_into("<I", self.cfg, P.REVISION_ID, revision | class_code << 8)
        self.cfg[P.HEADER_TYPE] = header_type
        struct.pack_into("<H", self.wmask, P.COMMAND,
                         P.COMMAND_IO | P.COMMAND_MEMORY | P.COMMAND_MASTER
                         | P.COMMAND_INTX_DISABLE)
        self.bar_regs = [0] * P.NUM_BARS
        self.bar_wmask = [0] * P.NUM_BARS
        self.bar_sizes: dict[int, int] = {}
        self.bar_mem: dict[int, bytearray] = {}
        self.last_cap = 0
        self.next_cap = 0x40
        self.next_ext = 0
        self.violations: list[str] = []
        self.sizing_commands: list[int] = []  # COMMAND seen at each all-ones BAR write
        self.msix_cap = 0
        self.msix_bir = 0
        self.msix_table_off = 0
        self.msix_pba_off = 0
        self.msix_n = 0
        self.msix_pending: set[int] = set()
        self.exp_cap = 0
        self.flr_times: list[int] = []
        self.flr_busy_ns = 0
        self._flr_until = -1
        self.on_flr: Callable[[], None] = lambda: None

    # ---- building ----
    def add_bar(self, index: int, size: int, kind: str = "mem32", prefetch: bool = False
                ) -> None:
        flags = (P.BASE_ADDRESS_SPACE_IO if kind == "io" else
                 (P.BASE_ADDRESS_MEM_TYPE_64 if kind == "mem64" else 0)
                 | (P.BASE_ADDRESS_MEM_PREFETCH if prefetch else 0))
        low_bits = 0x3 if kind == "io" else 0xF
        mask = ~(size - 1) & 0xFFFFFFFFFFFFFFFF
        self.bar_regs[index] = flags
        self.bar_wmask[index] = mask & 0xFFFFFFFF & ~low_bits
        self.bar_sizes[index] = size
        self.bar_mem[index] = bytearray(size)
        if kind == "mem64" and index + 1 < P.NUM_BARS:
            self.bar_wmask[index + 1] = (mask >> 32) & 0xFFFFFFFF

    def bar_address(self, index: int) -> int:
        v = self.bar_regs[index] & ~0xF
        if self.bar_regs[index] & P.BASE_ADDRESS_MEM_TYPE_64:
            v |= self.bar_regs[index + 1] << 32
        return v

    def set_bar_address(self, index: int, addr: int) -> None:
        self.bar_regs[index] = (self.bar_regs[index] & 0xF) | (addr & 0xFFFFFFF0)
        if self.bar_regs[index] & P.BASE_ADDRESS_MEM_TYPE_64 and index + 1 < P.NUM_BARS:
            self.bar_regs[index + 1] = addr >> 32

    def add_cap(self, cap_id: int, body: bytes, writable: dict[int, int] | None = None) -> int:
        off = self.next_cap
        self.cfg[off] = cap_id
        self.cfg[off + 1] = 0
        self.cfg[off + 2:off + 2 + len(body)] = body
        for rel, m in (writable or {}).items():
            self.wmask[off + rel] = m
        if self.last_cap:
            self.cfg[self.last_cap + 1] = off
        else:
            self.cfg[P.CAPABILITY_LIST] = off
            struct.pack_into("<H", self.cfg, P.STATUS, P.STATUS_CAP_LIST)
        self.last_cap = off
        self.next_cap = (off + 2 + len(body) + 3) & ~3
        return off

    def add_ext_cap(self, cap_id: int, body: bytes, version: int = 1) -> int:
        off = self.next_ext or P.EXT_CAP_START
        struct.pack_into("<I", self.cfg, off, P.ext_cap_header(cap_id, version, 0))
        self.cfg[off + 4:off + 4 + len(body)] = body
        if self.next_ext:
            prev = self._last_ext
            hdr = struct.unpack_from("<I", self.cfg, prev)[0]
            struct.pack_into("<I", self.cfg, prev, hdr | (off << 20))
        self._last_ext = off
        self.next_ext = (off + 4 + len(body) + 3) & ~3
        return off

    def add_msix(self, n: int, bir: int, table_off: int = 0, pba_off: int = 0x800) -> int:
        body = struct.pack("<HII", n - 1, table_off | bir, pba_off | bir)
        self.msix_cap = self.add_cap(P.CAP_ID_MSIX, body,
                                     {P.MSIX_FLAGS + 1: (P.MSIX_FLAGS_ENABLE
                                                         | P.MSIX_FLAGS_MASKALL) >> 8})
        self.msix_bir, self.msix_table_off, self.msix_pba_off, self.msix_n = (
            bir, table_off, pba_off, n)
        for i in range(n):  # entries come out of reset masked
            struct.pack_into("<I", self.bar_mem[bir], table_off + 16 * i + 12, 1)
        return self.msix_cap

    def add_exp(self, flr: bool = True) -> int:
        body = bytearray(P.CAP_EXP_ENDPOINT_SIZEOF_V2 - 2)
        struct.pack_into("<H", body, P.EXP_FLAGS - 2, 2)  # version 2, endpoint
        struct.pack_into("<I", body, P.EXP_DEVCAP - 2, P.EXP_DEVCAP_FLR if flr else 0)
        self.exp_cap = self.add_cap(P.CAP_ID_EXP, bytes(body),
                                    {P.EXP_DEVCTL: 0xFF, P.EXP_DEVCTL + 1: 0x7F})
        return self.exp_cap

    # ---- config access ----
    def cfg_read(self, reg: int, size: int) -> int:
        if reg % size:
            self.violations.append(f"cfg/unaligned {reg:#x}/{size}")
        if self.k.sched.now < self._flr_until:
            return (1 << (8 * size)) - 1  # still in reset: not answering
        if P.BASE_ADDRESS_0 <= reg < P.BASE_ADDRESS_0 + 4 * P.NUM_BARS:
            assert size == 4, "BAR access not dword"
            return self.bar_regs[(reg - P.BASE_ADDRESS_0) // 4]
        return int.from_bytes(self.cfg[reg:reg + size], "little")

    def cfg_write(self, reg: int, size: int, value: int) -> None:
        if reg % size:
            self.violations.append(f"cfg/unaligned {reg:#x}/{size}")
        if P.BASE_ADDRESS_0 <= reg < P.BASE_ADDRESS_0 + 4 * P.NUM_BARS:
            i = (reg - P.BASE_ADDRESS_0) // 4
            if value == 0xFFFFFFFF:
                self.sizing_commands.append(self.command)
            self.bar_regs[i] = (self.bar_regs[i] & ~self.bar_wmask[i]) | (value
                                                                          & self.bar_wmask[i])
            return
        old_ctrl = self.msix_ctrl
        for j in range(size):
            b = (value >> (8 * j)) & 0xFF
            m = self.wmask[reg + j]
            self.cfg[reg + j] = (self.cfg[reg + j] & ~m) | (b & m)
        if self.exp_cap and reg == self.exp_cap + P.EXP_DEVCTL:
            if value & P.EXP_DEVCTL_BCR_FLR:
                struct.pack_into("<H", self.cfg, reg, value & ~P.EXP_DEVCTL_BCR_FLR & 0xFFFF)
                self._flr()
        if self.msix_cap and self.msix_ctrl != old_ctrl:
            self._msix_flush()

    @property
    def command(self) -> int:
        return struct.unpack_from("<H", self.cfg, P.COMMAND)[0]

    @property
    def msix_ctrl(self) -> int:
        return struct.unpack_from("<H", self.cfg, self.msix_cap + 2)[0] if self.msix_cap else 0

    def _flr(self) -> None:
        self.flr_times.append(self.k.sched.now)
        self._flr_until = self.k.sched.now + self.flr_busy_ns
        struct.pack_into("<H", self.cfg, P.COMMAND, 0)
        for i in range(P.NUM_BARS):  # addresses cleared, type bits kept
            self.bar_regs[i] = (self.bar_regs[i] & (0x3 if self.bar_regs[i] & 1 else 0xF)
                                if i in self.bar_sizes else 0)
        if self.msix_cap:
            struct.pack_into("<H", self.cfg, self.msix_cap + 2, self.msix_n - 1)
            for i in range(self.msix_n):
                struct.pack_into("<I", self.bar_mem[self.msix_bir],
                                 self.msix_table_off + 16 * i + 12, 1)
        self.on_flr()

    # ---- BAR memory ----
    def bar_access(self, index: int, off: int, size: int, value: int | None) -> int:
        if not self.command & P.COMMAND_MEMORY:
            self.violations.append(f"bar{index}/memory-decoding-off")
            return (1 << (8 * size)) - 1
        if self.msix_cap and index == self.msix_bir and (
                self.msix_table_off <= off < self.msix_table_off + 16 * self.msix_n):
            if size != 4 or off % 4:
                self.violations.append("msix/access-size")
            if value is None:
                return int.from_bytes(self.bar_mem[index][off:off + size], "little")
            self.bar_mem[index][off:off + size] = value.to_bytes(size, "little")
            self._msix_flush()
            return 0
        if self.msix_cap and index == self.msix_bir and off >= self.msix_pba_off:
            if value is None:
                bits = sum(1 << v for v in self.msix_pending)
                return (bits >> (8 * (off - self.msix_pba_off))) & ((1 << (8 * size)) - 1)
            return 0
        return self.bar_io(index, off, size, value)

    def bar_io(self, index: int, off: int, size: int, value: int | None) -> int:
        mem = self.bar_mem[index]
        if value is None:
            return int.from_bytes(mem[off:off + size], "little")
        mem[off:off + size] = value.to_bytes(size, "little")
        return 0

    # ---- MSI-X ----
    def msix_entry(self, i: int) -> tuple[int, int, int]:
        lo, hi, data, ctrl = struct.unpack_from("<IIII", self.bar_mem[self.msix_bir],
                                                self.msix_table_off + 16 * i)
        return lo | hi << 32, data, ctrl

    def msix_fire(self, vector: int) -> bool:
        """Send (or make pending) the message of one entry. False: MSI-X is off."""
        ctrl = self.msix_ctrl
        if not ctrl & P.MSIX_FLAGS_ENABLE or vector >= self.msix_n:
            return False
        addr, data, vctrl = self.msix_entry(vector)
        if ctrl & P.MSIX_FLAGS_MASKALL or vctrl & P.MSIX_ENTRY_CTRL_MASKBIT:
            self.msix_pending.add(vector)
            return True
        if not self.command & P.COMMAND_MASTER:
            self.violations.append("msix/no-bus-master")
            return True
        self.k.msi_write(addr, data)
        return True

    def _msix_flush(self) -> None:
        for v in sorted(self.msix_pending):
            ctrl = self.msix_ctrl
            if not ctrl & P.MSIX_FLAGS_ENABLE or ctrl & P.MSIX_FLAGS_MASKALL:
                return
            if not self.msix_entry(v)[2] & P.MSIX_ENTRY_CTRL_MASKBIT:
                self.msix_pending.discard(v)
                self.msix_fire(v)


# ------------------------------------------------------------------------------------------
COMMON_OFF, ISR_OFF, DEVCFG_OFF, NOTIFY_OFF = 0x0000, 0x1000, 0x2000, 0x3000
VIRTIO_BAR, MSIX_BAR = 4, 1


def virtio_cap(cfg_type: int, bar: int, offset: int, length: int, extra: bytes = b"") -> bytes:
    """Body of a virtio_pci_cap after cap_vndr/cap_next."""
    cap_len = VP.CAP.size + len(extra)
    return struct.pack("<BBBBHII", cap_len, cfg_type, bar, 0, 0, offset, length) + extra


class FakeVA1Pci(FakeVA1):
    """FakeVA1 behind a modern virtio-pci front end (virtio 1.x §4.1)."""

    def __init__(self, kernel: FakeKernel, *, msix_n: int = 8, notify_mult: int = 64,
                 notify_offs: list[int] | None = None, caps: str = "standard",
                 **kw: object) -> None:
        self.qvec: dict[int, int] = {}
        self.msix_config = VP.MSI_NO_VECTOR
        self.cfg_gen = 0
        self.refuse_queue_vectors: set[int] = set()
        self.refuse_all_vectors = False
        self.refuse_config_vector = False
        self.vector_limit: int | None = None  # accept only vectors below this
        self.lost_interrupts: list[str] = []
        self.notifies: list[int] = []
        super().__init__(kernel, **kw)  # type: ignore[arg-type]
        nq = len(self.queues)
        self.notify_mult = notify_mult
        self.notify_offs = notify_offs if notify_offs is not None else [
            (5 * i + 3) % 16 for i in range(nq)]
        self.pci = f = FakePciFunction(kernel, VP.PCI_VENDOR_ID, A.PCI_DEVICE_ID)
        f.bar_io = self._bar_io  # type: ignore[method-assign]
        f.on_flr = lambda: self._write_status(0)
        f.add_bar(MSIX_BAR, 0x1000)
        f.add_bar(VIRTIO_BAR, 0x4000, "mem64", prefetch=True)
        f.add_msix(msix_n, MSIX_BAR)
        if caps == "standard":
            self.add_virtio_caps()
        f.add_exp(flr=True)
        f.add_ext_cap(P.EXT_CAP_ID_SRIOV, bytes(P.EXT_CAP_SRIOV_SIZEOF - 4))
        f.add_ext_cap(0x000B, bytes(12))

    def add_virtio_caps(self, skip: tuple[int, ...] = ()) -> None:
        f = self.pci
        for t, off, ln, extra in (
                (VP.CAP_COMMON_CFG, COMMON_OFF, VP.COMMON_CFG_SIZE, b""),
                (VP.CAP_NOTIFY_CFG, NOTIFY_OFF, 0x1000, struct.pack("<I", self.notify_mult)),
                (VP.CAP_ISR_CFG, ISR_OFF, 4, b""),
                (VP.CAP_DEVICE_CFG, DEVCFG_OFF, 0x100, b""),
                (VP.CAP_PCI_CFG, 0, 0, bytes(4))):
            if t not in skip:
                f.add_cap(P.CAP_ID_VNDR, virtio_cap(t, VIRTIO_BAR, off, ln, extra))

    def _reset_state(self) -> None:
        super()._reset_state()
        self.qvec = {}
        self.msix_config = VP.MSI_NO_VECTOR

    def _signal_queue(self, qi: int) -> None:
        self._fire(self.qvec.get(qi, VP.MSI_NO_VECTOR), f"queue {qi}")

    def _signal_config(self) -> None:
        self.isr |= VP.ISR_CONFIG
        self._fire(self.msix_config, "config")

    def _fire(self, vector: int, what: str) -> None:
        if vector == VP.MSI_NO_VECTOR or not self.pci.msix_fire(vector):
            self.lost_interrupts.append(what)

    def set_config(self, **values: int) -> None:
        self.cfg.update(values)
        self.cfg_gen = (self.cfg_gen + 1) & 0xFF
        self._signal_config()

    # ---- BAR4 ----
    def _bar_io(self, index: int, off: int, size: int, value: int | None) -> int:
        if index != VIRTIO_BAR:
            return 0
        if COMMON_OFF <= off < COMMON_OFF + VP.COMMON_CFG_SIZE:
            return self._common(off - COMMON_OFF, size, value)
        if ISR_OFF <= off < ISR_OFF + 4:
            if value is not None:
                self._violate("isr/write")
                return 0
            v, self.isr = self.isr, 0
            return v
        if DEVCFG_OFF <= off < DEVCFG_OFF + 0x100:
            o = off - DEVCFG_OFF
            if value is not None:
                self._violate("config/write")
                return 0
            if size not in (1, 2, 4) or o % size:
                self._violate(f"devcfg/access-size {o:#x}/{size}")
            cfgb = struct.pack(A.CONFIG.format, *(self.cfg[n] for n in A.CONFIG.names))
            return int.from_bytes(cfgb[o:o + size].ljust(size, b"\0"), "little")
        if NOTIFY_OFF <= off < NOTIFY_OFF + 0x1000:
            if value is None:
                return 0
            rel = off - NOTIFY_OFF
            qs = [q for q in range(len(self.queues)) if self.notify_offs[q] * self.notify_mult
                  == rel]
            if size != 2 or value not in qs:
                self._violate(f"notify/wrong-address-or-value {rel:#x}={value}/{size}")
                return 0
            self.notifies.append(value)
            if not self.queues[value].ready:
                self._violate("queue/not-ready")
                return 0
            gen = self.gen
            self.k.sched.at(self.LATENCY, lambda: gen == self.gen and self._process(value))
            return 0
        return 0

    def _common(self, off: int, size: int, value: int | None) -> int:
        if VP.COMMON_FIELD_SIZE.get(off) != size:
            self._violate(f"common/access-size {off}/{size}")
            return 0
        q = self.queues[self.qsel] if self.qsel < len(self.queues) else None
        if value is None:
            if off == VP.COMMON_DF:
                return (self.offered >> (32 * self.dfsel)) & 0xFFFFFFFF if self.dfsel <= 1 else 0
            if off == VP.COMMON_STATUS:
                return (self.status | 1 if self.stuck_reset else self.status) & 0xFF
            return {
                VP.COMMON_DFSELECT: self.dfsel, VP.COMMON_GFSELECT: self.drvfsel,
                VP.COMMON_GF: self.drvfeat[self.drvfsel] if self.drvfsel <= 1 else 0,
                VP.COMMON_MSIX: self.msix_config, VP.COMMON_NUMQ: len(self.queues),
                VP.COMMON_CFGGENERATION: self.cfg_gen, VP.COMMON_Q_SELECT: self.qsel,
                VP.COMMON_Q_SIZE: (q.num or q.num_max) if q else 0,
                VP.COMMON_Q_MSIX: self.qvec.get(self.qsel, VP.MSI_NO_VECTOR) if q
                else VP.MSI_NO_VECTOR,
                VP.COMMON_Q_ENABLE: q.ready if q else 0,
                VP.COMMON_Q_NOFF: self.notify_offs[self.qsel] if q else 0,
                VP.COMMON_Q_DESCLO: q.desc & 0xFFFFFFFF if q else 0,
                VP.COMMON_Q_DESCHI: q.desc >> 32 if q else 0,
            }.get(off, 0)
        if off == VP.COMMON_STATUS:
            self._write_status(value)
        elif off == VP.COMMON_DFSELECT:
            self.dfsel = value
        elif off == VP.COMMON_GFSELECT:
            self.drvfsel = value
        elif off == VP.COMMON_GF:
            self._write_driver_features(value)
        elif off == VP.COMMON_MSIX:
            ok = (value == VP.MSI_NO_VECTOR or (value < self.pci.msix_n
                                                and not self.refuse_config_vector
                                                and not self.refuse_all_vectors))
            self.msix_config = value if ok else VP.MSI_NO_VECTOR
        elif off == VP.COMMON_Q_SELECT:
            self.qsel = value
        elif off in (VP.COMMON_NUMQ, VP.COMMON_CFGGENERATION, VP.COMMON_Q_NOFF, VP.COMMON_DF):
            self._violate(f"common/read-only {off}")
        elif q is None:
            self._violate("queue/bad-select")
        elif self.status & V.STATUS_DRIVER_OK:
            self._violate("queue/after-driver-ok")
        elif off == VP.COMMON_Q_MSIX:
            ok = (value == VP.MSI_NO_VECTOR or (value < self.pci.msix_n
                                                and self.qsel not in self.refuse_queue_vectors
                                                and not self.refuse_all_vectors
                                                and (self.vector_limit is None
                                                     or value < self.vector_limit)))
            self.qvec[self.qsel] = value if ok else VP.MSI_NO_VECTOR
        elif q.ready:
            self._violate("queue/after-enable")
        elif off == VP.COMMON_Q_SIZE:
            if value == 0 or value > q.num_max or value & (value - 1):
                self._violate("queue/size")
            else:
                q.num = value
        elif off == VP.COMMON_Q_ENABLE:
            if value != 1:
                self._violate("queue/enable-not-1")
            elif q.desc % 16 or q.drv % 2 or q.dev % 4 or not q.num:
                self._violate("queue/alignment")
            else:
                q.ready = 1
        else:
            fields = {VP.COMMON_Q_DESCLO: ("desc", 0), VP.COMMON_Q_DESCHI: ("desc", 1),
                      VP.COMMON_Q_AVAILLO: ("drv", 0), VP.COMMON_Q_AVAILHI: ("drv", 1),
                      VP.COMMON_Q_USEDLO: ("dev", 0), VP.COMMON_Q_USEDHI: ("dev", 1)}
            if off not in fields:
                self._violate(f"common/unlisted-write {off}")
                return 0
            name, hi = fields[off]
            cur = getattr(q, name)
            if hi:
                setattr(q, name, (cur & 0xFFFFFFFF) | value << 32)
            else:
                setattr(q, name, (cur & ~0xFFFFFFFF) | value)
        return 0


# ------------------------------------------------------------------------------------------
class PciMachine:
    """A FakeKernel with one (or more) PCI host bridges and a firmware that assigns BARs."""

    def __init__(self, k: FakeKernel | None = None, bus_start: int = 0, bus_end: int = 0,
                 ecam_base: int = ECAM_BASE, mem_base: int = MEM_BASE) -> None:
        self.k = k or FakeKernel()
        self.host = PciHostBridge(ecam_base, bus_start, bus_end, mem_base, MEM_SIZE)
        self.ecam = FakeEcam(self.host)
        self.k.mmio.add(ecam_base + (bus_start << P.ECAM_BUS_SHIFT),
                        (bus_end - bus_start + 1) << P.ECAM_BUS_SHIFT, self.ecam)
        self.k.pci_hosts = self.k.pci_hosts + (self.host,)
        self._next_mem = mem_base

    def add(self, fn: FakePciFunction, bus: int, dev: int, f: int = 0,
            assign: bool = True) -> FakePciFunction:
        self.ecam.functions[(bus, dev, f)] = fn
        if assign:
            for i, size in sorted(fn.bar_sizes.items()):
                if fn.bar_regs[i] & P.BASE_ADDRESS_SPACE_IO:
                    fn.bar_regs[i] |= 0xC000 + 0x100 * i
                    continue
                addr = (self._next_mem + size - 1) & ~(size - 1)
                self._next_mem = addr + size
                fn.set_bar_address(i, addr)
                self.k.mmio.add(addr, size, BarWindow(fn, i))
        return fn

    def add_va1(self, dev: int, bus: int = 0, fn: int = 0, **kw: object) -> FakeVA1Pci:
        d = FakeVA1Pci(self.k, **kw)
        self.add(d.pci, bus, dev, fn)
        return d


def make_pci_machine(n: int = 1, **kw: object) -> tuple[FakeKernel, list[FakeVA1Pci],
                                                         PciMachine]:
    m = PciMachine()
    devs = [m.add_va1(3 + i, **kw) for i in range(n)]
    return m.k, devs, m
