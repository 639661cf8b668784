"""VA-1 physical-function management: the API the HOST kernel's PF driver uses.

A VA-1 PF is a virtio-pci function with an SR-IOV extended capability that offers
VIRTIO_F_SR_IOV and VIRTIO_F_ADMIN_VQ. `VA1Pf` binds it as an ordinary VA-1 accelerator
(its own device file for the host: `open()`) plus the admin virtqueue, and manages its
virtual functions:

- `sriov_configure(n)` enables n VFs as Linux's sriov_enable does (write NumVFs, check
  offset/stride and the VF BAR, set VF Enable | VF MSE, wait 100 ms); 0 disables (clear
  VF Enable | VF MSE, wait 1 s, NumVFs 0). Above TotalVFs is EINVAL before anything is
  touched; changing the count while VFs are enabled is EBUSY (disable first).
- `set_resources`, `get_resources`, `stop`, `resume`, `stats`, `reset_vf`: VA-1 admin
  commands of the SR-IOV group, member = VF number 1..NumVFs. Admin status/qualifier
  become OSError: EINVAL (naming the member or field), ENOMEM (over-commit), EAGAIN
  (the VF is live), EOPNOTSUPP (the device lacks the command), EIO otherwise.

VFs themselves are bound by the host to VFIO, never to this driver.
"""
from __future__ import annotations

import errno
import struct
from dataclasses import asdict, dataclass

from hwspec import pci as P
from hwspec import va1 as A
from hwspec import virtio as V
from hwspec import virtio_admin as VA
from hwspec.va1 import VfResources

from ..kernel import GuestKernel, PciHostBridge
from ..mm import PAGE_SIZE, PageAllocator
from ..pci import PciError, PciFunction
from ..uapi import DeviceFile
from ..virtio.admin import AdminResult, qualifier_name, status_name
from ..virtio.pci import VirtioPci
from ..virtio.transport import ProbeError, TransportError
from .devfile import VA1File
from .driver import VA1Device, VA1Error

VF_ENABLE_WAIT_NS = 100_000_000     # PCIe: 100 ms after VF Enable before VF config access
VF_DISABLE_WAIT_NS = 1_000_000_000  # Linux sriov_disable: ssleep(1)
PF_OPCODES = frozenset(int(op) for op in A.AdminOp)
PRIORITY_MAX = A.MAX_PRIORITY


@dataclass
class VfStats:
    """va1_vf_stats (VF_STATS)."""
    submissions: int
    commands: int
    device_time_ns: int
    dma_bytes: int
    faults: int
    preemptions: int
    timeouts: int

    @classmethod
    def unpack(cls, data: bytes) -> "VfStats":
        return cls(*struct.unpack(A.VF_STATS.format, data[:A.VF_STATS.size]))


@dataclass(frozen=True)
class SriovInfo:
    """The PF's SR-IOV capability as read now (read_sriov)."""
    total_vfs: int
    initial_vfs: int
    num_vfs: int
    enabled: bool              # VF Enable
    vf_offset: int             # First VF Offset (routing-ID units)
    vf_stride: int
    vf_device_id: int
    vf_bar0_size: int          # per VF; 0 = no VF BAR0
    vf_bar0_base: int          # VF n's BAR0 is at base + (n-1) * size; 0 = unassigned
    vf_bar0_64bit: bool

    def vf_bar0(self, vf: int) -> int:
        """Guest physical address of VF `vf`'s (1-based) BAR0."""
        return self.vf_bar0_base + (vf - 1) * self.vf_bar0_size

    def vf_routing_id(self, pf_routing_id: int, vf: int) -> int:
        """Requester ID (bus << 8 | devfn) of VF `vf`."""
        return pf_routing_id + self.vf_offset + (vf - 1) * self.vf_stride


def _pf_err(err: int, msg: str) -> OSError:
    return OSError(err, msg)


def has_sriov(fn: PciFunction) -> bool:
    """A function with an SR-IOV capability offering at least one VF (a PF)."""
    pos = fn.find_ext_cap(P.EXT_CAP_ID_SRIOV)
    return pos is not None and fn.cfg.read16(pos + P.SRIOV_TOTAL_VF) > 0


