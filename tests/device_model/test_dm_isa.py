"""Command ISA (spec §7): every opcode against numpy, GEMM in every flag combination,
every validation rule with its status and byte offset, and the roofline times."""
from __future__ import annotations

import itertools
import math
import struct

import numpy as np
import pytest
from dm_driver import (Rig, d2d, d2h, eltwise, fill, gemm, h2d, hdr, nop, signal,
                       timestamp)

from device_model import Va1Config
from hwspec.va1 import NO_OFFSET, Status

MEM = 1 << 20
CFG = Va1Config(device_memory_size=MEM)
RNG_SEED = 1234


@pytest.fixture
def rig() -> Rig:
    return Rig(CFG)


def dev_put(rig: Rig, addr: int, arr: np.ndarray) -> None:
    rig.dev.memory.write(addr, arr.tobytes())


def dev_get(rig: Rig, addr: int, dtype: str, shape: tuple[int, ...]) -> np.ndarray:
    n = int(np.prod(shape)) * np.dtype(dtype).itemsize
    return np.frombuffer(rig.dev.memory.read(addr, n), dtype=dtype).reshape(shape)


def ok(rig: Rig, buf: bytes, **kw: int) -> None:
    cid = rig.create_context()
    r = rig.submit(cid, buf, **kw)
    assert (r.status, r.error_offset) == (0, NO_OFFSET), r


# --- opcodes -------------------------------------------------------------------------

def test_fill_and_nop(rig: Rig) -> None:
    dev_put(rig, 0, np.full(64, 0xEE, np.uint8))
    ok(rig, nop(24) + fill(4, 40, 0xDEADBEEF) + nop())
    got = rig.dev.memory.read(0, 64)
    assert got[:4] == b"\xEE" * 4 and got[44:] == b"\xEE" * 20
    assert got[4:44] == struct.pack("<I", 0xDEADBEEF) * 10


def test_dma_round_trip(rig: Rig) -> None:
    data = np.random.default_rng(RNG_SEED).integers(0, 256, 4096, dtype=np.uint8).tobytes()
    src = rig.put(data)
    dst = rig.alloc.alloc(4096)
    ok(rig, h2d(src + 1, 1000, 4095) + d2d(1000, 9000, 4095) + d2h(9000, dst, 4095))
    assert rig.dma.g_read(dst, 4095) == data[1:]
    assert rig.dev.memory.read(9000, 4095) == data[1:]


def test_d2d_memmove_overlap(rig: Rig) -> None:
    base = np.arange(256, dtype=np.uint8)
    dev_put(rig, 100, base)
    ok(rig, d2d(100, 110, 200))
    assert rig.dev.memory.read(110, 200) == base[:200].tobytes()
    dev_put(rig, 100, base)
    ok(rig, d2d(110, 100, 200))
    assert rig.dev.memory.read(100, 200) == base[10:210].tobytes()


def test_signal_and_timestamp(rig: Rig) -> None:
    out = rig.alloc.alloc(16)
    cid = rig.create_context()
    r = rig.submit(cid, nop() + timestamp(out) + signal(out + 8, 0x1122334455667788))
    assert r.status == 0
    ts, val = struct.unpack("<QQ", rig.dma.g_read(out, 16))
    assert val == 0x1122334455667788
    assert ts == r.start_ns + CFG.cmd_overhead_ns  # TIMESTAMP starts after the NOP
    assert r.end_ns == r.start_ns + 3 * CFG.cmd_overhead_ns


@pytest.mark.parametrize("dtype", [0, 1])
@pytest.mark.parametrize("op", [0, 1, 2])
def test_elementwise(rig: Rig, op: int, dtype: int) -> None:
    npdt = "<f4" if dtype == 0 else "<f2"
    rng = np.random.default_rng(RNG_SEED + op)
    a = rng.standard_normal(1000).astype(npdt)
    b = rng.standard_normal(1000).astype(npdt)
    dev_put(rig, 0, a)
    dev_put(rig, 8192, b)
    ok(rig, eltwise(op, dtype, 1000, 0, 8192, 16384))
    got = dev_get(rig, 16384, npdt, (1000,))
    ref = [a + b, a * b, np.maximum(a, 0)][op].astype(npdt)
    np.testing.assert_array_equal(got, ref)  # one correctly rounded op: bit exact


