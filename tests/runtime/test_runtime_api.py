"""Device/Context/Stream/Event/Buffer over a fake device file that records ioctls."""
from __future__ import annotations

import errno
import json
from typing import Any, Callable

import numpy as np
import pytest

from guest_driver import uapi
from hwspec import isa, va1
from hwspec.isa import Activation, Opcode
from userspace_runtime import (
    ContextMismatchError,
    Device,
    DeviceError,
    DriverError,
    Event,
    UseAfterFreeError,
)
from virtaccel.guests import mlp

SEED = 1234


def ops(sub: Any) -> list[int]:
    return [c["opcode"] for c in sub.commands]


@pytest.fixture
def dev(fake_os: Any) -> Device:
    return Device(fake_os)


# -- device and context ---------------------------------------------------------------


def test_device_reads_every_param(fake_os: Any) -> None:
    dev = Device(fake_os)
    names = {k[len("PARAM_"):].lower() for k in vars(uapi) if k.startswith("PARAM_")}
    assert set(dev.params) == names
    assert dev.params["device_memory_size"] == 32 << 20
    assert dev.params.num_submit_queues == 2
    assert fake_os.file.log == ["GET_PARAM"] * len(names)
    assert dev.has_feature(va1.F_TIMESTAMP) and not dev.has_feature(va1.F_INT8)
    assert dev.supports_dtype(np.float16) and not dev.supports_dtype(np.int8)
    with pytest.raises(AttributeError, match="no device parameter 'bogus'"):
        assert dev.params.bogus is None


def test_device_open_errors_are_wrapped(fake_os: Any) -> None:
    with pytest.raises(DriverError, match="cannot open /dev/accel/accel9") as ei:
        Device(fake_os, index=9)
    assert ei.value.errno == errno.ENOENT
    assert Device(fake_os, index=3).path == "/dev/accel/accel3"


def test_context_lifecycle_frees_everything(dev: Device, fake_os: Any) -> None:
    f = fake_os.file
    ctx = dev.create_context()
    assert ctx.id in f.contexts
    bufs = [ctx.alloc((4, 4), np.float32), ctx.alloc(16, np.int8)]
    s = ctx.create_stream()
    s.upload(bufs[0], np.ones((4, 4), np.float32))
    s.synchronize()
    ctx.destroy()
    assert ctx.id not in f.contexts
    assert f.bos == {}                      # device buffers and staging all freed
    assert all(b.freed for b in bufs)
    assert f.log[-1] == "CONTEXT_DESTROY"
    with pytest.raises(UseAfterFreeError, match=f"context {ctx.id} was destroyed"):
        ctx.alloc(4)
    with pytest.raises(UseAfterFreeError, match="stream was destroyed"):
        s.upload(bufs[0], np.ones((4, 4), np.float32))


def test_device_close_destroys_contexts(fake_os: Any) -> None:
    with Device(fake_os) as dev:
        a, b = dev.create_context(), dev.create_context()
        assert a.id != b.id
    assert a.destroyed and b.destroyed and fake_os.file.closed
    assert fake_os.file.contexts == set()
    with pytest.raises(UseAfterFreeError, match="closed"):
        dev.create_context()


# -- buffers --------------------------------------------------------------------------


def test_alloc_uses_bo_device(dev: Device, fake_os: Any) -> None:
    ctx = dev.create_context()
    buf = ctx.alloc((3, 5), "float16")
    bo = fake_os.file.bos[buf.handle]
    assert bo.flags == uapi.BO_DEVICE and bo.size == 30 == buf.nbytes
    assert (buf.addr, buf.shape, buf.dtype, buf.size) == (bo.addr, (3, 5), np.float16, 15)


@pytest.mark.parametrize("shape,dtype,exc,match", [
    ((4,), np.float64, ValueError, "not a VA-1 dtype"),
    ((0, 4), np.float32, ValueError, "every dimension must be >= 1"),
    ((), np.float32, ValueError, "no elements"),
    ((2.5,), np.float32, TypeError, "not an integer"),
    ("ab", np.float32, TypeError, "shape must be"),
    ((1 << 30,), np.float32, ValueError, "exceed the device memory"),
])
def test_alloc_errors(dev: Device, shape: Any, dtype: Any, exc: type[Exception],
                      match: str) -> None:
    ctx = dev.create_context()
    with pytest.raises(exc, match=match):
        ctx.alloc(shape, dtype)