class VA1Pf:
    """The host's driver of one VA-1 PF: accelerator + SR-IOV + admin virtqueue."""

    def __init__(self, kernel: GuestKernel, fn: PciFunction, alloc: PageAllocator | None = None,
                 name: str = "accel0", host: PciHostBridge | None = None,
                 device: VA1Device | None = None) -> None:
        """`alloc`: the kernel's guest-RAM allocator (a new one over kernel.ram if None:
        only when nothing else allocates from that RAM). `host`: the bridge fn sits
        behind (checks that VF routing IDs fit its bus range). `device`: an already
        probed VA1Device of fn bound with admin=True (boot does that)."""
        self.kernel = kernel
        self.fn = fn
        self.host = host
        self.alloc = alloc or PageAllocator(kernel.ram.base, kernel.ram.size, "host RAM")
        self.name = name
        self.device = device or VA1Device(kernel, VirtioPci(kernel, fn), self.alloc, name,
                                          admin=True)
        self._probed = device is not None
        self.pos = 0                # config offset of the SR-IOV capability
        self.vf_bar0_size = 0
        self.vf_bar0_64bit = False

    # ------------------------------------------------------------------ probe
    def probe(self) -> None:
        """Bind the PF: the VA-1 function with SR_IOV and ADMIN_VQ negotiated, the admin
        queue initialised (LIST_QUERY, LIST_USE), the SR-IOV capability checked (VFs
        disabled if left enabled, System Page Size 4 KiB, VF BAR0 sized). Raises
        ProbeError naming what is missing."""
        pos = self.fn.find_ext_cap(P.EXT_CAP_ID_SRIOV)
        if pos is None:
            raise ProbeError(f"{self.name}: {self.fn.bdf} has no SR-IOV capability: not a PF")
        self.pos = pos
        if not self._probed:
            self.device.probe()
            self._probed = True
        dev = self.device
        missing = [n for b, n in ((V.F_SR_IOV, "VIRTIO_F_SR_IOV"),
                                  (V.F_ADMIN_VQ, "VIRTIO_F_ADMIN_VQ"))
                   if not dev.features >> b & 1]
        if missing or dev.admin is None:
            dev.remove()
            raise ProbeError(f"{self.name}: PF {self.fn.bdf} did not negotiate "
                             f"{', '.join(missing) or 'an admin queue'}")
        try:
            in_use = dev.admin_init(VA.GROUP_TYPE_SRIOV, PF_OPCODES)
        except OSError as e:
            dev.remove()
            raise ProbeError(f"{self.name}: admin queue initialisation failed: {e}") from None
        lacking = PF_OPCODES - in_use
        if lacking:
            self._trace("pf_admin_missing", opcodes=",".join(f"{o:#x}" for o in
                                                               sorted(lacking)))
        try:
            self._init_sriov()
        except PciError as e:
            dev.remove()
            raise ProbeError(f"{self.name}: {e}") from None
        self._trace("pf_bound", pci=str(self.fn.bdf), total_vfs=self._r16(P.SRIOV_TOTAL_VF),
                    vf_bar0_size=self.vf_bar0_size)

    def _init_sriov(self) -> None:
        """As Linux sriov_init: VFs off, page size, VF BAR sizing (with VF MSE off)."""
        ctrl = self._r16(P.SRIOV_CTRL)
        if ctrl & P.SRIOV_CTRL_VFE:
            self._w16(P.SRIOV_CTRL, 0)
            self.kernel.sched.sleep(VF_DISABLE_WAIT_NS)
        elif ctrl & P.SRIOV_CTRL_MSE:
            self._w16(P.SRIOV_CTRL, ctrl & ~P.SRIOV_CTRL_MSE)
        if self._r16(P.SRIOV_NUM_VF):
            self._w16(P.SRIOV_NUM_VF, 0)
        if self._r16(P.SRIOV_TOTAL_VF) == 0:
            raise PciError(f"{self.fn.bdf}: SR-IOV TotalVFs is 0")
        self._set_page_size()
        self.vf_bar0_size, self.vf_bar0_64bit = self._size_vf_bar0()

    def _set_page_size(self) -> None:
        """System Page Size: kept if firmware already chose a supported size of at least
        our page (it sized the VF BARs with it); else the smallest supported size >= our
        page, as Linux sriov_init. No such size: SR-IOV cannot be used here."""
        sup = self._r32(P.SRIOV_SUP_PGSIZE)
        usable = sup & ~((PAGE_SIZE >> 12) - 1)
        if not usable:
            raise PciError(f"{self.fn.bdf}: SR-IOV Supported Page Sizes {sup:#x} has no "
                           f"size >= {PAGE_SIZE:#x}")
        cur = self._r32(P.SRIOV_SYS_PGSIZE)
        if cur & (cur - 1) or not cur & usable:
            self._w32(P.SRIOV_SYS_PGSIZE, usable & -usable)

    def _size_vf_bar0(self) -> tuple[int, bool]:
        reg = P.SRIOV_BAR
        orig = self._r32(reg)
        self._w32(reg, 0xFFFFFFFF)
        mask = self._r32(reg)
        self._w32(reg, orig)
        if mask == 0 and orig == 0:
            return 0, False
        if orig & P.BASE_ADDRESS_SPACE_IO:
            raise PciError(f"{self.fn.bdf}: VF BAR0 is an I/O BAR")
        is64 = orig & P.BASE_ADDRESS_MEM_TYPE_MASK == P.BASE_ADDRESS_MEM_TYPE_64
        full = mask & P.BASE_ADDRESS_MEM_MASK
        if is64:
            hi = self._r32(reg + 4)
            self._w32(reg + 4, 0xFFFFFFFF)
            full |= self._r32(reg + 4) << 32
            self._w32(reg + 4, hi)
        else:
            full |= 0xFFFFFFFF00000000
        size = full & -full
        if size == 0:
            raise PciError(f"{self.fn.bdf}: VF BAR0 reports size 0 (mask {mask:#010x})")
        return size, is64

    # ------------------------------------------------------------------ config helpers
    def _r16(self, off: int) -> int:
        return self.fn.cfg.read16(self.pos + off)

    def _r32(self, off: int) -> int:
        return self.fn.cfg.read32(self.pos + off)

    def _w16(self, off: int, value: int) -> None:
        self.fn.cfg.write16(self.pos + off, value)

    def _w32(self, off: int, value: int) -> None:
        self.fn.cfg.write32(self.pos + off, value)

    def _trace(self, kind: str, **f: object) -> None:
        self.kernel.trace.emit(kind, dev=self.name, **f)

    def _vf_bar0_base(self) -> int:
        base = self._r32(P.SRIOV_BAR) & P.BASE_ADDRESS_MEM_MASK
        if self.vf_bar0_64bit:
            base |= self._r32(P.SRIOV_BAR + 4) << 32
        return base

    # ------------------------------------------------------------------ SR-IOV
    def read_sriov(self) -> SriovInfo:
        """TotalVFs, NumVFs, VF Enable, offset, stride, VF device id, VF BAR0."""
        return SriovInfo(
            total_vfs=self._r16(P.SRIOV_TOTAL_VF), initial_vfs=self._r16(P.SRIOV_INITIAL_VF),
            num_vfs=self._r16(P.SRIOV_NUM_VF),
            enabled=bool(self._r16(P.SRIOV_CTRL) & P.SRIOV_CTRL_VFE),
            vf_offset=self._r16(P.SRIOV_VF_OFFSET), vf_stride=self._r16(P.SRIOV_VF_STRIDE),
            vf_device_id=self._r16(P.SRIOV_VF_DID), vf_bar0_size=self.vf_bar0_size,
            vf_bar0_base=self._vf_bar0_base(), vf_bar0_64bit=self.vf_bar0_64bit)

    @property
    def num_vfs(self) -> int:
        """VFs currently enabled (0 when VF Enable is clear)."""
        ctrl = self._r16(P.SRIOV_CTRL)
        return self._r16(P.SRIOV_NUM_VF) if ctrl & P.SRIOV_CTRL_VFE else 0

    def sriov_configure(self, num_vfs: int) -> int:
        """Enable `num_vfs` VFs (0 disables); returns the number enabled. EINVAL above
        TotalVFs (nothing touched), EBUSY to change the count while enabled."""
        self.device.check_alive()
        if not isinstance(num_vfs, int) or num_vfs < 0:
            raise _pf_err(errno.EINVAL, f"{self.name}: num_vfs must be an int >= 0, "
                                        f"got {num_vfs!r}")
        total = self._r16(P.SRIOV_TOTAL_VF)
        if num_vfs > total:
            raise _pf_err(errno.EINVAL, f"{self.name}: num_vfs {num_vfs} exceeds TotalVFs "
                                        f"{total}")
        current = self.num_vfs
        if num_vfs == current:
            return current
        if num_vfs == 0:
            self._disable()
            return 0
        if current:
            raise _pf_err(errno.EBUSY, f"{self.name}: {current} VFs already enabled; "
                                       f"disable them (sriov_configure(0)) before enabling "
                                       f"{num_vfs}")
        self._enable(num_vfs)
        return num_vfs

    def _enable(self, n: int) -> None:
        """Linux sriov_enable: NumVFs, then check offset/stride/bus/VF BAR, then VF Enable
        and VF MSE in one write, then 100 ms."""
        self._w16(P.SRIOV_NUM_VF, n)
        got = self._r16(P.SRIOV_NUM_VF)
        if got != n:
            self._w16(P.SRIOV_NUM_VF, 0)
            raise _pf_err(errno.EIO, f"{self.name}: NumVFs wrote {n}, read back {got}")
        offset, stride = self._r16(P.SRIOV_VF_OFFSET), self._r16(P.SRIOV_VF_STRIDE)
        problem = ""
        err = errno.EIO
        if offset == 0 or (n > 1 and stride == 0):
            problem = f"First VF Offset {offset} / VF Stride {stride} unusable for {n} VFs"
        elif self.host is not None:
            last_rid = ((self.fn.bdf.bus << 8) | (self.fn.bdf.dev << 3) | self.fn.bdf.fn) \
                + offset + (n - 1) * stride
            if last_rid >> 8 > self.host.bus_end:
                err = errno.ENOMEM
                problem = (f"VF {n} would be on bus {last_rid >> 8}, beyond the host "
                           f"bridge's last bus {self.host.bus_end}")
        if not problem and self.vf_bar0_size:
            base = self._vf_bar0_base()
            if base == 0:
                err = errno.ENOMEM
                problem = "VF BAR0 was not assigned an address by the firmware"
            elif base % self.vf_bar0_size:
                err = errno.ENOMEM
                problem = f"VF BAR0 base {base:#x} not aligned to its size"
            elif self.host is not None and not (
                    self.host.mem_base <= base and base + n * self.vf_bar0_size
                    <= self.host.mem_base + self.host.mem_size):
                err = errno.ENOMEM
                problem = (f"VF BAR0 [{base:#x}, +{n} x {self.vf_bar0_size:#x}) is outside "
                           "the host bridge memory window")
        if problem:
            self._w16(P.SRIOV_NUM_VF, 0)
            raise _pf_err(err, f"{self.name}: cannot enable {n} VFs: {problem}")
        ctrl = self._r16(P.SRIOV_CTRL)
        self._w16(P.SRIOV_CTRL, ctrl | P.SRIOV_CTRL_VFE | P.SRIOV_CTRL_MSE)
        self.kernel.sched.sleep(VF_ENABLE_WAIT_NS)
        if not self._r16(P.SRIOV_CTRL) & P.SRIOV_CTRL_VFE:
            self._w16(P.SRIOV_NUM_VF, 0)
            raise _pf_err(errno.EIO, f"{self.name}: VF Enable did not stick")
        self._trace("sriov_enable", num_vfs=n, vf_offset=offset, vf_stride=stride)

    def _disable(self) -> None:
        ctrl = self._r16(P.SRIOV_CTRL)
        self._w16(P.SRIOV_CTRL, ctrl & ~(P.SRIOV_CTRL_VFE | P.SRIOV_CTRL_MSE))
        self.kernel.sched.sleep(VF_DISABLE_WAIT_NS)
        self._w16(P.SRIOV_NUM_VF, 0)
        self._trace("sriov_disable")

    # ------------------------------------------------------------------ admin commands
    def _check_vf(self, vf: int, what: str) -> None:
        n = self.num_vfs
        if not isinstance(vf, int) or isinstance(vf, bool) or not 1 <= vf <= n:
            raise _pf_err(errno.EINVAL, f"{self.name}: {what}: member vf {vf!r} does not "
                                        f"exist (members are VFs 1..{n} enabled)" if n else
                          f"{self.name}: {what}: member vf {vf!r} does not exist (no VFs "
                          "are enabled)")

    def admin_command(self, opcode: int, member: int, data: bytes = b"",
                      result_size: int = 0) -> AdminResult:
        """Raw admin command of the SR-IOV group, not checked here (tests of the
        device's own checks): (status, qualifier, result)."""
        st, q, res = self.device.admin_command(opcode, VA.GROUP_TYPE_SRIOV, member, data,
                                               result_size, what=_op_name(opcode))
        return AdminResult(st, q, res)

    def _call(self, op: A.AdminOp, vf: int, data: bytes = b"", result_size: int = 0,
              detail: str = "") -> bytes:
        what = f"{op.name} vf {vf}"
        self._check_vf(vf, op.name)
        if self.device.admin is not None and not self.device.admin.needs_init and (
                int(op) not in self.device.admin.in_use):
            raise _pf_err(errno.EOPNOTSUPP, f"{self.name}: {what}: the device does not "
                                            "support this admin command (LIST_QUERY)")
        st, q, res = self.admin_command(op, vf, data, result_size)
        if st == VA.STATUS_OK:
            if len(res) < result_size:
                raise _pf_err(errno.EIO, f"{self.name}: {what}: result of {len(res)} bytes, "
                                         f"{result_size} expected")
            return res
        raise admin_errno(self.name, what, st, q, detail)

    def set_resources(self, vf: int, res: VfResources) -> None:
        """VF_RESOURCES_SET. EINVAL naming a bad field (checked here first) or the member,
        ENOMEM when the card cannot give that much (over-commit), EAGAIN while the VF is
        live."""
        self._check_vf(vf, A.AdminOp.VF_RESOURCES_SET.name)
        _check_resources(self.name, vf, res)
        self._call(A.AdminOp.VF_RESOURCES_SET, vf, res.encode(),
                   detail=f"requested {_fmt(res)}")
        self._trace("vf_resources_set", vf=vf, **{k: int(v) for k, v in asdict(res).items()})

    def get_resources(self, vf: int) -> VfResources:
        """VF_RESOURCES_GET."""
        return VfResources.decode(self._call(A.AdminOp.VF_RESOURCES_GET, vf, b"",
                                             A.VF_RESOURCES.size))

    def stop(self, vf: int) -> None:
        """VF_STOP: the VF's queued work completes STOPPED, nothing more runs."""
        self._call(A.AdminOp.VF_STOP, vf)
        self._trace("vf_stop", vf=vf)

    def resume(self, vf: int) -> None:
        """VF_RESUME."""
        self._call(A.AdminOp.VF_RESUME, vf)
        self._trace("vf_resume", vf=vf)

    def stats(self, vf: int) -> VfStats:
        """VF_STATS."""
        return VfStats.unpack(self._call(A.AdminOp.VF_STATS, vf, b"", A.VF_STATS.size))

    def reset_vf(self, vf: int) -> None:
        """VF_RESET: the VF is reset as by FLR (its driver sees NEEDS_RESET / aborts)."""
        self._call(A.AdminOp.VF_RESET, vf)
        self._trace("vf_reset", vf=vf)

    # ------------------------------------------------------------------ the PF as an accelerator
    def open(self, path: str = "") -> DeviceFile:
        """A device file on the PF's own accelerator (host use)."""
        return VA1File(self.device, path or f"/dev/accel/{self.name}")

    def remove(self) -> None:
        """Unbind: VFs disabled, the function reset."""
        try:
            if self.pos and self.num_vfs:
                self._disable()
        except (OSError, PciError, TransportError):
            pass
        self.device.remove()


