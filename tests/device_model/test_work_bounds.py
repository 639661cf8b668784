"""Work bounds (spec §7, "Work bounds"; isolation issue, defect 2).

- A command's kernel allocates at most `work_memory_size` bytes of host memory, whatever
  its shape: measured with tracemalloc (numpy reports its data buffers to it) around
  the kernel, never with wall time. Tiled results match the untiled ones.
- A command asking for more than `max_command_flops` is refused at validation with
  WORK_LIMIT at its offset (rule `work/flops`), before anything runs or is allocated.
- Inputs overlapping the output other than in place are staged; more than half the work
  memory of them is WORK_LIMIT (rule `work/memory`).
"""
from __future__ import annotations

import struct
import tracemalloc
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import numpy as np
import pytest
from dm_driver import Rig, fill, gemm, hdr, nop

from device_model import Va1Config
from device_model.va1 import commands as C
from device_model.va1.config import ConfigError
from device_model.va1.memory import DeviceMemory
from hwspec import isa
from hwspec.isa import Activation, DType, EltOp, Opcode, ReduceOp
from hwspec.va1 import NO_OFFSET, Status

MIB = 1 << 20
W = MIB            # the smallest work memory: modest shapes already need tiles
MEM = 32 * MIB
BIG = 16 << 30     # the largest work memory: every kernel in one piece (the reference)
SEED = 20240
NP = {DType.F32: np.dtype("<f4"), DType.F16: np.dtype("<f2"), DType.I8: np.dtype("i1"),
      DType.I32: np.dtype("<i4")}


def enc(opcode: Opcode, flags: int = 0, **fields: Any) -> bytes:
    layout = isa.PAYLOAD[opcode]
    return hdr(opcode, isa.command_length(opcode), flags) + struct.pack(
        layout.format, *(fields.get(n, 0) for n in layout.names))


def env(mem: DeviceMemory, work: int = W, flops: int = 1 << 62) -> C.DecodeEnv:
    cfg = Va1Config(device_memory_size=mem.size, work_memory_size=work,
                    max_command_flops=flops)
    return C.DecodeEnv(config=cfg, memory=mem, dma=None,  # type: ignore[arg-type]
                       fp16=True, timestamp=True, int8=True)


def run_measured(buf: bytes, mem: DeviceMemory, work: int) -> int:
    """Validate and run `buf` on `mem`; the largest host allocation peak of one command's
    kernel (bytes above what was allocated before it started)."""
    cmds = C.decode(buf, env(mem, work))
    peak = 0
    tracemalloc.start()
    try:
        for cmd in cmds:
            base = tracemalloc.get_traced_memory()[0]
            tracemalloc.reset_peak()
            with np.errstate(all="ignore"):
                C.OPS[cmd.opcode].execute(cmd, None, 0)  # type: ignore[arg-type]
            peak = max(peak, tracemalloc.get_traced_memory()[1] - base)
    finally:
        tracemalloc.stop()
    return peak


@dataclass
class Case:
    """One command on a memory image: where its output is (address, dtype, shape)."""
    name: str
    buf: bytes
    image: np.ndarray
    out: tuple[int, np.dtype[Any], tuple[int, ...]]


class Image:
    """A device memory image filled operand by operand."""

    def __init__(self, rng: np.random.Generator) -> None:
        self.rng = rng
        self.data = np.zeros(MEM, np.uint8)
        self.top = 0

    def put(self, arr: np.ndarray) -> int:
        addr = self.top
        raw = np.ascontiguousarray(arr).view(np.uint8).reshape(-1)
        self.data[addr:addr + raw.size] = raw
        self.top = (addr + raw.size + 63) // 64 * 64
        assert self.top <= MEM
        return addr

    def rand(self, shape: tuple[int, ...], dt: DType) -> int:
        if dt in (DType.I8, DType.I32):
            lim = 127 if dt == DType.I8 else 1 << 20
            return self.put(self.rng.integers(-lim, lim, shape).astype(NP[dt]))
        return self.put(self.rng.standard_normal(shape).astype(NP[dt]))

    def out(self, shape: tuple[int, ...], dt: DType) -> int:
        return self.put(np.zeros(shape, NP[dt]))