def _gemm_case(rig: Rig, m: int, n: int, k: int, flags: int, act: int, dtype: int,
               alpha: float, beta: float, seed: int) -> None:
    npdt = np.dtype("<f4" if dtype == 0 else "<f2")
    rng = np.random.default_rng(seed)
    A = rng.standard_normal((m, k)).astype(npdt)
    B = rng.standard_normal((k, n)).astype(npdt)
    C0 = rng.standard_normal((m, n)).astype(npdt)
    bias = rng.standard_normal(n).astype(npdt)
    a_st = np.ascontiguousarray(A.T) if flags & 1 else A
    b_st = np.ascontiguousarray(B.T) if flags & 2 else B
    ea, eb, ec, ebias = 0, 64 * 1024, 128 * 1024, 192 * 1024
    dev_put(rig, ea, a_st)
    dev_put(rig, eb, b_st)
    dev_put(rig, ec, C0 if beta != 0 else np.full((m, n), np.nan, npdt))
    dev_put(rig, ebias, bias)
    ok(rig, gemm(m, n, k, ea, eb, ec, ebias, alpha, beta, dtype, act, flags))
    ref = alpha * (A.astype(np.float64) @ B.astype(np.float64))
    if beta != 0:
        ref += beta * C0.astype(np.float64)
    if flags & 4:
        ref += bias.astype(np.float64)
    if act == 1:
        ref = np.maximum(ref, 0)
    got = dev_get(rig, ec, npdt.str, (m, n)).astype(np.float64)
    assert np.isfinite(got).all()  # beta == 0: C (NaN) was not read
    if dtype == 0:
        np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5 * k)
    else:  # f32 accumulate, one f16 rounding at the end: within 1 f16 ulp (+ f32 noise)
        np.testing.assert_allclose(got, ref.astype(np.float16).astype(np.float64),
                                   rtol=2 ** -10, atol=1e-3)


@pytest.mark.parametrize("flags,act,dtype", list(itertools.product(range(8), (0, 1), (0, 1))))
@pytest.mark.parametrize("alpha,beta", [(1.0, 0.0), (0.5, 0.0), (1.0, 1.0), (-1.5, 0.25)])
def test_gemm_all_flags(rig: Rig, flags: int, act: int, dtype: int, alpha: float,
                        beta: float) -> None:
    _gemm_case(rig, 7, 5, 9, flags, act, dtype, alpha, beta, RNG_SEED + flags)


def test_gemm_fast_path_large(rig: Rig) -> None:
    _gemm_case(rig, 64, 48, 80, 0, 0, 0, 1.0, 0.0, 7)


def test_gemm_overlapping_output(rig: Rig) -> None:
    A = np.eye(4, dtype=np.float32) * 2
    dev_put(rig, 0, A)
    ok(rig, gemm(4, 4, 4, 0, 0, 0))  # C aliases A and B
    np.testing.assert_array_equal(dev_get(rig, 0, "<f4", (4, 4)), A @ A)


def test_gemm_unaligned_address(rig: Rig) -> None:
    A = np.arange(6, dtype=np.float32).reshape(2, 3)
    B = np.arange(12, dtype=np.float32).reshape(3, 4)
    dev_put(rig, 1, A)
    dev_put(rig, 101, B)
    ok(rig, gemm(2, 4, 3, 1, 101, 203))
    np.testing.assert_array_equal(dev_get(rig, 203, "<f4", (2, 4)), A @ B)


# --- roofline --------------------------------------------------------------------------

def test_roofline_times(rig: Rig) -> None:
    cid = rig.create_context()
    m, n, k = 256, 128, 512
    r = rig.submit(cid, gemm(m, n, k, 0, 0, 0))
    flops_ns = math.ceil(2 * m * n * k * 1e9 / CFG.peak_flops)
    bytes_ns = math.ceil((m * k + k * n + m * n) * 4 * 1e9 / CFG.mem_bandwidth)
    assert r.end_ns - r.start_ns == CFG.cmd_overhead_ns + max(flops_ns, bytes_ns)
    r = rig.submit(cid, gemm(m, n, k, 0, 0, 0, dtype=1), fence=2)
    assert r.end_ns - r.start_ns == CFG.cmd_overhead_ns + max(
        math.ceil(2 * m * n * k * 1e9 / (2 * CFG.peak_flops)),
        math.ceil((m * k + k * n + m * n) * 2 * 1e9 / CFG.mem_bandwidth))
    r = rig.submit(cid, gemm(m, n, k, 0, 0, 0, beta=1.0, flags=4), fence=9)
    assert r.end_ns - r.start_ns == CFG.cmd_overhead_ns + max(flops_ns, math.ceil(
        (m * k + k * n + 2 * m * n + n) * 4 * 1e9 / CFG.mem_bandwidth))
    src = rig.put(bytes(64 * 1024))
    r = rig.submit(cid, h2d(src, 0, 64 * 1024) + fill(0, 4096, 1) + d2d(0, 8192, 4096), fence=3)
    assert r.end_ns - r.start_ns == 3 * CFG.cmd_overhead_ns + math.ceil(
        64 * 1024 * 1e9 / CFG.link_bandwidth) + math.ceil(4096 * 1e9 / CFG.mem_bandwidth) \
        + math.ceil(2 * 4096 * 1e9 / CFG.mem_bandwidth)
    ends = [e["end_ns"] for e in rig.tracer.kinds("cmd")][-3:]
    assert ends[-1] == r.end_ns and ends == sorted(ends)


