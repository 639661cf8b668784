"""Test doubles for SR-IOV: a fake VA-1 PF (SR-IOV extended capability, admin virtqueue
with the virtio 1.3 admin command format and the VA-1 admin commands) and context
address spaces (CONTEXT_MAP / CONTEXT_UNMAP) on the fake device.

Written from the virtio 1.3 admin-queue chapter, the PCIe SR-IOV capability and
hwspec (va1, virtio_admin, pci), not from the driver; only what the tests need.
"""
from __future__ import annotations

import struct
from dataclasses import dataclass, field

from gd_fakes import OFFERED, FakeKernel, FakeVA1
from gd_pci_fakes import COMMON_OFF, FakeVA1Pci, PciMachine, virtio_cap, VIRTIO_BAR
from hwspec import pci as P
from hwspec import va1 as A
from hwspec import virtio as V
from hwspec import virtio_admin as VA
from hwspec import virtio_pci as VP

CTX_FLAT = A.CTX_CREATE_FLAT
PF_OFFERED = OFFERED | (1 << V.F_SR_IOV) | (1 << V.F_ADMIN_VQ)
VF_BAR0_SIZE = A.PCI_BAR_SIZE
SUPPORTED_OPS = {VA.CMD_LIST_QUERY, VA.CMD_LIST_USE} | {int(o) for o in A.AdminOp}
LIST_WORDS = max(SUPPORTED_OPS) // 64 + 1


# ---------------------------------------------------------------- context address spaces
class CtxAsMixin:
    """CONTEXT_MAP / CONTEXT_UNMAP (controlq) on a fake VA-1: per context, va -> (pa,
    size, flags). `ctx_as=False` is an older device: unknown type BAD_ARG, flags must
    be 0."""

    ctx_as: bool
    max_mappings: int
    maps: dict[int, dict[int, tuple[int, int, int]]]
    flat: set[int]
    map_log: list[tuple[str, int, int, int]]
    map_fail: dict[str, int]     # "MAP"/"UNMAP" -> status to answer once

    def ctrl_extra(self, typ: int, cid: int, flags: int, res: int, req: bytes
                   ) -> bytes | None:
        dev: FakeVA1 = self  # type: ignore[assignment]
        if typ == A.CtrlType.CONTEXT_CREATE:
            if flags & ~CTX_FLAT or (flags and not self.ctx_as):
                return struct.pack("<II", A.Status.BAD_REQUEST, 0)
            if len(dev.contexts) >= dev.cfg["max_contexts"]:
                return struct.pack("<II", A.Status.NO_RESOURCES, 0)
            nid = next(i for i in range(1, 1 << 20) if i not in dev.contexts)
            dev.contexts[nid] = False
            self.maps[nid] = {}
            if flags & CTX_FLAT or not self.ctx_as:
                self.flat.add(nid)
            return struct.pack("<II", A.Status.OK, nid)
        if typ == A.CtrlType.CONTEXT_DESTROY:
            self.maps.pop(cid, None)
            self.flat.discard(cid)
            return None
        if typ not in (A.CtrlType.CONTEXT_MAP, A.CtrlType.CONTEXT_UNMAP) or not self.ctx_as:
            return None
        if len(req) < A.CTX_MAP_REQ.size:
            return struct.pack("<II", A.Status.BAD_REQUEST, cid)
        _, _, _, _, va, pa, size = struct.unpack(A.CTX_MAP_REQ.format,
                                                 req[:A.CTX_MAP_REQ.size])
        kind = "MAP" if typ == A.CtrlType.CONTEXT_MAP else "UNMAP"
        self.map_log.append((kind, cid, va, size))
        if kind in self.map_fail:
            return struct.pack("<II", self.map_fail.pop(kind), cid)
        if res:
            return struct.pack("<II", A.Status.BAD_REQUEST, cid)
        if cid not in dev.contexts:
            return struct.pack("<II", A.Status.BAD_CONTEXT, cid)
        table = self.maps.setdefault(cid, {})
        if kind == "MAP":
            ok_flags = flags and not flags & ~(A.CTX_MAP_READ | A.CTX_MAP_WRITE)
            aligned = not (va % A.CTX_PAGE or pa % A.CTX_PAGE or size % A.CTX_PAGE)
            if not ok_flags or not aligned or size == 0:
                return struct.pack("<II", A.Status.BAD_ARG, cid)
            if pa + size > dev.cfg["device_memory_size"]:
                return struct.pack("<II", A.Status.OUT_OF_BOUNDS, cid)
            if any(v < va + size and va < v + s for v, (_, s, _) in table.items()):
                return struct.pack("<II", A.Status.BAD_ARG, cid)
            if len(table) >= self.max_mappings:
                return struct.pack("<II", A.Status.NO_RESOURCES, cid)
            table[va] = (pa, size, flags)
        else:
            if flags or table.get(va, (0, -1, 0))[1] != size:
                return struct.pack("<II", A.Status.BAD_ARG, cid)
            del table[va]
        return struct.pack("<II", A.Status.OK, cid)

    def reaches(self, cid: int, addr: int, size: int = 1) -> bool:
        """Whether context cid may touch [addr, addr+size) of device memory."""
        if cid in self.flat:
            return True
        return any(va <= addr and addr + size <= va + s
                   for va, (pa, s, _) in self.maps.get(cid, {}).items())


