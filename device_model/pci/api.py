"""The contract between a PCI function of the device model and the platform's PCI host.

The host reaches a function only through this: its configuration space (4 KiB, as ECAM
gives it), its BARs by index and offset (the host decides where BARs live in its
address space, from what software wrote to the BAR registers), function-level reset,
and facts it needs to plan (BAR sizes, where the MSI-X table is).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence

from ..ports import DevicePorts, MsiPort


@dataclass(frozen=True)
class BarInfo:
    index: int
    size: int            # a power of two, >= 4 KiB for memory BARs
    is_64bit: bool
    prefetchable: bool


@dataclass(frozen=True)
class MsixInfo:
    count: int           # table entries
    table_bar: int
    table_offset: int
    pba_bar: int
    pba_offset: int


class PciFunction(Protocol):
    def config_read(self, offset: int, size: int) -> int:
        """1, 2 or 4 bytes within 0..4095; anything else reads all-ones. Never raises."""
        ...

    def config_write(self, offset: int, size: int, value: int) -> None:
        """Read-only and out-of-range bits are ignored. Never raises."""
        ...

    def bars(self) -> tuple[BarInfo, ...]: ...

    def bar_read(self, index: int, offset: int, size: int) -> int:
        """An access inside BAR `index`; outside it reads all-ones. Never raises."""
        ...

    def bar_write(self, index: int, offset: int, size: int, value: int) -> None: ...

    def msix_info(self) -> MsixInfo | None: ...

    def function_level_reset(self) -> None: ...


class SriovPlatform(Protocol):
    """What a PF with SR-IOV needs from the host it sits in. VF n (1-based) has
    requester ID = PF RID + First VF Offset + (n-1) * VF Stride; the platform builds its
    DMA (through the IOMMU, by that RID) and MSI ports, and puts the VFs on its bus
    when software sets VF Enable (and takes them off when it clears it)."""

    def vf_ports(self, vf: int) -> tuple[DevicePorts, MsiPort]: ...

    def vfs_enabled(self, vfs: Sequence[PciFunction]) -> None: ...

    def vfs_disabled(self) -> None: ...
