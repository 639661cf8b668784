"""The virtio administration virtqueue, driver side (virtio 1.3 §2.12; Linux virtio_pci_admin).

A command is one request on the admin queue: a device-readable part holding
`virtio_admin_cmd_hdr` (opcode, group type, group member id) and the command-specific
data, then a device-writable part holding `virtio_admin_cmd_status` (status,
status_qualifier) and the command-specific result. `used.len` counts the bytes written.

The queue is set up like any other queue of the function (the transport gives its index
and the owner wires its interrupt); the owner calls `reap()` from its interrupt handler
and `abort()` after a device reset. `command()` blocks the calling task until the device
answers or a virtual timeout passes. After every (re)initialisation `init_group()` must
run LIST_QUERY then LIST_USE (virtio 1.3 §2.12.1.2) before other commands of the group:
`command()` does it lazily when the owner marked the queue as needing it.
"""
from __future__ import annotations

import errno
import struct
from dataclasses import dataclass
from typing import Callable, Iterable, NamedTuple

from hwspec import virtio_admin as VA

from ..errors import GuestDriverError
from ..kernel import GuestKernel
from ..mm import AllocError, PageAllocator
from .ring import DriverRing
from .ring_factory import make_driver_ring

ADMIN_QUEUE_SIZE = 16
ADMIN_TIMEOUT_NS = 1_000_000_000
_HDR = struct.Struct(VA.CMD_HDR.format)
_STATUS = struct.Struct(VA.CMD_STATUS.format)


class AdminResult(NamedTuple):
    """What the device answered: admin status (an errno value), qualifier, result bytes
    (as many as the device wrote, at most the result size asked for)."""
    status: int
    qualifier: int
    result: bytes


class AdminError(GuestDriverError, OSError):
    """An admin command could not be carried out (errno + a message naming it)."""


@dataclass
class _AdminCmd:
    opcode: int
    buf: int            # guest physical address of the request+response buffer
    out_off: int        # offset of the device-writable part
    out_len: int
    done: bool = False
    aborted: bool = False
    used_len: int = 0


def bitmap_words(max_opcode: int) -> int:
    """le64 words a LIST_QUERY/LIST_USE bitmap needs to cover opcodes 0..max_opcode."""
    return max_opcode // 64 + 1


def encode_bitmap(opcodes: Iterable[int], words: int) -> bytes:
    bits = 0
    for op in opcodes:
        bits |= 1 << op
    return bits.to_bytes(8 * words, "little")


def decode_bitmap(data: bytes) -> set[int]:
    bits = int.from_bytes(data, "little")
    return {i for i in range(8 * len(data)) if bits >> i & 1}


def opcode_name(opcode: int, names: dict[int, str] | None = None) -> str:
    base = {VA.CMD_LIST_QUERY: "LIST_QUERY", VA.CMD_LIST_USE: "LIST_USE"}
    if names:
        base.update(names)
    return base.get(opcode, f"opcode {opcode:#06x}")


