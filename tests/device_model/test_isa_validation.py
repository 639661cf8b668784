"""Validation rules of the ISA additions (spec §7): each bad command fails its submission
with its status and the byte offset of the command, and nothing in the buffer ran.
Also the VA1_F_INT8 gate and CALL errors (unmapped callee, inner errors, sizes)."""
from __future__ import annotations

import struct
from typing import Any

import pytest
from dm_driver import Rig, fill, gemm, hdr, nop, signal

from device_model import Va1Config
from hwspec import isa
from hwspec.isa import Opcode
from hwspec.va1 import Status

MEM = 1 << 20
CFG = Va1Config(device_memory_size=MEM, max_call_depth=4)
OUTSIDE = 0x10  # an IOVA below the fake guest RAM
BIG = 1 << 64
F32_INF = float("inf")


def enc(opcode: Opcode, flags: int = 0, length: int | None = None, **fields: Any) -> bytes:
    layout = isa.PAYLOAD[opcode]
    n = isa.command_length(opcode)
    return hdr(opcode, n if length is None else length, flags) + struct.pack(
        layout.format, *(fields.get(f, 0) for f in layout.names))


def conv(flags: int = 0, **kw: Any) -> bytes:
    f = dict(dtype=0, groups=1, n=1, c=2, h=4, w=4, k=2, r=3, s=3, stride_h=1, stride_w=1,
             dilation_h=1, dilation_w=1, x=0, weight=4096, bias=8192, y=12288)
    f.update(kw)
    return enc(Opcode.CONV2D, flags, **f)


def pool(flags: int = 0, **kw: Any) -> bytes:
    f = dict(dtype=0, op=0, n=1, c=2, h=4, w=4, r=2, s=2, stride_h=2, stride_w=2,
             dilation_h=1, dilation_w=1, x=0, y=4096)
    f.update(kw)
    return enc(Opcode.POOL2D, flags, **f)


def gather(**kw: Any) -> bytes:
    f = dict(dtype=0, rows=4, cols=8, count=3, table=0, indices=4096, out=8192)
    f.update(kw)
    return enc(Opcode.GATHER, **f)


def copy(**kw: Any) -> bytes:
    f = dict(dtype=0, ndim=2, src=0, dst=4096, shape0=4, shape1=4, src_stride0=4,
             src_stride1=1, dst_stride0=1, dst_stride1=4)
    f.update(kw)
    return enc(Opcode.COPY, **f)


def rowwise(opcode: Opcode, **kw: Any) -> bytes:
    f: dict[str, Any] = dict(dtype=0, rows=4, cols=8, x=0, y=4096)
    if opcode == Opcode.LAYERNORM:
        f.update(gamma=8192, beta=12288, epsilon=1e-5)
    f.update(kw)
    return enc(opcode, **f)


def quant(op: Opcode, **kw: Any) -> bytes:
    f = dict(dtype=0, int_dtype=2, scale=0.5, zero_point=0, count=16, x=0, y=4096)
    f.update(kw)
    return enc(op, **f)


def qdyn(**kw: Any) -> bytes:
    f = dict(dtype=0, int_dtype=2, count=16, x=0, y=4096, qparams=8192)
    f.update(kw)
    return enc(Opcode.QUANTIZE_DYNAMIC, **f)


def dqdyn(flags: int = isa.DQD_BIAS, **kw: Any) -> bytes:
    """[2, 4, 2] I32 sums, 4 channels."""
    f = dict(dtype=0, channels=4, inner=2, count=16, x=0, y=4096, qparams=8192,
             wscale=8200, wsum=8216, bias=8232)
    f.update(kw)
    return enc(Opcode.DEQUANTIZE_DYNAMIC, flags, **f)


def elt(flags: int = 0, **kw: Any) -> bytes:
    f = dict(op=0, dtype=0, count=16, a=0, b=4096, out=8192)
    f.update(kw)
    return enc(Opcode.ELEMENTWISE, flags, **f)