def probe_pf(kernel: GuestKernel, fn: PciFunction, alloc: PageAllocator | None = None,
             name: str = "accel0", host: PciHostBridge | None = None) -> VA1Pf:
    """Bind a VA-1 PF (see VA1Pf.probe)."""
    pf = VA1Pf(kernel, fn, alloc, name, host)
    pf.probe()
    return pf


def _fmt(res: VfResources) -> str:
    return ", ".join(f"{k}={v}" for k, v in asdict(res).items())


def _op_name(opcode: int) -> str:
    try:
        return A.AdminOp(opcode).name
    except ValueError:
        return {VA.CMD_LIST_QUERY: "LIST_QUERY", VA.CMD_LIST_USE: "LIST_USE"}.get(
            opcode, f"admin opcode {opcode:#06x}")


_FIELD_LIMITS = VfResources.field_limits()


def _check_resources(name: str, vf: int, res: VfResources) -> None:
    """Local checks (datasheet §11 field ranges) that name the bad field; the device
    checks again."""
    where = f"{name}: VF_RESOURCES_SET vf {vf}"
    for fname, limit in _FIELD_LIMITS.items():
        v = getattr(res, fname)
        if not isinstance(v, int) or not 0 <= v <= limit:
            raise _pf_err(errno.EINVAL, f"{where}: field {fname}={v!r} is not an integer in "
                                        f"0..{limit:#x}")
    if res.device_memory == 0 or res.device_memory % A.PARTITION_ALIGN:
        raise _pf_err(errno.EINVAL, f"{where}: field device_memory={res.device_memory} is not "
                                    f"a non-zero multiple of {A.PARTITION_ALIGN} "
                                    "(PARTITION_ALIGN)")
    if not 1 <= res.num_submit_queues <= A.MAX_SUBMIT_QUEUES_PER_FUNCTION:
        raise _pf_err(errno.EINVAL, f"{where}: field num_submit_queues="
                                    f"{res.num_submit_queues} is not in "
                                    f"1..{A.MAX_SUBMIT_QUEUES_PER_FUNCTION}")
    for fname in ("max_contexts", "weight", "exec_quantum_ns", "preemption_timeout_ns"):
        if getattr(res, fname) < 1:
            raise _pf_err(errno.EINVAL, f"{where}: field {fname}={getattr(res, fname)} must "
                                        "be >= 1")
    if res.priority > PRIORITY_MAX:
        raise _pf_err(errno.EINVAL, f"{where}: field priority={res.priority} is not 0 "
                                    "(normal), 1 (high) or 2 (realtime)")


