"""Guest boot: probe the platform's devices and bind VA-1 functions as /dev/accel/accelN."""
from __future__ import annotations

import errno

from hwspec import va1 as A

from .kernel import GuestKernel
from .mm import PageAllocator
from .uapi import DeviceFile
from .va1.devfile import VA1File
from .va1.driver import VA1Device
from .virtio.mmio import TransportError, VirtioMmio

ACCEL_DIR = "/dev/accel/"


class AccelGuestOS:
    """GuestOS: the device files this guest's kernel created at boot."""

    def __init__(self, kernel: GuestKernel) -> None:
        self.kernel = kernel
        self.devices: dict[str, VA1Device] = {}
        self.probe_errors: list[str] = []  # one line per device that failed to bind

    def open(self, path: str) -> DeviceFile:
        dev = self.devices.get(path)
        if dev is None:
            raise OSError(errno.ENOENT, f"{path}: no such device "
                                        f"(have {', '.join(sorted(self.devices)) or 'none'})")
        return VA1File(dev, path)


def boot(kernel: GuestKernel) -> AccelGuestOS:
    """Probe every platform device; bind each VA-1 virtio-mmio function in order."""
    os_ = AccelGuestOS(kernel)
    alloc = PageAllocator(kernel.ram.base, kernel.ram.size, "guest RAM")
    minor = 0
    for pdev in kernel.platform_devices:
        if pdev.compatible != "virtio,mmio":
            continue
        try:
            dev_id = VirtioMmio(kernel.mmio, pdev.base).probe()
        except TransportError as e:
            os_.probe_errors.append(str(e))
            kernel.trace.emit("probe_error", base=pdev.base, error=str(e))
            continue
        if dev_id != A.VIRTIO_DEVICE_ID:
            continue  # 0 = empty slot; other ids are other drivers' business
        name = f"accel{minor}"
        dev = VA1Device(kernel, pdev, alloc, name)
        try:
            dev.probe()
        except TransportError as e:
            os_.probe_errors.append(str(e))
            kernel.trace.emit("probe_error", base=pdev.base, error=str(e))
            continue
        os_.devices[ACCEL_DIR + name] = dev
        kernel.trace.emit("bound", dev=name, base=pdev.base, irq=pdev.irq,
                          features=dev.features)
        minor += 1
    return os_
