"""CommandBufferBuilder: encodings field by field, argument checks, the offset map."""
from __future__ import annotations

import struct
from typing import Any, Callable

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hwspec import isa
from hwspec.isa import Activation, DType, EltOp, Opcode
from userspace_runtime.commands import CommandBufferBuilder, decode, disassemble

RawDecode = Callable[[bytes], list[dict[str, Any]]]


def only(b: CommandBufferBuilder, raw_decode: RawDecode) -> dict[str, Any]:
    cmds = raw_decode(bytes(b))
    assert len(cmds) == 1
    return cmds[0]


def test_header_layout_and_alignment(raw_decode: RawDecode) -> None:
    b = CommandBufferBuilder()
    b.dma_h2d(0x1000, 0x20, 64)
    data = b.bytes()
    assert len(data) == isa.command_length(Opcode.DMA_H2D)
    assert len(data) % isa.ALIGN == 0
    opcode, flags, length = struct.unpack_from(isa.HEADER.format, data, 0)
    assert (opcode, flags, length) == (Opcode.DMA_H2D, 0, len(data))


@pytest.mark.parametrize("method,opcode", [
    ("dma_h2d", Opcode.DMA_H2D), ("dma_d2h", Opcode.DMA_D2H), ("dma_d2d", Opcode.DMA_D2D)])
def test_dma_fields(method: str, opcode: Opcode, raw_decode: RawDecode) -> None:
    b = CommandBufferBuilder()
    getattr(b, method)(0xDEAD_BEEF_0000, 0x1234_5678, 4097)
    c = only(b, raw_decode)
    assert c["opcode"] == opcode and c["flags"] == 0
    assert c["length"] == isa.HEADER.size + isa.PAYLOAD[opcode].size
    assert (c["src"], c["dst"], c["size"]) == (0xDEAD_BEEF_0000, 0x1234_5678, 4097)


def test_fill_fields(raw_decode: RawDecode) -> None:
    b = CommandBufferBuilder()
    b.fill(0x100, 256, 0xA5A5_0F0F)
    c = only(b, raw_decode)
    assert c["opcode"] == Opcode.FILL
    assert (c["dst"], c["size"], c["pattern"], c["reserved"]) == (0x100, 256, 0xA5A5_0F0F, 0)


@pytest.mark.parametrize("trans_a,trans_b,with_bias", [
    (False, False, False), (True, False, True), (False, True, True), (True, True, False)])
def test_gemm_fields_and_flags(trans_a: bool, trans_b: bool, with_bias: bool,
                               raw_decode: RawDecode) -> None:
    b = CommandBufferBuilder()
    b.gemm(dtype=DType.F16, m=3, n=5, k=7, a=0x1000, b=0x2000, c=0x3000,
           bias=0x4000 if with_bias else None, alpha=0.5, beta=-2.25,
           trans_a=trans_a, trans_b=trans_b, activation="relu")
    c = only(b, raw_decode)
    expect_flags = ((isa.GEMM_TRANS_A if trans_a else 0) | (isa.GEMM_TRANS_B if trans_b else 0)
                    | (isa.GEMM_BIAS if with_bias else 0))
    assert c["opcode"] == Opcode.GEMM and c["flags"] == expect_flags
    assert c["length"] == isa.command_length(Opcode.GEMM)
    assert (c["dtype"], c["activation"], c["reserved"]) == (DType.F16, Activation.RELU, 0)
    assert (c["m"], c["n"], c["k"]) == (3, 5, 7)
    assert (c["a"], c["b"], c["c"]) == (0x1000, 0x2000, 0x3000)
    assert c["bias"] == (0x4000 if with_bias else 0)
    assert (c["alpha"], c["beta"]) == (0.5, -2.25)


def test_gemm_alpha_is_rounded_to_f32(raw_decode: RawDecode) -> None:
    b = CommandBufferBuilder()
    b.gemm(dtype="f32", m=1, n=1, k=1, a=0, b=0, c=0, alpha=0.1)
    c = only(b, raw_decode)
    assert c["alpha"] == float(np.float32(0.1))
    assert c["activation"] == Activation.NONE


@pytest.mark.parametrize("op", list(EltOp))
def test_elementwise_fields(op: EltOp, raw_decode: RawDecode) -> None:
    b = CommandBufferBuilder()
    b.elementwise(op, dtype=DType.F32, count=1000, a=0x10, b=0x2000, out=0x4000)
    c = only(b, raw_decode)
    assert c["opcode"] == Opcode.ELEMENTWISE and c["flags"] == 0
    assert (c["op"], c["dtype"], c["reserved"], c["cols"]) == (op, DType.F32, 0, 0)
    assert (c["count"], c["a"], c["out"]) == (1000, 0x10, 0x4000)
    # unary ops ignore b: the builder encodes 0 rather than a stale address
    assert c["b"] == (0 if op in isa.UNARY_ELT_OPS else 0x2000)


