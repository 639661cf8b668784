"""A VFIO group (/dev/vfio/<id>) and the device files it hands out.

Why: the group is the unit of isolation. A function is only safe to give to a guest
when every device that can DMA as it (its IOMMU group) is owned by VFIO; a VF behind
ACS is a group of its own. The host side binds devices into a group with
`add_device(name, device, requester_id)`, as binding to vfio-pci does; user space (the
VMM) then drives it with the linux/vfio.h calls, with the errnos of
drivers/vfio/group.c and container.c:
- GET_STATUS: argsz below offsetofend(flags): EINVAL. VIABLE when every device of
  the group is owned by VFIO (`viable`), CONTAINER_SET (and VIABLE) once in a container.
- SET_CONTAINER: already in a container, or not given a VFIO container: EINVAL; group
  not viable (a host driver owns a device; iommu_group_claim_dma_owner): EPERM; a
  device cannot join the container's IOMMU domain: EBUSY.
- UNSET_CONTAINER: not in a container: EINVAL; device files still open: EBUSY. The
  last group out of a container releases its IOMMU (every mapping is dropped).
- GET_DEVICE_FD: unknown device name: ENODEV; group without a container or the
  container without an IOMMU: EINVAL. Returns a `VfioDeviceFile`.
A failed call changes nothing.
"""
from __future__ import annotations

import errno
from dataclasses import dataclass

import numpy as np

from ..bus import MmioHandler
from ..iommu import check_requester_id, format_bdf
from . import uapi
from .container import VfioContainer, _check_argsz, _dispatch, _expect, vfio_error
from .device_api import VfioDevice
from .uapi import CData


@dataclass(frozen=True)
class GroupMember:
    name: str
    device: VfioDevice
    requester_id: int


class VfioGroup:
    """One IOMMU group bound to VFIO."""

    def __init__(self, group_id: int, *, viable: bool = True) -> None:
        self.group_id = group_id
        self.viable = viable  # False: a device of the group is bound to a host driver
        self.container: VfioContainer | None = None
        self._members: dict[str, GroupMember] = {}
        self._open_files = 0
        self._device_opens: dict[str, int] = {}

    def __repr__(self) -> str:
        return f"<VfioGroup {self.group_id}: {', '.join(self._members)}>"

    # -- host side --------------------------------------------------------------------

    def add_device(self, name: str, device: VfioDevice, requester_id: int) -> None:
        """Bind `device` (PCI requester ID `requester_id`) into this group under `name`
        (its PCI address, e.g. '0000:01:00.1', as GET_DEVICE_FD looks it up)."""
        check_requester_id(requester_id)
        if name in self._members:
            raise ValueError(f"group {self.group_id} already has a device named {name!r}")
        for m in self._members.values():
            if m.requester_id == requester_id:
                raise ValueError(f"group {self.group_id}: requester {format_bdf(requester_id)} "
                                 f"is already {m.name!r}")
        if self.container is not None:
            self.container._attach_device(requester_id)
        self._members[name] = GroupMember(name, device, requester_id)

    @property
    def members(self) -> tuple[GroupMember, ...]:
        return tuple(self._members.values())

    def requester_ids(self) -> list[int]:
        return [m.requester_id for m in self._members.values()]

    # -- group ioctls -----------------------------------------------------------------

    def get_status(self, status: CData) -> None:
        s = _expect(status, "vfio_group_status")
        _check_argsz(s, "vfio_group_status", "flags", "VFIO_GROUP_GET_STATUS")
        flags = 0
        if self.container is not None:
            flags |= uapi.VFIO_GROUP_FLAGS_CONTAINER_SET | uapi.VFIO_GROUP_FLAGS_VIABLE
        elif self.viable:
            flags |= uapi.VFIO_GROUP_FLAGS_VIABLE
        s.flags = flags

    def set_container(self, container: VfioContainer) -> None:
        name = "VFIO_GROUP_SET_CONTAINER"
        if self.container is not None:
            raise vfio_error(errno.EINVAL, f"{name}: group {self.group_id} is already in a container")
        if not isinstance(container, VfioContainer):
            raise vfio_error(errno.EINVAL, f"{name}: {type(container).__name__} is not a VFIO container")
        if not self.viable:
            raise vfio_error(errno.EPERM, f"{name}: group {self.group_id} is not viable (a device "
                                          "of the group is owned by a host driver)")
        container._add_group(self)
        self.container = container

    def unset_container(self) -> None:
        name = "VFIO_GROUP_UNSET_CONTAINER"
        if self.container is None:
            raise vfio_error(errno.EINVAL, f"{name}: group {self.group_id} is in no container")
        if self._open_files:
            raise vfio_error(errno.EBUSY, f"{name}: group {self.group_id} still has "
                                          f"{self._open_files} device file(s) open")
        self.container._remove_group(self)
        self.container = None

    def get_device_fd(self, name: str | bytes | CData) -> "VfioDeviceFile":
        if isinstance(name, uapi.ffi.CData):
            name = uapi.ffi.string(name)
        if isinstance(name, bytes):
            name = name.decode("utf-8", "replace")
        member = self._members.get(name)
        if member is None:
            raise vfio_error(errno.ENODEV, f"VFIO_GROUP_GET_DEVICE_FD: group {self.group_id} has no "
                                           f"device {name!r}")
        if self.container is None or self.container.domain is None:
            raise vfio_error(errno.EINVAL, f"VFIO_GROUP_GET_DEVICE_FD: group {self.group_id} needs a "
                                           "container with an IOMMU set first")
        self._open_files += 1
        self._device_opens[name] = self._device_opens.get(name, 0) + 1
        return VfioDeviceFile(self, member)

    def ioctl(self, request: int, arg: int | str | bytes | CData | VfioContainer = 0
              ) -> "int | VfioDeviceFile":
        """Dispatch by linux/vfio.h ioctl number (GET_DEVICE_FD returns the file)."""
        result: int | VfioDeviceFile = _dispatch(request, arg, {
            uapi.VFIO_GROUP_GET_STATUS: self.get_status,
            uapi.VFIO_GROUP_SET_CONTAINER: self.set_container,
            uapi.VFIO_GROUP_UNSET_CONTAINER: lambda _: self.unset_container(),
            uapi.VFIO_GROUP_GET_DEVICE_FD: self.get_device_fd,
        }, f"group ioctl {request:#x} is not a VFIO group ioctl")
        return result


