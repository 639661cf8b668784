"""VA-1 command ISA: header, opcodes, payload layouts, dtypes, enums and flags.

Every command is a header followed by its payload; `length` counts both, is a multiple
of 8 and is exactly `8 + payload.size` except for NOP, which may be longer (padding).
See docs/spec.md §7 for the semantics and validation rules behind each layout.
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
    COPY = 0x08          # strided copy / transpose, up to 4-D
    GATHER = 0x09        # rows of a table by I32 indices (embedding lookup)
    GEMM = 0x10
    ELEMENTWISE = 0x11
    GEMM_BATCHED = 0x13  # strided batched GEMM (attention), leading dimensions per operand
    COMPARE = 0x14       # comparisons and logic -> an I8 mask of 0 / 1
    SELECT = 0x15        # out = cond != 0 ? a : b (Where)
    QUANTIZE_DYNAMIC = 0x16    # QUANTIZE with the scale and zero point of x's run-time range
    DEQUANTIZE_DYNAMIC = 0x17  # int8 GEMM sums -> floats with run-time and per-channel scales
    CONV2D = 0x18
    SOFTMAX = 0x19
    LAYERNORM = 0x1A
    REDUCE = 0x1B
    QUANTIZE = 0x1C
    DEQUANTIZE = 0x1D
    POOL2D = 0x1E        # max / average pooling, NCHW
    SIGNAL = 0x20
    TIMESTAMP = 0x21
    WAIT = 0x22          # poll a host u64 until it is >= value (preemptible)
    CALL = 0x28          # run a sub-buffer at an IOVA (bounded nesting)


class DType(IntEnum):
    F32 = 0
    F16 = 1
    I8 = 2
    I32 = 3


DTYPE_SIZE = {DType.F32: 4, DType.F16: 2, DType.I8: 1, DType.I32: 4}
DTYPE_NUMPY = {DType.F32: "<f4", DType.F16: "<f2", DType.I8: "i1", DType.I32: "<i4"}

FLOAT_DTYPES = frozenset({DType.F32, DType.F16})
INT_DTYPES = frozenset({DType.I8, DType.I32})   # need VA1_F_INT8


class Activation(IntEnum):
    """GEMM / CONV2D epilogue."""
    NONE = 0
    RELU = 1
    GELU = 2      # exact (erf) form, as ONNX Gelu default
    SIGMOID = 3
    SILU = 4      # x * sigmoid(x)


class EltOp(IntEnum):
    ADD = 0
    MUL = 1
    RELU = 2      # unary: b is ignored
    SUB = 3
    DIV = 4
    GELU = 5      # unary
    SIGMOID = 6   # unary
    MAX = 7
    MIN = 8
    POW = 9
    ERF = 10         # unary, from here on
    SQRT = 11
    TANH = 12
    EXP = 13
    NEG = 14
    RECIPROCAL = 15
    SILU = 16
    ABS = 17
    LOG = 18


UNARY_ELT_OPS = frozenset({EltOp.RELU, EltOp.GELU, EltOp.SIGMOID, EltOp.ERF, EltOp.SQRT,
                           EltOp.TANH, EltOp.EXP, EltOp.NEG, EltOp.RECIPROCAL, EltOp.SILU,
                           EltOp.ABS, EltOp.LOG})


class CmpOp(IntEnum):
    """COMPARE: out = 1 where the relation holds, else 0 (an I8 mask). The logic ops
    take nonzero as true."""
    EQUAL = 0
    LESS = 1
    GREATER = 2
    LESS_EQUAL = 3
    GREATER_EQUAL = 4
    AND = 5
    OR = 6
    XOR = 7
    NOT = 8       # unary: b is ignored


UNARY_CMP_OPS = frozenset({CmpOp.NOT})


class PoolOp(IntEnum):
    MAX = 0
    AVG = 1


class ReduceOp(IntEnum):
    SUM = 0
    MAX = 1
    MEAN = 2
    MIN = 3


# GEMM header flags.
GEMM_TRANS_A = 1 << 0
GEMM_TRANS_B = 1 << 1
GEMM_BIAS = 1 << 2
GEMM_FLAGS_ALL = GEMM_TRANS_A | GEMM_TRANS_B | GEMM_BIAS

# GEMM_BATCHED takes the GEMM flags and at most this many batches per command.
GEMM_BATCHED_MAX_BATCH = 65535

# ELEMENTWISE header flags.
ELT_BROADCAST_B = 1 << 0   # b is a [cols] vector repeated over count / cols rows
ELT_FLAGS_ALL = ELT_BROADCAST_B

# COMPARE header flags: BROADCAST_B as ELEMENTWISE's (b a [cols] vector).
CMP_BROADCAST_B = 1 << 0
CMP_FLAGS_ALL = CMP_BROADCAST_B

# CONV2D header flags.
CONV_BIAS = 1 << 0
CONV_FLAGS_ALL = CONV_BIAS

# POOL2D header flags.
POOL_COUNT_INCLUDE_PAD = 1 << 0   # AVG divides by the taps inside the padded input
POOL_CEIL = 1 << 1                # output extent rounded up (ONNX ceil_mode)
POOL_FLAGS_ALL = POOL_COUNT_INCLUDE_PAD | POOL_CEIL

# DEQUANTIZE_DYNAMIC header flags.
DQD_BIAS = 1 << 0
DQD_FLAGS_ALL = DQD_BIAS

# QUANTIZE_DYNAMIC writes, and DEQUANTIZE_DYNAMIC reads, this record at `qparams`.
QPARAMS = Layout("va1_qparams", (("scale", "f"), ("zero_point", "i")))

# WAIT: polling in virtual time. The first poll is at the command's start; the next
# ones follow after WAIT_POLL_MIN_NS, doubling up to WAIT_POLL_MAX_NS (backoff).
WAIT_POLL_MIN_NS = 1_000
WAIT_POLL_MAX_NS = 64_000

# COPY: at most this many dimensions.
COPY_MAX_DIMS = 4

# CALL: the expanded submission (top-level buffer plus every callee, each time it is
# called) may hold at most CALL_EXPANSION_FACTOR * max_cmdbuf_size bytes.
CALL_EXPANSION_FACTOR = 4

_QUANT = Layout("va1_quant", (
    ("dtype", "B"), ("int_dtype", "B"), ("reserved", "H"), ("scale", "f"),
    ("zero_point", "i"), ("reserved2", "I"),
    ("count", "Q"), ("x", "Q"), ("y", "Q")))

PAYLOAD: dict[Opcode, Layout] = {
    Opcode.NOP: Layout("va1_nop", ()),
    Opcode.FILL: Layout("va1_fill", (
        ("dst", "Q"), ("size", "Q"), ("pattern", "I"), ("reserved", "I"))),
    Opcode.DMA_H2D: Layout("va1_dma", (("src", "Q"), ("dst", "Q"), ("size", "Q"))),
    Opcode.DMA_D2H: Layout("va1_dma", (("src", "Q"), ("dst", "Q"), ("size", "Q"))),
    Opcode.DMA_D2D: Layout("va1_dma", (("src", "Q"), ("dst", "Q"), ("size", "Q"))),
    Opcode.COPY: Layout("va1_copy", (
        ("dtype", "B"), ("ndim", "B"), ("reserved", "H"), ("reserved2", "I"),
        ("src", "Q"), ("dst", "Q"),
        ("shape0", "I"), ("shape1", "I"), ("shape2", "I"), ("shape3", "I"),
        ("src_stride0", "Q"), ("src_stride1", "Q"), ("src_stride2", "Q"),
        ("src_stride3", "Q"),
        ("dst_stride0", "Q"), ("dst_stride1", "Q"), ("dst_stride2", "Q"),
        ("dst_stride3", "Q"))),
    Opcode.GEMM: Layout("va1_gemm", (
        ("dtype", "B"), ("activation", "B"), ("reserved", "H"),
        ("m", "I"), ("n", "I"), ("k", "I"),
        ("a", "Q"), ("b", "Q"), ("c", "Q"), ("bias", "Q"),
        ("alpha", "f"), ("beta", "f"))),
    Opcode.GEMM_BATCHED: Layout("va1_gemm_batched", (
        ("dtype", "B"), ("activation", "B"), ("reserved", "H"), ("batch", "I"),
        ("m", "I"), ("n", "I"), ("k", "I"), ("reserved2", "I"),
        ("a", "Q"), ("b", "Q"), ("c", "Q"), ("bias", "Q"),
        ("lda", "Q"), ("ldb", "Q"), ("ldc", "Q"),
        ("stride_a", "Q"), ("stride_b", "Q"), ("stride_c", "Q"),
        ("alpha", "f"), ("beta", "f"))),
    Opcode.ELEMENTWISE: Layout("va1_elementwise", (
        ("op", "B"), ("dtype", "B"), ("reserved", "H"), ("cols", "I"),
        ("count", "Q"), ("a", "Q"), ("b", "Q"), ("out", "Q"))),
    Opcode.COMPARE: Layout("va1_compare", (
        ("op", "B"), ("dtype", "B"), ("reserved", "H"), ("cols", "I"),
        ("count", "Q"), ("a", "Q"), ("b", "Q"), ("out", "Q"))),
    Opcode.SELECT: Layout("va1_select", (
        ("dtype", "B"), ("reserved", "B"), ("reserved2", "H"), ("reserved3", "I"),
        ("count", "Q"), ("cond", "Q"), ("a", "Q"), ("b", "Q"), ("out", "Q"))),
    Opcode.GATHER: Layout("va1_gather", (
        ("dtype", "B"), ("reserved", "B"), ("reserved2", "H"),
        ("rows", "I"), ("cols", "I"), ("count", "I"),
        ("table", "Q"), ("indices", "Q"), ("out", "Q"))),
    Opcode.POOL2D: Layout("va1_pool2d", (
        ("dtype", "B"), ("op", "B"), ("reserved", "H"),
        ("n", "I"), ("c", "I"), ("h", "I"), ("w", "I"), ("reserved2", "I"),
        ("r", "H"), ("s", "H"), ("stride_h", "H"), ("stride_w", "H"),
        ("dilation_h", "H"), ("dilation_w", "H"),
        ("pad_top", "H"), ("pad_left", "H"), ("pad_bottom", "H"), ("pad_right", "H"),
        ("reserved3", "I"), ("x", "Q"), ("y", "Q"))),
    Opcode.CONV2D: Layout("va1_conv2d", (
        ("dtype", "B"), ("activation", "B"), ("reserved", "H"), ("groups", "I"),
        ("n", "I"), ("c", "I"), ("h", "I"), ("w", "I"),
        ("k", "I"), ("r", "I"), ("s", "I"),
        ("stride_h", "H"), ("stride_w", "H"), ("dilation_h", "H"), ("dilation_w", "H"),
        ("pad_top", "H"), ("pad_left", "H"), ("pad_bottom", "H"), ("pad_right", "H"),
        ("reserved2", "I"),
        ("x", "Q"), ("weight", "Q"), ("bias", "Q"), ("y", "Q"))),
    Opcode.SOFTMAX: Layout("va1_softmax", (
        ("dtype", "B"), ("reserved", "B"), ("reserved2", "H"),
        ("rows", "I"), ("cols", "I"), ("reserved3", "I"),
        ("x", "Q"), ("y", "Q"))),
    Opcode.LAYERNORM: Layout("va1_layernorm", (
        ("dtype", "B"), ("reserved", "B"), ("reserved2", "H"),
        ("rows", "I"), ("cols", "I"), ("epsilon", "f"),
        ("x", "Q"), ("gamma", "Q"), ("beta", "Q"), ("y", "Q"))),
    Opcode.REDUCE: Layout("va1_reduce", (
        ("op", "B"), ("dtype", "B"), ("reserved", "H"),
        ("rows", "I"), ("cols", "I"), ("reserved2", "I"),
        ("x", "Q"), ("y", "Q"))),
    Opcode.QUANTIZE: _QUANT,
    Opcode.DEQUANTIZE: _QUANT,
    Opcode.QUANTIZE_DYNAMIC: Layout("va1_quant_dynamic", (
        ("dtype", "B"), ("int_dtype", "B"), ("reserved", "H"), ("reserved2", "I"),
        ("count", "Q"), ("x", "Q"), ("y", "Q"), ("qparams", "Q"))),
    Opcode.DEQUANTIZE_DYNAMIC: Layout("va1_dequant_dynamic", (
        ("dtype", "B"), ("activation", "B"), ("reserved", "H"), ("channels", "I"),
        ("inner", "I"), ("reserved2", "I"), ("count", "Q"), ("x", "Q"), ("y", "Q"),
        ("qparams", "Q"), ("wscale", "Q"), ("wsum", "Q"), ("bias", "Q"))),
    Opcode.SIGNAL: Layout("va1_signal", (("addr", "Q"), ("value", "Q"))),
    Opcode.TIMESTAMP: Layout("va1_timestamp", (("addr", "Q"),)),
    Opcode.WAIT: Layout("va1_wait", (("addr", "Q"), ("value", "Q"))),
    Opcode.CALL: Layout("va1_call", (("addr", "Q"), ("size", "I"), ("reserved", "I"))),
}


def command_length(opcode: Opcode) -> int:
    return HEADER.size + PAYLOAD[opcode].size
