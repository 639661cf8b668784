"""Which device-side ring a virtqueue gets, keyed on the negotiated feature bits.

The one place outside the layout modules that knows ring layouts exist: transports ask
it whether a queue's size and areas suit the layout and, at DRIVER_OK (or when a queue
is enabled again after RING_RESET), for the ring itself; devices offer the ring
features it lists. The split ring (virtio 1.x §2.7) or, with VIRTIO_F_RING_PACKED, the
packed ring (§2.8); both take INDIRECT_DESC, EVENT_IDX and IN_ORDER.
"""
from __future__ import annotations

from hwspec import virtio as V

from .packed_ring import PackedRing
from .queue import Queue, is_power_of_two
from .ring import DeviceRing
from .split_ring import SplitRing

RING_FEATURES = (1 << V.F_RING_INDIRECT_DESC | 1 << V.F_RING_EVENT_IDX
                 | 1 << V.F_RING_PACKED | 1 << V.F_IN_ORDER)
"""Ring feature bits the device side implements (a device offers these)."""


def _packed(features: int) -> bool:
    return bool(features >> V.F_RING_PACKED & 1)


def make_device_ring(features: int, queue: Queue) -> DeviceRing:
    """The device side of `queue`'s ring for the negotiated `features`."""
    options = dict(indirect=bool(features >> V.F_RING_INDIRECT_DESC & 1),
                   event_idx=bool(features >> V.F_RING_EVENT_IDX & 1),
                   in_order=bool(features >> V.F_IN_ORDER & 1))
    if _packed(features):
        return PackedRing(queue, **options)
    return SplitRing(queue, **options)


def ring_alignment_ok(features: int, queue: Queue) -> bool:
    """Whether `queue`'s three areas are aligned as the layout of `features` requires."""
    if _packed(features):
        return PackedRing.alignment_ok(queue)
    return SplitRing.alignment_ok(queue)


def ring_size_ok(features: int, size: int) -> bool:
    """Whether `size` is a queue size the layout of `features` takes (split: a power of
    two; packed: any size up to 2^15)."""
    if _packed(features):
        return PackedRing.size_ok(size)
    return is_power_of_two(size)
