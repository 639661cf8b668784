"""Which driver-side ring a virtqueue gets, keyed on the negotiated feature bits.

Drivers ask for the ring features they can use (`RING_FEATURES`), then for a ring per
queue; they never see the layout. Today the split ring (with INDIRECT_DESC and
EVENT_IDX); the packed ring will be a second branch here. Written independently of
the device side's factory.
"""
from __future__ import annotations

from typing import TypeVar

from hwspec import virtio as V

from ..errors import GuestDriverError
from ..kernel import PhysMemory
from ..mm import RangeAllocator
from .ring import DriverRing
from .split_ring import SplitQueue

T = TypeVar("T")

RING_FEATURES = (1 << V.F_RING_INDIRECT_DESC) | (1 << V.F_RING_EVENT_IDX)
"""Ring feature bits the driver side implements (a driver may accept these)."""

_LAYOUT_BITS = (1 << V.F_RING_PACKED) | (1 << V.F_IN_ORDER)
_NAMES = {V.F_RING_PACKED: "VIRTIO_F_RING_PACKED", V.F_IN_ORDER: "VIRTIO_F_IN_ORDER"}


class UnsupportedRingError(GuestDriverError, ValueError):
    """The features name a ring layout or ring behaviour with no driver side here."""


def ring_features(features: int) -> int:
    """The bits of `features` that decide which ring is built and how: two rings built
    for the same value are interchangeable."""
    return features & (RING_FEATURES | _LAYOUT_BITS)


def make_driver_ring(features: int, memory: PhysMemory, alloc: RangeAllocator, index: int,
                     num: int, *, max_indirect: int = 8) -> DriverRing[T]:
    """The driver side of queue `index` with `num` entries for the negotiated
    `features`, its memory from `alloc`. `max_indirect`: segments one indirect table
    holds (when INDIRECT_DESC was negotiated).

    Raises UnsupportedRingError for a ring feature with no implementation, ValueError
    for a bad size."""
    for bit, name in _NAMES.items():
        if features >> bit & 1:
            raise UnsupportedRingError(
                f"{name} (feature bit {bit}) has no driver-side ring: only the split ring "
                "with INDIRECT_DESC and EVENT_IDX is implemented")
    return SplitQueue(memory, alloc, index, num,
                      indirect=bool(features >> V.F_RING_INDIRECT_DESC & 1),
                      event_idx=bool(features >> V.F_RING_EVENT_IDX & 1),
                      max_indirect=max_indirect)
