"""A VA-1 card (spec "SR-IOV", "Admin virtqueue"): the card's device memory, the compute
units and their scheduler, the PF function and its VFs, and the PF's admin commands.

Wiring (by the host):
    card = Va1Card(Va1Config(), DevicePorts(dma=pf_dma, clock=clock, tracer=tracer))
    pf = card.physical_function(msi=pf_msi, platform=sriov_platform)
    # software sets NumVFs and VF Enable in the PF's SR-IOV capability:
    #   -> platform.vf_ports(n) for n in 1..NumVFs, then platform.vfs_enabled(vfs)
    # VF n's BAR0 is at card.vf_bar_address(n); pf.admin_queue_index is the admin queue.

The PF and the VFs are generic virtio-pci functions; what makes them SR-IOV functions
is plugged in through their `SriovHooks` (sriov.py).

Memory: the PF owns card memory [0, pf_memory); the rest is the VF pool. On VF Enable
every VF gets an equal share of the pool (rounded down to 1 MiB) and the default
resources; VF_RESOURCES_SET changes them while the VF has no live driver.
"""
from __future__ import annotations

import struct
from dataclasses import dataclass, replace
from typing import Protocol

from hwspec import va1
from hwspec import virtio_admin as VA
from hwspec.va1 import AdminOp, VfResources

from ..errors import DeviceModelError
from ..pci.api import SriovPlatform
from ..pci.sriov import SriovCap
from ..ports import DevicePorts, IrqLine, MsiPort, Tracer
from ..virtio.pci import VirtioPciFunction
from .config import Va1Config
from .device import Va1Device
from .memory import CardMemory
from .scheduler import Scheduler
from .sriov import PfHooks, VfHooks

DEFAULT_VF_CONTEXT_POOL = 1024     # contexts shared by all VFs (max_contexts sum)
_MIB = 1 << 20
_ADMIN_OPS = frozenset(int(o) for o in AdminOp)
SUPPORTED_OPCODES = frozenset({VA.CMD_LIST_QUERY, VA.CMD_LIST_USE}) | _ADMIN_OPS
_BITMAP_WORDS = max(SUPPORTED_OPCODES) // 64 + 1        # 33 le64 words
_SUPPORTED_BITMAP = sum(1 << o for o in SUPPORTED_OPCODES)
_HDR = VA.CMD_HDR
_STATUS = VA.CMD_STATUS


class AdminHandler(Protocol):
    def admin_command(self, raw: bytes, writable_len: int) -> bytes: ...

    def pf_reset(self) -> None: ...


@dataclass
class VfPartition:
    """One VF's share of the card: its resources as provisioned (VF_RESOURCES_SET) and
    where its memory partition starts on the card."""
    resources: VfResources
    base: int = 0                  # card offset of the partition

    @property
    def device_memory(self) -> int:
        return self.resources.device_memory


