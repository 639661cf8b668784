"""Property tests (hypothesis, derandomized): random command buffers and garbage rings
never make the device raise, and it never writes guest memory it was not pointed at."""
from __future__ import annotations

import struct

import numpy as np
from dm_driver import Rig, d2d, d2h, eltwise, fill, gemm, h2d, hdr, nop, signal, timestamp
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from device_model import Va1Config
from hwspec.va1 import Status

MEM = 64 * 1024
CFG = Va1Config(device_memory_size=MEM, max_cmdbuf_size=4096)
FUZZ = settings(derandomize=True, database=None, max_examples=150, deadline=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])

U64 = 1 << 64
dev_addr = st.one_of(st.integers(0, MEM), st.sampled_from([MEM - 4, MEM - 1, U64 - 4, 1 << 32]),
                     st.integers(0, U64 - 1))
size = st.one_of(st.integers(0, 512), st.sampled_from([4, 8, 1 << 32, U64 - 1]))
dim = st.one_of(st.integers(0, 9), st.sampled_from([2**32 - 1, 1 << 16]))


def host_addr(scratch: int) -> st.SearchStrategy[int]:
    # only the scratch window, or addresses that are not guest RAM at all
    return st.one_of(st.integers(scratch, scratch + 512), st.integers(0, 0x3FFF_FFFF),
                     st.sampled_from([U64 - 8, U64 - 1]))


def command(scratch: int) -> st.SearchStrategy[bytes]:
    h = host_addr(scratch)
    return st.one_of(
        st.builds(nop, st.sampled_from([8, 16, 24])),
        st.builds(fill, dev_addr, size, st.integers(0, 2**32 - 1), st.sampled_from([0, 0, 1])),
        st.builds(h2d, h, dev_addr, size),
        st.builds(d2h, dev_addr, h, st.integers(0, 512)),
        st.builds(d2d, dev_addr, dev_addr, size),
        st.builds(lambda m, n, k, a, b, c, bias, al, be, dt, act, fl: gemm(
            m, n, k, a, b, c, bias, al, be, dt, act, fl),
            dim, dim, dim, dev_addr, dev_addr, dev_addr, dev_addr,
            st.floats(-2, 2, width=32), st.sampled_from([0.0, 1.0, float("nan")]),
            st.integers(0, 4), st.integers(0, 2), st.integers(0, 15)),
        st.builds(eltwise, st.integers(0, 3), st.integers(0, 3), size, dev_addr, dev_addr,
                  dev_addr),
        st.builds(signal, h, st.integers(0, U64 - 1)),
        st.builds(timestamp, h),
        st.builds(lambda op, fl, ln, pad: hdr(op, ln, fl) + bytes(pad),
                  st.integers(0, 0xFFFF), st.integers(0, 3), st.integers(0, 80),
                  st.sampled_from([0, 8, 24, 56])),
    )


@st.composite
def buffers(draw: st.DrawFn, scratch: int) -> bytes:
    cmds = draw(st.lists(command(scratch), min_size=1, max_size=6))
    buf = b"".join(cmds)
    return buf[: len(buf) - len(buf) % 8] or nop()


SCRATCH_SIZE = 1024


@FUZZ
@given(data=st.data())
def test_random_command_buffers(data: st.DataObject) -> None:
    rig = Rig(CFG, ram=1 << 20)
    scratch = rig.alloc.alloc(SCRATCH_SIZE, 64)
    cid = rig.create_context()
    buf = data.draw(buffers(scratch))
    cmd = rig.put(buf)
    resp = rig.submit_nowait(cid, None, 77, addr=cmd, length=len(buf))
    before = rig.dma.mem.copy()
    rig.kick()
    rig.clock.run()
    r = rig.resp(resp)
    assert r.fence == 77
    assert Status(r.status) in set(Status) - {Status.ABORTED}
    assert r.status == 0 or r.error_offset < len(buf) or r.error_offset == 0xFFFFFFFF
    after = rig.dma.mem
    changed = np.flatnonzero(before != after) + rig.dma.base
    q = rig.queues[2]
    allowed = [(scratch, scratch + SCRATCH_SIZE), (resp, resp + 32), (q.used, q.used + 4 + 8 * q.size + 2)]
    bad = [hex(a) for a in changed if not any(lo <= a < hi for lo, hi in allowed)]
    assert not bad, bad
    assert rig.mmio.violations == []
    # the function still works
    cid2 = rig.create_context()
    assert rig.submit(cid2, nop(), fence=78).status == 0


