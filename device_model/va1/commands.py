"""Command-buffer decoder and validator (spec §7).

Every command is decoded and checked before any runs; the first bad one fails the whole
buffer with its status and byte offset (`CommandError`). A good buffer comes out as a
list of `Command`s already resolved to zero-copy numpy views of device memory and to
their roofline cost, so the engine only has to do the math.

Everything the device does by opcode is one row of `OPS` (the opcode registry): how
the command is resolved, how it is executed, and what the engine may assume about it.
The decoder and the engine both dispatch through it and nowhere else.
"""
from __future__ import annotations

import math
import struct
from dataclasses import dataclass, field, replace
from enum import IntEnum
from functools import partial
from typing import Callable, NamedTuple

import numpy as np
from numpy.lib.stride_tricks import as_strided

from hwspec import isa
from hwspec.isa import DType, Opcode
from hwspec.va1 import Status

from ..errors import DeviceModelError
from ..ports import DmaFault, DmaPort
from ..testing_breaks import BREAKS
from .config import Va1Config
from .aspace import AddressSpace
from .memory import DeviceMemory
from .ops import execute as ex
from .ops import kernels
from .timing import roofline_ns

_U64 = 1 << 64
_HDR_FMT = isa.HEADER.format
_HDR_SIZE = isa.HEADER.size
_OPCODES = {int(o): o for o in Opcode}
_LENGTH = {o: isa.command_length(o) for o in Opcode}
_PAYLOAD_FMT = {o: isa.PAYLOAD[o].format for o in Opcode}
_NOP = Opcode.NOP
_NOP_V = int(Opcode.NOP)
_HDR_STRUCT = struct.Struct(isa.HEADER.format)
_MATH_DTYPES = isa.FLOAT_DTYPES
_GEMM_DTYPES = frozenset({DType.F32, DType.F16, DType.I8})
_ALL_DTYPES = frozenset(DType)
_DTYPE_VALUES = frozenset(int(d) for d in DType)
# Operand names that the command writes (every other device operand is only read).
_WRITTEN = frozenset({"dst", "C", "out", "y"})


class CommandError(DeviceModelError):
    """The first invalid command: status (hwspec.va1.Status) and its byte offset."""

    def __init__(self, status: Status, offset: int, message: str,
                 path: tuple[int, ...] = ()) -> None:
        super().__init__(f"{status.name} at offset {offset}: {message}")
        self.status = status
        self.offset = offset      # in the top-level buffer (of the outermost CALL)
        self.message = message
        self.path = path          # offsets inside each nested callee, outermost first


@dataclass(slots=True)
class Command:
    """One validated command, ready to run. A value: never changed after decode (runs of
    NOPs share their `Command`s across submissions, see `_nop_commands`)."""
    opcode: Opcode
    offset: int
    cost_ns: int
    # Resolved operands (which are set depends on the opcode).
    dst: np.ndarray | None = None          # device destination view
    src: np.ndarray | None = None          # device source view
    host_addr: int = 0                     # IOVA (H2D src, D2H dst, SIGNAL, TIMESTAMP)
    size: int = 0
    value: int = 0                         # FILL pattern, SIGNAL value
    dtype: DType = DType.F32
    activation: int = 0
    op: int = 0
    a: np.ndarray | None = None
    b: np.ndarray | None = None
    c: np.ndarray | None = None
    bias: np.ndarray | None = None
    alpha: float = 1.0
    beta: float = 0.0
    extra: dict[str, int] = field(default_factory=dict)
    run: Callable[[], None] | None = None  # its kernel, bound (operands, staging, budget)
    path: tuple[int, ...] = ()             # offsets inside nested callees (CALL)

    @property
    def host_bytes(self) -> int:
        """Bytes this command moves across the host link (for dma_bytes)."""
        return OPS[self.opcode].host_bytes(self)


class DecodeEnv(NamedTuple):
    """What validation depends on besides the buffer (a tuple: one is made per
    submission)."""
    config: Va1Config
    memory: DeviceMemory
    dma: DmaPort
    fp16: bool        # VA1_F_FP16 negotiated
    timestamp: bool   # VA1_F_TIMESTAMP negotiated
    int8: bool = False  # VA1_F_INT8 negotiated (I8 and I32 tensors)
    aspace: AddressSpace | None = None  # the context's address space (None: FLAT)
    cache: "ResolveCache | None" = None  # the context's resolved commands, if it keeps them


class ResolveCache:
    """A context's memo of resolved device-only commands (`OpSpec.device_only`, and DMAs
    whose host range is checked again on each use: `OpSpec.host_recheck`), keyed by
    their offset and exact bytes: such a command resolves from its bytes and the decode
    environment alone, so the same bytes in the same environment give the same Command
    (a value, as `_nop_commands` shares). A whole buffer made only of such commands and
    NOPs is kept too, under its exact bytes, with the host rechecks it owes (in command
    order), so a buffer submitted again costs one lookup and those rechecks instead of a
    walk. It is emptied whenever the environment may resolve differently: another
    config, memory or negotiated features, a change of the context's mappings
    (`AddressSpace.generation`); and when it is full."""

    MAX_ENTRIES = 1024
    MAX_BUFFER_BYTES = 1 << 20   # bytes of whole buffers kept (their keys)

    def __init__(self) -> None:
        self._entries: dict[tuple[int, bytes], Command] = {}
        self._buffers: dict[bytes, _KeptBuffer] = {}
        self._buffer_bytes = 0
        self._state: tuple[object, ...] = ()
        self._env: DecodeEnv | None = None   # the env of the last lookup

    def find(self, env: DecodeEnv, buf: bytes
             ) -> tuple[dict[tuple[int, bytes], Command], "_KeptBuffer | None"]:
        """What lookup answers, asking it only when `env` is not the last lookup's, its
        address space's generation moved since (`_state[3]`) or the memo is full:
        otherwise lookup would find its state unchanged and empty nothing."""
        aspace = env.aspace
        if (env is self._env and (aspace is None or aspace.generation == self._state[3])
                and len(self._entries) < self.MAX_ENTRIES):
            return self._entries, self._buffers.get(buf)
        return self.lookup(env, buf)

    def lookup(self, env: DecodeEnv, buf: bytes
               ) -> tuple[dict[tuple[int, bytes], Command], "_KeptBuffer | None"]:
        """The memo valid in `env` (emptied first if `env` differs from its own), and
        the kept decode of exactly `buf` in it, if any."""
        aspace = env.aspace
        state = (env.config, env.memory, aspace, -1 if aspace is None else aspace.generation,
                 env.fp16, env.timestamp, env.int8)
        old = self._state
        if (not old or old[0] is not state[0] or old[1] is not state[1]
                or old[2] is not state[2] or old[3:] != state[3:]
                or len(self._entries) >= self.MAX_ENTRIES):
            self._entries.clear()
            self._buffers.clear()
            self._buffer_bytes = 0
            self._state = state
        self._env = env
        return self._entries, self._buffers.get(buf)

    def keep_buffer(self, buf: bytes, cmds: list[Command],
                    rechecks: list[tuple[Command, Recheck]]) -> None:
        """Keep a top-level buffer's decode, every command of which may be kept (NOPs
        included), with the host rechecks its commands owe, in order."""
        if self._buffer_bytes + len(buf) > self.MAX_BUFFER_BYTES:
            self._buffers.clear()
            self._buffer_bytes = 0
            if len(buf) > self.MAX_BUFFER_BYTES:
                return
        self._buffers[buf] = _KeptBuffer(tuple(cmds), tuple(rechecks))
        self._buffer_bytes += len(buf)

    def __len__(self) -> int:
        return len(self._entries)


Recheck = Callable[["_Checker", Command], None]


class _KeptBuffer(NamedTuple):
    """A whole buffer's commands and the host rechecks each use owes, in order."""
    cmds: tuple[Command, ...]
    rechecks: tuple[tuple[Command, Recheck], ...]


