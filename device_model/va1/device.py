"""The VA-1 function: controlq, eventq, submit queues, contexts (spec §6, §8).

Implements `VirtioDevice`; knows nothing of the transport. Whatever the driver or guest
memory does, no exception leaves `notify` or a timer callback: broken rings become
`needs_reset` on the transport, bad requests become status codes. The device's own
failures too: a command that fails inside the device completes DEVICE_ERROR (engine.py);
any other unexpected exception sets DEVICE_NEEDS_RESET on this function alone (rule
`device/internal`) and releases its compute units.
"""
from __future__ import annotations

import struct
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Callable, Sequence

from hwspec import va1
from hwspec import virtio as V
from hwspec.va1 import NO_OFFSET, CtrlType, EventType, Status

from ..ports import DevicePorts, DmaFault
from ..testing_breaks import BREAKS
from ..virtio.device import VirtioDevice, VirtioInterrupt
from ..virtio.ring import DescriptorChain, DeviceRing, DmaWindow, RingError
from ..virtio.ring_factory import RING_FEATURES
from ..virtio.status import TRANSPORT_FEATURES
from .commands import Command, CommandError, DecodeEnv, ResolveCache, decode
from .config import DEFAULT_VIRTIO_FEATURES, Va1Config
from .aspace import AddressSpace
from .engine import CommandProcessor, Submission
from .memory import DeviceMemory
from .scheduler import Scheduler
from .metrics import Metrics
from .migration import MigrationPort
from .requests import (CtrlRequest, SubmitRequest, bad_request_reply, ctrl_response_size,
                       pack_ctrl_resp, pack_event, pack_stats_resp, pack_submit_resp,
                       pack_submit_resp_into, unpack_submit_from)

if TYPE_CHECKING:  # pragma: no cover
    from .card import AdminHandler

BASE_FEATURES = (1 << V.F_VERSION_1 | 1 << V.F_ACCESS_PLATFORM
                 | 1 << va1.F_FP16 | 1 << va1.F_INT8 | 1 << va1.F_TIMESTAMP)
OFFERED_FEATURES = BASE_FEATURES | DEFAULT_VIRTIO_FEATURES
"""What a function built with the default Va1Config offers."""
ALL_FEATURES = BASE_FEATURES | RING_FEATURES | TRANSPORT_FEATURES
"""Everything a function can be built to offer (PF-only bits aside)."""
PF_ONLY_FEATURES = 1 << V.F_SR_IOV | 1 << V.F_ADMIN_VQ
ADMIN_QUEUE_SIZE_MAX = 64
ADMIN_CMD_MAX = 4096            # readable bytes of one admin command

_NO_FAULT = frozenset({Status.OK, Status.ABORTED, Status.BAD_CONTEXT, Status.CONTEXT_FAULTED})
_SUBMIT_REQ_SIZE = va1.SUBMIT_REQ.size
_SUBMIT_RESP_SIZE = va1.SUBMIT_RESP.size
_U64 = 1 << 64
_new_tuple = tuple.__new__


@dataclass
class Context:
    id: int
    faulted: bool = False
    flat: bool = False
    aspace: AddressSpace = field(default_factory=AddressSpace)
    resolved: ResolveCache = field(default_factory=ResolveCache)
    # The DecodeEnv of its submissions, made at the first one (_env).
    env: DecodeEnv | None = field(default=None, repr=False, compare=False)


