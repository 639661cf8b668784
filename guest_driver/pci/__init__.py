"""PCI: ECAM config access, bus scan, BAR sizing, capability walks, FLR and MSI-X.

Public API: `scan_host(kernel, host) -> ScanResult`, `PciFunction` (bars, caps,
ext_caps, find_cap), `enable_device`, `function_level_reset`, `MsixVectors`, and the
error `PciError`. Imports only hwspec and the guest kernel protocols.
"""
from .config import Bdf, ConfigSpace, PciError
from .msix import MsixInfo, MsixVectors, parse_msix
from .scan import (Bar, Capability, PciFunction, ScanResult, disable_device, enable_device,
                   function_level_reset, read_function, scan_host, size_bars, walk_caps,
                   walk_ext_caps)

__all__ = ["Bdf", "ConfigSpace", "PciError", "MsixInfo", "MsixVectors", "parse_msix", "Bar",
           "Capability", "PciFunction", "ScanResult", "disable_device", "enable_device",
           "function_level_reset", "read_function", "scan_host", "size_bars", "walk_caps",
           "walk_ext_caps"]
