"""The host's vdpa bus: management devices, vdpa devices, and their vhost-vdpa files.

Why: this is the state the vdpa netlink family reads and changes (drivers/vdpa/vdpa.c).
A parent driver bound to a function registers a management device (`pci/<bdf>`);
DEV_NEW creates a named vdpa device on it, which vhost-vdpa exposes as
/dev/vhost-vdpa-N; DEV_DEL removes it. The rules, with the kernel's errnos:
- a management device that does not exist: ENODEV; a device name already used: EEXIST;
  a name empty or longer than 15 bytes (IFNAMSIZ): EINVAL; a management device already
  holding its one device (vp_vdpa has one per function): EBUSY (EEXIST in Linux);
- DEV_DEL or DEV_GET of a name that does not exist: ENODEV; DEV_DEL while the device's
  vhost file is open: EBUSY (the kernel would block until it is closed);
- opening /dev/vhost-vdpa-N that does not exist: ENOENT; one open at a time: EBUSY.
A refused request changes nothing.
"""
from __future__ import annotations

import errno
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from hwspec import va1

from ..memory import GuestMemory
from .errors import vdpa_error
from .parent import VpVdpa

if TYPE_CHECKING:
    from ..host import Host, HostPciFunction
    from .netlink import VdpaGenl
    from .vhost import VhostVdpaFile

NAME_MAX = 15          # IFNAMSIZ - 1
MIN_VQ_SIZE = 1
VHOST_VDPA_DIR = "/dev/vhost-vdpa-"


@dataclass
class MgmtDev:
    """A management device: a parent driver ready to create one vdpa device."""
    bus_name: str        # "pci"
    dev_name: str        # "0000:01:00.1"
    parent: VpVdpa
    device: "VdpaDevice | None" = None

    @property
    def handle(self) -> str:
        return f"{self.bus_name}/{self.dev_name}"

    @property
    def supported_classes(self) -> int:
        return 1 << va1.VIRTIO_DEVICE_ID

    @property
    def max_vqs(self) -> int:
        return self.parent.num_queues

    @property
    def supported_features(self) -> int:
        return self.parent.device_features


@dataclass
class VdpaDevice:
    """One vdpa device: a name, its management device, its vhost-vdpa file index."""
    name: str
    mgmtdev: MgmtDev
    index: int
    opened: "VhostVdpaFile | None" = None
    stats: dict[str, int] = field(default_factory=dict)

    @property
    def parent(self) -> VpVdpa:
        return self.mgmtdev.parent

    @property
    def vhost_path(self) -> str:
        return f"{VHOST_VDPA_DIR}{self.index}"


class VdpaBus:
    """Every management device and vdpa device of one host."""

    def __init__(self, host: "Host") -> None:
        self.host = host
        self.mgmtdevs: dict[str, MgmtDev] = {}
        self.devices: dict[str, VdpaDevice] = {}
        self._next_index = 0
        self.trace = host.machine.trace.tracer(f"{host.name}.vdpa")
        self._genl: "VdpaGenl | None" = None

    @property
    def genl(self) -> "VdpaGenl":
        """The "vdpa" generic netlink family over this bus."""
        if self._genl is None:
            from .netlink import VdpaGenl
            self._genl = VdpaGenl(self)
        return self._genl

    # -- parents -------------------------------------------------------------------------

    def register(self, hf: "HostPciFunction") -> MgmtDev:
        """Bind vp_vdpa to `hf` and register its management device (pci/<bdf>)."""
        handle = f"pci/{hf.name}"
        if handle in self.mgmtdevs:
            return self.mgmtdevs[handle]
        if hf.group is not None:
            raise vdpa_error(errno.EBUSY, f"{hf.name} is bound to vfio-pci")
        parent = VpVdpa(self.host, hf)
        m = self.mgmtdevs[handle] = MgmtDev("pci", hf.name, parent)
        self.trace.emit("mgmtdev_add", mgmtdev=handle, max_vqs=parent.num_queues)
        return m

    def unregister(self, handle: str) -> None:
        m = self.mgmtdev(handle)
        if m.device is not None:
            self.dev_del(m.device.name)
        m.parent.remove()
        del self.mgmtdevs[handle]

    def mgmtdev(self, handle: str) -> MgmtDev:
        m = self.mgmtdevs.get(handle)
        if m is None:
            raise vdpa_error(errno.ENODEV, f"management device {handle!r} does not exist")
        return m

    # -- devices -----------------------------------------------------------------------------

    def dev_add(self, name: str, mgmtdev: str) -> VdpaDevice:
        check_name(name)
        m = self.mgmtdev(mgmtdev)
        if name in self.devices:
            raise vdpa_error(errno.EEXIST, f"vdpa device {name!r} already exists")
        if m.device is not None:
            raise vdpa_error(errno.EBUSY, f"management device {mgmtdev!r} already has device "
                                          f"{m.device.name!r} (one per function)")
        m.parent.reset()
        dev = VdpaDevice(name, m, self._next_index)
        self._next_index += 1
        m.device = dev
        self.devices[name] = dev
        self.trace.emit("dev_add", name=name, mgmtdev=mgmtdev, vhost=dev.vhost_path)
        return dev

    def device(self, name: str) -> VdpaDevice:
        dev = self.devices.get(name)
        if dev is None:
            raise vdpa_error(errno.ENODEV, f"vdpa device {name!r} does not exist")
        return dev

    def dev_del(self, name: str) -> None:
        dev = self.device(name)
        if dev.opened is not None:
            raise vdpa_error(errno.EBUSY, f"vdpa device {name!r}: {dev.vhost_path} is open")
        dev.parent.reset()
        dev.mgmtdev.device = None
        del self.devices[name]
        self.trace.emit("dev_del", name=name)

    def vq_stats(self, dev: VdpaDevice, index: int) -> dict[str, int]:
        """Per-queue counters (mlx5_vdpa's names where they exist): descriptors made
        available (avail.idx) and completed (used.idx) as read through the IOTLB,
        doorbells forwarded and interrupts raised."""
        p = dev.parent
        out: dict[str, int] = {}
        f = dev.opened
        avail = f.ring_index(index, "avail") if f is not None else None
        used = f.ring_index(index, "used") if f is not None else None
        out["received_desc"] = avail or 0
        out["completed_desc"] = used or 0
        out["kicks"] = p.kicks[index]
        out["calls"] = p.calls[index]
        return out

    # -- vhost-vdpa -------------------------------------------------------------------------------

    def open(self, path: str, memory: "list[GuestMemory] | None" = None,
             process: object = None) -> "VhostVdpaFile":
        """open() of /dev/vhost-vdpa-N by `process` (the owner-to-be); `memory` is the
        caller's address space the IOTLB's uaddrs resolve in (the VMM's guest RAM)."""
        from .vhost import VhostVdpaFile
        dev = next((d for d in self.devices.values() if d.vhost_path == path), None)
        if dev is None:
            raise vdpa_error(errno.ENOENT, f"{path}: no such vhost-vdpa device")
        if dev.opened is not None:
            raise vdpa_error(errno.EBUSY, f"{path} is already open")
        f = VhostVdpaFile(self.host, dev, memory or [], process)
        dev.opened = f
        return f


def check_name(name: object) -> str:
    if not isinstance(name, str) or not name or len(name.encode()) > NAME_MAX \
            or "/" in name or any(c.isspace() for c in name):
        raise vdpa_error(errno.EINVAL, f"device name {name!r}: 1 to {NAME_MAX} bytes, "
                                       "no '/' or white space")
    return name
