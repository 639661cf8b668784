"""What a VFIO device object must offer (the device-fd side of linux/vfio.h).

Why: the container and group here are finished before the PCI function that sits
behind a device fd; this Protocol is the seam, so a later change can implement it for a
VA-1 function (vfio-pci style: BAR regions, config region, MSI-X IRQ index) without
touching the group. Each call takes the cffi struct (vmm.vfio.uapi) the ioctl takes,
fills it in place like the kernel's copy_to_user, and raises OSError(errno, message)
with nothing changed when the request is bad (argsz below the minimum, unknown index,
bad flags: EINVAL, as vfio-pci answers).
"""
from __future__ import annotations

from typing import Protocol

import numpy as np

from ..bus import MmioHandler
from .uapi import CData


class VfioDevice(Protocol):
    def get_info(self, info: CData) -> None:
        """VFIO_DEVICE_GET_INFO: fill `struct vfio_device_info` (flags PCI|RESET,
        num_regions, num_irqs)."""
        ...

    def get_region_info(self, info: CData) -> None:
        """VFIO_DEVICE_GET_REGION_INFO: the caller sets `index` (and `argsz`, which may
        cover a larger buffer for the capability chain, e.g. SPARSE_MMAP); fill size,
        offset, flags and cap_offset, or raise the argsz to what the chain needs."""
        ...

    def get_irq_info(self, info: CData) -> None:
        """VFIO_DEVICE_GET_IRQ_INFO: the caller sets `index`; fill flags and count."""
        ...

    def set_irqs(self, irq_set: CData) -> None:
        """VFIO_DEVICE_SET_IRQS: `struct vfio_irq_set` with its data[] (bools or s32
        eventfds, as DATA_* says) for subindexes [start, start + count)."""
        ...

    def reset(self) -> None:
        """VFIO_DEVICE_RESET: function-level reset; no DMA for this function after it."""
        ...

    def region_read(self, index: int, offset: int, length: int) -> bytes:
        """pread() on the device fd inside region `index` (offset from its start)."""
        ...

    def region_write(self, index: int, offset: int, data: bytes) -> None:
        """pwrite() on the device fd inside region `index`."""
        ...

    def region_mmap(self, index: int, offset: int, length: int) -> "np.ndarray | MmioHandler":
        """mmap() of an area of region `index` that region info marks MMAP (and lists
        in its SPARSE_MMAP areas): a zero-copy uint8 view of memory, or, for a BAR of
        device registers, an MmioHandler whose loads and stores reach the registers
        directly (vfio-pci's BarMapping). OSError(EINVAL) elsewhere (the MSI-X table is
        never mappable, so the VMM keeps trapping it)."""
        ...
