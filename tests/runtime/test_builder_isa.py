"""CommandBufferBuilder for the ISA additions: field-by-field encodings (checked with
struct from the hwspec layouts), argument errors, decode/disassemble, and the new
opcodes end to end on the real stack (VM, guest driver, VA-1 over virtio-mmio)."""
from __future__ import annotations

import math
from typing import Any, Callable

import numpy as np
import pytest

from guest_driver import uapi
from hwspec import isa
from hwspec.isa import Activation, DType, EltOp, Opcode, ReduceOp
from userspace_runtime import Device
from userspace_runtime.commands import (CommandBufferBuilder, contiguous_strides,
                                        conv2d_output_hw, decode, disassemble)

import rt_stack

RawDecode = Callable[[bytes], list[dict[str, Any]]]
SEED = 20261122


def only(b: CommandBufferBuilder, raw_decode: RawDecode) -> dict[str, Any]:
    cmds = raw_decode(bytes(b))
    assert len(cmds) == 1
    c = cmds[0]
    assert c["length"] == isa.command_length(Opcode(c["opcode"])) == len(bytes(b))
    return c


def test_conv2d_fields(raw_decode: RawDecode) -> None:
    b = CommandBufferBuilder()
    b.conv2d(dtype="f16", n=2, c=4, h=9, w=7, k=6, r=3, s=2, x=0x100, weight=0x2000,
             y=0x3000, bias=0x4000, stride=(2, 1), padding=(0, 1, 2, 0), dilation=1,
             groups=2, activation="gelu")
    c = only(b, raw_decode)
    assert c["opcode"] == Opcode.CONV2D and c["flags"] == isa.CONV_BIAS
    assert (c["dtype"], c["activation"], c["groups"]) == (DType.F16, Activation.GELU, 2)
    assert [c[f] for f in ("n", "c", "h", "w", "k", "r", "s")] == [2, 4, 9, 7, 6, 3, 2]
    assert [c[f] for f in ("stride_h", "stride_w", "dilation_h", "dilation_w", "pad_top",
                           "pad_left", "pad_bottom", "pad_right")] == [2, 1, 1, 1, 0, 1, 2, 0]
    assert (c["x"], c["weight"], c["bias"], c["y"]) == (0x100, 0x2000, 0x4000, 0x3000)
    assert c["reserved"] == c["reserved2"] == 0
    assert conv2d_output_hw(9, 7, 3, 2, (2, 1), (0, 1, 2, 0)) == (5, 7)


def test_rowwise_and_quant_fields(raw_decode: RawDecode) -> None:
    b = CommandBufferBuilder()
    b.softmax(dtype="f32", rows=3, cols=5, x=8, y=16)
    b.layernorm(dtype="f16", rows=2, cols=4, x=1, gamma=2, beta=3, y=4, epsilon=1e-6)
    b.reduce("mean", dtype="f32", rows=7, cols=9, x=0x10, y=0x20)
    b.quantize(count=10, x=0x30, y=0x40, scale=0.25, zero_point=-3)
    b.dequantize(count=11, x=0x50, y=0x60, scale=2.0, zero_point=-1000, src_dtype="i32",
                 dtype="f16")
    b.call(0x4000_0000, 64)
    sm, ln, rd, q, dq, call = raw_decode(bytes(b))
    assert (sm["opcode"], sm["dtype"], sm["rows"], sm["cols"], sm["x"], sm["y"]) == \
        (Opcode.SOFTMAX, 0, 3, 5, 8, 16)
    assert (ln["opcode"], ln["dtype"], ln["gamma"], ln["beta"], ln["y"]) == \
        (Opcode.LAYERNORM, 1, 2, 3, 4)
    assert ln["epsilon"] == pytest.approx(1e-6, rel=1e-7)
    assert (rd["opcode"], rd["op"], rd["rows"], rd["cols"]) == (Opcode.REDUCE, ReduceOp.MEAN,
                                                                7, 9)
    assert (q["opcode"], q["dtype"], q["int_dtype"], q["scale"], q["zero_point"],
            q["count"]) == (Opcode.QUANTIZE, DType.F32, DType.I8, 0.25, -3, 10)
    assert (dq["opcode"], dq["dtype"], dq["int_dtype"], dq["zero_point"]) == \
        (Opcode.DEQUANTIZE, DType.F16, DType.I32, -1000)
    assert (call["opcode"], call["addr"], call["size"], call["reserved"]) == \
        (Opcode.CALL, 0x4000_0000, 64, 0)


