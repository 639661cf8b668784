"""The device model's fast paths do exactly what the general paths do.

- decode: runs of NOPs are built without the per-command checker;
- engine: GEMM with an f32 bias (and NONE/RELU) runs its epilogue in place in C;
- engine: runs of NOPs are stepped in a tight loop; work is applied up to the clock's
  horizon (horizon_ns) when the clock has one.
"""
from __future__ import annotations

import struct

import numpy as np
import pytest
from dm_driver import Rig, d2h, gemm, h2d, nop, signal

from device_model import Va1Config
from device_model.va1 import commands as C
from device_model.va1.ops import kernels
from device_model.va1.memory import DeviceMemory
from hwspec.isa import Activation, Opcode
from hwspec.va1 import Status


def _env() -> C.DecodeEnv:
    return C.DecodeEnv(config=Va1Config(device_memory_size=1 << 16),
                       memory=DeviceMemory(1 << 16), dma=None,  # type: ignore[arg-type]
                       fp16=True, timestamp=True)


def _slow_nop(env: C.DecodeEnv, offset: int) -> C.Command:
    out: list[C.Command] = []
    C.resolve(C._Checker(env, offset), Opcode.NOP, 0, (), out)
    (cmd,) = out
    return cmd


def test_nop_runs_decode_like_the_general_path() -> None:
    env = _env()
    buf = nop() + nop(16) + nop() + nop(64)
    got = C.decode(buf, env)
    assert got == [_slow_nop(env, off) for off in (0, 8, 24, 32)]
    assert all(type(c) is C.Command for c in got)


def test_long_nop_runs_decode_like_the_general_path() -> None:
    """Runs longer than the shared block and the cache (offsets past 64 KiB) included."""
    env = _env()
    n = 9000
    buf = nop() * n + nop(16) + nop() * 5 + struct.pack("<HHI", 0, 1, 8)
    with pytest.raises(C.CommandError) as ei:
        C.decode(buf, env)
    assert ei.value.offset == 8 * n + 16 + 40
    buf = buf[:-8]
    offsets = [8 * i for i in range(n)] + [8 * n] + [8 * n + 16 + 8 * i for i in range(5)]
    for _ in range(2):
        assert C.decode(buf, env) == [_slow_nop(env, off) for off in offsets]


class _Host:
    """A DMA port over one bytes object at IOVA 0 (for CALL)."""

    def __init__(self, data: bytes) -> None:
        self.data = data

    def view(self, iova: int, size: int) -> memoryview:
        return memoryview(self.data)[iova:iova + size]

    def read(self, iova: int, size: int) -> bytes:
        return self.data[iova:iova + size]


def test_callee_nops_do_not_change_the_nops_of_other_buffers() -> None:
    """A callee's commands get the CALL's offset and a path: as copies, so the NOPs a
    plain buffer decodes to (shared between decodes) keep their own offsets."""
    callee = nop() * 3
    env = C.DecodeEnv(config=Va1Config(device_memory_size=1 << 16),
                      memory=DeviceMemory(1 << 16), dma=_Host(callee),  # type: ignore[arg-type]
                      fp16=True, timestamp=True)
    plain = C.decode(nop() * 4, env)
    call = struct.pack("<HHIQII", int(Opcode.CALL), 0, 24, 0, len(callee), 0)
    got = C.decode(nop() + call, env)
    assert [(c.opcode, c.offset, c.path) for c in got] == [
        (Opcode.NOP, 0, ()), (Opcode.CALL, 8, ()),
        (Opcode.NOP, 8, (0,)), (Opcode.NOP, 8, (8,)), (Opcode.NOP, 8, (16,))]
    assert plain == C.decode(nop() * 4, env) == [_slow_nop(env, 8 * i) for i in range(4)]


@pytest.mark.parametrize("buf,status,offset", [
    (nop() + struct.pack("<HHI", 0, 1, 8), Status.BAD_ARG, 8),        # NOP with flags
    (nop() + struct.pack("<HHI", 0, 0, 12) + bytes(4), Status.BAD_LENGTH, 8),  # unaligned
    (nop() + struct.pack("<HHI", 0, 0, 4), Status.BAD_LENGTH, 8),     # shorter than a header
    (nop() + struct.pack("<HHI", 0, 0, 32), Status.TRUNCATED, 8),     # past the end
    (nop() + bytes(4), Status.TRUNCATED, 8),                           # no room for a header
])
def test_bad_nops_still_fail_through_the_general_path(buf: bytes, status: Status,
                                                      offset: int) -> None:
    with pytest.raises(C.CommandError) as ei:
        C.decode(buf, _env())
    assert (ei.value.status, ei.value.offset) == (status, offset)


