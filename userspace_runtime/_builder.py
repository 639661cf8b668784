"""Encoding, decoding and disassembly of VA-1 command buffers (ISA 1.0 and its
additions: COPY, GATHER, GEMM_BATCHED, COMPARE, SELECT, CONV2D, POOL2D, SOFTMAX, LAYERNORM, REDUCE, QUANTIZE,
DEQUANTIZE, QUANTIZE_DYNAMIC, DEQUANTIZE_DYNAMIC, CALL).

Every number comes from `hwspec.isa`: opcodes, header and payload layouts, flags and
enums. Fields are packed by name from the hwspec `Layout`s, so a layout change there is
picked up here without re-typing an offset.
"""
from __future__ import annotations

import bisect
import builtins
import math
import operator
import struct
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, SupportsIndex, Union

from hwspec import isa
from hwspec.isa import Activation, CmpOp, DType, EltOp, Opcode, PoolOp, ReduceOp

IntLike = SupportsIndex  # an int, or anything with __index__ (numpy integers)

U16_MAX = 0xFFFF
U32_MAX = 0xFFFF_FFFF
U64_MAX = 0xFFFF_FFFF_FFFF_FFFF
_U64_END = U64_MAX + 1   # a range [addr, addr + size) fits in 64 bits iff addr <= _U64_END - size
_F32_MAX = float(struct.unpack("<f", b"\xff\xff\x7f\x7f")[0])

# ELEMENTWISE (and float GEMM) compute dtypes (spec §7, BAD_DTYPE rule).
COMPUTE_DTYPES = frozenset({DType.F32, DType.F16})
# GEMM also takes I8 (int32 accumulation, I32 C and bias).
GEMM_DTYPES = frozenset({DType.F32, DType.F16, DType.I8})

# One precompiled struct per opcode: header and payload, both packed little-endian,
# so the concatenation of their formats is exactly the wire layout.
_STRUCTS: dict[Opcode, struct.Struct] = {
    op: struct.Struct(isa.HEADER.format + layout.format[1:]) for op, layout in isa.PAYLOAD.items()
}


# Per opcode: its struct, its command length and its payload field names in wire order.
_ENCODING: dict[Opcode, tuple[struct.Struct, int, tuple[str, ...]]] = {
    op: (_STRUCTS[op], isa.command_length(op), tuple(layout.names))
    for op, layout in isa.PAYLOAD.items()
}


def _wire_order(opcode: Opcode, keys: tuple[str, ...]) -> Callable[[tuple[Any, ...]], Any]:
    """A getter that takes a tuple of the values of `keys` followed by one 0 and returns
    them in `opcode`'s wire order (the 0 for every payload field not in `keys`): the hot
    appends pack by position, still placed by the hwspec layout's field names."""
    names = _ENCODING[opcode][2]
    unknown = set(keys) - set(names)
    if unknown:
        raise AssertionError(f"{opcode.name} has no fields {sorted(unknown)}")
    return operator.itemgetter(*[keys.index(n) if n in keys else len(keys) for n in names])


# The opcodes of the hot appends, read once: on CPython 3.11 an enum member access
# (Opcode.GEMM) is a Python-level lookup that costs as much as packing the command.
_DMA_H2D, _DMA_D2H, _DMA_D2D, _GEMM = Opcode.DMA_H2D, Opcode.DMA_D2H, Opcode.DMA_D2D, Opcode.GEMM

_DMA_ORDER = {op: _wire_order(op, ("src", "dst", "size"))
              for op in (Opcode.DMA_H2D, Opcode.DMA_D2H, Opcode.DMA_D2D)}
# Whether the DMA payloads are exactly (src, dst, size) (then packed as they come).
_DMA_AS_IS = all(_ENCODING[op][2] == ("src", "dst", "size") for op in _DMA_ORDER)
_GEMM_ORDER = _wire_order(Opcode.GEMM, ("dtype", "activation", "m", "n", "k", "a", "b", "c",
                                        "bias", "alpha", "beta"))


# A command's name, or a function that makes it: names are read only for errors and
# disassembly, so a stream hands over the function and the hot path formats nothing.
Name = Union[str, Callable[[], str]]


@dataclass(frozen=True)
class CommandRecord:
    """Where one appended command sits in the buffer, and what made it."""

    index: int
    offset: int
    opcode: int
    length: int
    label: Name

    @property
    def name(self) -> str:
        label = self.label
        return label if isinstance(label, str) else label()

    @property
    def opcode_name(self) -> str:
        return _opcode_name(self.opcode)


@dataclass(frozen=True)
class DecodedCommand:
    """One command read back from bytes (header plus payload fields by layout name)."""

    offset: int
    opcode: int
    flags: int
    length: int
    fields: Mapping[str, int | float] = field(default_factory=dict)

    @property
    def opcode_name(self) -> str:
        return _opcode_name(self.opcode)


def _opcode_name(opcode: int) -> str:
    try:
        return Opcode(opcode).name
    except ValueError:
        return f"OP_{opcode:#06x}"


# --- argument checking --------------------------------------------------------------


def _int(value: Any, what: str) -> int:
    if type(value) is int:  # the common case, without a Protocol isinstance check
        return value
    if isinstance(value, bool) or not isinstance(value, (int, SupportsIndex)):
        raise TypeError(f"{what} must be an integer, got {type(value).__name__} {value!r}")
    return operator.index(value)


def _uint(value: Any, what: str, maximum: int, *, minimum: int = 0) -> int:
    if type(value) is int and minimum <= value <= maximum:
        return value
    v = _int(value, what)
    if not minimum <= v <= maximum:
        raise ValueError(f"{what} = {v} is out of range [{minimum}, {maximum:#x}]")
    return v


def _addr(value: Any, what: str) -> int:
    if type(value) is int and 0 <= value <= U64_MAX:
        return value
    return _uint(value, what, U64_MAX)


def _range(addr: int, size: int, what: str) -> None:
    if addr + size - 1 > U64_MAX:
        raise ValueError(f"{what} range [{addr:#x}, +{size:#x}) overflows 64 bits")


def check_f32(value: Any, what: str) -> float:
    """`value` as a float that float32 represents finitely, else TypeError/ValueError."""
    if type(value) is float and -_F32_MAX <= value <= _F32_MAX:  # (NaN fails this too)
        return value
    if isinstance(value, bool):
        raise TypeError(f"{what} must be a float, got bool")
    try:
        v = float(value)
    except (TypeError, ValueError):
        raise TypeError(f"{what} must be a float, got {type(value).__name__} {value!r}") from None
    if not math.isfinite(v) or abs(v) > _F32_MAX:
        raise ValueError(f"{what} = {v!r} is not a finite float32 value")
    return v


# Each operation enum by its exact member names, upper and lower case (what callers
# write); other spellings go through `str.upper`.
_ENUM_NAMES: dict[type[Any], dict[str, Any]] = {
    e: {**{m.name.lower(): m for m in e}, **{m.name: m for m in e}}
    for e in (Activation, EltOp, CmpOp, ReduceOp, PoolOp)
}


def _enum(enum: type[Any], value: Any, what: str) -> Any:
    if type(value) is enum:
        return value
    if isinstance(value, str):
        hit = _ENUM_NAMES[enum].get(value)
        if hit is not None:
            return hit
        try:
            return enum[value.upper()]
        except KeyError:
            pass
    else:
        try:
            return enum(_int(value, what))
        except (ValueError, TypeError):
            pass
    names = ", ".join(m.name.lower() for m in enum)
    raise ValueError(f"{what} = {value!r} is not one of: {names}")


def as_dtype(value: Any) -> DType:
    """A hwspec DType from a DType, its integer code or its name ("f32", "F16")."""
    if type(value) is DType:
        return value
    if isinstance(value, str):
        try:
            return DType[value.upper()]
        except KeyError:
            pass
    elif isinstance(value, (int, SupportsIndex)) and not isinstance(value, bool):
        try:
            return DType(operator.index(value))
        except ValueError:
            pass
    names = ", ".join(m.name.lower() for m in DType)
    raise ValueError(f"dtype {value!r} is not a VA-1 dtype ({names})")