def test_dynamic_quant_fields(raw_decode: RawDecode) -> None:
    b = CommandBufferBuilder()
    b.quantize_dynamic(count=10, x=0x30, y=0x40, qparams=0x50, dtype="f16")
    b.dequantize_dynamic(count=24, channels=3, inner=4, x=0x100, y=0x200, qparams=0x50,
                         wscale=0x300, wsum=0x400, bias=0x500, activation="relu")
    b.dequantize_dynamic(count=6, channels=6, x=0x100, y=0x200, qparams=0x50,
                         wscale=0x300, wsum=0x400)
    q, dq, dq2 = raw_decode(bytes(b))
    assert (q["opcode"], q["dtype"], q["int_dtype"], q["count"], q["x"], q["y"],
            q["qparams"]) == (Opcode.QUANTIZE_DYNAMIC, DType.F16, DType.I8, 10, 0x30, 0x40,
                              0x50)
    assert (dq["opcode"], dq["flags"], dq["dtype"], dq["activation"], dq["channels"],
            dq["inner"], dq["count"]) == (Opcode.DEQUANTIZE_DYNAMIC, isa.DQD_BIAS,
                                          DType.F32, Activation.RELU, 3, 4, 24)
    assert [dq[f] for f in ("x", "y", "qparams", "wscale", "wsum", "bias")] == \
        [0x100, 0x200, 0x50, 0x300, 0x400, 0x500]
    assert (dq2["flags"], dq2["inner"], dq2["bias"], dq2["activation"]) == (0, 1, 0, 0)
    text = disassemble(bytes(b))
    assert "QUANTIZE_DYNAMIC" in text and "qparams=0x50" in text


def test_copy_and_transpose_fields(raw_decode: RawDecode) -> None:
    b = CommandBufferBuilder()
    b.copy(dtype="i8", shape=(3, 4), src=0, dst=100)
    b.transpose(dtype="f32", shape=(2, 3, 4), perm=(2, 0, 1), src=0, dst=1000)
    dense, tr = raw_decode(bytes(b))
    assert (dense["ndim"], dense["shape0"], dense["shape1"], dense["shape2"]) == (2, 3, 4, 0)
    assert (dense["src_stride0"], dense["src_stride1"], dense["dst_stride0"],
            dense["dst_stride1"], dense["src_stride2"]) == (4, 1, 4, 1, 0)
    assert [tr[f"shape{i}"] for i in range(4)] == [4, 2, 3, 0]
    assert [tr[f"src_stride{i}"] for i in range(3)] == [1, 12, 4]
    assert [tr[f"dst_stride{i}"] for i in range(3)] == list(contiguous_strides((4, 2, 3)))


def test_elementwise_new_ops_and_broadcast(raw_decode: RawDecode) -> None:
    b = CommandBufferBuilder()
    b.elementwise("sub", dtype="f32", count=12, a=0, b=64, out=128, broadcast_cols=4)
    b.elementwise("gelu", dtype="f16", count=5, a=0, b=64, out=128)
    bc, gelu = raw_decode(bytes(b))
    assert (bc["flags"], bc["op"], bc["cols"], bc["count"]) == (isa.ELT_BROADCAST_B,
                                                                EltOp.SUB, 4, 12)
    assert (gelu["flags"], gelu["op"], gelu["cols"], gelu["b"]) == (0, EltOp.GELU, 0, 0)