def _install_ctx_as(dev: FakeVA1, ctx_as: bool, max_mappings: int) -> None:
    d = dev  # type: ignore[assignment]
    d.ctx_as = ctx_as
    d.max_mappings = max_mappings
    d.maps = {}
    d.flat = set()
    d.map_log = []
    d.map_fail = {}


class FakeVA1As(CtxAsMixin, FakeVA1):
    """FakeVA1 (virtio-mmio) with context address spaces."""

    def __init__(self, kernel: FakeKernel, *, ctx_as: bool = True, max_mappings: int = 64,
                 **kw: object) -> None:
        _install_ctx_as(self, ctx_as, max_mappings)
        super().__init__(kernel, **kw)  # type: ignore[arg-type]

    def _reset_state(self) -> None:
        super()._reset_state()
        self.maps, self.flat = {}, set()

    def _control(self, head, rd, wr) -> None:  # type: ignore[no-untyped-def]
        _control_with_extra(self, head, rd, wr)


def _control_with_extra(dev, head, rd, wr) -> None:  # type: ignore[no-untyped-def]
    req = dev._gather(rd)
    if len(req) >= A.CTRL_REQ.size:
        typ, cid, flags, res = struct.unpack(A.CTRL_REQ.format, req[:16])
        resp = dev.ctrl_extra(typ, cid, flags, res, req)
        if resp is not None:
            gen = dev.gen
            dev.k.sched.at(dev.cfg["cmd_overhead_ns"],
                           lambda: gen == dev.gen and dev._used(A.CONTROLQ, head,
                                                                dev._scatter(wr, resp)))
            return
    FakeVA1._control(dev, head, rd, wr)


def make_as_machine(ctx_as: bool = True, **kw: object) -> tuple[FakeKernel, FakeVA1As]:
    k = FakeKernel()
    d = FakeVA1As(k, ctx_as=ctx_as, **kw)
    k.attach(d, 0x1000_0000, 5)
    return k, d


# ---------------------------------------------------------------- the PF
@dataclass
class VfState:
    resources: bytes = bytes(A.VF_RESOURCES.size)
    stopped: bool = False
    live: bool = False
    resets: int = 0
    stats: tuple[int, ...] = (0,) * len(A.VF_STATS.names)


@dataclass
class SriovRegs:
    total: int = A.DEFAULT_TOTAL_VFS
    initial: int = A.DEFAULT_TOTAL_VFS
    ctrl: int = 0
    num_vf: int = 0
    offset: int = A.SRIOV_FIRST_VF_OFFSET
    stride: int = A.SRIOV_VF_STRIDE
    vf_did: int = A.SRIOV_VF_DEVICE_ID
    sup_pgsize: int = 0x553
    sys_pgsize: int = 0
    bar: list[int] = field(default_factory=lambda: [0] * 6)
    bar_mask: list[int] = field(default_factory=lambda: [0] * 6)