class VfioDeviceFile:
    """An open device fd: forwards the device ioctls to the device until closed.

    While open it pins the group in its container (UNSET_CONTAINER gives EBUSY)."""

    def __init__(self, group: VfioGroup, member: GroupMember) -> None:
        self.group = group
        self.name = member.name
        self.requester_id = member.requester_id
        self._device: VfioDevice | None = member.device

    @property
    def device(self) -> VfioDevice:
        if self._device is None:
            raise vfio_error(errno.EBADF, f"VFIO device file of {self.name!r} is closed")
        return self._device

    @property
    def closed(self) -> bool:
        return self._device is None

    def close(self) -> None:
        """Release the fd. When the last fd of the device closes, the host driver gets
        `close_device()` if it has one (vfio-pci then disables interrupts and resets
        the function, so nothing of the user's setup outlives it)."""
        if self._device is not None:
            device, self._device = self._device, None
            self.group._open_files -= 1
            left = self.group._device_opens.get(self.name, 1) - 1
            self.group._device_opens[self.name] = left
            if left == 0:
                release = getattr(device, "close_device", None)
                if release is not None:
                    release()

    def __enter__(self) -> "VfioDeviceFile":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def get_info(self, info: CData) -> None:
        self.device.get_info(info)

    def get_region_info(self, info: CData) -> None:
        self.device.get_region_info(info)

    def get_irq_info(self, info: CData) -> None:
        self.device.get_irq_info(info)

    def set_irqs(self, irq_set: CData) -> None:
        self.device.set_irqs(irq_set)

    def reset(self) -> None:
        self.device.reset()

    def region_read(self, index: int, offset: int, length: int) -> bytes:
        return self.device.region_read(index, offset, length)

    def region_write(self, index: int, offset: int, data: bytes) -> None:
        self.device.region_write(index, offset, data)

    def region_mmap(self, index: int, offset: int, length: int) -> "np.ndarray | MmioHandler":
        return self.device.region_mmap(index, offset, length)

    def ioctl(self, request: int, arg: CData = None) -> int:
        """Dispatch by linux/vfio.h device ioctl number; unknown numbers: ENOTTY."""
        dev = self.device
        _dispatch(request, arg, {
            uapi.VFIO_DEVICE_GET_INFO: dev.get_info,
            uapi.VFIO_DEVICE_GET_REGION_INFO: dev.get_region_info,
            uapi.VFIO_DEVICE_GET_IRQ_INFO: dev.get_irq_info,
            uapi.VFIO_DEVICE_SET_IRQS: dev.set_irqs,
            uapi.VFIO_DEVICE_RESET: lambda _: dev.reset(),
        }, f"device ioctl {request:#x} is not a VFIO device ioctl")
        return 0
