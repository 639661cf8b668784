"""The VA-1 hardware model: virtio device side, transports, command processor.

Wiring (by the VMM):
    dev = Va1Device(Va1Config(), DevicePorts(dma=..., clock=..., tracer=...))
    mmio = MmioTransport(dev, irq=line, tracer=tracer)
    value = mmio.read(offset, size); mmio.write(offset, size, value)
  or as a PCIe function (device_model.pci.api.PciFunction):
    fn = VirtioPciFunction(dev, msi=msi_port, tracer=tracer, intx=None)
    fn.config_read(off, size); fn.bar_write(0, off, size, value); fn.function_level_reset()
  or as an SR-IOV card (PF + VFs; see device_model/va1/card.py):
    card = Va1Card(Va1Config(), DevicePorts(...), memory_size=..., total_vfs=64)
    pf = card.physical_function(msi=msi_port, platform=sriov_platform)
"""
from .errors import DeviceModelError
from .ports import DevicePorts, DmaFault
from .va1.card import Va1Card
from .va1.config import Va1Config
from .va1.device import Va1Device
from .virtio.mmio import MmioTransport, Violation
from .virtio.pci import VirtioPciFunction
from .virtio.ring import RingError

__all__ = ["DeviceModelError", "DevicePorts", "DmaFault", "MmioTransport", "RingError", "Va1Card", "Va1Config",
           "Va1Device", "VirtioPciFunction", "Violation"]
