"""The guest kernel side of VA-1: transports, virtqueues, the VA-1 driver, the device file.

Public entry point: `guest_driver.boot.boot(kernel) -> GuestOS`. Modules: `mm` (range
allocators), `pci` (ECAM scan, BAR sizing, capability walks, FLR, `pci.msix`),
`virtio.transport` (the `VirtioTransport` interface the VA-1 driver is written against),
`virtio.mmio` (virtio-mmio v2), `virtio.pci` (virtio-pci modern, MSI-X),
`virtio.ring` (the `DriverRing` a driver uses), `virtio.ring_factory` (which ring the
negotiated features give), `virtio.split_ring` (split virtqueue driver side), `virtio.admin` (the virtio 1.3 admin
virtqueue), `va1.driver` (one VA-1 function, any transport), `va1.fence`, `va1.devmem`,
`va1.devfile` (the uAPI of `uapi`, per-context address spaces), `va1.pf` (the host's PF
management API: SR-IOV enable, VF provisioning through the admin queue). Imports only
hwspec, numpy, cffi and the stdlib. Every exception defined here derives from
`GuestDriverError` (`errors`).
"""
from .errors import GuestDriverError

__all__ = ["GuestDriverError"]
