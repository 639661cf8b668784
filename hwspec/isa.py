"""VA-1 command ISA: header, opcodes, payload layouts, dtypes.

Every command is a header followed by its payload; `length` counts both, is a multiple
of 8 and is exactly `8 + payload.size` except for NOP, which may be longer (padding).
"""
from __future__ import annotations

from enum import IntEnum

from .layout import Layout

HEADER = Layout("va1_cmd_header", (("opcode", "H"), ("flags", "H"), ("length", "I")))
ALIGN = 8


class Opcode(IntEnum):
    NOP = 0x00
    FILL = 0x01
    DMA_H2D = 0x02
    DMA_D2H = 0x03
    DMA_D2D = 0x04
    GEMM = 0x10
    ELEMENTWISE = 0x11
    SIGNAL = 0x20
    TIMESTAMP = 0x21


class DType(IntEnum):
    F32 = 0
    F16 = 1
    I8 = 2
    I32 = 3


DTYPE_SIZE = {DType.F32: 4, DType.F16: 2, DType.I8: 1, DType.I32: 4}
DTYPE_NUMPY = {DType.F32: "<f4", DType.F16: "<f2", DType.I8: "i1", DType.I32: "<i4"}


class Activation(IntEnum):
    NONE = 0
    RELU = 1


class EltOp(IntEnum):
    ADD = 0
    MUL = 1
    RELU = 2  # unary: b is ignored


UNARY_ELT_OPS = frozenset({EltOp.RELU})

# GEMM header flags.
GEMM_TRANS_A = 1 << 0
GEMM_TRANS_B = 1 << 1
GEMM_BIAS = 1 << 2
GEMM_FLAGS_ALL = GEMM_TRANS_A | GEMM_TRANS_B | GEMM_BIAS

PAYLOAD: dict[Opcode, Layout] = {
    Opcode.NOP: Layout("va1_nop", ()),
    Opcode.FILL: Layout("va1_fill", (
        ("dst", "Q"), ("size", "Q"), ("pattern", "I"), ("reserved", "I"))),
    Opcode.DMA_H2D: Layout("va1_dma", (("src", "Q"), ("dst", "Q"), ("size", "Q"))),
    Opcode.DMA_D2H: Layout("va1_dma", (("src", "Q"), ("dst", "Q"), ("size", "Q"))),
    Opcode.DMA_D2D: Layout("va1_dma", (("src", "Q"), ("dst", "Q"), ("size", "Q"))),
    Opcode.GEMM: Layout("va1_gemm", (
        ("dtype", "B"), ("activation", "B"), ("reserved", "H"),
        ("m", "I"), ("n", "I"), ("k", "I"),
        ("a", "Q"), ("b", "Q"), ("c", "Q"), ("bias", "Q"),
        ("alpha", "f"), ("beta", "f"))),
    Opcode.ELEMENTWISE: Layout("va1_elementwise", (
        ("op", "B"), ("dtype", "B"), ("reserved", "H"), ("reserved2", "I"),
        ("count", "Q"), ("a", "Q"), ("b", "Q"), ("out", "Q"))),
    Opcode.SIGNAL: Layout("va1_signal", (("addr", "Q"), ("value", "Q"))),
    Opcode.TIMESTAMP: Layout("va1_timestamp", (("addr", "Q"),)),
}


def command_length(opcode: Opcode) -> int:
    return HEADER.size + PAYLOAD[opcode].size
