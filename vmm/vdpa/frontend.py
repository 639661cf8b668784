"""The VMM frontend of a vhost-vdpa device (what QEMU's vhost-vdpa devices do): the guest
sees an emulated VA-1 over virtio-pci or virtio-mmio, its control accesses become vhost
ioctls, and its data path goes straight to the function.

Why: the guest must need nothing but its ordinary virtio driver. So the registers are
the emulated transports' own (device_model.virtio: same rules, same violations), with a
`VhostBackend` as their device: feature, status, config and queue-setup accesses turn
into vhost ioctls on /dev/vhost-vdpa-N. At DRIVER_OK the queue registers go to the
device (SET_VRING_NUM/ADDR/BASE/ENABLE, then SET_STATUS), never to an emulated ring:
- guest RAM is in the IOTLB at IOVA = guest physical address (one batch at start), so
  the rings and buffers the guest gives are what the function reads;
- kicks: the notify area (virtio-pci) or QueueNotify (virtio-mmio) is an ioeventfd: a
  guest store of the queue index signals that queue's kick eventfd, which vhost-vdpa
  turns into the function's doorbell; any other store traps to the transport, which
  logs the violation;
- interrupts: each queue's call eventfd is an irqfd that raises the frontend's used-
  buffer interrupt (the MSI-X vector the guest programmed, or the mmio line); the config
  eventfd is read by the VMM, which sets DEVICE_NEEDS_RESET when the device reports it
  and otherwise signals a configuration change.
A vhost request refused at DRIVER_OK (a ring the IOTLB does not cover, say) sets
DEVICE_NEEDS_RESET, as QEMU's virtio_error does.
"""
from __future__ import annotations

import os
from typing import Any, Callable, Sequence

from device_model import MmioTransport, VirtioPciFunction
from device_model.ports import IrqLine, MsiPort, Tracer
from device_model.virtio.device import VirtioDevice, VirtioInterrupt
from device_model.virtio.queue import Queue
from device_model.virtio.ring import DeviceRing
from device_model.virtio.status import TransportCore
from hwspec import va1
from hwspec import virtio as V
from hwspec import virtio_mmio as R

from ..eventfd import EventfdWaitQueues, IrqfdRegistry, drain, new_eventfd
from ..memory import GuestMemory
from ..pci.host_bridge import BarRegion, BarWindow
from ..vfio.container import vaddr_of
from . import uapi
from .errors import VhostError
from .vhost import VhostVdpaFile, iotlb_msg

WANTED_BACKEND = (1 << uapi.VHOST_BACKEND_F_IOTLB_MSG_V2 | 1 << uapi.VHOST_BACKEND_F_IOTLB_BATCH
                  | 1 << uapi.VHOST_BACKEND_F_SUSPEND | 1 << uapi.VHOST_BACKEND_F_RESUME)
_PAGE = 0x1000


def _u(ctype: str, value: int = 0) -> Any:
    p = uapi.new(f"{ctype} *")
    p[0] = value
    return p


