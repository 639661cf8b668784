"""virtio-pci modern transport, driver side (virtio 1.x §4.1; Linux virtio_pci_modern).

The function's vendor capabilities place the common config, notify area, ISR and device
config inside its memory BARs. Every field is accessed with its natural width (§4.1.3.1:
64-bit device-config fields as two 32-bit reads). Interrupts are MSI-X only: one vector
for config changes plus one per queue, or, when the table, the kernel or the device
cannot give that, a single vector for everything (the ISR read tells a config change
apart). INTx is not supported: a device that refuses even that fails probe.

With VIRTIO_F_ADMIN_VQ negotiated (a PF), the common config goes on past queue_reset with
admin_queue_index / admin_queue_num (virtio 1.3 §4.1.4.3): the admin queues are set up
like the others (`set_admin_queues` first, so they get vectors too). When the MSI-X table
is one vector short for them, they share the config-change vector (the ISR read tells a
config change apart) before falling back to a single vector for everything.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

from hwspec import pci as P
from hwspec import virtio as V
from hwspec import virtio_admin as VA
from hwspec import virtio_pci as VP
from hwspec.layout import Layout

from ..kernel import GuestKernel
from ..pci import MsixVectors, PciError, PciFunction, enable_device, parse_msix
from .transport import (RESET_QUEUE_POLL_LIMIT, FeaturesRefused, InterruptHandler,
                        ProbeError, TransportError, check_queue_size, notify_value)
from .transport import negotiate as _negotiate

__all__ = ["VirtioPci", "VirtioPciCap", "TransportError", "ProbeError", "FeaturesRefused"]

RESET_POLL_LIMIT = 1000
CONFIG_GENERATION_RETRIES = 100
NUM_BARS_VIRTIO = 6          # cap.bar 0..5 name a BAR; other values are reserved
COMMON_CFG_MIN = VP.COMMON_Q_USEDHI + 4  # up to queue_device_hi: what this driver uses
NOTIFY_WIDTH = 2             # the queue index, 16 bits
NOTIFY_DATA_WIDTH = 4        # with NOTIFICATION_DATA: le32 {vqn, next_off, next_wrap}
MODE_PER_QUEUE = "per-queue"
MODE_SHARED = "shared"

_SIZE_OF_CODE = {"B": 1, "H": 2, "I": 4, "Q": 8}
_FIELD_SIZE = dict(VP.COMMON_FIELD_SIZE)
_FIELD_SIZE.update({VA.COMMON_ADM_Q_IDX: 2, VA.COMMON_ADM_Q_NUM: 2})


@dataclass(frozen=True)
class VirtioPciCap:
    """One virtio structure, placed: guest physical address and length."""
    cfg_type: int
    cap_offset: int   # in config space
    bar: int
    offset: int
    length: int
    address: int


class VirtioPci:
    """One modern virtio-pci function (implements VirtioTransport)."""

    def __init__(self, kernel: GuestKernel, fn: PciFunction) -> None:
        self.kernel = kernel
        self.mmio = kernel.mmio
        self.fn = fn
        self.name = f"virtio-pci {fn.bdf}"
        self.device_id = 0
        self.common: VirtioPciCap | None = None
        self.notify_cap: VirtioPciCap | None = None
        self.notify_multiplier = 0
        self.isr: VirtioPciCap | None = None
        self.device: VirtioPciCap | None = None
        self.pci_cfg_offset: int | None = None
        self.notify_addr: dict[int, int] = {}
        self.num_queues = 0
        self._status = 0
        self.msix: MsixVectors | None = None
        self.mode: str | None = None
        self.vectors: dict[int, int] = {}    # queue index -> MSI-X entry
        self.config_vector = VP.MSI_NO_VECTOR
        self.fallback_reason: str | None = None
        self._queues: tuple[int, ...] = ()
        self._handler: InterruptHandler | None = None
        self.admin_queues: tuple[int, ...] = ()
        self.features = 0    # accepted at the last negotiation
        self.config_shared: tuple[int, ...] = ()  # queues whose vector is the config one

    # ---- identification -----------------------------------------------------------
    def probe(self) -> int:
        """Check the ids, place the virtio structures, enable the function."""
        fn = self.fn
        if fn.vendor_id != VP.PCI_VENDOR_ID:
            raise ProbeError(f"{self.name}: vendor {fn.vendor_id:#06x} is not virtio "
                             f"({VP.PCI_VENDOR_ID:#06x})")
        if fn.device_id < VP.PCI_DEVICE_ID_BASE:
            raise ProbeError(f"{self.name}: device id {fn.device_id:#06x} is not a modern "
                             f"virtio device ({VP.PCI_DEVICE_ID_BASE:#06x} + type); legacy and "
                             "transitional devices are not supported")
        self.device_id = fn.device_id - VP.PCI_DEVICE_ID_BASE
        try:
            self._parse_caps()
        except PciError as e:
            raise ProbeError(f"{self.name}: {e}") from None
        enable_device(fn)
        self.num_queues = self._rd(VP.COMMON_NUMQ)
        return self.device_id

    def _parse_caps(self) -> None:
        """First usable capability of each type wins (virtio 1.x §4.1.4); ones with a
        reserved BAR, a short cap_len or a range outside their BAR are skipped."""
        cfg = self.fn.cfg
        rejected: list[str] = []
        for off in self.fn.find_caps(P.CAP_ID_VNDR):
            cap_len = cfg.read8(off + VP.CAP.offsets["cap_len"])
            cfg_type = cfg.read8(off + VP.CAP.offsets["cfg_type"])
            if cap_len < VP.CAP.size:
                rejected.append(f"cap at {off:#x}: cap_len {cap_len} < {VP.CAP.size}")
                continue
            if cfg_type == VP.CAP_PCI_CFG:
                if self.pci_cfg_offset is None and cap_len >= VP.PCI_CFG_CAP_SIZE:
                    self.pci_cfg_offset = off
                continue
            if cfg_type not in (VP.CAP_COMMON_CFG, VP.CAP_NOTIFY_CFG, VP.CAP_ISR_CFG,
                                VP.CAP_DEVICE_CFG):
                continue
            if getattr(self, _ATTR[cfg_type]) is not None:
                continue
            bar_index = cfg.read8(off + VP.CAP.offsets["bar"])
            if bar_index >= NUM_BARS_VIRTIO:
                continue  # reserved BAR value: the driver MUST ignore the capability
            offset = cfg.read32(off + VP.CAP.offsets["offset"])
            length = cfg.read32(off + VP.CAP.offsets["length"])
            try:
                bar = self.fn.bar(bar_index)
            except PciError as e:
                rejected.append(f"{_NAME[cfg_type]} cap at {off:#x}: {e}")
                continue
            problem = _check_cap(cfg_type, offset, length, cap_len, bar.size)
            if problem:
                rejected.append(f"{_NAME[cfg_type]} cap at {off:#x}: {problem}")
                continue
            if cfg_type == VP.CAP_NOTIFY_CFG:
                mult = cfg.read32(off + VP.NOTIFY_CAP_MULT)
                if mult and (mult & (mult - 1) or mult & 1):
                    rejected.append(f"notify cap at {off:#x}: notify_off_multiplier {mult} "
                                    "is neither 0 nor an even power of 2")
                    continue
                self.notify_multiplier = mult
            setattr(self, _ATTR[cfg_type], VirtioPciCap(cfg_type, off, bar_index, offset,
                                                         length, bar.address + offset))
        missing = [_NAME[t] for t in (VP.CAP_COMMON_CFG, VP.CAP_NOTIFY_CFG, VP.CAP_ISR_CFG)
                   if getattr(self, _ATTR[t]) is None]
        if missing:
            why = f" (rejected: {'; '.join(rejected)})" if rejected else ""
            raise PciError(f"no usable virtio {', '.join(missing)} capability{why}")

    # ---- common config ----------------------------------------------------------------
    def _caddr(self, field: int) -> int:
        assert self.common is not None
        return self.common.address + field

    def _rd(self, field: int) -> int:
        return self.mmio.read(self._caddr(field), _FIELD_SIZE[field])

    def _wr(self, field: int, value: int) -> None:
        size = _FIELD_SIZE[field]
        self.mmio.write(self._caddr(field), size, value & ((1 << (8 * size)) - 1))

    # ---- status --------------------------------------------------------------------------
    def read_status(self) -> int:
        return self._rd(VP.COMMON_STATUS)

    def reset(self) -> None:
        """Write 0, read back until 0 (§4.1.4.3.2). Does not wait: IRQ context may call."""
        self._wr(VP.COMMON_STATUS, 0)
        self._status = 0
        for _ in range(RESET_POLL_LIMIT):
            if self._rd(VP.COMMON_STATUS) == 0:
                return
        raise TransportError(f"{self.name}: device_status did not read back 0 after reset "
                             f"({RESET_POLL_LIMIT} reads)")

    def add_status(self, bits: int) -> None:
        self._status |= bits
        self._wr(VP.COMMON_STATUS, self._status)

    def fail(self) -> None:
        self.add_status(V.STATUS_FAILED)

    # ---- features -------------------------------------------------------------------------
    def device_features(self) -> int:
        feats = 0
        for sel in (0, 1):
            self._wr(VP.COMMON_DFSELECT, sel)
            feats |= self._rd(VP.COMMON_DF) << (32 * sel)
        return feats

    def write_driver_features(self, features: int) -> None:
        for sel in (0, 1):
            self._wr(VP.COMMON_GFSELECT, sel)
            self._wr(VP.COMMON_GF, (features >> (32 * sel)) & 0xFFFFFFFF)

    def negotiate(self, wanted: int, required: int = 1 << V.F_VERSION_1) -> int:
        self.features = _negotiate(self, wanted, required)
        return self.features

    # ---- admin queues (VIRTIO_F_ADMIN_VQ) ----------------------------------------------------
    def admin_queue_info(self) -> tuple[int, int]:
        """(admin_queue_index, admin_queue_num) from the common config; only meaningful
        once VIRTIO_F_ADMIN_VQ is negotiated. (0, 0) when the common config is too short
        to hold them."""
        assert self.common is not None
        if self.common.length < VA.COMMON_CFG_SIZE_WITH_ADMIN:
            return 0, 0
        return self._rd(VA.COMMON_ADM_Q_IDX), self._rd(VA.COMMON_ADM_Q_NUM)

    def set_admin_queues(self, indices: Sequence[int]) -> None:
        """Admin queue indices the driver will set up (they lie outside num_queues)."""
        self.admin_queues = tuple(indices)

    def _exists(self, index: int) -> bool:
        return index < self.num_queues or index in self.admin_queues

    # ---- queues ------------------------------------------------------------------------------
    def queue_num_max(self, index: int) -> int:
        """queue_size of a queue (0 = absent). Read before the driver writes it."""
        if not self._exists(index):
            return 0
        self._wr(VP.COMMON_Q_SELECT, index)
        return self._rd(VP.COMMON_Q_SIZE)

    def setup_queue(self, index: int, num: int, desc: int, driver: int, device: int) -> None:
        """Program size and addresses, compute the notify address, enable (§4.1.5.1.3).
        The queue's MSI-X vector was routed by setup_interrupts."""
        if not self._exists(index):
            raise TransportError(f"{self.name}: queue {index} does not exist "
                                 f"(num_queues {self.num_queues})")
        self._wr(VP.COMMON_Q_SELECT, index)
        if self._rd(VP.COMMON_Q_ENABLE):
            raise TransportError(f"{self.name}: queue {index} already enabled")
        check_queue_size(self.name, index, num, self._rd(VP.COMMON_Q_SIZE))
        self._wr(VP.COMMON_Q_SIZE, num)
        for low, addr in ((VP.COMMON_Q_DESCLO, desc), (VP.COMMON_Q_AVAILLO, driver),
                          (VP.COMMON_Q_USEDLO, device)):
            self._wr(low, addr & 0xFFFFFFFF)
            self._wr(low + 4, addr >> 32)
        self.notify_addr[index] = self._notify_address(index, self._rd(VP.COMMON_Q_NOFF))
        self._wr(VP.COMMON_Q_ENABLE, 1)

    def _notify_address(self, index: int, notify_off: int) -> int:
        cap = self.notify_cap
        assert cap is not None
        rel = notify_off * self.notify_multiplier
        width = (NOTIFY_DATA_WIDTH if self.features >> V.F_NOTIFICATION_DATA & 1
                 else NOTIFY_WIDTH)
        if rel + width > cap.length:
            raise TransportError(f"{self.name}: queue {index} notify offset {notify_off} x "
                                 f"multiplier {self.notify_multiplier} = {rel:#x} is outside "
                                 f"the notify area of {cap.length:#x} bytes")
        return cap.address + rel

    def notify(self, index: int, data: int | None = None) -> None:
        if data is None:
            self.mmio.write(self.notify_addr[index], NOTIFY_WIDTH, index)
        else:
            self.mmio.write(self.notify_addr[index], NOTIFY_DATA_WIDTH,
                            notify_value(index, data))

    def reset_queue(self, index: int) -> None:
        """queue_reset = 1 (virtio 1.x §4.1.4.3.1), then read until queue_reset and
        queue_enable both read 0."""
        self._wr(VP.COMMON_Q_SELECT, index)
        self._wr(VP.COMMON_Q_RESET, 1)
        for _ in range(RESET_QUEUE_POLL_LIMIT):
            if self._rd(VP.COMMON_Q_RESET) == 0 and self._rd(VP.COMMON_Q_ENABLE) == 0:
                return
        raise TransportError(f"{self.name}: queue {index} reset did not complete "
                             f"({RESET_QUEUE_POLL_LIMIT} reads)")

    def reenable_queue(self, index: int, num: int, desc: int, driver: int,
                       device: int) -> None:
        """The reset put the queue's vector back to NO_VECTOR: route it again (read
        back), then program and enable the queue."""
        vector = self.vectors.get(index)
        if vector is not None:
            self._wr(VP.COMMON_Q_SELECT, index)
            self._wr(VP.COMMON_Q_MSIX, vector)
            got = self._rd(VP.COMMON_Q_MSIX)
            if got != vector:
                raise TransportError(f"{self.name}: device refused MSI-X vector {vector} for "
                                     f"queue {index} after its reset (read {got:#x})")
        self.setup_queue(index, num, desc, driver, device)

    # ---- interrupts ------------------------------------------------------------------------
    def setup_interrupts(self, queues: Sequence[int], handler: InterruptHandler,
                         name: str) -> None:
        """Take MSI-X vectors on the first call; route config and queues to them on
        every call (a reset unmapped them), with read-back. A refused mapping in
        per-queue mode falls back to one shared vector; refused there, probe fails."""
        self._handler = handler
        if self.msix is None or tuple(queues) != self._queues:
            self.free_interrupts()
            self._queues = tuple(queues)
            try:
                self.msix = MsixVectors(self.kernel, self.fn, parse_msix(self.fn))
            except PciError as e:
                raise TransportError(f"{self.name}: {e}; INTx is not supported") from None
            self._take_vectors(name)
        refused = self._route()
        if refused is None:
            return
        if self.mode == MODE_SHARED:
            raise TransportError(f"{self.name}: device refused the MSI-X vector for "
                                 f"{refused} even with a single shared vector, and INTx is "
                                 "not supported")
        self._fall_back(name, f"device refused the vector for {refused}")
        refused = self._route()
        if refused is not None:
            raise TransportError(f"{self.name}: device refused the MSI-X vector for "
                                 f"{refused} even with a single shared vector, and INTx is "
                                 "not supported")

    def _take_vectors(self, name: str) -> None:
        assert self.msix is not None
        want = 1 + len(self._queues)
        admin = tuple(q for q in self._queues if q in self.admin_queues)
        self.config_shared = ()
        if want > self.msix.table_size and admin and want - len(admin) <= self.msix.table_size:
            self.config_shared = admin  # admin queues ride on the config vector
        own = [q for q in self._queues if q not in self.config_shared]
        if 1 + len(own) <= self.msix.table_size:
            handlers: list[tuple[Callable[[], None], str]] = [(self._config_irq,
                                                               f"{name}-config")]
            handlers += [(self._queue_irq(q), f"{name}-vq{q}") for q in own]
            try:
                self.msix.setup(handlers)
                self.mode = MODE_PER_QUEUE
                self.config_vector = 0
                self.vectors = {q: 1 + i for i, q in enumerate(own)}
                self.vectors.update({q: 0 for q in self.config_shared})
                return
            except OSError as e:
                self.fallback_reason = f"kernel has no {1 + len(own)} MSI vectors ({e})"
        else:
            self.fallback_reason = (f"MSI-X table has {self.msix.table_size} entries, "
                                    f"{want} wanted")
        self.config_shared = ()
        self._shared(name)

    def _shared(self, name: str) -> None:
        assert self.msix is not None
        try:
            self.msix.setup([(self._shared_irq, f"{name}-virtio")])
        except (OSError, PciError) as e:
            raise TransportError(f"{self.name}: cannot get even one MSI-X vector ({e}); "
                                 "INTx is not supported") from None
        self.mode = MODE_SHARED
        self.config_vector = 0
        self.vectors = {q: 0 for q in self._queues}
        self.kernel.trace.emit("msix_fallback", dev=self.name, reason=self.fallback_reason or "")

    def _fall_back(self, name: str, reason: str) -> None:
        assert self.msix is not None
        self.msix.teardown()
        self.config_shared = ()
        self.fallback_reason = reason
        self._shared(name)

    def _route(self) -> str | None:
        """Write msix_config and every queue_msix_vector; read each back. Returns what
        was refused (None: all accepted)."""
        self._wr(VP.COMMON_MSIX, self.config_vector)
        got = self._rd(VP.COMMON_MSIX)
        if got != self.config_vector:
            return f"config changes (msix_config wrote {self.config_vector}, read {got:#x})"
        for q in self._queues:
            if not self._exists(q):
                continue  # setup_queue will say it does not exist
            self._wr(VP.COMMON_Q_SELECT, q)
            self._wr(VP.COMMON_Q_MSIX, self.vectors[q])
            got = self._rd(VP.COMMON_Q_MSIX)
            if got != self.vectors[q]:
                return f"queue {q} (wrote {self.vectors[q]}, read {got:#x})"
        return None

    def free_interrupts(self) -> None:
        if self.msix is not None:
            self.msix.teardown()
        self.msix = None
        self.mode = None
        self.vectors = {}
        self.config_vector = VP.MSI_NO_VECTOR
        self.config_shared = ()

    def _config_irq(self) -> None:
        if self._handler is None:
            return
        if self.config_shared:  # shared with admin queues: the ISR tells a config change
            self._handler(bool(self.read_isr() & VP.ISR_CONFIG), self.config_shared)
        else:
            self._handler(True, ())

    def _queue_irq(self, index: int) -> Callable[[], None]:
        def irq() -> None:
            if self._handler is not None:
                self._handler(False, (index,))
        return irq

    def _shared_irq(self) -> None:
        """One vector for all: reading ISR (which clears it) tells a config change."""
        if self._handler is None:
            return
        isr = self.read_isr()
        self._handler(bool(isr & VP.ISR_CONFIG), None)

    def poll_interrupt(self) -> bool:
        if self.mode == MODE_SHARED:
            return bool(self.read_isr() & VP.ISR_CONFIG)
        return False

    def restore_after_reset(self) -> None:
        """A reset the driver did not start (an admin VF reset, an FLR nobody restored
        the header around) cleared COMMAND and MSI-X: memory decoding and bus mastering
        on (written even if they read as set: a VMM may shadow them), then MSI-X off and
        the table and enable again (a VMM that shadows the capability, as VFIO does,
        programs the host side on the enable transition)."""
        cmd = self.fn.cfg.read16(P.COMMAND)
        self.fn.cfg.write16(P.COMMAND, cmd | P.COMMAND_MEMORY | P.COMMAND_MASTER)
        if self.msix is not None and self.msix.messages:
            self.msix.reprogram()
        self.kernel.trace.emit("function_restored", dev=self.name)

    def interrupts_broken(self) -> str | None:
        if self.msix is None or not self.msix.messages:
            return None
        return self.msix.lost()

    def read_isr(self) -> int:
        assert self.isr is not None
        return self.mmio.read(self.isr.address, 1)

    # ---- device configuration ---------------------------------------------------------------
    def config_generation(self) -> int:
        return self._rd(VP.COMMON_CFGGENERATION)

    def read_config(self, layout: Layout) -> dict[str, int]:
        """Read a whole structure with config_generation equal before and after."""
        dev = self.device
        if dev is None:
            raise TransportError(f"{self.name}: no virtio DEVICE_CFG capability")
        if layout.size > dev.length:
            raise TransportError(f"{self.name}: device config is {dev.length} bytes, "
                                 f"{layout.name} needs {layout.size}")
        for _ in range(CONFIG_GENERATION_RETRIES):
            gen = self.config_generation()
            values: dict[str, int] = {}
            for fname, code in layout.fields:
                size = _SIZE_OF_CODE[code]
                addr = dev.address + layout.offsets[fname]
                if size == 8:  # §4.1.3.1: 64-bit fields as two 32-bit accesses
                    values[fname] = (self.mmio.read(addr, 4)
                                     | self.mmio.read(addr + 4, 4) << 32)
                else:
                    values[fname] = self.mmio.read(addr, size)
            if self.config_generation() == gen:
                return values
        raise TransportError(f"{self.name}: device config kept changing "
                             f"({CONFIG_GENERATION_RETRIES} config_generation retries)")


