"""GEMM_BATCHED (spec §7): every batch's C_i = act(alpha op(A_i) op(B_i) + beta C_i + bias)
with per-operand batch strides and leading dimensions, against numpy; equal bit for bit
to one GEMM per batch; transposed, shared (stride 0) and strided operands read in place;
its validation rules and its roofline time."""
from __future__ import annotations

import math

import numpy as np
import pytest
from dm_driver import Rig
from test_isa_ops import CFG, NPDT, SEED, close, enc, get, ok, put
from test_isa_validation import CFG as VCFG
from test_isa_validation import MEM as VMEM

from hwspec import isa
from hwspec.isa import Activation, Opcode
from hwspec.va1 import Status


@pytest.fixture
def rig() -> Rig:
    return Rig(CFG)


def bgemm(flags: int = 0, **kw: object) -> bytes:
    f: dict[str, object] = dict(dtype=0, batch=2, m=3, n=4, k=5, a=0, b=4096, c=8192,
                                lda=5, ldb=4, ldc=4, stride_a=15, stride_b=20, stride_c=12,
                                alpha=1.0, beta=0.0)
    f.update(kw)
    return enc(Opcode.GEMM_BATCHED, flags, **f)


def act_ref(t: np.ndarray, act: int) -> np.ndarray:
    if act == Activation.RELU:
        return np.maximum(t, 0)
    if act == Activation.SIGMOID:
        return 1 / (1 + np.exp(-t))
    return t


@pytest.mark.parametrize("dtype", [0, 1])
@pytest.mark.parametrize("trans_a,trans_b", [(False, False), (False, True), (True, False),
                                             (True, True)])
def test_dense_batches_match_numpy(rig: Rig, dtype: int, trans_a: bool, trans_b: bool
                                   ) -> None:
    bt, m, n, k = 6, 5, 7, 4
    rng = np.random.default_rng(SEED)
    a = rng.standard_normal((bt, m, k)).astype(NPDT[dtype])
    b = rng.standard_normal((bt, k, n)).astype(NPDT[dtype])
    sa = np.ascontiguousarray(a.transpose(0, 2, 1)) if trans_a else a
    sb = np.ascontiguousarray(b.transpose(0, 2, 1)) if trans_b else b
    put(rig, 0, sa)
    put(rig, 4096, sb)
    flags = (isa.GEMM_TRANS_A if trans_a else 0) | (isa.GEMM_TRANS_B if trans_b else 0)
    ok(rig, bgemm(flags, dtype=dtype, batch=bt, m=m, n=n, k=k,
                  lda=m if trans_a else k, ldb=k if trans_b else n, ldc=n,
                  stride_a=m * k, stride_b=k * n, stride_c=m * n))
    close(get(rig, 8192, NPDT[dtype], (bt, m, n)),
          a.astype(np.float64) @ b.astype(np.float64), dtype)


def test_strided_views_shared_b_bias_alpha_beta_activation(rig: Rig) -> None:
    """A read as a transposed head view of a [S, H, D] tensor (attention's q), B shared
    by every batch (stride 0), C written into every other row of a wider buffer."""
    rng = np.random.default_rng(SEED + 1)
    s, h, d, n = 6, 3, 4, 5
    q = rng.standard_normal((s, h, d)).astype(np.float32)     # A_i = q[:, i, :] (s x d)
    w = rng.standard_normal((d, n)).astype(np.float32)
    bias = rng.standard_normal(n).astype(np.float32)
    c0 = rng.standard_normal((h, s, 2 * n)).astype(np.float32)
    put(rig, 0, q)
    put(rig, 4096, w)
    put(rig, 8192, c0)
    put(rig, 12288, bias)
    ok(rig, bgemm(isa.GEMM_BIAS, batch=h, m=s, n=n, k=d, lda=h * d, stride_a=d, ldb=n,
                  stride_b=0, ldc=2 * n, stride_c=s * 2 * n, bias=12288, alpha=0.5,
                  beta=2.0, activation=Activation.SIGMOID))
    t = 0.5 * np.einsum("shd,dn->hsn", q.astype(np.float64), w) + 2.0 * c0[:, :, :n] + bias
    got = get(rig, 8192, np.float32, (h, s, 2 * n))
    np.testing.assert_allclose(got[:, :, :n], act_ref(t, Activation.SIGMOID), rtol=1e-5,
                               atol=1e-6)
    assert np.array_equal(got[:, :, n:], c0[:, :, n:])        # the gaps are untouched


