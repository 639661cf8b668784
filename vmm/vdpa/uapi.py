"""The linux/vhost.h, linux/vhost_types.h and linux/vdpa.h numbers and structs this
VMM uses, with the kernel's exact values.

Why: the vhost-vdpa files and the vdpa netlink family here are meant to be driven
exactly as a VMM and iproute2's `vdpa` drive the kernel's, so code written against them
reads like code written against /dev/vhost-vdpa-N and the "vdpa" generic netlink
family. tests/vmm/test_vdpa_uapi.py checks every number, size and offset against the
installed headers with a C compiler.

Struct layouts are a cffi cdef (ABI mode); allocate with `new("struct vhost_vring_state *")`.
The ioctl encoding is the generic one of <asm-generic/ioctl.h> (vmm.vfio.uapi has it).
Two numbers are newer than some installed headers (VHOST_VDPA_RESUME and
VHOST_BACKEND_F_RESUME, Linux 6.3): the header test checks them where the header has them.
"""
from __future__ import annotations

from typing import Any

import cffi

from ..vfio.uapi import _IO, _IOR, _IOW, _IOWR

VHOST_VIRTIO = 0xAF
VHOST_FILE_UNBIND = -1
VHOST_PAGE_SIZE = 0x1000
VHOST_VRING_F_LOG = 0

# -- struct layouts -------------------------------------------------------------------------
CDEF = """
struct vhost_vring_state {
    unsigned int index;
    unsigned int num;
};
struct vhost_vring_file {
    unsigned int index;
    int fd;
};
struct vhost_vring_addr {
    unsigned int index;
    unsigned int flags;
    uint64_t desc_user_addr;
    uint64_t used_user_addr;
    uint64_t avail_user_addr;
    uint64_t log_guest_addr;
};
struct vhost_iotlb_msg {
    uint64_t iova;
    uint64_t size;
    uint64_t uaddr;
    uint8_t perm;
    uint8_t type;
};
struct vhost_msg_v2 {
    uint32_t type;
    uint32_t asid;
    union {
        struct vhost_iotlb_msg iotlb;
        uint8_t padding[64];
    };
};
struct vhost_vdpa_config {
    uint32_t off;
    uint32_t len;
    uint8_t buf[];
};
struct vhost_vdpa_iova_range {
    uint64_t first;
    uint64_t last;
};
"""

STRUCTS: tuple[str, ...] = ("vhost_vring_state", "vhost_vring_file", "vhost_vring_addr",
                            "vhost_iotlb_msg", "vhost_msg_v2", "vhost_vdpa_config",
                            "vhost_vdpa_iova_range")

ffi = cffi.FFI()
ffi.cdef(CDEF)
CData = Any


def new(ctype: str, init: Any = None) -> CData:
    p: CData = ffi.new(ctype, init)
    return p


def sizeof(ctype: str) -> int:
    n: int = ffi.sizeof(ctype)
    return n


_U64, _U32, _U16, _U8, _INT = 8, 4, 2, 1, 4