def test_alloc_driver_error_names_the_call(dev: Device, fake_os: Any) -> None:
    ctx = dev.create_context()
    fake_os.file.fail["BO_CREATE"] = errno.ENOMEM
    with pytest.raises(DriverError, match=r"BO_CREATE\(size=64, DEVICE\) on /dev/accel/accel0") \
            as ei:
        ctx.alloc(16, np.float32)
    assert ei.value.errno == errno.ENOMEM


def test_use_after_free_and_cross_context(dev: Device) -> None:
    c1, c2 = dev.create_context(), dev.create_context()
    s1 = c1.create_stream()
    other = c2.alloc(8)
    with pytest.raises(ContextMismatchError, match=f"belongs to context {c2.id}"):
        s1.fill(other, 0.0)
    mine = c1.alloc(8)
    mine.free()
    with pytest.raises(UseAfterFreeError, match="was freed"):
        s1.upload(mine, np.zeros(8, np.float32))
    with pytest.raises(UseAfterFreeError, match="already freed"):
        mine.free()
    with pytest.raises(TypeError, match="must be a Buffer"):
        s1.fill(np.zeros(8), 0.0)  # type: ignore[arg-type]
    assert s1.pending_commands == 0


def test_free_flushes_unsubmitted_users_first(dev: Device, fake_os: Any) -> None:
    ctx = dev.create_context()
    s = ctx.create_stream()
    buf = ctx.alloc(8)
    s.fill(buf, 1.0)
    buf.free()
    log = fake_os.file.log
    assert log.index("SUBMIT") < log.index("BO_FREE")
    assert buf.handle in fake_os.file.submissions[0].handles


# -- streams: transfers ------------------------------------------------------------------


def test_upload_stages_once_and_lists_handles(dev: Device, fake_os: Any) -> None:
    f = fake_os.file
    ctx = dev.create_context()
    s = ctx.create_stream(queue=1)
    x = np.random.default_rng(SEED).standard_normal((16, 8), dtype=np.float32)
    buf = ctx.alloc(x.shape, np.float32)
    s.upload(buf, x)
    x[:] = 0                                  # caller may reuse its array at once
    assert f.submissions == []                # nothing is submitted before a flush
    s.synchronize()
    (sub,) = f.submissions
    assert sub.queue == 1 and sub.context_id == ctx.id
    (c,) = sub.commands
    assert c["opcode"] == Opcode.DMA_H2D and c["dst"] == buf.addr and c["size"] == buf.nbytes
    staging = f.host(c["src"], c["size"])
    expect = np.random.default_rng(SEED).standard_normal((16, 8), dtype=np.float32)
    assert staging.view(np.float32).reshape(16, 8).tolist() == expect.tolist()
    host_handles = [h for h in sub.handles if f.bos[h].flags == uapi.BO_HOST]
    assert buf.handle in sub.handles and len(host_handles) == 1
    assert f.bos[host_handles[0]].addr <= c["src"]


def test_round_trip_and_staging_reuse(dev: Device, fake_os: Any) -> None:
    f = fake_os.file
    ctx = dev.create_context()
    s = ctx.create_stream()
    rng = np.random.default_rng(SEED)
    buf = ctx.alloc((32, 32), np.float32)
    x = rng.standard_normal((32, 32), dtype=np.float32)
    s.upload(buf, x)
    pending = s.download(buf)
    assert not pending.done() or len(f.submissions) == 1
    np.testing.assert_array_equal(pending.result(), x)
    host_bos = sum(1 for b in f.bos.values() if b.flags == uapi.BO_HOST)
    y = rng.standard_normal((32, 32), dtype=np.float32)
    s.upload(buf, y)
    out = np.empty((32, 32), np.float32)
    p2 = s.download(buf, out=out)
    s.synchronize()
    assert p2.result() is out
    np.testing.assert_array_equal(out, y)
    assert sum(1 for b in f.bos.values() if b.flags == uapi.BO_HOST) == host_bos


def test_download_result_flushes_and_waits(dev: Device, fake_os: Any) -> None:
    ctx = dev.create_context()
    s = ctx.create_stream()
    buf = ctx.alloc(10, np.int32)
    s.fill(buf, -7)
    p = s.download(buf)
    assert fake_os.file.submissions == []
    assert p.result().tolist() == [-7] * 10
    assert len(fake_os.file.submissions) == 1


