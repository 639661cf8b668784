"""The host platform: machine and scheduler, memory, bus, PCI, IOMMU, interrupts, VFIO,
vDPA, SR-IOV. Every exception defined here derives from `VmmError` (`errors`)."""
from .errors import VmmError

__all__ = ["VmmError"]
