"""The PCIe SR-IOV extended capability of a physical function (PCIe base spec §9.3.3).

Registers: SR-IOV Capabilities (0), Control (VF Enable, VF MSE; RW), Status (0),
InitialVFs and TotalVFs (RO), NumVFs (RW), Function Dependency Link (0), First VF
Offset and VF Stride (RO), VF Device ID (RO), Supported Page Sizes (RO: 4K, 8K, 64K,
256K, 1M and 4M, the set PCIe requires of a PF), System Page Size (RW, one bit), VF
BAR0/1 (one 64-bit memory BAR with the sizing protocol: its writable bits are the
address bits above the per-VF aperture, max(BAR size, System Page Size), so that every
VF's BAR starts on a system page, PCIe §9.3.3.13).

Rules the device enforces (each refusal is logged with a rule name, the write ignored):
NumVFs above TotalVFs ("sriov/num-vfs"); NumVFs changed while VF Enable is set
("sriov/num-vfs-while-enabled"); a System Page Size that is not one supported size
("sriov/page-size"); System Page Size changed while VF Enable is set
("sriov/page-size-while-enabled"). VF Enable 0 -> 1 calls `on_enable(NumVFs)`, 1 -> 0 `on_disable()`.
"""
from __future__ import annotations

from typing import Callable

from hwspec import pci as P

from .config import ConfigSpace, LogFn

# bit n: 2^(n+12) bytes. PCIe §9.3.3.12: a PF must support 4K, 8K, 64K, 256K, 1M and
# 4M (0x553); a host whose page is larger than every supported size cannot enable VFs.
SUPPORTED_PAGE_SIZES = 0x553
PAGE_SHIFT_BASE = 12