def _dims(rng: np.random.Generator, lo: int, hi: int) -> int:
    """Log-uniform in [lo, hi]: small and large shapes alike."""
    return int(np.exp(rng.uniform(np.log(lo), np.log(hi + 1))))


def gemm_cases(rng: np.random.Generator) -> Iterator[Case]:
    for i in range(6):
        dt = [DType.F32, DType.F16, DType.I8][i % 3]
        if i < 3:
            m, n, k = (int(v) for v in rng.integers(64, 600, 3))
        else:  # one row of A and column of B alone are over the budget: k is split
            m, n, k = _dims(rng, 1, 8), _dims(rng, 1, 8), _dims(rng, 100_000, 300_000)
        im = Image(rng)
        a, b = im.rand((m, k), dt), im.rand((k, n), dt)
        odt = DType.I32 if dt == DType.I8 else dt
        c = im.rand((m, n), odt)
        bias = im.rand((n,), odt)
        act = [Activation.GELU, Activation.SIGMOID, Activation.RELU][i % 3]
        beta = 1.0
        alpha = 1.0 if dt == DType.I8 else 0.5
        if dt == DType.I8:
            act = Activation.RELU
        yield Case(f"gemm-{dt.name}-{m}x{n}x{k}", enc(
            Opcode.GEMM, isa.GEMM_BIAS | (isa.GEMM_TRANS_B if i % 2 else 0), dtype=dt,
            activation=act, m=m, n=n, k=k, a=a, b=b, c=c, bias=bias, alpha=alpha,
            beta=beta), im.data, (c, NP[odt], (m, n)))


def elementwise_cases(rng: np.random.Generator) -> Iterator[Case]:
    for op, dt in [(EltOp.GELU, DType.F32), (EltOp.SIGMOID, DType.F16),
                   (EltOp.GELU, DType.F16), (EltOp.ADD, DType.F32)]:
        count = _dims(rng, 1000, 1_500_000)
        im = Image(rng)
        a, b, out = im.rand((count,), dt), im.rand((count,), dt), im.out((count,), dt)
        yield Case(f"elementwise-{op.name}-{dt.name}-{count}", enc(
            Opcode.ELEMENTWISE, dtype=dt, op=op, count=count, a=a, b=b, out=out),
            im.data, (out, NP[dt], (count,)))


