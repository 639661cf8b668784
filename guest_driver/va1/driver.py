"""The VA-1 driver for one function over any virtio transport (datasheet §2-§8).

The driver talks to its function only through `VirtioTransport` (virtio-mmio or
virtio-pci), so bring-up, fences, recovery and the device file are the same on both.

Queues: controlq (0), eventq (1), submitq[i] (2+i). Requests live in per-queue slots in
guest RAM; the ring token of a request is the driver object that waits for it. The IRQ
handler reaps every used ring and completes fences; it never waits. A broken device
(DEVICE_NEEDS_RESET, a bad used entry, a stuck control request) is reset and
re-initialised from the handler or the task that noticed it: every in-flight fence is
signalled ABORTED exactly once, every context of the old instance is lost, and new
contexts work.

Context address spaces: contexts are created private (no CTX_CREATE_FLAT); the device
file maps each of its buffers into each of its contexts (`ctx_map` / `ctx_unmap`). A
device that answers CONTEXT_MAP with BAD_ARG (it predates address spaces) makes the
driver fall back to flat contexts for the rest of its life (`address_spaces` False).

On a PF (`admin=True`, a PCI function with an SR-IOV capability) the driver also accepts
VIRTIO_F_SR_IOV and VIRTIO_F_ADMIN_VQ and runs the admin virtqueue (`self.admin`);
everywhere else it never accepts them.
"""
from __future__ import annotations

import errno
import struct
import sys
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence, Union

from hwspec import isa
from hwspec import va1 as A
from hwspec import virtio as V
from hwspec.layout import Layout

from ..errors import GuestDriverError
from ..params import DEFAULT_OPTIONAL, FEATURE_NAMES, OPTIONAL_FEATURES, DriverParams
from ..kernel import GuestKernel, KernelTimer, PlatformDevice, guest_state, plain_emitter
from ..mm import AllocError, PageAllocator
from ..pci import PciError
from ..virtio.admin import ADMIN_QUEUE_SIZE, AdminError, AdminQueue
from ..virtio.mmio import VirtioMmio
from ..virtio.pci import VirtioPci
from ..virtio.transport import ProbeError, TransportError, VirtioTransport
from ..virtio.ring import DriverRing, RingError
from ..virtio.ring_factory import RING_FEATURES, make_driver_ring, ring_features
from .devmem import DeviceMemory
from .fence import Fence, FenceTimeline

WANTED_FEATURES = ((1 << V.F_VERSION_1) | (1 << V.F_ACCESS_PLATFORM) | DEFAULT_OPTIONAL
                   | (1 << A.F_FP16) | (1 << A.F_INT8) | (1 << A.F_TIMESTAMP))
REQUIRED_FEATURES = 1 << V.F_VERSION_1
PF_FEATURES = (1 << V.F_SR_IOV) | (1 << V.F_ADMIN_VQ)  # only ever accepted on a PF
CTX_CREATE_FLAT = A.CTX_CREATE_FLAT
CTX_MAP_RW = A.CTX_MAP_READ | A.CTX_MAP_WRITE
CTRL_REQ_MAX = max(A.CTRL_REQ.size, A.CTX_MAP_REQ.size)   # request part of a ctrl slot
CTRL_RESP_MAX = max(A.CTRL_RESP.size, A.STATS_RESP.size)
CTRL_QUEUE_SIZE = 64
EVENT_QUEUE_SIZE = 64
SUBMIT_QUEUE_SIZE = A.DEFAULT_QUEUE_SIZE_MAX
CTRL_TIMEOUT_NS = 1_000_000_000  # a control request completes in cmd_overhead_ns
MAX_SUBMIT_QUEUES = 64
# STOPPED (the PF stopped this function while the submission was queued) is not the
# context's fault: it does not mark it faulted here (a CONTEXT_FAULT event would).
FAULT_STATUSES = frozenset(s for s in A.Status if s not in (
    A.Status.OK, A.Status.ABORTED, A.Status.BAD_CONTEXT, A.Status.CONTEXT_FAULTED,
    A.Status.STOPPED))


class VA1Error(GuestDriverError, OSError):
    """An errno-style driver error; the message names what was wrong."""

    def __init__(self, err: int, msg: str) -> None:
        super().__init__(err, msg)


def _unpack(layout: Layout, data: bytes) -> dict[str, int]:
    return dict(zip(layout.names, struct.unpack(layout.format, data[:layout.size])))


_SUBMIT_REQ = struct.Struct(A.SUBMIT_REQ.format)
_SUBMIT_RESP = struct.Struct(A.SUBMIT_RESP.format)
_SUBMIT_REQ_SEGS = A.SUBMIT_REQ.size, A.SUBMIT_RESP.size
_U32_AT = struct.Struct("<I").unpack_from
_LITTLE_ENDIAN = sys.byteorder == "little"


def _pack(layout: Layout, **values: int) -> bytes:
    return struct.pack(layout.format, *(values.get(n, 0) for n in layout.names))


def _pow2_floor(n: int) -> int:
    return 1 << (n.bit_length() - 1) if n > 0 else 0


@dataclass
class Context:
    """A device context as the driver knows it."""
    uid: int                 # uAPI id, unique for this device's lifetime
    device_id: int           # id the device assigned (reused after destroy/reset)
    generation: int          # device instance it lives on
    timeline: FenceTimeline
    faulted: bool = False
    fault_status: int = 0
    lost: bool = False       # device reset since creation
    destroyed: bool = False
    flat: bool = False       # created FLAT (or on a device without address spaces)
    mappings: dict[int, int] = field(default_factory=dict)  # va -> size (CONTEXT_MAP)


@dataclass
class _CtrlRequest:
    slot: int
    done: bool = False
    aborted: bool = False
    status: int = 0
    resp: bytes = b""


class _Submission:
    """A submission in flight (the ring's token): made on every submission, so a
    slotted class built from positional arguments."""

    __slots__ = ("slot", "ctx", "fence")

    def __init__(self, slot: int, ctx: Context, fence: Fence) -> None:
        self.slot = slot
        self.ctx = ctx
        self.fence = fence


@dataclass
class _EventBuf:
    slot: int


_Token = Union[_CtrlRequest, _Submission, _EventBuf]


@dataclass
class _Queue:
    index: int
    ring: DriverRing[_Token]
    slot_base: int
    slot_size: int
    free_slots: list[int] = field(default_factory=list)
    outstanding: int = 0     # requests in flight (submissions, control requests)
    progress_ns: int = 0     # while outstanding: last completion, or when it became busy
    reaps: int = 0           # reaps that found used buffers
    suspect: int = -1        # `reaps` when used buffers were first seen unreaped
    descs: int = 2           # descriptors a two-segment request takes on this ring
    notify_data: bool = False   # the ring was built for NOTIFICATION_DATA
    slots: memoryview = memoryview(b"")       # the slots' memory, bytes from slot_base

    def __post_init__(self) -> None:
        self.descs = self.ring.descs_needed(2)
        self.notify_data = bool(self.ring.features >> V.F_NOTIFICATION_DATA & 1)

    def reset_slots(self) -> None:
        self.free_slots = list(range(self.ring.num - 1, -1, -1))

    def slot_addr(self, slot: int) -> int:
        return self.slot_base + slot * self.slot_size