_ATTR = {VP.CAP_COMMON_CFG: "common", VP.CAP_NOTIFY_CFG: "notify_cap",
         VP.CAP_ISR_CFG: "isr", VP.CAP_DEVICE_CFG: "device"}
_NAME = {VP.CAP_COMMON_CFG: "COMMON_CFG", VP.CAP_NOTIFY_CFG: "NOTIFY_CFG",
         VP.CAP_ISR_CFG: "ISR_CFG", VP.CAP_DEVICE_CFG: "DEVICE_CFG"}


def _check_cap(cfg_type: int, offset: int, length: int, cap_len: int, bar_size: int) -> str:
    """Why a capability cannot be used ('' if it can)."""
    need = {VP.CAP_COMMON_CFG: COMMON_CFG_MIN, VP.CAP_NOTIFY_CFG: NOTIFY_WIDTH,
            VP.CAP_ISR_CFG: 1, VP.CAP_DEVICE_CFG: 0}[cfg_type]
    align = {VP.CAP_COMMON_CFG: 4, VP.CAP_NOTIFY_CFG: 2, VP.CAP_ISR_CFG: 1,
             VP.CAP_DEVICE_CFG: 4}[cfg_type]
    if cfg_type == VP.CAP_NOTIFY_CFG and cap_len < VP.NOTIFY_CAP_SIZE:
        return f"cap_len {cap_len} < {VP.NOTIFY_CAP_SIZE} (no notify_off_multiplier)"
    if length < need:
        return f"length {length} < {need}"
    if offset % align:
        return f"offset {offset:#x} not {align}-byte aligned"
    if offset + length > bar_size:
        return f"[{offset:#x}, +{length:#x}) overruns its BAR of {bar_size:#x} bytes"
    return ""