def test_equal_bit_for_bit_to_one_gemm_per_batch(rig: Rig) -> None:
    rng = np.random.default_rng(SEED + 2)
    bt, m, n, k = 4, 9, 11, 13
    a = rng.standard_normal((bt, m, k)).astype(np.float32)
    b = rng.standard_normal((bt, n, k)).astype(np.float32)
    put(rig, 0, a)
    put(rig, 1 << 16, b)
    buf = b"".join(enc(Opcode.GEMM, isa.GEMM_TRANS_B, dtype=0, activation=Activation.RELU,
                       m=m, n=n, k=k, a=i * m * k * 4, b=(1 << 16) + i * n * k * 4,
                       c=(2 << 16) + i * m * n * 4, alpha=1.5, beta=0.0)
                   for i in range(bt))
    ok(rig, buf + bgemm(isa.GEMM_TRANS_B, batch=bt, m=m, n=n, k=k, a=0, b=1 << 16,
                        c=3 << 16, lda=k, ldb=k, ldc=n, stride_a=m * k, stride_b=n * k,
                        stride_c=m * n, alpha=1.5, activation=Activation.RELU))
    assert get(rig, 2 << 16, np.float32, (bt, m, n)).tobytes() == \
        get(rig, 3 << 16, np.float32, (bt, m, n)).tobytes()


def test_int8_batches_exact_with_accumulate(rig: Rig) -> None:
    rng = np.random.default_rng(SEED + 3)
    bt, m, n, k = 3, 4, 5, 6
    a = rng.integers(-128, 128, (bt, m, k)).astype(np.int8)
    b = rng.integers(-128, 128, (bt, k, n)).astype(np.int8)
    c = rng.integers(-1000, 1000, (bt, m, n)).astype(np.int32)
    put(rig, 0, a)
    put(rig, 4096, b)
    put(rig, 8192, c)
    ok(rig, bgemm(dtype=2, batch=bt, m=m, n=n, k=k, lda=k, ldb=n, ldc=n, stride_a=m * k,
                  stride_b=k * n, stride_c=m * n, beta=1.0, activation=Activation.RELU))
    ref = np.maximum(a.astype(np.int64) @ b.astype(np.int64) + c, 0)
    assert np.array_equal(get(rig, 8192, np.int32, (bt, m, n)), ref)


def test_c_overlapping_a_is_staged(rig: Rig) -> None:
    """C written over A (in place for batch 0, overlapping the others): A is read first."""
    rng = np.random.default_rng(SEED + 4)
    bt, m = 3, 4
    a = rng.standard_normal((bt, m, m)).astype(np.float32)
    b = rng.standard_normal((bt, m, m)).astype(np.float32)
    put(rig, 0, a)
    put(rig, 4096, b)
    ok(rig, bgemm(batch=bt, m=m, n=m, k=m, a=0, c=0, lda=m, ldb=m, ldc=m, stride_a=m * m,
                  stride_b=m * m, stride_c=m * m))
    np.testing.assert_allclose(get(rig, 0, np.float32, (bt, m, m)), a @ b, rtol=1e-5,
                               atol=1e-6)


