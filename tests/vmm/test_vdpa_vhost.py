"""/dev/vhost-vdpa-N: the ioctls and IOTLB messages a VMM uses, and every bad request of
the issue refused with its errno, naming what was wrong, and changing nothing."""
from __future__ import annotations

import errno
import os
from typing import Any, Callable, Iterator

import pytest

from vmm.eventfd import new_eventfd
from vmm.host import Host
from vmm.machine import Machine
from vmm.memory import GuestMemory, HostMemory
from vmm.vdpa import VhostError, VhostVdpaFile, iotlb_msg, uapi
from vmm.vfio.container import vaddr_of

RAM = 1 << 20
V2 = 1 << uapi.VHOST_BACKEND_F_IOTLB_MSG_V2 | 1 << uapi.VHOST_BACKEND_F_IOTLB_BATCH


class Rig:
    def __init__(self) -> None:
        self.host = Host(Machine(3))
        self.host.vdpa.register(self.host.add_va1())
        self.dev = self.host.vdpa.dev_add("acc0", "pci/0000:01:00.0")
        self.hm = HostMemory(RAM + 0x10000)
        self.hm.carve(0x3000)
        self.mem = GuestMemory(self.hm, 0x4000_0000, RAM)
        self.f: VhostVdpaFile = self.host.vdpa.open(self.dev.vhost_path, [self.mem], "vmm")
        self.fds: list[int] = []

    def ioctl(self, request: int, arg: Any = None, process: object = None) -> int:
        return self.f.ioctl(request, arg, process=process)

    def u(self, ctype: str, value: int = 0) -> Any:
        p = uapi.new(f"{ctype} *")
        p[0] = value
        return p

    def get(self, ctype: str, request: int) -> int:
        p = self.u(ctype)
        self.ioctl(request, p)
        return int(p[0])

    def state(self, index: int = 0, num: int = 0) -> Any:
        s = uapi.new("struct vhost_vring_state *")
        s.index, s.num = index, num
        return s

    def addr(self, index: int, desc: int, avail: int, used: int, flags: int = 0) -> Any:
        a = uapi.new("struct vhost_vring_addr *")
        a.index, a.flags = index, flags
        a.desc_user_addr, a.avail_user_addr, a.used_user_addr = desc, avail, used
        return a

    def file(self, index: int, fd: int) -> Any:
        f = uapi.new("struct vhost_vring_file *")
        f.index, f.fd = index, fd
        return f

    def map(self, iova: int, size: int, gpa: int, perm: int = uapi.VHOST_ACCESS_RW) -> None:
        self.f.write(iotlb_msg(uapi.VHOST_IOTLB_UPDATE, iova, size, vaddr_of(self.mem, gpa), perm))

    def owned(self) -> "Rig":
        self.ioctl(uapi.VHOST_SET_OWNER)
        self.ioctl(uapi.VHOST_SET_BACKEND_FEATURES, self.u("uint64_t", V2))
        return self

    def eventfd(self) -> int:
        fd = new_eventfd()
        self.fds.append(fd)
        return fd

    def snapshot(self) -> tuple[Any, ...]:
        f = self.f
        vqs = tuple((v.num, v.desc, v.avail, v.used, v.base, v.kick, v.call, v.ready)
                    for v in f.vqs)
        maps = tuple((m.iova, m.size, m.read, m.write) for m in f.domain.mappings)
        p = f.parent
        return (f.owner, f.backend_features, vqs, maps, f.batch, f.config_call, f.suspended,
                p.get_status(), p.get_driver_features())

    def close(self) -> None:
        self.f.close()
        for fd in self.fds:
            os.close(fd)
        self.hm.close()
        self.host.close()


@pytest.fixture
def rig() -> Iterator[Rig]:
    r = Rig()
    yield r
    r.close()


