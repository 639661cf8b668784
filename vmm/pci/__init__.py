"""The host side of PCI: host bridges (ECAM, BAR assignment and decoding)."""
from .host_bridge import BarRegion, BarWindow, PciError, PciHost, PciSlot, size_bars

__all__ = ["BarRegion", "BarWindow", "PciError", "PciHost", "PciSlot", "size_bars"]