@pytest.mark.parametrize("bad,exc,match", [
    (np.zeros((4, 4), np.float64), TypeError, "dtype float64 but the buffer is float32"),
    (np.zeros((16,), np.float32), ValueError, r"shape \(16,\) but the buffer is \(4, 4\)"),
    ([[0.0] * 4] * 4, TypeError, "astype"),
])
def test_upload_checks(dev: Device, bad: Any, exc: type[Exception], match: str) -> None:
    ctx = dev.create_context()
    s = ctx.create_stream()
    with pytest.raises(exc, match=match):
        s.upload(ctx.alloc((4, 4)), bad)
    assert s.pending_commands == 0


def test_download_out_checks(dev: Device) -> None:
    ctx = dev.create_context()
    s = ctx.create_stream()
    buf = ctx.alloc((4,))
    with pytest.raises(ValueError, match="out is"):
        s.download(buf, out=np.empty(5, np.float32))
    ro = np.empty(4, np.float32)
    ro.flags.writeable = False
    with pytest.raises(ValueError, match="read-only"):
        s.download(buf, out=ro)


@pytest.mark.parametrize("dtype,value,pattern", [
    (np.float32, 1.5, int.from_bytes(np.float32(1.5).tobytes(), "little")),
    (np.float16, -2.0, int.from_bytes(np.float16(-2.0).tobytes() * 2, "little")),
    (np.int8, -1, 0xFFFF_FFFF),
    (np.int32, 0x1234, 0x1234),
])
def test_fill_pattern(dev: Device, fake_os: Any, dtype: Any, value: Any, pattern: int) -> None:
    ctx = dev.create_context()
    s = ctx.create_stream()
    buf = ctx.alloc(8, dtype)
    s.fill(buf, value)
    got = s.download(buf).result()
    (fill, _d2h) = fake_os.file.submissions[0].commands
    assert fill["opcode"] == Opcode.FILL and fill["pattern"] == pattern
    assert fill["size"] == buf.nbytes and fill["dst"] == buf.addr
    assert got.tolist() == [value] * 8


def test_fill_odd_size_tail_goes_by_dma(dev: Device, fake_os: Any) -> None:
    ctx = dev.create_context()
    s = ctx.create_stream()
    buf = ctx.alloc(7, np.int8)
    s.fill(buf, 5)
    got = s.download(buf).result()
    fill, tail, _ = fake_os.file.submissions[0].commands
    assert (fill["opcode"], fill["size"]) == (Opcode.FILL, 4)
    assert (tail["opcode"], tail["dst"], tail["size"]) == (Opcode.DMA_H2D, buf.addr + 4, 3)
    assert got.tolist() == [5] * 7


@pytest.mark.parametrize("dtype,value,exc,match", [
    (np.int8, 300, ValueError, "does not fit in int8"),
    (np.int32, 1.5, ValueError, "not an integer"),
    (np.float16, 1e6, ValueError, "does not fit in float16"),
    (np.float32, "1", TypeError, "must be a number"),
])
def test_fill_value_checks(dev: Device, dtype: Any, value: Any, exc: type[Exception],
                           match: str) -> None:
    ctx = dev.create_context()
    s = ctx.create_stream()
    with pytest.raises(exc, match=match):
        s.fill(ctx.alloc(4, dtype), value)


def test_copy_d2d(dev: Device, fake_os: Any) -> None:
    ctx = dev.create_context()
    s = ctx.create_stream()
    a, b = ctx.alloc((2, 3), np.int32), ctx.alloc(6, np.int32)
    s.upload(a, np.arange(6, dtype=np.int32).reshape(2, 3))
    s.copy(b, a)
    assert s.download(b).result().tolist() == list(range(6))
    with pytest.raises(ValueError, match="dtype and element count must match"):
        s.copy(ctx.alloc(5, np.int32), a)


# -- streams: compute encodings ------------------------------------------------------------