def test_a_queue_set_up_by_the_book(rig: Rig) -> None:
    r = rig.owned()
    assert r.get("uint32_t", uapi.VHOST_VDPA_GET_DEVICE_ID) == 60
    assert r.get("uint32_t", uapi.VHOST_VDPA_GET_VQS_COUNT) == 4
    assert r.get("uint16_t", uapi.VHOST_VDPA_GET_VRING_NUM) == 256
    assert r.get("uint32_t", uapi.VHOST_VDPA_GET_CONFIG_SIZE) == 72
    rng = uapi.new("struct vhost_vdpa_iova_range *")
    r.ioctl(uapi.VHOST_VDPA_GET_IOVA_RANGE, rng)
    assert (rng.first, rng.last) == (0, (1 << 48) - 1)
    r.f.write(iotlb_msg(uapi.VHOST_IOTLB_BATCH_BEGIN))
    r.map(0x10000, 0x4000, r.mem.base)
    assert r.f.domain.mappings == ()                  # held until BATCH_END
    r.f.write(iotlb_msg(uapi.VHOST_IOTLB_BATCH_END))
    assert [(m.iova, m.size) for m in r.f.domain.mappings] == [(0x10000, 0x4000)]
    r.ioctl(uapi.VHOST_SET_VRING_NUM, r.state(2, 64))
    r.ioctl(uapi.VHOST_SET_VRING_ADDR, r.addr(2, 0x10000, 0x11000, 0x12000))
    r.ioctl(uapi.VHOST_SET_VRING_KICK, r.file(2, r.eventfd()))
    r.ioctl(uapi.VHOST_SET_VRING_CALL, r.file(2, r.eventfd()))
    r.ioctl(uapi.VHOST_SET_VRING_BASE, r.state(2, 7))
    st = r.state(2)
    r.ioctl(uapi.VHOST_GET_VRING_BASE, st)
    assert st.num == 7
    c = uapi.new("struct vhost_vdpa_config *", {"buf": 8})
    c.off, c.len = 0, 8
    r.ioctl(uapi.VHOST_VDPA_GET_CONFIG, c)
    assert bytes(uapi.ffi.buffer(c.buf, 4)) == (2).to_bytes(4, "little")  # num_submit_queues
    r.f.write(iotlb_msg(uapi.VHOST_IOTLB_INVALIDATE, 0x11000, 0x1000))
    assert [(m.iova, m.size) for m in r.f.domain.mappings] == [(0x10000, 0x1000),
                                                               (0x12000, 0x2000)]


def _ok_ring(r: Rig) -> None:
    r.owned()
    r.map(0x10000, 0x4000, r.mem.base)
    r.ioctl(uapi.VHOST_SET_VRING_NUM, r.state(2, 64))


def _features_ok(r: Rig) -> None:
    r.owned()
    r.ioctl(uapi.VHOST_VDPA_SET_STATUS, r.u("uint8_t", 0x03))
    r.ioctl(uapi.VHOST_SET_FEATURES, r.u("uint64_t", 1 << 32))
    r.ioctl(uapi.VHOST_VDPA_SET_STATUS, r.u("uint8_t", 0x0B))


def _not_eventfd(r: Rig) -> int:
    rfd, wfd = os.pipe()
    r.fds += [rfd, wfd]
    return rfd


def _closed_fd(r: Rig) -> int:
    fd = new_eventfd()
    os.close(fd)
    return fd


