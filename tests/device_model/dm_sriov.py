"""Test kit for SR-IOV: a fake SriovPlatform (each VF gets its own guest RAM and MSI
recorder on the shared clock), a mock PF driver that also brings up the admin virtqueue
(virtio 1.3 §2.12 layout, numbers re-typed here on purpose), and driver rigs over VFs.
Shares no code with device_model except the public constructors."""
from __future__ import annotations

import struct
from typing import Sequence

from dm_driver import ACK, DRV, DRV_OK, FEAT_OK, Bump, MockSplitQueue, Resp
from dm_fakes import FakeClock, FakeDma, FakeIrq, RecordingTracer  # noqa: F401
from dm_pci_driver import (COMMON, CAP_VNDR, DSTATUS, MSIX_CFG, NUMQ, PciDriver, PciRig,
                           RecordingMsi)

from device_model import DevicePorts, Va1Config, VirtioPciFunction
from device_model.va1.card import Va1Card

MIB = 1 << 20
# PCIe SR-IOV extended capability (PCIe base spec §9.3.3)
EXT_SRIOV = 0x0010
SR_CTRL, SR_INITIAL, SR_TOTAL, SR_NUM, SR_OFFSET, SR_STRIDE, SR_DID = (
    0x08, 0x0C, 0x0E, 0x10, 0x14, 0x16, 0x1A)
SR_SUPPG, SR_SYSPG, SR_BAR0 = 0x1C, 0x20, 0x24
VFE, VF_MSE = 0x1, 0x8
# virtio 1.3 admin
ADM_Q_IDX, ADM_Q_NUM = 60, 62
F_SR_IOV, F_ADMIN_VQ = 37, 41
LIST_QUERY, LIST_USE = 0, 1
GROUP_SRIOV = 1
EINVAL, ENOMEM, EAGAIN = 22, 12, 11
Q_INVALID_OPCODE, Q_INVALID_FIELD, Q_INVALID_GROUP, Q_INVALID_MEMBER = 2, 3, 4, 5
Q_NORESOURCE, Q_TRYAGAIN = 6, 7
# VA-1 admin opcodes
RES_SET, RES_GET, VF_STOP, VF_RESUME, VF_STATS, VF_RESET = range(0x800, 0x806)
RES_FMT = "<QIIIIQQ"     # va1_vf_resources
STATS_FMT = "<7Q"        # va1_vf_stats
VF_BAR_BASE = 0x1_0000_0000


class FakeSriovPlatform:
    def __init__(self, clock: FakeClock, tracer: RecordingTracer, ram: int = 4 << 20) -> None:
        self.clock = clock
        self.tracer = tracer
        self.ram = ram
        self.dmas: dict[int, FakeDma] = {}
        self.msis: dict[int, RecordingMsi] = {}
        self.asked: list[int] = []
        self.enabled: list[Sequence[object]] = []
        self.disabled = 0

    def vf_ports(self, vf: int) -> tuple[DevicePorts, RecordingMsi]:
        self.asked.append(vf)
        dma = FakeDma(base=0x4000_0000, size=self.ram)
        self.dmas[vf] = dma
        self.msis[vf] = RecordingMsi()
        return DevicePorts(dma=dma, clock=self.clock, tracer=self.tracer), self.msis[vf]

    def vfs_enabled(self, vfs: Sequence[object]) -> None:
        self.enabled.append(list(vfs))

    def vfs_disabled(self) -> None:
        self.disabled += 1


def ext_cap(drv: PciDriver, cap_id: int) -> int:
    off = 0x100
    while off:
        hdr = drv.cr(off)
        if hdr & 0xFFFF == cap_id:
            return off
        off = (hdr >> 20) & 0xFFC
    raise KeyError(cap_id)