class Va1Device(VirtioDevice):
    """One VA-1 function (the single-function mmio device, later a PF or VF)."""

    def __init__(self, config: Va1Config, ports: DevicePorts, *,
                 memory: DeviceMemory | None = None, scheduler: Scheduler | None = None,
                 function_index: int = 0, admin: "AdminHandler | None" = None) -> None:
        """A single-function device by default (its own memory of
        `config.device_memory_size` bytes and its own `num_compute_units` engines). On a
        card (card.py) the function gets its partition of the card memory, the card's
        scheduler, its function number (0 PF, n VF n) and, on the PF, the admin handler
        (which adds the admin virtqueue after the other queues)."""
        self.config = config
        self.ports = ports
        self.dma = ports.dma
        self.clock = ports.clock
        self.tracer = ports.tracer
        self.memory = memory if memory is not None else DeviceMemory(config.device_memory_size)
        self.metrics = Metrics()
        self.admin = admin
        self._config_bytes = config.pack()
        self._generation = 0
        self.num_queues = va1.FIRST_SUBMITQ + config.num_submit_queues
        self.submitqs = list(range(va1.FIRST_SUBMITQ, self.num_queues))
        self.processor = CommandProcessor(
            self.submitqs, config.num_compute_units, self.dma, self.clock, self.tracer,
            self.metrics, self._prepare, self._complete_submission, scheduler=scheduler,
            function_index=function_index)
        self.processor.on_failure = self._internal_failure
        self.function_index = function_index
        self.admin_queue_index: int | None = self.num_queues if admin is not None else None
        self.acked_features = 0
        self.queues: list[DeviceRing] = []
        self.interrupt: VirtioInterrupt | None = None
        self.contexts: dict[int, Context] = {}
        self.active = False
        self.broken = False
        self.bus_master = True
        self._held: list[Callable[[], None]] = []
        self._busy: dict[int, int] = {}   # controlq/adminq: requests taken, not answered
        # Submissions' requests, command buffers and responses go through port views
        # when the port offers them (ring.DmaWindow); control and admin traffic does not.
        self._win = DmaWindow()
        self.fault_port = FaultPort(self)
        self.migration_port = MigrationPort(self)

    # --- VirtioDevice ----------------------------------------------------------------

    @property
    def device_id(self) -> int:
        return va1.VIRTIO_DEVICE_ID

    @property
    def vendor_id(self) -> int:
        return va1.MMIO_VENDOR_ID

    def avail_features(self) -> int:
        return (BASE_FEATURES | self.config.virtio_features
                | (PF_ONLY_FEATURES if self.admin is not None else 0))

    def ack_features(self, features: int) -> None:
        self.acked_features = features & self.avail_features()

    def queue_max_sizes(self) -> Sequence[int]:
        sizes = [self.config.queue_size_max] * self.num_queues
        if self.admin is not None:
            sizes.append(ADMIN_QUEUE_SIZE_MAX)
        return sizes

    def reconfigure(self, config: Va1Config, memory: DeviceMemory) -> None:
        """New resources (a VF provisioned by its PF while no driver is live): queue
        count, memory partition, contexts. Only between resets."""
        self.reset()
        self.config = config
        self.memory = memory
        packed = config.pack()
        if packed != self._config_bytes:
            self._generation += 1
        self._config_bytes = packed
        self.num_queues = va1.FIRST_SUBMITQ + config.num_submit_queues
        self.submitqs = list(range(va1.FIRST_SUBMITQ, self.num_queues))
        self.processor.set_queues(self.submitqs)

    def read_config(self, offset: int, length: int) -> bytes:
        if offset < 0 or length < 0:
            return b""
        return self._config_bytes[offset:offset + length].ljust(length, b"\0")

    @property
    def config_generation(self) -> int:
        """Bumped whenever the device configuration changes (a re-provisioning), so a
        driver reading it field by field can tell a torn read (virtio 1.x §2.5)."""
        return self._generation

    def activate(self, queues: Sequence[DeviceRing], interrupt: VirtioInterrupt) -> None:
        self.queues = list(queues)
        self.migration_port.apply(self.queues)
        self.interrupt = interrupt
        self.active = True
        self.broken = False
        self.tracer.emit("activate", features=self.acked_features)

    def notify_data(self, queue_index: int, next_off: int, next_wrap: int) -> None:
        """NOTIFICATION_DATA: the ring checks the claim before anything is taken."""
        self._notified(queue_index, (next_off, next_wrap))

    def _notified(self, queue_index: int, data: tuple[int, int] | None = None) -> None:
        """A notification of `queue_index`; `data`: NOTIFICATION_DATA's (next_off,
        next_wrap)."""
        if not self.active or self.broken or not 0 <= queue_index < len(self.queues):
            return
        if self.migration_port.suspended:
            return  # spec §15: nothing new is taken; resume() looks again
        if not self.queues[queue_index].ready:
            return
        try:
            if data is not None:
                self.queues[queue_index].check_notification(self.dma, *data)
            if queue_index == self.admin_queue_index:
                if self._has(V.F_ADMIN_VQ):
                    self._drain_adminq(queue_index)
            elif queue_index == va1.CONTROLQ:
                self._drain_controlq()
            elif queue_index == va1.EVENTQ:
                self.queues[queue_index].pending(self.dma)  # checks avail.idx only
            else:
                self._drain_submitq(queue_index)
        except RingError as e:
            self._break(e)
        except Exception as e:  # never into the guest's MMIO write
            self.processor.failed(e)

    notify = _notified   # VirtioDevice.notify(queue_index), without a call in between

    def reset_queue(self, queue_index: int) -> bool:
        """RING_RESET (spec §4.7): the queue's work is dropped, never answered (the driver
        completes it itself); the other queues go on. Refused with NEEDS_RESET: a queue
        that is not enabled (queue/reset-not-enabled), the controlq or the admin queue
        with requests in flight (queue/reset-busy)."""
        if not self._live() or not 0 <= queue_index < len(self.queues):
            return False
        ring = self.queues[queue_index]
        if not ring.ready:
            self._break(RingError("queue/reset-not-enabled",
                                  f"queue {queue_index} reset while not enabled"))
            return False
        if self._busy.get(queue_index):
            self._break(RingError("queue/reset-busy",
                                  f"queue {queue_index} reset with {self._busy[queue_index]} "
                                  "requests in flight"))
            return False
        if queue_index in self.submitqs:
            dropped = self.processor.drop_queue(queue_index)
            self.tracer.emit("queue_dropped", queue=queue_index, submissions=dropped)
        self.queues[queue_index] = _Disabled()
        return True

    def enable_queue(self, queue_index: int, ring: DeviceRing) -> None:
        if self.active and 0 <= queue_index < len(self.queues):
            self.queues[queue_index] = ring

    def set_bus_master(self, enabled: bool) -> None:
        """Off: the engines stop at their next command boundary (or before a host
        transfer) and every completion due meanwhile (its response, used entry, event
        and interrupt) is held. On again: the held completions go out in the order they
        were due, then the engines go on where they stopped."""
        if enabled == self.bus_master or (BREAKS and "pci/ignore-bus-master" in BREAKS):
            return
        self.bus_master = enabled
        if not enabled:
            self.processor.set_bus_master(False)
            return
        while self._held and self.bus_master:
            self._held.pop(0)()
        if self.bus_master:
            self.processor.set_bus_master(True)

    def _when_bus_master(self, what: str, work: Callable[[], None]) -> None:
        """Run `work` (which DMAs) now, or when Bus Master is set again."""
        if self.bus_master:
            work()
            return
        self._held.append(work)
        self.tracer.emit("dma_held", what=what)

    def reset(self) -> None:
        self._held.clear()
        if self.admin is not None:
            self.admin.pf_reset()
        if not (BREAKS and "reset/keep-pending-work" in BREAKS):
            self.processor.reset()
        self.metrics.reset()
        self.migration_port.forget()
        self.contexts.clear()
        self._busy.clear()
        self.queues = []
        self.interrupt = None
        self.active = False
        self.broken = False
        self.acked_features = 0

    # --- helpers ---------------------------------------------------------------------

    def _live(self) -> bool:
        """False once reset or broken (an interrupt handler may reset us re-entrantly)."""
        return self.active and not self.broken

    def _has(self, feature: int) -> bool:
        return bool(self.acked_features >> feature & 1)

    def _break(self, e: RingError) -> None:
        """A broken ring stops every queue of the function until reset."""
        if not self.active:
            return  # reset meanwhile: nothing left to stop
        self.broken = True
        self.processor.reset()
        self.tracer.emit("ring_broken", rule=e.rule, message=e.message)
        if self.interrupt is not None:
            self.interrupt.needs_reset(e.rule, e.message)

    def _internal_failure(self, exc: Exception) -> None:
        """The processor failed outside any one command (a device bug): like a broken
        ring, this function stops until reset; the others are not touched."""
        self._internal_error(f"device failure: {type(exc).__name__}")

    def _internal_error(self, message: str) -> bool:
        """DEVICE_NEEDS_RESET for an error the device found in itself (rule
        `device/internal`); the caller drops its work. False when the function is not
        live (reset, or before DRIVER_OK): nothing to stop."""
        if not self.active:
            return False
        self.broken = True
        rule = "device/internal"
        self.tracer.emit("ring_broken", rule=rule, message=message)
        if self.interrupt is not None:
            self.interrupt.needs_reset(rule, message)
        return True

    def _return_chain(self, qi: int, chain: DescriptorChain, reply: bytes,
                      win: DmaWindow | None = None) -> None:
        """Write the reply (through `win` when it covers it), push the used entry and
        interrupt if the driver wants it; nothing for a chain of a ring that a
        RING_RESET replaced since."""
        q = self.queues[qi]
        if chain.ring is not None and chain.ring is not q:
            self.tracer.emit("stale_completion", queue=qi, head=chain.head)
            return
        try:
            n = chain.write(self.dma, reply, win)
        except DmaFault as e:
            raise RingError("ring/dma", f"reply buffer: {e}") from None
        self._used(q, qi, chain.head, n)

    def _used(self, q: DeviceRing, qi: int, head: int, written: int) -> None:
        """Chain `head` of queue qi goes back with `written` bytes; interrupt the driver
        if it wants it."""
        if q.push_used_interrupt(self.dma, head, written) and self.interrupt is not None:
            self.interrupt.signal_used(qi)

    # --- controlq --------------------------------------------------------------------

    def _drain_controlq(self) -> None:
        q = self.queues[va1.CONTROLQ]
        while self._live() and (chain := q.pop(self.dma)) is not None:
            try:
                raw = chain.read(self.dma, va1.CTX_MAP_REQ.size)
            except DmaFault as e:
                raise RingError("ring/dma", f"controlq request: {e}") from None
            self._busy[va1.CONTROLQ] = self._busy.get(va1.CONTROLQ, 0) + 1
            self.processor.schedule(self.config.cmd_overhead_ns,
                                    self._ctrl_callback(chain, raw), "va1-ctrl")

    def _ctrl_callback(self, chain: DescriptorChain, raw: bytes) -> Callable[[], None]:
        def complete() -> None:
            try:
                self._ctrl_complete(chain, raw)
            except RingError as e:
                self._break(e)

        def run() -> None:
            self._when_bus_master("ctrl", complete)
        return run

    def _ctrl_complete(self, chain: DescriptorChain, raw: bytes) -> None:
        if not self._live():
            return
        self._busy[va1.CONTROLQ] -= 1
        reply = self._ctrl_execute(chain, raw)
        self._return_chain(va1.CONTROLQ, chain, reply)

    def _ctrl_execute(self, chain: DescriptorChain, raw: bytes) -> bytes:
        wlen = chain.writable_len
        if len(raw) < va1.CTRL_REQ.size:
            return bad_request_reply(wlen)
        req = CtrlRequest.unpack(raw)
        if req.type not in CtrlType.__members__.values():
            if wlen >= va1.CTRL_RESP.size:
                return pack_ctrl_resp(Status.BAD_ARG, req.context_id)
            return bad_request_reply(wlen)
        if wlen < ctrl_response_size(req.type):
            return bad_request_reply(wlen)
        if req.type in (CtrlType.CONTEXT_MAP, CtrlType.CONTEXT_UNMAP):
            return self._ctx_map(req.type, raw)
        allowed = va1.CTX_CREATE_FLAGS_ALL if req.type == CtrlType.CONTEXT_CREATE else 0
        if req.flags & ~allowed or req.reserved:
            status = Status.BAD_REQUEST
            if req.type == CtrlType.GET_STATS:
                return pack_stats_resp(status, 0, 0, 0, 0, 0)
            return pack_ctrl_resp(status, req.context_id)
        if req.type == CtrlType.CONTEXT_CREATE:
            status, cid = self._context_create(bool(req.flags & va1.CTX_CREATE_FLAT))
            self.tracer.emit("ctrl", type="CONTEXT_CREATE", context=cid, status=status.name)
            return pack_ctrl_resp(status, cid)
        if req.type == CtrlType.CONTEXT_DESTROY:
            status = self._context_destroy(req.context_id)
            self.tracer.emit("ctrl", type="CONTEXT_DESTROY", context=req.context_id,
                             status=status.name)
            return pack_ctrl_resp(status, req.context_id)
        m = self.metrics
        self.tracer.emit("ctrl", type="GET_STATS", context=0, status="OK")
        return pack_stats_resp(Status.OK, m.submissions, m.commands, m.device_time_ns,
                               m.dma_bytes, m.faults)

    def _context_create(self, flat: bool = False) -> tuple[Status, int]:
        if len(self.contexts) >= self.config.max_contexts:
            return Status.NO_RESOURCES, 0
        cid = 1
        while cid in self.contexts:
            cid += 1
        self.contexts[cid] = Context(cid, flat=flat)
        return Status.OK, cid

    def _ctx_map(self, type_: int, raw: bytes) -> bytes:
        """CONTEXT_MAP / CONTEXT_UNMAP (va1_ctx_map_req, 40 bytes)."""
        if len(raw) < va1.CTX_MAP_REQ.size:
            return pack_ctrl_resp(Status.BAD_REQUEST, 0)
        _, cid, flags, reserved, va, pa, size = struct.unpack(va1.CTX_MAP_REQ.format, raw)
        name = "CONTEXT_MAP" if type_ == CtrlType.CONTEXT_MAP else "CONTEXT_UNMAP"
        ctx = self.contexts.get(cid)
        if reserved or (type_ == CtrlType.CONTEXT_UNMAP and (flags or pa)):
            status = Status.BAD_REQUEST
        elif ctx is None:
            status = Status.BAD_CONTEXT
        elif ctx.flat:
            status = Status.BAD_ARG       # a FLAT context has no mappings to change
        elif type_ == CtrlType.CONTEXT_MAP:
            status = ctx.aspace.map(va, pa, size, flags, self.memory.size)
        else:
            status = ctx.aspace.unmap(va, size)
        self.tracer.emit("ctrl", type=name, context=cid, status=status.name)
        return pack_ctrl_resp(status, cid)

    def _context_destroy(self, cid: int) -> Status:
        if cid not in self.contexts:
            return Status.BAD_CONTEXT
        del self.contexts[cid]
        now = self.clock.now_ns()
        for sub in self.processor.take_queued(cid):
            sub.status, sub.error_offset = Status.ABORTED, NO_OFFSET
            sub.start_ns = sub.end_ns = now
            self.metrics.submissions += 1
            self.tracer.emit("submit_end", queue=sub.queue, context=cid,
                             fence=sub.req.fence_seq, status=sub.status.name,
                             error_offset=sub.error_offset, engine=-1, start_ns=now,
                             end_ns=now)
            self._complete_submission(sub)
            if not self._live():
                break
        return Status.OK

    # --- submit queues ---------------------------------------------------------------

    def _drain_submitq(self, qi: int) -> None:
        q = self.queues[qi]
        dma = self.dma
        # self._live() inlined: this loop runs for every submission
        while self.active and not self.broken and (chain := q.pop(dma)) is not None:
            if (chain.readable_len < _SUBMIT_REQ_SIZE
                    or chain.writable_len < _SUBMIT_RESP_SIZE):
                self.tracer.emit("bad_request", queue=qi, head=chain.head)
                self._return_chain(qi, chain, bad_request_reply(chain.writable_len))
                continue
            rd = chain.readable
            w = self._win
            if (len(rd) == 1 and dma is w.dma
                    and dma.view_epoch == w.epoch  # type: ignore[attr-defined]
                    and w.lo <= (addr := rd[0][0]) and addr + _SUBMIT_REQ_SIZE <= w.hi):
                # the usual request, one buffer inside the window: chain.read's own
                # window read, and unpacked in place
                req = _new_tuple(SubmitRequest, unpack_submit_from(w.mem, addr - w.lo))
            else:
                try:
                    raw = chain.read(dma, _SUBMIT_REQ_SIZE, w)
                except DmaFault as e:
                    raise RingError("ring/dma", f"submit request: {e}") from None
                req = SubmitRequest.unpack(raw)
            sub = Submission(qi, chain, req)
            # The ring known empty (the pop that would find so is skipped) and the
            # function idle: the processor starts it as enqueue + dispatch would.
            if q.drained and self.processor.start_alone(sub):
                return
            self.processor.enqueue(sub)
        if self.active and not self.broken:
            self.processor.sched.dispatch()  # type: ignore[union-attr]

    def _prepare(self, sub: Submission) -> tuple[Status, int, list[Command]]:
        """Submission checks in spec order, then the whole command buffer."""
        cid, flags, addr, n, reserved, _ = sub.req
        ctx = self.contexts.get(cid)
        if ctx is None:
            return Status.BAD_CONTEXT, NO_OFFSET, []
        if ctx.faulted:
            return Status.CONTEXT_FAULTED, NO_OFFSET, []
        if flags or reserved:
            return Status.BAD_REQUEST, NO_OFFSET, []
        if n == 0 or n % 8:
            return Status.BAD_REQUEST, NO_OFFSET, []
        if n > self.config.max_cmdbuf_size:
            return Status.CMDBUF_TOO_LARGE, NO_OFFSET, []
        if addr + n > _U64:
            return Status.DMA_FAULT, NO_OFFSET, []
        dma = self.dma
        w = self._win
        if (dma is w.dma and dma.view_epoch == w.epoch  # type: ignore[attr-defined]
                and w.lo <= addr and addr + n <= w.hi or w.cover(dma, addr, n)):
            off = addr - w.lo
            buf = w.mem[off:off + n].tobytes()
        else:
            try:
                buf = dma.read(addr, n)
            except DmaFault:
                return Status.DMA_FAULT, NO_OFFSET, []
        try:
            return Status.OK, NO_OFFSET, decode(buf, ctx.env or self._env(ctx))
        except CommandError as e:
            self.tracer.emit("cmd_invalid", queue=sub.queue, offset=e.offset,
                             status=e.status.name, message=e.message)
            return e.status, e.offset, []

    def _env(self, ctx: Context) -> DecodeEnv:
        """The decode environment of `ctx`'s submissions, made at its first one and kept
        in it for good: nothing it holds changes while the context lives (features are
        accepted only at FEATURES_OK and a reset or a reconfigure drops every context;
        the context's address space and resolve cache are its own; a migration load makes
        contexts without one)."""
        acked = self.acked_features
        env = ctx.env = DecodeEnv(
            self.config, self.memory, self.dma, bool(acked >> va1.F_FP16 & 1),
            bool(acked >> va1.F_TIMESTAMP & 1), int8=bool(acked >> va1.F_INT8 & 1),
            aspace=None if ctx.flat else ctx.aspace, cache=ctx.resolved)
        return env

    def _complete_submission(self, sub: Submission) -> None:
        """At end_ns (or when Bus Master is set again): response, used entry,
        interrupt; a fault marks the context."""
        if not self.bus_master:
            self._when_bus_master("submit", lambda: self._complete_submission(sub))
            return
        if not self.active or self.broken:   # self._live()
            return
        try:
            chain = sub.chain
            qi = sub.queue
            q = self.queues[qi]
            wr = chain.writable
            w = self._win
            dma = self.dma
            if (chain.ring is q and len(wr) == 1 and wr[0][1] >= _SUBMIT_RESP_SIZE
                    and dma is w.dma
                    and dma.view_epoch == w.epoch  # type: ignore[attr-defined]
                    and w.lo <= (addr := wr[0][0]) and addr + _SUBMIT_RESP_SIZE <= w.hi):
                # the usual reply (a chain that is not stale, one buffer that holds it
                # inside the window): packed in place instead of chain.write's copy
                pack_submit_resp_into(w.mem, addr - w.lo, sub.status, sub.error_offset,
                                      sub.req.fence_seq, sub.start_ns, sub.end_ns)
                self._used(q, qi, chain.head, _SUBMIT_RESP_SIZE)
            else:
                reply = pack_submit_resp(sub.status, sub.error_offset, sub.req.fence_seq,
                                         sub.start_ns, sub.end_ns)
                self._return_chain(qi, chain, reply, w)
            if sub.status not in _NO_FAULT and not (BREAKS and "ctx/no-fault-on-error" in BREAKS):
                ctx = self.contexts.get(sub.req.context_id)
                if ctx is not None and not ctx.faulted:
                    ctx.faulted = True
                    self.metrics.faults += 1
                    self.tracer.emit("context_fault", context=ctx.id, status=sub.status.name,
                                     error_offset=sub.error_offset)
                    self._post_event(pack_event(EventType.CONTEXT_FAULT, ctx.id,
                                                sub.req.fence_seq, sub.status,
                                                sub.error_offset))
        except RingError as e:
            self._break(e)

    # --- admin virtqueue (PF only) ----------------------------------------------------

    def _drain_adminq(self, qi: int) -> None:
        q = self.queues[qi]
        while self._live() and (chain := q.pop(self.dma)) is not None:
            try:
                raw = chain.read(self.dma, ADMIN_CMD_MAX)
            except DmaFault as e:
                raise RingError("ring/dma", f"admin command: {e}") from None
            self._busy[qi] = self._busy.get(qi, 0) + 1
            self.processor.schedule(self.config.cmd_overhead_ns,
                                    self._admin_callback(qi, chain, raw), "va1-admin")

    def _admin_callback(self, qi: int, chain: DescriptorChain,
                        raw: bytes) -> Callable[[], None]:
        def complete() -> None:
            try:
                if not self._live() or self.admin is None:
                    return
                self._busy[qi] -= 1
                reply = self.admin.admin_command(raw, chain.writable_len)
                self._return_chain(qi, chain, reply)
            except RingError as e:
                self._break(e)

        def run() -> None:
            self._when_bus_master("admin", complete)
        return run

    # --- eventq ----------------------------------------------------------------------

    def _post_event(self, event: bytes) -> None:
        if not self._live() or not self.queues[va1.EVENTQ].ready:
            self.tracer.emit("event_dropped", reason="eventq not ready")
            return
        q = self.queues[va1.EVENTQ]
        chain = q.pop(self.dma)
        if chain is None:
            self.tracer.emit("event_dropped", reason="no buffer")
            return
        if chain.readable or chain.writable_len < len(event):
            self.tracer.emit("event_dropped", reason="bad buffer")
            self._return_chain(va1.EVENTQ, chain, b"")
            return
        self._return_chain(va1.EVENTQ, chain, event)
        self.tracer.emit("event", type="CONTEXT_FAULT")


