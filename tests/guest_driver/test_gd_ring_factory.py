"""The driver-side ring factory: the negotiated features pick the ring (split today,
with INDIRECT/EVENT_IDX), an unimplemented layout is refused by name, and the VA-1
driver and the admin queue know no ring layout."""
from __future__ import annotations

import pathlib
import re

import pytest
from gd_fakes import FakeMemory

import guest_driver
from guest_driver.mm import PageAllocator
from guest_driver.va1.driver import WANTED_FEATURES
from guest_driver.virtio.ring import DriverRing
from guest_driver.virtio.ring_factory import (RING_FEATURES, UnsupportedRingError,
                                              make_driver_ring, ring_features)
from guest_driver.virtio.split_ring import SplitQueue
from hwspec import virtio as V

INDIRECT = 1 << V.F_RING_INDIRECT_DESC
EVENT_IDX = 1 << V.F_RING_EVENT_IDX
BASE = 1 << V.F_VERSION_1 | 1 << V.F_ACCESS_PLATFORM


def _make(features: int, num: int = 8) -> DriverRing[str]:
    mem = FakeMemory()
    return make_driver_ring(features, mem, PageAllocator(mem.base, mem.size), 3, num,
                            max_indirect=4)


@pytest.mark.parametrize("options", [0, INDIRECT, EVENT_IDX, INDIRECT | EVENT_IDX])
def test_split_features_give_a_split_ring_with_their_options(options: int) -> None:
    ring = _make(BASE | options)
    assert isinstance(ring, SplitQueue)
    assert ring.indirect == bool(options & INDIRECT)
    assert ring.event_idx == bool(options & EVENT_IDX)
    assert ring.features == ring_features(BASE | options) == options
    assert (ring.index, ring.num, ring.num_free) == (3, 8, 8)
    assert ring.descs_needed(3) == (1 if options & INDIRECT else 3)
    assert ring.desc_addr < ring.driver_addr < ring.device_addr


@pytest.mark.parametrize("bit,name", [(V.F_RING_PACKED, "VIRTIO_F_RING_PACKED"),
                                      (V.F_IN_ORDER, "VIRTIO_F_IN_ORDER")])
def test_unimplemented_ring_features_are_refused_by_name(bit: int, name: str) -> None:
    with pytest.raises(UnsupportedRingError, match=rf"{name} \(feature bit {bit}\)"):
        _make(BASE | 1 << bit)


def test_ring_features_ignore_what_does_not_shape_the_ring() -> None:
    assert ring_features(BASE | 1 << V.F_SR_IOV | INDIRECT) == INDIRECT


def test_va1_driver_asks_for_exactly_the_ring_features_the_factory_builds() -> None:
    ring_bits = INDIRECT | EVENT_IDX | 1 << V.F_RING_PACKED | 1 << V.F_IN_ORDER
    assert WANTED_FEATURES & ring_bits == RING_FEATURES


_LAYOUT = re.compile(r"\bV\.(DESC|AVAIL_|USED_|desc_table_size|avail_ring_size|"
                     r"used_ring_size)|SplitQueue|split_ring|RingLayout")


@pytest.mark.parametrize("module", ["va1/driver.py", "va1/devfile.py", "va1/pf.py",
                                    "virtio/admin.py"])
def test_drivers_know_no_ring_layout(module: str) -> None:
    root = pathlib.Path(guest_driver.__file__).parent
    assert not _LAYOUT.search((root / module).read_text())