class FakeVA1Pf(CtxAsMixin, FakeVA1Pci):
    """A VA-1 PF: FakeVA1Pci + SR-IOV capability registers + the admin virtqueue."""

    def __init__(self, kernel: FakeKernel, *, total_vfs: int = A.DEFAULT_TOTAL_VFS,
                 admin_num_max: int = 64, offered: int = PF_OFFERED,
                 pool_memory: int = 1 << 30, pool_queues: int = 64, pool_contexts: int = 512,
                 ctx_as: bool = True, admin_in_common: bool = True, **kw: object) -> None:
        _install_ctx_as(self, ctx_as, 64)
        self.admin_num_max = admin_num_max
        self.admin_in_common = admin_in_common
        self.pool = dict(device_memory=pool_memory, num_submit_queues=pool_queues,
                         max_contexts=pool_contexts)
        self.vfs: dict[int, VfState] = {}
        self.admin_log: list[tuple[int, int, int, bytes]] = []  # opcode, group, member, data
        self.admin_hold = False
        self.admin_force: tuple[int, int] | None = None
        self.admin_in_use: set[int] | None = None
        self.sriov = SriovRegs(total=total_vfs, initial=total_vfs)
        self.sriov_log: list[tuple[int, int, int, int]] = []  # (time, reg, size, value)
        self.sriov_violations: list[str] = []
        super().__init__(kernel, offered=offered, caps="none", **kw)
        self.admin_index = 2 + self.nsq
        self.common_size = VA.COMMON_CFG_SIZE_WITH_ADMIN if admin_in_common else \
            VP.COMMON_CFG_SIZE
        self._add_caps()
        s = self.sriov
        s.bar[0] = P.BASE_ADDRESS_MEM_TYPE_64
        s.bar_mask[0] = ~(VF_BAR0_SIZE - 1) & 0xFFFFFFF0
        s.bar_mask[1] = 0xFFFFFFFF
        self._orig_cfg_read, self._orig_cfg_write = self.pci.cfg_read, self.pci.cfg_write
        self.pci.cfg_read = self._cfg_read  # type: ignore[method-assign]
        self.pci.cfg_write = self._cfg_write  # type: ignore[method-assign]

    def _add_caps(self) -> None:
        f = self.pci
        for t, off, ln, extra in (
                (VP.CAP_COMMON_CFG, COMMON_OFF, self.common_size, b""),
                (VP.CAP_NOTIFY_CFG, 0x3000, 0x1000, struct.pack("<I", self.notify_mult)),
                (VP.CAP_ISR_CFG, 0x1000, 4, b""),
                (VP.CAP_DEVICE_CFG, 0x2000, 0x100, b""),
                (VP.CAP_PCI_CFG, 0, 0, bytes(4))):
            f.add_cap(P.CAP_ID_VNDR, virtio_cap(t, VIRTIO_BAR, off, ln, extra))

    def assign_vf_bar(self, base: int) -> None:
        """What the firmware does: place VF BAR0 (NumVFs x VF_BAR0_SIZE)."""
        self.sriov.bar[0] = P.BASE_ADDRESS_MEM_TYPE_64 | (base & 0xFFFFFFF0)
        self.sriov.bar[1] = base >> 32

    # ---- state ----
    def _reset_state(self) -> None:
        super()._reset_state()
        self.queues.append(type(self.queues[0])(self.admin_num_max))
        self.maps, self.flat = {}, set()
        self.admin_in_use = None

    @property
    def num_queues_visible(self) -> int:
        return len(self.queues) - 1

    # ---- SR-IOV capability ----
    def _cfg_read(self, reg: int, size: int) -> int:
        pos = P.EXT_CAP_START
        if pos + 4 <= reg < pos + P.EXT_CAP_SRIOV_SIZEOF:
            return self._sriov_read(reg - pos, size)
        return self._orig_cfg_read(reg, size)

    def _cfg_write(self, reg: int, size: int, value: int) -> None:
        pos = P.EXT_CAP_START
        if pos + 4 <= reg < pos + P.EXT_CAP_SRIOV_SIZEOF:
            self.sriov_log.append((self.k.sched.now, reg - pos, size, value))
            self._sriov_write(reg - pos, size, value)
            return
        self._orig_cfg_write(reg, size, value)

    def _sriov_bytes(self) -> bytearray:
        s = self.sriov
        b = bytearray(P.EXT_CAP_SRIOV_SIZEOF)
        struct.pack_into("<HHHHHBx", b, P.SRIOV_CTRL, s.ctrl, 0, s.initial, s.total, s.num_vf,
                         0)
        struct.pack_into("<HH", b, P.SRIOV_VF_OFFSET, s.offset, s.stride)
        struct.pack_into("<H", b, P.SRIOV_VF_DID, s.vf_did)
        struct.pack_into("<II", b, P.SRIOV_SUP_PGSIZE, s.sup_pgsize, s.sys_pgsize)
        struct.pack_into("<6I", b, P.SRIOV_BAR, *s.bar)
        return b

    def _sriov_read(self, rel: int, size: int) -> int:
        return int.from_bytes(self._sriov_bytes()[rel:rel + size], "little")

    def _sriov_write(self, rel: int, size: int, value: int) -> None:
        s = self.sriov
        if rel == P.SRIOV_CTRL and size == 2:
            new = value & (P.SRIOV_CTRL_VFE | P.SRIOV_CTRL_MSE | P.SRIOV_CTRL_ARI)
            if new & P.SRIOV_CTRL_VFE and not s.ctrl & P.SRIOV_CTRL_VFE:
                if not s.num_vf:
                    self.sriov_violations.append("sriov/enable-with-zero-numvfs")
                self.vfs = {n: self.vfs.get(n, VfState()) for n in range(1, s.num_vf + 1)}
            if not new & P.SRIOV_CTRL_VFE and s.ctrl & P.SRIOV_CTRL_VFE:
                self.vfs = {}
            s.ctrl = new
        elif rel == P.SRIOV_NUM_VF and size == 2:
            if s.ctrl & P.SRIOV_CTRL_VFE:
                self.sriov_violations.append("sriov/numvfs-while-enabled")
            elif value > s.total:
                self.sriov_violations.append("sriov/numvfs-above-total")
            else:
                s.num_vf = value
        elif rel == P.SRIOV_SYS_PGSIZE and size == 4:
            s.sys_pgsize = value
        elif P.SRIOV_BAR <= rel < P.SRIOV_BAR + 24 and size == 4:
            i = (rel - P.SRIOV_BAR) // 4
            if s.ctrl & P.SRIOV_CTRL_MSE:
                self.sriov_violations.append("sriov/bar-write-with-mse")
            s.bar[i] = (s.bar[i] & ~s.bar_mask[i]) | (value & s.bar_mask[i])
        else:
            self.sriov_violations.append(f"sriov/write-read-only {rel:#x}/{size}")

    # ---- common config (admin fields, num_queues without the admin queue) ----
    def _bar_io(self, index: int, off: int, size: int, value: int | None) -> int:
        if index == VIRTIO_BAR and VP.COMMON_CFG_SIZE <= off < self.common_size:
            if value is not None:
                self._violate(f"common/read-only {off}")
                return 0
            if size != 2:
                self._violate(f"common/access-size {off}/{size}")
                return 0
            if off == VA.COMMON_ADM_Q_IDX:
                return self.admin_index
            return 1 if off == VA.COMMON_ADM_Q_NUM else 0
        return super()._bar_io(index, off, size, value)

    def _common(self, off: int, size: int, value: int | None) -> int:
        if off == VP.COMMON_NUMQ and value is None and size == 2:
            return self.num_queues_visible
        if self.qsel == getattr(self, "admin_index", -1) and not (
                self.features >> V.F_ADMIN_VQ & 1) and off in (
                    VP.COMMON_Q_SIZE, VP.COMMON_Q_ENABLE):
            self._violate("admin/not-negotiated")
            return 0
        return super()._common(off, size, value)

    # ---- admin queue ----
    def _process(self, qi: int) -> None:
        if qi != self.admin_index:
            super()._process(qi)
            return
        for chain in self._avail_chains(qi):
            if chain is None:
                return
            head, rd, wr = chain
            if self.admin_hold:
                continue
            status, qual, result = self._admin(self._gather(rd))
            out = struct.pack(VA.CMD_STATUS.format, status, qual, bytes(4)) + result
            gen = self.gen

            def done(head: int = head, wr: list = wr, out: bytes = out) -> None:
                if gen == self.gen:
                    self._used(qi, head, self._scatter(wr, out))
            self.k.sched.at(self.cfg["cmd_overhead_ns"], done)

    def _admin(self, req: bytes) -> tuple[int, int, bytes]:
        if len(req) < VA.CMD_HDR.size:
            return VA.STATUS_EINVAL, VA.STATUS_Q_INVALID_COMMAND, b""
        op, group, _, member = struct.unpack(VA.CMD_HDR.format, req[:VA.CMD_HDR.size])
        data = req[VA.CMD_HDR.size:]
        self.admin_log.append((op, group, member, data))
        if self.admin_force is not None:
            st, q = self.admin_force
            self.admin_force = None
            return st, q, b""
        if group != VA.GROUP_TYPE_SRIOV:
            return VA.STATUS_EINVAL, VA.STATUS_Q_INVALID_GROUP, b""
        if op == VA.CMD_LIST_QUERY:
            return VA.STATUS_OK, 0, sum(1 << o for o in SUPPORTED_OPS).to_bytes(
                8 * LIST_WORDS, "little")
        if op == VA.CMD_LIST_USE:
            used = {i for i in range(8 * len(data)) if int.from_bytes(data, "little") >> i & 1}
            if used - SUPPORTED_OPS or not {VA.CMD_LIST_QUERY, VA.CMD_LIST_USE} <= used:
                return VA.STATUS_EINVAL, VA.STATUS_Q_INVALID_FIELD, b""
            self.admin_in_use = used
            return VA.STATUS_OK, 0, b""
        if op not in SUPPORTED_OPS or (self.admin_in_use is not None
                                       and op not in self.admin_in_use):
            return VA.STATUS_EINVAL, VA.STATUS_Q_INVALID_OPCODE, b""
        vf = self.vfs.get(member)
        if vf is None:
            return VA.STATUS_EINVAL, VA.STATUS_Q_INVALID_MEMBER, b""
        if op == A.AdminOp.VF_RESOURCES_SET:
            if len(data) < A.VF_RESOURCES.size:
                return VA.STATUS_EINVAL, VA.STATUS_Q_INVALID_COMMAND, b""
            r = dict(zip(A.VF_RESOURCES.names,
                         struct.unpack(A.VF_RESOURCES.format, data[:A.VF_RESOURCES.size])))
            if (r["device_memory"] % A.PARTITION_ALIGN or r["device_memory"] == 0
                    or not 1 <= r["num_submit_queues"] <= 16 or r["max_contexts"] < 1
                    or r["weight"] < 1 or r["priority"] > 2 or r["exec_quantum_ns"] == 0
                    or r["preemption_timeout_ns"] == 0):
                return VA.STATUS_EINVAL, VA.STATUS_Q_INVALID_FIELD, b""
            if vf.live:
                return VA.STATUS_EAGAIN, VA.STATUS_Q_TRYAGAIN, b""
            for name, pool in self.pool.items():
                others = sum(dict(zip(A.VF_RESOURCES.names, struct.unpack(
                    A.VF_RESOURCES.format, v.resources)))[name]
                    for n, v in self.vfs.items() if n != member)
                if others + r[name] > pool:
                    return VA.STATUS_ENOMEM, VA.STATUS_Q_NORESOURCE, b""
            vf.resources = data[:A.VF_RESOURCES.size]
            return VA.STATUS_OK, 0, b""
        if op == A.AdminOp.VF_RESOURCES_GET:
            return VA.STATUS_OK, 0, vf.resources
        if op == A.AdminOp.VF_STOP:
            vf.stopped = True
            return VA.STATUS_OK, 0, b""
        if op == A.AdminOp.VF_RESUME:
            vf.stopped = False
            return VA.STATUS_OK, 0, b""
        if op == A.AdminOp.VF_STATS:
            return VA.STATUS_OK, 0, struct.pack(A.VF_STATS.format, *vf.stats)
        if op == A.AdminOp.VF_RESET:
            vf.resets += 1
            vf.stopped = False
            return VA.STATUS_OK, 0, b""
        return VA.STATUS_EINVAL, VA.STATUS_Q_INVALID_OPCODE, b""

    # ---- controlq with address spaces ----
    def _control(self, head, rd, wr) -> None:  # type: ignore[no-untyped-def]
        _control_with_extra(self, head, rd, wr)


def make_pf_machine(*, vf_bar: bool = True, bus_end: int = 0, **kw: object
                    ) -> tuple[FakeKernel, FakeVA1Pf, PciMachine]:
    m = PciMachine(bus_end=bus_end)
    d = FakeVA1Pf(m.k, **kw)  # type: ignore[arg-type]
    m.add(d.pci, 0, 3)
    if vf_bar:
        d.assign_vf_bar(0x8800_0000)
    return m.k, d, m
