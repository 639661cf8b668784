"""/dev/vhost-vdpa-N: the vhost ioctls and IOTLB messages of linux/vhost.h over a vdpa
device (drivers/vhost/vdpa.c).

Why: this is the control plane a VMM gets, and the only one: the data path is the
function's own (its rings in guest memory, kicks into its notify register, interrupts
out through eventfds). The file checks every request before it reaches the parent, so
a buggy or hostile VMM cannot misprogram the function or map what it does not own.

Semantics and errnos (vhost.c, vdpa.c), with these choices:
- Ownership: SET_OWNER by the process that opened the file (EBUSY if owned already);
  every other ioctl needs the owner: before SET_OWNER or from another process, EPERM
  (stricter than Linux, which lets the VDPA_* queries through).
- Features: GET_FEATURES is the parent's offer; SET_FEATURES with a bit not offered is
  EINVAL, and after FEATURES_OK is set EBUSY. Backend features offered: IOTLB_MSG_V2,
  IOTLB_BATCH, SUSPEND and RESUME (the last two when the parent can); others EOPNOTSUPP.
- Status: SET_STATUS 0 resets the device (and forgets queue bases); clearing a bit
  other than by 0 is EINVAL; DRIVER_OK while an IOTLB batch is open is EBUSY.
- Queues: an index >= the queue count is ENOBUFS; SET_VRING_NUM outside 1..max or not a
  power of two is EINVAL; NUM, ADDR and BASE after DRIVER_OK (unless suspended) EBUSY.
  SET_VRING_ADDR: unknown flags EOPNOTSUPP; desc not 16-byte, avail not 2-byte, used not
  4-byte aligned, or any of the three areas (for the ring size set) not covered by the
  IOTLB with the access the device needs (desc, avail read; used write): EINVAL.
  SET_VRING_BASE above 0xffff: EINVAL. KICK/CALL/CONFIG_CALL take an eventfd or -1:
  a closed fd is EBADF, an open fd that is not an eventfd EINVAL.
- IOTLB (write() of struct vhost_msg_v2, IOTLB_MSG_V2 acked first): a short write, a
  type other than VHOST_IOTLB_MSG_V2 or a non-zero asid is EINVAL. UPDATE: perm not
  RO/WO/RW, zero size, not 4 KiB aligned, or outside GET_IOVA_RANGE: EINVAL; an overlap
  with a mapping (or one pending in the batch): EEXIST; a uaddr range outside the
  caller's memory: EFAULT. INVALIDATE unmaps (splitting at the edges). BATCH_BEGIN /
  BATCH_END need IOTLB_BATCH; inside a batch updates and invalidations are held and
  applied together at BATCH_END; a second BEGIN or an END without BEGIN is EINVAL; a
  batch still open at close() is dropped, nothing of it applied.
- SUSPEND / RESUME without the backend feature acked: EOPNOTSUPP. SUSPEND of a running
  device returns once it has finished what it took from its rings (the caller's task
  waits, in virtual time; ETIMEDOUT after 1 s, the device resumed); while suspended,
  kicks are dropped (the owner re-kicks after RESUME or a move) and NUM/ADDR/BASE may
  be set again.
The function's DMA goes through an IOMMU domain of this file's, programmed from the
IOTLB; closing the file resets the device and drops the domain.
"""
from __future__ import annotations

import errno
from typing import TYPE_CHECKING, Any, Callable

from hwspec import virtio as V

from ..eventfd import drain, is_eventfd
from ..iommu import PAGE_MASK, IommuDomain, IommuError
from ..memory import GuestMemory
from . import uapi
from .errors import vhost_error
from .uapi import CData

if TYPE_CHECKING:
    from ..host import Host
    from .bus import VdpaDevice

BACKEND_FEATURES = (1 << uapi.VHOST_BACKEND_F_IOTLB_MSG_V2 | 1 << uapi.VHOST_BACKEND_F_IOTLB_BATCH)
SUSPEND_FEATURES = 1 << uapi.VHOST_BACKEND_F_SUSPEND | 1 << uapi.VHOST_BACKEND_F_RESUME
MSG_V2_SIZE = uapi.sizeof("struct vhost_msg_v2")
VRING_DESC_ALIGN, VRING_AVAIL_ALIGN, VRING_USED_ALIGN = 16, 2, 4
SUSPEND_TIMEOUT_NS = 1_000_000_000   # virtual: how long SUSPEND waits for in-flight work