def _reference(a: np.ndarray, b: np.ndarray, bias: np.ndarray | None, act: int) -> np.ndarray:
    t: np.ndarray = np.matmul(a, b)
    if bias is not None:
        t += bias
    if act == Activation.RELU:
        np.maximum(t, 0, out=t)
    return t


@pytest.mark.parametrize("act", [Activation.NONE, Activation.RELU])
@pytest.mark.parametrize("with_bias", [False, True])
def test_gemm_in_place_epilogue_is_bit_exact(act: int, with_bias: bool) -> None:
    rng = np.random.default_rng(5)
    a = rng.standard_normal((17, 33), dtype=np.float32)
    b = rng.standard_normal((33, 9), dtype=np.float32)
    bias = rng.standard_normal(9, dtype=np.float32) if with_bias else None
    c = np.full((17, 9), np.nan, np.float32)
    kernels.gemm(a, b, c, bias, alpha=1.0, beta=0.0, activation=act, budget=1 << 20)
    np.testing.assert_array_equal(c, _reference(a, b, bias, act))


def test_gemm_bias_aliasing_the_output_takes_the_general_path() -> None:
    rng = np.random.default_rng(6)
    a = rng.standard_normal((4, 3), dtype=np.float32)
    b = rng.standard_normal((3, 4), dtype=np.float32)
    c = rng.standard_normal((4, 4), dtype=np.float32)
    bias = c[0]  # the bias is the output's first row: read before the output is written
    want = _reference(a, b, bias.copy(), Activation.RELU)
    kernels.gemm(a, b, c, bias, alpha=1.0, beta=0.0, activation=Activation.RELU,
                 budget=1 << 20)
    np.testing.assert_array_equal(c, want)


def test_gemm_bias_on_the_device_matches_numpy() -> None:
    rig = Rig()
    cid = rig.create_context()
    rng = np.random.default_rng(7)
    A = rng.standard_normal((8, 16), dtype=np.float32)
    B = rng.standard_normal((16, 4), dtype=np.float32)
    bias = rng.standard_normal(4, dtype=np.float32)
    rig.dev.memory.write(0, A.tobytes())
    rig.dev.memory.write(1024, B.tobytes())
    rig.dev.memory.write(4096, bias.tobytes())
    r = rig.submit(cid, gemm(8, 4, 16, 0, 1024, 2048, bias=4096, act=1, flags=4))
    assert r.status == Status.OK
    got = np.frombuffer(rig.dev.memory.read(2048, 8 * 4 * 4), "<f4").reshape(8, 4)
    np.testing.assert_array_equal(got, _reference(A, B, bias, Activation.RELU))


def test_nop_run_trace_and_times_match_one_command_at_a_time() -> None:
    """A run of NOPs followed by other commands: every NOP gets its `cmd` event with
    back-to-back virtual times, the counters add up, and a SIGNAL after the run lands."""
    rig = Rig()
    cid = rig.create_context()
    addr = rig.put(bytes(8))
    buf = nop() * 5 + nop(24) + signal(addr, 7) + nop()
    r = rig.submit(cid, buf)
    assert r.status == Status.OK
    cmds = rig.tracer.kinds("cmd")[-8:]
    assert [c["opcode"] for c in cmds] == ["NOP"] * 6 + ["SIGNAL", "NOP"]
    assert [c["offset"] for c in cmds] == [0, 8, 16, 24, 32, 40, 64, 88]
    for prev, nxt in zip(cmds, cmds[1:]):
        assert nxt["start_ns"] == prev["end_ns"]
    assert cmds[0]["start_ns"] == r.start_ns and cmds[-1]["end_ns"] == r.end_ns
    assert r.end_ns - r.start_ns == 8 * Va1Config().cmd_overhead_ns
    assert int.from_bytes(rig.dma.g_read(addr, 8), "little") == 7


