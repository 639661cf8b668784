"""Virtio 1.x numbers (OASIS virtio spec; Linux include/uapi/linux/virtio_*.h)."""
from __future__ import annotations

from .layout import Layout

# Device status field (virtio_config.h).
STATUS_ACKNOWLEDGE = 1
STATUS_DRIVER = 2
STATUS_DRIVER_OK = 4
STATUS_FEATURES_OK = 8
STATUS_DEVICE_NEEDS_RESET = 0x40
STATUS_FAILED = 0x80

# Reserved feature bits (virtio_config.h, virtio_ring.h, virtio spec 1.3 §6).
F_NOTIFY_ON_EMPTY = 24
F_ANY_LAYOUT = 27
F_RING_INDIRECT_DESC = 28
F_RING_EVENT_IDX = 29
F_VERSION_1 = 32
F_ACCESS_PLATFORM = 33
F_RING_PACKED = 34
F_IN_ORDER = 35
F_ORDER_PLATFORM = 36
F_SR_IOV = 37
F_NOTIFICATION_DATA = 38
F_NOTIF_CONFIG_DATA = 39
F_RING_RESET = 40
F_ADMIN_VQ = 41

# Split virtqueue descriptor flags (virtio_ring.h).
DESC_F_NEXT = 1
DESC_F_WRITE = 2
DESC_F_INDIRECT = 4
AVAIL_F_NO_INTERRUPT = 1
USED_F_NO_NOTIFY = 1

# Split virtqueue layout (virtio 1.x §2.7). Alignments are those of virtio 1.x, not legacy.
DESC_ALIGN = 16
AVAIL_ALIGN = 2
USED_ALIGN = 4
QUEUE_SIZE_MAX = 32768  # queue sizes are powers of two up to this

DESC = Layout("virtq_desc", (("addr", "Q"), ("len", "I"), ("flags", "H"), ("next", "H")))
USED_ELEM = Layout("virtq_used_elem", (("id", "I"), ("len", "I")))
# avail: le16 flags; le16 idx; le16 ring[N]; le16 used_event (EVENT_IDX)
AVAIL_HEADER = 4
AVAIL_ELEM = 2
# used: le16 flags; le16 idx; struct virtq_used_elem ring[N]; le16 avail_event (EVENT_IDX)
USED_HEADER = 4


def desc_table_size(num: int) -> int:
    return DESC.size * num


def avail_ring_size(num: int) -> int:
    """Bytes of the driver area, including used_event."""
    return AVAIL_HEADER + AVAIL_ELEM * num + 2


def used_ring_size(num: int) -> int:
    """Bytes of the device area, including avail_event."""
    return USED_HEADER + USED_ELEM.size * num + 2


# Packed virtqueue (virtio 1.x §2.8; linux/virtio_ring.h). Flag bit numbers as the header
# names them (VRING_PACKED_DESC_F_AVAIL/USED), and the masks the descriptors carry.
PACKED_DESC_F_AVAIL = 7
PACKED_DESC_F_USED = 15
DESC_F_AVAIL = 1 << PACKED_DESC_F_AVAIL
DESC_F_USED = 1 << PACKED_DESC_F_USED
PACKED_DESC = Layout("vring_packed_desc", (("addr", "Q"), ("len", "I"), ("id", "H"),
                                           ("flags", "H")))
PACKED_EVENT = Layout("vring_packed_desc_event", (("off_wrap", "H"), ("flags", "H")))
PACKED_EVENT_FLAG_ENABLE = 0x0
PACKED_EVENT_FLAG_DISABLE = 0x1
PACKED_EVENT_FLAG_DESC = 0x2    # only with RING_EVENT_IDX; 0x3 is reserved
PACKED_EVENT_FLAGS_MASK = 0x3   # desc_event_flags: 2 bits; the other 14 are reserved
PACKED_EVENT_F_WRAP_CTR = 15    # bit of off_wrap holding the wrap counter
PACKED_DESC_ALIGN = 16
PACKED_EVENT_ALIGN = 4
PACKED_QUEUE_SIZE_MAX = 1 << 15  # any size 1 .. 2^15, not only powers of two


def packed_ring_size(num: int) -> int:
    """Bytes of a packed descriptor ring of `num` entries."""
    return PACKED_DESC.size * num


# Driver notifications with VIRTIO_F_NOTIFICATION_DATA (virtio 1.x §2.9, le32):
# vqn in bits 0-15; next_off in bits 16-30 (split: the avail index's 15 low bits; packed:
# the offset of the next descriptor to be made available); next_wrap in bit 31 (split:
# the avail index's bit 15; packed: the driver's wrap counter).
NOTIFY_DATA_VQN_MASK = 0xFFFF
NOTIFY_DATA_OFF_SHIFT = 16
NOTIFY_DATA_OFF_MASK = 0x7FFF
NOTIFY_DATA_WRAP_SHIFT = 31