class VhostBackend(VirtioDevice):
    """A VirtioDevice whose every request is a vhost ioctl on an open vhost-vdpa file."""

    def __init__(self, vhost: VhostVdpaFile, memory: GuestMemory, eventfds: EventfdWaitQueues,
                 irqfd: IrqfdRegistry, tracer: Tracer, owner: object = None) -> None:
        self.vhost = vhost
        self.memory = memory
        self.eventfds = eventfds
        self.irqfd = irqfd
        self.tracer = tracer
        self.owner = owner
        self.interrupt: TransportCore | None = None
        self.generation = 0
        self.running = False       # DRIVER_OK reached the device
        self._call(uapi.VHOST_SET_OWNER)
        self.features = self._get("uint64_t", uapi.VHOST_GET_FEATURES)
        offered = self._get("uint64_t", uapi.VHOST_GET_BACKEND_FEATURES)
        self._call(uapi.VHOST_SET_BACKEND_FEATURES, _u("uint64_t", offered & WANTED_BACKEND))
        self.backend_features = offered & WANTED_BACKEND
        self.num_queues = self._get("uint32_t", uapi.VHOST_VDPA_GET_VQS_COUNT)
        self.vq_max = self._get("uint16_t", uapi.VHOST_VDPA_GET_VRING_NUM)
        self.config_size = self._get("uint32_t", uapi.VHOST_VDPA_GET_CONFIG_SIZE)
        self._device_id = self._get("uint32_t", uapi.VHOST_VDPA_GET_DEVICE_ID)
        self.bases = [0] * self.num_queues
        self._map_ram()
        self.kick = [new_eventfd() for _ in range(self.num_queues)]
        self.call = [new_eventfd() for _ in range(self.num_queues)]
        self.config_fd = new_eventfd()
        for i in range(self.num_queues):
            self._vring_file(uapi.VHOST_SET_VRING_KICK, i, self.kick[i])
            self._vring_file(uapi.VHOST_SET_VRING_CALL, i, self.call[i])
        self._call(uapi.VHOST_VDPA_SET_CONFIG_CALL, _u("int", self.config_fd))
        self.eventfds.add_waiter(self.config_fd, self._config_event)

    # -- vhost plumbing -----------------------------------------------------------------------

    def _call(self, request: int, arg: Any = None) -> int:
        return self.vhost.ioctl(request, arg, process=self.owner)

    def _get(self, ctype: str, request: int) -> int:
        p = _u(ctype)
        self._call(request, p)
        return int(p[0])

    def _state(self, request: int, index: int, num: int) -> Any:
        s = uapi.new("struct vhost_vring_state *")
        s.index, s.num = index, num
        self._call(request, s)
        return s

    def _vring_file(self, request: int, index: int, fd: int) -> None:
        f = uapi.new("struct vhost_vring_file *")
        f.index, f.fd = index, fd
        self._call(request, f)

    def _set_status(self, status: int) -> None:
        self._call(uapi.VHOST_VDPA_SET_STATUS, _u("uint8_t", status))

    def _map_ram(self) -> None:
        """Guest RAM at IOVA = GPA, in one batch (QEMU's memory listener commit)."""
        m = self.memory
        for msg in (iotlb_msg(uapi.VHOST_IOTLB_BATCH_BEGIN),
                    iotlb_msg(uapi.VHOST_IOTLB_UPDATE, m.base, m.size, vaddr_of(m, m.base),
                              uapi.VHOST_ACCESS_RW),
                    iotlb_msg(uapi.VHOST_IOTLB_BATCH_END)):
            self.vhost.write(msg, process=self.owner)

    def bind(self, transport: TransportCore) -> None:
        """The frontend's transport: call eventfds become its used-buffer interrupts."""
        self.interrupt = transport
        for i, fd in enumerate(self.call):
            self.irqfd.assign(fd, self._used(transport, i))

    @staticmethod
    def _used(transport: TransportCore, index: int) -> Callable[[], None]:
        return lambda: transport.signal_used(index)

    def _config_event(self, fd: int) -> None:
        if not drain(fd) or self.interrupt is None:
            return
        status = self._get("uint8_t", uapi.VHOST_VDPA_GET_STATUS)
        if status & V.STATUS_DEVICE_NEEDS_RESET:
            self.tracer.emit("vdpa_needs_reset", status=status)
            self.interrupt.needs_reset("device/needs-reset",
                                       "the vDPA device reported DEVICE_NEEDS_RESET")
            return
        self.generation += 1
        self.interrupt.signal_config_change()

    # -- VirtioDevice -------------------------------------------------------------------------

    @property
    def device_id(self) -> int:
        return self._device_id

    @property
    def vendor_id(self) -> int:
        return va1.MMIO_VENDOR_ID

    def avail_features(self) -> int:
        return self.features

    def ack_features(self, features: int) -> None:
        self._set_status(V.STATUS_ACKNOWLEDGE | V.STATUS_DRIVER)
        self._call(uapi.VHOST_SET_FEATURES, _u("uint64_t", features))
        self._set_status(V.STATUS_ACKNOWLEDGE | V.STATUS_DRIVER | V.STATUS_FEATURES_OK)

    def queue_max_sizes(self) -> Sequence[int]:
        return [self.vq_max] * self.num_queues

    def read_config(self, offset: int, length: int) -> bytes:
        if offset < 0 or length <= 0:
            return b""
        n = max(0, min(length, self.config_size - offset))
        if not n:
            return bytes(length)
        c = uapi.new("struct vhost_vdpa_config *", {"buf": n})
        c.off, c.len = offset, n
        self._call(uapi.VHOST_VDPA_GET_CONFIG, c)
        return bytes(uapi.ffi.buffer(c.buf, n)).ljust(length, b"\0")

    @property
    def config_generation(self) -> int:
        return self.generation

    def activate(self, queues: Sequence[DeviceRing], interrupt: VirtioInterrupt) -> None:
        raise NotImplementedError("a vhost frontend starts the device with start()")

    def start(self, queues: Sequence[Queue], interrupt: TransportCore) -> None:
        """DRIVER_OK: queue registers to the device, then DRIVER_OK (vhost_dev_start)."""
        try:
            for i, q in enumerate(queues[:self.num_queues]):
                if not q.ready:
                    continue
                self._state(uapi.VHOST_SET_VRING_NUM, i, q.size)
                a = uapi.new("struct vhost_vring_addr *")
                a.index, a.desc_user_addr = i, q.desc_table
                a.avail_user_addr, a.used_user_addr = q.avail_ring, q.used_ring
                self._call(uapi.VHOST_SET_VRING_ADDR, a)
                self._state(uapi.VHOST_SET_VRING_BASE, i, self.bases[i])
                self._state(uapi.VHOST_VDPA_SET_VRING_ENABLE, i, 1)
            self._set_status(V.STATUS_ACKNOWLEDGE | V.STATUS_DRIVER | V.STATUS_FEATURES_OK
                             | V.STATUS_DRIVER_OK)
            self.running = True
        except VhostError as e:
            self.tracer.emit("vdpa_start_failed", error=str(e))
            interrupt.needs_reset("vdpa/start", f"the vDPA device refused the setup: {e}")

    # -- suspend, resume, live move ----------------------------------------------------------

    def suspend(self) -> list[int]:
        """VHOST_VDPA_SUSPEND (in-flight work finished), then every queue's base."""
        self._call(uapi.VHOST_VDPA_SUSPEND)
        return [int(self._state(uapi.VHOST_GET_VRING_BASE, i, 0).num)
                for i in range(self.num_queues)]

    def resume(self) -> None:
        """VHOST_VDPA_RESUME, then a kick on every queue for what came meanwhile."""
        self._call(uapi.VHOST_VDPA_RESUME)
        self.kick_all()

    def kick_all(self) -> None:
        for fd in self.kick:
            self.eventfds.signal(fd)

    def restore(self, features: int, status: int, queues: Sequence[Queue],
                interrupt: TransportCore) -> None:
        """Bring a fresh device to where the frontend's guest left the old one: its
        features, then (if the guest had started it) its queues from `self.bases`."""
        if status & V.STATUS_FEATURES_OK:
            self.ack_features(features)
        if status & V.STATUS_DRIVER_OK:
            self.start(queues, interrupt)

    def unbind(self) -> None:
        for fd in self.call:
            self.irqfd.deassign(fd)

    def notify(self, queue_index: int) -> None:
        if 0 <= queue_index < self.num_queues:
            self.eventfds.signal(self.kick[queue_index])

    def reset(self) -> None:
        self.bases = [0] * self.num_queues
        self.running = False
        if not self.vhost.closed:
            self._set_status(0)

    def set_bus_master(self, enabled: bool) -> None:
        """Bus Master cleared on the frontend while the device runs: vhost has no way to
        hold the function's DMA, so the VMM stops the device (as QEMU does: DRIVER_OK
        dropped, the device reset) and sets DEVICE_NEEDS_RESET for the guest's driver."""
        if enabled or not self.running or self.interrupt is None:
            return
        self.reset()
        self.tracer.emit("vdpa_stopped", reason="bus master cleared")
        self.interrupt.needs_reset("vdpa/bus-master-off", "Bus Master cleared while the vDPA "
                                   "device ran: the VMM stopped it")

    # -- release --------------------------------------------------------------------------------

    def close(self) -> None:
        """Interrupts and kicks unwired, the vhost file closed (device reset, IOTLB gone),
        the eventfds closed."""
        self.unbind()
        self.eventfds.remove_waiter(self.config_fd, self._config_event)
        self.vhost.close()
        for fd in self.kick + self.call + [self.config_fd]:
            os.close(fd)
        self.kick, self.call = [], []


