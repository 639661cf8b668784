"""The transport-independent half of a virtio 1.x transport (virtio 1.x §2.1, §3.1).

virtio-mmio and virtio-pci differ only in their register layout; the device status
state machine, feature negotiation, the virtqueue register rules, notification checks,
violation logging and reset are the same, and live here once (`TransportCore`). Each
transport keeps its own register decoding and interrupt delivery and names its
registers in violation messages through the `_*_NAME` class attributes.
"""
from __future__ import annotations

from dataclasses import dataclass

from hwspec import virtio as V

from ..ports import Tracer
from ..testing_breaks import BREAKS
from .device import VirtioDevice
from .queue import Queue
from .ring_factory import make_device_ring, ring_alignment_ok, ring_size_ok

TRANSPORT_FEATURES = 1 << V.F_NOTIFICATION_DATA | 1 << V.F_RING_RESET
"""Feature bits the transports implement (a device offers these with its own)."""
DRIVER_STATUS_BITS = (V.STATUS_ACKNOWLEDGE | V.STATUS_DRIVER | V.STATUS_FEATURES_OK
                      | V.STATUS_DRIVER_OK | V.STATUS_FAILED)


@dataclass(frozen=True)
class Violation:
    """One broken driver rule (spec §3/§4 rule name) with a human message."""
    rule: str
    message: str


