"""virtio-pci modern transport (virtio 1.x §4.1; VA-1 spec "virtio-pci transport").

The same transport-agnostic `VirtioDevice` that sits behind virtio-mmio, presented as a
PCIe function: a type-0 configuration space with the five virtio vendor capabilities,
MSI-X and a PCI Express capability (FLR), and one 64-bit memory BAR holding the common
configuration, ISR, device configuration, notification area, MSI-X table and PBA, each
on its own 4 KiB page (so a VMM can trap the table page and map the rest).

Strict like the mmio transport: every driver rule that is broken is logged in
`violations` (the rule names are shared with mmio where a rule applies to both), emitted
as a `violation` trace event, and the offending access has no effect. Nothing guest
software can do makes a method of `VirtioPciFunction` raise.
"""
from __future__ import annotations

import struct

from hwspec import pci as P
from hwspec import va1
from hwspec import virtio as V
from hwspec import virtio_admin as VA
from hwspec import virtio_pci as VP

from typing import Protocol

from ..pci.api import BarInfo, MsixInfo
from ..pci.config import ConfigSpace, add_pcie_endpoint_cap, all_ones
from ..pci.msix import Msix
from ..ports import IrqLine, MsiPort, NullTracer, Tracer
from .device import VirtioDevice
from .queue import Queue
from .status import TransportCore, Violation

_PAGE = 0x1000
_BAR_ACCESS_SIZES = (1, 2, 4, 8)
_CONFIG_SIZES = (1, 2, 4, 8)
# 64-bit queue addresses may also be accessed whole (virtio 1.x §4.1.3.1)
_QUEUE_ADDR_LO = (VP.COMMON_Q_DESCLO, VP.COMMON_Q_AVAILLO, VP.COMMON_Q_USEDLO)
_QUEUE_ADDR = _QUEUE_ADDR_LO + (VP.COMMON_Q_DESCHI, VP.COMMON_Q_AVAILHI, VP.COMMON_Q_USEDHI)
_QUEUE_WRITES = (VP.COMMON_Q_SIZE, VP.COMMON_Q_ENABLE) + _QUEUE_ADDR


class SriovHooks(Protocol):
    """What an SR-IOV owner plugs into a function: the transport calls it at the few
    points where a physical or virtual function differs from a plain one, so that the
    generic transport needs to know nothing else of SR-IOV."""

    def init_config(self, config: ConfigSpace) -> None:
        """Once, before the power-on image is sealed: add or reshape registers."""
        ...

    def memory_enabled(self, command: int) -> bool:
        """Whether the BAR decodes, given this function's Command register."""
        ...

    def after_flr(self) -> None:
        """An FLR has just put every register of the function back to power-on."""
        ...