def admin_errno(name: str, what: str, status: int, qualifier: int, detail: str = ""
                ) -> OSError:
    """The OSError for a failed admin command: by the qualifier when it is specific,
    else by the status (an errno value)."""
    tail = f" (status {status_name(status)}, qualifier {qualifier_name(qualifier)})"
    extra = f"; {detail}" if detail else ""
    q = qualifier
    if q == VA.STATUS_Q_INVALID_MEMBER:
        err, msg = errno.EINVAL, "no such member: the VF does not exist"
    elif q == VA.STATUS_Q_INVALID_FIELD:
        err, msg = errno.EINVAL, f"the device rejected a field of the command{extra}"
    elif q == VA.STATUS_Q_INVALID_OPCODE:
        err, msg = errno.EOPNOTSUPP, "the device does not support this command"
    elif q == VA.STATUS_Q_INVALID_GROUP:
        err, msg = errno.EINVAL, "invalid group type"
    elif q == VA.STATUS_Q_INVALID_COMMAND:
        err, msg = errno.EINVAL, "malformed command"
    elif q == VA.STATUS_Q_NORESOURCE or status == VA.STATUS_ENOMEM:
        err, msg = errno.ENOMEM, f"over-commit: the card has not enough free resources{extra}"
    elif q == VA.STATUS_Q_TRYAGAIN or status == VA.STATUS_EAGAIN:
        err, msg = errno.EAGAIN, ("the VF is live (a driver has it running); stop or reset "
                                  "it first, then retry")
    elif status == VA.STATUS_EINVAL:
        err, msg = errno.EINVAL, f"invalid command{extra}"
    else:
        err, msg = errno.EIO, "failed"
    return _pf_err(err, f"{name}: {what}: {msg}{tail}")


__all__ = ["VA1Pf", "VfStats", "SriovInfo", "probe_pf", "has_sriov",
           "admin_errno", "VA1Error", "PF_OPCODES"]
