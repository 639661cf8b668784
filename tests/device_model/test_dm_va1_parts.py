"""Small parts of the VA-1 model: config image, device memory, eventq buffer handling."""
from __future__ import annotations

import struct

import numpy as np
import pytest
from dm_driver import Rig, fill

from device_model import Va1Config
from device_model.va1.memory import DeviceMemory
from device_model.va1.timing import roofline_ns
from hwspec import va1


def test_config_defaults_and_image() -> None:
    c = Va1Config()
    img = c.pack()
    assert len(img) == 72 == va1.CONFIG.size
    vals = struct.unpack("<IIQIIIIQQQIIII", img)
    assert vals == (2, 4, 256 << 20, 1 << 20, 1 << 20, 0x00010000, 0b1111, 50 * 10**12,
                    10**12, 32 * 10**9, 500, 64, 8, 0)
    assert c.queue_size_max == 256


@pytest.mark.parametrize("kw", [dict(queue_size_max=100), dict(num_compute_units=0),
                                dict(peak_flops=0), dict(queue_size_max=65536)])
def test_config_rejects_nonsense(kw: dict[str, int]) -> None:
    with pytest.raises(ValueError):
        Va1Config(**kw)


def test_device_memory_views_are_zero_copy_and_checked() -> None:
    m = DeviceMemory(4096)
    v = m.typed_view(16, "<f4", (2, 3))
    v[...] = 1.5
    assert np.frombuffer(m.read(16, 24), "<f4").tolist() == [1.5] * 6
    assert np.shares_memory(v, m.data)
    assert m.contains(4000, 96) and not m.contains(4000, 97) and not m.contains(-1, 1)
    with pytest.raises(ValueError):
        m.bytes_view(4095, 2)


def test_roofline_rounds_up_exactly() -> None:
    assert roofline_ns(500) == 500
    assert roofline_ns(500, flops=1, peak_flops=50 * 10**12) == 501
    assert roofline_ns(0, nbytes=10**12, bandwidth=10**12) == 10**9
    assert roofline_ns(0, flops=3, peak_flops=2 * 10**9, nbytes=1, bandwidth=10**9) == 2


def test_eventq_bad_buffers_drop_the_event() -> None:
    rig = Rig(Va1Config(device_memory_size=1 << 20))
    q = rig.queues[1]
    small = rig.alloc.alloc(16)
    head = q.add([(small, 16, True)])  # too small for va1_event
    rig.kick(1)
    bad = rig.create_context()
    assert rig.submit(bad, fill(1 << 20, 4, 0)).status == 5
    assert q.pop_used() == (head, 0)
    assert rig.tracer.kinds("event_dropped")[-1]["reason"] == "bad buffer"
    rd, wr = rig.alloc.alloc(8), rig.alloc.alloc(24)
    head = q.add([(rd, 8, False), (wr, 24, True)])  # readable part: not an event buffer
    rig.kick(1)
    bad2 = rig.create_context()
    assert rig.submit(bad2, fill(1 << 20, 4, 0), fence=2).status == 5
    assert q.pop_used() == (head, 0)
    assert rig.dma.g_read(wr, 24) == bytes(24)
    good = rig.post_event_buffer(64)
    bad3 = rig.create_context()
    assert rig.submit(bad3, fill(1 << 20, 4, 0), fence=3).status == 5
    got = q.pop_used()
    assert got is not None and got[1] == 24
    assert struct.unpack("<IIQII", rig.dma.g_read(good, 24)) == (1, bad3, 3, 5, 0)
    assert rig.mmio.violations == []
