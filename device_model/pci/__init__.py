"""PCI functions of the device model: what a PCI host bridge (the VMM) talks to.

`api` is the contract with the platform's PCI host; `config` and `msix` are the building
blocks every function uses (configuration space with capability chains and FLR, MSI-X
table and PBA). The virtio-pci function itself is `device_model.virtio.pci`."""
from .api import BarInfo, MsixInfo, PciFunction
from .config import ConfigSpace, add_pcie_endpoint_cap, all_ones
from .msix import Msix

__all__ = ["BarInfo", "ConfigSpace", "Msix", "MsixInfo", "PciFunction",
           "add_pcie_endpoint_cap", "all_ones"]