def _rig_over(fn: VirtioPciFunction, dma: FakeDma, clock: FakeClock, tracer: RecordingTracer,
              qsize: int, cls: type = PciRig) -> PciRig:
    rig = cls.__new__(cls)
    PciDriver.__init__(rig, fn)
    rig.dma, rig.clock, rig.tracer = dma, clock, tracer
    rig.msi = fn.msi
    rig.irq = FakeIrq()
    rig.config = None
    rig.dev = fn.device
    rig.alloc = Bump(dma)
    rig.qsize = qsize
    rig.features = None
    rig.event_idx = True
    rig.queues = []
    rig.use_msix = True
    rig.enable()
    rig.vcaps = rig.virtio_caps()
    rig.common = rig.vcaps[COMMON].offset
    rig.setup_msix()
    rig.init()
    return rig


class PfRig(PciRig):
    """The PF driven by a mock PF driver with the admin queue."""

    admin: MockSplitQueue

    def init(self) -> None:   # as PciRig.init, plus the admin queue before DRIVER_OK
        self.reset_and_ack()
        self.accept_features(self.offered())
        self.w16(MSIX_CFG, 0)
        nq = self.c16(NUMQ)
        self.adm_index = self.c16(ADM_Q_IDX)
        assert self.c16(ADM_Q_NUM) == 1
        self.queues = []
        for i in list(range(nq)) + [self.adm_index]:
            q = self.setup_queue(i, i + 1)
            if i == self.adm_index:
                self.admin = q
            else:
                self.queues.append(q)
        self.w8(DSTATUS, ACK | DRV | FEAT_OK | DRV_OK)
        self.vio_before = len(self.fn.violations)

    def admin_cmd(self, opcode: int, member: int = 0, data: bytes = b"",
                  result_len: int = 0, group: int = GROUP_SRIOV) -> tuple[int, int, bytes]:
        """(status, qualifier, result)."""
        hdr = struct.pack("<HH12sQ", opcode, group, b"", member) + data
        cmd = self.put(hdr, 8)
        resp = self.alloc.alloc(8 + result_len, 8)
        self.dma.g_write(resp, b"\xEE" * (8 + result_len))
        bufs = [(cmd, len(hdr), False), (resp, 8, True)]
        if result_len:
            bufs.append((resp + 8, result_len, True))
        self.admin.add(bufs)
        self.kick(self.adm_index)
        self.clock.run()
        got = self.admin.pop_used()
        assert got is not None
        raw = self.dma.g_read(resp, 8 + result_len)
        st, q = struct.unpack_from("<HH", raw)
        return st, q, raw[8:got[1]]

    def use_all(self) -> None:
        st, q, res = self.admin_cmd(LIST_QUERY, result_len=33 * 8)
        assert (st, q) == (0, 0)
        st, q, _ = self.admin_cmd(LIST_USE, data=res)
        assert (st, q) == (0, 0)

    # SR-IOV capability
    def sriov(self) -> int:
        return ext_cap(self, EXT_SRIOV)

    def enable_vfs(self, n: int) -> None:
        cap = self.sriov()
        self.cw(cap + SR_BAR0, 4, VF_BAR_BASE & 0xFFFF_FFFF)
        self.cw(cap + SR_BAR0 + 4, 4, VF_BAR_BASE >> 32)
        self.cw(cap + SR_NUM, 2, n)
        self.cw(cap + SR_CTRL, 2, VFE | VF_MSE)

    def disable_vfs(self) -> None:
        self.cw(self.sriov() + SR_CTRL, 2, 0)

    def set_resources(self, vf: int, mem: int, queues: int = 2, ctxs: int = 4,
                      weight: int = 1, prio: int = 0, quantum: int = 100_000,
                      timeout: int = 10_000_000) -> tuple[int, int]:
        st, q, _ = self.admin_cmd(RES_SET, vf, struct.pack(RES_FMT, mem, queues, ctxs, weight,
                                                           prio, quantum, timeout))
        return st, q

    def get_resources(self, vf: int) -> tuple[int, ...]:
        st, q, res = self.admin_cmd(RES_GET, vf, result_len=40)
        assert (st, q) == (0, 0), (st, q)
        return struct.unpack(RES_FMT, res)


