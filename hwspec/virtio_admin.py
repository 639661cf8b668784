"""Virtio 1.3 administration virtqueue (§2.12; linux/virtio_pci.h admin definitions).

A command is a device-readable header plus command-specific data, followed by a
device-writable status plus command-specific result.
"""
from __future__ import annotations

from .layout import Layout

CMD_HDR = Layout("virtio_admin_cmd_hdr", (
    ("opcode", "H"), ("group_type", "H"), ("reserved1", "12s"), ("group_member_id", "Q")))
CMD_STATUS = Layout("virtio_admin_cmd_status", (
    ("status", "H"), ("status_qualifier", "H"), ("reserved2", "4s")))

# Opcodes (generic).
CMD_LIST_QUERY = 0x0
CMD_LIST_USE = 0x1

# Group types.
GROUP_TYPE_SRIOV = 0x1

# Status (errno values) and qualifiers.
STATUS_OK = 0
STATUS_EAGAIN = 11
STATUS_ENOMEM = 12
STATUS_EINVAL = 22

STATUS_Q_OK = 0x0
STATUS_Q_INVALID_COMMAND = 0x1
STATUS_Q_INVALID_OPCODE = 0x2
STATUS_Q_INVALID_FIELD = 0x3
STATUS_Q_INVALID_GROUP = 0x4
STATUS_Q_INVALID_MEMBER = 0x5
STATUS_Q_NORESOURCE = 0x6
STATUS_Q_TRYAGAIN = 0x7

# virtio-pci common configuration fields for the admin queue (after queue_reset).
COMMON_ADM_Q_IDX = 60
COMMON_ADM_Q_NUM = 62
COMMON_CFG_SIZE_WITH_ADMIN = 64