class _Disabled:
    """The ring of a queue reset by RING_RESET until it is enabled again: not ready,
    nothing to take (DeviceRing)."""

    ready = False
    drained = False

    def pending(self, dma: object) -> int:
        return 0

    def pop(self, dma: object) -> DescriptorChain | None:
        return None

    def push_used(self, dma: object, head: int, length: int) -> None:
        return None

    def needs_interrupt(self, dma: object) -> bool:
        return False

    def push_used_interrupt(self, dma: object, head: int, length: int) -> bool:
        return False

    def check_notification(self, dma: object, next_off: int, next_wrap: int) -> None:
        return None


class FaultPort:
    """The function's test port for a platform's fault injection (spec §14): internal
    failures of the device a platform can ask for, so the device and its driver are
    exercised through their real paths. Never used by a driver; unused, it costs
    nothing and changes nothing."""

    def __init__(self, device: Va1Device) -> None:
        self._device = device

    @property
    def live(self) -> bool:
        """Whether the function runs (DRIVER_OK, not reset, not already NEEDS_RESET)."""
        return self._device.active and not self._device.broken

    def hang_next_command(self) -> None:
        """The next command that starts on this function (before its next reset) does
        not finish: it ends at the preemption timeout, which fails its submission
        TIMEOUT and faults its context (with the timeout off, it holds its compute unit
        until the function is reset)."""
        self._device.processor.hang_pending += 1

    def internal_error(self, message: str) -> bool:
        """The device found an internal error in this function: DEVICE_NEEDS_RESET with
        a configuration-change interrupt, rule `device/internal`, its work dropped. False
        (nothing done) when the function is not live."""
        d = self._device
        if not self.live:
            return False
        d.processor.reset()
        return d._internal_error(message)