class SriovCap:
    def __init__(self, config: ConfigSpace, total_vfs: int, vf_device_id: int,
                 vf_bar_size: int, first_vf_offset: int, vf_stride: int,
                 on_enable: Callable[[int], None], on_disable: Callable[[], None],
                 log: LogFn) -> None:
        if not 0 <= total_vfs <= 0xFFFF or vf_bar_size & (vf_bar_size - 1):
            raise ValueError("bad SR-IOV parameters")
        self.config = config
        self.total_vfs = total_vfs
        self.vf_bar_size = vf_bar_size
        self.first_vf_offset = first_vf_offset
        self.vf_stride = vf_stride
        self._on_enable = on_enable
        self._on_disable = on_disable
        self._log = log
        body = bytearray(P.EXT_CAP_SRIOV_SIZEOF - 4)
        wmask = bytearray(len(body))

        def put(off: int, size: int, value: int, mask: int = 0) -> None:
            body[off - 4:off - 4 + size] = value.to_bytes(size, "little")
            wmask[off - 4:off - 4 + size] = mask.to_bytes(size, "little")

        put(P.SRIOV_CTRL, 2, 0, P.SRIOV_CTRL_VFE | P.SRIOV_CTRL_MSE)
        put(P.SRIOV_INITIAL_VF, 2, total_vfs)
        put(P.SRIOV_TOTAL_VF, 2, total_vfs)
        put(P.SRIOV_NUM_VF, 2, 0, 0xFFFF)
        put(P.SRIOV_VF_OFFSET, 2, first_vf_offset)
        put(P.SRIOV_VF_STRIDE, 2, vf_stride)
        put(P.SRIOV_VF_DID, 2, vf_device_id)
        put(P.SRIOV_SUP_PGSIZE, 4, SUPPORTED_PAGE_SIZES)
        put(P.SRIOV_SYS_PGSIZE, 4, 0x1, 0xFFFF_FFFF)
        put(P.SRIOV_BAR, 4, P.BASE_ADDRESS_MEM_TYPE_64)
        self.cap = config.add_ext_capability(P.EXT_CAP_ID_SRIOV, 1, bytes(body), bytes(wmask))
        self.enabled = False
        self._num_vfs = 0
        self._page = 0x1
        self._set_aperture()
        config.on_write(self.cap + P.SRIOV_CTRL, 2, self._ctrl_written)
        config.on_write(self.cap + P.SRIOV_NUM_VF, 2, self._num_vfs_written)
        config.on_write(self.cap + P.SRIOV_SYS_PGSIZE, 4, self._page_written)

    # --- registers ----------------------------------------------------------------------

    def _get(self, reg: int, size: int) -> int:
        return self.config.get(self.cap + reg, size)

    def _put(self, reg: int, size: int, value: int) -> None:
        self.config.put(self.cap + reg, size, value)

    @property
    def num_vfs(self) -> int:
        return self._num_vfs

    @property
    def vf_mse(self) -> bool:
        return bool(self._get(P.SRIOV_CTRL, 2) & P.SRIOV_CTRL_MSE)

    def vf_bar_base(self) -> int:
        return ((self._get(P.SRIOV_BAR, 4) & P.BASE_ADDRESS_MEM_MASK)
                | self._get(P.SRIOV_BAR + 4, 4) << 32)

    @property
    def page_size(self) -> int:
        """The System Page Size in bytes."""
        return 1 << (PAGE_SHIFT_BASE + self._page.bit_length() - 1)

    @property
    def vf_aperture(self) -> int:
        """Address space per VF in VF BAR0: its BAR size, padded to a system page."""
        return max(self.vf_bar_size, self.page_size)

    def vf_bar_address(self, vf: int) -> int:
        """Where VF `vf` (1-based) has its BAR0: VF BAR0 base + (vf-1) * aperture."""
        return self.vf_bar_base() + (vf - 1) * self.vf_aperture

    def _set_aperture(self) -> None:
        """VF BAR0's writable bits follow the aperture (the sizing protocol then reports
        it); address bits below it read 0, so the base stays page aligned."""
        mask = ~(self.vf_aperture - 1) & ((1 << 64) - 1)
        lo_mask = mask & P.BASE_ADDRESS_MEM_MASK
        self.config.set_wmask(self.cap + P.SRIOV_BAR, 4, lo_mask)
        self.config.set_wmask(self.cap + P.SRIOV_BAR + 4, 4, mask >> 32)
        lo = self._get(P.SRIOV_BAR, 4)
        self._put(P.SRIOV_BAR, 4, (lo & lo_mask) | (lo & ~P.BASE_ADDRESS_MEM_MASK))
        self._put(P.SRIOV_BAR + 4, 4, self._get(P.SRIOV_BAR + 4, 4) & (mask >> 32))

    def _num_vfs_written(self, offset: int, size: int) -> None:
        new = self._get(P.SRIOV_NUM_VF, 2)
        if new == self._num_vfs:
            return
        if self.enabled:
            self._put(P.SRIOV_NUM_VF, 2, self._num_vfs)
            self._log("sriov/num-vfs-while-enabled",
                      f"NumVFs {self._num_vfs} -> {new} with VF Enable set")
            return
        if new > self.total_vfs:
            self._put(P.SRIOV_NUM_VF, 2, self._num_vfs)
            self._log("sriov/num-vfs", f"NumVFs {new} > TotalVFs {self.total_vfs}")
            return
        self._num_vfs = new

    def _page_written(self, offset: int, size: int) -> None:
        new = self._get(P.SRIOV_SYS_PGSIZE, 4)
        if new == self._page:
            return
        if self.enabled:
            self._put(P.SRIOV_SYS_PGSIZE, 4, self._page)
            self._log("sriov/page-size-while-enabled",
                      f"System Page Size {self._page:#x} -> {new:#x} with VF Enable set")
            return
        if new & (new - 1) or not new & SUPPORTED_PAGE_SIZES:
            self._put(P.SRIOV_SYS_PGSIZE, 4, self._page)
            self._log("sriov/page-size", f"System Page Size {new:#x} is not exactly one of "
                                         f"the supported sizes ({SUPPORTED_PAGE_SIZES:#x})")
            return
        self._page = new
        self._set_aperture()

    def _ctrl_written(self, offset: int, size: int) -> None:
        vfe = bool(self._get(P.SRIOV_CTRL, 2) & P.SRIOV_CTRL_VFE)
        if vfe and not self.enabled:
            self.enabled = True
            self._on_enable(self._num_vfs)
        elif not vfe and self.enabled:
            self.enabled = False
            self._on_disable()

    def reset(self) -> None:
        """After the config image went back to power-on (PF FLR): VFs go away."""
        was = self.enabled
        self.enabled = False
        self._num_vfs = 0
        self._page = 0x1
        self._set_aperture()
        if was:
            self._on_disable()


def make_vf_header(config: ConfigSpace) -> None:
    """Turn a function's power-on header into a VF's (PCIe §9.3.4): Vendor and Device
    ID read 0xFFFF, the BAR registers read 0 (the PF's VF BARs place the VF), Memory
    Space and INTx Disable are RsvdP (the PF's VF MSE decides; no INTx); Bus Master is
    the VF's own."""
    config.put(P.VENDOR_ID, 2, 0xFFFF)
    config.put(P.DEVICE_ID, 2, 0xFFFF)
    config.set_wmask(P.COMMAND, 2, P.COMMAND_MASTER)
    for i in range(P.NUM_BARS):
        reg = P.BASE_ADDRESS_0 + 4 * i
        config.put(reg, 4, 0)
        config.set_wmask(reg, 4, 0)