def test_signal_timestamp_nop(raw_decode: RawDecode) -> None:
    b = CommandBufferBuilder()
    b.signal(0x8000, 2**64 - 1)
    b.timestamp(0x8008)
    b.nop(24)
    s, t, n = raw_decode(bytes(b))
    assert (s["opcode"], s["addr"], s["value"], s["length"]) == (
        Opcode.SIGNAL, 0x8000, 2**64 - 1, isa.command_length(Opcode.SIGNAL))
    assert (t["opcode"], t["addr"], t["length"]) == (
        Opcode.TIMESTAMP, 0x8008, isa.command_length(Opcode.TIMESTAMP))
    assert (n["opcode"], n["length"], n["offset"]) == (Opcode.NOP, 24, s["length"] + t["length"])
    assert bytes(b)[n["offset"] + isa.HEADER.size:] == bytes(16)


def test_offsets_map_back_to_commands() -> None:
    b = CommandBufferBuilder()
    offs = [b.nop(), b.fill(0, 4, 1, name="first fill"),
            b.gemm(dtype="f32", m=1, n=1, k=1, a=0, b=0, c=0, name="my gemm"),
            b.timestamp(0x1000)]
    assert offs == [0, 8, 8 + 32, 8 + 32 + 64]
    assert [r.offset for r in b.commands] == offs
    names = {o: getattr(b.command_at(o), "name", None) for o in (offs[1], offs[2], offs[2] + 63)}
    assert names == {offs[1]: "first fill", offs[2]: "my gemm", offs[2] + 63: "my gemm"}
    assert getattr(b.command_at(offs[3]), "opcode", None) == Opcode.TIMESTAMP
    assert b.command_at(len(b)) is None
    assert b.command_at(-1) is None
    assert [r.index for r in b.commands] == [0, 1, 2, 3]


def test_default_names_describe_the_command() -> None:
    b = CommandBufferBuilder()
    b.gemm(dtype="f32", m=2, n=3, k=4, a=0, b=0, c=0, bias=8, activation="relu", trans_b=True)
    assert b.commands[0].name == "GEMM f32 m=2 n=3 k=4 trans_b +bias relu"


@pytest.mark.parametrize("call,exc,match", [
    (lambda b: b.dma_h2d(-1, 0, 4), ValueError, "DMA_H2D src"),
    (lambda b: b.dma_d2h(0, 2**64, 4), ValueError, "DMA_D2H dst"),
    (lambda b: b.dma_d2d(0, 0, 0), ValueError, "DMA_D2D size"),
    (lambda b: b.dma_h2d(2**64 - 4, 0, 8), ValueError, "overflows 64 bits"),
    (lambda b: b.dma_h2d(1.0, 0, 8), TypeError, "must be an integer"),
    (lambda b: b.dma_h2d(True, 0, 8), TypeError, "must be an integer"),
    (lambda b: b.fill(0, 6, 0), ValueError, "multiple of 4"),
    (lambda b: b.fill(0, 8, 2**32), ValueError, "FILL pattern"),
    (lambda b: b.gemm(dtype="i32", m=1, n=1, k=1, a=0, b=0, c=0), ValueError, "GEMM dtype I32"),
    (lambda b: b.gemm(dtype="f64", m=1, n=1, k=1, a=0, b=0, c=0), ValueError, "not a VA-1 dtype"),
    (lambda b: b.gemm(dtype="f32", m=0, n=1, k=1, a=0, b=0, c=0), ValueError, "GEMM m"),
    (lambda b: b.gemm(dtype="f32", m=1, n=2**32, k=1, a=0, b=0, c=0), ValueError, "GEMM n"),
    (lambda b: b.gemm(dtype="f32", m=1, n=1, k=1, a=0, b=0, c=0, activation="swish"),
     ValueError, "activation"),
    (lambda b: b.gemm(dtype="f32", m=1, n=1, k=1, a=0, b=0, c=0, alpha=float("nan")),
     ValueError, "GEMM alpha"),
    (lambda b: b.gemm(dtype="f32", m=1, n=1, k=1, a=0, b=0, c=0, beta=1e39),
     ValueError, "GEMM beta"),
    (lambda b: b.gemm(dtype="f32", m=1, n=1, k=1, a=0, b=0, c=0, alpha="x"),
     TypeError, "GEMM alpha"),
    (lambda b: b.elementwise("add", dtype="f32", count=4, a=0, out=0), ValueError, "b is required"),
    (lambda b: b.elementwise("atan2", dtype="f32", count=4, a=0, b=0, out=0), ValueError,
     "elementwise op"),
    (lambda b: b.elementwise("relu", dtype="f32", count=0, a=0, out=0), ValueError,
     "ELEMENTWISE count"),
    (lambda b: b.elementwise("relu", dtype="i32", count=4, a=0, out=0), ValueError,
     "ELEMENTWISE dtype I32"),
    (lambda b: b.nop(12), ValueError, "multiple of 8"),
    (lambda b: b.nop(4), ValueError, "NOP length"),
    (lambda b: b.signal(0, -1), ValueError, "SIGNAL value"),
    (lambda b: b.timestamp(2**64 - 4), ValueError, "overflows"),
])
def test_argument_errors(call: Callable[[CommandBufferBuilder], Any], exc: type[Exception],
                         match: str) -> None:
    b = CommandBufferBuilder()
    with pytest.raises(exc, match=match):
        call(b)
    assert len(b) == 0 and b.commands == ()  # a rejected command leaves no trace


