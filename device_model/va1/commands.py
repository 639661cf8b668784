"""Command-buffer decoder and validator (spec §7).

Every command is decoded and checked before any runs; the first bad one fails the whole
buffer with its status and byte offset (`CommandError`). A good buffer comes out as a
list of `Command`s already resolved to zero-copy numpy views of device memory and to
their roofline cost, so the engine only has to do the math.
"""
from __future__ import annotations

import struct
from dataclasses import dataclass, field

import numpy as np

from hwspec import isa
from hwspec.isa import DType, Opcode
from hwspec.va1 import Status

from ..ports import DmaFault, DmaPort
from .config import Va1Config
from .memory import DeviceMemory
from .timing import roofline_ns

_U64 = 1 << 64
_HDR_FMT = isa.HEADER.format
_HDR_SIZE = isa.HEADER.size
_OPCODES = {int(o): o for o in Opcode}
_LENGTH = {o: isa.command_length(o) for o in Opcode}
_PAYLOAD_FMT = {o: isa.PAYLOAD[o].format for o in Opcode}
_MATH_DTYPES = frozenset({DType.F32, DType.F16})


class CommandError(Exception):
    """The first invalid command: status (hwspec.va1.Status) and its byte offset."""

    def __init__(self, status: Status, offset: int, message: str) -> None:
        super().__init__(f"{status.name} at offset {offset}: {message}")
        self.status = status
        self.offset = offset
        self.message = message


@dataclass
class Command:
    """One validated command, ready to run."""
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

    @property
    def host_bytes(self) -> int:
        """Bytes this command moves across the host link (for dma_bytes)."""
        if self.opcode in (Opcode.DMA_H2D, Opcode.DMA_D2H):
            return self.size
        if self.opcode in (Opcode.SIGNAL, Opcode.TIMESTAMP):
            return 8
        return 0


@dataclass(frozen=True)
class DecodeEnv:
    """What validation depends on besides the buffer."""
    config: Va1Config
    memory: DeviceMemory
    dma: DmaPort
    fp16: bool        # VA1_F_FP16 negotiated
    timestamp: bool   # VA1_F_TIMESTAMP negotiated


class _Checker:
    def __init__(self, env: DecodeEnv, offset: int) -> None:
        self.env = env
        self.offset = offset

    def fail(self, status: Status, message: str) -> CommandError:
        return CommandError(status, self.offset, message)

    def zero(self, value: int, what: str) -> None:
        if value:
            raise self.fail(Status.BAD_ARG, f"{what} = {value:#x}, must be 0")

    def dtype(self, value: int) -> DType:
        if value not in DType.__members__.values():
            raise self.fail(Status.BAD_DTYPE, f"unknown dtype {value}")
        dt = DType(value)
        if not self.env.config.dtype_mask >> dt & 1 or dt not in _MATH_DTYPES:
            raise self.fail(Status.BAD_DTYPE, f"dtype {dt.name} not supported here")
        if dt == DType.F16 and not self.env.fp16:
            raise self.fail(Status.BAD_DTYPE, "F16 without VA1_F_FP16 negotiated")
        return dt

    def nbytes(self, *factors: int) -> int:
        n = 1
        for f in factors:
            n *= f
        if n == 0:
            raise self.fail(Status.BAD_SHAPE, "zero size")
        if n >= _U64:
            raise self.fail(Status.BAD_SHAPE, f"byte size {n:#x} overflows 64 bits")
        return n

    def device(self, addr: int, size: int, what: str) -> np.ndarray:
        if not self.env.memory.contains(addr, size):
            raise self.fail(Status.OUT_OF_BOUNDS,
                            f"{what} [{addr:#x}, +{size:#x}) outside device memory "
                            f"({self.env.memory.size:#x})")
        return self.env.memory.bytes_view(addr, size)

    def host(self, iova: int, size: int, what: str) -> None:
        if iova + size > _U64:
            raise self.fail(Status.DMA_FAULT, f"{what} {iova:#x}+{size:#x} overflows")
        try:
            self.env.dma.view(iova, size)
        except DmaFault as e:
            raise self.fail(Status.DMA_FAULT, f"{what}: {e}") from None


def decode(buf: bytes, env: DecodeEnv) -> list[Command]:
    """Validate a whole command buffer; raises CommandError for the first bad command."""
    cmds: list[Command] = []
    pos = 0
    end = len(buf)
    while pos < end:
        ck = _Checker(env, pos)
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
        cmds.append(_resolve(ck, opcode, flags, payload))
        pos += length
    return cmds


