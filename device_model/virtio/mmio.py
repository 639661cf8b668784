"""virtio-mmio version 2 transport (virtio 1.x §4.2.2; VA-1 spec §3).

A strict register window: every driver rule of spec §3 that is broken is logged in
`violations`, emitted as a `violation` trace event, and the offending access has no
effect. Nothing a driver writes makes `read`/`write` raise.
"""
from __future__ import annotations

from hwspec import virtio as V
from hwspec import virtio_mmio as R

from ..ports import IrqLine, NullTracer, Tracer, plain_emitter
from .device import VirtioDevice
from .queue import Queue
from .status import TransportCore, Violation

__all__ = ["MmioTransport", "Violation"]

_CONFIG_SIZES = (1, 2, 4, 8)
# QueueDescLow/High, QueueDriverLow/High, QueueDeviceLow/High -> (queue field, half)
_QUEUE_ADDR = {R.QUEUE_DESC_LOW: ("desc_table", "lo"), R.QUEUE_DESC_HIGH: ("desc_table", "hi"),
               R.QUEUE_DRIVER_LOW: ("avail_ring", "lo"), R.QUEUE_DRIVER_HIGH: ("avail_ring", "hi"),
               R.QUEUE_DEVICE_LOW: ("used_ring", "lo"), R.QUEUE_DEVICE_HIGH: ("used_ring", "hi")}


class MmioTransport(TransportCore):
    """The 0x1000-byte virtio-mmio window in front of a `VirtioDevice`."""

    _STATUS_NAME = "Status"
    _DRIVER_FEATURES_NAME = "DriverFeatures"
    _QUEUE_SEL_NAME = "QueueSel"
    _QUEUE_SIZE_NAME = "QueueNum"
    _QUEUE_REG_NAME = "register"
    _NOTIFY_NAME = "QueueNotify"

    def __init__(self, device: VirtioDevice, irq: IrqLine, tracer: Tracer | None = None) -> None:
        self.device = device
        self.irq = irq
        self.tracer: Tracer = tracer if tracer is not None else NullTracer()
        self._emit_plain = plain_emitter(self.tracer)
        self.violations: list[Violation] = []
        self.queues: list[Queue] = [Queue(n) for n in device.queue_max_sizes()]
        self._irq_level = False
        self._reset_state()

    # --- state -----------------------------------------------------------------------

    def _reset_state(self) -> None:
        self._reset_core_state()
        self.interrupt_status = 0
        self._set_irq()

    def _set_irq(self) -> None:
        level = self.interrupt_status != 0
        if level != self._irq_level:
            self._irq_level = level
            self.irq.set_level(level)

    # --- VirtioInterrupt (handed to the device at DRIVER_OK) --------------------------

    def signal_used(self, queue_index: int) -> None:
        self._raise(R.INT_VRING)

    def signal_config_change(self) -> None:
        self._raise(R.INT_CONFIG)

    def _raise(self, bits: int) -> None:
        """Set ISR `bits` (the transport's own R.INT_* ints) and the line."""
        self.interrupt_status |= bits
        self._emit_plain("irq", {"bits": bits, "status": self.interrupt_status})
        if not self._irq_level:   # _set_irq with the status known non-zero
            self._irq_level = True
            self.irq.set_level(True)

    # --- MMIO ------------------------------------------------------------------------

    def read(self, offset: int, size: int) -> int:
        """A guest load; never raises."""
        if offset == R.INTERRUPT_STATUS and size == 4:   # the one read of every interrupt
            return self.interrupt_status
        if not 0 <= offset < R.REGION_SIZE:
            return 0
        if offset >= R.CONFIG:
            if size not in _CONFIG_SIZES:
                self._violation("mmio/access-size",
                                f"{size}-byte config read at {offset:#x}")
                return 0
            data = self.device.read_config(offset - R.CONFIG, size)
            return int.from_bytes(data.ljust(size, b"\0")[:size], "little")
        if size != 4 or offset % 4:
            self._violation("mmio/access-size", f"{size}-byte read at {offset:#x}")
            return 0
        if offset == R.MAGIC_VALUE:
            return R.MAGIC
        if offset == R.VERSION:
            return R.VERSION_MODERN
        if offset == R.DEVICE_ID:
            return self.device.device_id
        if offset == R.VENDOR_ID:
            return self.device.vendor_id
        if offset == R.DEVICE_FEATURES:
            return self._device_features_word()
        if offset == R.QUEUE_NUM_MAX:
            q = self._selected()
            return q.max_size if q is not None else 0
        if offset == R.QUEUE_READY:
            q = self._selected()
            return int(q.ready) if q is not None else 0
        if offset == R.QUEUE_RESET:
            return 0  # a queue reset completes before the write returns
        if offset == R.STATUS:
            return self._status_value()
        if offset == R.CONFIG_GENERATION:
            return self.device.config_generation & 0xFFFF_FFFF
        return 0

    def write(self, offset: int, size: int, value: int) -> None:
        """A guest store; never raises."""
        if size == 4:
            # the two stores of every submission first (4-byte stores to aligned
            # registers in the window: none of the checks below applies)
            if offset == R.QUEUE_NOTIFY:
                value &= 0xFFFF_FFFF
                if self._features_in_force >> V.F_NOTIFICATION_DATA & 1:
                    self._notify(value & V.NOTIFY_DATA_VQN_MASK,
                                 value >> V.NOTIFY_DATA_OFF_SHIFT)
                else:
                    self._notify(value)
                return
            if offset == R.INTERRUPT_ACK:
                self.interrupt_status &= ~(value & 0xFFFF_FFFF)
                self._set_irq()
                return
        if not 0 <= offset < R.REGION_SIZE:
            return
        if offset >= R.CONFIG:
            self._violation("config/write", f"{size}-byte write at {offset:#x}")
            return
        if size != 4 or offset % 4:
            self._violation("mmio/access-size", f"{size}-byte write at {offset:#x}")
            return
        value &= 0xFFFF_FFFF
        if offset == R.DEVICE_FEATURES_SEL:
            self.device_features_sel = value
        elif offset == R.DRIVER_FEATURES_SEL:
            self.driver_features_sel = value
        elif offset == R.DRIVER_FEATURES:
            self._write_driver_features(value)
        elif offset == R.QUEUE_SEL:
            self.queue_sel = value
        elif offset in (R.QUEUE_NUM, R.QUEUE_READY) or offset in _QUEUE_ADDR:
            self._write_queue_reg(offset, value)
        elif offset == R.QUEUE_RESET:
            self._reset_queue(value)
        elif offset == R.STATUS:
            self._write_status(value)
        # read-only registers and unlisted offsets: ignored

    def _write_queue_reg(self, offset: int, value: int) -> None:
        q = self._queue_writable(offset)
        if q is None:
            return
        if offset == R.QUEUE_NUM:
            self._set_queue_size(q, value)
        elif offset == R.QUEUE_READY:
            if value == 1:
                self._enable_queue(q)
            else:
                q.ready = False
        else:
            attr, part = _QUEUE_ADDR[offset]
            self._set_queue_addr(q, attr, value, part)