class TransportCore:
    """Device status, features and virtqueue rules shared by the virtio transports.

    A transport sets `device`, `tracer`, `violations` and `queues` in its constructor
    and provides the interrupts (`signal_used`, `signal_config_change`: with the
    inherited `needs_reset`, the `VirtioInterrupt` handed to the device at DRIVER_OK)
    and `_reset_state` (which calls `_reset_core_state`)."""

    # how the transport names its registers in violation messages
    _STATUS_NAME = "device_status"
    _DRIVER_FEATURES_NAME = "driver_feature"
    _QUEUE_SEL_NAME = "queue_select"
    _QUEUE_SIZE_NAME = "queue_size"
    _QUEUE_REG_NAME = "register"
    _NOTIFY_NAME = "notify"

    device: VirtioDevice
    tracer: Tracer
    violations: list[Violation]
    queues: list[Queue]

    # --- state -----------------------------------------------------------------------

    def _reset_core_state(self) -> None:
        """Status 0: queues, status and feature registers back to their reset values."""
        for q in self.queues:
            q.reset()
        self.status = 0
        self._needs_reset = False
        self.device_features_sel = 0
        self.driver_features_sel = 0
        self.driver_features: dict[int, int] = {}
        self._acked = 0   # acked_features, kept up to date by _write_driver_features
        self._features_in_force = 0   # _ring_features(), kept up to date by _write_status
        self.queue_sel = 0

    def _reset_state(self) -> None:  # pragma: no cover - every transport overrides it
        raise NotImplementedError

    def signal_used(self, queue_index: int) -> None:  # pragma: no cover - overridden
        raise NotImplementedError

    def signal_config_change(self) -> None:  # pragma: no cover - overridden
        raise NotImplementedError

    def _violation(self, rule: str, message: str) -> None:
        self.violations.append(Violation(rule, message))
        self.tracer.emit("violation", rule=rule, message=message)

    @property
    def acked_features(self) -> int:
        return self._acked

    def _queue_ok(self, index: int) -> bool:
        return 0 <= index < len(self.queues)   # inlined by _notify

    def _selected(self) -> Queue | None:
        if self._queue_ok(self.queue_sel):
            return self.queues[self.queue_sel]
        return None

    def _status_value(self) -> int:
        """The status register as the driver reads it (DEVICE_NEEDS_RESET included)."""
        return self.status | (V.STATUS_DEVICE_NEEDS_RESET if self._needs_reset else 0)

    def _device_features_word(self) -> int:
        """The 32 device feature bits selected by the device feature select register."""
        if self.device_features_sel > 1:
            return 0
        return (self.device.avail_features() >> (32 * self.device_features_sel)) & 0xFFFF_FFFF

    # --- VirtioInterrupt ---------------------------------------------------------------

    def needs_reset(self, rule: str, message: str) -> None:
        """VirtioInterrupt: a broken ring: DEVICE_NEEDS_RESET + config interrupt."""
        if self._needs_reset:
            return
        self._needs_reset = True
        self.violations.append(Violation(rule, message))
        self.signal_config_change()

    # --- feature negotiation -----------------------------------------------------------

    def _write_driver_features(self, value: int) -> None:
        if self.status & V.STATUS_FEATURES_OK:
            self._violation("features/after-features-ok",
                            f"{self._DRIVER_FEATURES_NAME}[{self.driver_features_sel}] = "
                            f"{value:#x}")
            return
        self.driver_features[self.driver_features_sel] = value
        self._acked = sum((v & 0xFFFF_FFFF) << (32 * s)
                          for s, v in self.driver_features.items() if s <= 1)

    # --- virtqueue registers -----------------------------------------------------------

    def _queue_writable(self, reg: int) -> Queue | None:
        """The selected queue if its registers may be written now, else log why not."""
        q = self._selected()
        if q is None:
            self._violation("queue/bad-select",
                            f"{self._QUEUE_REG_NAME} {reg:#x} written with "
                            f"{self._QUEUE_SEL_NAME}={self.queue_sel}")
            return None
        if self.status & V.STATUS_DRIVER_OK and not q.queue_reset:
            self._violation("queue/after-driver-ok",
                            f"{self._QUEUE_REG_NAME} {reg:#x} of queue {self.queue_sel} "
                            "after DRIVER_OK")
            return None
        return q

    def _set_queue_size(self, q: Queue, value: int) -> None:
        if value == 0 or value > q.max_size or not ring_size_ok(self._ring_features(), value):
            self._violation("queue/size", f"{self._QUEUE_SIZE_NAME} {value} for queue "
                            f"{self.queue_sel} (max {q.max_size})")
            return
        q.size = value

    def _ring_features(self) -> int:
        """The features the driver's rings follow: accepted ones once FEATURES_OK is
        set (a subset of the offer), else none (the split ring's rules)."""
        return self._features_in_force

    def _enable_queue(self, q: Queue) -> None:
        if not ring_alignment_ok(self._ring_features(), q):
            self._violation("queue/alignment",
                            f"queue {self.queue_sel}: desc {q.desc_table:#x} driver "
                            f"{q.avail_ring:#x} device {q.used_ring:#x}")
            return
        q.ready = True
        if q.queue_reset and self.status & V.STATUS_DRIVER_OK:
            # RING_RESET re-enable: the device takes the queue's new ring now
            q.queue_reset = False
            self.tracer.emit("queue_enable", queue=self.queue_sel)
            if not self._needs_reset and not self.status & V.STATUS_FAILED:
                self.device.enable_queue(self.queue_sel,
                                         make_device_ring(self.acked_features, q))

    def _has(self, feature: int) -> bool:
        return bool(self._features_in_force >> feature & 1)

    def _reset_queue(self, value: int) -> None:
        """queue_reset / QueueReset written (virtio 1.x §2.6.1, §4.1.4.3, §4.2.2): 1
        resets the selected queue alone; the reset is done when the write returns (the
        register reads 0, and so does the queue's enable)."""
        if not self._has(V.F_RING_RESET):
            self._violation("queue/reset-not-negotiated",
                            f"queue reset written for queue {self.queue_sel}")
            return
        q = self._selected()
        if q is None:
            self._violation("queue/bad-select",
                            f"queue reset written with {self._QUEUE_SEL_NAME}={self.queue_sel}")
            return
        if value != 1:
            self._violation("queue/reset-value", f"queue reset = {value} for queue "
                            f"{self.queue_sel} (only 1 may be written)")
            return
        if not self.status & V.STATUS_DRIVER_OK:
            if not q.ready:
                self._violation("queue/reset-not-enabled",
                                f"queue {self.queue_sel} reset before it was enabled")
                return
            q.reset()
            return
        if self._needs_reset or self.status & V.STATUS_FAILED:
            return  # the function is stopped until reset
        if self.device.reset_queue(self.queue_sel):
            q.reset()
            q.queue_reset = True
            self._queue_was_reset(self.queue_sel)
            self.tracer.emit("queue_reset", queue=self.queue_sel)

    def _queue_was_reset(self, index: int) -> None:
        """Transport state of one queue back to its reset value (virtio-pci: its MSI-X
        vector)."""

    @staticmethod
    def _set_queue_addr(q: Queue, attr: str, value: int, part: str) -> None:
        """Set `attr` (desc_table/avail_ring/used_ring) of `q`: its low or high 32 bits
        (`part` "lo"/"hi") or all 64 ("wide")."""
        old = getattr(q, attr)
        if part == "wide":
            new = value
        elif part == "lo":
            new = (old & ~0xFFFF_FFFF) | value
        else:
            new = (old & 0xFFFF_FFFF) | value << 32
        setattr(q, attr, new)

    # --- notifications -----------------------------------------------------------------

    _NOTIFY_RULES = False
    """Whether the transport has notification rules of its own (`_notify_allowed`)."""

    def _notify_allowed(self, index: int) -> bool:
        """Transport-specific notification rules (checked after the queue rules), when
        `_NOTIFY_RULES` says there are."""
        return True

    def _notify(self, index: int, data: int | None = None) -> None:
        """A driver notification of queue `index`; `data`, with NOTIFICATION_DATA, the
        16 bits after the queue index (next_off, next_wrap)."""
        queues = self.queues
        if not (0 <= index < len(queues) and queues[index].ready):
            self._violation("queue/not-ready",
                            f"{self._NOTIFY_NAME}({index}): queue not ready")
            return
        if not self.status & V.STATUS_DRIVER_OK:
            self._violation("queue/not-ready", f"{self._NOTIFY_NAME}({index}) before DRIVER_OK")
            return
        if self._NOTIFY_RULES and not self._notify_allowed(index):
            return
        if self._needs_reset or self.status & V.STATUS_FAILED:
            return  # the function is stopped until reset
        if data is None:
            self.device.notify(index)
        else:
            self.device.notify_data(index, data & V.NOTIFY_DATA_OFF_MASK,
                                    data >> (V.NOTIFY_DATA_WRAP_SHIFT - V.NOTIFY_DATA_OFF_SHIFT)
                                    & 1)

    # --- device status -----------------------------------------------------------------

    def _write_status(self, value: int) -> None:
        if value == 0:
            self.reset()
            return
        new = value & DRIVER_STATUS_BITS
        old = self.status
        added = new & ~old
        if not (BREAKS and "status/allow-any-transition" in BREAKS) \
                and not self._transition_ok(old, new, value):
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
        self._features_in_force = self._acked if new & V.STATUS_FEATURES_OK else 0
        if added & V.STATUS_DRIVER_OK:
            self._activate(self.acked_features)

    def _activate(self, features: int) -> None:
        """DRIVER_OK: hand the device the device side of every ring. A transport whose
        data path lies elsewhere (a VMM's vhost-vdpa frontend, which hands the queue
        registers to the hardware instead) overrides this."""
        self.device.activate([make_device_ring(features, q) for q in self.queues], self)

    def _transition_ok(self, old: int, new: int, value: int) -> bool:
        """Bits only added, in order (spec §3.1); else log the rule broken."""
        if old & ~new:
            self._violation("status/clear-bit", f"{self._STATUS_NAME} {old:#x} -> {value:#x}")
            return False
        added = new & ~old
        if added & V.STATUS_DRIVER and not new & V.STATUS_ACKNOWLEDGE:
            self._violation("status/order", f"DRIVER without ACKNOWLEDGE ({value:#x})")
            return False
        if added & V.STATUS_FEATURES_OK and not new & V.STATUS_DRIVER:
            self._violation("status/order", f"FEATURES_OK before DRIVER ({value:#x})")
            return False
        if added & V.STATUS_DRIVER_OK and not new & V.STATUS_FEATURES_OK:
            self._violation("status/order", f"DRIVER_OK without FEATURES_OK ({value:#x})")
            return False
        return True

    def reset(self) -> None:
        """Status 0 (spec §8): the device drops everything, then the registers clear."""
        self.device.reset()
        self._reset_state()
        self.tracer.emit("reset")