def _resolve(ck: _Checker, opcode: Opcode, flags: int, p: tuple) -> Command:  # type: ignore[type-arg]
    cfg = ck.env.config
    ov = cfg.cmd_overhead_ns
    off = ck.offset
    if opcode != Opcode.GEMM:
        ck.zero(flags, "header flags")
    if opcode == Opcode.NOP:
        return Command(opcode, off, roofline_ns(ov))
    if opcode == Opcode.FILL:
        dst, size, pattern, reserved = p
        ck.zero(reserved, "reserved")
        if size == 0 or size % 4:
            raise ck.fail(Status.BAD_SHAPE, f"FILL size {size} not a non-zero multiple of 4")
        view = ck.device(dst, size, "dst")
        return Command(opcode, off, roofline_ns(ov, nbytes=size, bandwidth=cfg.mem_bandwidth),
                       dst=view, size=size, value=pattern)
    if opcode in (Opcode.DMA_H2D, Opcode.DMA_D2H, Opcode.DMA_D2D):
        src, dst, size = p
        if size == 0:
            raise ck.fail(Status.BAD_SHAPE, "zero size")
        if opcode == Opcode.DMA_H2D:
            dview = ck.device(dst, size, "dst")
            ck.host(src, size, "src")
            return Command(opcode, off, roofline_ns(ov, nbytes=size,
                                                    bandwidth=cfg.link_bandwidth),
                           dst=dview, host_addr=src, size=size)
        if opcode == Opcode.DMA_D2H:
            sview = ck.device(src, size, "src")
            ck.host(dst, size, "dst")
            return Command(opcode, off, roofline_ns(ov, nbytes=size,
                                                    bandwidth=cfg.link_bandwidth),
                           src=sview, host_addr=dst, size=size)
        sview = ck.device(src, size, "src")
        dview = ck.device(dst, size, "dst")
        return Command(opcode, off, roofline_ns(ov, nbytes=2 * size,
                                                bandwidth=cfg.mem_bandwidth),
                       src=sview, dst=dview, size=size)
    if opcode == Opcode.GEMM:
        return _resolve_gemm(ck, flags, p)
    if opcode == Opcode.ELEMENTWISE:
        return _resolve_elementwise(ck, p)
    if opcode == Opcode.SIGNAL:
        addr, value = p
        ck.host(addr, 8, "addr")
        return Command(opcode, off, roofline_ns(ov), host_addr=addr, value=value)
    # TIMESTAMP
    (addr,) = p
    ck.host(addr, 8, "addr")
    return Command(opcode, off, roofline_ns(ov), host_addr=addr)


def _resolve_gemm(ck: _Checker, flags: int, p: tuple) -> Command:  # type: ignore[type-arg]
    cfg = ck.env.config
    dtype_v, act, reserved, m, n, k, a, b, c, bias, alpha, beta = p
    if flags & ~isa.GEMM_FLAGS_ALL:
        raise ck.fail(Status.BAD_ARG, f"GEMM flags {flags:#x}")
    ck.zero(reserved, "reserved")
    if act not in isa.Activation.__members__.values():
        raise ck.fail(Status.BAD_ARG, f"activation {act}")
    dt = ck.dtype(dtype_v)
    es = isa.DTYPE_SIZE[dt]
    if m == 0 or n == 0 or k == 0:
        raise ck.fail(Status.BAD_SHAPE, f"GEMM m={m} n={n} k={k}")
    a_bytes = ck.nbytes(m, k, es)
    b_bytes = ck.nbytes(k, n, es)
    c_bytes = ck.nbytes(m, n, es)
    npdt = np.dtype(isa.DTYPE_NUMPY[dt])
    av = ck.device(a, a_bytes, "A").view(npdt)
    bv = ck.device(b, b_bytes, "B").view(npdt)
    cv = ck.device(c, c_bytes, "C").view(npdt).reshape(m, n)
    av = av.reshape(k, m).T if flags & isa.GEMM_TRANS_A else av.reshape(m, k)
    bv = bv.reshape(n, k).T if flags & isa.GEMM_TRANS_B else bv.reshape(k, n)
    biasv = None
    bias_bytes = 0
    if flags & isa.GEMM_BIAS:
        bias_bytes = ck.nbytes(n, es)
        biasv = ck.device(bias, bias_bytes, "bias").view(npdt)
    nbytes = a_bytes + b_bytes + c_bytes + (c_bytes if beta != 0 else 0) + bias_bytes
    peak = cfg.peak_flops * (2 if dt == DType.F16 else 1)
    cost = roofline_ns(cfg.cmd_overhead_ns, flops=2 * m * n * k, peak_flops=peak,
                       nbytes=nbytes, bandwidth=cfg.mem_bandwidth)
    return Command(Opcode.GEMM, ck.offset, cost, dtype=dt, activation=act, a=av, b=bv, c=cv,
                   bias=biasv, alpha=alpha, beta=beta, extra={"m": m, "n": n, "k": k})


def _resolve_elementwise(ck: _Checker, p: tuple) -> Command:  # type: ignore[type-arg]
    cfg = ck.env.config
    op, dtype_v, reserved, reserved2, count, a, b, out = p
    ck.zero(reserved, "reserved")
    ck.zero(reserved2, "reserved2")
    if op not in isa.EltOp.__members__.values():
        raise ck.fail(Status.BAD_ARG, f"elementwise op {op}")
    dt = ck.dtype(dtype_v)
    es = isa.DTYPE_SIZE[dt]
    if count == 0:
        raise ck.fail(Status.BAD_SHAPE, "zero count")
    size = ck.nbytes(count, es)
    npdt = np.dtype(isa.DTYPE_NUMPY[dt])
    unary = op in isa.UNARY_ELT_OPS
    av = ck.device(a, size, "a").view(npdt)
    bv = None if unary else ck.device(b, size, "b").view(npdt)
    ov = ck.device(out, size, "out").view(npdt)
    nbytes = size * (2 if unary else 3)
    cost = roofline_ns(cfg.cmd_overhead_ns, flops=count, peak_flops=cfg.peak_flops
                       * (2 if dt == DType.F16 else 1), nbytes=nbytes,
                       bandwidth=cfg.mem_bandwidth)
    return Command(Opcode.ELEMENTWISE, ck.offset, cost, dtype=dt, op=op, a=av, b=bv, dst=ov,
                   size=size)