class _Vq:
    def __init__(self) -> None:
        self.num = 0
        self.desc = self.avail = self.used = 0
        self.addr_set = False
        self.base = 0
        self.kick: int | None = None
        self.call: int | None = None
        self.ready = False


class VhostVdpaFile:
    """One open /dev/vhost-vdpa-N."""

    def __init__(self, host: "Host", device: "VdpaDevice", memory: list[GuestMemory],
                 process: object) -> None:
        self.host = host
        self.device = device
        self.parent = device.parent
        self.path = device.vhost_path
        self.opener = process
        self.owner: object = None
        self.memory = list(memory)
        self.trace = host.machine.trace.tracer(f"{host.name}.vhost-vdpa-{device.index}")
        self.backend_features = 0
        self.vqs = [_Vq() for _ in range(self.parent.num_queues)]
        self.config_call: int | None = None
        self.batch: list[tuple[str, int, int, int, int]] | None = None
        self.suspended = False
        self.closed = False
        self.iotlb_msgs = 0
        self._kickers: dict[int, Callable[[int], None]] = {}
        rid = self.parent.hf.requester_id
        self.domain: IommuDomain = host.iommu.create_domain()
        try:
            host.iommu.attach(rid, self.domain)
        except IommuError as e:
            host.iommu.destroy_domain(self.domain)
            raise vhost_error(errno.EBUSY, f"{self.path}: the function's DMA is taken ({e})") \
                from None
        self.parent.reset()

    # -- helpers ----------------------------------------------------------------------------

    def _check_open(self, what: str) -> None:
        if self.closed:
            raise vhost_error(errno.EBADF, f"{what}: {self.path} is closed")

    def _check_owner(self, what: str, process: object) -> None:
        self._check_open(what)
        if self.owner is None:
            raise vhost_error(errno.EPERM, f"{what}: {self.path} has no owner (VHOST_SET_OWNER "
                                           "first)")
        if process is not self.owner:
            raise vhost_error(errno.EPERM, f"{what}: the caller is not the owner of {self.path}")

    def _vq(self, what: str, index: int) -> _Vq:
        if not 0 <= index < len(self.vqs):
            raise vhost_error(errno.ENOBUFS, f"{what}: queue index {index} is out of range "
                                             f"(the device has {len(self.vqs)} queues)")
        return self.vqs[index]

    def _status(self) -> int:
        return self.parent.get_status()

    def _setup_allowed(self, what: str) -> None:
        if self._status() & V.STATUS_DRIVER_OK and not self.suspended:
            raise vhost_error(errno.EBUSY, f"{what}: the device is running (DRIVER_OK); "
                                           "suspend or reset it first")

    def _fd(self, what: str, fd: int) -> int | None:
        if fd == uapi.VHOST_FILE_UNBIND:
            return None
        kind = is_eventfd(fd) if fd >= 0 else None
        if kind is None:
            raise vhost_error(errno.EBADF, f"{what}: fd {fd} is not open")
        if not kind:
            raise vhost_error(errno.EINVAL, f"{what}: fd {fd} is not an eventfd")
        return fd

    # -- ioctl --------------------------------------------------------------------------------

    def ioctl(self, request: int, arg: CData = None, *, process: object = None) -> int:
        """Dispatch by linux/vhost.h ioctl number; `process` defaults to the opener.
        Scalar arguments are cffi pointers (`uapi.new("uint64_t *")`), as the kernel's
        copy_from_user/copy_to_user targets; structs are `struct ... *`."""
        who = self.opener if process is None else process
        name = uapi.IOCTL_NAMES.get(request)
        if name is None:
            self._check_open(f"ioctl {request:#x}")
            raise vhost_error(errno.ENOTTY, f"ioctl {request:#x} is not a vhost-vdpa ioctl")
        if request == uapi.VHOST_SET_OWNER:
            self._check_open(name)
            if self.owner is not None:
                raise vhost_error(errno.EBUSY, f"{name}: {self.path} already has an owner")
            self.owner = who
            return 0
        self._check_owner(name, who)
        handler: Callable[[str, Any], int | None] = getattr(self, "_" + name.lower())
        result = handler(name, arg)
        return 0 if result is None else result

    @staticmethod
    def _ptr(name: str, arg: CData, ctype: str) -> CData:
        if not isinstance(arg, uapi.ffi.CData):
            raise vhost_error(errno.EFAULT, f"{name}: argument is not a '{ctype} *'")
        t = uapi.ffi.typeof(arg)
        want = uapi.ffi.typeof(ctype)
        if t.kind != "pointer" or t.item is not want:
            raise vhost_error(errno.EFAULT, f"{name}: argument is a {t.cname!r}, not a "
                                            f"'{ctype} *'")
        return arg

    def _get(self, name: str, arg: CData, ctype: str, value: int) -> None:
        self._ptr(name, arg, ctype)[0] = value

    def _set(self, name: str, arg: CData, ctype: str) -> int:
        return int(self._ptr(name, arg, ctype)[0])

    def _struct(self, name: str, arg: CData, struct: str) -> CData:
        return self._ptr(name, arg, f"struct {struct}")[0]

    # features
    def _vhost_get_features(self, name: str, arg: CData) -> None:
        self._get(name, arg, "uint64_t", self.parent.device_features)

    def _vhost_set_features(self, name: str, arg: CData) -> None:
        features = self._set(name, arg, "uint64_t")
        if self._status() & V.STATUS_FEATURES_OK:
            raise vhost_error(errno.EBUSY, f"{name}: FEATURES_OK is already set")
        extra = features & ~self.parent.device_features
        if extra:
            raise vhost_error(errno.EINVAL, f"{name}: features {extra:#x} are not offered "
                                            f"(offered {self.parent.device_features:#x})")
        self.parent.set_driver_features(features)

    def _offered_backend(self) -> int:
        return BACKEND_FEATURES | (SUSPEND_FEATURES if self.parent.migration is not None else 0)

    def _vhost_get_backend_features(self, name: str, arg: CData) -> None:
        self._get(name, arg, "uint64_t", self._offered_backend())

    def _vhost_set_backend_features(self, name: str, arg: CData) -> None:
        features = self._set(name, arg, "uint64_t")
        extra = features & ~self._offered_backend()
        if extra:
            raise vhost_error(errno.EOPNOTSUPP, f"{name}: backend features {extra:#x} are not "
                                                f"offered (offered {self._offered_backend():#x})")
        self.backend_features = features

    # device
    def _vhost_vdpa_get_device_id(self, name: str, arg: CData) -> None:
        self._get(name, arg, "uint32_t", self.parent.device_id)

    def _vhost_vdpa_get_status(self, name: str, arg: CData) -> None:
        self._get(name, arg, "uint8_t", self._status())

    def _vhost_vdpa_set_status(self, name: str, arg: CData) -> None:
        status = self._set(name, arg, "uint8_t")
        old = self._status()
        if status == 0:
            self.parent.reset()
            for vq in self.vqs:
                vq.base, vq.ready = 0, False
            self.suspended = False
            self.trace.emit("vhost_status", status=0)
            return
        if old & ~status:
            raise vhost_error(errno.EINVAL, f"{name}: status {old:#x} -> {status:#x} clears bits "
                                            "(only a write of 0 may)")
        if status & V.STATUS_DRIVER_OK and not old & V.STATUS_DRIVER_OK:
            if self.batch is not None:
                raise vhost_error(errno.EBUSY, f"{name}: DRIVER_OK while an IOTLB batch is open "
                                               "(VHOST_IOTLB_BATCH_END first)")
            for i, vq in enumerate(self.vqs):
                if vq.ready:
                    self.parent.set_vq_state(i, vq.base)
        self.parent.set_status(status)
        self.trace.emit("vhost_status", status=status)

    def _vhost_vdpa_get_config_size(self, name: str, arg: CData) -> None:
        self._get(name, arg, "uint32_t", self.parent.get_config_size())

    def _config_range(self, name: str, c: CData, avail: int) -> tuple[int, int]:
        off, length = int(c.off), int(c.len)
        size = self.parent.get_config_size()
        if off > size or length > size - off:
            raise vhost_error(errno.EINVAL, f"{name}: [{off}, +{length}) is outside the "
                                            f"{size}-byte device configuration")
        if length > avail:
            raise vhost_error(errno.EFAULT, f"{name}: len {length} overruns the {avail}-byte buf")
        return off, length

    def _vhost_vdpa_get_config(self, name: str, arg: CData) -> None:
        ptr = self._ptr(name, arg, "struct vhost_vdpa_config")
        avail = uapi.ffi.sizeof(ptr[0]) - uapi.sizeof("struct vhost_vdpa_config")
        off, length = self._config_range(name, ptr[0], avail)
        if length:
            uapi.ffi.buffer(ptr[0].buf, length)[:] = self.parent.get_config(off, length)

    def _vhost_vdpa_set_config(self, name: str, arg: CData) -> None:
        ptr = self._ptr(name, arg, "struct vhost_vdpa_config")
        avail = uapi.ffi.sizeof(ptr[0]) - uapi.sizeof("struct vhost_vdpa_config")
        self._config_range(name, ptr[0], avail)
        raise vhost_error(errno.EOPNOTSUPP, f"{name}: the VA-1 device configuration is "
                                            "read-only")

    def _vhost_vdpa_get_vring_num(self, name: str, arg: CData) -> None:
        self._get(name, arg, "uint16_t", self.parent.vq_num_max)

    def _vhost_vdpa_get_vqs_count(self, name: str, arg: CData) -> None:
        self._get(name, arg, "uint32_t", len(self.vqs))

    def _vhost_vdpa_get_iova_range(self, name: str, arg: CData) -> None:
        r = self._struct(name, arg, "vhost_vdpa_iova_range")
        r.first, r.last = self.iova_range()

    def iova_range(self) -> tuple[int, int]:
        return 0, self.host.iommu.aperture_end - 1

    def _vhost_vdpa_set_config_call(self, name: str, arg: CData) -> None:
        fd = self._fd(name, self._set(name, arg, "int"))
        self.config_call = fd
        self.parent.set_config_cb(None if fd is None else self._signaller(fd))

    # queues
    def _vhost_set_vring_num(self, name: str, arg: CData) -> None:
        s = self._struct(name, arg, "vhost_vring_state")
        vq = self._vq(name, int(s.index))
        self._setup_allowed(name)
        num, top = int(s.num), self.parent.vq_num_max
        if not 0 < num <= top or num & (num - 1):
            raise vhost_error(errno.EINVAL, f"{name}: queue {s.index} size {num}: a power of two "
                                            f"in 1..{top}")
        vq.num = num
        self.parent.set_vq_num(int(s.index), num)

    def _vhost_set_vring_addr(self, name: str, arg: CData) -> None:
        a = self._struct(name, arg, "vhost_vring_addr")
        index = int(a.index)
        vq = self._vq(name, index)
        self._setup_allowed(name)
        if a.flags & ~(1 << uapi.VHOST_VRING_F_LOG):
            raise vhost_error(errno.EOPNOTSUPP, f"{name}: unknown flags {int(a.flags):#x}")
        desc, avail, used = int(a.desc_user_addr), int(a.avail_user_addr), int(a.used_user_addr)
        if desc % VRING_DESC_ALIGN or avail % VRING_AVAIL_ALIGN or used % VRING_USED_ALIGN:
            raise vhost_error(errno.EINVAL, f"{name}: queue {index}: desc {desc:#x} (16), avail "
                                            f"{avail:#x} (2), used {used:#x} (4) misaligned")
        num = vq.num or self.parent.vq_num_max
        for what, addr, size, write in (("desc", desc, 16 * num, False),
                                        ("avail", avail, 6 + 2 * num, False),
                                        ("used", used, 6 + 8 * num, True)):
            gap = self._uncovered(addr, size, write)
            if gap is not None:
                raise vhost_error(errno.EINVAL, f"{name}: queue {index} {what} ring [{addr:#x}, "
                                                f"+{size:#x}) is not covered by the IOTLB at "
                                                f"{gap:#x}")
        vq.desc, vq.avail, vq.used, vq.addr_set = desc, avail, used, True
        self.parent.set_vq_address(index, desc, avail, used)

    def _uncovered(self, iova: int, size: int, write: bool) -> int | None:
        """First IOVA of [iova, iova+size) the IOTLB does not map with the access needed."""
        pos, end = iova, iova + size
        while pos < end:
            m = self.domain.find(pos)
            if m is None or not m.read or (write and not m.write):
                return pos
            pos = m.end
        return None

    def _vhost_set_vring_base(self, name: str, arg: CData) -> None:
        s = self._struct(name, arg, "vhost_vring_state")
        vq = self._vq(name, int(s.index))
        self._setup_allowed(name)
        if s.num > 0xFFFF:
            raise vhost_error(errno.EINVAL, f"{name}: base {s.num} is above 0xffff")
        vq.base = int(s.num)
        if self.suspended:
            self.parent.set_vq_state(int(s.index), vq.base)

    def _vhost_get_vring_base(self, name: str, arg: CData) -> None:
        s = self._struct(name, arg, "vhost_vring_state")
        index = int(s.index)
        vq = self._vq(name, index)
        if self._status() & V.STATUS_DRIVER_OK:
            s.num = self.parent.get_vq_state(index)
        else:
            s.num = vq.base

    def _vhost_set_vring_kick(self, name: str, arg: CData) -> None:
        f = self._struct(name, arg, "vhost_vring_file")
        index = int(f.index)
        vq = self._vq(name, index)
        fd = self._fd(name, int(f.fd))
        if vq.kick is not None:
            self.host.eventfds.remove_waiter(vq.kick, self._kicker(index))
        vq.kick = fd
        if fd is not None:
            self.host.eventfds.add_waiter(fd, self._kicker(index))

    def _vhost_set_vring_call(self, name: str, arg: CData) -> None:
        f = self._struct(name, arg, "vhost_vring_file")
        index = int(f.index)
        vq = self._vq(name, index)
        fd = self._fd(name, int(f.fd))
        vq.call = fd
        self.parent.set_vq_cb(index, None if fd is None else self._signaller(fd))

    def _vhost_vdpa_set_vring_enable(self, name: str, arg: CData) -> None:
        s = self._struct(name, arg, "vhost_vring_state")
        index = int(s.index)
        vq = self._vq(name, index)
        if s.num and vq.addr_set:
            vq.ready = True
        self.parent.set_vq_ready(index, bool(s.num))

    def _vhost_reset_owner(self, name: str, arg: CData) -> None:
        self.parent.reset()
        self.owner = None

    # suspend / resume
    def _need_backend(self, name: str, bit: int) -> None:
        if not self.backend_features >> bit & 1:
            raise vhost_error(errno.EOPNOTSUPP, f"{name}: backend feature {bit} was not "
                                                "negotiated (VHOST_SET_BACKEND_FEATURES)")

    def _vhost_vdpa_suspend(self, name: str, arg: CData) -> None:
        self._need_backend(name, uapi.VHOST_BACKEND_F_SUSPEND)
        m = self.parent.migration
        assert m is not None  # offered only then
        if self._status() & V.STATUS_DRIVER_OK:
            m.suspend()
            drained = self.host.machine.wait_until(lambda: m.quiescent, SUSPEND_TIMEOUT_NS,
                                                   "vhost-vdpa suspend")
            if not drained:
                m.resume()
                raise vhost_error(errno.ETIMEDOUT, f"{name}: the device did not finish its "
                                                   f"work within {SUSPEND_TIMEOUT_NS} ns")
        self.suspended = True
        self.trace.emit("vhost_suspend")

    def _vhost_vdpa_resume(self, name: str, arg: CData) -> None:
        self._need_backend(name, uapi.VHOST_BACKEND_F_RESUME)
        m = self.parent.migration
        assert m is not None
        if m.suspended:
            m.resume()
        self.suspended = False
        self.trace.emit("vhost_resume")

    # -- eventfds ----------------------------------------------------------------------------

    def _signaller(self, fd: int) -> Callable[[], None]:
        return lambda: self.host.eventfds.signal(fd)

    def _kicker(self, index: int) -> Callable[[int], None]:
        """The kick eventfd's waiter of queue `index` (one per queue, so it can be
        removed): a signal rings the function's doorbell unless suspended."""
        k = self._kickers.get(index)
        if k is None:
            def kick(fd: int) -> None:
                if drain(fd) and not self.suspended and not self.closed:
                    self.parent.kick_vq(index)
            k = self._kickers[index] = kick
        return k

    # -- IOTLB --------------------------------------------------------------------------------

    def write(self, data: bytes | bytearray | memoryview, *, process: object = None) -> int:
        """write() of one struct vhost_msg_v2; returns the bytes taken."""
        who = self.opener if process is None else process
        name = "write(vhost_msg_v2)"
        self._check_owner(name, who)
        raw = bytes(data)
        if not self.backend_features >> uapi.VHOST_BACKEND_F_IOTLB_MSG_V2 & 1:
            raise vhost_error(errno.EINVAL, f"{name}: VHOST_BACKEND_F_IOTLB_MSG_V2 was not "
                                            "negotiated")
        if len(raw) < MSG_V2_SIZE:
            raise vhost_error(errno.EINVAL, f"{name}: {len(raw)} bytes, a message is "
                                            f"{MSG_V2_SIZE}")
        msg: CData = uapi.ffi.new("struct vhost_msg_v2 *")
        uapi.ffi.buffer(msg)[:] = raw[:MSG_V2_SIZE]
        if msg.type != uapi.VHOST_IOTLB_MSG_V2:
            raise vhost_error(errno.EINVAL, f"{name}: type {msg.type} is not VHOST_IOTLB_MSG_V2")
        if msg.asid != 0:
            raise vhost_error(errno.EINVAL, f"{name}: asid {msg.asid}: this device has one "
                                            "address space")
        m = msg.iotlb
        self._iotlb(name, int(m.type), int(m.iova), int(m.size), int(m.uaddr), int(m.perm))
        self.iotlb_msgs += 1
        return MSG_V2_SIZE

    def _iotlb(self, name: str, kind: int, iova: int, size: int, uaddr: int, perm: int) -> None:
        if kind in (uapi.VHOST_IOTLB_BATCH_BEGIN, uapi.VHOST_IOTLB_BATCH_END):
            if not self.backend_features >> uapi.VHOST_BACKEND_F_IOTLB_BATCH & 1:
                raise vhost_error(errno.EINVAL, f"{name}: batching needs "
                                                "VHOST_BACKEND_F_IOTLB_BATCH")
            if kind == uapi.VHOST_IOTLB_BATCH_BEGIN:
                if self.batch is not None:
                    raise vhost_error(errno.EINVAL, f"{name}: BATCH_BEGIN inside an open batch")
                self.batch = []
                return
            if self.batch is None:
                raise vhost_error(errno.EINVAL, f"{name}: BATCH_END without BATCH_BEGIN")
            held, self.batch = self.batch, None
            self._apply(held)
            self.trace.emit("iotlb_batch", ops=len(held))
            return
        if kind == uapi.VHOST_IOTLB_UPDATE:
            op = self._check_update(name, iova, size, uaddr, perm)
        elif kind == uapi.VHOST_IOTLB_INVALIDATE:
            if not size or (iova | size) & PAGE_MASK or iova + size > self.iova_range()[1] + 1:
                raise vhost_error(errno.EINVAL, f"{name}: INVALIDATE [{iova:#x}, +{size:#x}) must "
                                                "be non-zero, 4 KiB aligned, inside the IOVA range")
            op = ("unmap", iova, size, 0, 0)
        else:
            raise vhost_error(errno.EINVAL, f"{name}: IOTLB message type {kind} is not UPDATE, "
                                            "INVALIDATE, BATCH_BEGIN or BATCH_END")
        if self.batch is not None:
            self.batch.append(op)
        else:
            self._apply([op])

    def _check_update(self, name: str, iova: int, size: int, uaddr: int, perm: int
                      ) -> tuple[str, int, int, int, int]:
        if perm not in (uapi.VHOST_ACCESS_RO, uapi.VHOST_ACCESS_WO, uapi.VHOST_ACCESS_RW):
            raise vhost_error(errno.EINVAL, f"{name}: perm {perm} is not RO, WO or RW")
        if not size or (iova | size | uaddr) & PAGE_MASK:
            raise vhost_error(errno.EINVAL, f"{name}: UPDATE iova {iova:#x} size {size:#x} uaddr "
                                            f"{uaddr:#x}: non-zero and 4 KiB aligned")
        first, last = self.iova_range()
        if iova < first or iova + size - 1 > last:
            raise vhost_error(errno.EINVAL, f"{name}: [{iova:#x}, +{size:#x}) is outside the IOVA "
                                            f"range [{first:#x}, {last:#x}]")
        clash = next(self.domain.overlapping(iova, size), None)
        pending = [op for op in (self.batch or []) if op[0] == "map"
                   and op[1] < iova + size and iova < op[1] + op[2]]
        if clash is not None or pending:
            lo, hi = (clash.iova, clash.end) if clash is not None else \
                (pending[0][1], pending[0][1] + pending[0][2])
            raise vhost_error(errno.EEXIST, f"{name}: [{iova:#x}, +{size:#x}) overlaps the mapping "
                                            f"[{lo:#x}, {hi:#x})")
        if self._resolve(uaddr, size) is None:
            raise vhost_error(errno.EFAULT, f"{name}: uaddr [{uaddr:#x}, +{size:#x}) is not the "
                                            "caller's memory")
        return ("map", iova, size, uaddr, perm)

    def _resolve(self, uaddr: int, size: int) -> GuestMemory | None:
        for m in self.memory:
            if m.host_offset <= uaddr and uaddr + size <= m.host_offset + m.size:
                return m
        return None

    def _apply(self, ops: list[tuple[str, int, int, int, int]]) -> None:
        for kind, iova, size, uaddr, perm in ops:
            if kind == "map":
                mem = self._resolve(uaddr, size)
                assert mem is not None
                self.host.iommu.map(self.domain, iova, mem, mem.base + uaddr - mem.host_offset,
                                    size, read=bool(perm & uapi.VHOST_ACCESS_RO),
                                    write=bool(perm & uapi.VHOST_ACCESS_WO))
            else:
                self.host.iommu.unmap(self.domain, iova, size)

    def ring_index(self, index: int, which: str) -> int | None:
        """avail.idx ("avail") or used.idx ("used") of queue `index` as the device sees
        it through the IOTLB, or None when the queue is not set up or not mapped."""
        vq = self.vqs[index]
        if not vq.addr_set:
            return None
        iova = (vq.avail if which == "avail" else vq.used) + 2
        m = self.domain.find(iova)
        if m is None or m.end < iova + 2:
            return None
        at = m.index + iova - m.iova
        return int(m.array[at]) | int(m.array[at + 1]) << 8

    # -- release ------------------------------------------------------------------------------

    def close(self) -> None:
        """release(): the device reset, callbacks and kick waiters gone, the IOMMU domain
        (every mapping) dropped, an open batch discarded."""
        if self.closed:
            return
        self.parent.reset()
        self.parent.set_config_cb(None)
        for i, vq in enumerate(self.vqs):
            self.parent.set_vq_cb(i, None)
            if vq.kick is not None:
                self.host.eventfds.remove_waiter(vq.kick, self._kicker(i))
        self.batch = None
        rid = self.parent.hf.requester_id
        if self.host.iommu.domain_of(rid) is self.domain:
            self.host.iommu.detach(rid)
        self.host.iommu.destroy_domain(self.domain)
        self.closed = True
        self.device.opened = None

    def __enter__(self) -> "VhostVdpaFile":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def iotlb_msg(kind: int, iova: int = 0, size: int = 0, uaddr: int = 0,
              perm: int = uapi.VHOST_ACCESS_RW) -> bytes:
    """The bytes of one struct vhost_msg_v2 carrying an IOTLB message (what a VMM writes)."""
    msg: CData = uapi.ffi.new("struct vhost_msg_v2 *")
    msg.type = uapi.VHOST_IOTLB_MSG_V2
    msg.iotlb.type, msg.iotlb.iova, msg.iotlb.size = kind, iova, size
    msg.iotlb.uaddr, msg.iotlb.perm = uaddr, perm
    return bytes(uapi.ffi.buffer(msg))


__all__ = ["VhostVdpaFile", "iotlb_msg"]