class IoeventfdWindow:
    """KVM ioeventfds over a notify area: a store of queue i's index at its address
    signals kick[i] with no VMM work; anything else traps to `fallback`."""

    def __init__(self, fallback: Any, kicks: Callable[[], list[int]], eventfds: EventfdWaitQueues,
                 stride: int, width: int, base: int = 0) -> None:
        self.fallback = fallback
        self.kicks = kicks
        self.eventfds = eventfds
        self.stride = stride
        self.width = width
        self.base = base
        self.signals = 0

    def read(self, offset: int, size: int) -> int:
        value: int = self.fallback.read(self.base + offset, size)
        return value

    def write(self, offset: int, size: int, value: int) -> None:
        kicks = self.kicks()
        index = offset // self.stride if self.stride else value
        if (size == self.width and (not self.stride or offset % self.stride == 0)
                and 0 <= index < len(kicks) and value == index):
            self.signals += 1
            self.eventfds.signal(kicks[index])
            return
        self.fallback.write(self.base + offset, size, value)


class _Window:
    """A piece of a handler's window (offsets shifted by `base`)."""

    def __init__(self, handler: Any, base: int) -> None:
        self.handler = handler
        self.base = base

    def read(self, offset: int, size: int) -> int:
        value: int = self.handler.read(self.base + offset, size)
        return value

    def write(self, offset: int, size: int, value: int) -> None:
        self.handler.write(self.base + offset, size, value)