def test_max_size_is_enforced() -> None:
    b = CommandBufferBuilder(max_size=64)
    b.dma_h2d(0, 0, 4)
    b.dma_h2d(0, 0, 4)
    with pytest.raises(ValueError, match="above its maximum of 64"):
        b.nop()
    assert len(b) == 64


def test_numpy_integers_accepted(raw_decode: RawDecode) -> None:
    b = CommandBufferBuilder()
    b.dma_d2d(np.uint64(16), np.int32(32), np.int64(8))
    c = only(b, raw_decode)
    assert (c["src"], c["dst"], c["size"]) == (16, 32, 8)


def test_decode_matches_builder_and_struct(raw_decode: RawDecode) -> None:
    b = CommandBufferBuilder()
    b.fill(0, 8, 7)
    b.gemm(dtype="f32", m=2, n=3, k=4, a=1, b=2, c=3, bias=4, activation="relu")
    b.elementwise("mul", dtype="f16", count=5, a=6, b=7, out=8)
    b.nop(16)
    ours = decode(b.bytes())
    theirs = raw_decode(b.bytes())
    assert [c.offset for c in ours] == [c["offset"] for c in theirs]
    for d, r in zip(ours, theirs, strict=True):
        assert (d.opcode, d.flags, d.length) == (r["opcode"], r["flags"], r["length"])
        for k, v in d.fields.items():
            assert r[k] == v
    assert ours[1].fields["m"] == 2 and ours[3].fields == {}


def test_decode_rejects_malformed() -> None:
    good = CommandBufferBuilder()
    good.dma_h2d(0, 0, 4)
    data = good.bytes()
    with pytest.raises(ValueError, match="truncated header"):
        decode(data + b"\0" * 4)
    with pytest.raises(ValueError, match="runs past the end"):
        decode(data[:-8])
    bad = struct.pack(isa.HEADER.format, Opcode.FILL, 0, 12) + bytes(4)
    with pytest.raises(ValueError, match="bad command length 12"):
        decode(bad)
    wrong = struct.pack(isa.HEADER.format, Opcode.FILL, 0, 16) + bytes(8)
    with pytest.raises(ValueError, match="FILL length 16, expected 32"):
        decode(wrong)


def test_raw_and_unknown_opcodes() -> None:
    b = CommandBufferBuilder()
    b.raw(0x7F, bytes(8), flags=3, name="hostile")
    b.raw(Opcode.FILL, bytes(24), length=48)   # lies about its length
    data = b.bytes()
    assert struct.unpack_from(isa.HEADER.format, data, 0) == (0x7F, 3, 16)
    assert struct.unpack_from(isa.HEADER.format, data, 16) == (Opcode.FILL, 0, 48)
    assert getattr(b.command_at(0), "name", None) == "hostile"
    first = decode(data[:16])[0]
    assert first.opcode_name == "OP_0x007f" and first.fields == {}


def test_disassembly_lists_every_command_with_names() -> None:
    b = CommandBufferBuilder()
    b.dma_h2d(0x1000, 0x40, 64, name="upload x")
    b.gemm(dtype="f32", m=2, n=3, k=4, a=0, b=64, c=128, activation="relu")
    text = b.disassemble()
    lines = text.splitlines()
    assert len(lines) == 2
    assert lines[0].startswith("0x0000 DMA_H2D") and "src=0x1000" in lines[0]
    assert lines[0].endswith("; upload x")
    assert "dtype=F32" in lines[1] and "activation=RELU" in lines[1] and "m=2" in lines[1]
    assert disassemble(b.bytes()) == "\n".join(line.split("  ; ")[0] for line in lines)