class AdminError(DeviceModelError):
    """An admin command the card refuses: its virtio admin status and qualifier."""

    def __init__(self, status: int, qualifier: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.qualifier = qualifier


class Va1Card:
    """One VA-1 card: PF + up to `total_vfs` VFs over shared memory and compute units."""

    def __init__(self, config: Va1Config, ports: DevicePorts, *,
                 memory_size: int = va1.DEFAULT_CARD_MEMORY,
                 pf_memory: int = va1.DEFAULT_PF_MEMORY,
                 total_vfs: int = va1.DEFAULT_TOTAL_VFS,
                 vf_context_pool: int = DEFAULT_VF_CONTEXT_POOL,
                 vf_config: Va1Config | None = None) -> None:
        """`config` is the PF's (its device_memory_size is replaced by `pf_memory`) and
        gives the card's compute units; `vf_config` the VFs' base parameters (memory,
        queues and contexts come from their resources)."""
        if pf_memory % va1.PARTITION_ALIGN or not 0 <= pf_memory <= memory_size:
            raise ValueError("pf_memory must be a multiple of 1 MiB within memory_size")
        if not 0 <= total_vfs <= 0xFFFF:
            raise ValueError("total_vfs out of range")
        self.ports = ports
        self.tracer: Tracer = ports.tracer
        self.memory = CardMemory(memory_size)
        self.scheduler = Scheduler(config.num_compute_units)
        self.total_vfs = total_vfs
        self.vf_context_pool = vf_context_pool
        self.pf_memory = pf_memory
        self.pf_config = replace(config, device_memory_size=pf_memory)
        self.vf_base_config = vf_config if vf_config is not None else config
        self.pf_device = Va1Device(self.pf_config, ports,
                                   memory=self.memory.partition(0, pf_memory),
                                   scheduler=self.scheduler, function_index=0, admin=self)
        self.pf_function: VirtioPciFunction | None = None
        self.pf_hooks = PfHooks(self)
        self.platform: SriovPlatform | None = None
        self.vf_functions: list[VirtioPciFunction] = []
        self.vf_devices: list[Va1Device] = []
        self.partitions: list[VfPartition] = []   # VF n is partitions[n - 1]
        self.used_opcodes = _SUPPORTED_BITMAP & ((1 << VA.CMD_LIST_QUERY) | (1 << VA.CMD_LIST_USE))

    @property
    def vf_pool(self) -> tuple[int, int]:
        """[start, end) of the VF memory pool on the card."""
        return self.pf_memory, self.memory.size

    def physical_function(self, msi: MsiPort, platform: SriovPlatform,
                          tracer: Tracer | None = None, intx: IrqLine | None = None,
                          ) -> VirtioPciFunction:
        """The PF with its SR-IOV capability and admin virtqueue. Setting VF Enable
        creates NumVFs VFs (ports from `platform.vf_ports(n)`) and hands them to
        `platform.vfs_enabled`; clearing it drops them (`platform.vfs_disabled`)."""
        fn = VirtioPciFunction(self.pf_device, msi,
                               tracer if tracer is not None else self.tracer, intx,
                               sriov_hooks=self.pf_hooks)
        self.pf_function = fn
        self.platform = platform
        return fn

    # --- SR-IOV capability --------------------------------------------------------------

    @property
    def sriov(self) -> SriovCap | None:
        """The PF's SR-IOV capability (None before `physical_function`)."""
        return self.pf_hooks.cap

    @property
    def vf_mse(self) -> bool:
        """VF Memory Space Enable: whether the VFs' BARs decode."""
        return self.sriov is not None and self.sriov.vf_mse

    def vf_bar_address(self, vf: int) -> int:
        """Where VF `vf` (1-based) has its BAR0 (PF VF BAR0 + (vf-1) * BAR size)."""
        if self.sriov is None:
            raise ValueError("no SR-IOV physical function yet")
        return self.sriov.vf_bar_address(vf)

    @staticmethod
    def vf_routing_id_offset(vf: int) -> int:
        """VF `vf`'s requester ID relative to the PF's (First VF Offset + (vf-1) * Stride)."""
        return va1.SRIOV_FIRST_VF_OFFSET + (vf - 1) * va1.SRIOV_VF_STRIDE

    # --- VF lifecycle -------------------------------------------------------------------

    def _vf_config(self, r: VfResources) -> Va1Config:
        return replace(self.vf_base_config, device_memory_size=r.device_memory,
                       num_submit_queues=r.num_submit_queues, max_contexts=r.max_contexts)

    def _apply_sched(self, dev: Va1Device, r: VfResources) -> None:
        fs = dev.processor.fs
        fs.weight, fs.priority = r.weight, r.priority
        fs.exec_quantum_ns, fs.preemption_timeout_ns = r.exec_quantum_ns, r.preemption_timeout_ns

    def enable_vfs(self, num_vfs: int) -> None:
        """VF Enable 0 -> 1 with NumVFs = `num_vfs`: default provisioning, the VF
        functions, and the platform told."""
        assert self.pf_function is not None and self.platform is not None
        lo, hi = self.vf_pool
        share = ((hi - lo) // num_vfs) // va1.PARTITION_ALIGN * va1.PARTITION_ALIGN \
            if num_vfs else 0
        contexts = min(va1.DEFAULT_VF_MAX_CONTEXTS, self.vf_context_pool // max(num_vfs, 1))
        for n in range(1, num_vfs + 1):
            r = VfResources(share, max_contexts=max(contexts, 1))
            part = VfPartition(r, base=lo + (n - 1) * share)
            ports, msi = self.platform.vf_ports(n)
            dev = Va1Device(self._vf_config(r), ports,
                            memory=self.memory.partition(part.base, r.device_memory),
                            scheduler=self.scheduler, function_index=n)
            self._apply_sched(dev, r)
            fn = VirtioPciFunction(dev, msi, tracer=ports.tracer,
                                   queue_capacity=va1.FIRST_SUBMITQ
                                   + va1.MAX_SUBMIT_QUEUES_PER_FUNCTION,
                                   sriov_hooks=VfHooks(self, n))
            self.memory.scrub(part.base, r.device_memory)
            self.partitions.append(part)
            self.vf_devices.append(dev)
            self.vf_functions.append(fn)
        self.tracer.emit("sriov_enable", num_vfs=num_vfs, share=share)
        self.platform.vfs_enabled(list(self.vf_functions))

    def disable_vfs(self) -> None:
        """VF Enable 1 -> 0 (or PF FLR): every VF reset and dropped."""
        for dev, part in zip(self.vf_devices, self.partitions):
            dev.reset()
            dev.processor.detach()
            self.memory.scrub(part.base, part.device_memory)
        self.vf_functions.clear()
        self.vf_devices.clear()
        self.partitions.clear()
        self.tracer.emit("sriov_disable")
        if self.platform is not None:
            self.platform.vfs_disabled()

    def vf_flr(self, n: int) -> None:
        """After VF `n`'s FLR: its memory is scrubbed (the next tenant sees zeros)."""
        if 1 <= n <= len(self.partitions):
            part = self.partitions[n - 1]
            self.memory.scrub(part.base, part.device_memory)

    def vf_stats(self, n: int) -> dict[str, int]:
        m = self.vf_devices[n - 1].metrics
        return {"submissions": m.submissions, "commands": m.commands,
                "device_time_ns": m.device_time_ns, "dma_bytes": m.dma_bytes,
                "faults": m.faults, "preemptions": m.preemptions, "timeouts": m.timeouts}

    # --- admin virtqueue ----------------------------------------------------------------

    def pf_reset(self) -> None:
        """The PF's virtio reset: the opcodes in use go back to LIST_QUERY/LIST_USE
        (the VFs, their resources and their state are not touched)."""
        self.used_opcodes = (1 << VA.CMD_LIST_QUERY) | (1 << VA.CMD_LIST_USE)

    def admin_command(self, raw: bytes, writable_len: int) -> bytes:
        """One admin command (hdr + data readable; status + result writable): the
        bytes to write back. A refused command changes nothing."""
        if writable_len < _STATUS.size:
            return b""
        result = b""
        opcode = member = -1
        try:
            if len(raw) < _HDR.size:
                raise AdminError(VA.STATUS_EINVAL, VA.STATUS_Q_INVALID_COMMAND,
                                 "short admin command header")
            opcode, group, _, member = struct.unpack_from(_HDR.format, raw)
            data = raw[_HDR.size:]
            room = writable_len - _STATUS.size
            result = self._admin(opcode, group, member, data, room)
            status, qual = VA.STATUS_OK, VA.STATUS_Q_OK
        except AdminError as e:
            status, qual, result = e.status, e.qualifier, b""
            self.tracer.emit("admin_refused", opcode=opcode, member=member, status=status,
                             qualifier=qual, message=str(e))
        else:
            self.tracer.emit("admin", opcode=opcode, member=member)
        return struct.pack(_STATUS.format, status, qual, b"\0" * 4) + result

    def _admin(self, opcode: int, group: int, member: int, data: bytes, room: int) -> bytes:
        if group != VA.GROUP_TYPE_SRIOV:
            raise AdminError(VA.STATUS_EINVAL, VA.STATUS_Q_INVALID_GROUP, f"group {group}")
        if opcode not in SUPPORTED_OPCODES or not self.used_opcodes >> opcode & 1:
            raise AdminError(VA.STATUS_EINVAL, VA.STATUS_Q_INVALID_OPCODE,
                             f"opcode {opcode:#x} not supported or not in use")
        if opcode == VA.CMD_LIST_QUERY:
            if room < 8:
                raise AdminError(VA.STATUS_EINVAL, VA.STATUS_Q_INVALID_COMMAND,
                                 "no room for the opcode bitmap")
            words = min(_BITMAP_WORDS, room // 8)
            return _SUPPORTED_BITMAP.to_bytes(8 * _BITMAP_WORDS, "little")[:8 * words]
        if opcode == VA.CMD_LIST_USE:
            if not data or len(data) % 8:
                raise AdminError(VA.STATUS_EINVAL, VA.STATUS_Q_INVALID_COMMAND,
                                 "LIST_USE data must be le64 words")
            want = int.from_bytes(data, "little")
            if want & ~_SUPPORTED_BITMAP:
                raise AdminError(VA.STATUS_EINVAL, VA.STATUS_Q_INVALID_FIELD,
                                 f"LIST_USE bitmap {want:#x} names unsupported opcodes")
            self.used_opcodes = want | (1 << VA.CMD_LIST_QUERY) | (1 << VA.CMD_LIST_USE)
            return b""
        n = member
        if not 1 <= n <= len(self.vf_devices):
            raise AdminError(VA.STATUS_EINVAL, VA.STATUS_Q_INVALID_MEMBER,
                             f"member {n}: VFs 1..{len(self.vf_devices)}")
        if opcode == AdminOp.VF_RESOURCES_SET:
            if len(data) < va1.VF_RESOURCES.size:
                raise AdminError(VA.STATUS_EINVAL, VA.STATUS_Q_INVALID_COMMAND,
                                 "VF_RESOURCES_SET needs va1_vf_resources")
            self._resources_set(n, data[:va1.VF_RESOURCES.size])
            return b""
        if opcode == AdminOp.VF_RESOURCES_GET:
            self._need(room, va1.VF_RESOURCES.size)
            return self.partitions[n - 1].resources.encode()
        if opcode == AdminOp.VF_STATS:
            self._need(room, va1.VF_STATS.size)
            s = self.vf_stats(n)
            return struct.pack(va1.VF_STATS.format, *(s[k] for k in va1.VF_STATS.names))
        dev = self.vf_devices[n - 1]
        if opcode == AdminOp.VF_STOP:
            dev.processor.fs.stopped = True
            self.tracer.emit("vf_stop", vf=n)
            return b""
        if opcode == AdminOp.VF_RESUME:
            dev.processor.fs.stopped = False
            self.tracer.emit("vf_resume", vf=n)
            self.scheduler.dispatch()
            return b""
        # VF_RESET: as an FLR of the VF
        self.vf_functions[n - 1].function_level_reset()
        return b""

    @staticmethod
    def _need(room: int, size: int) -> None:
        if room < size:
            raise AdminError(VA.STATUS_EINVAL, VA.STATUS_Q_INVALID_COMMAND,
                             f"result needs {size} bytes, {room} writable")

    def _resources_set(self, n: int, data: bytes) -> None:
        req = VfResources.decode(data)
        mem, queues, ctxs = req.device_memory, req.num_submit_queues, req.max_contexts
        weight, prio = req.weight, req.priority
        quantum, timeout = req.exec_quantum_ns, req.preemption_timeout_ns
        bad = []
        if mem == 0 or mem % va1.PARTITION_ALIGN:
            bad.append(f"device_memory {mem:#x}")
        if queues == 0:
            bad.append("num_submit_queues 0")
        if ctxs == 0:
            bad.append("max_contexts 0")
        if weight == 0:
            bad.append("weight 0")
        if prio > va1.MAX_PRIORITY:
            bad.append(f"priority {prio}")
        if quantum == 0:
            bad.append("exec_quantum_ns 0")
        if timeout == 0:
            bad.append("preemption_timeout_ns 0")
        if bad:
            raise AdminError(VA.STATUS_EINVAL, VA.STATUS_Q_INVALID_FIELD, ", ".join(bad))
        fn = self.vf_functions[n - 1]
        if fn.status != 0 or not self.vf_devices[n - 1].processor.idle():
            raise AdminError(VA.STATUS_EAGAIN, VA.STATUS_Q_TRYAGAIN,
                             f"VF {n} has a live driver (status {fn.status:#x})")
        if queues > va1.MAX_SUBMIT_QUEUES_PER_FUNCTION:
            raise AdminError(VA.STATUS_ENOMEM, VA.STATUS_Q_NORESOURCE,
                             f"{queues} submit queues > {va1.MAX_SUBMIT_QUEUES_PER_FUNCTION}")
        others = sum(p.resources.max_contexts for i, p in enumerate(self.partitions)
                     if i != n - 1)
        if others + ctxs > self.vf_context_pool:
            raise AdminError(VA.STATUS_ENOMEM, VA.STATUS_Q_NORESOURCE,
                             f"contexts {others} + {ctxs} > pool {self.vf_context_pool}")
        layout = self._place(n, mem)
        if layout is None:
            raise AdminError(VA.STATUS_ENOMEM, VA.STATUS_Q_NORESOURCE,
                             f"{mem:#x} bytes do not fit the VF memory pool")
        # Commit: partitions that moved (or changed size) are scrubbed.
        for i, base in layout.items():
            part = self.partitions[i - 1]
            size = mem if i == n else part.device_memory
            if base != part.base or size != part.device_memory:
                part.base, part.resources = base, replace(part.resources, device_memory=size)
                self.memory.scrub(base, size)
                if i != n:
                    dev = self.vf_devices[i - 1]
                    dev.reconfigure(self._vf_config(part.resources),
                                    self.memory.partition(base, size))
        part = self.partitions[n - 1]   # in `layout`: its device_memory is `mem` now
        part.resources = req
        dev = self.vf_devices[n - 1]
        dev.reconfigure(self._vf_config(req), self.memory.partition(part.base, mem))
        self._apply_sched(dev, req)
        self.tracer.emit("vf_resources", vf=n, device_memory=mem, queues=queues,
                         contexts=ctxs, weight=weight, priority=prio)

    def _place(self, n: int, size: int) -> dict[int, int] | None:
        """New bases {vf: base} for VF `n` at `size` (others unchanged if possible);
        None if the pool cannot hold it. Only VFs without a live driver move."""
        lo, hi = self.vf_pool
        cur = self.partitions[n - 1]
        others = [(p.base, p.base + p.device_memory) for i, p in enumerate(self.partitions)
                  if i != n - 1 and p.device_memory]
        total = sum(b - a for a, b in others) + size
        if total > hi - lo:
            return None
        if size <= cur.device_memory:
            return {n: cur.base}
        gap = _first_fit(sorted(others), lo, hi, size)
        if gap is not None:
            return {n: gap}
        # Repack: live VFs stay; every other VF (n included) is placed again.
        fixed, movable = [], [(size, n)]
        for i, p in enumerate(self.partitions, start=1):
            if i == n or not p.device_memory:
                continue
            if self.vf_functions[i - 1].status != 0 or not self.vf_devices[i - 1].processor.idle():
                fixed.append((p.base, p.base + p.device_memory))
            else:
                movable.append((p.device_memory, i))
        taken = sorted(fixed)
        layout: dict[int, int] = {}
        for sz, i in sorted(movable, key=lambda t: (-t[0], t[1])):
            base = _first_fit(taken, lo, hi, sz)
            if base is None:
                return None
            layout[i] = base
            taken = sorted(taken + [(base, base + sz)])
        return layout


def _first_fit(taken: list[tuple[int, int]], lo: int, hi: int, size: int) -> int | None:
    pos = lo
    for a, b in taken:
        if a - pos >= size:
            return pos
        pos = max(pos, b)
    return pos if hi - pos >= size else None