# --- validation ------------------------------------------------------------------------

BIG = 1 << 64
OUTSIDE = 0x10  # an IOVA below guest RAM


def cases(rig: Rig) -> list[tuple[bytes, Status]]:
    host = rig.alloc.alloc(64)
    m = MEM
    return [
        (hdr(0x05, 8), Status.BAD_OPCODE),
        (hdr(0x12, 8), Status.BAD_OPCODE),
        (hdr(0xFFFF, 8), Status.BAD_OPCODE),
        (hdr(1, 32) + bytes(8), Status.TRUNCATED),
        (hdr(0, 0xFFFFFFF8), Status.TRUNCATED),
        (hdr(0, 0), Status.BAD_LENGTH),
        (hdr(0, 4) + bytes(8), Status.BAD_LENGTH),
        (hdr(0, 12) + bytes(8), Status.BAD_LENGTH),
        (hdr(1, 40) + bytes(32), Status.BAD_LENGTH),
        (hdr(0x20, 16) + bytes(8), Status.BAD_LENGTH),
        (hdr(0, 8, flags=1), Status.BAD_ARG),
        (fill(0, 4, 0, reserved=1), Status.BAD_ARG),
        (hdr(1, 32, flags=2) + fill(0, 4, 0)[8:], Status.BAD_ARG),
        (gemm(1, 1, 1, 0, 0, 0, flags=8), Status.BAD_ARG),
        (gemm(1, 1, 1, 0, 0, 0, reserved=1), Status.BAD_ARG),
        (gemm(1, 1, 1, 0, 0, 0, act=9), Status.BAD_ARG),
        (eltwise(99, 0, 1, 0, 0, 0), Status.BAD_ARG),
        (eltwise(0, 0, 1, 0, 0, 0, reserved=1), Status.BAD_ARG),
        (eltwise(0, 0, 1, 0, 0, 0, reserved2=1), Status.BAD_ARG),
        (eltwise(0, 2, 1, 0, 0, 0), Status.BAD_DTYPE),
        (gemm(1, 1, 1, 0, 0, 0, dtype=3), Status.BAD_DTYPE),
        (gemm(1, 1, 1, 0, 0, 0, dtype=9), Status.BAD_DTYPE),
        (eltwise(0, 4, 1, 0, 0, 0), Status.BAD_DTYPE),
        (fill(0, 0, 0), Status.BAD_SHAPE),
        (fill(0, 6, 0), Status.BAD_SHAPE),
        (h2d(host, 0, 0), Status.BAD_SHAPE),
        (d2d(0, 0, 0), Status.BAD_SHAPE),
        (gemm(0, 1, 1, 0, 0, 0), Status.BAD_SHAPE),
        (gemm(1, 1, 0, 0, 0, 0), Status.BAD_SHAPE),
        (eltwise(0, 0, 0, 0, 0, 0), Status.BAD_SHAPE),
        (eltwise(0, 0, 1 << 62, 0, 0, 0), Status.BAD_SHAPE),
        (gemm(2**32 - 1, 2**32 - 1, 2**32 - 1, 0, 0, 0), Status.BAD_SHAPE),
        (fill(m - 4, 8, 0), Status.OUT_OF_BOUNDS),
        (fill(BIG - 4, 8, 0), Status.OUT_OF_BOUNDS),
        (d2d(0, m - 1, 2), Status.OUT_OF_BOUNDS),
        (h2d(host, m, 4), Status.OUT_OF_BOUNDS),
        (d2h(m - 8, host, 16), Status.OUT_OF_BOUNDS),
        (gemm(16, 16, 16, 0, 0, m - 16 * 16 * 4 + 4), Status.OUT_OF_BOUNDS),
        (gemm(16, 16, 16, m - 16 * 16 * 4 + 4, 0, 0), Status.OUT_OF_BOUNDS),
        (gemm(16, 16, 16, 0, m - 16 * 16 * 2 + 2, 0, dtype=1), Status.OUT_OF_BOUNDS),
        (gemm(4, 16, 4, 0, 0, 0, bias=m - 60, flags=4), Status.OUT_OF_BOUNDS),
        (eltwise(0, 0, 16, 0, m - 60, 0), Status.OUT_OF_BOUNDS),
        (eltwise(0, 0, 16, 0, 0, m - 60), Status.OUT_OF_BOUNDS),
        (h2d(OUTSIDE, 0, 16), Status.DMA_FAULT),
        (h2d(rig.dma.base + rig.dma.size - 8, 0, 16), Status.DMA_FAULT),
        (d2h(0, BIG - 8, 16), Status.DMA_FAULT),
        (signal(OUTSIDE, 1), Status.DMA_FAULT),
        (timestamp(BIG - 4), Status.DMA_FAULT),
    ]