Q, DQ, SM, LN, RD = (Opcode.QUANTIZE, Opcode.DEQUANTIZE, Opcode.SOFTMAX, Opcode.LAYERNORM,
                     Opcode.REDUCE)


def cases(rig: Rig) -> list[tuple[str, bytes, Status]]:
    m = MEM
    host = rig.put(fill(0, 4, 1))
    bad_inner = rig.put(nop() + fill(m - 2, 4, 0))
    return [
        # opcodes and lengths
        ("unassigned 0x05", hdr(0x05, 8), Status.BAD_OPCODE),
        ("unassigned 0x12", hdr(0x12, 8), Status.BAD_OPCODE),
        ("unassigned 0x1F", hdr(0x1F, 8), Status.BAD_OPCODE),
        ("conv short", hdr(Opcode.CONV2D, 88) + conv()[8:-8], Status.BAD_LENGTH),
        ("call long", enc(Opcode.CALL, length=32, addr=host, size=32) + bytes(8),
         Status.BAD_LENGTH),
        # BAD_ARG: flags, reserved fields, enums, scalars
        ("conv flag", conv(flags=2), Status.BAD_ARG),
        ("conv reserved", conv(reserved=1), Status.BAD_ARG),
        ("conv reserved2", conv(reserved2=1), Status.BAD_ARG),
        ("conv act", conv(activation=5), Status.BAD_ARG),
        ("pool flag", pool(flags=4), Status.BAD_ARG),
        ("pool op", pool(op=2), Status.BAD_ARG),
        ("pool include pad with max", pool(flags=isa.POOL_COUNT_INCLUDE_PAD), Status.BAD_ARG),
        ("pool reserved", pool(reserved3=1), Status.BAD_ARG),
        ("gather reserved", gather(reserved2=1), Status.BAD_ARG),
        ("elt flag", elt(flags=2), Status.BAD_ARG),
        ("elt cols without flag", elt(cols=4), Status.BAD_ARG),
        ("elt bcast unary", elt(isa.ELT_BROADCAST_B, op=5, cols=4), Status.BAD_ARG),
        ("elt op", elt(op=19), Status.BAD_ARG),
        ("elt bcast unary erf", elt(isa.ELT_BROADCAST_B, op=10, cols=4), Status.BAD_ARG),
        ("copy flags", hdr(Opcode.COPY, 112, 1) + copy()[8:], Status.BAD_ARG),
        ("copy ndim 0", copy(ndim=0), Status.BAD_ARG),
        ("copy ndim 5", copy(ndim=5), Status.BAD_ARG),
        ("copy dim beyond ndim", copy(shape2=1), Status.BAD_ARG),
        ("copy stride beyond ndim", copy(dst_stride3=1), Status.BAD_ARG),
        ("copy reserved2", copy(reserved2=1), Status.BAD_ARG),
        ("softmax reserved3", rowwise(SM, reserved3=1), Status.BAD_ARG),
        ("softmax flags", hdr(SM, 40, 1) + rowwise(SM)[8:], Status.BAD_ARG),
        ("layernorm eps nan", rowwise(LN, epsilon=float("nan")), Status.BAD_ARG),
        ("layernorm eps inf", rowwise(LN, epsilon=F32_INF), Status.BAD_ARG),
        ("layernorm eps < 0", rowwise(LN, epsilon=-1e-5), Status.BAD_ARG),
        ("reduce op", rowwise(RD, op=4), Status.BAD_ARG),
        ("reduce reserved2", rowwise(RD, reserved2=1), Status.BAD_ARG),
        ("quant scale 0", quant(Q, scale=0.0), Status.BAD_ARG),
        ("quant scale < 0", quant(Q, scale=-1.0), Status.BAD_ARG),
        ("quant scale nan", quant(DQ, scale=float("nan")), Status.BAD_ARG),
        ("quant zp > 127", quant(Q, zero_point=128), Status.BAD_ARG),
        ("dequant zp < -128", quant(DQ, zero_point=-129), Status.BAD_ARG),
        ("quant reserved2", quant(Q, reserved2=1), Status.BAD_ARG),
        ("quant dynamic flags", hdr(Opcode.QUANTIZE_DYNAMIC, 48, 1) + qdyn()[8:],
         Status.BAD_ARG),
        ("quant dynamic reserved2", qdyn(reserved2=1), Status.BAD_ARG),
        ("dequant dynamic flag", dqdyn(flags=2), Status.BAD_ARG),
        ("dequant dynamic reserved", dqdyn(reserved=1), Status.BAD_ARG),
        ("dequant dynamic gelu", dqdyn(activation=2), Status.BAD_ARG),
        ("dequant dynamic act 5", dqdyn(activation=5), Status.BAD_ARG),
        ("gemm i8 alpha", gemm(1, 1, 1, 0, 0, 0, dtype=2, alpha=2.0), Status.BAD_ARG),
        ("gemm i8 beta", gemm(1, 1, 1, 0, 0, 0, dtype=2, beta=0.5), Status.BAD_ARG),
        ("gemm i8 gelu", gemm(1, 1, 1, 0, 0, 0, dtype=2, act=2), Status.BAD_ARG),
        ("gemm act 5", gemm(1, 1, 1, 0, 0, 0, act=5), Status.BAD_ARG),
        ("gemm i8 silu", gemm(1, 1, 1, 0, 0, 0, dtype=2, act=4), Status.BAD_ARG),
        ("call flags", hdr(Opcode.CALL, 24, 1) + struct.pack("<QII", host, 32, 0),
         Status.BAD_ARG),
        ("call reserved", enc(Opcode.CALL, addr=host, size=32, reserved=1), Status.BAD_ARG),
        # BAD_DTYPE
        ("conv i8", conv(dtype=2), Status.BAD_DTYPE),
        ("conv unknown", conv(dtype=7), Status.BAD_DTYPE),
        ("pool i8", pool(dtype=2), Status.BAD_DTYPE),
        ("gather unknown", gather(dtype=9), Status.BAD_DTYPE),
        ("softmax i32", rowwise(SM, dtype=3), Status.BAD_DTYPE),
        ("layernorm i8", rowwise(LN, dtype=2), Status.BAD_DTYPE),
        ("reduce i32", rowwise(RD, dtype=3), Status.BAD_DTYPE),
        ("quant from i8", quant(Q, dtype=2), Status.BAD_DTYPE),
        ("quant to i32", quant(Q, int_dtype=3), Status.BAD_DTYPE),
        ("dequant to f32", quant(DQ, int_dtype=0), Status.BAD_DTYPE),
        ("quant dynamic from i32", qdyn(dtype=3), Status.BAD_DTYPE),
        ("quant dynamic to i32", qdyn(int_dtype=3), Status.BAD_DTYPE),
        ("dequant dynamic to i8", dqdyn(dtype=2), Status.BAD_DTYPE),
        ("copy unknown", copy(dtype=4), Status.BAD_DTYPE),
        ("elt i8", elt(dtype=2), Status.BAD_DTYPE),
        ("gemm i32", gemm(1, 1, 1, 0, 0, 0, dtype=3), Status.BAD_DTYPE),
        # BAD_SHAPE
        ("conv n 0", conv(n=0), Status.BAD_SHAPE),
        ("conv groups 0", conv(groups=0), Status.BAD_SHAPE),
        ("conv stride 0", conv(stride_w=0), Status.BAD_SHAPE),
        ("conv dilation 0", conv(dilation_h=0), Status.BAD_SHAPE),
        ("conv c % groups", conv(groups=2, c=3, k=2), Status.BAD_SHAPE),
        ("conv k % groups", conv(groups=2, c=2, k=3), Status.BAD_SHAPE),
        ("conv kernel > input", conv(h=2), Status.BAD_SHAPE),
        ("conv pad >= kernel", conv(pad_bottom=3), Status.BAD_SHAPE),
        ("conv dilated kernel > input", conv(dilation_w=2), Status.BAD_SHAPE),
        ("conv huge", conv(n=2**32 - 1, c=2**32 - 1, h=2**32 - 1, w=2**32 - 1),
         Status.BAD_SHAPE),
        ("pool c 0", pool(c=0), Status.BAD_SHAPE),
        ("pool stride 0", pool(stride_h=0), Status.BAD_SHAPE),
        ("pool pad >= kernel", pool(pad_left=2), Status.BAD_SHAPE),
        ("pool kernel > input", pool(r=5, s=5, pad_top=1), Status.BAD_SHAPE),
        ("gather count 0", gather(count=0), Status.BAD_SHAPE),
        ("gather rows*cols overflows", gather(rows=2**32 - 1, cols=2**32 - 1),
         Status.BAD_SHAPE),
        ("elt bcast cols 0", elt(isa.ELT_BROADCAST_B, cols=0), Status.BAD_SHAPE),
        ("elt bcast count % cols", elt(isa.ELT_BROADCAST_B, cols=5), Status.BAD_SHAPE),
        ("copy zero dim", copy(shape1=0), Status.BAD_SHAPE),
        ("copy dst overlap", copy(dst_stride0=1, dst_stride1=1), Status.BAD_SHAPE),
        ("copy dst stride 0", copy(dst_stride0=0), Status.BAD_SHAPE),
        ("copy extent overflows", copy(src_stride0=2**63), Status.BAD_SHAPE),
        ("softmax rows 0", rowwise(SM, rows=0), Status.BAD_SHAPE),
        ("layernorm cols 0", rowwise(LN, cols=0), Status.BAD_SHAPE),
        ("reduce rows*cols*4 overflows", rowwise(RD, rows=2**32 - 1, cols=2**32 - 1),
         Status.BAD_SHAPE),
        ("quant count 0", quant(Q, count=0), Status.BAD_SHAPE),
        ("quant count overflow", quant(DQ, int_dtype=3, count=2**62), Status.BAD_SHAPE),
        ("quant dynamic count 0", qdyn(count=0), Status.BAD_SHAPE),
        ("dequant dynamic channels 0", dqdyn(channels=0), Status.BAD_SHAPE),
        ("dequant dynamic inner 0", dqdyn(inner=0), Status.BAD_SHAPE),
        ("dequant dynamic count % (channels * inner)", dqdyn(count=12), Status.BAD_SHAPE),
        ("call size 0", enc(Opcode.CALL, addr=host, size=0), Status.BAD_SHAPE),
        ("call size % 8", enc(Opcode.CALL, addr=host, size=12), Status.BAD_SHAPE),
        # CALL limits
        ("call too large", enc(Opcode.CALL, addr=host, size=CFG.max_cmdbuf_size + 8),
         Status.CMDBUF_TOO_LARGE),
        # OUT_OF_BOUNDS: every device range
        ("conv x", conv(x=m - 100), Status.OUT_OF_BOUNDS),
        ("conv weight", conv(weight=m - 4 * 2 * 2 * 9 + 4), Status.OUT_OF_BOUNDS),
        ("conv bias", conv(flags=isa.CONV_BIAS, bias=m - 4), Status.OUT_OF_BOUNDS),
        ("conv bias ignored without flag", conv(bias=BIG - 1) + conv(y=m - 4 * 2 * 2 * 2 + 4),
         Status.OUT_OF_BOUNDS),
        ("elt bcast b", elt(isa.ELT_BROADCAST_B, cols=4, b=m - 12), Status.OUT_OF_BOUNDS),
        ("pool x", pool(x=m - 60), Status.OUT_OF_BOUNDS),
        ("pool y", pool(y=m - 28), Status.OUT_OF_BOUNDS),
        ("pool y (ceil)", pool(flags=isa.POOL_CEIL, h=5, w=5, x=0, y=m - 68),
         Status.OUT_OF_BOUNDS),
        ("gather table", gather(table=m - 124), Status.OUT_OF_BOUNDS),
        ("gather indices", gather(indices=m - 8), Status.OUT_OF_BOUNDS),
        ("gather out", gather(out=m - 92), Status.OUT_OF_BOUNDS),
        ("copy src extent", copy(src=m - 60), Status.OUT_OF_BOUNDS),
        ("copy dst extent", copy(dst=m - 60), Status.OUT_OF_BOUNDS),
        ("copy src strided", copy(src_stride0=m // 8), Status.OUT_OF_BOUNDS),
        ("copy address past end", copy(src=BIG - 4), Status.OUT_OF_BOUNDS),
        ("softmax y", rowwise(SM, y=m - 4 * 32 + 4), Status.OUT_OF_BOUNDS),
        ("layernorm gamma", rowwise(LN, gamma=m - 28), Status.OUT_OF_BOUNDS),
        ("layernorm beta", rowwise(LN, beta=m - 4), Status.OUT_OF_BOUNDS),
        ("reduce y", rowwise(RD, y=m - 12), Status.OUT_OF_BOUNDS),
        ("quant y (i8)", quant(Q, y=m - 15), Status.OUT_OF_BOUNDS),
        ("dequant x (i32)", quant(DQ, int_dtype=3, x=m - 60), Status.OUT_OF_BOUNDS),
        ("dequant y (f16)", quant(DQ, dtype=1, y=m - 30), Status.OUT_OF_BOUNDS),
        ("quant dynamic x", qdyn(x=m - 60), Status.OUT_OF_BOUNDS),
        ("quant dynamic y", qdyn(y=m - 15), Status.OUT_OF_BOUNDS),
        ("quant dynamic qparams", qdyn(qparams=m - 4), Status.OUT_OF_BOUNDS),
        ("quant dynamic qparams past end", qdyn(qparams=BIG - 4), Status.OUT_OF_BOUNDS),
        ("dequant dynamic x (i32)", dqdyn(x=m - 60), Status.OUT_OF_BOUNDS),
        ("dequant dynamic y", dqdyn(y=m - 60), Status.OUT_OF_BOUNDS),
        ("dequant dynamic qparams", dqdyn(qparams=m - 7), Status.OUT_OF_BOUNDS),
        ("dequant dynamic wscale", dqdyn(wscale=m - 12), Status.OUT_OF_BOUNDS),
        ("dequant dynamic wsum", dqdyn(wsum=m - 12), Status.OUT_OF_BOUNDS),
        ("dequant dynamic bias", dqdyn(bias=m - 12), Status.OUT_OF_BOUNDS),
        ("dequant dynamic bias ignored without flag", dqdyn(0, bias=BIG - 1)
         + dqdyn(0, wsum=m - 4), Status.OUT_OF_BOUNDS),
        ("gemm i8 c is i32", gemm(4, 4, 4, 0, 0, m - 60, dtype=2), Status.OUT_OF_BOUNDS),
        ("gemm i8 bias is i32", gemm(4, 4, 4, 0, 0, 0, bias=m - 12, dtype=2, flags=4),
         Status.OUT_OF_BOUNDS),
        # DMA_FAULT / callee errors
        ("call unmapped", enc(Opcode.CALL, addr=OUTSIDE, size=32), Status.DMA_FAULT),
        ("call past RAM", enc(Opcode.CALL, addr=rig.dma.base + rig.dma.size - 16, size=32),
         Status.DMA_FAULT),
        ("call overflows", enc(Opcode.CALL, addr=BIG - 8, size=32), Status.DMA_FAULT),
        ("callee bad command", enc(Opcode.CALL, addr=bad_inner, size=40),
         Status.OUT_OF_BOUNDS),
        ("callee truncated", enc(Opcode.CALL, addr=host, size=24), Status.TRUNCATED),
    ]


def test_each_rule_fails_with_status_offset_and_runs_nothing() -> None:
    rig = Rig(CFG)
    out = rig.alloc.alloc(8)
    for i, (what, bad, status) in enumerate(cases(rig)):
        rig.dev.memory.write(0, b"\x55" * 16)
        rig.dma.g_write(out, bytes(8))
        prefix = fill(0, 16, 0) + signal(out, 1) + nop(16)  # 72 bytes
        cid = rig.create_context()
        r = rig.submit(cid, prefix + bad + nop(), fence=100 + i)
        offset = 72 + {"conv bias ignored without flag": len(conv()),
                       "dequant dynamic bias ignored without flag": len(dqdyn())}.get(what, 0)
        assert (Status(r.status), r.error_offset) == (status, offset), what
        assert r.end_ns == r.start_ns, what
        assert rig.dev.memory.read(0, 16) == b"\x55" * 16, f"{what}: a command ran"
        assert rig.dma.g_read(out, 8) == bytes(8), f"{what}: a command ran"
        assert rig.destroy_context(cid) == 0


def test_callee_error_reports_the_call_offset_and_inner_offset_in_the_trace() -> None:
    rig = Rig(CFG)
    leaf = rig.put(nop(16) + fill(0, 4, 1) + gemm(1, 1, 1, 0, 0, 0, dtype=9))
    mid = rig.put(fill(0, 4, 2) + enc(Opcode.CALL, addr=leaf, size=112))
    cid = rig.create_context()
    r = rig.submit(cid, fill(0, 4, 3) + nop() + enc(Opcode.CALL, addr=mid, size=56))
    assert (Status(r.status), r.error_offset) == (Status.BAD_DTYPE, 40)
    ev = rig.tracer.kinds("cmd_invalid")[-1]
    assert ev["offset"] == 40 and "inner offset 32/48" in str(ev["message"])
    assert rig.dev.memory.read(0, 4) == bytes(4)  # nothing ran, the callees neither


@pytest.mark.parametrize("buf_fn", [
    lambda: gemm(1, 1, 1, 0, 0, 0, dtype=2),
    lambda: enc(Opcode.QUANTIZE, dtype=0, int_dtype=2, scale=1.0, count=1, x=0, y=0),
    lambda: enc(Opcode.QUANTIZE_DYNAMIC, dtype=0, int_dtype=2, count=1, x=0, y=0, qparams=8),
    lambda: enc(Opcode.DEQUANTIZE_DYNAMIC, dtype=0, channels=1, inner=1, count=1, x=0, y=0,
                qparams=8, wscale=16, wsum=20),                            # its I32 sums
    lambda: enc(Opcode.COPY, dtype=3, ndim=1, shape0=1, src=0, dst=0),
    lambda: enc(Opcode.COMPARE, op=0, dtype=0, count=1, a=0, b=0, out=0),   # its I8 mask
    lambda: enc(Opcode.SELECT, dtype=0, count=1, cond=0, a=0, b=0, out=0),  # its I8 cond
])
def test_int8_needs_the_feature_and_the_dtype_mask(buf_fn: Any) -> None:
    no_int8 = (1 << 32) | (1 << 28) | (1 << 29) | 1 | 4
    for rig in (Rig(CFG, features=no_int8), Rig(Va1Config(device_memory_size=MEM,
                                                          dtype_mask=0b11))):
        cid = rig.create_context()
        r = rig.submit(cid, nop() + buf_fn())
        assert (Status(r.status), r.error_offset) == (Status.BAD_DTYPE, 8)
    rig = Rig(CFG)
    cid = rig.create_context()
    assert rig.submit(cid, nop() + buf_fn()).status == Status.OK


def test_int8_is_offered_in_config_and_features() -> None:
    rig = Rig(CFG)
    assert rig.offered() >> 1 & 1
    assert rig.r(0x100 + 28) == 0b1111  # dtype_mask: F32, F16, I8, I32


def test_call_whose_callee_is_unmapped_midway() -> None:
    rig = Rig(CFG)
    callee = rig.put(fill(0, 4, 1) + fill(4, 4, 2), align=4096)
    rig.dma.holes.append((callee + 32, callee + 64))
    cid = rig.create_context()
    r = rig.submit(cid, fill(8, 4, 9) + enc(Opcode.CALL, addr=callee, size=64))
    assert (Status(r.status), r.error_offset) == (Status.DMA_FAULT, 32)
    assert rig.dev.memory.read(0, 12) == bytes(12)