def test_int8_gemm_fields(raw_decode: RawDecode) -> None:
    b = CommandBufferBuilder()
    b.gemm(dtype="i8", m=2, n=3, k=4, a=0, b=8, c=16, bias=64, beta=1.0, activation="relu")
    c = only(b, raw_decode)
    assert (c["dtype"], c["flags"], c["beta"], c["activation"]) == (DType.I8, isa.GEMM_BIAS,
                                                                    1.0, Activation.RELU)


@pytest.mark.parametrize("call,exc,match", [
    (lambda b: b.conv2d(dtype="i8", n=1, c=1, h=3, w=3, k=1, r=1, s=1, x=0, weight=0, y=0),
     ValueError, "CONV2D dtype I8"),
    (lambda b: b.conv2d(dtype="f32", n=1, c=3, h=3, w=3, k=2, r=1, s=1, x=0, weight=0, y=0,
                        groups=2), ValueError, "multiples of groups"),
    (lambda b: b.conv2d(dtype="f32", n=1, c=1, h=3, w=3, k=1, r=3, s=3, x=0, weight=0, y=0,
                        padding=3), ValueError, "below the dilated kernel"),
    (lambda b: b.conv2d(dtype="f32", n=1, c=1, h=2, w=3, k=1, r=3, s=3, x=0, weight=0, y=0),
     ValueError, "larger than the padded input"),
    (lambda b: b.conv2d(dtype="f32", n=1, c=1, h=3, w=3, k=1, r=1, s=1, x=0, weight=0, y=0,
                        stride=0), ValueError, "CONV2D stride"),
    (lambda b: b.conv2d(dtype="f32", n=1, c=1, h=3, w=3, k=1, r=1, s=1, x=0, weight=0, y=0,
                        padding=(1, 1)), ValueError, "top, left, bottom, right"),
    (lambda b: b.softmax(dtype="f32", rows=0, cols=1, x=0, y=0), ValueError, "SOFTMAX rows"),
    (lambda b: b.layernorm(dtype="f32", rows=1, cols=1, x=0, gamma=0, beta=0, y=0,
                           epsilon=-1.0), ValueError, "epsilon"),
    (lambda b: b.reduce("prod", dtype="f32", rows=1, cols=1, x=0, y=0), ValueError,
     "reduce op"),
    (lambda b: b.quantize(count=1, x=0, y=0, scale=0.0), ValueError, "scale"),
    (lambda b: b.quantize(count=1, x=0, y=0, scale=1.0, zero_point=128), ValueError,
     "zero_point"),
    (lambda b: b.dequantize(count=1, x=0, y=0, scale=1.0, src_dtype="f32"), ValueError,
     "integer dtype"),
    (lambda b: b.quantize_dynamic(count=0, x=0, y=0, qparams=0), ValueError,
     "QUANTIZE_DYNAMIC count"),
    (lambda b: b.quantize_dynamic(count=1, x=0, y=0, qparams=2**64 - 4), ValueError,
     "QUANTIZE_DYNAMIC qparams"),
    (lambda b: b.dequantize_dynamic(count=10, channels=4, x=0, y=0, qparams=0, wscale=0,
                                    wsum=0), ValueError, "multiple of channels"),
    (lambda b: b.dequantize_dynamic(count=4, channels=4, x=0, y=0, qparams=0, wscale=0,
                                    wsum=0, activation="gelu"), ValueError, "NONE, RELU"),
    (lambda b: b.dequantize_dynamic(count=4, channels=4, x=0, y=0, qparams=0, wscale=0,
                                    wsum=0, dtype="i8"), ValueError, "DEQUANTIZE_DYNAMIC"),
    (lambda b: b.gemm(dtype="i8", m=1, n=1, k=1, a=0, b=0, c=0, alpha=2.0), ValueError,
     "alpha must be 1"),
    (lambda b: b.gemm(dtype="i8", m=1, n=1, k=1, a=0, b=0, c=0, activation="gelu"),
     ValueError, "I8 GEMM activation"),
    (lambda b: b.elementwise("gelu", dtype="f32", count=4, a=0, out=0, broadcast_cols=2),
     ValueError, "unary"),
    (lambda b: b.elementwise("add", dtype="f32", count=5, a=0, b=0, out=0, broadcast_cols=2),
     ValueError, "multiple of broadcast_cols"),
    (lambda b: b.copy(dtype="f32", shape=(1, 2, 3, 4, 5), src=0, dst=0), ValueError,
     "dimensions"),
    (lambda b: b.copy(dtype="f32", shape=(2, 2), src=0, dst=0, dst_strides=(1, 1)),
     ValueError, "overlap"),
    (lambda b: b.copy(dtype="f32", shape=(2, 2), src=0, dst=0, src_strides=(1,)),
     ValueError, "entries"),
    (lambda b: b.transpose(dtype="f32", shape=(2, 2), perm=(0, 0), src=0, dst=0),
     ValueError, "permutation"),
    (lambda b: b.call(0, 12), ValueError, "multiple of 8"),
    (lambda b: b.call(0, 0), ValueError, "CALL size"),
    (lambda b: b.call(2**64 - 8, 16), ValueError, "overflows"),
])
def test_argument_errors(call: Callable[[CommandBufferBuilder], Any], exc: type,
                         match: str) -> None:
    b = CommandBufferBuilder()
    with pytest.raises(exc, match=match):
        call(b)
    assert len(b) == 0