# -- ioctls ---------------------------------------------------------------------------------
VHOST_GET_FEATURES = _IOR(VHOST_VIRTIO, 0x00, _U64)
VHOST_SET_FEATURES = _IOW(VHOST_VIRTIO, 0x00, _U64)
VHOST_SET_OWNER = _IO(VHOST_VIRTIO, 0x01)
VHOST_RESET_OWNER = _IO(VHOST_VIRTIO, 0x02)
VHOST_SET_VRING_NUM = _IOW(VHOST_VIRTIO, 0x10, sizeof("struct vhost_vring_state"))
VHOST_SET_VRING_ADDR = _IOW(VHOST_VIRTIO, 0x11, sizeof("struct vhost_vring_addr"))
VHOST_SET_VRING_BASE = _IOW(VHOST_VIRTIO, 0x12, sizeof("struct vhost_vring_state"))
VHOST_GET_VRING_BASE = _IOWR(VHOST_VIRTIO, 0x12, sizeof("struct vhost_vring_state"))
VHOST_SET_VRING_KICK = _IOW(VHOST_VIRTIO, 0x20, sizeof("struct vhost_vring_file"))
VHOST_SET_VRING_CALL = _IOW(VHOST_VIRTIO, 0x21, sizeof("struct vhost_vring_file"))
VHOST_SET_BACKEND_FEATURES = _IOW(VHOST_VIRTIO, 0x25, _U64)
VHOST_GET_BACKEND_FEATURES = _IOR(VHOST_VIRTIO, 0x26, _U64)
VHOST_VDPA_GET_DEVICE_ID = _IOR(VHOST_VIRTIO, 0x70, _U32)
VHOST_VDPA_GET_STATUS = _IOR(VHOST_VIRTIO, 0x71, _U8)
VHOST_VDPA_SET_STATUS = _IOW(VHOST_VIRTIO, 0x72, _U8)
VHOST_VDPA_GET_CONFIG = _IOR(VHOST_VIRTIO, 0x73, sizeof("struct vhost_vdpa_config"))
VHOST_VDPA_SET_CONFIG = _IOW(VHOST_VIRTIO, 0x74, sizeof("struct vhost_vdpa_config"))
VHOST_VDPA_SET_VRING_ENABLE = _IOW(VHOST_VIRTIO, 0x75, sizeof("struct vhost_vring_state"))
VHOST_VDPA_GET_VRING_NUM = _IOR(VHOST_VIRTIO, 0x76, _U16)
VHOST_VDPA_SET_CONFIG_CALL = _IOW(VHOST_VIRTIO, 0x77, _INT)
VHOST_VDPA_GET_IOVA_RANGE = _IOR(VHOST_VIRTIO, 0x78, sizeof("struct vhost_vdpa_iova_range"))
VHOST_VDPA_GET_CONFIG_SIZE = _IOR(VHOST_VIRTIO, 0x79, _U32)
VHOST_VDPA_GET_VQS_COUNT = _IOR(VHOST_VIRTIO, 0x80, _U32)
VHOST_VDPA_SUSPEND = _IO(VHOST_VIRTIO, 0x7D)
VHOST_VDPA_RESUME = _IO(VHOST_VIRTIO, 0x7E)

IOCTLS: tuple[str, ...] = (
    "VHOST_GET_FEATURES", "VHOST_SET_FEATURES", "VHOST_SET_OWNER", "VHOST_RESET_OWNER",
    "VHOST_SET_VRING_NUM", "VHOST_SET_VRING_ADDR", "VHOST_SET_VRING_BASE",
    "VHOST_GET_VRING_BASE", "VHOST_SET_VRING_KICK", "VHOST_SET_VRING_CALL",
    "VHOST_SET_BACKEND_FEATURES", "VHOST_GET_BACKEND_FEATURES", "VHOST_VDPA_GET_DEVICE_ID",
    "VHOST_VDPA_GET_STATUS", "VHOST_VDPA_SET_STATUS", "VHOST_VDPA_GET_CONFIG",
    "VHOST_VDPA_SET_CONFIG", "VHOST_VDPA_SET_VRING_ENABLE", "VHOST_VDPA_GET_VRING_NUM",
    "VHOST_VDPA_SET_CONFIG_CALL", "VHOST_VDPA_GET_IOVA_RANGE", "VHOST_VDPA_GET_CONFIG_SIZE",
    "VHOST_VDPA_GET_VQS_COUNT", "VHOST_VDPA_SUSPEND", "VHOST_VDPA_RESUME",
)
IOCTL_NAMES: dict[int, str] = {globals()[n]: n for n in IOCTLS}

# -- backend features (bit numbers) -----------------------------------------------------------
VHOST_BACKEND_F_IOTLB_MSG_V2 = 0x1
VHOST_BACKEND_F_IOTLB_BATCH = 0x2
VHOST_BACKEND_F_IOTLB_ASID = 0x3
VHOST_BACKEND_F_SUSPEND = 0x4
VHOST_BACKEND_F_RESUME = 0x5