# -- property: any sequence of valid commands decodes back to its arguments ---------------

u64 = st.integers(0, 2**40)
dims = st.integers(1, 2**16)
_CMDS = st.one_of(
    st.tuples(st.just("fill"), u64, st.integers(1, 2**20).map(lambda n: 4 * n),
              st.integers(0, 2**32 - 1)),
    st.tuples(st.sampled_from(["dma_h2d", "dma_d2h", "dma_d2d"]), u64, u64,
              st.integers(1, 2**30)),
    st.tuples(st.just("gemm"), dims, dims, dims, st.booleans(), st.booleans(),
              st.booleans(), st.sampled_from([None, "relu"]),
              st.floats(-4, 4, width=32), st.floats(-4, 4, width=32)),
    st.tuples(st.just("signal"), u64, st.integers(0, 2**64 - 1)),
    st.tuples(st.just("timestamp"), u64),
    st.tuples(st.just("nop"), st.integers(1, 8).map(lambda n: 8 * n)),
)


@settings(derandomize=True, max_examples=150, deadline=None)
@given(st.lists(_CMDS, min_size=1, max_size=12))
def test_property_encode_decode(cmds: list[tuple[Any, ...]]) -> None:
    b = CommandBufferBuilder()
    for c in cmds:
        if c[0] == "gemm":
            _, m, n, k, ta, tb, bias, act, alpha, beta = c
            b.gemm(dtype="f32", m=m, n=n, k=k, a=0x1000, b=0x2000, c=0x3000,
                   bias=0x4000 if bias else None, trans_a=ta, trans_b=tb, activation=act,
                   alpha=alpha, beta=beta)
        else:
            getattr(b, c[0])(*c[1:])
    raw = raw_decode_local(b.bytes())
    assert len(raw) == len(cmds) == len(b.commands)
    assert [r["offset"] for r in raw] == [rec.offset for rec in b.commands]
    for c, r in zip(cmds, raw, strict=True):
        if c[0] == "gemm":
            _, m, n, k, ta, tb, bias, act, alpha, beta = c
            assert (r["m"], r["n"], r["k"], r["alpha"], r["beta"]) == (m, n, k, alpha, beta)
            assert bool(r["flags"] & isa.GEMM_BIAS) == bias
            assert bool(r["flags"] & isa.GEMM_TRANS_A) == ta
            assert bool(r["flags"] & isa.GEMM_TRANS_B) == tb
        elif c[0] == "nop":
            assert (r["opcode"], r["length"]) == (Opcode.NOP, c[1])
        else:
            layout = isa.PAYLOAD[r["opcode"]]
            given_fields = [n for n in layout.names if not n.startswith("reserved")]
            assert Opcode[c[0].upper()] == r["opcode"]
            assert tuple(r[n] for n in given_fields) == tuple(c[1:])


def raw_decode_local(data: bytes) -> list[dict[str, Any]]:
    """Header + payload by hwspec layout, with one struct call per field."""
    out, pos = [], 0
    while pos < len(data):
        cmd: dict[str, Any] = {"offset": pos}
        for name, code in isa.HEADER.fields:
            cmd[name] = struct.unpack_from("<" + code, data, pos + isa.HEADER.offsets[name])[0]
        layout = isa.PAYLOAD[cmd["opcode"]]
        for name, code in layout.fields:
            cmd[name] = struct.unpack_from("<" + code, data,
                                           pos + isa.HEADER.size + layout.offsets[name])[0]
        out.append(cmd)
        pos += cmd["length"]
    return out


def test_pool2d_and_gather_encode_their_layouts_and_check_arguments() -> None:
    from hwspec.isa import Opcode, PoolOp

    from userspace_runtime.commands import CommandBufferBuilder, decode, pool2d_output_hw
    b = CommandBufferBuilder()
    b.pool2d("max", dtype="f32", n=1, c=8, h=13, w=13, r=3, s=3, stride=2, ceil=True,
             x=0, y=4096)
    b.gather(dtype="f32", rows=100, cols=64, count=16, table=0, indices=1 << 16,
             out=1 << 17)
    pool, gather = decode(b.bytes())
    assert pool.opcode == Opcode.POOL2D and pool.flags == 2
    assert pool.fields["op"] == PoolOp.MAX and pool.fields["r"] == 3
    assert gather.opcode == Opcode.GATHER and gather.fields["count"] == 16
    assert pool2d_output_hw(13, 13, 3, 3, (2, 2), ceil=True) == (6, 6)
    assert pool2d_output_hw(14, 14, 3, 3, (2, 2), ceil=True) == (7, 7)
    assert pool2d_output_hw(14, 14, 3, 3, (2, 2)) == (6, 6)
    with pytest.raises(ValueError, match="count_include_pad is for AVG only"):
        b.pool2d("max", dtype="f32", n=1, c=1, h=4, w=4, r=2, s=2, x=0, y=0,
                 count_include_pad=True)
    with pytest.raises(ValueError, match="POOL2D padding"):
        b.pool2d("avg", dtype="f32", n=1, c=1, h=4, w=4, r=2, s=2, x=0, y=0, padding=2)
    with pytest.raises(ValueError, match="GATHER count"):
        b.gather(dtype="f32", rows=1, cols=1, count=0, table=0, indices=0, out=0)