class VdpaPciFrontend(VirtioPciFunction):
    """VA-1 over virtio-pci in front of a vhost-vdpa device; the notify page is ioeventfds."""

    def __init__(self, backend: VhostBackend, msi: MsiPort, tracer: Tracer | None = None) -> None:
        super().__init__(backend, msi, tracer, device_cfg_length=backend.config_size)
        self.backend = backend
        backend.bind(self)
        self.ioeventfd = IoeventfdWindow(BarWindow(self, va1.PCI_BAR, va1.PCI_NOTIFY_OFFSET),
                                         lambda: self.backend.kick, backend.eventfds,
                                         self.notify_multiplier, 2)

    def _activate(self, features: int) -> None:
        self.backend.start(self.queues, self)

    def switch_backend(self, backend: VhostBackend) -> VhostBackend:
        """A live move: `backend` (already restored) takes over; the old one is returned
        unbound, for the caller to close."""
        old, self.backend, self.device = self.backend, backend, backend
        old.unbind()
        backend.bind(self)
        return old

    def bar_regions(self, index: int) -> Sequence[BarRegion]:
        size = next(b.size for b in self.bars() if b.index == index)
        n = va1.PCI_NOTIFY_OFFSET
        return (BarRegion(0, n, BarWindow(self, index, 0)),
                BarRegion(n, _PAGE, self.ioeventfd),
                BarRegion(n + _PAGE, size - n - _PAGE, BarWindow(self, index, n + _PAGE)))


class VdpaMmioFrontend(MmioTransport):
    """VA-1 over virtio-mmio in front of a vhost-vdpa device; QueueNotify is an ioeventfd."""

    def __init__(self, backend: VhostBackend, irq: IrqLine, tracer: Tracer | None = None) -> None:
        super().__init__(backend, irq, tracer)
        self.backend = backend
        backend.bind(self)
        self.ioeventfd = IoeventfdWindow(self, lambda: self.backend.kick, backend.eventfds, 0, 4,
                                         base=R.QUEUE_NOTIFY)

    def _activate(self, features: int) -> None:
        self.backend.start(self.queues, self)

    def switch_backend(self, backend: VhostBackend) -> VhostBackend:
        """A live move: `backend` (already restored) takes over; the old one is returned
        unbound, for the caller to close."""
        old, self.backend, self.device = self.backend, backend, backend
        old.unbind()
        backend.bind(self)
        return old

    def regions(self) -> list[tuple[int, int, Any]]:
        """(offset, size, handler) pieces of the window for the VM bus."""
        n = R.QUEUE_NOTIFY
        return [(0, n, self), (n, 4, self.ioeventfd),
                (n + 4, R.REGION_SIZE - n - 4, _Window(self, n + 4))]
