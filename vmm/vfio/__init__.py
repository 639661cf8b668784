"""VFIO-style device assignment: container, group and device files with the semantics
and numbers of linux/vfio.h (see uapi, container, group, device_api)."""
from .container import VfioContainer, vaddr_of
from .device_api import VfioDevice
from .group import GroupMember, VfioDeviceFile, VfioGroup

__all__ = ["VfioContainer", "VfioDevice", "VfioDeviceFile", "VfioGroup", "GroupMember", "vaddr_of"]