def as_activation(value: Any) -> Activation:
    """None means no activation; otherwise an Activation, its code or name ("relu")."""
    if value is None:
        return Activation.NONE
    return _enum(Activation, value, "activation")  # type: ignore[no-any-return]


def as_eltop(value: Any) -> EltOp:
    return _enum(EltOp, value, "elementwise op")  # type: ignore[no-any-return]


def as_cmpop(value: Any) -> CmpOp:
    return _enum(CmpOp, value, "compare op")  # type: ignore[no-any-return]


def as_reduceop(value: Any) -> ReduceOp:
    return _enum(ReduceOp, value, "reduce op")  # type: ignore[no-any-return]


def _float_dtype(value: Any, what: str) -> DType:
    dt = as_dtype(value)
    if dt not in COMPUTE_DTYPES:
        raise ValueError(f"{what} dtype {dt.name} is not supported (only F32, F16)")
    return dt


def _pair(value: Any, what: str, maximum: int, minimum: int) -> tuple[int, int]:
    if isinstance(value, (tuple, list)):
        if len(value) != 2:
            raise ValueError(f"{what} must be one integer or a pair, got {value!r}")
        return (_uint(value[0], what, maximum, minimum=minimum),
                _uint(value[1], what, maximum, minimum=minimum))
    v = _uint(value, what, maximum, minimum=minimum)
    return v, v


def conv2d_output_hw(h: int, w: int, r: int, s: int, stride: tuple[int, int] = (1, 1),
                     padding: tuple[int, int, int, int] = (0, 0, 0, 0),
                     dilation: tuple[int, int] = (1, 1)) -> tuple[int, int]:
    """CONV2D output height and width (spec §7); ValueError when the kernel does not fit.
    `padding` is (top, left, bottom, right)."""
    pt, pl, pb, pr = padding
    eh, ew = dilation[0] * (r - 1) + 1, dilation[1] * (s - 1) + 1
    if h + pt + pb < eh or w + pl + pr < ew:
        raise ValueError(f"CONV2D kernel extent ({eh}, {ew}) larger than the padded input "
                         f"({h + pt + pb}, {w + pl + pr})")
    return (h + pt + pb - eh) // stride[0] + 1, (w + pl + pr - ew) // stride[1] + 1


def as_poolop(value: Any) -> PoolOp:
    return _enum(PoolOp, value, "pool op")  # type: ignore[no-any-return]


def pool2d_output_hw(h: int, w: int, r: int, s: int, stride: tuple[int, int] = (1, 1),
                     padding: tuple[int, int, int, int] = (0, 0, 0, 0),
                     dilation: tuple[int, int] = (1, 1), ceil: bool = False
                     ) -> tuple[int, int]:
    """POOL2D output height and width (spec §7): as CONV2D, or with `ceil` rounded up,
    less one when that last window would start past the input and its start pad."""
    pt, pl, pb, pr = padding
    out = []
    for size, k, st, d, lo, hi in ((h, r, stride[0], dilation[0], pt, pb),
                                   (w, s, stride[1], dilation[1], pl, pr)):
        ext = d * (k - 1) + 1
        if size + lo + hi < ext:
            raise ValueError(f"POOL2D kernel extent {ext} larger than the padded input "
                             f"{size + lo + hi}")
        q, rem = divmod(size + lo + hi - ext, st)
        o = q + 1 + (1 if ceil and rem else 0)
        if ceil and (o - 1) * st >= size + lo:
            o -= 1
        out.append(o)
    return out[0], out[1]


def contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    """Row-major element strides of a dense tensor of `shape`."""
    strides = []
    acc = 1
    for d in reversed(shape):
        strides.append(acc)
        acc *= d
    return tuple(reversed(strides))


# --- the builder --------------------------------------------------------------------


