"""A hostile VMM user of vhost-vdpa and of the vdpa netlink family: the process that owns
the attacker VM's /dev/vhost-vdpa-N misuses it (ioctls, IOTLB messages, eventfds) and
sends the management family garbage, while the victim VM (its own vdpa device on
another function) works. Every refusal must be an errno with nothing changed; anything
else escaping is a FAIL, and reaching the victim is a breach."""
from __future__ import annotations

import errno
import os
import struct
from typing import Any, Callable

from vmm.eventfd import new_eventfd
from vmm.vdpa import uapi
from vmm.vdpa.netlink import VDPA_FAMILY_ID, VdpaClient, vdpamsg
from vmm.vdpa.vhost import iotlb_msg
from vmm.vfio.container import vaddr_of

from .core import Attack, Scenario, Setup
from .vfio_user import _refused

CAT = "vDPA"
VDPA = frozenset({"vdpa"})
PAGE = 4096


def _parts(a: Attack) -> tuple[Any, Any, Any]:
    """(the attacker's vhost file, its backend, the attacker VM's GuestMemory)."""
    vm = a.session.vms[0]
    v = vm.vdpa[0]
    return v.backend.vhost, v.backend, vm.memory


def _victim(a: Attack) -> tuple[Any, Any]:
    """(the victim's vdpa device, the victim VM's GuestMemory)."""
    vm = a.session.vms[1]
    host = a.session.host
    assert host is not None
    return host.vdpa.device(vm.vdpa[0].device_name), vm.memory


def _u(ctype: str, value: int = 0) -> Any:
    p = uapi.new(f"{ctype} *")
    p[0] = value
    return p


def _state(index: int, num: int) -> Any:
    s = uapi.new("struct vhost_vring_state *")
    s.index, s.num = index, num
    return s


def _vfile(index: int, fd: int) -> Any:
    f = uapi.new("struct vhost_vring_file *")
    f.index, f.fd = index, fd
    return f


def _ioctl(a: Attack, request: int, arg: Any = None, process: object = None) -> int:
    f, b, _ = _parts(a)
    return int(f.ioctl(request, arg, process=b.owner if process is None else process))


def _write(a: Attack, msg: bytes) -> int:
    f, b, _ = _parts(a)
    return int(f.write(msg, process=b.owner))


def _genl(a: Attack, admin: bool = True) -> Any:
    host = a.session.host
    assert host is not None
    return host.vdpa.genl.socket(admin=admin)