Case = tuple[str, Callable[[Rig], None], Callable[[Rig], Any], int, str]
CASES: list[Case] = [
    ("ioctl before SET_OWNER", lambda r: None,
     lambda r: r.get("uint64_t", uapi.VHOST_GET_FEATURES), errno.EPERM, "no owner"),
    ("ioctl from a non-owner", lambda r: r.owned(),
     lambda r: r.ioctl(uapi.VHOST_GET_FEATURES, r.u("uint64_t"), process="intruder"),
     errno.EPERM, "not the owner"),
    ("IOTLB write from a non-owner", lambda r: r.owned(),
     lambda r: r.f.write(iotlb_msg(uapi.VHOST_IOTLB_UPDATE, 0, 0x1000,
                                   vaddr_of(r.mem, r.mem.base)), process="intruder"),
     errno.EPERM, "not the owner"),
    ("SET_OWNER twice", lambda r: r.owned(), lambda r: r.ioctl(uapi.VHOST_SET_OWNER),
     errno.EBUSY, "already has an owner"),
    ("unknown ioctl", lambda r: r.owned(), lambda r: r.ioctl(0xDEAD), errno.ENOTTY,
     "not a vhost-vdpa ioctl"),
    ("argument of the wrong type", lambda r: r.owned(),
     lambda r: r.ioctl(uapi.VHOST_GET_FEATURES, r.u("uint32_t")), errno.EFAULT, "uint64_t"),
    ("features not offered", lambda r: r.owned(),
     lambda r: r.ioctl(uapi.VHOST_SET_FEATURES, r.u("uint64_t", 1 << 37 | 1 << 32)),
     errno.EINVAL, "not offered"),
    ("features after FEATURES_OK", _features_ok,
     lambda r: r.ioctl(uapi.VHOST_SET_FEATURES, r.u("uint64_t", 1 << 32)), errno.EBUSY,
     "FEATURES_OK"),
    ("status clearing a bit", _features_ok,
     lambda r: r.ioctl(uapi.VHOST_VDPA_SET_STATUS, r.u("uint8_t", 0x03)), errno.EINVAL,
     "clears bits"),
    ("backend features not offered", lambda r: r.ioctl(uapi.VHOST_SET_OWNER),
     lambda r: r.ioctl(uapi.VHOST_SET_BACKEND_FEATURES, r.u("uint64_t", 1 << 3)),
     errno.EOPNOTSUPP, "not offered"),
    ("ring size not a power of two", lambda r: r.owned(),
     lambda r: r.ioctl(uapi.VHOST_SET_VRING_NUM, r.state(2, 48)), errno.EINVAL, "power of two"),
    ("ring size above the maximum", lambda r: r.owned(),
     lambda r: r.ioctl(uapi.VHOST_SET_VRING_NUM, r.state(2, 512)), errno.EINVAL, "1..256"),
    ("ring size 0", lambda r: r.owned(),
     lambda r: r.ioctl(uapi.VHOST_SET_VRING_NUM, r.state(2, 0)), errno.EINVAL, "power of two"),
    ("queue index out of range", lambda r: r.owned(),
     lambda r: r.ioctl(uapi.VHOST_SET_VRING_NUM, r.state(4, 64)), errno.ENOBUFS,
     "queue index 4"),
    ("queue index out of range (enable)", lambda r: r.owned(),
     lambda r: r.ioctl(uapi.VHOST_VDPA_SET_VRING_ENABLE, r.state(9, 1)), errno.ENOBUFS,
     "queue index 9"),
    ("desc misaligned", _ok_ring,
     lambda r: r.ioctl(uapi.VHOST_SET_VRING_ADDR, r.addr(2, 0x10008, 0x11000, 0x12000)),
     errno.EINVAL, "misaligned"),
    ("used misaligned", _ok_ring,
     lambda r: r.ioctl(uapi.VHOST_SET_VRING_ADDR, r.addr(2, 0x10000, 0x11000, 0x12002)),
     errno.EINVAL, "misaligned"),
    ("ring not covered by the IOTLB", _ok_ring,
     lambda r: r.ioctl(uapi.VHOST_SET_VRING_ADDR, r.addr(2, 0x10000, 0x11000, 0x14000)),
     errno.EINVAL, "not covered by the IOTLB at 0x14000"),
    ("used ring read-only in the IOTLB", lambda r: (_ok_ring(r), r.map(0x20000, 0x1000,
                                                    r.mem.base + 0x8000, uapi.VHOST_ACCESS_RO)),
     lambda r: r.ioctl(uapi.VHOST_SET_VRING_ADDR, r.addr(2, 0x10000, 0x11000, 0x20000)),
     errno.EINVAL, "used ring"),
    ("unknown vring address flags", _ok_ring,
     lambda r: r.ioctl(uapi.VHOST_SET_VRING_ADDR, r.addr(2, 0x10000, 0x11000, 0x12000, 0x4)),
     errno.EOPNOTSUPP, "unknown flags"),
    ("base above 16 bits", lambda r: r.owned(),
     lambda r: r.ioctl(uapi.VHOST_SET_VRING_BASE, r.state(2, 0x10000)), errno.EINVAL, "0xffff"),
    ("kick fd not an eventfd", lambda r: r.owned(),
     lambda r: r.ioctl(uapi.VHOST_SET_VRING_KICK, r.file(2, _not_eventfd(r))), errno.EINVAL,
     "not an eventfd"),
    ("call fd not an eventfd", lambda r: r.owned(),
     lambda r: r.ioctl(uapi.VHOST_SET_VRING_CALL, r.file(2, _not_eventfd(r))), errno.EINVAL,
     "not an eventfd"),
    ("config call fd closed", lambda r: r.owned(),
     lambda r: r.ioctl(uapi.VHOST_VDPA_SET_CONFIG_CALL, r.u("int", _closed_fd(r))), errno.EBADF,
     "not open"),
    ("IOTLB overlap", lambda r: (r.owned(), r.map(0x10000, 0x4000, r.mem.base)),
     lambda r: r.map(0x13000, 0x2000, r.mem.base + 0x8000), errno.EEXIST, "overlaps"),
    ("IOTLB overlap inside a batch", lambda r: (r.owned(), r.f.write(iotlb_msg(
        uapi.VHOST_IOTLB_BATCH_BEGIN)), r.map(0x10000, 0x4000, r.mem.base)),
     lambda r: r.map(0x11000, 0x1000, r.mem.base), errno.EEXIST, "overlaps"),
    ("IOTLB outside the IOVA range", lambda r: r.owned(),
     lambda r: r.map(1 << 48, 0x1000, r.mem.base), errno.EINVAL, "outside the IOVA range"),
    ("IOTLB uaddr outside the caller's memory", lambda r: r.owned(),
     lambda r: r.f.write(iotlb_msg(uapi.VHOST_IOTLB_UPDATE, 0, 0x1000, 0x4000_0000)),
     errno.EFAULT, "not the caller's memory"),
    ("IOTLB bad perm", lambda r: r.owned(),
     lambda r: r.map(0, 0x1000, r.mem.base, perm=0), errno.EINVAL, "perm 0"),
    ("IOTLB short write", lambda r: r.owned(),
     lambda r: r.f.write(iotlb_msg(uapi.VHOST_IOTLB_UPDATE)[:40]), errno.EINVAL, "40 bytes"),
    ("IOTLB without MSG_V2", lambda r: r.ioctl(uapi.VHOST_SET_OWNER),
     lambda r: r.map(0, 0x1000, r.mem.base), errno.EINVAL, "MSG_V2"),
    ("IOTLB MISS from user space", lambda r: r.owned(),
     lambda r: r.f.write(iotlb_msg(uapi.VHOST_IOTLB_MISS)), errno.EINVAL, "type 1"),
    ("second BATCH_BEGIN", lambda r: (r.owned(), r.f.write(iotlb_msg(uapi.VHOST_IOTLB_BATCH_BEGIN))),
     lambda r: r.f.write(iotlb_msg(uapi.VHOST_IOTLB_BATCH_BEGIN)), errno.EINVAL, "inside an open"),
    ("BATCH_END without BEGIN", lambda r: r.owned(),
     lambda r: r.f.write(iotlb_msg(uapi.VHOST_IOTLB_BATCH_END)), errno.EINVAL, "without"),
    ("batch never ended, then DRIVER_OK", lambda r: (
        _features_ok(r), r.f.write(iotlb_msg(uapi.VHOST_IOTLB_BATCH_BEGIN)),
        r.map(0x10000, 0x1000, r.mem.base)),
     lambda r: r.ioctl(uapi.VHOST_VDPA_SET_STATUS, r.u("uint8_t", 0x0F)), errno.EBUSY,
     "IOTLB batch is open"),
    ("SUSPEND without the backend feature", lambda r: r.owned(),
     lambda r: r.ioctl(uapi.VHOST_VDPA_SUSPEND), errno.EOPNOTSUPP, "backend feature 4"),
    ("RESUME without the backend feature", lambda r: r.owned(),
     lambda r: r.ioctl(uapi.VHOST_VDPA_RESUME), errno.EOPNOTSUPP, "backend feature 5"),
    ("config read past the end", lambda r: r.owned(),
     lambda r: r.ioctl(uapi.VHOST_VDPA_GET_CONFIG, _config(70, 8)), errno.EINVAL,
     "outside the 72-byte"),
    ("config read larger than its buffer", lambda r: r.owned(),
     lambda r: r.ioctl(uapi.VHOST_VDPA_GET_CONFIG, _config(0, 16, buf=8)), errno.EFAULT,
     "overruns"),
]