class _Owed:
    """While a top-level buffer is decoded: the host rechecks its kept commands owe, in
    order, and whether every command in it may be kept (NOPs may: they come from their
    offset and the config alone)."""

    def __init__(self) -> None:
        self.rechecks: list[tuple[Command, Recheck]] = []
        self.whole = True


class _Checker:
    """The checks of one command at `offset`, `depth` CALLs deep."""

    def __init__(self, env: DecodeEnv, offset: int, depth: int = 0,
                 budget: "_Budget | None" = None) -> None:
        self.env = env
        self.offset = offset
        self.depth = depth
        self.budget = budget

    def fail(self, status: Status, message: str) -> CommandError:
        return CommandError(status, self.offset, message)

    def zero(self, value: int, what: str) -> None:
        if value:
            raise self.fail(Status.BAD_ARG, f"{what} = {value:#x}, must be 0")

    def dtype(self, value: int, allowed: frozenset[DType] = _MATH_DTYPES) -> DType:
        if value not in _DTYPE_VALUES and not (BREAKS and "cmd/skip-dtype-check" in BREAKS):
            raise self.fail(Status.BAD_DTYPE, f"unknown dtype {value}")
        dt = DType(value)
        if not self.env.config.dtype_mask >> dt & 1 or dt not in allowed:
            raise self.fail(Status.BAD_DTYPE, f"dtype {dt.name} not supported here")
        if dt == DType.F16 and not self.env.fp16:
            raise self.fail(Status.BAD_DTYPE, "F16 without VA1_F_FP16 negotiated")
        if dt in isa.INT_DTYPES and not self.env.int8:
            raise self.fail(Status.BAD_DTYPE, f"{dt.name} without VA1_F_INT8 negotiated")
        return dt

    def enum(self, enum: type[IntEnum], value: int, what: str) -> int:
        if value not in enum.__members__.values():
            raise self.fail(Status.BAD_ARG, f"{what} {value}")
        return value

    def shape(self, **dims: int) -> None:
        for name, v in dims.items():
            if v == 0:
                raise self.fail(Status.BAD_SHAPE, f"{name} = 0")

    def typed(self, addr: int, dt: DType, shape: tuple[int, ...], what: str) -> np.ndarray:
        """A zero-copy view of a dense tensor, after the size and bounds checks."""
        size = self.nbytes(*shape, isa.DTYPE_SIZE[dt])
        return self.device(addr, size, what).view(isa.DTYPE_NUMPY[dt]).reshape(shape)

    def nbytes(self, *factors: int) -> int:
        n = 1
        for f in factors:
            n *= f
        if n == 0:
            raise self.fail(Status.BAD_SHAPE, "zero size")
        if n >= _U64:
            raise self.fail(Status.BAD_SHAPE, f"byte size {n:#x} overflows 64 bits")
        return n

    def device(self, addr: int, size: int, what: str,
               written: bool | None = None) -> np.ndarray:
        """A device operand: a context VA range, translated through the context's
        mappings (destinations need WRITE, sources READ) to function memory; `written`
        overrides the guess from the operand's name."""
        env = self.env
        aspace = env.aspace
        if aspace is not None and not (BREAKS and "ctx/ignore-address-space" in BREAKS):
            w = what in _WRITTEN if written is None else written
            pa = aspace.translate(addr, size, w)
            if pa < 0:
                raise self.fail(Status.OUT_OF_BOUNDS,
                                f"{what} [{addr:#x}, +{size:#x}) not inside one "
                                f"{'writable' if w else 'readable'} "
                                "mapping of the context")
            addr = pa
        mem = env.memory
        view = mem.view_in(addr, size)
        if view is not None:
            return view
        if not (BREAKS and "cmd/skip-partition-check" in BREAKS):
            raise self.fail(Status.OUT_OF_BOUNDS,
                            f"{what} [{addr:#x}, +{size:#x}) outside device memory "
                            f"({mem.size:#x})")
        return mem.bytes_view(addr, size)  # raises ValueError

    def host(self, iova: int, size: int, what: str) -> None:
        if iova + size > _U64:
            raise self.fail(Status.DMA_FAULT, f"{what} {iova:#x}+{size:#x} overflows")
        try:
            self.env.dma.view(iova, size)
        except DmaFault as e:
            raise self.fail(Status.DMA_FAULT, f"{what}: {e}") from None


class _Budget:
    """Bytes of the expanded submission so far (CALL expansion bound)."""

    def __init__(self, used: int, limit: int) -> None:
        self.used = used
        self.limit = limit


def _top_budget(buf: bytes, env: DecodeEnv) -> _Budget:
    """The CALL expansion budget of a top-level buffer."""
    return _Budget(len(buf), isa.CALL_EXPANSION_FACTOR * env.config.max_cmdbuf_size)


def decode(buf: bytes, env: DecodeEnv) -> list[Command]:
    """Validate a whole command buffer, every callee included; raises CommandError for
    the first bad command (a callee's error carries the offset of the top-level CALL)."""
    cache = env.cache
    if cache is None or type(buf) is not bytes or BREAKS:
        return _decode(buf, env, 0, _top_budget(buf, env))
    memo, kept = cache.find(env, buf)
    if kept is None:
        owed = _Owed()
        cmds = _decode(buf, env, 0, _top_budget(buf, env), memo, owed)
        if owed.whole:
            cache.keep_buffer(buf, cmds, owed.rechecks)
        return cmds
    # The same bytes decoded in this same environment: every command would be a memo
    # hit (or a NOP made the same way), so only the host rechecks are left, in order.
    if kept.rechecks:
        ck = _Checker(env, 0, 0, _top_budget(buf, env))
        for cmd, recheck in kept.rechecks:
            ck.offset = cmd.offset
            recheck(ck, cmd)
    return list(kept.cmds)


# A run of NOPs is found a power-of-two block of minimal NOPs (header only, no flags) at
# a time; the Commands of such NOPs at offsets 0, 8, 16 ... are built once per cost.
_MIN_NOP = _HDR_STRUCT.pack(_NOP_V, 0, _HDR_SIZE)
_NOP_BLOCKS = [_MIN_NOP * (1 << i) for i in range(13)]
_NOP_TOP = len(_NOP_BLOCKS) - 1
_NOP_CACHE_MAX = 1 << 16
_nop_cache: dict[int, list[Command]] = {}


def _nop_run(buf: bytes, pos: int) -> int:
    """How many minimal NOPs follow at `pos` (gallop up, then down, by blocks)."""
    startswith = buf.startswith
    if not startswith(_MIN_NOP, pos):
        return 0
    k = 1
    i = 1
    end = len(buf)
    while pos + k * _HDR_SIZE < end:
        if startswith(_NOP_BLOCKS[i], pos + k * _HDR_SIZE):
            k += 1 << i
            if i < _NOP_TOP:
                i += 1
        elif i == 0:
            break
        else:
            i -= 1
    return k


