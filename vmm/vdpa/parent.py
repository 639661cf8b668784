"""vp_vdpa for a VA-1 function: the host-kernel parent driver a vdpa device sits on.

Why: vDPA keeps the data path on the hardware (rings in guest memory, doorbells to the
function, interrupts from it) while the host keeps control; the parent is the piece that
knows the hardware. Like Linux's vp_vdpa it drives a virtio-pci function through its
own common configuration (vdpa_config_ops: features, status, queue size/address/enable,
kick, config reads), routes each queue's MSI-X vector to a callback that vhost-vdpa
turns into a call-eventfd signal, and leaves DMA to the platform IOMMU (vhost-vdpa
programs the function's domain from its IOTLB).

Choices where vp_vdpa and VA-1 differ:
- Interrupts use the host MSI domain directly (a callback in the device event, as
  vfio-pci's): one vector for config changes plus one per queue, set up at DRIVER_OK
  and freed at reset.
- Suspend, resume and queue state (last_avail_idx) use VA-1's migration port
  (docs/spec.md §15), which a real part would expose by vendor commands; vp_vdpa has
  none and answers EOPNOTSUPP (set_vq_state accepts only the initial state).
- The features offered are the function's, minus SR_IOV and ADMIN_VQ (a PF's own
  management, never handed to a vdpa user), NOTIFICATION_DATA (a kick through an
  ioeventfd carries no data) and RING_RESET (vhost-vdpa has no per-queue reset).
"""
from __future__ import annotations

import errno
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Protocol

from device_model.pci.api import PciFunction
from guest_driver.kernel import MsiMessage
from hwspec import pci as P
from hwspec import virtio as V
from hwspec import virtio_pci as VP

from ..vfio.pci_device import find_capability
from .errors import vhost_error

if TYPE_CHECKING:
    from ..host import Host, HostPciFunction

HIDDEN_FEATURES = (1 << V.F_SR_IOV | 1 << V.F_ADMIN_VQ
                   | 1 << V.F_NOTIFICATION_DATA | 1 << V.F_RING_RESET)
RESET_POLL_LIMIT = 1000
Callback = Callable[[], None]


class MigrationPort(Protocol):
    """What a function offers for suspend and a live move (device_model VA-1:
    `device.migration_port`, docs/spec.md §15)."""

    def suspend(self) -> None: ...

    def resume(self) -> None: ...

    @property
    def suspended(self) -> bool: ...

    @property
    def quiescent(self) -> bool: ...

    def vq_state(self, index: int) -> int: ...

    def set_vq_state(self, index: int, last_avail_idx: int) -> None: ...

    def save(self) -> bytes: ...

    def load(self, state: bytes) -> None: ...


class HostMsi(Protocol):
    def alloc(self, callback: Callable[[], None], name: str,
              requester_id: int | None = None) -> MsiMessage: ...

    def free(self, msg: MsiMessage) -> None: ...


@dataclass(frozen=True)
class _Cap:
    bar: int
    offset: int
    length: int


