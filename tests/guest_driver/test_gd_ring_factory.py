"""The driver-side ring factory: the negotiated features pick the ring (split, or packed
with VIRTIO_F_RING_PACKED; INDIRECT/EVENT_IDX/IN_ORDER/NOTIFICATION_DATA options), and
the VA-1 driver and the admin queue know no ring layout."""
from __future__ import annotations

import pathlib
import re

import pytest
from gd_fakes import FakeMemory

import guest_driver
from guest_driver.mm import PageAllocator
from guest_driver.va1.driver import (DEFAULT_OPTIONAL, OPTIONAL_FEATURES, WANTED_FEATURES)
from guest_driver.virtio.packed_ring import PackedQueue
from guest_driver.virtio.ring import DriverRing
from guest_driver.virtio.ring_factory import RING_FEATURES, make_driver_ring, ring_features
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


PACKED = 1 << V.F_RING_PACKED
IN_ORDER = 1 << V.F_IN_ORDER
DATA = 1 << V.F_NOTIFICATION_DATA


@pytest.mark.parametrize("options", [0, INDIRECT | EVENT_IDX, IN_ORDER | DATA,
                                     INDIRECT | EVENT_IDX | IN_ORDER | DATA])
def test_packed_feature_gives_a_packed_ring(options: int) -> None:
    ring = _make(BASE | PACKED | options)
    assert isinstance(ring, PackedQueue)
    assert ring.features == ring_features(BASE | PACKED | options) == PACKED | options
    assert (ring.index, ring.num, ring.num_free) == (3, 8, 8)
    assert ring.descs_needed(3) == (1 if options & INDIRECT else 3)
    assert ring.desc_addr < ring.driver_addr < ring.device_addr
    assert (ring.notification_data() is None) == (not options & DATA)


def test_notification_data_of_an_empty_ring() -> None:
    assert _make(BASE | PACKED | DATA).notification_data() == 1 << 15   # slot 0, wrap 1
    assert _make(BASE | DATA).notification_data() == 0                  # avail idx 0


def test_ring_features_ignore_what_does_not_shape_the_ring() -> None:
    assert ring_features(BASE | 1 << V.F_SR_IOV | INDIRECT) == INDIRECT


def test_va1_driver_asks_by_default_for_todays_ring_features_and_can_use_all() -> None:
    assert WANTED_FEATURES & OPTIONAL_FEATURES == DEFAULT_OPTIONAL == INDIRECT | EVENT_IDX
    assert OPTIONAL_FEATURES == RING_FEATURES | 1 << V.F_RING_RESET


_LAYOUT = re.compile(r"\bV\.(DESC|AVAIL_|USED_|desc_table_size|avail_ring_size|"
                     r"used_ring_size|PACKED_|packed_ring_size)|SplitQueue|split_ring|PackedQueue|packed_ring|"
                     r"RingLayout")


@pytest.mark.parametrize("module", ["va1/driver.py", "va1/devfile.py", "va1/pf.py",
                                    "virtio/admin.py"])
def test_drivers_know_no_ring_layout(module: str) -> None:
    root = pathlib.Path(guest_driver.__file__).parent
    assert not _LAYOUT.search((root / module).read_text())