class VirtioPciFunction(TransportCore):
    """A virtio 1.x device as a PCIe function (implements `device_model.pci.api.PciFunction`).

    `msi` receives MSI-X messages; `intx`, if given, is the level INTx line used while
    MSI-X is disabled (INTERRUPT_PIN then reads INTA, else 0). `device_cfg_length` is
    the size of the device configuration structure (VA-1: 72 bytes)."""

    _STATUS_NAME = "device_status"
    _DRIVER_FEATURES_NAME = "driver_feature"
    _QUEUE_SEL_NAME = "queue_select"
    _QUEUE_SIZE_NAME = "queue_size"
    _QUEUE_REG_NAME = "common config"
    _NOTIFY_NAME = "notify"

    def __init__(self, device: VirtioDevice, msi: MsiPort, tracer: Tracer | None = None,
                 intx: IrqLine | None = None, *,
                 subsystem_vendor_id: int = va1.PCI_SUBSYSTEM_VENDOR_ID,
                 subsystem_id: int = va1.PCI_SUBSYSTEM_ID,
                 device_cfg_length: int = va1.CONFIG.size,
                 queue_capacity: int = 0,
                 sriov_hooks: SriovHooks | None = None) -> None:
        """`queue_capacity`: queues (and MSI-X vectors) to provide for, when the device
        may be re-provisioned with more queues later. `sriov_hooks`: those of the SR-IOV
        owner when this function is a physical or virtual function."""
        self.device = device
        self.msi = msi
        self.sriov_hooks = sriov_hooks
        self.intx = intx
        self.tracer: Tracer = tracer if tracer is not None else NullTracer()
        self.violations: list[Violation] = []
        sizes = list(device.queue_max_sizes())
        extra = max(0, queue_capacity - len(sizes))
        self.queues: list[Queue] = [Queue(n) for n in sizes] + [
            Queue(sizes[-1] if sizes else 1) for _ in range(extra)]
        self.queue_capacity = len(self.queues)
        self._admin_index: int | None = getattr(device, "admin_queue_index", None)
        self._intx_level = False
        self.config = ConfigSpace(
            vendor_id=VP.PCI_VENDOR_ID, device_id=VP.PCI_DEVICE_ID_BASE + device.device_id,
            revision=VP.PCI_REVISION_MODERN, class_code=P.CLASS_PROCESSING_ACCELERATOR << 16,
            subsystem_vendor_id=subsystem_vendor_id, subsystem_id=subsystem_id,
            interrupt_pin=P.INTERRUPT_PIN_INTA if self.intx is not None else 0,
            log=self._violation)
        self.bar = self.config.add_bar(va1.PCI_BAR, va1.PCI_BAR_SIZE, is_64bit=True,
                                       prefetchable=False)  # ISR reads: side effects
        self.notify_multiplier = va1.PCI_NOTIFY_OFF_MULTIPLIER
        self.notify_length = self.queue_capacity * self.notify_multiplier
        self.device_cfg_length = device_cfg_length
        self.common_cfg_length = (VA.COMMON_CFG_SIZE_WITH_ADMIN
                                  if self._admin_index is not None else VP.COMMON_CFG_SIZE)
        self.caps: dict[int, int] = {}
        self.caps[VP.CAP_COMMON_CFG] = self._add_virtio_cap(
            VP.CAP_COMMON_CFG, va1.PCI_COMMON_CFG_OFFSET, self.common_cfg_length)
        self.caps[VP.CAP_ISR_CFG] = self._add_virtio_cap(VP.CAP_ISR_CFG, va1.PCI_ISR_OFFSET, 1)
        self.caps[VP.CAP_DEVICE_CFG] = self._add_virtio_cap(
            VP.CAP_DEVICE_CFG, va1.PCI_DEVICE_CFG_OFFSET, self.device_cfg_length)
        self.caps[VP.CAP_NOTIFY_CFG] = self._add_virtio_cap(
            VP.CAP_NOTIFY_CFG, va1.PCI_NOTIFY_OFFSET, self.notify_length,
            extra=struct.pack("<I", self.notify_multiplier))
        self.caps[VP.CAP_PCI_CFG] = self._add_pci_cfg_cap()
        self.msix = Msix(self.config, 1 + self.queue_capacity, va1.PCI_BAR,
                         va1.PCI_MSIX_TABLE_OFFSET, va1.PCI_BAR, va1.PCI_MSIX_PBA_OFFSET,
                         msi, self.tracer, self._violation, self._bus_master)
        self.config.on_write(self.msix.cap + P.MSIX_FLAGS, 2, self._irq_mode_changed)
        self.pcie_cap = add_pcie_endpoint_cap(self.config, self.function_level_reset)
        self.config.on_write(P.COMMAND, 2, self._command_written)
        if sriov_hooks is not None:
            sriov_hooks.init_config(self.config)
        self.config.seal_defaults()
        self._reset_state()
        self.device.set_bus_master(self._bus_master())

    @property
    def num_queues(self) -> int:
        """Queues the driver sees in num_queues (the admin queue not included)."""
        if self._admin_index is not None:
            return self._admin_index
        n = getattr(self.device, "num_queues", None)
        return n if isinstance(n, int) else len(self.device.queue_max_sizes())

    @property
    def admin_queue_index(self) -> int | None:
        """The admin virtqueue's index (None when the device has none)."""
        return self._admin_index

    def _queue_ok(self, index: int) -> bool:
        return 0 <= index < self.num_queues or (
            self._admin_index is not None and index == self._admin_index)

    def _memory_enabled(self) -> bool:
        command = self.config.command
        if self.sriov_hooks is not None:
            return self.sriov_hooks.memory_enabled(command)
        return bool(command & P.COMMAND_MEMORY)

    # --- capabilities -----------------------------------------------------------------

    def _add_virtio_cap(self, cfg_type: int, offset: int, length: int,
                        extra: bytes = b"", wmask: bytes | None = None) -> int:
        """struct virtio_pci_cap (+ `extra`) as a vendor-specific capability."""
        cap_len = VP.CAP.size + len(extra)
        raw = struct.pack(VP.CAP.format, P.CAP_ID_VNDR, 0, cap_len, cfg_type, va1.PCI_BAR,
                          0, 0, offset, length) + extra
        return self.config.add_capability(P.CAP_ID_VNDR, raw[2:], wmask)

    def _add_pci_cfg_cap(self) -> int:
        """VIRTIO_PCI_CAP_PCI_CFG: bar/offset/length and pci_cfg_data are the driver's,
        and reading or writing pci_cfg_data accesses the BAR (virtio 1.x §4.1.4.9)."""
        o = VP.CAP.offsets
        wmask = bytearray(VP.PCI_CFG_CAP_SIZE)
        wmask[o["bar"]] = 0xFF
        for field in ("offset", "length"):
            wmask[o[field]:o[field] + 4] = b"\xff" * 4
        wmask[VP.PCI_CFG_CAP_DATA:VP.PCI_CFG_CAP_DATA + 4] = b"\xff" * 4
        cap = self._add_virtio_cap(VP.CAP_PCI_CFG, 0, 0, extra=bytes(4),
                                   wmask=bytes(wmask[2:]))
        self.config.on_read(cap + VP.PCI_CFG_CAP_DATA, 4, self._pci_cfg_read)
        self.config.on_write(cap + VP.PCI_CFG_CAP_DATA, 4, self._pci_cfg_write)
        return cap

    def _pci_cfg_window(self) -> tuple[int, int, int] | None:
        cap = self.caps[VP.CAP_PCI_CFG]
        o = VP.CAP.offsets
        bar = self.config.get(cap + o["bar"], 1)
        offset = self.config.get(cap + o["offset"], 4)
        length = self.config.get(cap + o["length"], 4)
        if (bar != va1.PCI_BAR or length not in (1, 2, 4) or offset % length
                or offset + length > va1.PCI_BAR_SIZE):
            self._violation("pci/cfg-window", f"PCI_CFG access with bar {bar}, offset "
                            f"{offset:#x}, length {length}")
            return None
        return bar, offset, length

    def _pci_cfg_read(self, offset: int, size: int) -> None:
        win = self._pci_cfg_window()
        if win is None:
            return
        value = self._bar_access_read(win[1], win[2])
        self.config.put(self.caps[VP.CAP_PCI_CFG] + VP.PCI_CFG_CAP_DATA, 4, value)

    def _pci_cfg_write(self, offset: int, size: int) -> None:
        win = self._pci_cfg_window()
        if win is None:
            return
        value = self.config.get(self.caps[VP.CAP_PCI_CFG] + VP.PCI_CFG_CAP_DATA, 4)
        self._bar_access_write(win[1], win[2], value & all_ones(win[2]))

    # --- state ------------------------------------------------------------------------

    def _reset_state(self) -> None:
        """Device status 0: everything the virtio common configuration holds."""
        self._reset_core_state()
        self.isr = 0
        self.msix_config = VP.MSI_NO_VECTOR
        self.queue_vectors = [VP.MSI_NO_VECTOR] * self.queue_capacity
        self._update_intx()

    def _bus_master(self) -> bool:
        return bool(self.config.command & P.COMMAND_MASTER)

    # --- interrupts -------------------------------------------------------------------

    def _update_intx(self) -> None:
        """INTx (and Status.INTERRUPT) follow the ISR while MSI-X is off (§4.1.4.5)."""
        asserted = self.isr != 0 and not self.msix.enabled
        status = self.config.get(P.STATUS, 2)
        self.config.put(P.STATUS, 2, (status | P.STATUS_INTERRUPT) if asserted
                        else status & ~P.STATUS_INTERRUPT)
        level = asserted and not self.config.command & P.COMMAND_INTX_DISABLE
        if self.intx is not None and level != self._intx_level:
            self._intx_level = level
            self.intx.set_level(level)

    def _irq_mode_changed(self, offset: int, size: int) -> None:
        self._update_intx()

    def _command_written(self, offset: int, size: int) -> None:
        """INTx Disable, and Bus Master: the device holds its DMA while it is 0 and
        carries on when it is 1 again (after the vectors it pended meanwhile)."""
        self._update_intx()
        if self._bus_master():
            self.msix.flush()
        self.device.set_bus_master(self._bus_master())

    def signal_used(self, queue_index: int) -> None:
        """VirtioInterrupt: a used-buffer notification for `queue_index`."""
        if self.msix.enabled:
            vector = (self.queue_vectors[queue_index]
                      if 0 <= queue_index < self.queue_capacity else VP.MSI_NO_VECTOR)
            self.tracer.emit("irq", queue=queue_index, vector=vector)
            if vector != VP.MSI_NO_VECTOR:
                self.msix.fire(vector)
            return
        self.isr |= VP.ISR_QUEUE
        self.tracer.emit("irq", queue=queue_index, isr=self.isr)
        self._update_intx()

    def signal_config_change(self) -> None:
        """VirtioInterrupt: the ISR config bit is set whatever the interrupt mode."""
        self.isr |= VP.ISR_CONFIG
        if self.msix.enabled:
            self.tracer.emit("irq", config=1, vector=self.msix_config)
            if self.msix_config != VP.MSI_NO_VECTOR:
                self.msix.fire(self.msix_config)
            return
        self.tracer.emit("irq", config=1, isr=self.isr)
        self._update_intx()

    # --- PciFunction: configuration space ---------------------------------------------

    def config_read(self, offset: int, size: int) -> int:
        return self.config.read(offset, size)

    def config_write(self, offset: int, size: int, value: int) -> None:
        self.config.write(offset, size, value)

    def bars(self) -> tuple[BarInfo, ...]:
        """Size and type of every BAR, also when the SR-IOV owner placed it elsewhere
        than in the BAR registers."""
        return self.config.bars()

    def msix_info(self) -> MsixInfo | None:
        return self.msix.info

    # --- PciFunction: BAR access ------------------------------------------------------

    def _bar_ok(self, index: int, offset: int, size: int, what: str) -> bool:
        if (index != va1.PCI_BAR or size not in _BAR_ACCESS_SIZES or offset < 0
                or offset + size > va1.PCI_BAR_SIZE):
            self._violation("pci/bar-access", f"{size}-byte {what} at BAR {index} offset "
                            f"{offset:#x}")
            return False
        if not self._memory_enabled():
            self._violation("pci/memory-disabled", f"{size}-byte {what} at BAR {index} "
                            f"offset {offset:#x} with Memory Space disabled")
            return False
        return True

    def bar_read(self, index: int, offset: int, size: int) -> int:
        """A load inside BAR `index`; outside it (or with Memory Space off) all-ones."""
        if not self._bar_ok(index, offset, size, "read"):
            return all_ones(size)
        return self._bar_access_read(offset, size)

    def bar_write(self, index: int, offset: int, size: int, value: int) -> None:
        """A store inside BAR `index`; outside it (or with Memory Space off) dropped."""
        if not self._bar_ok(index, offset, size, "write"):
            return
        self._bar_access_write(offset, size, value & all_ones(size))

    def _bar_access_read(self, offset: int, size: int) -> int:
        page, off = offset & ~(_PAGE - 1), offset & (_PAGE - 1)
        if off + size > _PAGE:
            self._violation("pci/access-size", f"{size}-byte read at {offset:#x} crosses "
                            "a structure")
            return 0
        if page == va1.PCI_COMMON_CFG_OFFSET:
            return self._common_read(off, size)
        if page == va1.PCI_ISR_OFFSET:
            return self._isr_read(off, size)
        if page == va1.PCI_DEVICE_CFG_OFFSET:
            if size not in _CONFIG_SIZES:
                self._violation("pci/access-size", f"{size}-byte device config read at "
                                f"{off:#x}")
                return 0
            data = self.device.read_config(off, size)
            return int.from_bytes(data.ljust(size, b"\0")[:size], "little")
        if page == va1.PCI_MSIX_TABLE_OFFSET:
            return self.msix.table_read(off, size)
        if page == va1.PCI_MSIX_PBA_OFFSET:
            return self.msix.pba_read(off, size)
        return 0  # notify area and unused pages read 0

    def _bar_access_write(self, offset: int, size: int, value: int) -> None:
        page, off = offset & ~(_PAGE - 1), offset & (_PAGE - 1)
        if off + size > _PAGE:
            self._violation("pci/access-size", f"{size}-byte write at {offset:#x} crosses "
                            "a structure")
            return
        if page == va1.PCI_COMMON_CFG_OFFSET:
            self._common_write(off, size, value)
        elif page == va1.PCI_NOTIFY_OFFSET:
            self._notify_write(off, size, value)
        elif page == va1.PCI_DEVICE_CFG_OFFSET:
            self._violation("config/write", f"{size}-byte device config write at {off:#x}")
        elif page == va1.PCI_MSIX_TABLE_OFFSET:
            self.msix.table_write(off, size, value)
        elif page == va1.PCI_MSIX_PBA_OFFSET:
            self.msix.pba_write(off, size, value)
        # ISR (read-only) and unused pages: ignored

    # --- ISR --------------------------------------------------------------------------

    def _isr_read(self, off: int, size: int) -> int:
        """Read-to-clear; an 8-bit register, read with 8-bit loads."""
        if off != 0:
            return 0
        if size != 1:
            self._violation("pci/access-size", f"{size}-byte ISR read")
            return 0
        value = self.isr
        self.isr = 0
        self._update_intx()
        return value

    # --- common configuration ---------------------------------------------------------

    def _common_size_ok(self, off: int, size: int, what: str) -> bool:
        width = VP.COMMON_FIELD_SIZE.get(off)
        if width == size or (size == 8 and off in _QUEUE_ADDR_LO):
            return True
        if self._admin_index is not None and off in (VA.COMMON_ADM_Q_IDX, VA.COMMON_ADM_Q_NUM):
            if size == 2:
                return True
        if off < self.common_cfg_length:
            self._violation("pci/access-size", f"{size}-byte common config {what} at "
                            f"{off:#x}")
        return False

    def _common_read(self, off: int, size: int) -> int:
        if not self._common_size_ok(off, size, "read"):
            return 0
        if size == 8:
            return self._common_read(off, 4) | self._common_read(off + 4, 4) << 32
        q = self._selected()
        if off == VP.COMMON_DFSELECT:
            return self.device_features_sel
        if off == VP.COMMON_DF:
            return self._device_features_word()
        if off == VP.COMMON_GFSELECT:
            return self.driver_features_sel
        if off == VP.COMMON_GF:
            return self.driver_features.get(self.driver_features_sel, 0)
        if off == VP.COMMON_MSIX:
            return self.msix_config
        if off == VP.COMMON_NUMQ:
            return self.num_queues
        if self._admin_index is not None and off == VA.COMMON_ADM_Q_IDX:
            return self._admin_index
        if self._admin_index is not None and off == VA.COMMON_ADM_Q_NUM:
            return 1
        if off == VP.COMMON_STATUS:
            return self._status_value()
        if off == VP.COMMON_CFGGENERATION:
            return self.device.config_generation & 0xFF
        if off == VP.COMMON_Q_SELECT:
            return self.queue_sel
        if q is None:
            # no such queue: queue_size 0 says so; the rest reads 0 (vector: NO_VECTOR)
            return VP.MSI_NO_VECTOR if off == VP.COMMON_Q_MSIX else 0
        if off == VP.COMMON_Q_SIZE:
            return q.size
        if off == VP.COMMON_Q_MSIX:
            return self.queue_vectors[self.queue_sel]
        if off == VP.COMMON_Q_ENABLE:
            return int(q.ready)
        if off == VP.COMMON_Q_NOFF:
            return self.queue_sel  # notify address = notify base + index * multiplier
        if off in _QUEUE_ADDR:
            addr = {VP.COMMON_Q_DESCLO: q.desc_table, VP.COMMON_Q_DESCHI: q.desc_table,
                    VP.COMMON_Q_AVAILLO: q.avail_ring, VP.COMMON_Q_AVAILHI: q.avail_ring,
                    VP.COMMON_Q_USEDLO: q.used_ring, VP.COMMON_Q_USEDHI: q.used_ring}[off]
            return addr >> 32 if off not in _QUEUE_ADDR_LO else addr & 0xFFFF_FFFF
        if off == VP.COMMON_Q_RESET:
            return 0  # a queue reset completes before the write returns
        return 0  # queue_notify_data: VIRTIO_F_NOTIF_CONFIG_DATA is not offered

    def _common_write(self, off: int, size: int, value: int) -> None:
        if not self._common_size_ok(off, size, "write"):
            return
        if size == 8:
            self._write_queue_reg(off, value, wide=True)
            return
        if off == VP.COMMON_DFSELECT:
            self.device_features_sel = value
        elif off == VP.COMMON_GFSELECT:
            self.driver_features_sel = value
        elif off == VP.COMMON_GF:
            self._write_driver_features(value)
        elif off == VP.COMMON_MSIX:
            self.msix_config = self._vector(value, "msix_config")
        elif off == VP.COMMON_STATUS:
            self._write_status(value)
        elif off == VP.COMMON_Q_SELECT:
            self.queue_sel = value
        elif off == VP.COMMON_Q_MSIX:
            if self._selected() is None:
                self._violation("queue/bad-select", f"queue_msix_vector written with "
                                f"queue_select={self.queue_sel}")
                return
            self.queue_vectors[self.queue_sel] = self._vector(
                value, f"queue {self.queue_sel} vector")
        elif off in _QUEUE_WRITES:
            self._write_queue_reg(off, value)
        elif off == VP.COMMON_Q_RESET:
            self._reset_queue(value)
        # device_feature, num_queues, config_generation, queue_notify_off and
        # queue_notify_data are read-only: writes ignored

    def _queue_was_reset(self, index: int) -> None:
        """A queue reset puts its vector back to NO_VECTOR (its reset value)."""
        if 0 <= index < self.queue_capacity:
            self.queue_vectors[index] = VP.MSI_NO_VECTOR

    def _vector(self, value: int, what: str) -> int:
        """A vector outside the MSI-X table reads back NO_VECTOR (virtio 1.x §4.1.5.1.2)."""
        if value == VP.MSI_NO_VECTOR or value < self.msix.count:
            return value
        self.tracer.emit("msix_vector_refused", what=what, vector=value)
        return VP.MSI_NO_VECTOR

    def _write_queue_reg(self, off: int, value: int, wide: bool = False) -> None:
        q = self._queue_writable(off)
        if q is None:
            return
        if off == VP.COMMON_Q_SIZE:
            self._set_queue_size(q, value)
        elif off == VP.COMMON_Q_ENABLE:
            if value != 1:
                self._violation("queue/enable", f"queue_enable = {value} for queue "
                                f"{self.queue_sel} (only 1 may be written)")
                return
            self._enable_queue(q)
        else:
            attr = {VP.COMMON_Q_DESCLO: "desc_table", VP.COMMON_Q_DESCHI: "desc_table",
                    VP.COMMON_Q_AVAILLO: "avail_ring", VP.COMMON_Q_AVAILHI: "avail_ring",
                    VP.COMMON_Q_USEDLO: "used_ring", VP.COMMON_Q_USEDHI: "used_ring"}[off]
            part = "wide" if wide else "lo" if off in _QUEUE_ADDR_LO else "hi"
            self._set_queue_addr(q, attr, value, part)

    # --- notifications ----------------------------------------------------------------

    def _notify_write(self, off: int, size: int, value: int) -> None:
        """Notify address of queue i = notify base + i * notify_off_multiplier; the
        value written is the queue index (16 bits), or with NOTIFICATION_DATA the le32
        {vqn, next_off, next_wrap} (virtio 1.x §4.1.5.2)."""
        if size not in (2, 4) or off % self.notify_multiplier:
            self._violation("pci/access-size", f"{size}-byte notify write at {off:#x}")
            return
        index = off // self.notify_multiplier
        if value & V.NOTIFY_DATA_VQN_MASK != index:
            self._violation("notify/value", f"value {value:#x} written to the notify "
                            f"address of queue {index}")
            return
        if self._has(V.F_NOTIFICATION_DATA):
            if size != 4:
                self._violation("notify/data-width", f"{size}-byte notify of queue {index} "
                                "with VIRTIO_F_NOTIFICATION_DATA (le32 expected)")
                return
            self._notify(index, value >> V.NOTIFY_DATA_OFF_SHIFT)
            return
        self._notify(index)

    _NOTIFY_RULES = True

    def _notify_allowed(self, index: int) -> bool:
        if not self._bus_master():
            self._violation("pci/bus-master", f"notify({index}) with Bus Master disabled")
            return False
        return True

    # device status, feature negotiation and reset (status 0: the device drops
    # everything, then the common configuration clears, vectors back to NO_VECTOR and
    # ISR 0; PCI state is kept): `TransportCore`, the same rules as virtio-mmio

    def function_level_reset(self) -> None:
        """PCIe FLR: the virtio reset of status 0, plus every PCI register back to its
        power-on value (command, BARs, MSI-X enable/mask, table, PBA); only DEVCTL's
        Max_Payload_Size survives, as the PCIe spec requires."""
        devctl = self.pcie_cap + P.EXP_DEVCTL
        payload = self.config.get(devctl, 2) & P.EXP_DEVCTL_PAYLOAD
        self.device.reset()
        self.config.reset()
        self.config.put(devctl, 2, self.config.get(devctl, 2) | payload)
        self.msix.reset()
        self._reset_state()
        self.device.set_bus_master(self._bus_master())
        if self.sriov_hooks is not None:
            self.sriov_hooks.after_flr()
        self.tracer.emit("flr")