class CommandBufferBuilder:
    """Appends VA-1 commands to a byte buffer and remembers where each one went.

    Every append method checks its arguments (ValueError/TypeError naming the field),
    encodes the command, and returns its byte offset; `command_at(offset)` maps a
    device `error_offset` back to the append call (its `name`). `raw()` appends
    unchecked bytes, for tests that must send the device something invalid.
    """

    def __init__(self, max_size: int | None = None) -> None:
        self._data = bytearray()
        # One (opcode, length, name) per command, made into CommandRecords only when
        # read: appending is the hot path, reading records is for errors and listings.
        self._cmd_rows: list[tuple[int, int, Name]] = []
        self._offsets: list[int] = []
        self.max_size = max_size

    # -- inspection -----------------------------------------------------------------

    def __len__(self) -> int:
        return len(self._data)

    @property
    def size(self) -> int:
        """Bytes encoded so far."""
        return len(self._data)

    @property
    def commands(self) -> tuple[CommandRecord, ...]:
        return tuple(self._record_at(i) for i in range(len(self._cmd_rows)))

    @property
    def command_count(self) -> int:
        """How many commands were appended (without building their records)."""
        return len(self._cmd_rows)

    def _record_at(self, i: int) -> CommandRecord:
        opcode, length, name = self._cmd_rows[i]
        return CommandRecord(i, self._offsets[i], opcode, length, name)

    def __bytes__(self) -> builtins.bytes:
        return builtins.bytes(self._data)

    def bytes(self) -> builtins.bytes:
        """The encoded command buffer (a copy)."""
        return builtins.bytes(self._data)

    def view(self) -> memoryview:
        """Zero-copy read-only view of the encoded bytes (valid until the next append)."""
        return memoryview(self._data).toreadonly()

    def command_at(self, offset: int) -> CommandRecord | None:
        """The command whose bytes contain `offset` (a device error_offset), or None."""
        i = bisect.bisect_right(self._offsets, offset) - 1
        if i < 0:
            return None
        rec = self._record_at(i)
        return rec if offset < rec.offset + rec.length else None

    def disassemble(self) -> str:
        """Text listing of the buffer, one command per line, with each command's name."""
        return disassemble(self._data, names={r.offset: r.name for r in self.commands})

    def extend(self, other: CommandBufferBuilder) -> int:
        """Append another builder's bytes and command records; returns the offset."""
        base = len(self._data)
        if self.max_size is not None and base + len(other._data) > self.max_size:
            self._reserve(len(other._data))
        self._data += other._data
        self._cmd_rows.extend(other._cmd_rows)
        if base == 0:
            self._offsets.extend(other._offsets)
        else:
            self._offsets.extend(base + o for o in other._offsets)
        return base

    def clear(self) -> None:
        self._data.clear()
        self._cmd_rows.clear()
        self._offsets.clear()

    # -- encoding -------------------------------------------------------------------

    def _reserve(self, length: int) -> None:
        if self.max_size is not None and len(self._data) + length > self.max_size:
            raise ValueError(
                f"command buffer would grow to {len(self._data) + length} bytes, "
                f"above its maximum of {self.max_size}")

    def _emit(self, opcode: Opcode, flags: int, fields: Mapping[str, int | float],
              name: Name) -> int:
        names = _ENCODING[opcode][2]
        return self._emit_wire(opcode, flags, [fields.get(n, 0) for n in names], name)

    def _emit_wire(self, opcode: Opcode, flags: int, values: Any, name: Name) -> int:
        """Append one checked command whose payload `values` are in wire order."""
        st, length, _ = _ENCODING[opcode]
        data = self._data
        offset = len(data)
        if self.max_size is not None and offset + length > self.max_size:
            self._reserve(length)
        data += st.pack(opcode, flags, length, *values)
        self._cmd_rows.append((opcode, length, name))
        self._offsets.append(offset)
        return offset

    def _record(self, offset: int, opcode: int, length: int, name: Name) -> None:
        self._cmd_rows.append((opcode, length, name))
        self._offsets.append(offset)

    def nop(self, length: IntLike = isa.HEADER.size, *, name: Name | None = None) -> int:
        """Padding: a NOP of `length` bytes (>= 8, a multiple of 8)."""
        length = _uint(length, "NOP length", U32_MAX, minimum=isa.HEADER.size)
        if length % isa.ALIGN:
            raise ValueError(f"NOP length {length} is not a multiple of {isa.ALIGN}")
        self._reserve(length)
        offset = len(self._data)
        self._data += struct.pack(isa.HEADER.format, Opcode.NOP, 0, length)
        self._data += bytes(length - isa.HEADER.size)
        self._record(offset, Opcode.NOP, length, name or f"NOP len={length}")
        return offset

    def fill(self, dst: IntLike, size: IntLike, pattern: IntLike, *,
             name: Name | None = None) -> int:
        """FILL `size` bytes (a multiple of 4) at device address `dst` with a u32 pattern."""
        dst = _addr(dst, "FILL dst")
        size = _uint(size, "FILL size", U64_MAX, minimum=1)
        if size % 4:
            raise ValueError(f"FILL size {size} is not a multiple of 4")
        _range(dst, size, "FILL dst")
        pattern = _uint(pattern, "FILL pattern", U32_MAX)
        return self._emit(Opcode.FILL, 0, {"dst": dst, "size": size, "pattern": pattern},
                          name or f"FILL dst={dst:#x} size={size} pattern={pattern:#010x}")

    def _dma(self, opcode: Opcode, src: IntLike, dst: IntLike, size: IntLike,
             name: Name | None) -> int:
        if (type(src) is type(dst) is type(size) is int and name is not None and size >= 1
                and 0 <= src <= _U64_END - size and 0 <= dst <= _U64_END - size):
            # Plain in-range ints (the common case): the checks below would all pass.
            return self._dma_unchecked(opcode, src, dst, size, name)
        what = opcode.name
        src = _addr(src, f"{what} src")
        dst = _addr(dst, f"{what} dst")
        size = _uint(size, f"{what} size", U64_MAX, minimum=1)
        _range(src, size, f"{what} src")
        _range(dst, size, f"{what} dst")
        return self._emit(opcode, 0, {"src": src, "dst": dst, "size": size},
                          name or f"{what} src={src:#x} dst={dst:#x} size={size}")

    def _dma_unchecked(self, opcode: Opcode, src: int, dst: int, size: int, name: Name) -> int:
        """A DMA whose caller guarantees what `_dma` checks (plain ints, size >= 1, both
        ranges inside 64 bits): a Stream, whose addresses and sizes are those of buffers
        the driver made, where the checks would only repeat."""
        return self._emit_wire(opcode, 0, (src, dst, size) if _DMA_AS_IS
                               else _DMA_ORDER[opcode]((src, dst, size, 0)), name)

    def dma_h2d(self, src_iova: IntLike, dst: IntLike, size: IntLike, *,
                name: Name | None = None) -> int:
        """Copy `size` bytes from host IOVA `src_iova` to device address `dst`."""
        return self._dma(_DMA_H2D, src_iova, dst, size, name)

    def dma_d2h(self, src: IntLike, dst_iova: IntLike, size: IntLike, *,
                name: Name | None = None) -> int:
        """Copy `size` bytes from device address `src` to host IOVA `dst_iova`."""
        return self._dma(_DMA_D2H, src, dst_iova, size, name)

    def dma_d2d(self, src: IntLike, dst: IntLike, size: IntLike, *,
                name: Name | None = None) -> int:
        """Copy `size` bytes within device memory (memmove semantics)."""
        return self._dma(_DMA_D2D, src, dst, size, name)

    def gemm(self, *, dtype: DType | int | str, m: IntLike, n: IntLike,
             k: IntLike, a: IntLike, b: IntLike, c: IntLike,
             bias: IntLike | None = None,
             alpha: float = 1.0, beta: float = 0.0,
             trans_a: bool = False, trans_b: bool = False,
             activation: Activation | int | str | None = None,
             name: Name | None = None) -> int:
        """C = act(alpha * op(A) @ op(B) + beta * C + bias), all at device addresses."""
        if (type(dtype) is DType and dtype in COMPUTE_DTYPES and type(activation) is Activation
                and name is not None and type(m) is int and type(n) is int and type(k) is int
                and type(a) is int and type(b) is int and type(c) is int
                and (bias is None or type(bias) is int)
                and type(alpha) is float and type(beta) is float
                and 0 < m <= U32_MAX and 0 < n <= U32_MAX and 0 < k <= U32_MAX
                and -_F32_MAX <= alpha <= _F32_MAX and -_F32_MAX <= beta <= _F32_MAX):
            # The common case (a float dtype, plain ints and floats in range): only
            # the address ranges are left to check, as below.
            es = isa.DTYPE_SIZE[dtype]
            if (a >= 0 and b >= 0 and c >= 0 and a + m * k * es - 1 <= U64_MAX
                    and b + k * n * es - 1 <= U64_MAX and c + m * n * es - 1 <= U64_MAX
                    and (bias is None or 0 <= bias <= U64_MAX - n * es + 1)):
                return self._gemm_unchecked(dtype, m, n, k, a, b, c, bias, alpha, beta,
                                            trans_a, trans_b, activation, name)
        dt = as_dtype(dtype)
        if dt not in GEMM_DTYPES:
            raise ValueError(f"GEMM dtype {dt.name} is not supported (only F32, F16, I8)")
        m = _uint(m, "GEMM m", U32_MAX, minimum=1)
        n = _uint(n, "GEMM n", U32_MAX, minimum=1)
        k = _uint(k, "GEMM k", U32_MAX, minimum=1)
        act = as_activation(activation)
        esize = isa.DTYPE_SIZE[dt]
        osize = esize
        if dt == DType.I8:  # int32 accumulation: C and bias are I32
            osize = isa.DTYPE_SIZE[DType.I32]
            if act not in (Activation.NONE, Activation.RELU):
                raise ValueError(f"I8 GEMM activation {act.name} (only NONE, RELU)")
            if alpha != 1.0 or beta not in (0.0, 1.0):
                raise ValueError(f"I8 GEMM alpha={alpha!r} beta={beta!r}: alpha must be 1 "
                                 "and beta 0 or 1")
        flags = 0
        if trans_a:
            flags |= isa.GEMM_TRANS_A
        if trans_b:
            flags |= isa.GEMM_TRANS_B
        aa, ba, ca = _addr(a, "GEMM a"), _addr(b, "GEMM b"), _addr(c, "GEMM c")
        fields: dict[str, int | float] = {
            "dtype": dt, "activation": act, "m": m, "n": n, "k": k, "a": aa, "b": ba, "c": ca,
            "alpha": check_f32(alpha, "GEMM alpha"), "beta": check_f32(beta, "GEMM beta"),
        }
        _range(aa, m * k * esize, "GEMM a")
        _range(ba, k * n * esize, "GEMM b")
        _range(ca, m * n * osize, "GEMM c")
        if bias is not None:
            flags |= isa.GEMM_BIAS
            fields["bias"] = bias_addr = _addr(bias, "GEMM bias")
            _range(bias_addr, n * osize, "GEMM bias")
        if name is None:
            extra = "".join([" trans_a" if trans_a else "", " trans_b" if trans_b else "",
                             " +bias" if bias is not None else "",
                             f" {act.name.lower()}" if act != Activation.NONE else ""])
            name = f"GEMM {dt.name.lower()} m={m} n={n} k={k}{extra}"
        return self._emit(Opcode.GEMM, flags, fields, name)

    def _gemm_unchecked(self, dtype: DType, m: int, n: int, k: int, a: int, b: int, c: int,
                        bias: int | None, alpha: float, beta: float, trans_a: Any,
                        trans_b: Any, activation: Activation, name: Name) -> int:
        """A float GEMM whose caller guarantees what `gemm` checks: `gemm` itself, or a
        Stream, whose operands are buffers it has checked and the driver made."""
        flags = ((isa.GEMM_TRANS_A if trans_a else 0) | (isa.GEMM_TRANS_B if trans_b else 0)
                 | (0 if bias is None else isa.GEMM_BIAS))
        return self._emit_wire(_GEMM, flags, _GEMM_ORDER(
            (dtype, activation, m, n, k, a, b, c, 0 if bias is None else bias, alpha, beta, 0)),
            name)

    def gemm_batched(self, *, dtype: DType | int | str, batch: IntLike, m: IntLike,
                     n: IntLike, k: IntLike, a: IntLike, b: IntLike, c: IntLike,
                     lda: IntLike | None = None, ldb: IntLike | None = None,
                     ldc: IntLike | None = None, stride_a: IntLike | None = None,
                     stride_b: IntLike | None = None, stride_c: IntLike | None = None,
                     bias: IntLike | None = None, alpha: float = 1.0, beta: float = 0.0,
                     trans_a: bool = False, trans_b: bool = False,
                     activation: Activation | int | str | None = None,
                     name: Name | None = None) -> int:
        """For each i < batch: C_i = act(alpha * op(A_i) @ op(B_i) + beta * C_i + bias),
        where operand X_i starts at x + i * stride_x elements and its stored rows are
        ldx elements apart (defaults: dense, back to back; a stride of 0 shares one
        matrix between all batches, a transpose is a TRANS flag with its ld)."""
        dt = as_dtype(dtype)
        if dt not in GEMM_DTYPES:
            raise ValueError(f"GEMM_BATCHED dtype {dt.name} is not supported (only F32, "
                             "F16, I8)")
        batch = _uint(batch, "GEMM_BATCHED batch", isa.GEMM_BATCHED_MAX_BATCH, minimum=1)
        m = _uint(m, "GEMM_BATCHED m", U32_MAX, minimum=1)
        n = _uint(n, "GEMM_BATCHED n", U32_MAX, minimum=1)
        k = _uint(k, "GEMM_BATCHED k", U32_MAX, minimum=1)
        act = as_activation(activation)
        esize = isa.DTYPE_SIZE[dt]
        osize = isa.DTYPE_SIZE[DType.I32] if dt == DType.I8 else esize
        if dt == DType.I8 and (act not in (Activation.NONE, Activation.RELU)
                               or alpha != 1.0 or beta not in (0.0, 1.0)):
            raise ValueError(f"I8 GEMM_BATCHED activation {act.name} alpha={alpha!r} "
                             f"beta={beta!r}: NONE or RELU, alpha 1, beta 0 or 1")
        a_rows, a_cols = (k, m) if trans_a else (m, k)
        b_rows, b_cols = (n, k) if trans_b else (k, n)
        lds = {}
        for nm, v, cols in (("lda", lda, a_cols), ("ldb", ldb, b_cols), ("ldc", ldc, n)):
            lds[nm] = cols if v is None else _uint(v, f"GEMM_BATCHED {nm}", U64_MAX)
        strides = {}
        for nm, v, rows, ld in (("stride_a", stride_a, a_rows, lds["lda"]),
                                ("stride_b", stride_b, b_rows, lds["ldb"]),
                                ("stride_c", stride_c, m, lds["ldc"])):
            strides[nm] = rows * ld if v is None else _uint(v, f"GEMM_BATCHED {nm}", U64_MAX)
    
        def extent(rows: int, cols: int, ld: int, st: int, es: int) -> int:
            return ((batch - 1) * st + (rows - 1) * ld + cols) * es

        fields: dict[str, int | float] = {
            "dtype": dt, "activation": act, "batch": batch, "m": m, "n": n, "k": k,
            "a": _addr(a, "GEMM_BATCHED a"), "b": _addr(b, "GEMM_BATCHED b"),
            "c": _addr(c, "GEMM_BATCHED c"), **lds, **strides,
            "alpha": check_f32(alpha, "GEMM_BATCHED alpha"),
            "beta": check_f32(beta, "GEMM_BATCHED beta")}
        _range(int(fields["a"]), extent(a_rows, a_cols, lds["lda"], strides["stride_a"],
                                        esize), "GEMM_BATCHED a")
        _range(int(fields["b"]), extent(b_rows, b_cols, lds["ldb"], strides["stride_b"],
                                        esize), "GEMM_BATCHED b")
        _range(int(fields["c"]), extent(m, n, lds["ldc"], strides["stride_c"], osize),
               "GEMM_BATCHED c")
        flags = (isa.GEMM_TRANS_A if trans_a else 0) | (isa.GEMM_TRANS_B if trans_b else 0)
        if bias is not None:
            flags |= isa.GEMM_BIAS
            fields["bias"] = _addr(bias, "GEMM_BATCHED bias")
            _range(int(fields["bias"]), n * osize, "GEMM_BATCHED bias")
        if name is None:
            extra = "".join([" trans_a" if trans_a else "", " trans_b" if trans_b else "",
                             " +bias" if bias is not None else "",
                             f" {act.name.lower()}" if act != Activation.NONE else ""])
            name = f"GEMM_BATCHED {dt.name.lower()} {batch}x m={m} n={n} k={k}{extra}"
        return self._emit(Opcode.GEMM_BATCHED, flags, fields, name)

    def elementwise(self, op: EltOp | int | str, *, dtype: DType | int | str,
                    count: IntLike, a: IntLike, b: IntLike | None = None,
                    out: IntLike, broadcast_cols: IntLike | None = None,
                    name: Name | None = None) -> int:
        """out = a op b over `count` elements (b is ignored, encoded 0, for unary ops).

        With `broadcast_cols`, `b` is a [cols] vector added (etc.) to every row of the
        [count / cols, cols] tensor `a` (flag BROADCAST_B): bias adds, batchnorm."""
        eop = as_eltop(op)
        dt = as_dtype(dtype)
        if dt not in COMPUTE_DTYPES:
            raise ValueError(f"ELEMENTWISE dtype {dt.name} is not supported (only F32, F16)")
        count = _uint(count, "ELEMENTWISE count", U64_MAX, minimum=1)
        nbytes = count * isa.DTYPE_SIZE[dt]
        a = _addr(a, "ELEMENTWISE a")
        out = _addr(out, "ELEMENTWISE out")
        _range(a, nbytes, "ELEMENTWISE a")
        _range(out, nbytes, "ELEMENTWISE out")
        flags = cols = 0
        b_bytes = nbytes
        if broadcast_cols is not None:
            if eop in isa.UNARY_ELT_OPS:
                raise ValueError(f"ELEMENTWISE {eop.name} is unary: no broadcast_cols")
            cols = _uint(broadcast_cols, "ELEMENTWISE broadcast_cols", U32_MAX, minimum=1)
            if count % cols:
                raise ValueError(f"ELEMENTWISE count {count} is not a multiple of "
                                 f"broadcast_cols {cols}")
            flags = isa.ELT_BROADCAST_B
            b_bytes = cols * isa.DTYPE_SIZE[dt]
        if eop in isa.UNARY_ELT_OPS:
            b_addr = 0
        else:
            if b is None:
                raise ValueError(f"ELEMENTWISE {eop.name} is binary: b is required")
            b_addr = _addr(b, "ELEMENTWISE b")
            _range(b_addr, b_bytes, "ELEMENTWISE b")
        return self._emit(Opcode.ELEMENTWISE, flags,
                          {"op": eop, "dtype": dt, "cols": cols, "count": count, "a": a,
                           "b": b_addr, "out": out},
                          name or f"ELEMENTWISE {eop.name.lower()} {dt.name.lower()} "
                                  f"count={count}" + (f" bcast={cols}" if cols else ""))

    def compare(self, op: CmpOp | int | str, *, dtype: DType | int | str, count: IntLike,
                a: IntLike, b: IntLike | None = None, out: IntLike,
                broadcast_cols: IntLike | None = None, name: Name | None = None) -> int:
        """out (an I8 mask of `count` bytes) = 1 where `a op b` holds, else 0; a and b
        of `dtype` (any); logic ops (and, or, xor, not) take nonzero as true; NOT is
        unary. With `broadcast_cols`, b is a [cols] vector compared with every row."""
        cop = as_cmpop(op)
        dt = as_dtype(dtype)
        count = _uint(count, "COMPARE count", U64_MAX, minimum=1)
        nbytes = count * isa.DTYPE_SIZE[dt]
        a = _addr(a, "COMPARE a")
        out = _addr(out, "COMPARE out")
        _range(a, nbytes, "COMPARE a")
        _range(out, count, "COMPARE out")
        flags = cols = 0
        b_bytes = nbytes
        if broadcast_cols is not None:
            if cop in isa.UNARY_CMP_OPS:
                raise ValueError(f"COMPARE {cop.name} is unary: no broadcast_cols")
            cols = _uint(broadcast_cols, "COMPARE broadcast_cols", U32_MAX, minimum=1)
            if count % cols:
                raise ValueError(f"COMPARE count {count} is not a multiple of "
                                 f"broadcast_cols {cols}")
            flags = isa.CMP_BROADCAST_B
            b_bytes = cols * isa.DTYPE_SIZE[dt]
        b_addr = 0
        if cop not in isa.UNARY_CMP_OPS:
            if b is None:
                raise ValueError(f"COMPARE {cop.name} is binary: b is required")
            b_addr = _addr(b, "COMPARE b")
            _range(b_addr, b_bytes, "COMPARE b")
        return self._emit(Opcode.COMPARE, flags,
                          {"op": cop, "dtype": dt, "cols": cols, "count": count, "a": a,
                           "b": b_addr, "out": out},
                          name or f"COMPARE {cop.name.lower()} {dt.name.lower()} "
                                  f"count={count}" + (f" bcast={cols}" if cols else ""))

    def select(self, *, dtype: DType | int | str, count: IntLike, cond: IntLike,
               a: IntLike, b: IntLike, out: IntLike, name: Name | None = None) -> int:
        """out[i] = a[i] if cond[i] != 0 else b[i]: cond an I8 mask, a, b, out of `dtype`
        (any; the bytes are moved as they are): ONNX Where."""
        dt = as_dtype(dtype)
        count = _uint(count, "SELECT count", U64_MAX, minimum=1)
        nbytes = count * isa.DTYPE_SIZE[dt]
        f: dict[str, int | float] = {"dtype": dt, "count": count}
        for nm, v, size in (("cond", cond, count), ("a", a, nbytes), ("b", b, nbytes),
                            ("out", out, nbytes)):
            f[nm] = _addr(v, f"SELECT {nm}")
            _range(int(f[nm]), size, f"SELECT {nm}")
        return self._emit(Opcode.SELECT, 0, f,
                          name or f"SELECT {dt.name.lower()} count={count}")

    def copy(self, *, dtype: DType | int | str, shape: tuple[IntLike, ...] | list[IntLike],
             src: IntLike, dst: IntLike,
             src_strides: tuple[IntLike, ...] | list[IntLike] | None = None,
             dst_strides: tuple[IntLike, ...] | list[IntLike] | None = None,
             name: Name | None = None) -> int:
        """Strided COPY of a 1..4-D tensor: dst[i] = src[i] at element strides (default
        row-major dense). Covers transpose and reshape-with-copy."""
        dt = as_dtype(dtype)
        dims = tuple(_uint(d, "COPY shape", U32_MAX, minimum=1) for d in shape)
        if not 1 <= len(dims) <= isa.COPY_MAX_DIMS:
            raise ValueError(f"COPY shape has {len(dims)} dimensions (1..{isa.COPY_MAX_DIMS})")
        dense = contiguous_strides(dims)

        def strides(value: Any, what: str) -> tuple[int, ...]:
            if value is None:
                return dense
            st = tuple(_uint(v, what, U64_MAX) for v in value)
            if len(st) != len(dims):
                raise ValueError(f"{what} has {len(st)} entries for {len(dims)} dimensions")
            return st

        sst = strides(src_strides, "COPY src_strides")
        dst_st = strides(dst_strides, "COPY dst_strides")
        es = isa.DTYPE_SIZE[dt]
        src = _addr(src, "COPY src")
        dst = _addr(dst, "COPY dst")
        for addr, st, what in ((src, sst, "COPY src"), (dst, dst_st, "COPY dst")):
            _range(addr, (sum((d - 1) * s for d, s in zip(dims, st)) + 1) * es, what)
        span = 1
        for stride, d in sorted((s, d) for s, d in zip(dst_st, dims) if d > 1):
            if stride < span:
                raise ValueError("COPY dst_strides make destination elements overlap")
            span = stride * d
        pad = isa.COPY_MAX_DIMS - len(dims)
        fields: dict[str, int | float] = {"dtype": dt, "ndim": len(dims), "src": src,
                                          "dst": dst}
        for i, (d, s1, s2) in enumerate(zip(dims + (0,) * pad, sst + (0,) * pad,
                                            dst_st + (0,) * pad)):
            fields[f"shape{i}"], fields[f"src_stride{i}"], fields[f"dst_stride{i}"] = d, s1, s2
        return self._emit(Opcode.COPY, 0, fields,
                          name or f"COPY {dt.name.lower()} shape={list(dims)}")

    def transpose(self, *, dtype: DType | int | str, shape: tuple[IntLike, ...] | list[IntLike],
                  perm: tuple[int, ...] | list[int], src: IntLike, dst: IntLike,
                  name: Name | None = None) -> int:
        """dst (dense, shape permuted) = src (dense `shape`) transposed by `perm`, as
        numpy.transpose(src, perm): one strided COPY."""
        dims = tuple(_uint(d, "TRANSPOSE shape", U32_MAX, minimum=1) for d in shape)
        if sorted(perm) != list(range(len(dims))):
            raise ValueError(f"perm {perm!r} is not a permutation of {len(dims)} axes")
        sst = contiguous_strides(dims)
        out_shape = tuple(dims[p] for p in perm)
        return self.copy(dtype=dtype, shape=out_shape, src=src, dst=dst,
                         src_strides=tuple(sst[p] for p in perm),
                         name=name or f"TRANSPOSE shape={list(dims)} perm={list(perm)}")

    def conv2d(self, *, dtype: DType | int | str, n: IntLike, c: IntLike, h: IntLike,
               w: IntLike, k: IntLike, r: IntLike, s: IntLike, x: IntLike,
               weight: IntLike, y: IntLike, bias: IntLike | None = None,
               stride: IntLike | tuple[IntLike, IntLike] = 1,
               padding: IntLike | tuple[IntLike, IntLike, IntLike, IntLike] = 0,
               dilation: IntLike | tuple[IntLike, IntLike] = 1, groups: IntLike = 1,
               activation: Activation | int | str | None = None,
               name: Name | None = None) -> int:
        """y[n,k,oh,ow] = act(conv(x[n,c,h,w], weight[k,c/groups,r,s]) + bias[k]).

        `padding` is one int or (top, left, bottom, right); `stride` and `dilation` one
        int or (h, w). Each pad must be below the dilated kernel extent."""
        dt = _float_dtype(dtype, "CONV2D")
        dims = {nm: _uint(v, f"CONV2D {nm}", U32_MAX, minimum=1)
                for nm, v in (("n", n), ("c", c), ("h", h), ("w", w), ("k", k), ("r", r),
                              ("s", s), ("groups", groups))}
        sh, sw = _pair(stride, "CONV2D stride", U16_MAX, 1)
        dh, dw = _pair(dilation, "CONV2D dilation", U16_MAX, 1)
        if isinstance(padding, (tuple, list)):
            if len(padding) != 4:
                raise ValueError("CONV2D padding must be one int or (top, left, bottom, right)")
            pads = tuple(_uint(p, "CONV2D padding", U16_MAX) for p in padding)
        else:
            pads = (_uint(padding, "CONV2D padding", U16_MAX),) * 4
        pt, pl, pb, pr = pads
        g = dims["groups"]
        if dims["c"] % g or dims["k"] % g:
            raise ValueError(f"CONV2D c={dims['c']} and k={dims['k']} must be multiples of "
                             f"groups={g}")
        eh, ew = dh * (dims["r"] - 1) + 1, dw * (dims["s"] - 1) + 1
        if max(pt, pb) >= eh or max(pl, pr) >= ew:
            raise ValueError(f"CONV2D padding {pads} must be below the dilated kernel "
                             f"extent ({eh}, {ew})")
        oh, ow = conv2d_output_hw(dims["h"], dims["w"], dims["r"], dims["s"], (sh, sw),
                                  (pt, pl, pb, pr), (dh, dw))
        act = as_activation(activation)
        es = isa.DTYPE_SIZE[dt]
        fields: dict[str, int | float] = {
            "dtype": dt, "activation": act, **dims, "stride_h": sh, "stride_w": sw,
            "dilation_h": dh, "dilation_w": dw, "pad_top": pt, "pad_left": pl,
            "pad_bottom": pb, "pad_right": pr,
            "x": _addr(x, "CONV2D x"), "weight": _addr(weight, "CONV2D weight"),
            "y": _addr(y, "CONV2D y")}
        nn, cc, kk = dims["n"], dims["c"], dims["k"]
        _range(int(fields["x"]), nn * cc * dims["h"] * dims["w"] * es, "CONV2D x")
        _range(int(fields["weight"]), kk * (cc // g) * dims["r"] * dims["s"] * es,
               "CONV2D weight")
        _range(int(fields["y"]), nn * kk * oh * ow * es, "CONV2D y")
        flags = 0
        if bias is not None:
            flags = isa.CONV_BIAS
            fields["bias"] = _addr(bias, "CONV2D bias")
            _range(int(fields["bias"]), kk * es, "CONV2D bias")
        return self._emit(Opcode.CONV2D, flags, fields, name or (
            f"CONV2D {dt.name.lower()} n={nn} c={cc} {dims['h']}x{dims['w']} k={kk} "
            f"{dims['r']}x{dims['s']} -> {oh}x{ow}"))

    def pool2d(self, op: PoolOp | int | str, *, dtype: DType | int | str, n: IntLike,
               c: IntLike, h: IntLike, w: IntLike, r: IntLike, s: IntLike, x: IntLike,
               y: IntLike, stride: IntLike | tuple[IntLike, IntLike] = 1,
               padding: IntLike | tuple[IntLike, IntLike, IntLike, IntLike] = 0,
               dilation: IntLike | tuple[IntLike, IntLike] = 1,
               count_include_pad: bool = False, ceil: bool = False,
               name: Name | None = None) -> int:
        """y[n,c,oh,ow] = max or mean of the r x s windows of x[n,c,h,w]. MAX pads with
        -inf; AVG divides by the taps inside the input (or, with `count_include_pad`,
        inside the padded input). Each pad must be below the dilated kernel extent."""
        pop = as_poolop(op)
        dt = _float_dtype(dtype, "POOL2D")
        dims = {nm: _uint(v, f"POOL2D {nm}", U32_MAX, minimum=1)
                for nm, v in (("n", n), ("c", c), ("h", h), ("w", w))}
        r = _uint(r, "POOL2D r", U16_MAX, minimum=1)
        s = _uint(s, "POOL2D s", U16_MAX, minimum=1)
        sh, sw = _pair(stride, "POOL2D stride", U16_MAX, 1)
        dh, dw = _pair(dilation, "POOL2D dilation", U16_MAX, 1)
        if isinstance(padding, (tuple, list)):
            if len(padding) != 4:
                raise ValueError("POOL2D padding must be one int or (top, left, bottom, right)")
            pads = tuple(_uint(p, "POOL2D padding", U16_MAX) for p in padding)
        else:
            pads = (_uint(padding, "POOL2D padding", U16_MAX),) * 4
        pt, pl, pb, pr = pads
        eh, ew = dh * (r - 1) + 1, dw * (s - 1) + 1
        if max(pt, pb) >= eh or max(pl, pr) >= ew:
            raise ValueError(f"POOL2D padding {pads} must be below the dilated kernel "
                             f"extent ({eh}, {ew})")
        if count_include_pad and pop != PoolOp.AVG:
            raise ValueError("POOL2D count_include_pad is for AVG only")
        oh, ow = pool2d_output_hw(dims["h"], dims["w"], r, s, (sh, sw), (pt, pl, pb, pr),
                                  (dh, dw), ceil)
        es = isa.DTYPE_SIZE[dt]
        xa, ya = _addr(x, "POOL2D x"), _addr(y, "POOL2D y")
        _range(xa, dims["n"] * dims["c"] * dims["h"] * dims["w"] * es, "POOL2D x")
        _range(ya, dims["n"] * dims["c"] * oh * ow * es, "POOL2D y")
        flags = (isa.POOL_COUNT_INCLUDE_PAD if count_include_pad else 0) | \
            (isa.POOL_CEIL if ceil else 0)
        return self._emit(Opcode.POOL2D, flags, {
            "dtype": dt, "op": pop, **dims, "r": r, "s": s, "stride_h": sh, "stride_w": sw,
            "dilation_h": dh, "dilation_w": dw, "pad_top": pt, "pad_left": pl,
            "pad_bottom": pb, "pad_right": pr, "x": xa, "y": ya},
            name or f"POOL2D {pop.name.lower()} {dt.name.lower()} n={dims['n']} "
                    f"c={dims['c']} {dims['h']}x{dims['w']} {r}x{s} -> {oh}x{ow}")

    def gather(self, *, dtype: DType | int | str, rows: IntLike, cols: IntLike,
               count: IntLike, table: IntLike, indices: IntLike, out: IntLike,
               name: Name | None = None) -> int:
        """out[i, :] = table[indices[i], :] (I32 indices in [-rows, rows), negative from
        the end; any other index gives a row of zeros): an embedding lookup."""
        dt = as_dtype(dtype)
        rows = _uint(rows, "GATHER rows", U32_MAX, minimum=1)
        cols = _uint(cols, "GATHER cols", U32_MAX, minimum=1)
        count = _uint(count, "GATHER count", U32_MAX, minimum=1)
        es = isa.DTYPE_SIZE[dt]
        ta, ia, oa = (_addr(table, "GATHER table"), _addr(indices, "GATHER indices"),
                      _addr(out, "GATHER out"))
        _range(ta, rows * cols * es, "GATHER table")
        _range(ia, count * 4, "GATHER indices")
        _range(oa, count * cols * es, "GATHER out")
        return self._emit(Opcode.GATHER, 0, {"dtype": dt, "rows": rows, "cols": cols,
                                             "count": count, "table": ta, "indices": ia,
                                             "out": oa},
                          name or f"GATHER {dt.name.lower()} {count} of {rows}x{cols}")

    def _rows(self, opcode: Opcode, dtype: Any, rows: IntLike, cols: IntLike,
              x: IntLike) -> tuple[DType, int, int, int]:
        what = opcode.name
        dt = _float_dtype(dtype, what)
        rows = _uint(rows, f"{what} rows", U32_MAX, minimum=1)
        cols = _uint(cols, f"{what} cols", U32_MAX, minimum=1)
        xa = _addr(x, f"{what} x")
        _range(xa, rows * cols * isa.DTYPE_SIZE[dt], f"{what} x")
        return dt, rows, cols, xa

    def softmax(self, *, dtype: DType | int | str, rows: IntLike, cols: IntLike,
                x: IntLike, y: IntLike, name: Name | None = None) -> int:
        """y = softmax(x) over the last axis of [rows, cols] (max-subtracted, f32 math)."""
        dt, rows, cols, xa = self._rows(Opcode.SOFTMAX, dtype, rows, cols, x)
        ya = _addr(y, "SOFTMAX y")
        _range(ya, rows * cols * isa.DTYPE_SIZE[dt], "SOFTMAX y")
        return self._emit(Opcode.SOFTMAX, 0, {"dtype": dt, "rows": rows, "cols": cols,
                                              "x": xa, "y": ya},
                          name or f"SOFTMAX {dt.name.lower()} {rows}x{cols}")

    def layernorm(self, *, dtype: DType | int | str, rows: IntLike, cols: IntLike,
                  x: IntLike, gamma: IntLike, beta: IntLike, y: IntLike,
                  epsilon: float = 1e-5, name: Name | None = None) -> int:
        """y = (x - mean) / sqrt(var + epsilon) * gamma + beta over the last axis."""
        dt, rows, cols, xa = self._rows(Opcode.LAYERNORM, dtype, rows, cols, x)
        eps = check_f32(epsilon, "LAYERNORM epsilon")
        if eps < 0:
            raise ValueError(f"LAYERNORM epsilon = {eps!r} must be >= 0")
        es = isa.DTYPE_SIZE[dt]
        fields: dict[str, int | float] = {"dtype": dt, "rows": rows, "cols": cols,
                                          "epsilon": eps, "x": xa}
        for key, v, size in (("gamma", gamma, cols), ("beta", beta, cols),
                             ("y", y, rows * cols)):
            fields[key] = _addr(v, f"LAYERNORM {key}")
            _range(int(fields[key]), size * es, f"LAYERNORM {key}")
        return self._emit(Opcode.LAYERNORM, 0, fields,
                          name or f"LAYERNORM {dt.name.lower()} {rows}x{cols}")

    def reduce(self, op: ReduceOp | int | str, *, dtype: DType | int | str, rows: IntLike,
               cols: IntLike, x: IntLike, y: IntLike, name: Name | None = None) -> int:
        """y[rows] = op(x[rows, cols]) over the last axis: sum, max, mean, min."""
        rop = as_reduceop(op)
        dt, rows, cols, xa = self._rows(Opcode.REDUCE, dtype, rows, cols, x)
        ya = _addr(y, "REDUCE y")
        _range(ya, rows * isa.DTYPE_SIZE[dt], "REDUCE y")
        return self._emit(Opcode.REDUCE, 0, {"op": rop, "dtype": dt, "rows": rows,
                                             "cols": cols, "x": xa, "y": ya},
                          name or f"REDUCE {rop.name.lower()} {dt.name.lower()} "
                                  f"{rows}x{cols}")

    def _quant(self, opcode: Opcode, dtype: Any, int_dtype: Any, count: IntLike,
               x: IntLike, y: IntLike, scale: float, zero_point: IntLike,
               name: Name | None) -> int:
        what = opcode.name
        dt = _float_dtype(dtype, what)
        idt = as_dtype(int_dtype)
        allowed = (DType.I8,) if opcode == Opcode.QUANTIZE else (DType.I8, DType.I32)
        if idt not in allowed:
            raise ValueError(f"{what} integer dtype {idt.name} is not supported")
        count = _uint(count, f"{what} count", U64_MAX, minimum=1)
        sc = check_f32(scale, f"{what} scale")
        if not sc > 0:
            raise ValueError(f"{what} scale = {sc!r} must be > 0")
        zp = _int(zero_point, f"{what} zero_point")
        lo, hi = (-128, 127) if idt == DType.I8 else (-(1 << 31), (1 << 31) - 1)
        if not lo <= zp <= hi:
            raise ValueError(f"{what} zero_point = {zp} is out of range [{lo}, {hi}]")
        xa, ya = _addr(x, f"{what} x"), _addr(y, f"{what} y")
        fsize, isize = isa.DTYPE_SIZE[dt], isa.DTYPE_SIZE[idt]
        quant = opcode == Opcode.QUANTIZE
        _range(xa, count * (fsize if quant else isize), f"{what} x")
        _range(ya, count * (isize if quant else fsize), f"{what} y")
        return self._emit(opcode, 0, {"dtype": dt, "int_dtype": idt, "scale": sc,
                                      "zero_point": zp, "count": count, "x": xa, "y": ya},
                          name or f"{what} {dt.name.lower()}<->{idt.name.lower()} "
                                  f"count={count} scale={sc:g} zp={zp}")

    def quantize(self, *, count: IntLike, x: IntLike, y: IntLike, scale: float,
                 zero_point: IntLike = 0, dtype: DType | int | str = DType.F32,
                 name: Name | None = None) -> int:
        """y(i8) = saturate(round_half_even(x / scale) + zero_point), ONNX QuantizeLinear;
        `dtype` is the float input's (F32 or F16)."""
        return self._quant(Opcode.QUANTIZE, dtype, DType.I8, count, x, y, scale, zero_point,
                           name)

    def dequantize(self, *, count: IntLike, x: IntLike, y: IntLike, scale: float,
                   zero_point: IntLike = 0, dtype: DType | int | str = DType.F32,
                   src_dtype: DType | int | str = DType.I8, name: Name | None = None) -> int:
        """y(dtype) = (x - zero_point) * scale, ONNX DequantizeLinear; x is I8 or I32."""
        return self._quant(Opcode.DEQUANTIZE, dtype, src_dtype, count, x, y, scale,
                           zero_point, name)

    def quantize_dynamic(self, *, count: IntLike, x: IntLike, y: IntLike, qparams: IntLike,
                         dtype: DType | int | str = DType.F32,
                         name: Name | None = None) -> int:
        """QUANTIZE with the scale and zero point of x's run-time range (widened to hold
        0, on int8's 256 codes), which it also writes to the 8-byte record at `qparams`
        (scale f32, zero point i32) for DEQUANTIZE_DYNAMIC."""
        what = "QUANTIZE_DYNAMIC"
        dt = _float_dtype(dtype, what)
        count = _uint(count, f"{what} count", U64_MAX, minimum=1)
        xa, ya, qa = _addr(x, f"{what} x"), _addr(y, f"{what} y"), _addr(qparams,
                                                                         f"{what} qparams")
        _range(xa, count * isa.DTYPE_SIZE[dt], f"{what} x")
        _range(ya, count, f"{what} y")
        _range(qa, isa.QPARAMS.size, f"{what} qparams")
        return self._emit(Opcode.QUANTIZE_DYNAMIC, 0,
                          {"dtype": dt, "int_dtype": DType.I8, "count": count, "x": xa,
                           "y": ya, "qparams": qa},
                          name or f"{what} {dt.name.lower()}->i8 count={count}")

    def dequantize_dynamic(self, *, count: IntLike, channels: IntLike, inner: IntLike = 1,
                           x: IntLike, y: IntLike, qparams: IntLike, wscale: IntLike,
                           wsum: IntLike, bias: IntLike | None = None,
                           activation: Activation | int | str | None = None,
                           dtype: DType | int | str = DType.F32,
                           name: Name | None = None) -> int:
        """int8 GEMM sums x (I32, [count / (channels * inner), channels, inner]) to
        y = act(f32(x - zp * wsum[c]) * (scale * wscale[c]) + bias[c]), with (scale, zp)
        read from the record QUANTIZE_DYNAMIC wrote at `qparams` at run time."""
        what = "DEQUANTIZE_DYNAMIC"
        dt = _float_dtype(dtype, what)
        act = as_activation(activation)
        if act not in (Activation.NONE, Activation.RELU):
            raise ValueError(f"{what} activation {act.name} (only NONE, RELU)")
        count = _uint(count, f"{what} count", U64_MAX, minimum=1)
        ch = _uint(channels, f"{what} channels", U32_MAX, minimum=1)
        inn = _uint(inner, f"{what} inner", U32_MAX, minimum=1)
        if count % (ch * inn):
            raise ValueError(f"{what} count {count} is not a multiple of channels * inner "
                             f"({ch} * {inn})")
        fields: dict[str, int | float] = {"dtype": dt, "activation": act, "channels": ch,
                                          "inner": inn, "count": count}
        sizes = {"x": count * 4, "y": count * isa.DTYPE_SIZE[dt], "qparams": isa.QPARAMS.size,
                 "wscale": ch * 4, "wsum": ch * 4, "bias": ch * 4}
        flags = 0
        for key, v in (("x", x), ("y", y), ("qparams", qparams), ("wscale", wscale),
                       ("wsum", wsum), ("bias", bias)):
            if v is None:
                continue
            fields[key] = _addr(v, f"{what} {key}")
            _range(int(fields[key]), sizes[key], f"{what} {key}")
        if bias is not None:
            flags |= isa.DQD_BIAS
        extra = (" +bias" if bias is not None else "") + (
            f" {act.name.lower()}" if act != Activation.NONE else "")
        return self._emit(Opcode.DEQUANTIZE_DYNAMIC, flags, fields,
                          name or f"{what} i32->{dt.name.lower()} count={count} "
                                  f"channels={ch} inner={inn}{extra}")

    def call(self, addr: IntLike, size: IntLike, *, name: Name | None = None) -> int:
        """CALL the command buffer of `size` bytes (> 0, a multiple of 8) at host IOVA
        `addr`; it is validated with the caller, before anything runs."""
        addr = _addr(addr, "CALL addr")
        size = _uint(size, "CALL size", U32_MAX, minimum=isa.ALIGN)
        if size % isa.ALIGN:
            raise ValueError(f"CALL size {size} is not a multiple of {isa.ALIGN}")
        _range(addr, size, "CALL addr")
        return self._emit(Opcode.CALL, 0, {"addr": addr, "size": size},
                          name or f"CALL addr={addr:#x} size={size}")

    def signal(self, addr: IntLike, value: IntLike, *, name: Name | None = None) -> int:
        """Write the 8-byte `value` to host IOVA `addr`."""
        addr = _addr(addr, "SIGNAL addr")
        _range(addr, 8, "SIGNAL addr")
        value = _uint(value, "SIGNAL value", U64_MAX)
        return self._emit(Opcode.SIGNAL, 0, {"addr": addr, "value": value},
                          name or f"SIGNAL addr={addr:#x} value={value}")

    def wait(self, addr: IntLike, value: IntLike, *, name: Name | None = None) -> int:
        """Wait until the 8-byte value at host IOVA `addr` is >= `value` (the device
        polls in virtual time with backoff; the function's preemption timeout bounds
        the wait: a WAIT never satisfied fails with TIMEOUT)."""
        addr = _addr(addr, "WAIT addr")
        _range(addr, 8, "WAIT addr")
        value = _uint(value, "WAIT value", U64_MAX)
        return self._emit(Opcode.WAIT, 0, {"addr": addr, "value": value},
                          name or f"WAIT addr={addr:#x} value>={value}")

    def timestamp(self, addr: IntLike, *, name: Name | None = None) -> int:
        """Write the command's start time (ns, 8 bytes) to host IOVA `addr`."""
        addr = _addr(addr, "TIMESTAMP addr")
        _range(addr, 8, "TIMESTAMP addr")
        return self._emit(Opcode.TIMESTAMP, 0, {"addr": addr},
                          name or f"TIMESTAMP addr={addr:#x}")

    def raw(self, opcode: IntLike, payload: builtins.bytes = b"", *,
            flags: IntLike = 0, length: IntLike | None = None, name: Name | None = None) -> int:
        """Append a header and payload as given, unchecked (for negative tests).

        `length` defaults to 8 + len(payload); the bytes written are always exactly the
        header plus `payload`, whatever `length` claims.
        """
        opcode = _uint(opcode, "opcode", U16_MAX)
        flags = _uint(flags, "flags", U16_MAX)
        claimed = isa.HEADER.size + len(payload) if length is None else \
            _uint(length, "length", U32_MAX)
        total = isa.HEADER.size + len(payload)
        self._reserve(total)
        offset = len(self._data)
        self._data += struct.pack(isa.HEADER.format, opcode, flags, claimed)
        self._data += payload
        self._record(offset, opcode, total, name or f"raw {_opcode_name(opcode)}")
        return offset


# --- decoding -----------------------------------------------------------------------


def decode(data: builtins.bytes | bytearray | memoryview) -> list[DecodedCommand]:
    """Split a command buffer into commands and unpack each payload by its layout.

    Raises ValueError naming the offset when a header is truncated, a length is invalid,
    or a command runs past the end; unknown opcodes decode with empty fields.
    """
    buf = builtins.bytes(data)
    out: list[DecodedCommand] = []
    pos = 0
    hsize = isa.HEADER.size
    while pos < len(buf):
        if len(buf) - pos < hsize:
            raise ValueError(f"offset {pos}: truncated header ({len(buf) - pos} bytes left)")
        opcode, flags, length = struct.unpack_from(isa.HEADER.format, buf, pos)
        if length < hsize or length % isa.ALIGN:
            raise ValueError(f"offset {pos}: bad command length {length}")
        if pos + length > len(buf):
            raise ValueError(f"offset {pos}: command of length {length} runs past the end "
                             f"({len(buf)} bytes)")
        fields: dict[str, int | float] = {}
        if opcode in isa.PAYLOAD.keys() and opcode != Opcode.NOP:
            layout = isa.PAYLOAD[Opcode(opcode)]
            if length != hsize + layout.size:
                raise ValueError(f"offset {pos}: {Opcode(opcode).name} length {length}, "
                                 f"expected {hsize + layout.size}")
            values = struct.unpack_from(layout.format, buf, pos + hsize)
            fields = dict(zip(layout.names, values, strict=True))
        out.append(DecodedCommand(pos, opcode, flags, length, fields))
        pos += length
    return out


def _format_field(cmd: DecodedCommand, key: str, value: int | float) -> str:
    if isinstance(value, float):
        return f"{key}={value:g}"
    if key == "dtype":
        try:
            return f"dtype={DType(value).name}"
        except ValueError:
            pass
    elif key == "activation":
        try:
            return f"activation={Activation(value).name}"
        except ValueError:
            pass
    elif key == "int_dtype":
        try:
            return f"int_dtype={DType(value).name}"
        except ValueError:
            pass
    elif key == "op" and cmd.opcode in (Opcode.ELEMENTWISE, Opcode.REDUCE, Opcode.POOL2D,
                                        Opcode.COMPARE):
        enum: type[EltOp] | type[ReduceOp] | type[PoolOp] | type[CmpOp] = (
            EltOp if cmd.opcode == Opcode.ELEMENTWISE else
            ReduceOp if cmd.opcode == Opcode.REDUCE else
            CmpOp if cmd.opcode == Opcode.COMPARE else PoolOp)
        try:
            return f"op={enum(value).name}"
        except ValueError:
            pass
    elif key in ("src", "dst", "a", "b", "c", "bias", "out", "addr", "pattern", "x", "y",
                 "weight", "gamma", "beta", "table", "indices", "cond", "qparams", "wscale",
                 "wsum"):
        return f"{key}={value:#x}"
    return f"{key}={value}"


def disassemble(data: builtins.bytes | bytearray | memoryview,
                names: Mapping[int, str] | None = None) -> str:
    """Human-readable listing: offset, opcode, flags, fields (and names by offset)."""
    lines = []
    for cmd in decode(data):
        parts = [f"{cmd.offset:#06x}", f"{cmd.opcode_name:<11}", f"len={cmd.length}"]
        if cmd.flags:
            parts.append(f"flags={cmd.flags:#x}")
        parts += [_format_field(cmd, k, v) for k, v in cmd.fields.items()
                  if not k.startswith("reserved") or v]
        line = " ".join(parts)
        if names and cmd.offset in names:
            line += f"  ; {names[cmd.offset]}"
        lines.append(line)
    return "\n".join(lines)