def test_big_last_command_is_applied_at_its_end_with_the_completion() -> None:
    """Early application still covers the small commands before it; the big last one
    lands at its end time, together with the completion; virtual times are the same."""
    from dm_driver import fill, h2d
    rig = Rig()
    cid = rig.create_context()
    size = 1 << 20  # 1 MiB over the host link: well above 10 us of virtual time
    src = rig.put(bytes([7]) * size)
    rig.clock.schedule(10**12, lambda: None, "far")
    resp = rig.submit_nowait(cid, fill(0, 4, 5) + h2d(src, 4096, size))
    rig.kick()
    assert rig.dev.memory.read(0, 4) == struct.pack("<I", 5)  # the small one: applied
    assert rig.dev.memory.read(4096, 4) == bytes(4)           # the big one: not yet
    assert rig.queues[2].used_idx() == 0
    rig.clock.run(until=10**9)
    r = rig.resp(resp)
    assert r.status == 0 and rig.queues[2].used_idx() == 1
    assert rig.dev.memory.read(4096, size) == bytes([7]) * size
    cfg = Va1Config()
    link = -(-size * 10**9 // cfg.link_bandwidth)
    mem = -(-4 * 10**9 // cfg.mem_bandwidth)
    assert r.end_ns - r.start_ns == 2 * cfg.cmd_overhead_ns + link + mem


def _ctx_env(aspace: object, cache: C.ResolveCache, fp16: bool = True,
             memory: DeviceMemory | None = None) -> C.DecodeEnv:
    return C.DecodeEnv(config=_CFG, memory=memory or _MEM, dma=None,  # type: ignore[arg-type]
                       fp16=fp16, timestamp=True, aspace=aspace,  # type: ignore[arg-type]
                       cache=cache)


_MEM = DeviceMemory(1 << 16)
_CFG = Va1Config(device_memory_size=1 << 16)


def test_resolve_cache_serves_the_same_bytes_and_forgets_on_a_mapping_change() -> None:
    """A context's resolved device-only commands are reused for the same bytes at the
    same offset, and dropped when its mappings change: the same GEMM then fails."""
    from device_model.va1.aspace import AddressSpace
    from hwspec import va1
    aspace = AddressSpace()
    rw = va1.CTX_MAP_READ | va1.CTX_MAP_WRITE
    assert aspace.map(0x10000, 0, 0x4000, rw, 1 << 16) == Status.OK
    cache = C.ResolveCache()
    buf = nop() + gemm(4, 4, 4, 0x10000, 0x10100, 0x10200, act=int(Activation.RELU))
    first = C.decode(buf, _ctx_env(aspace, cache))
    again = C.decode(buf, _ctx_env(aspace, cache))
    assert again[1] is first[1] and len(cache) == 1
    uncached = C.decode(buf, C.DecodeEnv(*_ctx_env(aspace, cache)[:7]))
    assert uncached[1] is not first[1]
    assert (uncached[1].cost_ns, uncached[1].extra) == (first[1].cost_ns, first[1].extra)
    # other bytes at the same offset, or the same bytes at another offset: resolved anew
    other = C.decode(nop() + gemm(4, 4, 2, 0x10000, 0x10100, 0x10200), _ctx_env(aspace, cache))
    moved = C.decode(nop() * 2 + buf[8:], _ctx_env(aspace, cache))
    assert other[1].extra["k"] == 2 and moved[2].offset == 16 and len(cache) == 3
    # unmap: the same bytes no longer resolve
    assert aspace.unmap(0x10000, 0x4000) == Status.OK
    with pytest.raises(C.CommandError) as ei:
        C.decode(buf, _ctx_env(aspace, cache))
    assert (ei.value.status, ei.value.offset) == (Status.OUT_OF_BOUNDS, 8)
    assert len(cache) == 0
    # mapped again read-only: C is written, so the GEMM fails (not the stale entry)
    assert aspace.map(0x10000, 0, 0x4000, va1.CTX_MAP_READ, 1 << 16) == Status.OK
    with pytest.raises(C.CommandError) as ei:
        C.decode(buf, _ctx_env(aspace, cache))
    assert ei.value.status == Status.OUT_OF_BOUNDS and "writable" in ei.value.message


def test_resolve_cache_forgets_on_other_features_or_memory() -> None:
    """Negotiated features and device memory are part of what a command resolves from:
    an F16 GEMM cached with VA1_F_FP16 fails once it is not negotiated."""
    from hwspec.isa import DType
    cache = C.ResolveCache()
    buf = gemm(2, 2, 2, 0, 0x100, 0x200, dtype=int(DType.F16))
    first = C.decode(buf, _ctx_env(None, cache))
    with pytest.raises(C.CommandError) as ei:
        C.decode(buf, _ctx_env(None, cache, fp16=False))
    assert ei.value.status == Status.BAD_DTYPE
    other = DeviceMemory(1 << 16)
    got = C.decode(buf, _ctx_env(None, cache, memory=other))
    assert got[0] is not first[0] and np.shares_memory(got[0].c, other.data)
    assert C.decode(buf, _ctx_env(None, cache, memory=other))[0] is got[0]
    # another config object (a VF reconfigured): resolved anew
    env = _ctx_env(None, cache, memory=other)._replace(
        config=Va1Config(device_memory_size=1 << 16))
    assert C.decode(buf, env)[0] is not got[0]


class _Window:
    """A DMA port that maps IOVAs [0, limit): a narrower limit is an IOMMU unmap."""

    def __init__(self, limit: int) -> None:
        self.limit = limit

    def view(self, iova: int, size: int) -> np.ndarray:
        from device_model.ports import DmaFault
        if iova + size > self.limit:
            raise DmaFault(iova, size, False, "not mapped")
        return np.zeros(size, np.uint8)


def test_kept_dmas_check_their_host_range_on_every_use() -> None:
    """DMAs are kept resolved for their device side only: a host range unmapped since
    fails the same bytes DMA_FAULT, at the same offset, as a fresh decode does."""
    cache = C.ResolveCache()
    port = _Window(0x2000)
    env = _ctx_env(None, cache)._replace(dma=port)
    buf = nop() + h2d(0x1000, 0x100, 0x100) + d2h(0x100, 0x1800, 0x100)
    first = C.decode(buf, env)
    assert C.decode(buf, env)[1:] == first[1:] and C.decode(buf, env)[1] is first[1]
    port.limit = 0x1880
    for e in (env, env._replace(cache=None)):
        with pytest.raises(C.CommandError) as ei:
            C.decode(buf, e)
        assert (ei.value.status, ei.value.offset) == (Status.DMA_FAULT, 40)
    port.limit = 0x1000
    with pytest.raises(C.CommandError) as ei:
        C.decode(buf, env)
    assert (ei.value.status, ei.value.offset) == (Status.DMA_FAULT, 8)
    assert "src" in ei.value.message


def test_a_kept_buffer_is_served_whole_with_its_host_rechecks() -> None:
    """A buffer of kept commands and NOPs is served whole the second time (the same
    Commands in a fresh list) and still rechecks its DMAs' host ranges; a buffer with a
    command that is never kept (SIGNAL) is not kept whole."""
    cache = C.ResolveCache()
    port = _Window(0x2000)
    env = _ctx_env(None, cache)._replace(dma=port)
    buf = nop() + h2d(0x1000, 0x100, 0x100) + gemm(4, 4, 4, 0, 0x100, 0x200)
    first = C.decode(buf, env)
    assert cache.lookup(env, buf)[1] is not None
    again = C.decode(buf, env)
    assert again is not first and all(a is b for a, b in zip(again, first))
    # a longer buffer whose commands were kept one by one owes the same recheck
    longer = buf + nop()
    C.decode(longer, env)
    kept = cache.lookup(env, longer)[1]
    assert kept is not None and [c for c, _ in kept.rechecks] == [first[1]]
    port.limit = 0x1080
    for b in (buf, longer):
        with pytest.raises(C.CommandError) as ei:
            C.decode(b, env)
        assert (ei.value.status, ei.value.offset) == (Status.DMA_FAULT, 8)
    with_signal = buf + signal(0x1800, 1)
    port.limit = 0x2000
    C.decode(with_signal, env)
    assert cache.lookup(env, with_signal)[1] is None
    port.limit = 0x1800
    with pytest.raises(C.CommandError) as ei:
        C.decode(with_signal, env)
    assert (ei.value.status, ei.value.offset) == (Status.DMA_FAULT, len(buf))
