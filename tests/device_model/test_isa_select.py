"""COMPARE and SELECT (spec §7): comparisons and logic into an I8 mask of 0 / 1, and
out = cond ? a : b, against numpy for every dtype; NaN and inf are data (IEEE
comparisons, moved bytes); in place; the INT8 gate; validation rules; roofline."""
from __future__ import annotations

import math

import numpy as np
import pytest
from dm_driver import Rig
from test_isa_ops import CFG, SEED, enc, get, ok, put
from test_isa_validation import CFG as VCFG
from test_isa_validation import MEM as VMEM

from hwspec import isa
from hwspec.isa import CmpOp, DType, Opcode
from hwspec.va1 import Status

NP = {DType.F32: np.float32, DType.F16: np.float16, DType.I8: np.int8, DType.I32: np.int32}
REF = {CmpOp.EQUAL: np.equal, CmpOp.LESS: np.less, CmpOp.GREATER: np.greater,
       CmpOp.LESS_EQUAL: np.less_equal, CmpOp.GREATER_EQUAL: np.greater_equal,
       CmpOp.AND: np.logical_and, CmpOp.OR: np.logical_or, CmpOp.XOR: np.logical_xor}


@pytest.fixture
def rig() -> Rig:
    return Rig(CFG)


def _data(dt: DType, shape: tuple[int, ...], seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    x = rng.integers(-3, 4, shape).astype(NP[dt])       # small ints: many ties
    if dt in (DType.F32, DType.F16):
        flat = x.reshape(-1)
        flat[:4] = [np.nan, np.inf, -np.inf, -0.0]
    return x


@pytest.mark.parametrize("op", list(CmpOp))
@pytest.mark.parametrize("dt", list(DType))
def test_compare_every_op_and_dtype(rig: Rig, op: CmpOp, dt: DType) -> None:
    a, b = _data(dt, (64,), SEED), _data(dt, (64,), SEED + 1)
    put(rig, 0, a)
    put(rig, 4096, b)
    put(rig, 8192, np.full(64, 7, np.int8))
    ok(rig, enc(Opcode.COMPARE, op=op, dtype=dt, count=64, a=0,
                b=0 if op == CmpOp.NOT else 4096, out=8192))
    ref = np.logical_not(a) if op == CmpOp.NOT else REF[op](a, b)
    assert np.array_equal(get(rig, 8192, np.int8, (64,)), ref.astype(np.int8))


def test_compare_broadcast_row_vector_in_place(rig: Rig) -> None:
    a = _data(DType.I8, (6, 5), SEED)
    b = _data(DType.I8, (5,), SEED + 2)
    put(rig, 0, a)
    put(rig, 4096, b)
    ok(rig, enc(Opcode.COMPARE, isa.CMP_BROADCAST_B, op=CmpOp.LESS, dtype=DType.I8, cols=5,
                count=30, a=0, b=4096, out=0))             # over a itself
    assert np.array_equal(get(rig, 0, np.int8, (6, 5)), (a < b).astype(np.int8))


@pytest.mark.parametrize("dt", list(DType))
def test_select_moves_the_chosen_bytes(rig: Rig, dt: DType) -> None:
    rng = np.random.default_rng(SEED)
    cond = rng.integers(-2, 3, 100).astype(np.int8)      # any nonzero is true
    a, b = _data(dt, (100,), SEED + 3), _data(dt, (100,), SEED + 4)
    if dt == DType.F32:
        b[5:8] = [-np.inf, np.nan, np.inf]                 # masked_fill(-inf) stays exact
    put(rig, 0, cond)
    put(rig, 4096, a)
    put(rig, 8192, b)
    ok(rig, enc(Opcode.SELECT, dtype=dt, count=100, cond=0, a=4096, b=8192, out=12288))
    got = get(rig, 12288, NP[dt], (100,))
    assert got.tobytes() == np.where(cond != 0, a, b).tobytes()


def test_select_in_place_and_chunked() -> None:
    """out over b (in place) with a work memory that needs many chunks."""
    from device_model import Va1Config
    rig = Rig(Va1Config(device_memory_size=8 << 20,
                        work_memory_size=1 << 20))
    n = 300_000
    rng = np.random.default_rng(SEED)
    cond = (rng.random(n) < 0.5).astype(np.int8)
    a = rng.standard_normal(n).astype(np.float32)
    b = rng.standard_normal(n).astype(np.float32)
    put(rig, 0, cond)
    put(rig, 1 << 20, a)
    put(rig, 3 << 20, b)
    ok(rig, enc(Opcode.SELECT, dtype=DType.F32, count=n, cond=0, a=1 << 20, b=3 << 20,
                out=3 << 20))
    assert np.array_equal(get(rig, 3 << 20, np.float32, (n,)), np.where(cond != 0, a, b))


def test_roofline(rig: Rig) -> None:
    ov, peak, bw = CFG.cmd_overhead_ns, CFG.peak_flops, CFG.mem_bandwidth

    def t(flops: int, nbytes: int) -> int:
        return ov + max(math.ceil(flops * 1e9 / peak), math.ceil(nbytes * 1e9 / bw))

    n = 10**5
    cases = [(enc(Opcode.COMPARE, op=CmpOp.LESS, dtype=DType.F32, count=n, a=0, b=1 << 20,
                  out=2 << 20), t(n, 9 * n)),
             (enc(Opcode.SELECT, dtype=DType.F32, count=n, cond=0, a=1 << 20, b=2 << 20,
                  out=3 << 20), t(n, 13 * n))]
    for i, (buf, expect) in enumerate(cases):
        r = ok(rig, buf, fence=i + 1)
        assert r.end_ns - r.start_ns == expect, i


def cmp_(flags: int = 0, **kw: object) -> bytes:
    f: dict[str, object] = dict(op=0, dtype=0, count=16, a=0, b=4096, out=8192)
    f.update(kw)
    return enc(Opcode.COMPARE, flags, **f)


def sel(**kw: object) -> bytes:
    f: dict[str, object] = dict(dtype=0, count=16, cond=0, a=4096, b=8192, out=12288)
    f.update(kw)
    return enc(Opcode.SELECT, **f)


M = VMEM
VALIDATION = [
    ("cmp flag", cmp_(2), Status.BAD_ARG),
    ("cmp reserved", cmp_(reserved=1), Status.BAD_ARG),
    ("cmp op", cmp_(op=9), Status.BAD_ARG),
    ("cmp cols without flag", cmp_(cols=4), Status.BAD_ARG),
    ("cmp bcast unary", cmp_(isa.CMP_BROADCAST_B, op=CmpOp.NOT, cols=4), Status.BAD_ARG),
    ("cmp dtype", cmp_(dtype=7), Status.BAD_DTYPE),
    ("cmp count 0", cmp_(count=0), Status.BAD_SHAPE),
    ("cmp bcast count % cols", cmp_(isa.CMP_BROADCAST_B, cols=5), Status.BAD_SHAPE),
    ("cmp a", cmp_(a=M - 60), Status.OUT_OF_BOUNDS),
    ("cmp b (bcast)", cmp_(isa.CMP_BROADCAST_B, cols=4, b=M - 12), Status.OUT_OF_BOUNDS),
    ("cmp b ignored by NOT", cmp_(op=CmpOp.NOT, b=2**64 - 1) + cmp_(out=M - 15),
     Status.OUT_OF_BOUNDS),
    ("cmp out is one byte an element", cmp_(dtype=3, out=M - 15), Status.OUT_OF_BOUNDS),
    ("sel flags", enc(Opcode.SELECT, 1, dtype=0, count=1), Status.BAD_ARG),
    ("sel reserved3", sel(reserved3=1), Status.BAD_ARG),
    ("sel dtype", sel(dtype=4), Status.BAD_DTYPE),
    ("sel count 0", sel(count=0), Status.BAD_SHAPE),
    ("sel cond", sel(cond=M - 15), Status.OUT_OF_BOUNDS),
    ("sel a", sel(a=M - 60), Status.OUT_OF_BOUNDS),
    ("sel b (f16)", sel(dtype=1, b=M - 30), Status.OUT_OF_BOUNDS),
    ("sel out", sel(out=M - 4), Status.OUT_OF_BOUNDS),
]


@pytest.mark.parametrize("what,buf,status", VALIDATION, ids=[c[0] for c in VALIDATION])
def test_validation_rules(what: str, buf: bytes, status: Status) -> None:
    rig = Rig(VCFG)
    cid = rig.create_context()
    r = rig.submit(cid, enc(Opcode.NOP) + buf, fence=1)
    offset = 8 + (48 if what == "cmp b ignored by NOT" else 0)
    assert (Status(r.status), r.error_offset) == (status, offset), what
