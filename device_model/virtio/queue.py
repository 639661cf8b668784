"""A virtqueue as the driver programs it through a transport's registers (virtio 1.x
§2.5): size, enable, and the guest addresses of its three areas.

What those areas hold depends on the ring layout the driver negotiated; the transport
keeps only the registers here and, at DRIVER_OK, has `ring_factory.make_device_ring`
build the device side of the ring on them.
"""
from __future__ import annotations


def is_power_of_two(n: int) -> bool:
    return n > 0 and (n & (n - 1)) == 0


class Queue:
    """One virtqueue's registers (the driver's area addresses keep their split-ring
    names: descriptor table, avail ring = driver area, used ring = device area)."""

    def __init__(self, max_size: int) -> None:
        self.max_size = max_size
        self.reset()

    def reset(self) -> None:
        """Forget configuration (device reset)."""
        self.size = self.max_size
        self.ready = False
        self.desc_table = 0
        self.avail_ring = 0
        self.used_ring = 0
        # RING_RESET: reset on its own after DRIVER_OK; its registers may be written
        # again until it is re-enabled
        self.queue_reset = False
