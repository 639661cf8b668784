"""virtio-mmio version 2 transport (virtio 1.x §4.2.2; VA-1 spec §3).

A strict register window: every driver rule of spec §3 that is broken is logged in
`violations`, emitted as a `violation` trace event, and the offending access has no
effect. Nothing a driver writes makes `read`/`write` raise.
"""
from __future__ import annotations

from dataclasses import dataclass
from hwspec import virtio as V
from hwspec import virtio_mmio as R

from ..ports import IrqLine, NullTracer, Tracer
from .device import VirtioDevice
from .queue import Queue, is_power_of_two

_DRIVER_BITS = (V.STATUS_ACKNOWLEDGE | V.STATUS_DRIVER | V.STATUS_FEATURES_OK
                | V.STATUS_DRIVER_OK | V.STATUS_FAILED)
_CONFIG_SIZES = (1, 2, 4, 8)


@dataclass(frozen=True)
class Violation:
    """One broken driver rule (spec §3/§4 rule name) with a human message."""
    rule: str
    message: str


class MmioTransport:
    """The 0x1000-byte virtio-mmio window in front of a `VirtioDevice`."""

    def __init__(self, device: VirtioDevice, irq: IrqLine, tracer: Tracer | None = None) -> None:
        self.device = device
        self.irq = irq
        self.tracer: Tracer = tracer if tracer is not None else NullTracer()
        self.violations: list[Violation] = []
        self.queues: list[Queue] = [Queue(n) for n in device.queue_max_sizes()]
        self._irq_level = False
        self._reset_state()

    # --- state -----------------------------------------------------------------------

    def _reset_state(self) -> None:
        for q in self.queues:
            q.reset()
        self.status = 0
        self._needs_reset = False
        self.interrupt_status = 0
        self.device_features_sel = 0
        self.driver_features_sel = 0
        self.driver_features: dict[int, int] = {}
        self.queue_sel = 0
        self._set_irq()

    def _set_irq(self) -> None:
        level = self.interrupt_status != 0
        if level != self._irq_level:
            self._irq_level = level
            self.irq.set_level(level)

    def _violation(self, rule: str, message: str) -> None:
        self.violations.append(Violation(rule, message))
        self.tracer.emit("violation", rule=rule, message=message)

    @property
    def acked_features(self) -> int:
        return sum((v & 0xFFFF_FFFF) << (32 * s) for s, v in self.driver_features.items()
                   if s <= 1)

    def _selected(self) -> Queue | None:
        if 0 <= self.queue_sel < len(self.queues):
            return self.queues[self.queue_sel]
        return None

    # --- VirtioInterrupt (handed to the device at DRIVER_OK) --------------------------

    def signal_used(self, queue_index: int) -> None:
        self._raise(R.INT_VRING)

    def signal_config_change(self) -> None:
        self._raise(R.INT_CONFIG)

    def needs_reset(self, rule: str, message: str) -> None:
        if self._needs_reset:
            return
        self._needs_reset = True
        self.violations.append(Violation(rule, message))
        self._raise(R.INT_CONFIG)

    def _raise(self, bits: int) -> None:
        self.interrupt_status |= bits
        self.tracer.emit("irq", bits=bits, status=self.interrupt_status)
        self._set_irq()

    # --- MMIO ------------------------------------------------------------------------

    def read(self, offset: int, size: int) -> int:
        """A guest load; never raises."""
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
        return self._read_reg(offset)

    def _read_reg(self, offset: int) -> int:
        q = self._selected()
        if offset == R.MAGIC_VALUE:
            return R.MAGIC
        if offset == R.VERSION:
            return R.VERSION_MODERN
        if offset == R.DEVICE_ID:
            return self.device.device_id
        if offset == R.VENDOR_ID:
            return self.device.vendor_id
        if offset == R.DEVICE_FEATURES:
            if self.device_features_sel > 1:
                return 0
            return (self.device.avail_features() >> (32 * self.device_features_sel)) & 0xFFFF_FFFF
        if offset == R.QUEUE_NUM_MAX:
            return q.max_size if q is not None else 0
        if offset == R.QUEUE_READY:
            return int(q.ready) if q is not None else 0
        if offset == R.INTERRUPT_STATUS:
            return self.interrupt_status
        if offset == R.STATUS:
            return self.status | (V.STATUS_DEVICE_NEEDS_RESET if self._needs_reset else 0)
        if offset == R.CONFIG_GENERATION:
            return self.device.config_generation & 0xFFFF_FFFF
        return 0

    def write(self, offset: int, size: int, value: int) -> None:
        """A guest store; never raises."""
        if not 0 <= offset < R.REGION_SIZE:
            return
        if offset >= R.CONFIG:
            self._violation("config/write", f"{size}-byte write at {offset:#x}")
            return
        if size != 4 or offset % 4:
            self._violation("mmio/access-size", f"{size}-byte write at {offset:#x}")
            return
        self._write_reg(offset, value & 0xFFFF_FFFF)

    def _write_reg(self, offset: int, value: int) -> None:
        if offset == R.DEVICE_FEATURES_SEL:
            self.device_features_sel = value
        elif offset == R.DRIVER_FEATURES_SEL:
            self.driver_features_sel = value
        elif offset == R.DRIVER_FEATURES:
            if self.status & V.STATUS_FEATURES_OK:
                self._violation("features/after-features-ok",
                                f"DriverFeatures[{self.driver_features_sel}] = {value:#x}")
                return
            self.driver_features[self.driver_features_sel] = value
        elif offset == R.QUEUE_SEL:
            self.queue_sel = value
        elif offset in (R.QUEUE_NUM, R.QUEUE_READY, R.QUEUE_DESC_LOW, R.QUEUE_DESC_HIGH,
                        R.QUEUE_DRIVER_LOW, R.QUEUE_DRIVER_HIGH, R.QUEUE_DEVICE_LOW,
                        R.QUEUE_DEVICE_HIGH):
            self._write_queue_reg(offset, value)
        elif offset == R.QUEUE_NOTIFY:
            self._notify(value)
        elif offset == R.INTERRUPT_ACK:
            self.interrupt_status &= ~value
            self._set_irq()
        elif offset == R.STATUS:
            self._write_status(value)
        # read-only registers and unlisted offsets: ignored

    def _write_queue_reg(self, offset: int, value: int) -> None:
        q = self._selected()
        if q is None:
            self._violation("queue/bad-select",
                            f"register {offset:#x} written with QueueSel={self.queue_sel}")
            return
        if self.status & V.STATUS_DRIVER_OK:
            self._violation("queue/after-driver-ok",
                            f"register {offset:#x} of queue {self.queue_sel} after DRIVER_OK")
            return
        if offset == R.QUEUE_NUM:
            if value == 0 or value > q.max_size or not is_power_of_two(value):
                self._violation("queue/size", f"QueueNum {value} for queue {self.queue_sel} "
                                f"(max {q.max_size})")
                return
            q.size = value
        elif offset == R.QUEUE_READY:
            if value == 1 and not q.alignment_ok():
                self._violation("queue/alignment",
                                f"queue {self.queue_sel}: desc {q.desc_table:#x} driver "
                                f"{q.avail_ring:#x} device {q.used_ring:#x}")
                return
            q.ready = value == 1
        elif offset == R.QUEUE_DESC_LOW:
            q.desc_table = (q.desc_table & ~0xFFFF_FFFF) | value
        elif offset == R.QUEUE_DESC_HIGH:
            q.desc_table = (q.desc_table & 0xFFFF_FFFF) | value << 32
        elif offset == R.QUEUE_DRIVER_LOW:
            q.avail_ring = (q.avail_ring & ~0xFFFF_FFFF) | value
        elif offset == R.QUEUE_DRIVER_HIGH:
            q.avail_ring = (q.avail_ring & 0xFFFF_FFFF) | value << 32
        elif offset == R.QUEUE_DEVICE_LOW:
            q.used_ring = (q.used_ring & ~0xFFFF_FFFF) | value
        elif offset == R.QUEUE_DEVICE_HIGH:
            q.used_ring = (q.used_ring & 0xFFFF_FFFF) | value << 32

    def _notify(self, index: int) -> None:
        q = self.queues[index] if index < len(self.queues) else None
        if q is None or not q.ready:
            self._violation("queue/not-ready", f"QueueNotify({index}): queue not ready")
            return
        if not self.status & V.STATUS_DRIVER_OK:
            self._violation("queue/not-ready", f"QueueNotify({index}) before DRIVER_OK")
            return
        if self._needs_reset or self.status & V.STATUS_FAILED:
            return  # the function is stopped until reset
        self.device.notify(index)

    def _write_status(self, value: int) -> None:
        if value == 0:
            self.reset()
            return
        new = value & _DRIVER_BITS
        old = self.status
        if old & ~new:
            self._violation("status/clear-bit", f"Status {old:#x} -> {value:#x}")
            return
        added = new & ~old
        if added & V.STATUS_DRIVER and not new & V.STATUS_ACKNOWLEDGE:
            self._violation("status/order", f"DRIVER without ACKNOWLEDGE ({value:#x})")
            return
        if added & V.STATUS_FEATURES_OK and not new & V.STATUS_DRIVER:
            self._violation("status/order", f"FEATURES_OK before DRIVER ({value:#x})")
            return
        if added & V.STATUS_DRIVER_OK and not new & V.STATUS_FEATURES_OK:
            self._violation("status/order", f"DRIVER_OK without FEATURES_OK ({value:#x})")
            return
        if added & V.STATUS_FEATURES_OK:
            acked = self.acked_features
            extra = acked & ~self.device.avail_features()
            high = any(v for s, v in self.driver_features.items() if s > 1)
            if extra or high or not acked >> V.F_VERSION_1 & 1:
                self._violation("features/not-offered",
                                f"accepted {acked:#x}, offered "
                                f"{self.device.avail_features():#x}")
                return
            self.device.ack_features(acked)
        self.status = new
        if added & V.STATUS_DRIVER_OK:
            for q in self.queues:
                q.activate(self.acked_features)
            self.device.activate(self.queues, self)

    def reset(self) -> None:
        """Status 0 (spec §8): the device drops everything, then registers clear."""
        self.device.reset()
        self._reset_state()
        self.tracer.emit("reset")