def test_roofline_counts_a_shared_operand_once(rig: Rig) -> None:
    ov, peak, bw = CFG.cmd_overhead_ns, CFG.peak_flops, CFG.mem_bandwidth

    def t(flops: int, nbytes: int) -> int:
        return ov + max(math.ceil(flops * 1e9 / peak), math.ceil(nbytes * 1e9 / bw))

    bt, m, n, k = 8, 64, 64, 64
    cases = [
        (bgemm(batch=bt, m=m, n=n, k=k, a=0, b=1 << 20, c=2 << 20, lda=k, ldb=n, ldc=n,
               stride_a=m * k, stride_b=k * n, stride_c=m * n),
         t(2 * bt * m * n * k, 4 * bt * (m * k + k * n + m * n))),
        (bgemm(batch=bt, m=m, n=n, k=k, a=0, b=1 << 20, c=2 << 20, lda=k, ldb=n, ldc=n,
               stride_a=m * k, stride_b=0, stride_c=m * n, beta=1.0),
         t(2 * bt * m * n * k, 4 * (bt * m * k + k * n + 2 * bt * m * n))),
    ]
    for i, (buf, expect) in enumerate(cases):
        r = ok(rig, buf, fence=i + 1)
        assert r.end_ns - r.start_ns == expect, i


M = VMEM
VALIDATION = [
    ("flags", bgemm(8), Status.BAD_ARG),
    ("reserved", bgemm(reserved=1), Status.BAD_ARG),
    ("reserved2", bgemm(reserved2=1), Status.BAD_ARG),
    ("activation", bgemm(activation=5), Status.BAD_ARG),
    ("i8 alpha", bgemm(dtype=2, alpha=2.0), Status.BAD_ARG),
    ("i8 gelu", bgemm(dtype=2, activation=Activation.GELU), Status.BAD_ARG),
    ("i32", bgemm(dtype=3), Status.BAD_DTYPE),
    ("unknown dtype", bgemm(dtype=7), Status.BAD_DTYPE),
    ("batch 0", bgemm(batch=0), Status.BAD_SHAPE),
    ("k 0", bgemm(k=0), Status.BAD_SHAPE),
    ("batch > 65535", bgemm(batch=isa.GEMM_BATCHED_MAX_BATCH + 1, stride_a=0,
                            stride_b=0), Status.BAD_SHAPE),
    ("C rows overlap", bgemm(ldc=3), Status.BAD_SHAPE),
    ("C batches overlap", bgemm(stride_c=4), Status.BAD_SHAPE),
    ("C batch stride 0", bgemm(stride_c=0), Status.BAD_SHAPE),
    ("A extent overflows", bgemm(lda=2**62), Status.BAD_SHAPE),
    ("A past the end", bgemm(a=M - 4 * (15 + 14) + 4), Status.OUT_OF_BOUNDS),
    ("A strided past the end", bgemm(stride_a=M // 4), Status.OUT_OF_BOUNDS),
    ("B (trans) past the end", bgemm(isa.GEMM_TRANS_B, ldb=5, b=M - 4 * (20 + 19) + 4),
     Status.OUT_OF_BOUNDS),
    ("C past the end", bgemm(c=M - 4 * 24 + 4), Status.OUT_OF_BOUNDS),
    ("bias", bgemm(isa.GEMM_BIAS, bias=M - 12), Status.OUT_OF_BOUNDS),
    ("huge C past the end", bgemm(batch=65535, m=65535, n=65535, k=65535, stride_a=0, stride_b=0,
                         lda=0, ldb=0, ldc=65535, stride_c=65535 * 65535, c=0),
     Status.OUT_OF_BOUNDS),
]


@pytest.mark.parametrize("what,buf,status", VALIDATION, ids=[c[0] for c in VALIDATION])
def test_validation_rules(what: str, buf: bytes, status: Status) -> None:
    rig = Rig(VCFG)
    cid = rig.create_context()
    r = rig.submit(cid, enc(Opcode.NOP) + buf, fence=1)
    assert (Status(r.status), r.error_offset) == (status, 8), what


def test_work_flops_rule() -> None:
    rig = Rig(VCFG)
    cid = rig.create_context()
    # shared A and B rows, a 2-element C per batch: in bounds, but 2^34 flops
    r = rig.submit(cid, bgemm(batch=65535, m=2, n=1, k=2**16, a=0, b=0, c=0, lda=0,
                              ldb=0, ldc=1, stride_a=0, stride_b=0, stride_c=2), fence=1)
    assert (Status(r.status), r.error_offset) == (Status.WORK_LIMIT, 0)
    assert "work/flops" in str(rig.tracer.kinds("cmd_invalid")[-1]["message"])