def test_each_validation_rule_fails_with_offset_and_runs_nothing(rig: Rig) -> None:
    out = rig.alloc.alloc(8)
    for i, (bad, status) in enumerate(cases(rig)):
        rig.dev.memory.write(0, b"\x55" * 16)
        rig.dma.g_write(out, bytes(8))
        prefix = fill(0, 16, 0) + signal(out, 1) + nop(16)  # 72 bytes
        cid = rig.create_context()
        r = rig.submit(cid, prefix + bad + nop(), fence=100 + i)
        assert (Status(r.status), r.error_offset, r.fence) == (status, 72, 100 + i), (i, bad)
        assert r.end_ns == r.start_ns
        assert rig.dev.memory.read(0, 16) == b"\x55" * 16, "a command ran"
        assert rig.dma.g_read(out, 8) == bytes(8), "a command ran"
        assert rig.destroy_context(cid) == 0


def test_unaligned_untouched_padding_nop(rig: Rig) -> None:
    ok(rig, nop(8) + nop(1024))


def test_feature_gated_opcode_and_dtype() -> None:
    rig = Rig(CFG, features=(1 << 32) | (1 << 28) | (1 << 29))  # no FP16, no TIMESTAMP
    cid = rig.create_context()
    r = rig.submit(cid, nop() + timestamp(rig.alloc.alloc(8)))
    assert (r.status, r.error_offset) == (Status.BAD_OPCODE, 8)
    cid = rig.create_context()
    r = rig.submit(cid, gemm(1, 1, 1, 0, 0, 0, dtype=1), fence=2)
    assert (r.status, r.error_offset) == (Status.BAD_DTYPE, 0)


def test_dtype_mask_from_config() -> None:
    rig = Rig(Va1Config(device_memory_size=MEM, dtype_mask=1))
    cid = rig.create_context()
    r = rig.submit(cid, eltwise(0, 1, 4, 0, 0, 0))
    assert r.status == Status.BAD_DTYPE


def test_dma_fault_at_run_time(rig: Rig) -> None:
    """An IOVA valid at validation but unmapped before its command runs."""
    out = rig.alloc.alloc(8)
    cid = rig.create_context()
    resp = rig.submit_nowait(cid, gemm(512, 512, 512, 0, 0, 0) + signal(out, 5))
    rig.kick()
    rig.dma.holes.append((out, out + 8))
    rig.clock.run()
    got = rig.queues[2].pop_used()
    assert got is not None
    r = rig.resp(resp)
    assert (r.status, r.error_offset) == (Status.DMA_FAULT, 64)
    assert rig.dma.g_read(out, 8) == bytes(8)


def test_overflow_and_nan_are_data_not_exceptions(rig: Rig) -> None:
    import warnings
    dev_put(rig, 0, np.full(4, 60000, np.float16))
    dev_put(rig, 64, np.array([np.nan, 1, 2, 3], np.float32))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ok(rig, gemm(2, 2, 1, 0, 0, 128, dtype=1, alpha=2.0)
           + eltwise(1, 1, 4, 0, 0, 256) + eltwise(0, 0, 4, 64, 64, 320))
    assert np.isinf(dev_get(rig, 128, "<f2", (2, 2))).all()
    assert np.isinf(dev_get(rig, 256, "<f2", (4,))).all()
    assert np.isnan(dev_get(rig, 320, "<f4", (4,))[0])