class VpVdpa:
    """The parent driver bound to one VA-1 PCI function (`HostPciFunction`)."""

    def __init__(self, host: "Host", hf: "HostPciFunction") -> None:
        self.host = host
        self.hf = hf
        self.name = hf.name
        self.function: PciFunction = hf.function
        self.msi: HostMsi = host.msi
        self.trace = host.machine.trace.tracer(f"{host.name}.vp_vdpa.{hf.name[5:]}")
        caps = self._parse_caps()
        self.common, self.notify, self.device_cfg = caps[0], caps[1], caps[2]
        self.notify_multiplier = caps[3]
        self.msix_cap = find_capability(self.function, P.CAP_ID_MSIX)
        if self.msix_cap is None:
            raise vhost_error(errno.ENODEV, f"vp_vdpa {self.name}: no MSI-X capability")
        self._vq_cb: dict[int, Callback] = {}
        self._config_cb: Callback | None = None
        self._msgs: list[MsiMessage] = []
        self._enable_function()
        self.reset()
        self.num_queues = self._rd(VP.COMMON_NUMQ, 2)
        self.vq_num_max = self._queue_size(0)
        self.device_features = self._read_device_features() & ~HIDDEN_FEATURES
        self.kicks = [0] * self.num_queues
        self.calls = [0] * self.num_queues

    # -- probe ----------------------------------------------------------------------------

    def _parse_caps(self) -> tuple[_Cap, _Cap, _Cap, int]:
        f = self.function
        found: dict[int, _Cap] = {}
        mult = 0
        ptr = f.config_read(P.CAPABILITY_LIST, 1) & 0xFC
        for _ in range(48):
            if ptr < 0x40:
                break
            if f.config_read(ptr + P.CAP_LIST_ID, 1) == P.CAP_ID_VNDR:
                o = VP.CAP.offsets
                cfg_type = f.config_read(ptr + o["cfg_type"], 1)
                if cfg_type not in found and cfg_type in (VP.CAP_COMMON_CFG, VP.CAP_NOTIFY_CFG,
                                                          VP.CAP_DEVICE_CFG):
                    found[cfg_type] = _Cap(f.config_read(ptr + o["bar"], 1),
                                           f.config_read(ptr + o["offset"], 4),
                                           f.config_read(ptr + o["length"], 4))
                    if cfg_type == VP.CAP_NOTIFY_CFG:
                        mult = f.config_read(ptr + VP.NOTIFY_CAP_MULT, 4)
            ptr = f.config_read(ptr + P.CAP_LIST_NEXT, 1) & 0xFC
        missing = [n for t, n in ((VP.CAP_COMMON_CFG, "common"), (VP.CAP_NOTIFY_CFG, "notify"),
                                  (VP.CAP_DEVICE_CFG, "device")) if t not in found]
        if missing:
            raise vhost_error(errno.ENODEV, f"vp_vdpa {self.name}: not a modern virtio-pci "
                                            f"function (no {', '.join(missing)} capability)")
        return (found[VP.CAP_COMMON_CFG], found[VP.CAP_NOTIFY_CFG], found[VP.CAP_DEVICE_CFG],
                mult)

    def _enable_function(self) -> None:
        """pci_enable_device + pci_set_master (a VF's Memory Space is the PF's VF MSE)."""
        cmd = self.function.config_read(P.COMMAND, 2)
        self.function.config_write(P.COMMAND, 2, cmd | P.COMMAND_MEMORY | P.COMMAND_MASTER)

    # -- register access --------------------------------------------------------------------

    def _rd(self, field: int, size: int) -> int:
        return self.function.bar_read(self.common.bar, self.common.offset + field, size)

    def _wr(self, field: int, size: int, value: int) -> None:
        self.function.bar_write(self.common.bar, self.common.offset + field, size, value)

    def _select(self, index: int) -> None:
        self._wr(VP.COMMON_Q_SELECT, 2, index)

    def _queue_size(self, index: int) -> int:
        self._select(index)
        return self._rd(VP.COMMON_Q_SIZE, 2)

    def _read_device_features(self) -> int:
        feats = 0
        for sel in (0, 1):
            self._wr(VP.COMMON_DFSELECT, 4, sel)
            feats |= self._rd(VP.COMMON_DF, 4) << (32 * sel)
        return feats

    # -- vdpa_config_ops ------------------------------------------------------------------------

    @property
    def device_id(self) -> int:
        return self.function.config_read(P.DEVICE_ID, 2) - VP.PCI_DEVICE_ID_BASE \
            if self.hf.pf is None else self._vf_device_id()

    def _vf_device_id(self) -> int:
        platform = self.host.sriov.get(self.hf.pf.name) if self.hf.pf is not None else None
        did = platform._cfg(P.SRIOV_VF_DID, 2) if platform is not None and platform.cap else 0
        return int(did) - VP.PCI_DEVICE_ID_BASE

    @property
    def vendor_id(self) -> int:
        """vp_vdpa reports the subsystem vendor ID."""
        return self.function.config_read(P.SUBSYSTEM_VENDOR_ID, 2)

    def set_driver_features(self, features: int) -> None:
        for sel in (0, 1):
            self._wr(VP.COMMON_GFSELECT, 4, sel)
            self._wr(VP.COMMON_GF, 4, (features >> (32 * sel)) & 0xFFFF_FFFF)

    def get_driver_features(self) -> int:
        feats = 0
        for sel in (0, 1):
            self._wr(VP.COMMON_GFSELECT, 4, sel)
            feats |= self._rd(VP.COMMON_GF, 4) << (32 * sel)
        return feats

    def get_status(self) -> int:
        return self._rd(VP.COMMON_STATUS, 1)

    def set_status(self, status: int) -> None:
        """vp_vdpa_set_status: vectors are requested on the way to DRIVER_OK."""
        old = self.get_status()
        if status & V.STATUS_DRIVER_OK and not old & V.STATUS_DRIVER_OK:
            self._request_irqs()
        self._wr(VP.COMMON_STATUS, 1, status)

    def reset(self) -> None:
        """Status 0, read back until 0, vectors freed (vp_vdpa_reset)."""
        self._wr(VP.COMMON_STATUS, 1, 0)
        for _ in range(RESET_POLL_LIMIT):
            if self._rd(VP.COMMON_STATUS, 1) == 0:
                break
        self._free_irqs()
        self.trace.emit("vdpa_reset")

    def get_config_size(self) -> int:
        return self.device_cfg.length

    def get_config(self, offset: int, length: int) -> bytes:
        out = bytearray()
        for i in range(length):
            out.append(self.function.bar_read(self.device_cfg.bar, self.device_cfg.offset
                                              + offset + i, 1))
        return bytes(out)

    def get_generation(self) -> int:
        return self._rd(VP.COMMON_CFGGENERATION, 1)

    def set_vq_num(self, index: int, num: int) -> None:
        self._select(index)
        self._wr(VP.COMMON_Q_SIZE, 2, num)

    def set_vq_address(self, index: int, desc: int, driver: int, device: int) -> None:
        self._select(index)
        for low, addr in ((VP.COMMON_Q_DESCLO, desc), (VP.COMMON_Q_AVAILLO, driver),
                          (VP.COMMON_Q_USEDLO, device)):
            self._wr(low, 4, addr & 0xFFFF_FFFF)
            self._wr(low + 4, 4, addr >> 32)

    def set_vq_ready(self, index: int, ready: bool) -> None:
        """queue_enable can only be written 1 (virtio-pci); disabling takes a reset."""
        if ready:
            self._select(index)
            self._wr(VP.COMMON_Q_ENABLE, 2, 1)

    def get_vq_ready(self, index: int) -> bool:
        self._select(index)
        return bool(self._rd(VP.COMMON_Q_ENABLE, 2))

    def set_vq_cb(self, index: int, cb: Callback | None) -> None:
        if cb is None:
            self._vq_cb.pop(index, None)
        else:
            self._vq_cb[index] = cb

    def set_config_cb(self, cb: Callback | None) -> None:
        self._config_cb = cb

    def kick_vq(self, index: int) -> None:
        """Write the queue index to its notify address (vp_modern_notify)."""
        self.kicks[index] += 1
        self.function.bar_write(self.notify.bar, self.notify.offset
                                + index * self.notify_multiplier, 2, index)

    # -- suspend and queue state (VA-1 migration port) -------------------------------------------

    @property
    def migration(self) -> MigrationPort | None:
        port: MigrationPort | None = getattr(self.hf.device, "migration_port", None)
        return port

    def get_vq_state(self, index: int) -> int:
        m = self.migration
        if m is None:
            raise vhost_error(errno.EOPNOTSUPP, f"vp_vdpa {self.name}: no queue state")
        return m.vq_state(index)

    def set_vq_state(self, index: int, last_avail_idx: int) -> None:
        m = self.migration
        if m is None:
            if last_avail_idx:
                raise vhost_error(errno.EOPNOTSUPP, f"vp_vdpa {self.name}: only the initial "
                                                    "queue state can be set")
            return
        m.set_vq_state(index, last_avail_idx)

    # -- interrupts ------------------------------------------------------------------------------

    def _msix_flags(self, set_bits: int, clear_bits: int) -> None:
        assert self.msix_cap is not None
        off = self.msix_cap + P.MSIX_FLAGS
        v = self.function.config_read(off, 2)
        self.function.config_write(off, 2, (v | set_bits) & ~clear_bits & 0xFFFF)

    def _table_write(self, vector: int, field: int, value: int) -> None:
        assert self.msix_cap is not None
        table = self.function.config_read(self.msix_cap + P.MSIX_TABLE, 4)
        self.function.bar_write(table & P.MSIX_TABLE_BIR, (table & P.MSIX_TABLE_OFFSET)
                                + vector * P.MSIX_ENTRY_SIZE + field, 4, value)

    def _irq(self, index: int | None) -> Callback:
        def fire() -> None:
            if index is None:
                cb = self._config_cb
            else:
                cb = self._vq_cb.get(index)
                self.calls[index] += 1
            if cb is not None:
                cb()
        return fire

    def _request_irqs(self) -> None:
        """One vector for config changes (entry 0) and one per queue (entry 1 + i)."""
        self._free_irqs()
        names = ["config"] + [f"vq{i}" for i in range(self.num_queues)]
        cbs = [self._irq(None)] + [self._irq(i) for i in range(self.num_queues)]
        self._msgs = [self.msi.alloc(cb, f"vp-vdpa-{n}({self.name})", self.hf.requester_id)
                      for cb, n in zip(cbs, names)]
        self._msix_flags(P.MSIX_FLAGS_MASKALL | P.MSIX_FLAGS_ENABLE, 0)
        for i, msg in enumerate(self._msgs):
            self._table_write(i, P.MSIX_ENTRY_LOWER_ADDR, msg.address & 0xFFFF_FFFF)
            self._table_write(i, P.MSIX_ENTRY_UPPER_ADDR, msg.address >> 32)
            self._table_write(i, P.MSIX_ENTRY_DATA, msg.data)
            self._table_write(i, P.MSIX_ENTRY_VECTOR_CTRL, 0)
        self._msix_flags(0, P.MSIX_FLAGS_MASKALL)
        self._wr(VP.COMMON_MSIX, 2, 0)
        for i in range(self.num_queues):
            self._select(i)
            self._wr(VP.COMMON_Q_MSIX, 2, 1 + i)

    def _free_irqs(self) -> None:
        if not self._msgs:
            return
        self._msix_flags(0, P.MSIX_FLAGS_ENABLE)
        for msg in self._msgs:
            self.msi.free(msg)
        self._msgs = []

    def remove(self) -> None:
        """Unbind: the function reset, its vectors freed."""
        self.reset()
        self._vq_cb.clear()
        self._config_cb = None