def rowwise_cases(rng: np.random.Generator) -> Iterator[Case]:
    for i in range(12):  # i < 4: rows fit the budget; then one row alone is over it
        dt = [DType.F32, DType.F16][i % 2]
        cols = _dims(rng, 1, 50_000) if i < 4 else _dims(rng, 200_000, 1_000_000)
        rows = max(1, _dims(rng, 1, 2_000_000) // cols)
        im = Image(rng)
        x = im.rand((rows, cols), dt)
        kind = i % 4
        if kind == 0:
            y = im.out((rows, cols), dt)
            buf = enc(Opcode.SOFTMAX, dtype=dt, rows=rows, cols=cols, x=x, y=y)
            shape: tuple[int, ...] = (rows, cols)
        elif kind == 1:
            g, b, y = im.rand((cols,), dt), im.rand((cols,), dt), im.out((rows, cols), dt)
            buf = enc(Opcode.LAYERNORM, dtype=dt, rows=rows, cols=cols, epsilon=1e-5, x=x,
                      gamma=g, beta=b, y=y)
            shape = (rows, cols)
        else:
            op = [ReduceOp.SUM, ReduceOp.MAX, ReduceOp.MEAN, ReduceOp.MIN][i // 2 % 4]
            y = im.out((rows,), dt)
            buf = enc(Opcode.REDUCE, op=op, dtype=dt, rows=rows, cols=cols, x=x, y=y)
            shape = (rows,)
        yield Case(f"{Opcode(struct.unpack_from('<H', buf)[0]).name}-{dt.name}-"
                   f"{rows}x{cols}", buf, im.data, (y, NP[dt], shape))


def quant_cases(rng: np.random.Generator) -> Iterator[Case]:
    for quant, fdt, idt in [(True, DType.F32, DType.I8), (True, DType.F16, DType.I8),
                            (False, DType.F32, DType.I32), (False, DType.F16, DType.I8)]:
        count = _dims(rng, 1000, 2_000_000)
        im = Image(rng)
        if quant:
            x, y, odt = im.rand((count,), fdt), im.out((count,), idt), idt
        else:
            x, y, odt = im.rand((count,), idt), im.out((count,), fdt), fdt
        op = Opcode.QUANTIZE if quant else Opcode.DEQUANTIZE
        yield Case(f"{op.name}-{fdt.name}-{idt.name}-{count}", enc(
            op, dtype=fdt, int_dtype=idt, scale=0.05, zero_point=3, count=count, x=x, y=y),
            im.data, (y, NP[odt], (count,)))
    for fdt in (DType.F32, DType.F16):
        count = _dims(rng, 1000, 2_000_000)
        im = Image(rng)
        x, y, qp = im.rand((count,), fdt), im.out((count,), DType.I8), im.out((2,), DType.I32)
        yield Case(f"QUANTIZE_DYNAMIC-{fdt.name}-{count}", enc(
            Opcode.QUANTIZE_DYNAMIC, dtype=fdt, int_dtype=DType.I8, count=count, x=x, y=y,
            qparams=qp), im.data, (y, NP[DType.I8], (count,)))
        ch = _dims(rng, 1, 2000)
        inner = _dims(rng, 1, 4000)
        outer = max(1, 1_000_000 // (ch * inner))
        im = Image(rng)
        x = im.rand((outer * ch * inner,), DType.I32)
        qp = im.put(np.frombuffer(struct.pack("<fi", 0.01, -5), np.uint8))
        ws, wsum, b = im.rand((ch,), DType.F32), im.rand((ch,), DType.I32), im.rand((ch,),
                                                                                DType.F32)
        y = im.out((outer * ch * inner,), fdt)
        yield Case(f"DEQUANTIZE_DYNAMIC-{fdt.name}-{outer}x{ch}x{inner}", enc(
            Opcode.DEQUANTIZE_DYNAMIC, isa.DQD_BIAS, dtype=fdt, activation=Activation.RELU,
            channels=ch, inner=inner, count=outer * ch * inner, x=x, y=y, qparams=qp,
            wscale=ws, wsum=wsum, bias=b), im.data, (y, NP[fdt], (outer * ch * inner,)))


def conv_cases(rng: np.random.Generator) -> Iterator[Case]:
    shapes = [  # n, c, h, w, k, r, s, stride, pads, groups, act
        (2, 16, 40, 40, 32, 3, 3, 1, 1, 1, Activation.GELU),
        (1, 8, 64, 64, 8, 5, 5, 2, 2, 8, Activation.RELU),
        (1, 1, 96, 160, 1, 96, 96, 1, 0, 1, Activation.NONE),   # the issue's shape, scaled
        (1, 4, 30, 30, 600, 1, 1, 1, 0, 1, Activation.SIGMOID),
    ]
    for i, (n, c, h, w, k, r, s, st, pad, g, act) in enumerate(shapes):
        dt = DType.F16 if i == 1 else DType.F32
        im = Image(rng)
        x, wt, b = im.rand((n, c, h, w), dt), im.rand((k, c // g, r, s), dt), im.rand((k,), dt)
        oh, ow = (h + 2 * pad - r) // st + 1, (w + 2 * pad - s) // st + 1
        y = im.out((n, k, oh, ow), dt)
        yield Case(f"conv2d-{n}x{c}x{h}x{w}-k{k}-{r}x{s}", enc(
            Opcode.CONV2D, isa.CONV_BIAS, dtype=dt, activation=act, groups=g, n=n, c=c, h=h,
            w=w, k=k, r=r, s=s, stride_h=st, stride_w=st, dilation_h=1, dilation_w=1,
            pad_top=pad, pad_left=pad, pad_bottom=pad, pad_right=pad, x=x, weight=wt, bias=b,
            y=y), im.data, (y, NP[dt], (n, k, oh, ow)))


def model_op_cases(rng: np.random.Generator) -> Iterator[Case]:
    """POOL2D, GATHER and the f16 unary functions, at shapes over the 1 MiB bound."""
    for op, flags, o in ((isa.PoolOp.MAX, isa.POOL_CEIL, 29), (isa.PoolOp.AVG, 0, 28)):
        im = Image(rng)
        x = im.rand((2, 64, 56, 56), DType.F32)
        y = im.out((2, 64, o, o), DType.F32)
        yield Case(f"pool2d-{op.name}", enc(
            Opcode.POOL2D, flags, dtype=DType.F32, op=op, n=2, c=64, h=56, w=56, r=3, s=3,
            stride_h=2, stride_w=2, dilation_h=1, dilation_w=1, pad_top=1, pad_left=1,
            pad_bottom=1, pad_right=1, x=x, y=y), im.data, (y, NP[DType.F32], (2, 64, o, o)))
    im = Image(rng)
    table = im.rand((1000, 512), DType.F32)
    idx = im.put(rng.integers(-1000, 1000, 2000).astype(np.int32))
    out = im.out((2000, 512), DType.F32)
    yield Case("gather-2000x512", enc(Opcode.GATHER, dtype=DType.F32, rows=1000, cols=512,
                                      count=2000, table=table, indices=idx, out=out),
               im.data, (out, NP[DType.F32], (2000, 512)))
    im = Image(rng)
    a = im.rand((1 << 20,), DType.F16)
    o = im.out((1 << 20,), DType.F16)
    yield Case("tanh-f16-1M", enc(Opcode.ELEMENTWISE, op=isa.EltOp.TANH, dtype=DType.F16,
                                  count=1 << 20, a=a, out=o), im.data, (o, NP[DType.F16],
                                                                        (1 << 20,)))


def gemm_batched_cases(rng: np.random.Generator) -> Iterator[Case]:
    """GEMM_BATCHED over the bound: f16 (tiled per batch), strided transposed A and a
    shared B in f32, and C overlapping A (staged)."""
    im = Image(rng)
    a, b = im.rand((3, 400, 400), DType.F16), im.rand((3, 400, 400), DType.F16)
    c = im.out((3, 400, 400), DType.F16)
    yield Case("gemm_batched-f16", enc(
        Opcode.GEMM_BATCHED, dtype=DType.F16, batch=3, m=400, n=400, k=400, a=a, b=b, c=c,
        lda=400, ldb=400, ldc=400, stride_a=160_000, stride_b=160_000, stride_c=160_000,
        alpha=1.0, beta=0.0), im.data, (c, NP[DType.F16], (3, 400, 400)))
    im = Image(rng)
    q = im.rand((512, 4, 128), DType.F32)          # 4 heads of [512, 128], transposed
    w = im.rand((512, 512), DType.F32)
    c = im.out((4, 128, 512), DType.F32)
    yield Case("gemm_batched-strided", enc(
        Opcode.GEMM_BATCHED, isa.GEMM_TRANS_A, dtype=DType.F32, activation=Activation.GELU,
        batch=4, m=128, n=512, k=512, a=q, b=w, c=c, lda=512, ldb=512, ldc=512,
        stride_a=128, stride_b=0, stride_c=128 * 512, alpha=0.5, beta=0.0), im.data,
        (c, NP[DType.F32], (4, 128, 512)))
    im = Image(rng)
    a, b = im.rand((2, 160, 160), DType.F32), im.rand((2, 160, 160), DType.F32)
    im.out((160,), DType.F32)
    yield Case("gemm_batched-over-a", enc(
        Opcode.GEMM_BATCHED, dtype=DType.F32, batch=2, m=160, n=160, k=160, a=a, b=b,
        c=b + 4 * 160, lda=160, ldb=160, ldc=160, stride_a=25600, stride_b=25600,
        stride_c=25600, alpha=1.0, beta=0.0), im.data, (b + 4 * 160, NP[DType.F32],
                                                       (2, 160, 160)))


def select_cases(rng: np.random.Generator) -> Iterator[Case]:
    """COMPARE (f16, broadcast) and SELECT (f32, in place over a) over the bound."""
    im = Image(rng)
    a, b = im.rand((1024, 1024), DType.F16), im.rand((1024,), DType.F16)
    out = im.out((1024 * 1024,), DType.I8)
    yield Case("compare-f16-bcast", enc(
        Opcode.COMPARE, isa.CMP_BROADCAST_B, op=isa.CmpOp.GREATER_EQUAL, dtype=DType.F16,
        cols=1024, count=1 << 20, a=a, b=b, out=out), im.data, (out, NP[DType.I8],
                                                               (1 << 20,)))
    im = Image(rng)
    cond = im.put((rng.random(1 << 20) < 0.3).astype(np.int8))
    a, b = im.rand((1 << 20,), DType.F32), im.rand((1 << 20,), DType.F32)
    yield Case("select-f32-in-place", enc(
        Opcode.SELECT, dtype=DType.F32, count=1 << 20, cond=cond, a=a, b=b, out=a),
        im.data, (a, NP[DType.F32], (1 << 20,)))


def movement_cases(rng: np.random.Generator) -> Iterator[Case]:
    for shift in (-4096 - 3, 100_000):  # D2D over itself, both directions
        im = Image(rng)
        size = 6 * MIB
        src = im.rand((size + 200_000,), DType.I8) + 100_000
        yield Case(f"d2d-shift{shift}", enc(Opcode.DMA_D2D, src=src, dst=src + shift,
                                            size=size), im.data, (0, np.dtype("u1"), (MEM,)))
    im = Image(rng)  # a transposing COPY onto its own source (staged: 256 KiB)
    src = im.rand((256, 256), DType.F32)
    yield Case("copy-transpose-in-place", enc(
        Opcode.COPY, dtype=DType.F32, ndim=2, src=src, dst=src, shape0=256, shape1=256,
        src_stride0=1, src_stride1=256, dst_stride0=256, dst_stride1=1), im.data,
        (src, NP[DType.F32], (256, 256)))


GENERATORS: dict[str, Callable[[np.random.Generator], Iterator[Case]]] = {
    "gemm": gemm_cases, "elementwise": elementwise_cases, "rowwise": rowwise_cases,
    "quant": quant_cases, "conv2d": conv_cases, "movement": movement_cases,
    "model_ops": model_op_cases, "gemm_batched": gemm_batched_cases,
    "select": select_cases}


@pytest.mark.parametrize("kind", list(GENERATORS))
def test_every_kernel_stays_within_its_work_memory(kind: str) -> None:
    rng = np.random.default_rng(SEED + len(kind))
    for case in GENERATORS[kind](rng):
        small, ref = DeviceMemory(MEM, case.image.copy()), DeviceMemory(MEM, case.image.copy())
        peak = run_measured(case.buf, small, W)
        assert peak <= W, f"{case.name}: {peak} bytes of temporaries > {W} (seed {SEED})"
        run_measured(case.buf, ref, BIG)
        addr, dt, shape = case.out
        size = int(np.prod(shape)) * dt.itemsize
        got = small.data[addr:addr + size].view(dt).reshape(shape)
        want = ref.data[addr:addr + size].view(dt).reshape(shape)
        if dt.kind in "iu":
            np.testing.assert_array_equal(got, want, err_msg=case.name)
        else:  # a split reduction rounds in another order; f16 may then round apart
            tol = 1e-4 if dt.itemsize == 4 else 2 ** -9
            np.testing.assert_allclose(got.astype(np.float64), want.astype(np.float64),
                                       rtol=tol, atol=tol, err_msg=case.name)


def test_tiling_over_outputs_gives_the_same_bits() -> None:
    """Row blocks of SOFTMAX and chunks of GELU compute each output exactly as the
    whole command does."""
    rng = np.random.default_rng(SEED)
    im = Image(rng)
    x, y = im.rand((300, 3000), DType.F32), im.out((300, 3000), DType.F32)
    a, out = im.rand((700_000,), DType.F32), im.out((700_000,), DType.F32)
    buf = (enc(Opcode.SOFTMAX, dtype=DType.F32, rows=300, cols=3000, x=x, y=y)
           + enc(Opcode.ELEMENTWISE, op=EltOp.GELU, dtype=DType.F32, count=700_000, a=a,
                 out=out))
    small, ref = DeviceMemory(MEM, im.data.copy()), DeviceMemory(MEM, im.data.copy())
    run_measured(buf, small, W)
    run_measured(buf, ref, BIG)
    np.testing.assert_array_equal(small.data, ref.data)


# --- the issue's CONV2D --------------------------------------------------------------

ISSUE = dict(n=1, c=1, h=2048, w=4096, k=1, r=2048, s=2048)


def issue_conv(x: int, weight: int, y: int) -> bytes:
    return enc(Opcode.CONV2D, dtype=DType.F32, groups=1, stride_h=1, stride_w=1,
               dilation_h=1, dilation_w=1, x=x, weight=weight, y=y, **ISSUE)


def test_the_issues_conv2d_is_refused_before_any_allocation() -> None:
    """n=1 c=1 h=2048 w=4096, a 2048x2048 kernel: 17.2 GFLOP, over the default bound;
    refused WORK_LIMIT at its offset, and another context still runs."""
    rig = Rig(Va1Config(device_memory_size=64 * MIB))
    bad, good = rig.create_context(), rig.create_context()
    buf = nop() + issue_conv(0, 32 * MIB, 48 * MIB)
    tracemalloc.start()
    try:
        r = rig.submit(bad, buf)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert (Status(r.status), r.error_offset) == (Status.WORK_LIMIT, 8)
    assert peak < MIB, peak
    why = rig.tracer.kinds("cmd_invalid")
    assert why and str(why[-1]["message"]).startswith("work/flops"), why
    r2 = rig.submit(good, fill(0, 4096, 0x3F800000), fence=2)
    assert (Status(r2.status), r2.error_offset) == (Status.OK, NO_OFFSET)
    assert np.all(np.frombuffer(rig.dev.memory.read(0, 4096), "<f4") == 1.0)


def test_the_issues_conv2d_in_a_37_mib_function_is_refused_too() -> None:
    """The VF variant: a 37 MiB partition, operands overlapping (weight inside x, y
    inside x): refused at validation, nothing allocated."""
    rig = Rig(Va1Config(device_memory_size=37 * MIB))
    cid = rig.create_context()
    tracemalloc.start()
    try:
        r = rig.submit(cid, issue_conv(0, 4 * MIB, 36 * MIB - 16 * 1024))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert (Status(r.status), r.error_offset) == (Status.WORK_LIMIT, 0)
    assert peak < MIB, peak


def test_the_issues_conv2d_shape_runs_within_the_bound_once_admitted() -> None:
    """With the flop bound raised, the same kind of shape (one channel, a kernel as
    large as the image's height: one output pixel's im2col column alone is 16 MiB in the
    issue) runs in tiles within work_memory_size; scaled down so the test stays short."""
    rng = np.random.default_rng(SEED)
    h, w, r = 128, 256, 128
    x = rng.standard_normal((1, 1, h, w)).astype(np.float32)
    wt = rng.standard_normal((1, 1, r, r)).astype(np.float32)
    mem = DeviceMemory(MEM)
    mem.write(0, x.tobytes())
    mem.write(1 * MIB, wt.tobytes())
    buf = enc(Opcode.CONV2D, dtype=DType.F32, groups=1, n=1, c=1, h=h, w=w, k=1, r=r, s=r,
              stride_h=1, stride_w=1, dilation_h=1, dilation_w=1, x=0, weight=1 * MIB,
              y=2 * MIB)
    peak = run_measured(buf, mem, W)
    assert peak <= W, peak
    windows = np.lib.stride_tricks.sliding_window_view(x[0, 0].astype(np.float64), (r, r))
    want = np.einsum("ijkl,kl->ij", windows, wt[0, 0].astype(np.float64))
    got = np.frombuffer(mem.read(2 * MIB, want.size * 4), "<f4").reshape(want.shape)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-3)


# --- the flop bound ------------------------------------------------------------------

@pytest.mark.parametrize("make,flops", [
    (lambda: gemm(4, 5, 6, 0, 4096, 8192), 2 * 4 * 5 * 6),
    (lambda: enc(Opcode.ELEMENTWISE, op=EltOp.ADD, dtype=0, count=1000, a=0, b=4096,
                 out=8192), 1000),
    (lambda: enc(Opcode.SOFTMAX, dtype=0, rows=10, cols=20, x=0, y=4096), 5 * 10 * 20),
    (lambda: enc(Opcode.CONV2D, dtype=0, groups=1, n=1, c=2, h=5, w=5, k=3, r=3, s=3,
                 stride_h=1, stride_w=1, dilation_h=1, dilation_w=1, x=0, weight=4096,
                 y=8192), 2 * 3 * 3 * 3 * 2 * 3 * 3),
], ids=["gemm", "elementwise", "softmax", "conv2d"])
def test_work_over_the_flop_bound_is_refused_with_its_offset(
        make: Callable[[], bytes], flops: int) -> None:
    cmd = make()
    at = Rig(Va1Config(max_command_flops=flops))
    r = at.submit(at.create_context(), nop() + cmd)
    assert (Status(r.status), r.error_offset) == (Status.OK, NO_OFFSET)
    over = Rig(Va1Config(max_command_flops=flops - 1))
    r = over.submit(over.create_context(), nop() + nop(16) + cmd, fence=7)
    assert (Status(r.status), r.error_offset) == (Status.WORK_LIMIT, 24)
    assert r.start_ns == r.end_ns  # nothing ran


def test_a_refused_callee_command_reports_the_top_level_call() -> None:
    rig = Rig(Va1Config(max_command_flops=100))
    callee = gemm(8, 8, 8, 0, 4096, 8192)
    addr = rig.put(callee)
    call = enc(Opcode.CALL, addr=addr, size=len(callee))
    r = rig.submit(rig.create_context(), nop() + call)
    assert (Status(r.status), r.error_offset) == (Status.WORK_LIMIT, 8)


# --- staging -------------------------------------------------------------------------

def test_staging_over_half_the_work_memory_is_refused() -> None:
    """A COPY onto its own source, shifted, stages the source: 512 KiB of 1 MiB is admitted,
    one element more is WORK_LIMIT (`work/memory`)."""
    mem = DeviceMemory(MEM)
    n = W // 2 // 4

    def copy_onto_itself(count: int) -> bytes:
        return enc(Opcode.COPY, dtype=DType.F32, ndim=1, src=0, dst=4, shape0=count,
                   src_stride0=1, dst_stride0=1)

    C.decode(copy_onto_itself(n), env(mem))
    with pytest.raises(C.CommandError) as ei:
        C.decode(nop() + copy_onto_itself(n + 1), env(mem))
    assert (ei.value.status, ei.value.offset) == (Status.WORK_LIMIT, 8)
    assert "work/memory" in ei.value.message


def test_in_place_needs_no_staging_and_shifted_overlap_reads_inputs_first() -> None:
    """SOFTMAX in place is not staged (it would not fit); ELEMENTWISE onto its input
    shifted by one element reads every input before it writes, tiles or not."""
    rng = np.random.default_rng(SEED)
    mem = DeviceMemory(MEM)
    rows, cols = 64, 4096  # 1 MiB: more than half the work memory
    x = rng.standard_normal((rows, cols)).astype(np.float32)
    mem.write(0, x.tobytes())
    assert run_measured(enc(Opcode.SOFTMAX, dtype=0, rows=rows, cols=cols, x=0, y=0),
                        mem, W) <= W
    e = np.exp(x.astype(np.float64) - x.max(axis=1, keepdims=True))
    got = np.frombuffer(mem.read(0, x.nbytes), "<f4").reshape(rows, cols)
    np.testing.assert_allclose(got, e / e.sum(axis=1, keepdims=True), rtol=1e-5, atol=1e-7)
    a = rng.standard_normal(100_000).astype(np.float32)
    mem.write(8 * MIB, a.tobytes())
    run_measured(enc(Opcode.ELEMENTWISE, op=EltOp.GELU, dtype=0, count=a.size,
                     a=8 * MIB, out=8 * MIB + 4), mem, W)
    got1 = np.frombuffer(mem.read(8 * MIB + 4, a.nbytes), "<f4")
    ref = DeviceMemory(MEM)
    ref.write(0, a.tobytes())
    run_measured(enc(Opcode.ELEMENTWISE, op=EltOp.GELU, dtype=0, count=a.size, a=0,
                     out=4 * MIB), ref, W)
    np.testing.assert_array_equal(got1, np.frombuffer(ref.read(4 * MIB, a.nbytes), "<f4"))


# --- configuration -------------------------------------------------------------------

@pytest.mark.parametrize("field,value", [("work_memory_size", MIB - 1),
                                         ("work_memory_size", (16 << 30) + 1),
                                         ("max_command_flops", 0)])
def test_bounds_outside_their_range_are_refused(field: str, value: int) -> None:
    with pytest.raises(ConfigError) as ei:
        Va1Config(**{field: value})
    assert ei.value.field == field


def test_defaults_admit_the_benchmarks_gemm() -> None:
    cfg = Va1Config()
    assert cfg.work_memory_size == 32 * MIB
    assert cfg.max_command_flops >= 4 * 2 * 1024 ** 3  # bench GEMM 1024^3, 4x headroom