def _config(off: int, length: int, buf: int | None = None) -> Any:
    c = uapi.new("struct vhost_vdpa_config *", {"buf": length if buf is None else buf})
    c.off, c.len = off, length
    return c


@pytest.mark.parametrize("case, setup, bad, code, words", CASES, ids=[c[0] for c in CASES])
def test_bad_request_is_refused_and_changes_nothing(
        rig: Rig, case: str, setup: Callable[[Rig], None], bad: Callable[[Rig], Any], code: int,
        words: str) -> None:
    setup(rig)
    before = rig.snapshot()
    with pytest.raises(VhostError) as e:
        bad(rig)
    assert e.value.errno == code, (case, e.value)
    assert words in str(e.value), (case, str(e.value))
    assert rig.snapshot() == before


def test_a_batch_open_at_close_is_dropped(rig: Rig) -> None:
    r = rig.owned()
    r.f.write(iotlb_msg(uapi.VHOST_IOTLB_BATCH_BEGIN))
    r.map(0x10000, 0x1000, r.mem.base)
    domain = r.f.domain
    r.f.close()
    assert domain.destroyed and r.f.batch is None
    assert r.host.iommu.domain_of(r.dev.parent.hf.requester_id) is None
    with pytest.raises(VhostError) as e:
        r.ioctl(uapi.VHOST_GET_FEATURES, r.u("uint64_t"))
    assert e.value.errno == errno.EBADF
    r.f = r.host.vdpa.open(r.dev.vhost_path, [r.mem], "vmm")   # the device can be reopened