class Card:
    """A card with its PF up (admin queue in use); `vf_rig(n)` drives VF n."""

    def __init__(self, config: Va1Config | None = None, memory: int = 64 * MIB,
                 pf_memory: int = 8 * MIB, total_vfs: int = 64, ram: int = 4 << 20,
                 qsize: int = 16) -> None:
        self.clock = FakeClock()
        self.tracer = RecordingTracer()
        self.dma = FakeDma(size=ram)
        self.config = config or Va1Config()
        self.card = Va1Card(self.config, DevicePorts(dma=self.dma, clock=self.clock,
                                                     tracer=self.tracer),
                            memory_size=memory, pf_memory=pf_memory, total_vfs=total_vfs)
        self.platform = FakeSriovPlatform(self.clock, self.tracer, ram)
        self.pf_fn = self.card.physical_function(RecordingMsi(), self.platform)
        self.pf: PfRig = _rig_over(self.pf_fn, self.dma, self.clock, self.tracer, qsize,
                                   PfRig)  # type: ignore[assignment]
        self.qsize = qsize

    def vf_rig(self, n: int) -> PciRig:
        fn = self.card.vf_functions[n - 1]
        return _rig_over(fn, self.platform.dmas[n], self.clock, self.tracer, self.qsize)


__all__ = ["Card", "FakeSriovPlatform", "PfRig", "Resp", "ext_cap", "CAP_VNDR"]


# --- load generation ----------------------------------------------------------------------

def nops(n: int) -> bytes:
    """n NOP commands (opcode 0, length 8)."""
    return struct.pack("<HHI", 0, 0, 8) * n


class Saturator:
    """Keeps every submit queue of a rig full of the same command buffer; records
    (queue, submit_ns, Resp) for each completion."""

    def __init__(self, rig: PciRig, ctx: int, cmdbuf: bytes, depth: int = 4) -> None:
        self.rig = rig
        self.ctx = ctx
        self.addr = rig.put(cmdbuf)
        self.len = len(cmdbuf)
        self.depth = depth
        self.slots: dict[tuple[int, int], tuple[int, int]] = {}   # (queue, head) -> resp, t
        self.done: list[tuple[int, int, Resp]] = []
        self.fence = 0
        self.stopped = False
        self.submitqs = list(range(2, len(rig.queues)))
        for q in self.submitqs:
            for _ in range(depth):
                self._submit(q, kick=False)
            rig.kick(q)

    def _submit(self, qi: int, kick: bool = True) -> None:
        rig = self.rig
        req = rig.alloc.alloc(32)
        resp = rig.alloc.alloc(32)
        self.fence += 1
        rig.dma.g_write(req, struct.pack("<IIQIIQ", self.ctx, 0, self.addr, self.len, 0,
                                         self.fence))
        head = rig.queues[qi].add([(req, 32, False), (resp, 32, True)])
        self.slots[(qi, head)] = (resp, rig.clock.now)
        if kick:
            rig.kick(qi)

    def poll(self) -> None:
        for qi in self.submitqs:
            q = self.rig.queues[qi]
            while (got := q.pop_used()) is not None:
                resp, t = self.slots.pop((qi, got[0]))
                r = Resp(*struct.unpack("<IIQQQ", self.rig.dma.g_read(resp, 32)))
                self.done.append((qi, t, r))
                if not self.stopped:
                    self._submit(qi)


def run_until(clock: FakeClock, t_end: int, loads: Sequence[object]) -> None:
    """Step the clock to t_end, letting every load refill after each event."""
    while True:
        nxt = clock.next_event_ns()
        if nxt is None or nxt > t_end:
            break
        clock.step()
        for ld in loads:
            ld.poll()  # type: ignore[attr-defined]
    clock.now = max(clock.now, t_end)


def jain(xs: Sequence[float]) -> float:
    return sum(xs) ** 2 / (len(xs) * sum(x * x for x in xs))
