"""MSI-X (PCI Local Bus 3.0 §6.8.2), as Linux's msix_capability_init sets it up.

The table lives in a memory BAR; each entry is address lo/hi, data, vector control.
Setup: ENABLE with MASKALL (the function sends nothing while entries are written),
every entry masked, program the entries we use from kernel.irq.alloc_msi, unmask them,
clear MASKALL. Teardown masks, disables and frees the messages.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from hwspec import pci as P

from ..kernel import GuestKernel, MsiMessage
from .config import PciError
from .scan import PciFunction


@dataclass(frozen=True)
class MsixInfo:
    cap: int            # config offset of the capability
    table_size: int     # entries
    table_addr: int     # guest physical address of entry 0
    pba_addr: int


def parse_msix(fn: PciFunction) -> MsixInfo:
    """Find the MSI-X capability and place its table and PBA inside their BARs."""
    cap = fn.find_cap(P.CAP_ID_MSIX)
    if cap is None:
        raise PciError(f"{fn.bdf}: no MSI-X capability")
    cfg = fn.cfg
    ctrl = cfg.read16(cap + P.MSIX_FLAGS)
    n = (ctrl & P.MSIX_FLAGS_QSIZE) + 1
    table = cfg.read32(cap + P.MSIX_TABLE)
    pba = cfg.read32(cap + P.MSIX_PBA)
    addrs = []
    for what, reg, bir_mask, off_mask, length in (
            ("table", table, P.MSIX_TABLE_BIR, P.MSIX_TABLE_OFFSET, n * P.MSIX_ENTRY_SIZE),
            ("PBA", pba, P.MSIX_PBA_BIR, P.MSIX_PBA_OFFSET, 8 * ((n + 63) // 64))):
        bir, off = reg & bir_mask, reg & off_mask
        try:
            bar = fn.bar(bir)
        except PciError as e:
            raise PciError(f"MSI-X {what}: {e}") from None
        if off + length > bar.size:
            raise PciError(f"{fn.bdf}: MSI-X {what} [{off:#x}, +{length:#x}) overruns "
                           f"BAR{bir} of {bar.size:#x} bytes")
        addrs.append(bar.address + off)
    return MsixInfo(cap, n, addrs[0], addrs[1])


class MsixVectors:
    """The MSI-X vectors one driver uses on one function."""

    def __init__(self, kernel: GuestKernel, fn: PciFunction, info: MsixInfo | None = None
                 ) -> None:
        self.kernel = kernel
        self.fn = fn
        self.info = info if info is not None else parse_msix(fn)
        self.messages: list[MsiMessage] = []
        self.enabled = False

    @property
    def table_size(self) -> int:
        return self.info.table_size

    def _entry(self, i: int, field: int) -> int:
        return self.info.table_addr + i * P.MSIX_ENTRY_SIZE + field

    def _ctrl(self, set_bits: int, clear_bits: int) -> None:
        reg = self.info.cap + P.MSIX_FLAGS
        ctrl = self.fn.cfg.read16(reg)
        self.fn.cfg.write16(reg, (ctrl & ~clear_bits) | set_bits)

    def setup(self, handlers: list[tuple[Callable[[], None], str]]) -> list[MsiMessage]:
        """Allocate one message per handler (entry i = handlers[i]) and enable MSI-X.

        Raises PciError when the table is too small, OSError(ENOSPC) when the kernel has
        no vectors left (nothing stays allocated then).
        """
        if self.messages:
            raise PciError(f"{self.fn.bdf}: MSI-X vectors already set up")
        if not 0 < len(handlers) <= self.table_size:
            raise PciError(f"{self.fn.bdf}: {len(handlers)} MSI-X vectors wanted, the table "
                           f"has {self.table_size}")
        msgs: list[MsiMessage] = []
        try:
            for handler, name in handlers:
                msgs.append(self.kernel.irq.alloc_msi(handler, name))
        except OSError:
            for m in msgs:
                self.kernel.irq.free_msi(m)
            raise
        self.messages = msgs
        self._program()
        cmd = self.fn.cfg.read16(P.COMMAND)
        if not cmd & P.COMMAND_INTX_DISABLE:
            self.fn.cfg.write16(P.COMMAND, cmd | P.COMMAND_INTX_DISABLE)
        self.enabled = True
        return msgs

    def _program(self) -> None:
        """Enabled but function-masked while the entries are written; all entries
        masked, ours programmed and unmasked, then MASKALL cleared."""
        mmio = self.kernel.mmio
        self._ctrl(P.MSIX_FLAGS_ENABLE | P.MSIX_FLAGS_MASKALL, 0)
        for i in range(self.table_size):
            mmio.write(self._entry(i, P.MSIX_ENTRY_VECTOR_CTRL), 4, P.MSIX_ENTRY_CTRL_MASKBIT)
        for i, m in enumerate(self.messages):
            mmio.write(self._entry(i, P.MSIX_ENTRY_LOWER_ADDR), 4, m.address & 0xFFFFFFFF)
            mmio.write(self._entry(i, P.MSIX_ENTRY_UPPER_ADDR), 4, m.address >> 32)
            mmio.write(self._entry(i, P.MSIX_ENTRY_DATA), 4, m.data & 0xFFFFFFFF)
            mmio.write(self._entry(i, P.MSIX_ENTRY_VECTOR_CTRL), 4, 0)  # unmask
        self._ctrl(0, P.MSIX_FLAGS_MASKALL)

    def lost(self) -> str | None:
        """Why the function's MSI-X is no longer as `setup` left it (ENABLE clear or
        MASKALL set, as an FLR or a VF reset leaves it), or None. One config read."""
        if not self.messages:
            return None
        ctrl = self.fn.cfg.read16(self.info.cap + P.MSIX_FLAGS)
        if ctrl == 0xFFFF:
            return "function does not answer (MSI-X control reads all ones)"
        if not ctrl & P.MSIX_FLAGS_ENABLE or ctrl & P.MSIX_FLAGS_MASKALL:
            return f"MSI-X disabled behind the driver (control {ctrl:#06x})"
        return None

    def reprogram(self) -> None:
        """Disable, then set up the same messages again (after a reset the driver did
        not start: the enable transition makes a shadowing VMM program the host)."""
        if self.messages:
            self._ctrl(0, P.MSIX_FLAGS_ENABLE | P.MSIX_FLAGS_MASKALL)
            self._program()

    def restore(self) -> None:
        """Re-program the table and control after an FLR cleared them."""
        if self.messages:
            self._program()

    def teardown(self) -> None:
        """Mask every entry we used, disable MSI-X, free the messages (idempotent)."""
        if self.messages:
            mmio = self.kernel.mmio
            for i in range(len(self.messages)):
                mmio.write(self._entry(i, P.MSIX_ENTRY_VECTOR_CTRL), 4,
                           P.MSIX_ENTRY_CTRL_MASKBIT)
        if self.enabled:
            self._ctrl(0, P.MSIX_FLAGS_ENABLE | P.MSIX_FLAGS_MASKALL)
            self.enabled = False
        msgs, self.messages = self.messages, []
        for m in msgs:
            self.kernel.irq.free_msi(m)