# -- IOTLB messages -------------------------------------------------------------------------
VHOST_ACCESS_RO = 0x1
VHOST_ACCESS_WO = 0x2
VHOST_ACCESS_RW = 0x3
VHOST_IOTLB_MISS = 1
VHOST_IOTLB_UPDATE = 2
VHOST_IOTLB_INVALIDATE = 3
VHOST_IOTLB_ACCESS_FAIL = 4
VHOST_IOTLB_BATCH_BEGIN = 5
VHOST_IOTLB_BATCH_END = 6
VHOST_IOTLB_MSG = 0x1
VHOST_IOTLB_MSG_V2 = 0x2

# -- linux/vdpa.h: the "vdpa" generic netlink family --------------------------------------------
VDPA_GENL_NAME = "vdpa"
VDPA_GENL_VERSION = 0x1

VDPA_CMD_UNSPEC = 0
VDPA_CMD_MGMTDEV_NEW = 1
VDPA_CMD_MGMTDEV_GET = 2
VDPA_CMD_DEV_NEW = 3
VDPA_CMD_DEV_DEL = 4
VDPA_CMD_DEV_GET = 5
VDPA_CMD_DEV_CONFIG_GET = 6
VDPA_CMD_DEV_VSTATS_GET = 7

# enum vdpa_attr, in order (VDPA_ATTR_PAD aliases VDPA_ATTR_UNSPEC)
VDPA_ATTRS: tuple[str, ...] = (
    "VDPA_ATTR_UNSPEC",
    "VDPA_ATTR_MGMTDEV_BUS_NAME",
    "VDPA_ATTR_MGMTDEV_DEV_NAME",
    "VDPA_ATTR_MGMTDEV_SUPPORTED_CLASSES",
    "VDPA_ATTR_DEV_NAME",
    "VDPA_ATTR_DEV_ID",
    "VDPA_ATTR_DEV_VENDOR_ID",
    "VDPA_ATTR_DEV_MAX_VQS",
    "VDPA_ATTR_DEV_MAX_VQ_SIZE",
    "VDPA_ATTR_DEV_MIN_VQ_SIZE",
    "VDPA_ATTR_DEV_NET_CFG_MACADDR",
    "VDPA_ATTR_DEV_NET_STATUS",
    "VDPA_ATTR_DEV_NET_CFG_MAX_VQP",
    "VDPA_ATTR_DEV_NET_CFG_MTU",
    "VDPA_ATTR_DEV_NEGOTIATED_FEATURES",
    "VDPA_ATTR_DEV_MGMTDEV_MAX_VQS",
    "VDPA_ATTR_DEV_SUPPORTED_FEATURES",
    "VDPA_ATTR_DEV_QUEUE_INDEX",
    "VDPA_ATTR_DEV_VENDOR_ATTR_NAME",
    "VDPA_ATTR_DEV_VENDOR_ATTR_VALUE",
    "VDPA_ATTR_DEV_FEATURES",
    "VDPA_ATTR_VDPA_DEV_SUPPORTED_FEATURES",
)
VDPA_ATTR: dict[str, int] = {name: i for i, name in enumerate(VDPA_ATTRS)}
VDPA_ATTR_PAD = VDPA_ATTR["VDPA_ATTR_UNSPEC"]
VDPA_ATTR_MGMTDEV_BUS_NAME = VDPA_ATTR["VDPA_ATTR_MGMTDEV_BUS_NAME"]
VDPA_ATTR_MGMTDEV_DEV_NAME = VDPA_ATTR["VDPA_ATTR_MGMTDEV_DEV_NAME"]
VDPA_ATTR_DEV_NAME = VDPA_ATTR["VDPA_ATTR_DEV_NAME"]
VDPA_ATTR_DEV_QUEUE_INDEX = VDPA_ATTR["VDPA_ATTR_DEV_QUEUE_INDEX"]
VDPA_ATTR_MAX = len(VDPA_ATTRS)

COMMANDS: tuple[str, ...] = (
    "VDPA_CMD_UNSPEC", "VDPA_CMD_MGMTDEV_NEW", "VDPA_CMD_MGMTDEV_GET", "VDPA_CMD_DEV_NEW",
    "VDPA_CMD_DEV_DEL", "VDPA_CMD_DEV_GET", "VDPA_CMD_DEV_CONFIG_GET", "VDPA_CMD_DEV_VSTATS_GET",
)