def test_gemm_batched_defaults_to_dense_batches_and_checks_arguments() -> None:
    from hwspec import isa
    from hwspec.isa import Opcode

    from userspace_runtime.commands import CommandBufferBuilder, decode
    b = CommandBufferBuilder()
    b.gemm_batched(dtype="f32", batch=8, m=6, n=10, k=16, a=0, b=4096, c=8192,
                   trans_b=True, alpha=0.25)
    b.gemm_batched(dtype="f32", batch=4, m=6, n=16, k=10, a=0, b=4096, c=8192, lda=10,
                   ldb=128, stride_b=16, bias=0x100, activation="relu")
    dense, strided = decode(b.bytes())
    assert dense.opcode == Opcode.GEMM_BATCHED and dense.length == 120
    assert dense.flags == isa.GEMM_TRANS_B
    f = dense.fields
    assert (f["lda"], f["ldb"], f["ldc"]) == (16, 16, 10)            # B stored n x k
    assert (f["stride_a"], f["stride_b"], f["stride_c"]) == (96, 160, 60)
    assert f["alpha"] == 0.25
    g = strided.fields
    assert strided.flags == isa.GEMM_BIAS and (g["ldb"], g["stride_b"]) == (128, 16)
    assert "GEMM_BATCHED f32 8x m=6 n=10 k=16 trans_b" in b.disassemble()
    with pytest.raises(ValueError, match="GEMM_BATCHED batch"):
        b.gemm_batched(dtype="f32", batch=65536, m=1, n=1, k=1, a=0, b=0, c=0)
    with pytest.raises(ValueError, match="I8 GEMM_BATCHED"):
        b.gemm_batched(dtype="i8", batch=1, m=1, n=1, k=1, a=0, b=0, c=0, alpha=2.0)
    with pytest.raises(ValueError, match="dtype I32"):
        b.gemm_batched(dtype="i32", batch=1, m=1, n=1, k=1, a=0, b=0, c=0)
    with pytest.raises(ValueError, match="GEMM_BATCHED c range"):
        b.gemm_batched(dtype="f32", batch=2, m=1, n=1, k=1, a=0, b=0, c=2**64 - 4)


def test_compare_and_select_encode_their_layouts_and_check_arguments() -> None:
    from hwspec import isa
    from hwspec.isa import CmpOp, Opcode

    from userspace_runtime.commands import CommandBufferBuilder, decode
    b = CommandBufferBuilder()
    b.compare("less", dtype="f32", count=12, a=0, b=64, out=128, broadcast_cols=4)
    b.compare("not", dtype="i8", count=12, a=0, out=128)
    b.select(dtype="f16", count=12, cond=128, a=0, b=64, out=256)
    less, neg, sel = decode(b.bytes())
    assert less.opcode == Opcode.COMPARE and less.flags == isa.CMP_BROADCAST_B
    assert less.fields["op"] == CmpOp.LESS and less.fields["cols"] == 4
    assert neg.fields["b"] == 0 and sel.opcode == Opcode.SELECT and sel.length == 56
    assert sel.fields["cond"] == 128
    text = b.disassemble()
    assert "COMPARE less f32 count=12 bcast=4" in text and "SELECT f16 count=12" in text
    with pytest.raises(ValueError, match="b is required"):
        b.compare("equal", dtype="f32", count=4, a=0, out=0)
    with pytest.raises(ValueError, match="unary"):
        b.compare("not", dtype="f32", count=4, a=0, out=0, broadcast_cols=2)
    with pytest.raises(ValueError, match="compare op"):
        b.compare("like", dtype="f32", count=4, a=0, b=0, out=0)
    with pytest.raises(ValueError, match="SELECT count"):
        b.select(dtype="f32", count=0, cond=0, a=0, b=0, out=0)