@pytest.mark.parametrize("trans_a,trans_b", [(False, False), (True, False), (False, True)])
def test_gemm_encoding_from_shapes(dev: Device, fake_os: Any, trans_a: bool,
                                   trans_b: bool) -> None:
    ctx = dev.create_context()
    s = ctx.create_stream()
    m, n, k = 3, 5, 7
    a = ctx.alloc((k, m) if trans_a else (m, k))
    b = ctx.alloc((n, k) if trans_b else (k, n))
    c, bias = ctx.alloc((m, n)), ctx.alloc((n,))
    s.gemm(a, b, c, bias=bias, alpha=2.0, beta=0.5, trans_a=trans_a, trans_b=trans_b,
           activation="relu")
    s.synchronize()
    (sub,) = fake_os.file.submissions
    (g,) = sub.commands
    assert (g["m"], g["n"], g["k"]) == (m, n, k)
    assert (g["a"], g["b"], g["c"], g["bias"]) == (a.addr, b.addr, c.addr, bias.addr)
    assert g["flags"] & isa.GEMM_BIAS
    assert bool(g["flags"] & isa.GEMM_TRANS_A) == trans_a
    assert bool(g["flags"] & isa.GEMM_TRANS_B) == trans_b
    assert (g["activation"], g["alpha"], g["beta"]) == (Activation.RELU, 2.0, 0.5)
    assert set(sub.handles) == {a.handle, b.handle, c.handle, bias.handle}


def test_gemm_argument_errors(make_os: Callable[..., Any]) -> None:
    dev = Device(make_os(dtype_mask=0b01))  # f32 only
    ctx = dev.create_context()
    s = ctx.create_stream()
    a, b, c = ctx.alloc((2, 3)), ctx.alloc((3, 4)), ctx.alloc((2, 4))
    with pytest.raises(ValueError, match=r"inner dimensions differ: op\(a\) is 2x3 but op\(b\) "
                                         r"is 4x3"):
        s.gemm(a, b, c, trans_b=True)
    with pytest.raises(ValueError, match=r"c must be 2x4"):
        s.gemm(a, b, ctx.alloc((4, 2)))
    with pytest.raises(ValueError, match=r"bias must have shape \(4,\)"):
        s.gemm(a, b, c, bias=ctx.alloc((3,)))
    with pytest.raises(ValueError, match="must be 2-D"):
        s.gemm(ctx.alloc(6), b, c)
    with pytest.raises(TypeError, match="b is float16 but a is float32"):
        s.gemm(a, ctx.alloc((3, 4), np.float16), c)
    i32 = [ctx.alloc(x.shape, np.int32) for x in (a, b, c)]
    with pytest.raises(TypeError, match="not a compute dtype"):
        s.gemm(i32[0], i32[1], i32[2])
    f16 = [ctx.alloc(x.shape, np.float16) for x in (a, b, c)]
    with pytest.raises(TypeError, match="does not compute in float16"):
        s.gemm(f16[0], f16[1], f16[2])
    with pytest.raises(ValueError, match="activation"):
        s.gemm(a, b, c, activation="tanh")
    assert s.pending_commands == 0


def test_gemm_operand_errors_name_the_first_bad_operand(dev: Device) -> None:
    # The common case is tested at a glance; anything else takes the full checks in
    # their order (a, b, c, bias), each naming the operand.
    c1, c2 = dev.create_context(), dev.create_context()
    s = c1.create_stream()
    a, b, c = c1.alloc((2, 3)), c1.alloc((3, 4)), c1.alloc((2, 4))
    freed = c1.alloc((4,))
    freed.free()
    with pytest.raises(UseAfterFreeError, match="gemm bias: .* was freed"):
        s.gemm(a, b, c, bias=freed)
    with pytest.raises(ContextMismatchError, match=f"gemm bias: .* context {c2.id}"):
        s.gemm(a, b, c, bias=c2.alloc((4,)))
    with pytest.raises(TypeError, match="gemm bias must be a Buffer"):
        s.gemm(a, b, c, bias=np.zeros(4, np.float32))  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="bias is float16 but a is float32"):
        s.gemm(a, b, c, bias=c1.alloc((4,), np.float16))
    with pytest.raises(ContextMismatchError, match="gemm a: "):
        s.gemm(c2.alloc((2, 3)), b, c, bias=freed)
    with pytest.raises(TypeError, match="gemm c must be a Buffer"):
        s.gemm(a, b, None, bias=freed)  # type: ignore[arg-type]
    assert s.pending_commands == 0


