"""The VA-1 hardware model: virtio device side, transports, command processor.

Wiring (by the VMM):
    dev = Va1Device(Va1Config(), DevicePorts(dma=..., clock=..., tracer=...))
    mmio = MmioTransport(dev, irq=line, tracer=tracer)
    value = mmio.read(offset, size); mmio.write(offset, size, value)
"""
from .ports import DevicePorts, DmaFault
from .va1.config import Va1Config
from .va1.device import Va1Device
from .virtio.mmio import MmioTransport, Violation
from .virtio.queue import RingError

__all__ = ["DevicePorts", "DmaFault", "MmioTransport", "RingError", "Va1Config",
           "Va1Device", "Violation"]