def test_decode_and_disassemble_new_opcodes() -> None:
    b = CommandBufferBuilder()
    b.conv2d(dtype="f32", n=1, c=1, h=3, w=3, k=1, r=3, s=3, x=0, weight=64, y=128,
             padding=1, activation="relu")
    b.reduce("max", dtype="f16", rows=2, cols=3, x=0x10, y=0x20)
    b.quantize(count=4, x=0, y=16, scale=0.5)
    b.call(0x1000, 8, name="layer 1")
    cmds = decode(bytes(b))
    assert [c.opcode_name for c in cmds] == ["CONV2D", "REDUCE", "QUANTIZE", "CALL"]
    text = disassemble(bytes(b))
    lines = text.splitlines()
    assert "activation=RELU" in lines[0] and "weight=0x40" in lines[0]
    assert "op=MAX" in lines[1] and "dtype=F16" in lines[1]
    assert "int_dtype=I8" in lines[2] and "scale=0.5" in lines[2]
    assert "addr=0x1000" in lines[3]
    assert b.disassemble().splitlines()[3].endswith("; layer 1")


# --- end to end ---------------------------------------------------------------------


def run_guest(program: Callable[[uapi.GuestOS], Any], seed: int = SEED) -> Any:
    return rt_stack.run_guest(program, seed, "isa-e2e")