def test_elementwise(dev: Device, fake_os: Any) -> None:
    ctx = dev.create_context()
    s = ctx.create_stream()
    a, b, out = (ctx.alloc((4, 8)) for _ in range(3))
    s.elementwise("add", a, b, out)
    s.elementwise("relu", a, None, out)
    with pytest.raises(ValueError, match="relu is unary"):
        s.elementwise("relu", a, b, out)
    with pytest.raises(ValueError, match="mul is binary"):
        s.elementwise("mul", a, None, out)
    with pytest.raises(ValueError, match=r"out has shape \(32,\)"):
        s.elementwise("mul", a, b, ctx.alloc(32))
    s.synchronize()
    add, relu = fake_os.file.submissions[0].commands
    assert (add["op"], add["count"], add["a"], add["b"], add["out"]) == (
        isa.EltOp.ADD, 32, a.addr, b.addr, out.addr)
    assert (relu["op"], relu["b"]) == (isa.EltOp.RELU, 0)


def test_queue_range(dev: Device) -> None:
    ctx = dev.create_context()
    with pytest.raises(ValueError, match=r"queue 2 does not exist: the device has 2"):
        ctx.create_stream(queue=2)


# -- submission shape -----------------------------------------------------------------


def test_split_by_max_cmdbuf_size(make_os: Callable[..., Any]) -> None:
    fos = make_os(max_cmdbuf=64)
    dev = Device(fos)
    ctx = dev.create_context()
    s = ctx.create_stream()
    bufs = [ctx.alloc(4, np.int32) for _ in range(5)]
    for i, b in enumerate(bufs):
        s.fill(b, i)
    ps = [s.download(b) for b in bufs]
    s.synchronize()
    subs = fos.file.submissions
    assert all(len(x.cmdbuf) <= 64 for x in subs)
    assert sum(len(x.commands) for x in subs) == 10
    assert [p.result()[0] for p in ps] == [0, 1, 2, 3, 4]
    assert [x.fence for x in subs] == sorted(x.fence for x in subs)


def test_split_by_buffer_count(dev: Device, fake_os: Any) -> None:
    ctx = dev.create_context()
    s = ctx.create_stream()
    bufs = [ctx.alloc(4, np.int32) for _ in range(uapi.MAX_SUBMIT_BUFFERS + 6)]
    for i, b in enumerate(bufs):
        s.fill(b, i)
    s.synchronize()
    subs = fake_os.file.submissions
    assert len(subs) == 2
    assert all(len(x.handles) <= uapi.MAX_SUBMIT_BUFFERS for x in subs)
    filled = [c["dst"] for x in subs for c in x.commands]
    assert filled == [b.addr for b in bufs]  # order is kept across the split


# -- errors from the device --------------------------------------------------------------


def test_device_error_names_the_command(dev: Device, fake_os: Any) -> None:
    ctx = dev.create_context()
    s = ctx.create_stream()
    a, b, c = ctx.alloc((2, 3)), ctx.alloc((3, 4)), ctx.alloc((2, 4))
    s.upload(a, np.zeros((2, 3), np.float32))
    s.gemm(a, b, c); line = __import__("inspect").currentframe().f_lineno  # noqa: E702
    p = s.download(c)

    def fail_gemm(f: Any, sub: Any) -> tuple[int, int]:
        off = next(x["offset"] for x in sub.commands if x["opcode"] == Opcode.GEMM)
        return va1.Status.BAD_SHAPE, off

    fake_os.file.hook = fail_gemm
    with pytest.raises(DeviceError) as ei:
        s.synchronize()
    e = ei.value
    assert e.status == va1.Status.BAD_SHAPE and e.status_name == "BAD_SHAPE"
    assert e.error_offset == isa.command_length(Opcode.DMA_H2D)
    assert e.command is not None and "gemm 2x3 @ 3x4" in e.command
    assert f"test_runtime_api.py:{line}" in e.command
    assert "BAD_SHAPE" in str(e) and f"context {ctx.id}" in str(e)
    with pytest.raises(DeviceError, match="BAD_SHAPE"):
        p.result()
    with pytest.raises(DeviceError, match="BAD_SHAPE"):  # sticky
        s.synchronize()
    assert s.error is e
    assert not s.submissions[0].ok


