"""Guest RAM filled with seeded random bytes, for the IOMMU and VFIO container tests."""
from __future__ import annotations

from typing import Iterator

import numpy as np

from vmm.memory import GuestMemory, HostMemory


def random_ram(base: int, size: int, seed: int, host_offset: int = 0) -> Iterator[GuestMemory]:
    """A pytest fixture body (`yield from`): `size` bytes of guest RAM at `base`, in a
    host mapping with 64 KiB to spare, starting `host_offset` bytes into it (so that a
    vaddr differs from the gpa), filled from `seed`; the mapping is closed afterwards."""
    host = HostMemory(size + 0x10000)
    if host_offset:
        host.carve(host_offset)
    mem = GuestMemory(host, base, size)
    mem.write(base, np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8))
    yield mem
    host.close()
