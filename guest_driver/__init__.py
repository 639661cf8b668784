"""The guest kernel side of VA-1: transports, virtqueues, the VA-1 driver, the device file.

Public entry point: `guest_driver.boot.boot(kernel) -> GuestOS`. Modules: `mm` (range
allocators), `virtio.mmio` (virtio-mmio v2 transport), `virtio.split_ring` (split
virtqueue driver side), `va1.driver` (one VA-1 function), `va1.fence`, `va1.devmem`,
`va1.devfile` (the uAPI of `uapi`). Imports only hwspec, numpy, cffi and the stdlib.
"""