class AdminQueue:
    """One admin virtqueue of one function."""

    def __init__(self, kernel: GuestKernel, alloc: PageAllocator, index: int, num: int, *,
                 features: int, name: str,
                 notify: Callable[[int, int | None], None],
                 on_timeout: Callable[[str], None],
                 check_alive: Callable[[], None]) -> None:
        self.kernel = kernel
        self.alloc = alloc
        self.index = index
        self.name = name
        self.ring: DriverRing[_AdminCmd] = make_driver_ring(features, kernel.memory, alloc,
                                                            index, num, max_indirect=2)
        self._notify = notify
        self._on_timeout = on_timeout
        self._check_alive = check_alive
        self.generation = 0
        self.ready = False
        self.needs_init = True
        self.group_type = VA.GROUP_TYPE_SRIOV
        self.wanted: frozenset[int] = frozenset()
        self.supported: frozenset[int] = frozenset()
        self.in_use: frozenset[int] = frozenset()
        self.commands = 0
        self.timeouts = 0

    # ---- lifecycle (owner) -----------------------------------------------------------
    def reset(self) -> None:
        """After a device reset and abort(): empty ring, LIST_QUERY/USE needed again."""
        self.ring.reset()
        self.ready = False
        self.needs_init = True

    def release(self) -> None:
        self.ring.release()

    def abort(self) -> int:
        """The device was reset: every command in flight completes aborted. Returns how
        many. Their buffers go back (no DMA after a reset)."""
        self.generation += 1
        self.ready = False
        n = 0
        for cmd in self.ring.drain():
            cmd.aborted = True
            cmd.done = True
            self.alloc.free(cmd.buf)
            n += 1
        return n

    def reap(self) -> str | None:
        """Complete every answered command (interrupt context). Returns why the ring is
        broken, or None."""
        while True:
            for cmd, ulen in self.ring.get_used():
                cmd.used_len = ulen
                cmd.done = True
            if self.ring.broken:
                return self.ring.broken
            if not self.ring.enable_interrupts():
                return None

    # ---- commands ---------------------------------------------------------------------
    def command(self, opcode: int, group_type: int, member: int, data: bytes = b"",
                result_size: int = 0, timeout_ns: int = ADMIN_TIMEOUT_NS,
                what: str = "") -> AdminResult:
        """Send one admin command and wait for its answer (task context).

        Raises AdminError: ENODEV (device dead), EIO (device reset meanwhile, or an
        answer shorter than the status), ETIMEDOUT (no answer in `timeout_ns` of
        virtual time: the owner resets the device)."""
        if self.needs_init and opcode not in (VA.CMD_LIST_QUERY, VA.CMD_LIST_USE):
            self.init_group(self.group_type, self.wanted)
        return self._command(opcode, group_type, member, data, result_size, timeout_ns,
                             what or opcode_name(opcode))

    def _command(self, opcode: int, group_type: int, member: int, data: bytes,
                 result_size: int, timeout_ns: int, what: str) -> AdminResult:
        self._check_alive()
        if not self.ready:
            raise AdminError(errno.EIO, f"{self.name}: admin queue is not ready ({what})")
        if result_size < 0:
            raise ValueError(f"result_size {result_size} < 0")
        sched = self.kernel.sched
        gen = self.generation
        need = self.ring.descs_needed(2)
        if self.ring.num_free < need:
            sched.wait_until(lambda: self.generation != gen or self.ring.num_free >= need,
                             None, f"{self.name} admin_space")
            if self.generation != gen:
                raise AdminError(errno.EIO, f"{self.name}: device reset during {what}")
            self._check_alive()
        req = _HDR.pack(opcode, group_type, bytes(12), member) + data
        out_len = VA.CMD_STATUS.size + result_size
        try:
            buf = self.alloc.alloc_dma(len(req) + out_len)
        except AllocError as e:
            raise AdminError(errno.ENOMEM, f"{self.name}: {what}: {e}") from None
        mem = self.kernel.memory
        mem.write(buf, req)
        mem.write(buf + len(req), bytes(out_len))
        cmd = _AdminCmd(opcode, buf, len(req), out_len)
        self.ring.add(((buf, len(req)),), ((buf + len(req), out_len),), cmd)
        self.commands += 1
        self.kernel.trace.emit("admin_cmd", dev=self.name, opcode=opcode, member=member,
                               group_type=group_type)
        if self.ring.kick_prepare():
            self._notify(self.index, self.ring.notification_data())
        ok = cmd.done or sched.wait_until(lambda: cmd.done, timeout_ns,
                                          f"{self.name} admin {what}")
        if not ok:
            self.timeouts += 1
            self._on_timeout(f"admin command {what} not answered in {timeout_ns} ns")
            raise AdminError(errno.ETIMEDOUT, f"{self.name}: {what}: device did not answer "
                                              f"in {timeout_ns} ns; device was reset")
        if cmd.aborted:
            raise AdminError(errno.EIO, f"{self.name}: device reset during {what}")
        out = mem.read(buf + len(req), cmd.used_len) if cmd.used_len else b""
        self.alloc.free(buf)
        if len(out) < VA.CMD_STATUS.size:
            raise AdminError(errno.EIO, f"{self.name}: {what}: answer of {len(out)} bytes "
                                        f"is shorter than the {VA.CMD_STATUS.size}-byte status")
        status, qualifier, _ = _STATUS.unpack_from(out)
        self.kernel.trace.emit("admin_done", dev=self.name, opcode=opcode, status=status,
                               qualifier=qualifier)
        return AdminResult(status, qualifier, out[VA.CMD_STATUS.size:])

    def init_group(self, group_type: int, wanted: Iterable[int]) -> frozenset[int]:
        """LIST_QUERY then LIST_USE (the opcodes both sides know). Returns the opcodes
        in use. Raises AdminError if either fails."""
        self.group_type = group_type
        self.wanted = frozenset(wanted) | {VA.CMD_LIST_QUERY, VA.CMD_LIST_USE}
        words = bitmap_words(max(self.wanted))
        r = self._command(VA.CMD_LIST_QUERY, group_type, 0, b"", 8 * words,
                          ADMIN_TIMEOUT_NS, "LIST_QUERY")
        if r.status != VA.STATUS_OK:
            raise AdminError(errno.EIO, f"{self.name}: LIST_QUERY failed: status "
                                        f"{status_name(r.status)}, qualifier "
                                        f"{qualifier_name(r.qualifier)}")
        self.supported = frozenset(decode_bitmap(r.result))
        use = (self.supported & self.wanted) | {VA.CMD_LIST_QUERY, VA.CMD_LIST_USE}
        r = self._command(VA.CMD_LIST_USE, group_type, 0, encode_bitmap(use, words), 0,
                          ADMIN_TIMEOUT_NS, "LIST_USE")
        if r.status != VA.STATUS_OK:
            raise AdminError(errno.EIO, f"{self.name}: LIST_USE failed: status "
                                        f"{status_name(r.status)}, qualifier "
                                        f"{qualifier_name(r.qualifier)}")
        self.in_use = frozenset(use)
        self.needs_init = False
        self.kernel.trace.emit("admin_list_use", dev=self.name,
                               opcodes=",".join(f"{o:#x}" for o in sorted(use)),
                               missing=",".join(f"{o:#x}" for o in
                                                sorted(self.wanted - self.supported)))
        return self.in_use


_STATUS_NAMES = {VA.STATUS_OK: "OK", VA.STATUS_EAGAIN: "EAGAIN", VA.STATUS_ENOMEM: "ENOMEM",
                 VA.STATUS_EINVAL: "EINVAL"}
_QUALIFIER_NAMES = {
    VA.STATUS_Q_OK: "OK", VA.STATUS_Q_INVALID_COMMAND: "INVALID_COMMAND",
    VA.STATUS_Q_INVALID_OPCODE: "INVALID_OPCODE", VA.STATUS_Q_INVALID_FIELD: "INVALID_FIELD",
    VA.STATUS_Q_INVALID_GROUP: "INVALID_GROUP", VA.STATUS_Q_INVALID_MEMBER: "INVALID_MEMBER",
    VA.STATUS_Q_NORESOURCE: "NORESOURCE", VA.STATUS_Q_TRYAGAIN: "TRYAGAIN"}


def status_name(status: int) -> str:
    return _STATUS_NAMES.get(status, str(status))


def qualifier_name(qualifier: int) -> str:
    return _QUALIFIER_NAMES.get(qualifier, str(qualifier))
