"""Which device-side ring a virtqueue gets, keyed on the negotiated feature bits.

The one place outside the layout modules that knows ring layouts exist: transports ask
it whether a queue's areas are aligned for the layout and, at DRIVER_OK, for the ring
itself; devices offer the ring features it lists. Today the split ring (with
INDIRECT_DESC and EVENT_IDX); the packed ring will be a second branch here.
"""
from __future__ import annotations

from hwspec import virtio as V

from ..errors import DeviceModelError
from .queue import Queue
from .ring import DeviceRing
from .split_ring import SplitRing

RING_FEATURES = 1 << V.F_RING_INDIRECT_DESC | 1 << V.F_RING_EVENT_IDX
"""Ring feature bits the device side implements (a device offers these)."""

_NOT_IMPLEMENTED = {
    V.F_RING_PACKED: "VIRTIO_F_RING_PACKED",
    V.F_IN_ORDER: "VIRTIO_F_IN_ORDER",
}


class UnsupportedRingError(DeviceModelError, ValueError):
    """The features name a ring layout or ring behaviour with no device side here."""


def _check(features: int) -> None:
    for bit, name in _NOT_IMPLEMENTED.items():
        if features >> bit & 1:
            raise UnsupportedRingError(
                f"{name} (feature bit {bit}) has no device-side ring: only the split ring "
                "with INDIRECT_DESC and EVENT_IDX is implemented")


def make_device_ring(features: int, queue: Queue) -> DeviceRing:
    """The device side of `queue`'s ring for the negotiated `features`.

    Raises UnsupportedRingError for a ring feature with no implementation."""
    _check(features)
    return SplitRing(queue, indirect=bool(features >> V.F_RING_INDIRECT_DESC & 1),
                     event_idx=bool(features >> V.F_RING_EVENT_IDX & 1))


def ring_alignment_ok(features: int, queue: Queue) -> bool:
    """Whether `queue`'s three areas are aligned as the layout of `features` requires."""
    _check(features)
    return SplitRing.alignment_ok(queue)