def test_device_error_without_offset(dev: Device, fake_os: Any) -> None:
    ctx = dev.create_context()
    s = ctx.create_stream()
    s.fill(ctx.alloc(4), 0.0)
    fake_os.file.hook = lambda f, sub: (va1.Status.CONTEXT_FAULTED, va1.NO_OFFSET)
    with pytest.raises(DeviceError, match="CONTEXT_FAULTED not tied to a command") as ei:
        s.synchronize()
    assert ei.value.error_offset is None and ei.value.command is None


def test_submit_errno_is_wrapped(dev: Device, fake_os: Any) -> None:
    ctx = dev.create_context()
    s = ctx.create_stream()
    buf = ctx.alloc(4)
    s.fill(buf, 0.0)
    p = s.download(buf)
    fake_os.file.fail["SUBMIT"] = errno.EINVAL
    with pytest.raises(DriverError, match=rf"SUBMIT\(context={ctx.id}, queue=0, 2 commands") \
            as ei:
        s.synchronize()
    assert ei.value.errno == errno.EINVAL
    with pytest.raises(DriverError):
        p.result()


# -- events and timing ------------------------------------------------------------------


def test_events_timestamps_and_query(dev: Device, fake_os: Any) -> None:
    f = fake_os.file
    f.hold = True
    ctx = dev.create_context()
    s = ctx.create_stream()
    a, b, c = ctx.alloc((4, 4)), ctx.alloc((4, 4)), ctx.alloc((4, 4))
    start = s.record_event()
    s.gemm(a, b, c)
    s.elementwise("relu", c, None, c)
    end = s.record_event()
    assert isinstance(end, Event)
    assert not end.query()            # submitted, not yet run by the held fake
    assert len(f.submissions) == 1
    with pytest.raises(TimeoutError, match="did not signal within 0 ns"):
        s.synchronize(timeout_ns=0)
    end.synchronize()
    assert end.query() and s.query()
    assert start.elapsed_ns(end) == 3 * f.CMD_NS
    (sub,) = f.submissions
    assert s.device_ns == sub.result[3] - sub.result[2] == 4 * f.CMD_NS
    ts = [x for x in sub.commands if x["opcode"] == Opcode.TIMESTAMP]
    assert len(ts) == 2 and ts[0]["addr"] + 8 == ts[1]["addr"]


def test_record_event_needs_timestamp_feature(make_os: Callable[..., Any]) -> None:
    dev = Device(make_os(features=0))
    s = dev.create_context().create_stream()
    with pytest.raises(RuntimeError, match="VA1_F_TIMESTAMP"):
        s.record_event()


def test_stream_context_manager_synchronizes(dev: Device, fake_os: Any) -> None:
    ctx = dev.create_context()
    buf = ctx.alloc(4)
    with ctx.create_stream() as s:
        s.fill(buf, 3.0)
    assert len(fake_os.file.submissions) == 1 and fake_os.file.submissions[0].result
    assert s.destroyed and s not in ctx.streams


# -- the demo workload ------------------------------------------------------------------


def test_mlp_program_shape_on_fake(fake_os: Any) -> None:
    report = mlp.main(fake_os, seed=SEED, batch=8, sizes=(16, 32, 8))
    json.dumps(report)
    f = fake_os.file
    (sub,) = f.submissions
    kinds = ops(sub)
    assert kinds.count(Opcode.DMA_H2D) == 5 and kinds.count(Opcode.DMA_D2H) == 1
    g1, g2 = (c for c in sub.commands if c["opcode"] == Opcode.GEMM)
    assert (g1["m"], g1["k"], g1["n"]) == (8, 16, 32)
    assert (g2["m"], g2["k"], g2["n"]) == (8, 32, 8)
    for g in (g1, g2):
        assert g["flags"] == isa.GEMM_BIAS and g["activation"] == Activation.RELU
        assert (g["alpha"], g["beta"]) == (1.0, 0.0)
    assert g1["c"] == g2["a"]                           # layer 2 reads layer 1's output
    # the fake does no compute, so the device output is zeros and the check must fail
    assert report["ok"] is False and report["max_abs_error"] > 1e-4
    assert report["output_checksum"] == 0.0
    assert report["device_ns"] == sub.result[3] - sub.result[2]
    assert report["output_shape"] == [8, 8] and report["seed"] == SEED
    assert f.contexts == set() and f.bos == {} and f.closed


