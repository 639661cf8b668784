"""virtio-mmio version 2 transport, driver side (virtio 1.x §4.2.2, VA-1 datasheet §3).

Every register at 0x000-0x0FF is accessed with 4-byte loads/stores only (a strict device
logs anything else). Each access is a VM exit, so hot paths (notify, interrupt status/ack)
do exactly one access each.
"""
from __future__ import annotations

from typing import Sequence

from hwspec import virtio as V
from hwspec import virtio_mmio as R
from hwspec.layout import Layout

from ..kernel import IrqChip, MmioAccessor
from .transport import (RESET_QUEUE_POLL_LIMIT, FeaturesRefused, InterruptHandler,
                        ProbeError, TransportError, check_queue_size, notify_value)
from .transport import negotiate as _negotiate

__all__ = ["VirtioMmio", "TransportError", "ProbeError", "FeaturesRefused"]

RESET_POLL_LIMIT = 1000          # reads of Status after writing 0 before giving up
CONFIG_GENERATION_RETRIES = 100  # re-reads of a config block before giving up


_SIZE_OF_CODE = {"B": 1, "H": 2, "I": 4, "Q": 8}


class VirtioMmio:
    """One virtio-mmio register window (implements VirtioTransport).

    Interrupts: one platform line, level-triggered; the line handler reads
    InterruptStatus and ACKs it before calling the driver (two MMIO accesses).
    """

    def __init__(self, mmio: MmioAccessor, base: int, irqchip: IrqChip | None = None,
                 irq: int | None = None) -> None:
        self.mmio = mmio
        self.base = base
        self.name = f"virtio-mmio@{base:#x}"
        self.device_id = 0
        self.vendor_id = 0
        self._status = 0  # what the driver last wrote (avoids a read per status update)
        self._irqchip = irqchip
        self._irq = irq
        self._irq_registered = False
        self._handler: InterruptHandler | None = None
        self._in_irq = False

    # ---- raw register access -------------------------------------------------------
    def _rd(self, off: int) -> int:
        return self.mmio.read(self.base + off, 4)

    def _wr(self, off: int, value: int) -> None:
        self.mmio.write(self.base + off, 4, value & 0xFFFFFFFF)

    # ---- identification --------------------------------------------------------------
    def probe(self) -> int:
        """Check magic and version; return the device id (0 = placeholder, no device)."""
        magic = self._rd(R.MAGIC_VALUE)
        if magic != R.MAGIC:
            raise ProbeError(f"virtio-mmio@{self.base:#x}: bad magic {magic:#010x} "
                             f"(expected {R.MAGIC:#010x})")
        version = self._rd(R.VERSION)
        if version != R.VERSION_MODERN:
            raise ProbeError(f"virtio-mmio@{self.base:#x}: version {version} not supported "
                             f"(only {R.VERSION_MODERN}, virtio 1.x)")
        self.device_id = self._rd(R.DEVICE_ID)
        self.vendor_id = self._rd(R.VENDOR_ID)
        return self.device_id

    # ---- status ------------------------------------------------------------------------
    def read_status(self) -> int:
        return self._rd(R.STATUS)

    def reset(self) -> None:
        """Write 0 and read back until the device reports 0 (virtio 1.x §4.2.3.1)."""
        self._wr(R.STATUS, 0)
        self._status = 0
        for _ in range(RESET_POLL_LIMIT):
            if self._rd(R.STATUS) == 0:
                return
        raise TransportError(f"virtio-mmio@{self.base:#x}: Status did not read back 0 "
                             f"after reset ({RESET_POLL_LIMIT} reads)")

    def add_status(self, bits: int) -> None:
        """Set status bits, keeping those already set (clearing one is a violation)."""
        self._status |= bits
        self._wr(R.STATUS, self._status)

    def fail(self) -> None:
        """Tell the device the driver gave up (FAILED may be added at any time)."""
        self.add_status(V.STATUS_FAILED)

    # ---- features ------------------------------------------------------------------------
    def device_features(self) -> int:
        feats = 0
        for sel in (0, 1):
            self._wr(R.DEVICE_FEATURES_SEL, sel)
            feats |= self._rd(R.DEVICE_FEATURES) << (32 * sel)
        return feats

    def write_driver_features(self, features: int) -> None:
        for sel in (0, 1):
            self._wr(R.DRIVER_FEATURES_SEL, sel)
            self._wr(R.DRIVER_FEATURES, (features >> (32 * sel)) & 0xFFFFFFFF)

    def negotiate(self, wanted: int, required: int = 1 << V.F_VERSION_1) -> int:
        """Accept `wanted & offered`, write FEATURES_OK and check that it stuck.

        Returns the accepted feature set. Raises FeaturesRefused naming the features when
        a required one is not offered or the device leaves FEATURES_OK clear.
        """
        return _negotiate(self, wanted, required)

    # ---- queues -------------------------------------------------------------------------
    def queue_num_max(self, index: int) -> int:
        self._wr(R.QUEUE_SEL, index)
        return self._rd(R.QUEUE_NUM_MAX)

    def setup_queue(self, index: int, num: int, desc: int, driver: int, device: int) -> None:
        """Program and enable one queue; call before DRIVER_OK."""
        self._wr(R.QUEUE_SEL, index)
        if self._rd(R.QUEUE_READY):
            raise TransportError(f"virtio-mmio@{self.base:#x}: queue {index} already ready")
        check_queue_size(self.name, index, num, self._rd(R.QUEUE_NUM_MAX))
        self._wr(R.QUEUE_NUM, num)
        for low, addr in ((R.QUEUE_DESC_LOW, desc), (R.QUEUE_DRIVER_LOW, driver),
                          (R.QUEUE_DEVICE_LOW, device)):
            self._wr(low, addr & 0xFFFFFFFF)
            self._wr(low + 4, addr >> 32)
        self._wr(R.QUEUE_READY, 1)

    def notify(self, index: int, data: int | None = None) -> None:
        value = index if data is None else notify_value(index, data)
        self.mmio.write(self.base + R.QUEUE_NOTIFY, 4, value & 0xFFFFFFFF)  # _wr

    def reset_queue(self, index: int) -> None:
        """QueueReset = 1, then read until both QueueReset and QueueReady read 0."""
        self._wr(R.QUEUE_SEL, index)
        self._wr(R.QUEUE_RESET, 1)
        for _ in range(RESET_QUEUE_POLL_LIMIT):
            if self._rd(R.QUEUE_RESET) == 0 and self._rd(R.QUEUE_READY) == 0:
                return
        raise TransportError(f"virtio-mmio@{self.base:#x}: queue {index} reset did not "
                             f"complete ({RESET_QUEUE_POLL_LIMIT} reads)")

    def reenable_queue(self, index: int, num: int, desc: int, driver: int,
                       device: int) -> None:
        self.setup_queue(index, num, desc, driver, device)

    # ---- interrupts -----------------------------------------------------------------------
    def setup_interrupts(self, queues: Sequence[int], handler: InterruptHandler,
                         name: str) -> None:
        """Take the platform line once; virtio-mmio has no per-queue routing."""
        self._handler = handler
        if self._irq_registered or self._irqchip is None or self._irq is None:
            return
        try:
            self._irqchip.request_irq(self._irq, self._line_irq, name)
        except Exception as e:  # the VM's irqchip refused the line: no device without it
            raise TransportError(f"cannot get interrupt line {self._irq}: {e}") from e
        self._irq_registered = True

    def free_interrupts(self) -> None:
        if self._irq_registered and self._irqchip is not None and self._irq is not None:
            self._irqchip.free_irq(self._irq)
        self._irq_registered = False

    def _line_irq(self) -> None:
        """Read InterruptStatus, ACK it, hand it to the driver. ACK comes before the
        driver reaps, so a used entry landing after the reap raises the line again."""
        if self._in_irq or self._handler is None:
            return  # re-entered from our own MMIO; the level-triggered line stays up
        self._in_irq = True
        mmio, base = self.mmio, self.base
        try:
            isr = mmio.read(base + R.INTERRUPT_STATUS, 4)   # interrupt_status()
            if isr == 0:
                return
            # interrupt_ack(isr), even when the driver gave up: do not leave it high
            mmio.write(base + R.INTERRUPT_ACK, 4, isr & 0xFFFFFFFF)
            self._handler(bool(isr & R.INT_CONFIG), None)
        finally:
            self._in_irq = False

    def poll_interrupt(self) -> bool:
        isr = self.interrupt_status()
        if isr:
            self.interrupt_ack(isr)
        return bool(isr & R.INT_CONFIG)

    def restore_after_reset(self) -> None:
        pass  # a platform device: nothing outside the virtio registers to restore

    def interrupts_broken(self) -> str | None:
        return None  # a platform line: nothing in the function to lose

    def interrupt_status(self) -> int:
        return self._rd(R.INTERRUPT_STATUS)

    def interrupt_ack(self, bits: int) -> None:
        self._wr(R.INTERRUPT_ACK, bits)

    # ---- device configuration -------------------------------------------------------------
    def config_generation(self) -> int:
        return self._rd(R.CONFIG_GENERATION)

    def read_config(self, layout: Layout) -> dict[str, int]:
        """Read a whole config structure consistently (ConfigGeneration before == after)."""
        for _ in range(CONFIG_GENERATION_RETRIES):
            gen = self.config_generation()
            values: dict[str, int] = {}
            for name, code in layout.fields:
                size = _SIZE_OF_CODE[code]
                values[name] = self.mmio.read(self.base + R.CONFIG + layout.offsets[name], size)
            if self.config_generation() == gen:
                return values
        raise TransportError(f"virtio-mmio@{self.base:#x}: device config kept changing "
                             f"({CONFIG_GENERATION_RETRIES} ConfigGeneration retries)")

