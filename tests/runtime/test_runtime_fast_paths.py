"""The runtime's null round trip fast paths (enqueue without buffers, staging without a
Region, SUBMIT without handles) agree with the general paths they skip."""
from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from userspace_runtime import CommandBufferBuilder, Device
from userspace_runtime._staging import StagingPool


def _run(fake_os: Any, listed: bool) -> list[tuple[bytes, list[int], int]]:
    """Three NOP enqueues per sync (the second and third join a chunk that holds
    commands already), then a buffer-using enqueue; buffers listed as [] or not at all."""
    dev = Device(fake_os)
    ctx = dev.create_context()
    s = ctx.create_stream()
    nop = CommandBufferBuilder()
    nop.nop()
    two = CommandBufferBuilder()
    two.nop()
    two.nop()
    buf = ctx.alloc((4,), np.float32)
    for _ in range(2):
        for cmds in (nop, two, nop):
            if listed:
                s.enqueue(cmds, [])
            else:
                s.enqueue(cmds)
        s.synchronize()
    s.enqueue(nop, [buf])
    s.synchronize()
    s.enqueue(CommandBufferBuilder())   # empty: nothing queued
    assert s.pending_commands == 0
    return [(sub.cmdbuf, sub.handles, sub.fence) for sub in fake_os.file.submissions]


def test_enqueue_without_buffers_submits_what_an_empty_list_submits(make_os: Any) -> None:
    fast, general = _run(make_os(), False), _run(make_os(), True)
    assert fast == general
    assert [len(c) for c, _, _ in fast] == [32, 32, 8] and fast[2][1] != []


def test_enqueue_without_buffers_still_splits_at_the_max_size(make_os: Any) -> None:
    fake = make_os(max_cmdbuf=16)
    s = Device(fake).create_context().create_stream()
    two = CommandBufferBuilder()
    two.nop()
    two.nop()
    s.enqueue(two)
    s.enqueue(two)       # the open chunk is full: _room submits it first
    s.synchronize()
    assert [len(sub.cmdbuf) for sub in fake.file.submissions] == [16, 16]
    with pytest.raises(ValueError, match="multiple of 8 up to 16"):
        big = CommandBufferBuilder()
        for _ in range(3):
            big.nop()
        s.enqueue(big)


def test_staging_put_matches_alloc_and_falls_back_when_the_block_is_full(
        make_os: Any) -> None:
    drv = Device(make_os())._drv
    done = {"seq": -1}
    fast = StagingPool(drv, lambda q: q <= done["seq"], lambda: None, block_size=4096)
    slow = StagingPool(drv, lambda q: q <= done["seq"], lambda: None, block_size=4096)
    placed = []
    for seq, n in enumerate((24, 3000, 1100, 40)):   # the third does not fit: a new block
        data = bytes(i % 251 for i in range(seq, seq + n))
        block, off = fast.put(data, seq)
        region = slow.alloc(n, seq)
        region.write(data)
        assert bytes(block.view[off:off + n]) == data
        placed.append((fast.blocks.index(block), off, block.last_seq,
                       slow.blocks.index(region.block), region.offset, region.block.last_seq))
    assert [p[:3] for p in placed] == [p[3:] for p in placed]
    assert len(fast.blocks) == 2 and placed[2][1] == 0


def test_submit_takes_handles_from_any_iterable(make_os: Any) -> None:
    """SUBMIT skips the handle list only for an empty dict (a stream's set); a numpy
    array, a generator or a list of handles is listed as before."""
    from guest_driver import uapi
    from userspace_runtime.driver_file import DriverFile
    fake = make_os()
    drv = DriverFile.open(fake)
    h, _ = drv.bo_create(64, uapi.BO_HOST)
    d, _ = drv.bo_create(64, uapi.BO_DEVICE)
    nop = CommandBufferBuilder()
    nop.nop()
    drv.mmap(h)[:8] = np.frombuffer(nop.bytes(), np.uint8)
    ctx = drv.context_create()
    for handles in ({}, (), [], np.array([d, d]), (x for x in [d]), {d: None}):
        drv.submit(ctx, 0, h, 0, 8, handles)
    assert [sub.handles for sub in fake.file.submissions] == [[], [], [], [d, d], [d], [d]]


def test_a_reopened_chunk_never_touches_one_in_flight(make_os: Any) -> None:
    """The stream opens its last retired chunk again for the next submission; a chunk
    still in flight keeps its commands, so its failure names them, and every
    submission's result counts its own."""
    from hwspec import va1
    from userspace_runtime import DeviceError

    fake = make_os()
    s = Device(fake).create_context().create_stream()

    def cmds(*names: str) -> CommandBufferBuilder:
        b = CommandBufferBuilder()
        for n in names:
            b.nop(name=n)
        return b

    first = s._open
    s.enqueue(cmds("a0", "a1"))
    s.synchronize()                          # retired: opened again next
    fake.file.hold = True                    # submissions run at the blocking WAIT
    fake.file.hook = lambda f, sub: ((va1.Status.BAD_OPCODE, 8) if sub.fence == 2
                                     else None)
    s.enqueue(cmds("b0", "b1"))
    s.flush()
    in_flight = s._inflight[0]
    assert s._open is first and s._open.seq == 2 and s._open is not in_flight
    assert s._open.builder.command_count == 0 and s._open.fence is None
    s.enqueue(cmds("c0", "c1", "c2"))        # fills the reopened chunk
    s.flush()
    assert in_flight.builder.command_count == 2 and len(s._inflight) == 2
    with pytest.raises(DeviceError) as err:
        s.synchronize()
    assert err.value.command == "b1" and err.value.fence_seq == 2
    assert [(r.seq, r.commands, r.cmdbuf_size) for r in s.submissions] == \
        [(0, 2, 16), (1, 2, 16), (2, 3, 24)]
    assert [len(sub.cmdbuf) for sub in fake.file.submissions] == [16, 16, 24]
    s.enqueue(cmds("d0"))                    # into a new chunk (none was retired then)
    s.flush()
    assert s._open is first and s._open.seq == 4   # the last one retired: opened again
    assert fake.file.submissions[-1].commands[0]["offset"] == 0


def test_a_chunk_whose_copy_to_staging_failed_is_opened_again(make_os: Any) -> None:
    """The stream copies a chunk's commands to staging through a view it releases at
    once: the failed chunk, retired with its error (and the error's traceback) kept, is
    cleared and opened again for the next submission."""
    from hwspec import va1

    s = Device(make_os()).create_context().create_stream()
    nop = CommandBufferBuilder()
    nop.nop()
    put = s._staging.put

    def fail(data: Any, seq: int) -> Any:
        s._staging.put = put  # type: ignore[method-assign]
        raise RuntimeError("staging copy failed")

    s._staging.put = fail  # type: ignore[method-assign]
    s.enqueue(nop)
    with pytest.raises(RuntimeError, match="staging copy failed") as kept:
        s.flush()
    failed = s._inflight[0]
    s._poll()                                # retires it: opened again next
    assert s._retired is failed and s.submissions[-1].status == va1.Status.ABORTED
    s.enqueue(nop)
    with pytest.raises(RuntimeError, match="staging copy failed"):
        s.synchronize()                      # the stream's first error, still sticky
    assert s._open is failed and failed.builder.command_count == 0
    assert kept.value.__traceback__ is not None