# A queue as the interrupt handler looks at it: (queue, its ring, the ring's used index
# as a u16 memoryview and that index's position in it), or (queue, ring, None, 0) for
# a ring to ask `has_used()` (see `_used_look`).
_Look = tuple[_Queue, DriverRing[_Token], Optional[memoryview], int]


def _used_look(q: _Queue) -> _Look:
    """How the interrupt handler reads q's used index: a split ring's `used_view` cast
    to native u16 (the ring's own little-endian u16 on a little-endian host), indexed
    in C without a struct call; a packed ring (no `used_view`) or a big-endian host is
    asked `has_used()`. Made when the queues are set up: a ring's `used_view` is fixed
    for its life."""
    ring = q.ring
    view = ring.used_view
    if view is None or not _LITTLE_ENDIAN:
        return q, ring, None, 0
    return q, ring, view.cast("H"), ring.used_off >> 1


class VA1Device:
    """One bound VA-1 function."""

    def __init__(self, kernel: GuestKernel, dev: PlatformDevice | VirtioTransport,
                 alloc: PageAllocator, name: str, admin: bool = False, *,
                 params: DriverParams | None = None, poll_ns: int | None = None,
                 watchdog_ns: int | None = None, optional: int | None = None) -> None:
        """`dev` is a virtio-mmio platform device or any ready-made transport. `admin`:
        this is an SR-IOV PF (virtio-pci only): accept SR_IOV and ADMIN_VQ if offered.
        `params`: what the driver was loaded with (the kernel command line's); `poll_ns`,
        `watchdog_ns` override its recovery timer's period and submission watchdog's
        bound (virtual ns, > 0), `optional` the optional features (OPTIONAL_FEATURES
        bits) it may accept."""
        params = params or DriverParams()
        poll_ns = params.poll_ns if poll_ns is None else poll_ns
        watchdog_ns = params.watchdog_ns if watchdog_ns is None else watchdog_ns
        optional = params.optional if optional is None else optional
        self.breaks = params.breaks
        if poll_ns <= 0 or watchdog_ns <= 0:
            raise ValueError(f"poll_ns ({poll_ns}) and watchdog_ns ({watchdog_ns}) must "
                             "be > 0")
        if optional is not None and optional & ~OPTIONAL_FEATURES:
            raise ValueError(f"optional features {optional:#x}: bits "
                             f"{optional & ~OPTIONAL_FEATURES:#x} are not optional features "
                             "this driver can use")
        self.optional = optional
        self.kernel = kernel
        self.pdev: PlatformDevice | None = None
        self.transport: VirtioTransport
        if isinstance(dev, PlatformDevice):
            self.pdev = dev
            self.transport = VirtioMmio(kernel.mmio, dev.base, kernel.irq, dev.irq)
        else:
            self.transport = dev
        self.alloc = alloc
        self.name = name
        # the events of every submission (kick, wait, reap) carry the name, queue
        # indexes the driver numbered and ints it counted or tested
        self._emit_plain = plain_emitter(kernel.trace, name)
        self.features = 0
        self.config: dict[str, int] = {}
        self.generation = 0
        self.dead: str | None = None
        self.ready = False
        self.devmem: DeviceMemory | None = None
        self.interrupts = 0
        self.resets = 0
        self._queues: list[_Queue] = []
        self._look: tuple[_Look, ...] = ()   # _queues' (see _used_look), while set up
        self._contexts: dict[int, Context] = {}  # device_id -> live context (this generation)
        self._next_uid = 1
        self._in_irq = False
        self._irq_again: list[tuple[bool, Optional[Sequence[int]]]] = []
        self._recovering = False
        self.want_admin = admin and isinstance(self.transport, VirtioPci)
        self.admin: AdminQueue | None = None
        self.admin_opcodes: frozenset[int] = frozenset()  # opcodes the owner wants in use
        # Context address spaces: None = not known yet, True = CONTEXT_MAP works,
        # False = the device has none (old device): contexts are flat.
        self.ctx_as: bool | None = None
        self._flat_flag = CTX_CREATE_FLAT  # 0 once the device refused the flag
        self.deferred: list[Callable[[], None]] = []  # task-context work queued by IRQs
        # Device context ids destroyed while work of theirs may still complete: not
        # handed to anyone until every fence of the old context is signalled (a late
        # fault would otherwise mark the id's new owner faulted). id -> old context.
        self._quarantine: dict[int, Context] = {}
        self._held: dict[int, Context] = {}   # quarantined ids the device gave out again
        self._kctx: Context | None = None     # the driver's own (FLAT) context: scrubs
        # Recovery timer and its counters (GET_STATS' interrupts_lost, debug_stats).
        self.poll_ns = poll_ns
        self.poll_wait = params.poll_wait
        self.watchdog_ns = watchdog_ns
        self._start_timer = getattr(kernel.sched, "start_timer", None)
        self._watchdog_what = f"{name} watchdog"   # the timer's label
        self._fence_what = f"{name} fence"         # a fence wait's
        self._timer: KernelTimer | None = None
        self._outstanding = 0
        self._reaped = 0
        self.lost_interrupts = 0       # polls that found completions an interrupt lost
        self.polled_completions = 0    # completions those polls reaped
        self.watchdog_fires = 0        # submit queues that made no progress in time
        self.external_resets = 0       # resets the driver found done behind its back
        self.queue_resets = 0          # RING_RESET of one queue (watchdog or asked for)

    # ================================================================== bring-up
    def probe(self) -> None:
        """Bind: identify, initialise (interrupts included). Raises ProbeError on failure."""
        t = self.transport
        dev_id = t.probe()
        if dev_id != A.VIRTIO_DEVICE_ID:
            raise ProbeError(f"{self.name}: virtio device id {dev_id} is not VA-1 "
                             f"({A.VIRTIO_DEVICE_ID})")
        try:
            self._init_device()
        except (TransportError, AllocError, ValueError) as e:
            self._give_up()
            raise ProbeError(f"{self.name}: {e}") from e
        if self.devmem is None:
            self.devmem = DeviceMemory(self.config["device_memory_size"])

    def _give_up(self) -> None:
        """Stop the device's DMA (reset) before giving its rings back, then mark FAILED."""
        try:
            if self._queues:
                self.transport.reset()
            self.transport.fail()
        except Exception:  # noqa: BLE001 - best effort on a device we are abandoning
            pass
        self._release()
        self.ready = False

    def _release(self) -> None:
        """Give back the interrupts and the ring memory (the device is reset already)."""
        try:
            self.transport.free_interrupts()
        except Exception:  # noqa: BLE001 - best effort while unbinding
            pass
        for q in self._queues:
            q.ring.release()
            self.alloc.free(q.slot_base)
        self._queues = []
        self._look = ()
        if self.admin is not None:
            self.admin.release()
            self.admin = None

    def _init_device(self, reset: bool = True) -> None:
        """Reset (unless just done) and bring the device to DRIVER_OK (virtio 1.x §3.1.1)."""
        self.ready = False
        self._look = ()
        t = self.transport
        if reset:
            t.reset()
        t.add_status(V.STATUS_ACKNOWLEDGE)
        t.add_status(V.STATUS_DRIVER)
        wanted = ((WANTED_FEATURES & ~OPTIONAL_FEATURES) | self.optional
                  | (PF_FEATURES if self.want_admin else 0))
        self.features = t.negotiate(wanted, REQUIRED_FEATURES)
        cfg = t.read_config(A.CONFIG)
        nsq = cfg["num_submit_queues"]
        if not 1 <= nsq <= MAX_SUBMIT_QUEUES:
            raise TransportError(f"config num_submit_queues={nsq} out of 1..{MAX_SUBMIT_QUEUES}")
        if cfg["max_cmdbuf_size"] < 8:
            raise TransportError(f"config max_cmdbuf_size={cfg['max_cmdbuf_size']} < 8")
        if self.config and cfg["num_submit_queues"] != self.config["num_submit_queues"]:
            raise TransportError("num_submit_queues changed across a reset")
        self._set_config(cfg)
        rings = ring_features(self.features)
        plan = [(A.CONTROLQ, CTRL_QUEUE_SIZE, CTRL_REQ_MAX + CTRL_RESP_MAX),
                (A.EVENTQ, EVENT_QUEUE_SIZE, A.EVENT.size)]
        plan += [(A.FIRST_SUBMITQ + i, SUBMIT_QUEUE_SIZE, A.SUBMIT_REQ.size + A.SUBMIT_RESP.size)
                 for i in range(nsq)]
        if len(self._queues) != len(plan):
            for q in self._queues:
                q.ring.release()
                self.alloc.free(q.slot_base)
            self._queues = []
        admin_index = self._admin_index()
        irq_queues = [index for index, _, _ in plan]
        if admin_index is not None:
            irq_queues.append(admin_index)
        t.setup_interrupts(irq_queues, self._interrupt, self.name)
        for i, (index, cap, slot_size) in enumerate(plan):
            num_max = t.queue_num_max(index)
            if num_max == 0:
                raise TransportError(f"queue {index} does not exist (QueueNumMax 0)")
            num = min(_pow2_floor(num_max), cap)
            if i < len(self._queues):
                q = self._queues[i]
                if q.ring.num == num and q.ring.features == rings:
                    q.ring.reset()
                else:
                    q.ring.release()
                    self.alloc.free(q.slot_base)
                    self._queues[i] = self._new_queue(index, num, slot_size)
            else:
                self._queues.append(self._new_queue(index, num, slot_size))
            q = self._queues[i]
            q.reset_slots()
            t.setup_queue(index, num, q.ring.desc_addr, q.ring.driver_addr, q.ring.device_addr)
        self._look = tuple(_used_look(q) for q in self._queues)
        if admin_index is not None:
            self._setup_admin(admin_index)
        elif self.admin is not None:  # no longer negotiated after a reset
            self.admin.release()
            self.admin = None
        evq = self._queues[A.EVENTQ]
        for _ in range(evq.ring.num):
            self._post_event_buffer(evq)
        for q in self._queues:
            q.ring.enable_interrupts()
        t.add_status(V.STATUS_DRIVER_OK)
        self.ready = True
        if self.admin is not None:
            self.admin.ready = True
            self.admin.ring.enable_interrupts()
        self._kick(evq)

    # ================================================================== admin queue
    def _admin_index(self) -> int | None:
        """Index of the admin queue when ADMIN_VQ was negotiated (PF only)."""
        if not self.features >> V.F_ADMIN_VQ & 1:
            return None
        t = self.transport
        assert isinstance(t, VirtioPci)
        index, num = t.admin_queue_info()
        if num == 0:
            raise TransportError(f"{t.name}: VIRTIO_F_ADMIN_VQ negotiated but "
                                 "admin_queue_num is 0")
        t.set_admin_queues((index,))
        return index

    def _setup_admin(self, index: int) -> None:
        t = self.transport
        num_max = t.queue_num_max(index)
        if num_max == 0:
            raise TransportError(f"admin queue {index} does not exist (queue_size 0)")
        num = min(_pow2_floor(num_max), ADMIN_QUEUE_SIZE)
        aq = self.admin
        if (aq is None or aq.index != index or aq.ring.num != num
                or aq.ring.features != ring_features(self.features)):
            if aq is not None:
                aq.release()
            aq = AdminQueue(self.kernel, self.alloc, index, num, features=self.features,
                            name=self.name, notify=t.notify,
                            on_timeout=self.recover, check_alive=self.check_alive)
            aq.wanted = self.admin_opcodes
            self.admin = aq
        else:
            aq.reset()
        t.setup_queue(index, num, aq.ring.desc_addr, aq.ring.driver_addr,
                      aq.ring.device_addr)

    def admin_init(self, group_type: int, opcodes: frozenset[int]) -> frozenset[int]:
        """LIST_QUERY + LIST_USE on the admin queue (task context); again lazily after
        every reset. Returns the opcodes in use. Raises VA1Error."""
        self.admin_opcodes = opcodes
        aq = self._admin_queue()
        aq.group_type = group_type
        aq.wanted = opcodes
        try:
            return aq.init_group(group_type, opcodes)
        except AdminError as e:
            raise VA1Error(e.errno or errno.EIO, str(e)) from None

    def _admin_queue(self) -> AdminQueue:
        self.check_alive()
        if self.admin is None:
            raise VA1Error(errno.EOPNOTSUPP, f"{self.name}: no admin virtqueue "
                                             "(VIRTIO_F_ADMIN_VQ not negotiated)")
        return self.admin

    def admin_command(self, opcode: int, group_type: int, member: int, data: bytes = b"",
                      result_size: int = 0, what: str = "") -> tuple[int, int, bytes]:
        """One admin command, blocking: (status, qualifier, result). Raises VA1Error
        when it could not be carried out (no admin queue, reset, timeout)."""
        aq = self._admin_queue()
        try:
            return aq.command(opcode, group_type, member, data, result_size, what=what)
        except AdminError as e:
            raise VA1Error(e.errno or errno.EIO, str(e)) from None

    def _new_queue(self, index: int, num: int, slot_size: int) -> _Queue:
        ring: DriverRing[_Token] = make_driver_ring(self.features, self.kernel.memory,
                                                    self.alloc, index, num, max_indirect=2)
        try:
            slots = self.alloc.alloc_dma(num * slot_size)
        except AllocError:
            ring.release()
            raise
        q = _Queue(index, ring, slots, slot_size)
        q.slots = self.kernel.memory.view(slots, num * slot_size).data.cast("B")
        return q

    # ================================================================== helpers
    @property
    def num_submit_queues(self) -> int:
        return len(self._queues) - A.FIRST_SUBMITQ

    def _trace(self, kind: str, **fields: object) -> None:
        self.kernel.trace.emit(kind, dev=self.name, **fields)

    def _kick(self, q: _Queue) -> None:
        if q.ring.kick_prepare():
            self._notify(q)

    def _notify(self, q: _Queue) -> None:
        """The doorbell of q, once its ring said the device wants it (kick_prepare)."""
        self._emit_plain("kick", {"dev": self.name, "queue": q.index})
        # notification_data() is None without NOTIFICATION_DATA: not asked for then
        self.transport.notify(q.index, q.ring.notification_data() if q.notify_data else None)

    def _wait(self, cond: Callable[[], bool], timeout_ns: int | None, what: str,
              check_first: bool = True, label: str | None = None, **fields: object) -> bool:
        """Wait for cond (checked first unless the caller just did), traced as `what`;
        `label` names the waiting task (made once by callers on a hot path)."""
        if check_first and cond():
            return True
        self.kernel.trace.emit("wait", dev=self.name, what=what,
                               timeout_ns=-1 if timeout_ns is None else timeout_ns,
                               **fields)   # _trace
        return self.kernel.sched.wait_until(cond, timeout_ns,
                                            label or f"{self.name} {what}")

    def check_alive(self) -> None:
        if self.dead:
            raise VA1Error(errno.ENODEV, f"{self.name}: device is dead: {self.dead}")

    def _wait_for_space(self, q: _Queue, gen: int, what: str) -> None:
        need = q.descs

        def cond() -> bool:
            if self._polled(q) and self.generation == gen and self.ready \
                    and self.dead is None and q.ring.has_used():
                self._reap_polled(q)
            return (self.generation != gen or self.dead is not None
                    or (q.ring.num_free >= need and bool(q.free_slots)))
        # Polled (va1.poll_wait=1), the condition reaps the used ring, which the device
        # writes: then it reads more than guest state and must not be marked so.
        self._wait(cond if self._polled(q) else guest_state(cond), None, what, queue=q.index)

    # ================================================================== IRQ path
    def _interrupt(self, config: bool, queues: Optional[Sequence[int]]) -> None:
        """Interrupt handler, called by the transport: a config change may have happened
        and/or `queues` (None: any queue) may have used buffers. Never waits.

        A call that arrives while one runs (from our own MMIO) is queued and run after
        it, so an edge-triggered message (MSI-X) is never lost.
        """
        if self._in_irq:
            self._irq_again.append((config, queues))
            return
        self._in_irq = True
        try:
            self._handle_interrupt(config, queues)
            while self._irq_again:
                self._handle_interrupt(*self._irq_again.pop(0))
        finally:
            self._in_irq = False
            self._irq_again = []

    def _handle_interrupt(self, config: bool, queues: Optional[Sequence[int]]) -> None:
        self.interrupts += 1
        if not self.ready or self.dead:
            return
        if config:
            self._config_changed()
            if not self.ready:
                return
        if queues is None:
            self._reap_all()
            return
        gen = self.generation
        for index in queues:
            if self.generation != gen or not self.ready:
                return
            if 0 <= index < len(self._queues):
                self._reap(self._queues[index])
            elif self.admin is not None and index == self.admin.index:
                self._reap_admin()

    def _reap_admin(self) -> None:
        if self.admin is None:
            return
        broken = self.admin.reap()
        if broken:
            self._trace("ring_error", queue=self.admin.index, error=broken)
            self.recover(f"admin queue {self.admin.index}: {broken}")

    def _config_changed(self) -> None:
        status = self.transport.read_status()
        if status & V.STATUS_DEVICE_NEEDS_RESET:
            self.recover(f"device set DEVICE_NEEDS_RESET (status {status:#x})")
            return
        try:
            self._set_config(self.transport.read_config(A.CONFIG))
        except TransportError as e:
            self.recover(str(e))
            return
        self._trace("config_change", generation=self.transport.config_generation())

    def _set_config(self, cfg: dict[str, int]) -> None:
        """Take a (re-)read configuration; the device-memory allocator follows its size
        (a VF resized by its PF), so GET_PARAM and BO_CREATE always agree."""
        self.config = cfg
        size = cfg["device_memory_size"]
        if self.devmem is not None and self.devmem.size != size:
            self._trace("devmem_resize", old=self.devmem.size, new=size)
            self.devmem.resize(size)

    def _reap_all(self) -> None:
        """Reap every queue (one interrupt line says "used buffers", not which queue).
        A queue whose used ring has not moved since its last reap has nothing to reap,
        its interrupt is still enabled (no poll disabled it: polled queues are reaped
        whatever) and its eventq buffers are all kicked, so `_reap` would change nothing
        there: it is looked at and skipped."""
        if not self.ready:
            return
        gen = self.generation
        polled = self.poll_wait
        for q, ring, used, at in self._look:   # _queues, with where each publishes used.idx
            if (ring.broken
                    or (ring.has_used() if used is None   # else has_used(), inline
                        else used[at] != ring.last_used)
                    or (polled and q.index >= A.FIRST_SUBMITQ)):
                self._reap(q)   # only a reap can reset the device or make it not ready
                if self.generation != gen or not self.ready:
                    return
        if self.admin is not None:
            self._reap_admin()

    def _reap(self, q: _Queue) -> None:
        gen = self.generation
        while True:
            done = q.ring.get_used()
            if done:
                q.reaps += 1
                self._reaped += len(done)
                self._emit_plain("reap", {"dev": self.name, "queue": q.index,
                                          "count": len(done)})
                if not self._complete(q, done, gen):
                    return
            if q.ring.broken:
                self._trace("ring_error", queue=q.index, error=q.ring.broken)
                self.recover(f"queue {q.index}: {q.ring.broken}")
                return
            if self._polled(q):
                q.ring.disable_interrupts()
                if not q.ring.has_used():
                    break
            elif not q.ring.enable_interrupts():
                break
        if q.index == A.EVENTQ:
            self._kick(q)

    def _complete(self, q: _Queue, done: list[tuple[_Token, int]], gen: int) -> bool:
        """Complete the requests reaped from q, in order; False when one of them reset
        the device (generation `gen` is gone: the rest were aborted with it)."""
        for token, ulen in done:
            if not isinstance(token, _EventBuf):
                # a request of q completed: the recovery timer's bookkeeping
                if q.outstanding > 0:
                    q.outstanding -= 1
                    self._outstanding -= 1
                if q.outstanding:   # progress of an idle queue is never looked at
                    q.progress_ns = self.kernel.sched.now_ns()
                if self._outstanding == 0:
                    self._cancel_timer()
            if isinstance(token, _Submission):
                # the response, read through the slots' view, then the fence
                q.free_slots.append(token.slot)
                off = token.slot * q.slot_size + A.SUBMIT_REQ.size   # slot_addr
                tl = token.ctx.timeline
                fence = token.fence
                if ulen >= _SUBMIT_RESP.size:
                    status, error_offset, fence_seq, start_ns, end_ns = \
                        _SUBMIT_RESP.unpack_from(q.slots, off)
                    if fence_seq != fence.seq:
                        tl.signal(fence, A.Status.ABORTED)
                        self.recover(f"queue {q.index}: response fence_seq {fence_seq} for "
                                     f"a request with fence_seq {fence.seq}")
                    else:
                        if status in FAULT_STATUSES and not token.ctx.faulted:
                            token.ctx.faulted = True
                            token.ctx.fault_status = status
                        tl.signal(fence, status, error_offset, start_ns, end_ns)
                else:
                    status = (_U32_AT(q.slots, off)[0] if ulen >= 4
                              else int(A.Status.BAD_REQUEST))
                    tl.signal(fence, status)
            elif isinstance(token, _CtrlRequest):
                base = q.slot_base + token.slot * q.slot_size   # slot_addr
                resp = self.kernel.memory.read(base + CTRL_REQ_MAX, ulen) if ulen else b""
                q.free_slots.append(token.slot)
                token.status = (_U32_AT(resp)[0] if ulen >= 4
                                else int(A.Status.BAD_REQUEST))
                token.resp = resp
                token.done = True
            else:
                if ulen >= A.EVENT.size:
                    base = q.slot_base + token.slot * q.slot_size   # slot_addr
                    self._handle_event(_unpack(A.EVENT, self.kernel.memory.read(
                        base, A.EVENT.size)))
                else:
                    self._trace("event_short", len=ulen)
                q.free_slots.append(token.slot)
                self._post_event_buffer(q)
            if self.generation != gen:
                return False
        return True

    def _handle_event(self, ev: dict[str, int]) -> None:
        if ev["type"] != A.EventType.CONTEXT_FAULT:
            self._trace("event_unknown", type=ev["type"])
            return
        ctx = self._contexts.get(ev["context_id"]) or self._quarantine.get(ev["context_id"])
        self._trace("context_fault", device_context=ev["context_id"],
                    context=ctx.uid if ctx else 0, fence=ev["fence_seq"], status=ev["status"])
        if ctx is not None and not ctx.faulted:
            ctx.faulted = True
            ctx.fault_status = ev["status"]

    def _post_event_buffer(self, q: _Queue) -> None:
        if q.ring.broken or not q.free_slots or q.ring.num_free < 1:
            return
        slot = q.free_slots.pop()
        q.ring.add((), ((q.slot_addr(slot), A.EVENT.size),), _EventBuf(slot))

    # ================================================================== recovery timer
    def _busy(self, q: _Queue) -> None:
        """A request was queued on q: the recovery timer runs while any is in flight."""
        if q.outstanding == 0:
            q.progress_ns = self.kernel.sched.now_ns()
        q.outstanding += 1
        self._outstanding += 1
        if self._timer is None and self._start_timer is not None:
            self._timer = self._start_timer(self.poll_ns, self._tick, self._watchdog_what)

    def _cancel_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _tick(self) -> None:
        """The recovery timer (interrupt context): lost interrupts, then the watchdog.
        Nothing here touches the device unless one of them found something."""
        self._timer = None
        if self._in_irq:  # cannot happen (handlers never wait); be safe: look next period
            self._rearm()
            return
        self._in_irq = True
        try:
            if self.poll_wait and self.ready and not self.dead:
                gen = self.generation
                for q in self._queues[A.FIRST_SUBMITQ:]:   # what nobody waited for
                    if self.generation != gen or not self.ready:
                        break
                    if q.ring.has_used():
                        self._reap(q)
            if self.ready and not self.dead and "recovery/no-lost-irq-poll" not in self.breaks:
                self._check_lost_interrupts()
            if self.ready and not self.dead and "recovery/no-watchdog" not in self.breaks:
                self._check_watchdog()
            while self._irq_again:
                self._handle_interrupt(*self._irq_again.pop(0))
        finally:
            self._in_irq = False
            self._irq_again = []
        self._rearm()

    def _rearm(self) -> None:
        if (self._timer is None and self._outstanding and self._start_timer is not None
                and not self.dead):
            self._timer = self._start_timer(self.poll_ns, self._tick, self._watchdog_what)

    def _check_lost_interrupts(self) -> None:
        """Used buffers unreaped for a whole period mean a lost interrupt (an interrupt
        in flight is delivered far sooner): poll them as the handler would, which also
        re-arms the queue's interrupt (EVENT_IDX: used_event moves to the new end)."""
        lost = []
        for q in self._queues:
            if q.ring.broken or not q.ring.has_used():
                q.suspect = -1
            elif q.suspect == q.reaps:
                lost.append(q)
            else:
                q.suspect = q.reaps
        if not lost:
            return
        self.lost_interrupts += 1
        self._trace("irq_lost", queues=",".join(str(q.index) for q in lost))
        before, gen = self._reaped, self.generation
        if self.transport.poll_interrupt():
            self._config_changed()
        for q in lost:
            if self.generation != gen or not self.ready:
                break
            q.suspect = -1
            self._reap(q)
        self.polled_completions += self._reaped - before
        self._trace("irq_polled", completions=self._reaped - before)

    def _check_watchdog(self) -> None:
        """A submit queue with work in flight and no completion for watchdog_ns: poll
        every ring, then check the device; reset it whatever it says (healthy but
        stuck is wedged), so every fence in flight completes ABORTED."""
        now = self.kernel.sched.now_ns()
        stalled = [q for q in self._queues[A.FIRST_SUBMITQ:]
                   if q.outstanding and now - q.progress_ns >= self.watchdog_ns]
        if not stalled:
            return
        q = stalled[0]
        self.watchdog_fires += 1
        stall = now - q.progress_ns
        self._trace("watchdog", queue=q.index, stall_ns=stall, in_flight=q.outstanding)
        gen = self.generation
        if self.transport.poll_interrupt():
            self._config_changed()
        if self.generation == gen and self.ready:
            self._reap_all()
        if (self.generation != gen or not self.ready or not q.outstanding
                or q.progress_ns > now - stall):
            return   # reset, or q completed something (all of it, or progress_ns moved)
        why = (f"watchdog: submit queue {q.index - A.FIRST_SUBMITQ} made no progress "
               f"in {stall} ns")
        if self.features >> V.F_RING_RESET & 1:
            self._reset_ring(q, why)   # that queue alone; contexts and other queues go on
            return
        self.recover(why)

    def _external_reset(self) -> str | None:
        """Whether the function was reset by someone else while the driver had it at
        DRIVER_OK (device_status lost DRIVER_OK, or MSI-X was disabled): what was seen,
        or None. Two register reads; only on the way into a recovery."""
        if not self._queues:
            return None
        try:
            status = self.transport.read_status()
            if status == 0xFF:
                return "device_status reads all ones: the function is gone or was reset"
            if not status & V.STATUS_DRIVER_OK:
                return (f"device_status {status:#x}: the function was reset behind the "
                        "driver")
            return self.transport.interrupts_broken()
        except (TransportError, PciError) as e:
            return f"the function does not answer: {e}"

    # ================================================================== reset / recovery
    def recover(self, reason: str) -> None:
        """Reset the function, complete everything in flight, re-initialise."""
        if self._recovering:
            return
        self._recovering = True
        try:
            self.resets += 1
            self.generation += 1
            self.ready = False
            # A reset the driver did not start (FLR, status 0 written behind it, an
            # admin VF reset) also cleared the function's MSI-X: set it up again.
            external = self._external_reset()
            if external is not None:
                self.external_resets += 1
                reason = f"{reason}; {external}"
            self._trace("reset", reason=reason, generation=self.generation)
            try:
                self.transport.reset()  # after this the device issues no DMA (§8)
                if external is not None:
                    self.transport.restore_after_reset()
            except (TransportError, PciError) as e:
                self.dead = str(e)
            self._abort_in_flight()
            if self.dead:
                return
            try:
                self._init_device(reset=False)
            except (TransportError, AllocError, RingError, ValueError) as e:
                self.dead = f"re-initialisation after reset failed: {e}"
                self._trace("dead", reason=self.dead)
                try:
                    self.transport.fail()
                except Exception:  # noqa: BLE001
                    pass
        finally:
            self._recovering = False

    @staticmethod
    def _abort_requests(tokens: Sequence[_Token]) -> list[_Submission]:
        """Requests taken back from a ring that was reset: control requests complete
        ABORTED now; the submissions are returned for their fences to be signalled
        ABORTED once the driver's state is consistent again."""
        aborted: list[_Submission] = []
        for token in tokens:
            if isinstance(token, _CtrlRequest):
                token.aborted = True
                token.status = int(A.Status.ABORTED)
                token.done = True
            elif isinstance(token, _Submission):
                aborted.append(token)
        return aborted

    def _abort_in_flight(self) -> None:
        """After a reset: every request in flight completes ABORTED, exactly once."""
        aborted: list[_Submission] = []
        for q in self._queues:
            aborted += self._abort_requests(q.ring.drain())
        if self.admin is not None:
            self.admin.abort()
        for q in self._queues:
            q.outstanding, q.suspect = 0, -1
        self._outstanding = 0
        self._cancel_timer()
        for ctx in self._contexts.values():
            ctx.lost = True
            ctx.mappings.clear()
        self._contexts = {}
        self._quarantine.clear()   # the reset destroyed every context and stopped its DMA
        self._held.clear()
        self._kctx = None
        if "recovery/no-abort-on-reset" in self.breaks:
            return
        for sub in aborted:
            sub.ctx.timeline.signal(sub.fence, A.Status.ABORTED)

    def reset(self, reason: str = "requested") -> None:
        self.check_alive()
        self.recover(reason)

    # ================================================================== queue reset
    def reset_queue(self, queue: int, reason: str = "requested") -> None:
        """VIRTIO_F_RING_RESET: reset submit queue `queue` alone and set it up again; its
        fences in flight complete ABORTED exactly once, the other queues and every
        context go on. Raises VA1Error: EOPNOTSUPP (not negotiated), EINVAL (no such
        queue), ENODEV (dead)."""
        self.check_alive()
        if not self.features >> V.F_RING_RESET & 1:
            raise VA1Error(errno.EOPNOTSUPP, f"{self.name}: VIRTIO_F_RING_RESET was not "
                                             "negotiated")
        if not 0 <= queue < self.num_submit_queues:
            raise VA1Error(errno.EINVAL, f"submit queue {queue} out of range "
                                         f"0..{self.num_submit_queues - 1}")
        self._reset_ring(self._queues[A.FIRST_SUBMITQ + queue], reason)

    def _reset_ring(self, q: _Queue, reason: str) -> None:
        """Reset one queue through the transport, take its requests back, re-create its
        ring and enable it again; anything the device refuses becomes a full recovery."""
        self.queue_resets += 1
        self._trace("queue_reset", queue=q.index, reason=reason, in_flight=q.outstanding)
        try:
            status = self.transport.read_status()
            if status & V.STATUS_DEVICE_NEEDS_RESET:
                self.recover(f"queue {q.index} reset ({reason}): device set "
                             f"DEVICE_NEEDS_RESET (status {status:#x})")
                return
            self.transport.reset_queue(q.index)
        except (TransportError, PciError) as e:
            self.recover(f"queue {q.index} reset ({reason}) failed: {e}")
            return
        aborted = self._abort_requests(q.ring.drain())
        self._outstanding -= q.outstanding
        q.outstanding, q.suspect = 0, -1
        if self._outstanding == 0:
            self._cancel_timer()
        q.ring.reset()
        q.reset_slots()
        try:
            self.transport.reenable_queue(q.index, q.ring.num, q.ring.desc_addr,
                                          q.ring.driver_addr, q.ring.device_addr)
            q.ring.enable_interrupts()
            if q.index == A.EVENTQ:
                for _ in range(q.ring.num):
                    self._post_event_buffer(q)
                self._kick(q)
        except (TransportError, PciError) as e:
            self.recover(f"queue {q.index} could not be enabled after its reset: {e}")
        for sub in aborted:
            sub.ctx.timeline.signal(sub.fence, A.Status.ABORTED)

    def remove(self) -> None:
        """Unbind: reset (no DMA after it), abort what is in flight, give back the
        interrupts and the ring memory. The device file then reports ENODEV."""
        if self.dead == "removed":
            return
        self.generation += 1
        self.ready = False
        self._trace("remove")
        try:
            self.transport.reset()
        except TransportError:
            pass
        self._abort_in_flight()
        self.dead = "removed"
        self._release()

    # ================================================================== controlq
    def _control(self, req: bytes, resp_size: int, what: str) -> _CtrlRequest:
        self.check_alive()
        q = self._queues[A.CONTROLQ]
        gen = self.generation
        if not (q.ring.num_free >= q.descs and q.free_slots):
            self._wait_for_space(q, gen, "ctrl_space")
        if self.generation != gen:
            raise VA1Error(errno.EIO, f"{self.name}: device reset during {what}")
        self.check_alive()
        slot = q.free_slots.pop()
        base = q.slot_addr(slot)
        self.kernel.memory.write(base, req)
        token = _CtrlRequest(slot)
        q.ring.add(((base, len(req)),), ((base + CTRL_REQ_MAX, resp_size),), token)
        self._busy(q)
        self._kick(q)
        ok = self._wait(guest_state(lambda: token.done), CTRL_TIMEOUT_NS, "ctrl", request=what)
        if not ok:
            self.recover(f"control request {what} not answered in {CTRL_TIMEOUT_NS} ns")
            raise VA1Error(errno.ETIMEDOUT, f"{self.name}: {what}: device did not answer; "
                                            "device was reset")
        if token.aborted:
            raise VA1Error(errno.EIO, f"{self.name}: device reset during {what}")
        return token

    @property
    def address_spaces(self) -> bool:
        """Whether contexts get private address spaces (False after the fallback)."""
        return self.ctx_as is not False

    def create_context(self, flat: bool = False) -> Context:
        """A private context (flat once the device proved to have no address spaces);
        `flat`: a FLAT one (the driver's own). A device id still in quarantine (work of
        its destroyed context may still complete) is held, created but never used, and
        the device is asked again. ENOSPC frees the driver's own idle context first."""
        while True:
            try:
                ctx = self._create_context(flat)
            except VA1Error as e:
                if e.errno == errno.ENOSPC and self._release_kernel_context():
                    continue
                raise
            if ctx.device_id not in self._quarantine:
                return ctx
            self._held[ctx.device_id] = ctx
            self._trace("ctx_id_held", device_context=ctx.device_id)

    def _create_context(self, flat: bool) -> Context:
        flags = self._flat_flag if (flat or self.ctx_as is False) else 0
        tok = self._control(_pack(A.CTRL_REQ, type=A.CtrlType.CONTEXT_CREATE, flags=flags),
                            A.CTRL_RESP.size, "CONTEXT_CREATE")
        if flags and tok.status == A.Status.BAD_REQUEST:
            # a device without address spaces takes no flags: its contexts are all flat
            self._flat_flag = 0
            self._trace("ctx_flat_flag_refused")
            flags = 0
            tok = self._control(_pack(A.CTRL_REQ, type=A.CtrlType.CONTEXT_CREATE),
                                A.CTRL_RESP.size, "CONTEXT_CREATE")
        if len(tok.resp) < A.CTRL_RESP.size and tok.status == A.Status.OK:
            raise VA1Error(errno.EIO, f"{self.name}: CONTEXT_CREATE response short "
                                      f"({len(tok.resp)} bytes)")
        if tok.status == A.Status.NO_RESOURCES:
            raise VA1Error(errno.ENOSPC, f"{self.name}: device has no free context "
                                         f"(max_contexts {self.config['max_contexts']})")
        if tok.status != A.Status.OK:
            raise VA1Error(errno.EIO, f"{self.name}: CONTEXT_CREATE failed with status "
                                      f"{_status_name(tok.status)}")
        dev_id = _unpack(A.CTRL_RESP, tok.resp)["context_id"]
        if dev_id in self._contexts:
            raise VA1Error(errno.EIO, f"{self.name}: device returned context id {dev_id}, "
                                      "which is already live")
        uid = self._next_uid
        self._next_uid += 1
        ctx = Context(uid, dev_id, self.generation, FenceTimeline(uid, self.kernel.trace),
                      flat=flat or self.ctx_as is False)
        self._contexts[dev_id] = ctx
        return ctx

    def ctx_map(self, ctx: Context, va: int, pa: int, size: int,
                flags: int = CTX_MAP_RW) -> bool:
        """Map [pa, pa+size) of the function's memory at va in ctx's address space.
        Returns False when there is nothing to do (flat context, or the device has no
        address spaces: the first BAD_ARG answer switches the driver to flat contexts).
        Raises VA1Error: ENOMEM (device mapping table full), EINVAL (range refused),
        ECANCELED (context gone), EIO."""
        if ctx.flat or self.ctx_as is False:
            return False
        self.check_ctx_live(ctx)
        tok = self._control(_pack(A.CTX_MAP_REQ, type=A.CtrlType.CONTEXT_MAP,
                                  context_id=ctx.device_id, flags=flags, va=va, pa=pa,
                                  size=size),
                            A.CTRL_RESP.size, "CONTEXT_MAP")
        st = tok.status
        if st == A.Status.OK:
            self.ctx_as = True
            ctx.mappings[va] = size
            self._trace("ctx_map", context=ctx.uid, va=va, size=size)
            return True
        if st == A.Status.CONTEXT_FAULTED:
            # a faulted context runs nothing more: it needs no mapping
            if not ctx.faulted:
                ctx.faulted, ctx.fault_status = True, int(st)
            return False
        if st == A.Status.BAD_ARG and self.ctx_as is None:
            self.ctx_as = False
            for c in self._contexts.values():
                c.flat = True
            self._trace("ctx_as_fallback", reason="CONTEXT_MAP answered BAD_ARG: device has "
                                                  "no context address spaces; contexts are "
                                                  "flat")
            return False
        what = (f"{self.name}: CONTEXT_MAP of [{pa:#x}, +{size:#x}) at va {va:#x} into "
                f"context {ctx.uid}")
        if st == A.Status.NO_RESOURCES:
            raise VA1Error(errno.ENOMEM, f"{what}: device mapping table is full")
        if st in (A.Status.OUT_OF_BOUNDS, A.Status.BAD_ARG):
            raise VA1Error(errno.EINVAL, f"{what}: refused ({_status_name(st)})")
        if st == A.Status.BAD_CONTEXT:
            raise VA1Error(errno.ECANCELED, f"{what}: device does not know the context")
        raise VA1Error(errno.EIO, f"{what}: failed with status {_status_name(st)}")

    def ctx_unmap(self, ctx: Context, va: int) -> None:
        """Undo one ctx_map. Nothing to do when the mapping is gone with its context
        (destroyed, or lost in a reset). Raises VA1Error(EIO) if the device refuses."""
        size = ctx.mappings.get(va)
        if size is None or ctx.destroyed or ctx.lost or ctx.generation != self.generation:
            ctx.mappings.pop(va, None)
            return
        self.check_alive()
        tok = self._control(_pack(A.CTX_MAP_REQ, type=A.CtrlType.CONTEXT_UNMAP,
                                  context_id=ctx.device_id, va=va, size=size),
                            A.CTRL_RESP.size, "CONTEXT_UNMAP")
        if tok.status in (A.Status.OK, A.Status.BAD_CONTEXT, A.Status.CONTEXT_FAULTED):
            # a faulted context runs nothing more, so it cannot reach the range either
            if tok.status == A.Status.CONTEXT_FAULTED and not ctx.faulted:
                ctx.faulted, ctx.fault_status = True, int(tok.status)
            ctx.mappings.pop(va, None)
            self._trace("ctx_unmap", context=ctx.uid, va=va, size=size)
            return
        raise VA1Error(errno.EIO, f"{self.name}: CONTEXT_UNMAP of va {va:#x} (+{size:#x}) "
                                  f"from context {ctx.uid} failed: "
                                  f"{_status_name(tok.status)}")

    def check_ctx_live(self, ctx: Context) -> None:
        """The context exists on the device (faulted ones too)."""
        if ctx.destroyed:
            raise VA1Error(errno.ENOENT, f"context {ctx.uid} was destroyed")
        if ctx.lost or ctx.generation != self.generation:
            raise VA1Error(errno.ECANCELED, f"context {ctx.uid} was lost in a device reset")

    def run_deferred(self) -> None:
        """Run work that interrupt handlers queued for task context (e.g. the unmaps of
        a buffer whose deferred free became possible)."""
        while self.deferred:
            self.deferred.pop(0)()

    def destroy_context(self, ctx: Context) -> None:
        """Destroy; a context lost in a reset is simply forgotten (nothing to destroy)."""
        if ctx.destroyed:
            return
        if ctx.lost or ctx.generation != self.generation or self.dead:
            ctx.destroyed = True
            return
        try:
            tok = self._control(_pack(A.CTRL_REQ, type=A.CtrlType.CONTEXT_DESTROY,
                                      context_id=ctx.device_id),
                                A.CTRL_RESP.size, "CONTEXT_DESTROY")
        except VA1Error:
            if ctx.lost:  # the reset destroyed it anyway
                ctx.destroyed = True
                return
            raise
        if tok.status not in (A.Status.OK, A.Status.BAD_CONTEXT):
            raise VA1Error(errno.EIO, f"{self.name}: CONTEXT_DESTROY of device context "
                                      f"{ctx.device_id} failed: {_status_name(tok.status)}")
        ctx.destroyed = True
        ctx.mappings.clear()
        self._contexts.pop(ctx.device_id, None)
        pending = [f for f in ctx.timeline.fences.values() if not f.signalled]
        if pending:
            # DESTROY aborted what was queued; what already runs goes on and may still
            # fault "its" context id: nobody gets that id until it has completed
            self._quarantine[ctx.device_id] = ctx
            self._trace("ctx_quarantine", device_context=ctx.device_id, context=ctx.uid,
                        pending=len(pending))
            def check(_fence: Fence) -> None:
                self._quarantine_check(ctx)
            for f in pending:
                f.add_callback(check)

    def _quarantine_check(self, ctx: Context) -> None:
        """A fence of a quarantined context completed (interrupt context)."""
        if ctx.timeline.pending == 0 and self._quarantine.get(ctx.device_id) is ctx:
            self.deferred.append(lambda: self._release_quarantine(ctx))

    def _release_quarantine(self, ctx: Context) -> None:
        """Every fence of the old context completed: its id may be reused (task context)."""
        if self._quarantine.get(ctx.device_id) is not ctx:
            return
        del self._quarantine[ctx.device_id]
        self._trace("ctx_quarantine_end", device_context=ctx.device_id, context=ctx.uid)
        held = self._held.pop(ctx.device_id, None)
        if held is not None:
            try:
                self.destroy_context(held)
            except VA1Error as e:
                self._trace("ctx_held_destroy_failed", device_context=held.device_id,
                            error=str(e))

    # ================================================================== scrubbing
    def _kernel_context(self) -> Context:
        """The driver's own FLAT context (created on first use, again after a reset)."""
        k = self._kctx
        if k is not None and (k.lost or k.destroyed or k.generation != self.generation
                              or k.faulted):
            self._kctx = None
            if k.faulted and not k.destroyed:
                try:
                    self.destroy_context(k)
                except VA1Error:
                    pass  # gone with a reset, or the device is dead: check_alive says so
        if self._kctx is None:
            self._kctx = self.create_context(flat=True)
        return self._kctx

    def _release_kernel_context(self) -> bool:
        """Give the driver's own context back to the device when idle (a user needs the
        slot); True if one was freed."""
        k = self._kctx
        if k is None or k.timeline.pending:
            return False
        self._kctx = None
        self.destroy_context(k)
        self._trace("kernel_context_released", device_context=k.device_id)
        return True

    def scrub(self, ranges: Sequence[tuple[int, int]]) -> None:
        """Zero these device-memory ranges (start, length; multiples of 4) and wait: one
        FILL each, on the driver's own FLAT context, submit queue 0. Task context.
        Raises VA1Error (EIO when the FILLs did not complete OK, e.g. aborted by a
        reset; ENOSPC when the device has no context left for the driver)."""
        hdr = struct.Struct(isa.HEADER.format)
        fill = isa.PAYLOAD[isa.Opcode.FILL]
        length = isa.command_length(isa.Opcode.FILL)
        cmds = [hdr.pack(isa.Opcode.FILL, 0, length) + _pack(fill, dst=a, size=n)
                for a, n in ranges]
        per = max(self.config["max_cmdbuf_size"] // length, 1)
        for i in range(0, len(cmds), per):
            buf = b"".join(cmds[i:i + per])
            ctx = self._kernel_context()
            iova = self.alloc.alloc_dma(len(buf))
            self.kernel.memory.write(iova, buf)
            def free(_fence: Fence, addr: int = iova) -> None:
                self.alloc.free(addr)
            try:
                fence = self.submit(ctx, 0, iova, len(buf), on_done=free)
            except BaseException:
                self.alloc.free(iova)
                raise
            self.wait_fence(fence, None)
            if fence.status != A.Status.OK:
                first = ranges[i]
                raise VA1Error(errno.EIO, f"{self.name}: scrub of device memory "
                                          f"[{first[0]:#x}, +{first[1]:#x}) did not complete: "
                                          f"{_status_name(fence.status)}")
        self._trace("scrub", ranges=len(ranges), bytes=sum(n for _, n in ranges))

    def get_stats(self) -> dict[str, int]:
        tok = self._control(_pack(A.CTRL_REQ, type=A.CtrlType.GET_STATS),
                            A.STATS_RESP.size, "GET_STATS")
        if tok.status != A.Status.OK or len(tok.resp) < A.STATS_RESP.size:
            raise VA1Error(errno.EIO, f"{self.name}: GET_STATS failed: status "
                                      f"{_status_name(tok.status)}, {len(tok.resp)} bytes")
        stats = _unpack(A.STATS_RESP, tok.resp)
        stats.update(self.debug_stats())
        return stats

    def debug_stats(self) -> dict[str, int]:
        """The driver's own counters (no device request): interrupts handled, lost
        interrupts found and the completions polled for them, watchdog fires, resets."""
        return {"interrupts": self.interrupts, "lost_interrupts": self.lost_interrupts,
                "polled_completions": self.polled_completions,
                "watchdog_fires": self.watchdog_fires, "resets": self.resets}

    # ================================================================== submission
    def submit(self, ctx: Context, queue: int, iova: int, length: int,
               on_done: Callable[[Fence], None] | None = None, *,
               checked: bool = False) -> Fence:
        """Queue one command buffer; block while the ring is full. Returns its fence.
        `checked`: the caller ran `check_submit(ctx)` and nothing since could have
        changed its answer (no wait, no interrupt)."""
        if not checked:
            self.check_submit(ctx)
        queues = self._queues
        nq = len(queues) - A.FIRST_SUBMITQ   # num_submit_queues
        if not 0 <= queue < nq:
            raise VA1Error(errno.EINVAL, f"submit queue {queue} out of range "
                                         f"0..{nq - 1}")
        q = queues[A.FIRST_SUBMITQ + queue]
        ring = q.ring
        if not (q.free_slots and ring.num_free >= q.descs):
            self._wait_for_space(q, self.generation, "submit_space")
            self.check_submit(ctx)
        fence = ctx.timeline.next(queue, on_done)
        seq = fence.seq
        slot = q.free_slots.pop()
        off = slot * q.slot_size
        base = q.slot_base + off
        req, resp = _SUBMIT_REQ_SEGS
        # fields in SUBMIT_REQ order: context_id, flags, cmdbuf_addr, cmdbuf_len,
        # reserved, fence_seq
        _SUBMIT_REQ.pack_into(q.slots, off, ctx.device_id, 0, iova, length, 0, seq)
        kick = ring.add_pair(base, req, base + req, resp, _Submission(slot, ctx, fence))
        self._busy(q)
        if self.poll_wait:   # _polled(q): interrupts off before the device sees it
            ring.disable_interrupts()
        if kick:   # add_pair answered kick_prepare()
            self._notify(q)
        return fence

    def check_submit(self, ctx: Context) -> None:
        """What must hold for a submission on ctx: the device alive, the context neither
        destroyed, lost in a reset nor faulted."""
        if self.dead:
            self.check_alive()
        if ctx.destroyed:
            raise VA1Error(errno.ENOENT, f"context {ctx.uid} was destroyed")
        if ctx.lost or ctx.generation != self.generation:
            raise VA1Error(errno.ECANCELED, f"context {ctx.uid} was lost in a device reset; "
                                            "destroy it and create a new one")
        if ctx.faulted:
            raise VA1Error(errno.ECANCELED, f"context {ctx.uid} faulted (status "
                                            f"{_status_name(ctx.fault_status)}); destroy it")

    def wait_fence(self, fence: Fence, timeout_ns: int | None) -> bool:
        """Block until the fence is signalled or the virtual timeout passes."""
        if fence.signalled:
            return True
        if self.poll_wait and self.ready and not self.dead:
            return self._poll_fence(fence, timeout_ns)
        # timeout 0 still goes through wait_until: pending interrupts are delivered there
        return self._wait(fence, timeout_ns, "fence", False, self._fence_what,
                          context=fence.context, fence=fence.seq)

    def _poll_fence(self, fence: Fence, timeout_ns: int | None) -> bool:
        """`va1.poll_wait=1`: the wait reaps the fence's submit queue (whose interrupts
        are off, `_polled`) each time virtual time moves, as a guest spinning on the
        ring would: no interrupt delivery, no ISR and ACK exits."""
        q = self._queues[A.FIRST_SUBMITQ + fence.queue]
        gen = self.generation

        def cond() -> bool:
            if not fence.signalled and self.generation == gen and self.ready \
                    and not self.dead and q.ring.has_used():
                self._reap_polled(q)
            return fence.signalled
        return self._wait(cond, timeout_ns, "fence", context=fence.context, fence=fence.seq)

    def _polled(self, q: _Queue) -> bool:
        """With va1.poll_wait=1 the submit queues run with interrupts off: waits poll
        them, and the recovery timer reaps what nobody waited for."""
        return self.poll_wait and q.index >= A.FIRST_SUBMITQ

    def _reap_polled(self, q: _Queue) -> None:
        """Reap q in task context as its interrupt handler would (no interrupt is
        counted); handlers that come in meanwhile queue up and run after it."""
        if self._in_irq:
            return
        self._in_irq = True
        try:
            self._reap(q)
            while self._irq_again:
                self._handle_interrupt(*self._irq_again.pop(0))
        finally:
            self._in_irq = False
            self._irq_again = []


def _status_name(status: int) -> str:
    try:
        return A.Status(status).name
    except ValueError:
        return str(status)