@FUZZ
@given(table=st.binary(min_size=16 * 8, max_size=16 * 8),
       ring=st.lists(st.integers(0, 0xFFFF), min_size=8, max_size=8),
       avail_idx=st.integers(0, 0xFFFF), features=st.sampled_from([1 << 32, (1 << 32) | (3 << 28)]),
       addrs=st.lists(st.integers(0, 31), min_size=8, max_size=8),
       queue=st.sampled_from([0, 1, 2]))
def test_garbage_rings(table: bytes, ring: list[int], avail_idx: int, features: int,
                       addrs: list[int], queue: int) -> None:
    rig = Rig(CFG, features=features, qsize=8, ram=1 << 20)
    arena = rig.alloc.alloc(32 * 256, 64)
    rig.dma.g_write(arena, bytes(range(256)) * 32)
    q = rig.queues[queue]
    # Re-point half of the descriptors' addresses into the arena so some chains parse.
    tb = bytearray(table)
    for i, a in enumerate(addrs):
        if a < 16:
            struct.pack_into("<Q", tb, 16 * i, arena + 256 * a)
            struct.pack_into("<I", tb, 16 * i + 8, struct.unpack_from("<I", tb, 16 * i + 8)[0] % 300)
    rig.dma.g_write(q.desc, bytes(tb))
    for i, h in enumerate(ring):
        q.w16(q.avail + 4 + 2 * i, h % 12 if h & 1 else h)
    q.w16(q.avail + 2, avail_idx % 12 if avail_idx & 1 else avail_idx)
    before = rig.dma.mem.copy()
    rig.kick(queue)
    rig.clock.run()
    changed = np.flatnonzero(before != rig.dma.mem) + rig.dma.base
    allowed = [(arena, arena + 32 * 256), (q.used, q.used + 4 + 8 * q.size + 2)]
    bad = [hex(a) for a in changed if not any(lo <= a < hi for lo, hi in allowed)]
    assert not bad, bad
    broken = bool(rig.r(0x70) & 0x40)
    assert broken == bool(rig.tracer.kinds("ring_broken"))
    if broken:
        assert rig.mmio.violations[-1].rule.startswith("ring/")
    # reset + re-init always restores function
    rig.init()
    cid = rig.create_context()
    assert rig.submit(cid, nop(), fence=3).status == 0


@FUZZ
@given(ops=st.lists(st.tuples(st.sampled_from([0x000, 0x010, 0x014, 0x020, 0x024, 0x030, 0x034,
                                               0x038, 0x044, 0x050, 0x060, 0x064, 0x070,
                                               0x080, 0x084, 0x090, 0x0A0, 0x0FC, 0x100,
                                               0x13C, 0x7FC, 0x001]),
                              st.sampled_from([1, 2, 4, 8]), st.integers(0, 2**32 - 1),
                              st.booleans()), max_size=40))
def test_random_mmio_never_raises(ops: list[tuple[int, int, int, bool]]) -> None:
    rig = Rig(CFG, qsize=8)
    for off, sz, val, is_write in ops:
        if is_write:
            rig.mmio.write(off, sz, val)
        else:
            assert 0 <= rig.mmio.read(off, sz) < 1 << 64
        rig.clock.run()
    assert (rig.r(0x060) != 0) == rig.irq.level
    rig.init()
    assert rig.submit(rig.create_context(), nop()).status == 0