def test_mlp_inputs_are_seeded() -> None:
    a = mlp.make_inputs(7, 4, (8, 16, 4))
    b = mlp.make_inputs(7, 4, (8, 16, 4))
    c = mlp.make_inputs(8, 4, (8, 16, 4))
    assert all(np.array_equal(a[k], b[k]) for k in a)
    assert not np.array_equal(a["x"], c["x"])
    assert all(v.dtype == np.float32 for v in a.values())
    ref = mlp.reference(a["x"], a["w1"], a["b1"], a["w2"], a["b2"])
    assert ref.shape == (4, 4) and (ref >= 0).all()


# -- staging reuse and safety ----------------------------------------------------------------


def test_staging_not_overwritten_while_in_flight(dev: Device, fake_os: Any) -> None:
    f = fake_os.file
    f.hold = True
    ctx = dev.create_context()
    s = ctx.create_stream()
    n = 65536                                  # 256 KiB per upload
    buf = ctx.alloc(n, np.int32)
    s.upload(buf, np.full(n, 1, np.int32))
    s.flush()
    src_a = f.submissions[0].commands[0]["src"]
    for i in range(2, 14):                     # 3 MiB: more than a staging block
        s.upload(buf, np.full(n, i, np.int32))
        s.flush()
    assert all(r is None for r in (x.result for x in f.submissions))
    assert (f.host(src_a, 4 * n).view(np.int32) == 1).all()
    srcs = [x.commands[0]["src"] for x in f.submissions]
    assert len(set(srcs)) == len(srcs)         # no region handed out twice while busy
    s.synchronize()
    assert (s.download(buf).result() == 13).all()


def test_async_loop_reuses_completed_staging(dev: Device, fake_os: Any) -> None:
    f = fake_os.file
    ctx = dev.create_context()
    s = ctx.create_stream()
    buf = ctx.alloc(150_000, np.float32)        # 600 KB: two do not fit in one block
    x = np.arange(150_000, dtype=np.float32)
    for _ in range(50):
        s.upload(buf, x)
        s.flush()                              # never synchronized inside the loop
    host = [b for b in f.bos.values() if b.flags == uapi.BO_HOST]
    assert len(host) <= 3
    s.synchronize()
    assert len(s.submissions) == 50 and all(r.ok for r in s.submissions)


def test_optional_params_may_be_missing(fake_os: Any) -> None:
    f = fake_os.open("/dev/accel/accel0")
    del f.param_values[uapi.PARAM_MAX_CALL_DEPTH]
    dev = Device(fake_os)
    assert "max_call_depth" not in dev.params and dev.params["max_contexts"] == 64
    del f.param_values[uapi.PARAM_MAX_CMDBUF_SIZE]
    with pytest.raises(DriverError, match=r"GET_PARAM\(max_cmdbuf_size\)"):
        Device(fake_os)
    assert f.closed


def test_stats(dev: Device, fake_os: Any) -> None:
    ctx = dev.create_context()
    s = ctx.create_stream()
    s.fill(ctx.alloc(4), 1.0)
    s.fill(ctx.alloc(4), 2.0)
    s.synchronize()
    st = dev.stats()
    assert st["submissions"] == 1 and st["commands"] == 2
    assert set(st) == {"submissions", "commands", "device_time_ns", "dma_bytes", "faults",
                       "interrupts", "lost_interrupts", "polled_completions",
                       "watchdog_fires", "resets"}


def test_gemm_scalar_errors_leave_stream_untouched(dev: Device) -> None:
    ctx = dev.create_context()
    s = ctx.create_stream()
    a, b, c = ctx.alloc((2, 2)), ctx.alloc((2, 2)), ctx.alloc((2, 2))
    with pytest.raises(ValueError, match="gemm alpha"):
        s.gemm(a, b, c, alpha=float("inf"))
    with pytest.raises(TypeError, match="gemm beta"):
        s.gemm(a, b, c, beta=None)  # type: ignore[arg-type]
    assert s.pending_commands == 0
    s.gemm(a, b, c, beta=1.0)
    assert "beta=1" in s.disassemble() and "gemm 2x2 @ 2x2" in s.disassemble()