def _nop_commands(cost: int, pos: int, k: int) -> list[Command]:
    """The Commands of `k` minimal NOPs at `pos`, `pos + 8` ...: shared ones from the
    cache (offsets below _NOP_CACHE_MAX), fresh ones beyond it."""
    first = pos // _HDR_SIZE
    cached = _nop_cache.get(cost)
    if cached is not None and first + k <= len(cached):
        return cached[first:first + k]
    if cached is None:
        cached = _nop_cache[cost] = []
    want = min(first + k, _NOP_CACHE_MAX // _HDR_SIZE)
    if len(cached) < want:
        cached.extend(Command(_NOP, j * _HDR_SIZE, cost) for j in range(len(cached), want))
    out = cached[first:first + k]
    if len(out) < k:
        out.extend(Command(_NOP, j * _HDR_SIZE, cost)
                   for j in range(first + len(out), first + k))
    return out


def _decode(buf: bytes, env: DecodeEnv, depth: int, budget: _Budget,
            memo: dict[tuple[int, bytes], Command] | None = None,
            owed: "_Owed | None" = None) -> list[Command]:
    """The commands of `buf`; kept ones are taken from and put into `memo`, and what
    keeping the whole buffer takes is noted in `owed` (see `decode`)."""
    cmds: list[Command] = []
    pos = 0
    end = len(buf)
    nop_cost = roofline_ns(env.config.cmd_overhead_ns)
    unpack = _HDR_STRUCT.unpack_from
    append = cmds.append
    hdr, align = _HDR_SIZE, isa.ALIGN
    startswith = buf.startswith
    rck: _Checker | None = None   # the checker of the host rechecks, made once
    while pos < end:
        # Fast paths for runs of valid NOPs: exactly what OPS[NOP].resolve would build.
        if startswith(_MIN_NOP, pos):
            k = _nop_run(buf, pos)
            cmds.extend(_nop_commands(nop_cost, pos, k))
            pos += k * _HDR_SIZE
            if pos >= end:
                break
        if end - pos >= hdr:
            opcode_v, flags, length = unpack(buf, pos)
            if (opcode_v == _NOP_V and not flags and length >= hdr and not length % align
                    and pos + length <= end):
                append(Command(_NOP, pos, nop_cost))
                pos += length
                continue
            if memo is not None:
                # The same bytes at the same offset passed every check below in this
                # same environment (a shorter, truncated slice cannot equal a kept
                # command's bytes).
                hit = memo.get((pos, buf[pos:pos + length]))
                if hit is not None:
                    recheck = _KEPT[hit.opcode]
                    if recheck is not None:
                        if rck is None:
                            rck = _Checker(env, pos, depth, budget)
                        rck.offset = pos
                        recheck(rck, hit)
                        if owed is not None:
                            owed.rechecks.append((hit, recheck))
                    append(hit)
                    pos += length
                    continue
        ck = _Checker(env, pos, depth, budget)
        if end - pos < _HDR_SIZE:
            raise ck.fail(Status.TRUNCATED, "no room for a header")
        opcode_v, flags, length = struct.unpack_from(_HDR_FMT, buf, pos)
        if pos + length > end:
            raise ck.fail(Status.TRUNCATED, f"length {length} runs past the buffer end {end}")
        opcode = _OPCODES.get(opcode_v)
        if opcode is None or (opcode == Opcode.TIMESTAMP and not env.timestamp):
            raise ck.fail(Status.BAD_OPCODE, f"opcode {opcode_v:#x}")
        if length < _HDR_SIZE or length % isa.ALIGN or (
                opcode != Opcode.NOP and length != _LENGTH[opcode]):
            raise ck.fail(Status.BAD_LENGTH, f"length {length} for {opcode.name}")
        payload = struct.unpack_from(_PAYLOAD_FMT[opcode], buf, pos + _HDR_SIZE)
        resolve(ck, opcode, flags, payload, cmds)
        if memo is not None and opcode in _KEPT:
            memo[(pos, buf[pos:pos + length])] = cmds[-1]
            if owed is not None and (recheck := _KEPT[opcode]) is not None:
                owed.rechecks.append((cmds[-1], recheck))
        elif owed is not None:
            owed.whole = False
        pos += length
    return cmds


def resolve(ck: _Checker, opcode: Opcode, flags: int, p: tuple,  # type: ignore[type-arg]
            out: list[Command]) -> None:
    """Check one decoded command (header flags, then its opcode's own rules) and append
    what it resolves to (a CALL: itself, then its callee's commands)."""
    spec = OPS[opcode]
    if not spec.checks_flags:
        ck.zero(flags, "header flags")
    spec.resolve(ck, flags, p, out)


def _resolve_nop(ck: _Checker, flags: int, p: tuple) -> Command:  # type: ignore[type-arg]
    return Command(Opcode.NOP, ck.offset, roofline_ns(ck.env.config.cmd_overhead_ns))


def _resolve_fill(ck: _Checker, flags: int, p: tuple) -> Command:  # type: ignore[type-arg]
    cfg = ck.env.config
    dst, size, pattern, reserved = p
    ck.zero(reserved, "reserved")
    if size == 0 or size % 4:
        raise ck.fail(Status.BAD_SHAPE, f"FILL size {size} not a non-zero multiple of 4")
    view = ck.device(dst, size, "dst")
    return Command(Opcode.FILL, ck.offset,
                   roofline_ns(cfg.cmd_overhead_ns, nbytes=size, bandwidth=cfg.mem_bandwidth),
                   dst=view, size=size, value=pattern)


def _dma_size(ck: _Checker, p: tuple) -> tuple[int, int, int]:  # type: ignore[type-arg]
    src, dst, size = p
    if size == 0:
        raise ck.fail(Status.BAD_SHAPE, "zero size")
    return src, dst, size


def _resolve_dma_h2d(ck: _Checker, flags: int, p: tuple) -> Command:  # type: ignore[type-arg]
    cfg = ck.env.config
    src, dst, size = _dma_size(ck, p)
    dview = ck.device(dst, size, "dst")
    ck.host(src, size, "src")
    return Command(Opcode.DMA_H2D, ck.offset,
                   roofline_ns(cfg.cmd_overhead_ns, nbytes=size, bandwidth=cfg.link_bandwidth),
                   dst=dview, host_addr=src, size=size)


def _recheck_h2d(ck: _Checker, cmd: Command) -> None:
    ck.host(cmd.host_addr, cmd.size, "src")


def _recheck_d2h(ck: _Checker, cmd: Command) -> None:
    ck.host(cmd.host_addr, cmd.size, "dst")


def _resolve_dma_d2h(ck: _Checker, flags: int, p: tuple) -> Command:  # type: ignore[type-arg]
    cfg = ck.env.config
    src, dst, size = _dma_size(ck, p)
    sview = ck.device(src, size, "src")
    ck.host(dst, size, "dst")
    return Command(Opcode.DMA_D2H, ck.offset,
                   roofline_ns(cfg.cmd_overhead_ns, nbytes=size, bandwidth=cfg.link_bandwidth),
                   src=sview, host_addr=dst, size=size)


def _resolve_dma_d2d(ck: _Checker, flags: int, p: tuple) -> Command:  # type: ignore[type-arg]
    cfg = ck.env.config
    src, dst, size = _dma_size(ck, p)
    sview = ck.device(src, size, "src")
    dview = ck.device(dst, size, "dst")
    return Command(Opcode.DMA_D2D, ck.offset,
                   roofline_ns(cfg.cmd_overhead_ns, nbytes=2 * size,
                               bandwidth=cfg.mem_bandwidth),
                   src=sview, dst=dview, size=size,
                   run=partial(kernels.move, sview, dview,
                               budget=cfg.work_memory_size * 3 // 4))


def _resolve_fence(opcode: Opcode) -> "_OneResolver":
    """SIGNAL and WAIT: a host u64 and a value."""
    def resolve_fence(ck: _Checker, flags: int, p: tuple) -> Command:  # type: ignore[type-arg]
        addr, value = p
        ck.host(addr, 8, "addr")
        return Command(opcode, ck.offset, roofline_ns(ck.env.config.cmd_overhead_ns),
                       host_addr=addr, value=value)
    return resolve_fence


def _resolve_timestamp(ck: _Checker, flags: int, p: tuple) -> Command:  # type: ignore[type-arg]
    (addr,) = p
    ck.host(addr, 8, "addr")
    return Command(Opcode.TIMESTAMP, ck.offset, roofline_ns(ck.env.config.cmd_overhead_ns),
                   host_addr=addr)


def _peak(cfg: Va1Config, dt: DType) -> int:
    """Peak ops/s for a dtype: f16 twice f32, int8 four times."""
    return cfg.peak_flops * {DType.F16: 2, DType.I8: 4}.get(dt, 1)


def _cost(ck: _Checker, dt: DType, flops: int, nbytes: int) -> int:
    """The roofline cost; over max_command_flops is WORK_LIMIT (rule `work/flops`)."""
    cfg = ck.env.config
    if flops > cfg.max_command_flops:
        raise ck.fail(Status.WORK_LIMIT, f"work/flops: {flops} flops > max_command_flops "
                                         f"{cfg.max_command_flops}")
    return roofline_ns(cfg.cmd_overhead_ns, flops=flops, peak_flops=_peak(cfg, dt),
                       nbytes=nbytes, bandwidth=cfg.mem_bandwidth)


def _same_view(a: np.ndarray, b: np.ndarray) -> bool:
    return (a.__array_interface__["data"][0] == b.__array_interface__["data"][0]
            and a.dtype == b.dtype and a.shape == b.shape and a.strides == b.strides)


def _bind(ck: _Checker, kernel: Callable[..., None], operands: dict[str, np.ndarray | None],
          out: str, in_place: frozenset[str] = frozenset(), **kw: object) -> Callable[[], None]:
    """The command's kernel bound to its operands and its host-memory budget (spec §7,
    "Work bounds"). Inputs that overlap the output other than in place (the very same
    view, where each output reads only itself) are staged: copied before the kernel
    runs. Staging more than half of work_memory_size is WORK_LIMIT (rule `work/memory`);
    the kernel tiles within three quarters of what is left."""
    mem = ck.env.config.work_memory_size
    o = operands[out]
    assert o is not None
    snapshot: list[str] = []
    staged = 0
    for name, v in operands.items():
        if name == out or v is None or not np.may_share_memory(v, o):
            continue
        if name in in_place and _same_view(v, o):
            continue
        snapshot.append(name)
        staged += v.size * v.itemsize
    if staged > mem // 2:
        raise ck.fail(Status.WORK_LIMIT, f"work/memory: {'+'.join(snapshot)} overlapping "
                                         f"{out} need {staged} bytes of staging > "
                                         f"work_memory_size / 2 ({mem // 2})")
    return partial(kernels.staged, kernel, operands, tuple(snapshot),
                   (mem - staged) * 3 // 4, **kw)


def _finite_f32(ck: _Checker, value: float, what: str, positive: bool = False) -> None:
    if not math.isfinite(value) or value < 0 or (positive and value == 0):
        kind = "finite and > 0" if positive else "finite and >= 0"
        raise ck.fail(Status.BAD_ARG, f"{what} = {value!r}, must be {kind}")


def _gemm_args(ck: _Checker, what: str, dtype_v: int, act: int,
               alpha: float, beta: float) -> DType:
    """The checks GEMM and GEMM_BATCHED share after flags and reserved fields:
    activation, dtype, I8 arguments."""
    ck.enum(isa.Activation, act, "activation")
    dt = ck.dtype(dtype_v, _GEMM_DTYPES)
    if dt == DType.I8:
        if act not in (isa.Activation.NONE, isa.Activation.RELU):
            raise ck.fail(Status.BAD_ARG, f"activation {act} with I8 (NONE or RELU only)")
        if alpha != 1.0 or beta not in (0.0, 1.0):
            raise ck.fail(Status.BAD_ARG, f"I8 {what} alpha={alpha} beta={beta} "
                                          "(alpha 1, beta 0 or 1)")
    return dt


def _resolve_gemm(ck: _Checker, flags: int, p: tuple) -> Command:  # type: ignore[type-arg]
    dtype_v, act, reserved, m, n, k, a, b, c, bias, alpha, beta = p
    if flags & ~isa.GEMM_FLAGS_ALL:
        raise ck.fail(Status.BAD_ARG, f"GEMM flags {flags:#x}")
    ck.zero(reserved, "reserved")
    dt = _gemm_args(ck, "GEMM", dtype_v, act, alpha, beta)
    es = isa.DTYPE_SIZE[dt]
    out_dt = DType.I32 if dt == DType.I8 else dt
    oes = isa.DTYPE_SIZE[out_dt]
    if m == 0 or n == 0 or k == 0:
        raise ck.fail(Status.BAD_SHAPE, f"GEMM m={m} n={n} k={k}")
    a_bytes = ck.nbytes(m, k, es)
    b_bytes = ck.nbytes(k, n, es)
    c_bytes = ck.nbytes(m, n, oes)
    npdt = np.dtype(isa.DTYPE_NUMPY[dt])
    av = ck.device(a, a_bytes, "A").view(npdt)
    bv = ck.device(b, b_bytes, "B").view(npdt)
    cv = ck.device(c, c_bytes, "C").view(isa.DTYPE_NUMPY[out_dt]).reshape(m, n)
    av = av.reshape(k, m).T if flags & isa.GEMM_TRANS_A else av.reshape(m, k)
    bv = bv.reshape(n, k).T if flags & isa.GEMM_TRANS_B else bv.reshape(k, n)
    biasv = None
    bias_bytes = 0
    if flags & isa.GEMM_BIAS:
        bias_bytes = ck.nbytes(n, oes)
        biasv = ck.device(bias, bias_bytes, "bias").view(isa.DTYPE_NUMPY[out_dt])
    nbytes = a_bytes + b_bytes + c_bytes + (c_bytes if beta != 0 else 0) + bias_bytes
    cost = _cost(ck, dt, 2 * m * n * k, nbytes)
    operands = {"a": av, "b": bv, "c": cv, "bias": biasv}
    if dt == DType.I8:
        run = _bind(ck, kernels.gemm_i8, operands, "c", accumulate=beta == 1.0,
                    relu=act == isa.Activation.RELU)
    else:
        run = _bind(ck, kernels.gemm, operands, "c", alpha=alpha, beta=beta, activation=act)
    return Command(Opcode.GEMM, ck.offset, cost, dtype=dt, activation=act, a=av, b=bv, c=cv,
                   bias=biasv, alpha=alpha, beta=beta, extra={"m": m, "n": n, "k": k},
                   run=run)


def _strided(ck: _Checker, addr: int, npdt: np.dtype,
             shape: tuple[int, int, int], strides: tuple[int, int, int], what: str
             ) -> tuple[np.ndarray, int]:
    """A [batch, rows, cols] view with element strides (extent-1 dimensions ignore
    theirs), after the range check of its exact extent; and that extent in bytes."""
    st = tuple(s if d > 1 else 0 for d, s in zip(shape, strides))
    ext = ck.nbytes(sum((d - 1) * s for d, s in zip(shape, st)) + 1, npdt.itemsize)
    base = ck.device(addr, ext, what).view(npdt)
    return as_strided(base, shape, tuple(s * npdt.itemsize for s in st),
                      writeable=what == "C"), ext


def _resolve_gemm_batched(ck: _Checker, flags: int, p: tuple) -> Command:  # type: ignore[type-arg]
    (dtype_v, act, reserved, batch, m, n, k, reserved2, a, b, c, bias,
     lda, ldb, ldc, sa, sb, sc, alpha, beta) = p
    if flags & ~isa.GEMM_FLAGS_ALL:
        raise ck.fail(Status.BAD_ARG, f"GEMM_BATCHED flags {flags:#x}")
    ck.zero(reserved, "reserved")
    ck.zero(reserved2, "reserved2")
    dt = _gemm_args(ck, "GEMM_BATCHED", dtype_v, act, alpha, beta)
    if batch == 0 or m == 0 or n == 0 or k == 0:
        raise ck.fail(Status.BAD_SHAPE, f"GEMM_BATCHED batch={batch} m={m} n={n} k={k}")
    if batch > isa.GEMM_BATCHED_MAX_BATCH:
        raise ck.fail(Status.BAD_SHAPE, f"GEMM_BATCHED batch {batch} > "
                                        f"{isa.GEMM_BATCHED_MAX_BATCH}")
    # C's elements must be distinct (the COPY destination rule on (batch, m, n)).
    span = 1
    for st, d in sorted((st, d) for st, d in ((sc, batch), (ldc, m), (1, n)) if d > 1):
        if st < span:
            raise ck.fail(Status.BAD_SHAPE, "C strides (stride_c, ldc) make elements "
                                            "overlap")
        span = st * d
    out_dt = DType.I32 if dt == DType.I8 else dt
    npdt, onpdt = np.dtype(isa.DTYPE_NUMPY[dt]), np.dtype(isa.DTYPE_NUMPY[out_dt])
    ta, tb = bool(flags & isa.GEMM_TRANS_A), bool(flags & isa.GEMM_TRANS_B)
    av, a_ext = _strided(ck, a, npdt, (batch, k, m) if ta else (batch, m, k), (sa, lda, 1),
                         "A")
    bv, b_ext = _strided(ck, b, npdt, (batch, n, k) if tb else (batch, k, n), (sb, ldb, 1),
                         "B")
    cv, c_ext = _strided(ck, c, onpdt, (batch, m, n), (sc, ldc, 1), "C")
    av = av.transpose(0, 2, 1) if ta else av
    bv = bv.transpose(0, 2, 1) if tb else bv
    biasv = None
    bias_bytes = 0
    if flags & isa.GEMM_BIAS:
        bias_bytes = ck.nbytes(n, onpdt.itemsize)
        biasv = ck.device(bias, bias_bytes, "bias").view(onpdt)
    es, oes = npdt.itemsize, onpdt.itemsize
    # roofline bytes: an operand shared by every batch (batch stride 0) is read once
    a_bytes = m * k * es * (1 if sa == 0 else batch)
    b_bytes = k * n * es * (1 if sb == 0 else batch)
    c_bytes = batch * m * n * oes
    nbytes = a_bytes + b_bytes + c_bytes + (c_bytes if beta != 0 else 0) + bias_bytes
    cost = _cost(ck, dt, 2 * batch * m * n * k, nbytes)
    operands = {"a": av, "b": bv, "c": cv, "bias": biasv}
    if dt == DType.I8:
        run = _bind(ck, kernels.gemm_batched, operands, "c", alpha=1.0, beta=beta,
                    activation=act)
    else:
        run = _bind(ck, kernels.gemm_batched, operands, "c", alpha=alpha, beta=beta,
                    activation=act)
    return Command(Opcode.GEMM_BATCHED, ck.offset, cost, dtype=dt, activation=act, a=av,
                   b=bv, c=cv, bias=biasv, alpha=alpha, beta=beta,
                   extra={"batch": batch, "m": m, "n": n, "k": k}, run=run)


def _resolve_elementwise(ck: _Checker, flags: int, p: tuple) -> Command:  # type: ignore[type-arg]
    op, dtype_v, reserved, cols, count, a, b, out = p
    if flags & ~isa.ELT_FLAGS_ALL:
        raise ck.fail(Status.BAD_ARG, f"ELEMENTWISE flags {flags:#x}")
    ck.zero(reserved, "reserved")
    ck.enum(isa.EltOp, op, "elementwise op")
    unary = op in isa.UNARY_ELT_OPS
    bcast = bool(flags & isa.ELT_BROADCAST_B)
    if bcast and unary:
        raise ck.fail(Status.BAD_ARG, f"BROADCAST_B with unary {isa.EltOp(op).name}")
    if not bcast:
        ck.zero(cols, "cols (without BROADCAST_B)")
    dt = ck.dtype(dtype_v)
    es = isa.DTYPE_SIZE[dt]
    if count == 0:
        raise ck.fail(Status.BAD_SHAPE, "zero count")
    if bcast and (cols == 0 or count % cols):
        raise ck.fail(Status.BAD_SHAPE, f"count {count} not a multiple of cols {cols}")
    size = ck.nbytes(count, es)
    npdt = np.dtype(isa.DTYPE_NUMPY[dt])
    av = ck.device(a, size, "a").view(npdt)
    b_size = 0 if unary else (cols * es if bcast else size)
    bv = None if unary else ck.device(b, b_size, "b").view(npdt)
    ov = ck.device(out, size, "out").view(npdt)
    if bcast:
        av = av.reshape(count // cols, cols)
        ov = ov.reshape(count // cols, cols)
    cost = _cost(ck, dt, count, 2 * size + b_size)
    run = _bind(ck, kernels.elementwise, {"a": av, "b": bv, "out": ov}, "out",
                frozenset({"a"} if bcast else {"a", "b"}), op=op)
    return Command(Opcode.ELEMENTWISE, ck.offset, cost, dtype=dt, op=op, a=av, b=bv, dst=ov,
                   size=size, run=run)


def _resolve_compare(ck: _Checker, flags: int, p: tuple) -> Command:  # type: ignore[type-arg]
    op, dtype_v, reserved, cols, count, a, b, out = p
    if flags & ~isa.CMP_FLAGS_ALL:
        raise ck.fail(Status.BAD_ARG, f"COMPARE flags {flags:#x}")
    ck.zero(reserved, "reserved")
    ck.enum(isa.CmpOp, op, "compare op")
    unary = op in isa.UNARY_CMP_OPS
    bcast = bool(flags & isa.CMP_BROADCAST_B)
    if bcast and unary:
        raise ck.fail(Status.BAD_ARG, f"BROADCAST_B with unary {isa.CmpOp(op).name}")
    if not bcast:
        ck.zero(cols, "cols (without BROADCAST_B)")
    dt = ck.dtype(dtype_v, _ALL_DTYPES)
    ck.dtype(DType.I8, _ALL_DTYPES)          # the mask it writes
    if count == 0:
        raise ck.fail(Status.BAD_SHAPE, "zero count")
    if bcast and (cols == 0 or count % cols):
        raise ck.fail(Status.BAD_SHAPE, f"count {count} not a multiple of cols {cols}")
    es = isa.DTYPE_SIZE[dt]
    size = ck.nbytes(count, es)
    npdt = np.dtype(isa.DTYPE_NUMPY[dt])
    av = ck.device(a, size, "a").view(npdt)
    b_size = 0 if unary else (cols * es if bcast else size)
    bv = None if unary else ck.device(b, b_size, "b").view(npdt)
    ov = ck.device(out, ck.nbytes(count), "out").view(np.int8)
    if bcast:
        av = av.reshape(count // cols, cols)
        ov = ov.reshape(count // cols, cols)
    cost = _cost(ck, dt, count, size + b_size + count)
    run = _bind(ck, kernels.compare, {"a": av, "b": bv, "out": ov}, "out",
                frozenset({"a"} if bcast else {"a", "b"}), op=op)
    return Command(Opcode.COMPARE, ck.offset, cost, dtype=dt, op=op, a=av, b=bv, dst=ov,
                   size=count, run=run)


def _resolve_select(ck: _Checker, flags: int, p: tuple) -> Command:  # type: ignore[type-arg]
    dtype_v, reserved, reserved2, reserved3, count, cond, a, b, out = p
    ck.zero(reserved, "reserved")
    ck.zero(reserved2, "reserved2")
    ck.zero(reserved3, "reserved3")
    dt = ck.dtype(dtype_v, _ALL_DTYPES)
    ck.dtype(DType.I8, _ALL_DTYPES)          # the condition mask
    if count == 0:
        raise ck.fail(Status.BAD_SHAPE, "zero count")
    size = ck.nbytes(count, isa.DTYPE_SIZE[dt])
    npdt = np.dtype(isa.DTYPE_NUMPY[dt])
    cv = ck.device(cond, ck.nbytes(count), "cond").view(np.int8)
    av = ck.device(a, size, "a").view(npdt)
    bv = ck.device(b, size, "b").view(npdt)
    ov = ck.device(out, size, "out").view(npdt)
    cost = _cost(ck, dt, count, 3 * size + count)
    run = _bind(ck, kernels.select, {"cond": cv, "a": av, "b": bv, "out": ov}, "out",
                frozenset({"cond", "a", "b"}))
    return Command(Opcode.SELECT, ck.offset, cost, dtype=dt, a=av, b=bv, dst=ov, size=size,
                   run=run)


def _resolve_copy(ck: _Checker, flags: int, p: tuple) -> Command:  # type: ignore[type-arg]
    dtype_v, ndim, reserved, reserved2, src, dst = p[:6]
    shape_all, sst_all, dst_all = p[6:10], p[10:14], p[14:18]
    ck.zero(reserved, "reserved")
    ck.zero(reserved2, "reserved2")
    if not 1 <= ndim <= isa.COPY_MAX_DIMS:
        raise ck.fail(Status.BAD_ARG, f"ndim {ndim}")
    for i in range(ndim, isa.COPY_MAX_DIMS):
        ck.zero(shape_all[i], f"shape{i} (beyond ndim)")
        ck.zero(sst_all[i], f"src_stride{i} (beyond ndim)")
        ck.zero(dst_all[i], f"dst_stride{i} (beyond ndim)")
    dt = ck.dtype(dtype_v, _ALL_DTYPES)
    es = isa.DTYPE_SIZE[dt]
    shape = tuple(shape_all[:ndim])
    ck.shape(**{f"shape{i}": v for i, v in enumerate(shape)})
    count = ck.nbytes(*shape)
    # Dimensions of extent 1 contribute no offset: their strides are ignored (0).
    sst = tuple(st if d > 1 else 0 for d, st in zip(shape, sst_all))
    dstr = tuple(st if d > 1 else 0 for d, st in zip(shape, dst_all))
    # dst must not write one element twice: sorted by stride, every dimension must
    # step over the whole extent of the smaller ones.
    span = 1
    for st, d in sorted((st, d) for st, d in zip(dstr, shape) if d > 1):
        if st < span:
            raise ck.fail(Status.BAD_SHAPE, "dst strides make elements overlap")
        span = st * d

    def extent(strides: tuple[int, ...]) -> int:
        return ck.nbytes(sum((d - 1) * st for d, st in zip(shape, strides)) + 1, es)

    s_ext, d_ext = extent(sst), extent(dstr)
    npdt = np.dtype(isa.DTYPE_NUMPY[dt])
    sbase = ck.device(src, s_ext, "src").view(npdt)
    dbase = ck.device(dst, d_ext, "dst").view(npdt)
    sv = as_strided(sbase, shape, tuple(st * es for st in sst), writeable=False)
    dv = as_strided(dbase, shape, tuple(st * es for st in dstr))
    nbytes = 2 * count * es
    cost = roofline_ns(ck.env.config.cmd_overhead_ns, nbytes=nbytes,
                       bandwidth=ck.env.config.mem_bandwidth)
    return Command(Opcode.COPY, ck.offset, cost, dtype=dt, src=sv, dst=dv, size=count * es,
                   run=_bind(ck, kernels.copy, {"src": sv, "dst": dv}, "dst"))


def _resolve_conv2d(ck: _Checker, flags: int, p: tuple) -> Command:  # type: ignore[type-arg]
    (dtype_v, act, reserved, groups, n, c, h, w, k, r, s, sh, sw, dh, dw,
     pt, pl, pb, pr, reserved2, x, wgt, bias, y) = p
    if flags & ~isa.CONV_FLAGS_ALL:
        raise ck.fail(Status.BAD_ARG, f"CONV2D flags {flags:#x}")
    ck.zero(reserved, "reserved")
    ck.zero(reserved2, "reserved2")
    ck.enum(isa.Activation, act, "activation")
    dt = ck.dtype(dtype_v)
    ck.shape(groups=groups, n=n, c=c, h=h, w=w, k=k, r=r, s=s, stride_h=sh, stride_w=sw,
             dilation_h=dh, dilation_w=dw)
    if c % groups or k % groups:
        raise ck.fail(Status.BAD_SHAPE, f"c={c} and k={k} not multiples of groups={groups}")
    ext_h, ext_w = dh * (r - 1) + 1, dw * (s - 1) + 1
    if max(pt, pb) >= ext_h or max(pl, pr) >= ext_w:
        raise ck.fail(Status.BAD_SHAPE, f"padding ({pt},{pl},{pb},{pr}) not below the "
                                        f"dilated kernel extent ({ext_h},{ext_w})")
    if h + pt + pb < ext_h or w + pl + pr < ext_w:
        raise ck.fail(Status.BAD_SHAPE, "kernel larger than the padded input")
    oh = (h + pt + pb - ext_h) // sh + 1
    ow = (w + pl + pr - ext_w) // sw + 1
    cg = c // groups
    xv = ck.typed(x, dt, (n, c, h, w), "x")
    wv = ck.typed(wgt, dt, (k, cg, r, s), "weight")
    bv = ck.typed(bias, dt, (k,), "bias") if flags & isa.CONV_BIAS else None
    yv = ck.typed(y, dt, (n, k, oh, ow), "y")
    nbytes = xv.nbytes + wv.nbytes + yv.nbytes + (0 if bv is None else bv.nbytes)
    cost = _cost(ck, dt, 2 * n * k * oh * ow * cg * r * s, nbytes)
    run = _bind(ck, kernels.conv2d, {"x": xv, "w": wv, "bias": bv, "y": yv}, "y",
                groups=groups, stride=(sh, sw), dilation=(dh, dw), pads=(pt, pl, pb, pr),
                activation=act)
    return Command(Opcode.CONV2D, ck.offset, cost, dtype=dt, activation=act, run=run,
                   extra={"oh": oh, "ow": ow})


def pool2d_output(h: int, pt: int, pb: int, ext: int, stride: int, ceil: bool) -> int:
    """Output extent of one POOL2D axis (spec §7): floor, or with POOL_CEIL rounded up
    unless the last window would start past the input and its start padding."""
    span = h + pt + pb - ext
    if not ceil:
        return span // stride + 1
    out = -(-span // stride) + 1
    if (out - 1) * stride >= h + pt:
        out -= 1
    return out


def _resolve_pool2d(ck: _Checker, flags: int, p: tuple) -> Command:  # type: ignore[type-arg]
    (dtype_v, op, reserved, n, c, h, w, reserved2, r, s, sh, sw, dh, dw,
     pt, pl, pb, pr, reserved3, x, y) = p
    if flags & ~isa.POOL_FLAGS_ALL:
        raise ck.fail(Status.BAD_ARG, f"POOL2D flags {flags:#x}")
    ck.zero(reserved, "reserved")
    ck.zero(reserved2, "reserved2")
    ck.zero(reserved3, "reserved3")
    ck.enum(isa.PoolOp, op, "pool op")
    if flags & isa.POOL_COUNT_INCLUDE_PAD and op != isa.PoolOp.AVG:
        raise ck.fail(Status.BAD_ARG, "COUNT_INCLUDE_PAD with MAX")
    dt = ck.dtype(dtype_v)
    ck.shape(n=n, c=c, h=h, w=w, r=r, s=s, stride_h=sh, stride_w=sw, dilation_h=dh,
             dilation_w=dw)
    ext_h, ext_w = dh * (r - 1) + 1, dw * (s - 1) + 1
    if max(pt, pb) >= ext_h or max(pl, pr) >= ext_w:
        raise ck.fail(Status.BAD_SHAPE, f"padding ({pt},{pl},{pb},{pr}) not below the "
                                        f"dilated kernel extent ({ext_h},{ext_w})")
    if h + pt + pb < ext_h or w + pl + pr < ext_w:
        raise ck.fail(Status.BAD_SHAPE, "kernel larger than the padded input")
    ceil = bool(flags & isa.POOL_CEIL)
    oh = pool2d_output(h, pt, pb, ext_h, sh, ceil)
    ow = pool2d_output(w, pl, pr, ext_w, sw, ceil)
    xv = ck.typed(x, dt, (n, c, h, w), "x")
    yv = ck.typed(y, dt, (n, c, oh, ow), "y")
    cost = _cost(ck, dt, n * c * oh * ow * r * s, xv.nbytes + yv.nbytes)
    run = _bind(ck, kernels.pool2d, {"x": xv, "y": yv}, "y", op=op, window=(r, s),
                stride=(sh, sw), dilation=(dh, dw), pads=(pt, pl, pb, pr),
                include_pad=bool(flags & isa.POOL_COUNT_INCLUDE_PAD))
    return Command(Opcode.POOL2D, ck.offset, cost, dtype=dt, op=op, run=run,
                   extra={"oh": oh, "ow": ow})


def _resolve_gather(ck: _Checker, flags: int, p: tuple) -> Command:  # type: ignore[type-arg]
    dtype_v, reserved, reserved2, rows, cols, count, table, indices, out = p
    ck.zero(reserved, "reserved")
    ck.zero(reserved2, "reserved2")
    dt = ck.dtype(dtype_v, _ALL_DTYPES)
    ck.shape(rows=rows, cols=cols, count=count)
    tv = ck.typed(table, dt, (rows, cols), "table")
    iv = ck.device(indices, ck.nbytes(count, 4), "indices").view("<i4")
    ov = ck.typed(out, dt, (count, cols), "out")
    nbytes = 2 * ov.nbytes + iv.nbytes
    cost = roofline_ns(ck.env.config.cmd_overhead_ns, nbytes=nbytes,
                       bandwidth=ck.env.config.mem_bandwidth)
    return Command(Opcode.GATHER, ck.offset, cost, dtype=dt, size=ov.nbytes,
                   run=_bind(ck, kernels.gather, {"table": tv, "indices": iv, "out": ov},
                             "out"))


def _rows_cols(ck: _Checker, dt: DType, rows: int, cols: int, x: int) -> np.ndarray:
    ck.shape(rows=rows, cols=cols)
    return ck.typed(x, dt, (rows, cols), "x")


def _resolve_softmax(ck: _Checker, flags: int, p: tuple) -> Command:  # type: ignore[type-arg]
    dtype_v, reserved, reserved2, rows, cols, reserved3, x, y = p
    for i, v in enumerate((reserved, reserved2, reserved3)):
        ck.zero(v, "reserved" + (str(i + 1) if i else ""))
    dt = ck.dtype(dtype_v)
    xv = _rows_cols(ck, dt, rows, cols, x)
    yv = ck.typed(y, dt, (rows, cols), "y")
    cost = _cost(ck, dt, 5 * rows * cols, 2 * xv.nbytes)
    return Command(Opcode.SOFTMAX, ck.offset, cost, dtype=dt,
                   run=_bind(ck, kernels.softmax, {"x": xv, "y": yv}, "y", frozenset({"x"})))


def _resolve_layernorm(ck: _Checker, flags: int, p: tuple) -> Command:  # type: ignore[type-arg]
    dtype_v, reserved, reserved2, rows, cols, eps, x, gamma, beta, y = p
    ck.zero(reserved, "reserved")
    ck.zero(reserved2, "reserved2")
    _finite_f32(ck, eps, "epsilon")
    dt = ck.dtype(dtype_v)
    xv = _rows_cols(ck, dt, rows, cols, x)
    gv = ck.typed(gamma, dt, (cols,), "gamma")
    bv = ck.typed(beta, dt, (cols,), "beta")
    yv = ck.typed(y, dt, (rows, cols), "y")
    cost = _cost(ck, dt, 8 * rows * cols, 2 * xv.nbytes + 2 * gv.nbytes)
    return Command(Opcode.LAYERNORM, ck.offset, cost, dtype=dt,
                   run=_bind(ck, kernels.layernorm, {"x": xv, "gamma": gv, "beta": bv, "y": yv},
                             "y", frozenset({"x"}), epsilon=eps))


def _resolve_reduce(ck: _Checker, flags: int, p: tuple) -> Command:  # type: ignore[type-arg]
    op, dtype_v, reserved, rows, cols, reserved2, x, y = p
    ck.zero(reserved, "reserved")
    ck.zero(reserved2, "reserved2")
    ck.enum(isa.ReduceOp, op, "reduce op")
    dt = ck.dtype(dtype_v)
    xv = _rows_cols(ck, dt, rows, cols, x)
    yv = ck.typed(y, dt, (rows,), "y")
    cost = _cost(ck, dt, rows * cols, xv.nbytes + yv.nbytes)
    return Command(Opcode.REDUCE, ck.offset, cost, dtype=dt, op=op,
                   run=_bind(ck, kernels.reduce, {"x": xv, "y": yv}, "y", op=op))


def _resolve_quant(ck: _Checker, opcode: Opcode, p: tuple) -> Command:  # type: ignore[type-arg]
    dtype_v, int_v, reserved, scale, zp, reserved2, count, x, y = p
    ck.zero(reserved, "reserved")
    ck.zero(reserved2, "reserved2")
    _finite_f32(ck, scale, "scale", positive=True)
    dt = ck.dtype(dtype_v)
    quant = opcode == Opcode.QUANTIZE
    idt = ck.dtype(int_v, frozenset({DType.I8}) if quant else isa.INT_DTYPES)
    if idt == DType.I8 and not -128 <= zp <= 127:
        raise ck.fail(Status.BAD_ARG, f"zero_point {zp} outside int8")
    ck.shape(count=count)
    fv = ck.typed(x if quant else y, dt, (count,), "x" if quant else "y")
    iv = ck.typed(y if quant else x, idt, (count,), "y" if quant else "x")
    cost = _cost(ck, dt, 2 * count, fv.nbytes + iv.nbytes)
    run = (_bind(ck, kernels.quantize, {"x": fv, "y": iv}, "y", scale=scale, zero_point=zp)
           if quant else
           _bind(ck, kernels.dequantize, {"x": iv, "y": fv}, "y", scale=scale, zero_point=zp))
    return Command(opcode, ck.offset, cost, dtype=dt, run=run)


def _resolve_quant_dynamic(ck: _Checker, flags: int, p: tuple) -> Command:  # type: ignore[type-arg]
    dtype_v, int_v, reserved, reserved2, count, x, y, qparams = p
    ck.zero(reserved, "reserved")
    ck.zero(reserved2, "reserved2")
    dt = ck.dtype(dtype_v)
    idt = ck.dtype(int_v, frozenset({DType.I8}))
    ck.shape(count=count)
    xv = ck.typed(x, dt, (count,), "x")
    yv = ck.typed(y, idt, (count,), "y")
    qv = ck.device(qparams, isa.QPARAMS.size, "qparams", written=True)
    cost = _cost(ck, dt, 3 * count, 2 * xv.nbytes + yv.nbytes + isa.QPARAMS.size)
    return Command(Opcode.QUANTIZE_DYNAMIC, ck.offset, cost, dtype=dt,
                   run=_bind(ck, kernels.quantize_dynamic, {"x": xv, "y": yv}, "y",
                             qparams=qv))


def _resolve_dequant_dynamic(ck: _Checker, flags: int, p: tuple) -> Command:  # type: ignore[type-arg]
    (dtype_v, act, reserved, channels, inner, reserved2, count, x, y, qparams, wscale,
     wsum, bias) = p
    if flags & ~isa.DQD_FLAGS_ALL:
        raise ck.fail(Status.BAD_ARG, f"DEQUANTIZE_DYNAMIC flags {flags:#x}")
    ck.zero(reserved, "reserved")
    ck.zero(reserved2, "reserved2")
    ck.enum(isa.Activation, act, "activation")
    if act not in (isa.Activation.NONE, isa.Activation.RELU):
        raise ck.fail(Status.BAD_ARG, f"activation {act} (NONE or RELU only)")
    dt = ck.dtype(dtype_v)
    ck.dtype(DType.I32, isa.INT_DTYPES)        # the sums it reads
    ck.shape(count=count, channels=channels, inner=inner)
    if count % (channels * inner):
        raise ck.fail(Status.BAD_SHAPE, f"count {count} not a multiple of channels * inner "
                                        f"({channels} * {inner})")
    shape = (count // (channels * inner), channels, inner)
    xv = ck.typed(x, DType.I32, shape, "x")
    yv = ck.typed(y, dt, shape, "y")
    qv = ck.device(qparams, isa.QPARAMS.size, "qparams")
    sv = ck.typed(wscale, DType.F32, (channels,), "wscale")
    mv = ck.typed(wsum, DType.I32, (channels,), "wsum")
    bv = ck.typed(bias, DType.F32, (channels,), "bias") if flags & isa.DQD_BIAS else None
    vec = sv.nbytes + mv.nbytes + (0 if bv is None else bv.nbytes)
    cost = _cost(ck, dt, 3 * count, xv.nbytes + yv.nbytes + isa.QPARAMS.size + vec)
    run = _bind(ck, kernels.dequantize_dynamic, {"x": xv, "qparams": qv, "wscale": sv,
                                                  "wsum": mv, "bias": bv, "y": yv}, "y",
                relu=act == isa.Activation.RELU)
    return Command(Opcode.DEQUANTIZE_DYNAMIC, ck.offset, cost, dtype=dt, activation=act,
                   run=run)


def _resolve_call(ck: _Checker, flags: int, p: tuple,  # type: ignore[type-arg]
                  out: list[Command]) -> None:
    """Validate the callee now (before anything runs) and splice its commands in."""
    env = ck.env
    depth, budget = ck.depth, ck.budget
    assert budget is not None
    addr, size, reserved = p
    ck.zero(reserved, "reserved")
    if size == 0 or size % isa.ALIGN:
        raise ck.fail(Status.BAD_SHAPE, f"callee size {size} not a non-zero multiple of 8")
    if size > env.config.max_cmdbuf_size:
        raise ck.fail(Status.CMDBUF_TOO_LARGE, f"callee size {size} > max_cmdbuf_size")
    if depth + 1 > env.config.max_call_depth:
        raise ck.fail(Status.CALL_DEPTH, f"CALL at depth {depth + 1} > max_call_depth "
                                         f"{env.config.max_call_depth}")
    budget.used += size
    if budget.used > budget.limit:
        raise ck.fail(Status.CMDBUF_TOO_LARGE, f"expanded submission {budget.used} bytes "
                                               f"> {budget.limit}")
    ck.host(addr, size, "callee")
    try:
        body = env.dma.read(addr, size)
    except DmaFault as e:  # pragma: no cover - host() has just checked the mapping
        raise ck.fail(Status.DMA_FAULT, f"callee: {e}") from None
    try:
        inner = _decode(body, env, depth + 1, budget)
    except CommandError as e:
        raise CommandError(e.status, ck.offset,
                           f"in CALL callee at inner offset {e.offset}"
                           f"{'/' + '/'.join(map(str, e.path)) if e.path else ''}: "
                           f"{e.message}", (e.offset,) + e.path) from None
    cost = roofline_ns(env.config.cmd_overhead_ns, nbytes=size,
                       bandwidth=env.config.link_bandwidth)
    out.append(Command(Opcode.CALL, ck.offset, cost, host_addr=addr, size=size))
    for cmd in inner:  # copies: a callee's Commands may be shared (`_nop_commands`)
        out.append(replace(cmd, offset=ck.offset, path=(cmd.offset,) + cmd.path))


# --- the opcode registry -------------------------------------------------------------

_OneResolver = Callable[[_Checker, int, tuple], Command]  # type: ignore[type-arg]
Resolver = Callable[[_Checker, int, tuple, list[Command]], None]  # type: ignore[type-arg]


def _one(fn: _OneResolver) -> Resolver:
    """A resolver that makes exactly one command."""
    def resolve_one(ck: _Checker, flags: int, p: tuple,  # type: ignore[type-arg]
                    out: list[Command]) -> None:
        out.append(fn(ck, flags, p))
    return resolve_one


def _no_host_bytes(cmd: Command) -> int:
    return 0


def _size_host_bytes(cmd: Command) -> int:
    return cmd.size


def _u64_host_bytes(cmd: Command) -> int:
    return 8


@dataclass(frozen=True)
class OpSpec:
    """One opcode's row of the registry."""
    resolve: Resolver
    execute: ex.Executor
    checks_flags: bool = False      # the resolver checks the header flags itself
    host_bytes: Callable[[Command], int] = _no_host_bytes   # over the host link
    time_only: bool = False         # no effect, no host bytes, no wait: only takes time,
                                    # so the engine may run a stretch of them in one step
    polls: bool = False             # the engine polls it until satisfied (WAIT)
    host_writes: bool = False       # writes guest memory, which a guest may poll: the
                                    # engine applies it exactly at its end time, never early
    device_only: bool = False       # resolves from its bytes, the config, the negotiated
                                    # features and device memory alone (no host access):
                                    # a context may keep it resolved (ResolveCache)
    host_recheck: Callable[[_Checker, Command], None] | None = None
                                    # a command whose only other checks are of its host
                                    # range(s), run last: it may be kept resolved too, and
                                    # this redoes them on every use (the IOMMU may change)


OPS: dict[Opcode, OpSpec] = {
    Opcode.NOP: OpSpec(_one(_resolve_nop), ex.no_effect, time_only=True),
    Opcode.FILL: OpSpec(_one(_resolve_fill), ex.fill, device_only=True),
    Opcode.DMA_H2D: OpSpec(_one(_resolve_dma_h2d), ex.dma_h2d, host_bytes=_size_host_bytes,
                           host_recheck=_recheck_h2d),
    Opcode.DMA_D2H: OpSpec(_one(_resolve_dma_d2h), ex.dma_d2h, host_bytes=_size_host_bytes,
                           host_writes=True, host_recheck=_recheck_d2h),
    Opcode.DMA_D2D: OpSpec(_one(_resolve_dma_d2d), ex.bound_kernel, device_only=True),
    Opcode.COPY: OpSpec(_one(_resolve_copy), ex.bound_kernel, device_only=True),
    Opcode.GEMM: OpSpec(_one(_resolve_gemm), ex.bound_kernel, checks_flags=True,
                        device_only=True),
    Opcode.GEMM_BATCHED: OpSpec(_one(_resolve_gemm_batched), ex.bound_kernel, device_only=True,
                                checks_flags=True),
    Opcode.ELEMENTWISE: OpSpec(_one(_resolve_elementwise), ex.bound_kernel, checks_flags=True,
                               device_only=True),
    Opcode.GATHER: OpSpec(_one(_resolve_gather), ex.bound_kernel, device_only=True),
    Opcode.COMPARE: OpSpec(_one(_resolve_compare), ex.bound_kernel, checks_flags=True,
                           device_only=True),
    Opcode.SELECT: OpSpec(_one(_resolve_select), ex.bound_kernel, device_only=True),
    Opcode.CONV2D: OpSpec(_one(_resolve_conv2d), ex.bound_kernel, checks_flags=True,
                          device_only=True),
    Opcode.POOL2D: OpSpec(_one(_resolve_pool2d), ex.bound_kernel, checks_flags=True,
                          device_only=True),
    Opcode.SOFTMAX: OpSpec(_one(_resolve_softmax), ex.bound_kernel, device_only=True),
    Opcode.LAYERNORM: OpSpec(_one(_resolve_layernorm), ex.bound_kernel, device_only=True),
    Opcode.REDUCE: OpSpec(_one(_resolve_reduce), ex.bound_kernel, device_only=True),
    Opcode.QUANTIZE: OpSpec(_one(lambda ck, f, p: _resolve_quant(ck, Opcode.QUANTIZE, p)),
                            ex.bound_kernel, device_only=True),
    Opcode.DEQUANTIZE: OpSpec(_one(lambda ck, f, p: _resolve_quant(ck, Opcode.DEQUANTIZE, p)),
                              ex.bound_kernel, device_only=True),
    Opcode.QUANTIZE_DYNAMIC: OpSpec(_one(_resolve_quant_dynamic), ex.bound_kernel,
                                    device_only=True),
    Opcode.DEQUANTIZE_DYNAMIC: OpSpec(_one(_resolve_dequant_dynamic), ex.bound_kernel,
                                      checks_flags=True, device_only=True),
    Opcode.SIGNAL: OpSpec(_one(_resolve_fence(Opcode.SIGNAL)), ex.signal,
                          host_bytes=_u64_host_bytes, host_writes=True),
    Opcode.TIMESTAMP: OpSpec(_one(_resolve_timestamp), ex.timestamp,
                             host_bytes=_u64_host_bytes, host_writes=True),
    Opcode.WAIT: OpSpec(_one(_resolve_fence(Opcode.WAIT)), ex.no_effect, polls=True),
    Opcode.CALL: OpSpec(_resolve_call, ex.no_effect, host_bytes=_size_host_bytes),
}

# What a ResolveCache may keep: opcode -> the host checks to redo on each use (or None).
_KEPT: dict[Opcode, Callable[[_Checker, Command], None] | None] = {
    op: spec.host_recheck for op, spec in OPS.items()
    if spec.device_only or spec.host_recheck is not None}
