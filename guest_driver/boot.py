"""Guest boot: probe the platform's devices and the PCI buses, and bind VA-1 functions as
/dev/accel/accelN: virtio-mmio ones first (firmware order), then PCI ones in
(host bridge, bus, device, function) order. A function that fails probe gets a line in
`probe_errors` and no device file; boot goes on.

A PCI function with an SR-IOV capability (TotalVFs > 0) is a PF: it is bound with the
admin virtqueue (SR_IOV and ADMIN_VQ accepted when offered) and, when both were
negotiated, its management API is in `pfs` under the same path. No other function ever
accepts those features (a VF seen through VFIO has no SR-IOV capability)."""
from __future__ import annotations

import errno

from hwspec import va1 as A

from .kernel import GuestKernel
from .mm import PageAllocator
from .pci import PciError, scan_host
from .uapi import DeviceFile
from .va1.devfile import VA1File
from .params import ParamError, parse_cmdline
from .va1.driver import VA1Device
from .va1.pf import VA1Pf, has_sriov
from .virtio.mmio import VirtioMmio
from .virtio.pci import VirtioPci
from .virtio.transport import TransportError

ACCEL_DIR = "/dev/accel/"


class AccelGuestOS:
    """GuestOS: the device files this guest's kernel created at boot."""

    def __init__(self, kernel: GuestKernel) -> None:
        self.kernel = kernel
        self.devices: dict[str, VA1Device] = {}
        self.probe_errors: list[str] = []  # one line per device that failed to bind
        self.pfs: dict[str, VA1Pf] = {}    # SR-IOV PFs (host), by device path
        self.files: list[VA1File] = []     # every file opened here, in order
        self.killed = False

    def open(self, path: str) -> DeviceFile:
        if self.killed:
            raise OSError(errno.ESRCH, f"{path}: the program was killed")
        dev = self.devices.get(path)
        if dev is None:
            raise OSError(errno.ENOENT, f"{path}: no such device "
                                        f"(have {', '.join(sorted(self.devices)) or 'none'})")
        f = VA1File(dev, path)
        self.files.append(f)
        return f

    def kill(self) -> list[str]:
        """The program died: the kernel's exit path closes every device file it still
        has open (the uAPI's close: contexts destroyed, buffers freed once idle), in the
        calling task. Its later calls on them fail EBADF, a new open ESRCH. Returns the
        paths closed."""
        self.killed = True
        closed = []
        for f in self.files:
            if not f.closed:
                f.close()
                closed.append(f.path)
        return closed

    def _probe_error(self, error: str, **where: object) -> None:
        self.probe_errors.append(error)
        self.kernel.trace.emit("probe_error", error=error, **where)


def boot(kernel: GuestKernel, *, optional_features: int | None = None) -> AccelGuestOS:
    """Bind every VA-1 function: platform virtio-mmio ones, then PCI ones.
    `optional_features`: the optional virtio features the VA-1 driver may accept (like
    a module parameter; None: its defaults)."""
    os_ = AccelGuestOS(kernel)
    try:
        params = parse_cmdline(kernel.cmdline)
    except ParamError as e:
        os_._probe_error(f"va1: {e}; the driver binds no device")
        return os_
    alloc = PageAllocator(kernel.ram.base, kernel.ram.size, "guest RAM")
    for pdev in kernel.platform_devices:
        if pdev.compatible != "virtio,mmio":
            continue
        try:
            dev_id = VirtioMmio(kernel.mmio, pdev.base).probe()
        except TransportError as e:
            os_._probe_error(str(e), base=pdev.base)
            continue
        if dev_id != A.VIRTIO_DEVICE_ID:
            continue  # 0 = empty slot; other ids are other drivers' business
        name = f"accel{len(os_.devices)}"
        dev = VA1Device(kernel, pdev, alloc, name, params=params)
        try:
            dev.probe()
        except TransportError as e:
            os_._probe_error(str(e), base=pdev.base)
            continue
        os_.devices[ACCEL_DIR + name] = dev
        kernel.trace.emit("bound", dev=name, base=pdev.base, irq=pdev.irq,
                          features=dev.features)
    for segment, host in enumerate(kernel.pci_hosts):
        scan = scan_host(kernel, host, segment)
        for err in scan.errors:
            os_._probe_error(err, ecam=host.ecam_base)
        for fn in sorted(scan.functions, key=lambda f: f.bdf):
            if fn.vendor_id != A.PCI_VENDOR_ID or fn.device_id != A.PCI_DEVICE_ID:
                continue
            name = f"accel{len(os_.devices)}"
            try:
                is_pf = has_sriov(fn)
                dev = VA1Device(kernel, VirtioPci(kernel, fn), alloc, name, admin=is_pf,
                                params=params)
                dev.probe()
                if dev.admin is not None:
                    pf = VA1Pf(kernel, fn, alloc, name, host, device=dev)
                    pf.probe()
                    os_.pfs[ACCEL_DIR + name] = pf
            except (TransportError, PciError) as e:
                os_._probe_error(str(e), pci=str(fn.bdf))
                continue
            os_.devices[ACCEL_DIR + name] = dev
            kernel.trace.emit("bound", dev=name, pci=str(fn.bdf), features=dev.features)
    return os_
