"""The runtime on the real stack: one VM, the guest driver, a VA-1 over virtio-mmio.

These check the runtime's semantics against the device model (numpy does the math
there); the fake-device tests check encodings and bookkeeping.
"""
from __future__ import annotations

import errno
from typing import Any, Callable

import numpy as np
import pytest

from guest_driver import uapi
from hwspec import isa, va1
from hwspec.isa import Opcode
from userspace_runtime import CommandBufferBuilder, Device, DeviceError, DriverError
from virtaccel.guests import mlp

import rt_stack

SEED = 20261121


def run_guest(program: Callable[[uapi.GuestOS], Any], seed: int = SEED) -> Any:
    """Boot a VM with one VA-1, run `program(os)` as its guest task, return its result."""
    return rt_stack.run_guest(program, seed, "runtime-test")


def test_mlp_demo_is_correct_on_device() -> None:
    r = run_guest(lambda os_: mlp.main(os_, seed=SEED))
    assert r["ok"] is True, r
    assert r["max_abs_error"] <= mlp.TOLERANCE
    assert r["output_checksum"] == pytest.approx(r["reference_checksum"], rel=1e-5)
    assert r["device_ns"] > r["compute_ns"] > 0
    assert r["submissions"] == 1 and r["commands"] == 10


def test_mlp_same_seed_same_result() -> None:
    a = run_guest(lambda os_: mlp.main(os_, seed=3, batch=4, sizes=(8, 16, 4)), seed=1)
    b = run_guest(lambda os_: mlp.main(os_, seed=3, batch=4, sizes=(8, 16, 4)), seed=1)
    assert a == b and a["ok"]


def test_mlp_from_pinned_inputs_matches_numpy() -> None:
    """`mlp.pin_inputs` gives pinned copies the device uploads from in one DMA each."""
    def program(os_: uapi.GuestOS) -> tuple[bool, np.ndarray]:
        inp = mlp.make_inputs(5, 4, (8, 16, 4))
        with Device(os_) as dev:
            host = mlp.pin_inputs(dev, inp)
            same = all(np.array_equal(host[k], inp[k]) and host[k] is not inp[k]
                       for k in mlp.WEIGHTS)
            ctx = dev.create_context()
            bufs = mlp.alloc_buffers(ctx, 4, (8, 16, 4))
            s = ctx.create_stream()
            for name in mlp.WEIGHTS:
                s.upload(bufs[name], host[name])
            mlp.enqueue_layers(s, bufs)
            y: np.ndarray = s.download(bufs["y"]).result()
            return same, y - mlp.reference(*(inp[k] for k in mlp.WEIGHTS))
    same, diff = run_guest(program)
    assert same
    assert float(np.abs(diff).max()) <= mlp.TOLERANCE


def test_api_semantics_match_numpy() -> None:
    rng = np.random.default_rng(SEED)
    a_h = rng.standard_normal((6, 5), dtype=np.float32)    # stored k x m: trans_a
    b_h = rng.standard_normal((4, 6), dtype=np.float32)    # stored n x k: trans_b
    c_h = rng.standard_normal((5, 4), dtype=np.float32)
    x_h = rng.standard_normal(33, dtype=np.float32).astype(np.float16)

    def program(os_: uapi.GuestOS) -> dict[str, np.ndarray]:
        with Device(os_) as dev:
            ctx = dev.create_context()
            s = ctx.create_stream(queue=1)
            a, b, c = ctx.alloc((6, 5)), ctx.alloc((4, 6)), ctx.alloc((5, 4))
            for buf, host in ((a, a_h), (b, b_h), (c, c_h)):
                s.upload(buf, host)
            s.gemm(a, b, c, alpha=0.5, beta=2.0, trans_a=True, trans_b=True)
            x, y = ctx.alloc(33, np.float16), ctx.alloc(33, np.float16)
            s.upload(x, x_h)
            s.fill(y, 1.5)
            s.elementwise("mul", x, y, y)
            s.elementwise("relu", y, None, y)
            ints = ctx.alloc(7, np.int8)
            s.fill(ints, -3)
            out = {"c": s.download(c), "y": s.download(y), "ints": s.download(ints)}
            s.synchronize()
            return {k: p.result() for k, p in out.items()}

    got = run_guest(program)
    expect_c = 0.5 * (a_h.T @ b_h.T) + 2.0 * c_h
    np.testing.assert_allclose(got["c"], expect_c, rtol=1e-5, atol=1e-5)
    expect_y = np.maximum(x_h * np.float16(1.5), np.float16(0))
    np.testing.assert_allclose(got["y"].astype(np.float32), expect_y.astype(np.float32),
                               rtol=1e-3)
    assert got["ints"].tolist() == [-3] * 7


def test_device_error_maps_to_the_enqueued_command() -> None:
    def program(os_: uapi.GuestOS) -> dict[str, Any]:
        with Device(os_) as dev:
            mem = dev.params["device_memory_size"]
            ctx = dev.create_context()
            s = ctx.create_stream()
            buf = ctx.alloc(16)
            s.upload(buf, np.zeros(16, np.float32))
            bad = CommandBufferBuilder()
            bad.nop()
            bad.gemm(dtype="f32", m=4, n=4, k=4, a=buf.addr, b=buf.addr, c=mem - 16,
                     name="gemm writing past device memory")
            s.enqueue(bad, [buf])
            with pytest.raises(DeviceError) as ei:
                s.synchronize()
            first = ei.value
            s.fill(buf, 1.0)                       # the context is faulted now
            with pytest.raises(DeviceError) as again:
                s.synchronize()
            cause = again.value.__cause__
            ctx.destroy()
            ctx2 = dev.create_context()             # another context is unaffected
            s2 = ctx2.create_stream()
            b2 = ctx2.alloc(4, np.int32)
            s2.fill(b2, 9)
            ok = s2.download(b2).result()
            return {"e": first, "again": again.value, "cause": cause, "ok": ok}

    r = run_guest(program)
    e = r["e"]
    assert e.status == va1.Status.OUT_OF_BOUNDS and e.status_name == "OUT_OF_BOUNDS"
    # after the upload's DMA_H2D and the 8-byte NOP
    assert e.error_offset == isa.command_length(Opcode.DMA_H2D) + isa.HEADER.size
    assert e.command == "gemm writing past device memory"
    assert r["again"] is e                         # sticky: the first error is the cause
    assert isinstance(r["cause"], DriverError) and r["cause"].errno == errno.ECANCELED
    assert r["ok"].tolist() == [9] * 4