def catalogue() -> list[Scenario]:
    out: list[Scenario] = []

    def add(name: str, rule: str, fn: Callable[[Attack], object], doc: str) -> None:
        out.append(Scenario(f"vdpa/{name}", CAT, rule, fn, VDPA, Setup.HOST, doc))

    # -- IOTLB -------------------------------------------------------------------------------
    def update(iova: Callable[[Any], int], size: int, uaddr: Callable[[Attack, Any], int],
               perm: int = uapi.VHOST_ACCESS_RW, want: int | None = None
               ) -> Callable[[Attack], None]:
        def program(a: Attack) -> None:
            _, _, mem = _parts(a)
            msg = iotlb_msg(uapi.VHOST_IOTLB_UPDATE, iova(mem), size, uaddr(a, mem), perm)
            _refused(a, "IOTLB_UPDATE", lambda: _write(a, msg), want)
        return program

    def ram(a: Attack, mem: Any) -> int:
        return vaddr_of(mem, mem.base)

    def top(mem: Any) -> int:
        return int(mem.base + mem.size)
    for name, iova, size, uaddr, kw in (
            ("iotlb-overlap", lambda m: m.base, PAGE, ram, {"want": errno.EEXIST}),
            ("iotlb-unaligned", lambda m: top(m) + 12, PAGE, ram, {"want": errno.EINVAL}),
            ("iotlb-size-zero", top, 0, ram, {"want": errno.EINVAL}),
            ("iotlb-past-range", lambda m: 1 << 48, PAGE, ram, {"want": errno.EINVAL}),
            ("iotlb-wraps", lambda m: (1 << 64) - PAGE, 2 * PAGE, ram, {"want": errno.EINVAL}),
            ("iotlb-uaddr-outside", top, PAGE, lambda a, m: 1 << 40, {"want": errno.EFAULT}),
            ("iotlb-no-access", top, PAGE, ram, {"perm": 0, "want": errno.EINVAL})):
        add(name, "vhost/iotlb", update(iova, size, uaddr, **kw),
            f"VHOST_IOTLB_UPDATE: {name[6:].replace('-', ' ')}")

    def iotlb_victim_uaddr(a: Attack) -> None:
        """The victim VMM's uaddr of its RAM: in this process it can only name the
        attacker's own memory; no IOVA may reach the victim's RAM."""
        f, _, mem = _parts(a)
        vmem = _victim(a)[1]
        iova = 1 << 32
        msg = iotlb_msg(uapi.VHOST_IOTLB_UPDATE, iova, PAGE, vaddr_of(vmem, vmem.base + (1 << 20)))
        _refused(a, "IOTLB_UPDATE", lambda: _write(a, msg))
        m = f.domain.find(iova)
        if m is not None and m.backing is vmem:
            a.breach("vhost/foreign-memory", "an IOVA of the attacker's IOTLB maps the victim "
                     "VM's RAM")
    add("iotlb-victim-uaddr", "vhost/iotlb", iotlb_victim_uaddr,
        "IOTLB_UPDATE naming the victim VMM's uaddr of its RAM")

    for name, kind, want in (("iotlb-miss-from-user", uapi.VHOST_IOTLB_MISS, errno.EINVAL),
                             ("iotlb-access-fail-from-user", uapi.VHOST_IOTLB_ACCESS_FAIL,
                              errno.EINVAL),
                             ("iotlb-type-99", 99, errno.EINVAL),
                             ("iotlb-batch-end-alone", uapi.VHOST_IOTLB_BATCH_END, errno.EINVAL)):
        def kind_case(a: Attack, k: int = kind, w: int = want) -> None:
            _refused(a, "IOTLB message", lambda: _write(a, iotlb_msg(k)), w)
        add(name, "vhost/iotlb", kind_case, f"IOTLB message: {name[6:].replace('-', ' ')}")

    def short_write(a: Attack) -> None:
        _refused(a, "write", lambda: _write(a, iotlb_msg(uapi.VHOST_IOTLB_UPDATE)[:17]),
                 errno.EINVAL)
    add("iotlb-short-write", "vhost/iotlb", short_write, "a 17-byte IOTLB message")

    def bad_asid(a: Attack) -> None:
        msg = bytearray(iotlb_msg(uapi.VHOST_IOTLB_UPDATE))
        struct.pack_into("<I", msg, 4, 7)
        _refused(a, "write", lambda: _write(a, bytes(msg)), errno.EINVAL)
    add("iotlb-asid-7", "vhost/iotlb", bad_asid, "an IOTLB message for address space 7")

    def invalidate_and_remap(a: Attack) -> None:
        """Invalidate all guest RAM under the running function, then map it back."""
        _, _, mem = _parts(a)
        if a.ctx is not None:
            from hwspec import isa
            from .raw import cmd
            a.dev.submit(a.ctx, cmd(isa.Opcode.NOP), timeout_ns=100_000)
        _write(a, iotlb_msg(uapi.VHOST_IOTLB_INVALIDATE, mem.base, mem.size))
        a.sleep(50_000)
        _write(a, iotlb_msg(uapi.VHOST_IOTLB_UPDATE, mem.base, mem.size, vaddr_of(mem, mem.base)))
    add("iotlb-invalidate-ram-and-remap", "vhost/iotlb", invalidate_and_remap,
        "invalidate all guest RAM under the function, then map it back")

    def batch_left_open(a: Attack) -> None:
        """A batch begun and not ended: DRIVER_OK is refused until it is."""
        _, _, mem = _parts(a)
        _write(a, iotlb_msg(uapi.VHOST_IOTLB_BATCH_BEGIN))
        _refused(a, "BATCH_BEGIN again", lambda: _write(a, iotlb_msg(uapi.VHOST_IOTLB_BATCH_BEGIN)),
                 errno.EINVAL)
        _refused(a, "IOTLB overlap in the batch", lambda: _write(a, iotlb_msg(
            uapi.VHOST_IOTLB_UPDATE, mem.base, PAGE, vaddr_of(mem, mem.base))), errno.EEXIST)
        _ioctl(a, uapi.VHOST_VDPA_SET_STATUS, _u("uint8_t", 0))
        _ioctl(a, uapi.VHOST_VDPA_SET_STATUS, _u("uint8_t", 0x03))
        _ioctl(a, uapi.VHOST_SET_FEATURES, _u("uint64_t", 1 << 32))
        _ioctl(a, uapi.VHOST_VDPA_SET_STATUS, _u("uint8_t", 0x0B))
        _refused(a, "DRIVER_OK with a batch open",
                 lambda: _ioctl(a, uapi.VHOST_VDPA_SET_STATUS, _u("uint8_t", 0x0F)), errno.EBUSY)
        _write(a, iotlb_msg(uapi.VHOST_IOTLB_BATCH_END))
    add("iotlb-batch-left-open", "vhost/iotlb", batch_left_open,
        "an IOTLB batch begun and not ended, then DRIVER_OK")

    # -- ioctls ------------------------------------------------------------------------------
    def ioctl_case(request: int, arg: Callable[[Attack], Any], want: int | None,
                   process: object = None) -> Callable[[Attack], None]:
        def program(a: Attack) -> None:
            _refused(a, uapi.IOCTL_NAMES.get(request, hex(request)),
                     lambda: _ioctl(a, request, arg(a), process), want)
        return program

    def closed_fd(a: Attack) -> int:
        fd = new_eventfd()
        os.close(fd)
        return fd

    cases: list[tuple[str, str, int, Callable[[Attack], Any], int | None, object]] = [
        ("non-owner-get-features", "vhost/owner", uapi.VHOST_GET_FEATURES,
         lambda a: _u("uint64_t"), errno.EPERM, "intruder"),
        ("set-owner-again", "vhost/owner", uapi.VHOST_SET_OWNER, lambda a: None, errno.EBUSY, None),
        ("unknown-ioctl", "vhost/ioctl", 0xAF99, lambda a: None, errno.ENOTTY, None),
        ("features-after-features-ok", "vhost/features", uapi.VHOST_SET_FEATURES,
         lambda a: _u("uint64_t", (1 << 64) - 1), errno.EBUSY, None),
        ("backend-features-unknown", "vhost/features", uapi.VHOST_SET_BACKEND_FEATURES,
         lambda a: _u("uint64_t", 1 << 40), errno.EOPNOTSUPP, None),
        ("status-clear-bits", "vhost/status", uapi.VHOST_VDPA_SET_STATUS,
         lambda a: _u("uint8_t", 0x01), errno.EINVAL, None),
        ("vring-num-live", "vhost/vring", uapi.VHOST_SET_VRING_NUM,
         lambda a: _state(2, 64), errno.EBUSY, None),
        ("vring-index-huge", "vhost/vring", uapi.VHOST_VDPA_SET_VRING_ENABLE,
         lambda a: _state(0xFFFF_FFFF, 1), errno.ENOBUFS, None),
        ("vring-base-huge", "vhost/vring", uapi.VHOST_GET_VRING_BASE,
         lambda a: _state(4, 0), errno.ENOBUFS, None),
        ("kick-closed-fd", "vhost/eventfd", uapi.VHOST_SET_VRING_KICK,
         lambda a: _vfile(2, closed_fd(a)), errno.EBADF, None),
        ("config-call-fd-negative", "vhost/eventfd", uapi.VHOST_VDPA_SET_CONFIG_CALL,
         lambda a: _u("int", -7), errno.EBADF, None),
        ("config-past-end", "vhost/config", uapi.VHOST_VDPA_GET_CONFIG,
         lambda a: _config(64, 4096), errno.EINVAL, None),
        ("config-overrun-buf", "vhost/config", uapi.VHOST_VDPA_GET_CONFIG,
         lambda a: _config(0, 64, buf=4), errno.EFAULT, None),
        ("config-write", "vhost/config", uapi.VHOST_VDPA_SET_CONFIG,
         lambda a: _config(0, 4), errno.EOPNOTSUPP, None),
        ("arg-wrong-type", "vhost/ioctl", uapi.VHOST_VDPA_GET_STATUS,
         lambda a: _u("uint64_t"), errno.EFAULT, None),
    ]
    for name, rule, request, arg, expect, process in cases:
        add(name, rule, ioctl_case(request, arg, expect, process),
            f"{uapi.IOCTL_NAMES.get(request, hex(request))}: {name.replace('-', ' ')}")

    def call_not_eventfd(a: Attack) -> None:
        """A pipe as a call eventfd."""
        r, w = os.pipe()
        try:
            _refused(a, "SET_VRING_CALL", lambda: _ioctl(a, uapi.VHOST_SET_VRING_CALL,
                                                         _vfile(2, r)), errno.EINVAL)
        finally:
            os.close(r)
            os.close(w)
    add("call-not-eventfd", "vhost/eventfd", call_not_eventfd, "a pipe as a call eventfd")

    def vring_addr_unmapped(a: Attack) -> None:
        """Ring addresses outside the IOTLB on a suspended device (setup allowed)."""
        _ioctl(a, uapi.VHOST_VDPA_SUSPEND)
        ad = uapi.new("struct vhost_vring_addr *")
        ad.index, ad.desc_user_addr = 2, 1 << 40
        ad.avail_user_addr, ad.used_user_addr = (1 << 40) + 0x1000, (1 << 40) + 0x2000
        _refused(a, "SET_VRING_ADDR", lambda: _ioctl(a, uapi.VHOST_SET_VRING_ADDR, ad),
                 errno.EINVAL)
        ad.desc_user_addr = 8
        _refused(a, "SET_VRING_ADDR misaligned", lambda: _ioctl(a, uapi.VHOST_SET_VRING_ADDR, ad),
                 errno.EINVAL)
        _ioctl(a, uapi.VHOST_VDPA_RESUME)
    add("vring-addr-outside-iotlb", "vhost/vring", vring_addr_unmapped,
        "SET_VRING_ADDR outside the IOTLB and misaligned, on a suspended device")

    def suspend_storm(a: Attack) -> None:
        """SUSPEND/RESUME 50 times while the function works; GET_VRING_BASE between."""
        if a.ctx is not None:
            from hwspec import isa
            from .raw import cmd
            a.dev.submit(a.ctx, cmd(isa.Opcode.NOP), timeout_ns=100_000)
        for _ in range(50):
            _ioctl(a, uapi.VHOST_VDPA_SUSPEND)
            _ioctl(a, uapi.VHOST_GET_VRING_BASE, _state(2, 0))
            _ioctl(a, uapi.VHOST_VDPA_RESUME)
    add("suspend-resume-storm", "vhost/suspend", suspend_storm,
        "SUSPEND and RESUME 50 times while the function works")

    def kick_storm(a: Attack) -> None:
        """10000 signals on every kick eventfd, and on the call eventfds too."""
        _, b, _ = _parts(a)
        for fd in b.kick + b.call:
            for _ in range(2000):
                b.eventfds.signal(fd)
    add("eventfd-storm", "vhost/eventfd", kick_storm,
        "thousands of signals on the kick and call eventfds")

    # -- management ----------------------------------------------------------------------------
    def open_victim(a: Attack) -> None:
        host = a.session.host
        assert host is not None
        dev, vmem = _victim(a)
        _refused(a, "open victim's vhost file",
                 lambda: host.vdpa.open(dev.vhost_path, [_parts(a)[2]], "intruder"),
                 errno.EBUSY, "vdpa/foreign-device")
    add("open-victim-vhost", "vdpa/bus", open_victim, "open the victim's /dev/vhost-vdpa-N")

    def del_victim(a: Attack) -> None:
        dev, _ = _victim(a)
        for admin, want in ((False, errno.EPERM), (True, errno.EBUSY)):
            c = VdpaClient(_genl(a, admin))
            _refused(a, f"DEV_DEL victim (admin={admin})", lambda: c.dev_del(dev.name), want,
                     "vdpa/foreign-device")
    add("netlink-del-victim", "vdpa/netlink", del_victim,
        "DEV_DEL of the victim's device, without and with CAP_NET_ADMIN")

    def new_on_victim(a: Attack) -> None:
        dev, _ = _victim(a)
        c = VdpaClient(_genl(a))
        _refused(a, "DEV_NEW on the victim's function",
                 lambda: c.dev_add("evil", dev.mgmtdev.handle), errno.EBUSY, "vdpa/foreign-device")
        own = a.session.vms[0].vdpa[0]
        host = a.session.host
        assert host is not None
        _refused(a, "DEV_NEW with the victim's name", lambda: c.dev_add(
            dev.name, host.vdpa.device(own.device_name).mgmtdev.handle), errno.EEXIST)
    add("netlink-new-on-victim", "vdpa/netlink", new_on_victim,
        "DEV_NEW on the victim's management device and with its name")

    def garbage(a: Attack) -> None:
        """400 seeded malformed requests: truncated, wrong family, version, command,
        attributes; every one answered by a netlink error, none changes the bus."""
        host = a.session.host
        assert host is not None
        sock = _genl(a, admin=True)
        before = sorted(host.vdpa.devices)
        for _ in range(400):
            m = vdpamsg()
            m["cmd"] = a.rng.choice([0, 1, 3, 4, 5, 6, 7, 8, 200])
            m["version"] = a.rng.choice([0, 1, 1, 2])
            m["attrs"] = []
            m["header"]["type"] = a.rng.choice([VDPA_FAMILY_ID, VDPA_FAMILY_ID, 0x10, 0x33])
            m["header"]["flags"] = a.rng.choice([1, 0x301, 5])
            m.encode()
            data = bytearray(m.data)
            data += a.rng.randbytes(a.rng.randrange(0, 40))
            cut = a.rng.randrange(0, len(data) + 1)
            data = data[:cut] if a.rng.random() < 0.3 else data
            sock.send(bytes(data))
            while True:
                try:
                    sock.recv()
                except BlockingIOError:
                    break
        if sorted(host.vdpa.devices) != before:
            a.breach("vdpa/netlink", f"devices changed: {before} -> {sorted(host.vdpa.devices)}")
    add("netlink-garbage", "vdpa/netlink", garbage, "400 malformed vdpa netlink requests")
    return out


def _config(off: int, length: int, buf: int | None = None) -> Any:
    c = uapi.new("struct vhost_vdpa_config *", {"buf": length if buf is None else buf})
    c.off, c.len = off, length
    return c