def test_new_opcodes_end_to_end() -> None:
    """A conv -> softmax -> layernorm chain, int8 GEMM with requantization, a transpose
    and a CALL of a host-memory sub-buffer, through the runtime, driver and device."""
    rng = np.random.default_rng(SEED)
    x_h = rng.standard_normal((1, 2, 6, 6)).astype(np.float32)
    w_h = rng.standard_normal((4, 2, 3, 3)).astype(np.float32)
    a_h = rng.integers(-128, 128, (3, 5), dtype=np.int8)
    b_h = rng.integers(-128, 128, (5, 4), dtype=np.int8)

    def program(os_: uapi.GuestOS) -> dict[str, np.ndarray]:
        with Device(os_) as dev:
            ctx = dev.create_context()
            s = ctx.create_stream()
            x, w = ctx.alloc((1, 2, 6, 6)), ctx.alloc((4, 2, 3, 3))
            y, sm, ln = ctx.alloc((1, 4, 6, 6)), ctx.alloc((4, 36)), ctx.alloc((4, 36))
            gamma, beta = ctx.alloc(36), ctx.alloc(36)
            a, b8 = ctx.alloc((3, 5), np.int8), ctx.alloc((5, 4), np.int8)
            acc, deq = ctx.alloc((3, 4), np.int32), ctx.alloc((3, 4))
            q, tr = ctx.alloc((3, 4), np.int8), ctx.alloc((4, 3))
            for buf, host in ((x, x_h), (w, w_h), (a, a_h), (b8, b_h)):
                s.upload(buf, host)
            s.fill(gamma, 2.0)
            s.fill(beta, 0.5)
            cb = CommandBufferBuilder()
            cb.conv2d(dtype="f32", n=1, c=2, h=6, w=6, k=4, r=3, s=3, x=x.addr,
                      weight=w.addr, y=y.addr, padding=1, activation="relu")
            cb.softmax(dtype="f32", rows=4, cols=36, x=y.addr, y=sm.addr)
            cb.layernorm(dtype="f32", rows=4, cols=36, x=y.addr, gamma=gamma.addr,
                         beta=beta.addr, y=ln.addr, epsilon=1e-5)
            cb.gemm(dtype="i8", m=3, n=4, k=5, a=a.addr, b=b8.addr, c=acc.addr)
            # the requantization tail lives in a host-memory sub-buffer, CALLed
            sub = CommandBufferBuilder()
            sub.dequantize(count=12, x=acc.addr, y=deq.addr, scale=0.01, src_dtype="i32")
            sub.quantize(count=12, x=deq.addr, y=q.addr, scale=0.5, zero_point=1)
            sub.transpose(dtype="f32", shape=(3, 4), perm=(1, 0), src=deq.addr, dst=tr.addr)
            handle, iova = ctx._drv.bo_create(len(sub), uapi.BO_HOST)
            ctx._drv.mmap(handle, len(sub))[:] = np.frombuffer(sub.bytes(), np.uint8)
            cb.call(iova, len(sub))
            s.enqueue(cb, [x, w, y, sm, ln, gamma, beta, a, b8, acc, deq, q, tr])
            out = {k: s.download(v) for k, v in (("y", y), ("sm", sm), ("ln", ln),
                                                  ("acc", acc), ("deq", deq), ("q", q),
                                                  ("tr", tr))}
            s.synchronize()
            res = {k: p.result() for k, p in out.items()}
            ctx._drv.bo_free(handle)
            return res

    got = run_guest(program)
    xp = np.pad(x_h.astype(np.float64), ((0, 0), (0, 0), (1, 1), (1, 1)))
    ref = np.zeros((1, 4, 6, 6))
    for k in range(4):
        for i in range(6):
            for j in range(6):
                ref[0, k, i, j] = np.sum(xp[0, :, i:i + 3, j:j + 3] * w_h[k])
    ref = np.maximum(ref, 0)
    np.testing.assert_allclose(got["y"], ref, rtol=1e-5, atol=1e-5)
    r2 = ref.reshape(4, 36)
    e = np.exp(r2 - r2.max(1, keepdims=True))
    np.testing.assert_allclose(got["sm"], e / e.sum(1, keepdims=True), rtol=1e-5, atol=1e-7)
    mu = r2.mean(1, keepdims=True)
    ln = (r2 - mu) / np.sqrt(((r2 - mu) ** 2).mean(1, keepdims=True) + 1e-5) * 2 + 0.5
    np.testing.assert_allclose(got["ln"], ln, rtol=1e-4, atol=1e-4)
    acc = a_h.astype(np.int64) @ b_h.astype(np.int64)
    np.testing.assert_array_equal(got["acc"], acc)
    deq = acc.astype(np.float32) * np.float32(0.01)
    np.testing.assert_array_equal(got["deq"], deq)
    np.testing.assert_array_equal(
        got["q"], np.clip(np.rint(deq / np.float32(0.5)) + 1, -128, 127).astype(np.int8))
    np.testing.assert_array_equal(got["tr"], deq.T)
    assert math.isfinite(float(got["ln"].sum()))
