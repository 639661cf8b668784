"""The SUBMIT-time host-range check walks runs of NOPs a block at a time: what it
refuses, and where, is what a command-by-command walk refuses."""
from __future__ import annotations

import errno
import struct

import pytest

from guest_driver.va1.cmdcheck import CheckCache, check_cmdbuf
from guest_driver.va1.driver import VA1Error
from hwspec.isa import Opcode

_HOST = (0x10000, 0x1000)  # the one HOST buffer of the caller: [base, +size)


def _owner(addr: int, size: int) -> str | None:
    base, length = _HOST
    return "host" if base <= addr and addr + size <= base + length else None


def _nop(length: int = 8, flags: int = 0) -> bytes:
    return struct.pack("<HHI", int(Opcode.NOP), flags, length) + bytes(length - 8)


def _signal(addr: int) -> bytes:
    return struct.pack("<HHIQQ", int(Opcode.SIGNAL), 0, 24, addr, 1)


def _check(buf: bytes) -> list[str]:
    return check_cmdbuf(buf, _owner, lambda a, s: bytes(s), 1 << 20, 4).used


@pytest.mark.parametrize("before", [
    _nop() * 5000,                              # longer than the largest block
    _nop() * 3 + _nop(16) + _nop() * 7,         # a longer NOP inside the run
    _nop() * 4 + _nop(flags=1) + _nop() * 2,    # a NOP with flags is still a NOP here
])
def test_a_bad_host_range_after_a_nop_run_is_refused_at_its_offset(before: bytes) -> None:
    with pytest.raises(VA1Error) as ei:
        _check(before + _signal(0x20000))
    assert ei.value.errno == errno.EFAULT
    assert f"command at offset {len(before)} (SIGNAL)" in str(ei.value)
    assert _check(before + _signal(_HOST[0])) == ["host"]


def test_an_unknown_opcode_after_a_nop_run_stops_the_walk() -> None:
    # the device refuses the submission there: nothing after it runs, nor is checked
    unknown = struct.pack("<HHI", 0xFFFF, 0, 8)
    assert _check(_nop() * 9 + unknown + _signal(0x20000)) == []


def _call(addr: int, size: int) -> bytes:
    return struct.pack("<HHIQII", int(Opcode.CALL), 0, 24, addr, size, 0)


def test_the_check_cache_keeps_call_free_buffers_for_the_same_host_index() -> None:
    """The same bytes against the same host-buffer index are checked once; another
    index (a BO_CREATE or BO_FREE makes one) checks again and refuses what it must;
    a buffer that follows a CALL is read and checked on every SUBMIT."""
    cache: CheckCache[str] = CheckCache()
    reads: list[int] = []

    def read(addr: int, size: int) -> bytes:
        reads.append(addr)
        return _signal(_HOST[0])
    buf = _nop() + _signal(_HOST[0] + 8)
    first = cache.check(buf, _owner, read, 1 << 20, 4)
    assert first.used == ["host"] and cache.check(buf, _owner, read, 1 << 20, 4) is first

    def no_host(addr: int, size: int) -> str | None:
        return None
    with pytest.raises(VA1Error) as ei:
        cache.check(buf, no_host, read, 1 << 20, 4)
    assert ei.value.errno == errno.EFAULT and "command at offset 8 (SIGNAL)" in str(ei.value)
    with pytest.raises(VA1Error):
        cache.check(buf, no_host, read, 1 << 20, 4)
    called = _call(_HOST[0], 24)
    for _ in range(2):
        got = cache.check(called, _owner, read, 1 << 20, 4)
        assert len(got.segments) == 2 and got.used == ["host"]
    assert reads == [_HOST[0], _HOST[0]]


def test_the_check_cache_keeps_bare_nop_buffers_and_their_plain_image() -> None:
    """A buffer of bare NOPs is found again by one lookup; its shadow image is its own
    bytes at any IOVA, worked out once."""
    cache: CheckCache[str] = CheckCache()

    def read(addr: int, size: int) -> bytes:
        raise AssertionError("a bare-NOP buffer reads nothing")
    buf = _nop() * 5
    first = cache.check(buf, _owner, read, 1 << 20, 4)
    again = cache.check(bytes(bytearray(buf)), _owner, read, 1 << 20, 4)
    assert again is first and first.used == [] and first.size == len(buf)
    assert first.plain == buf and first.image(0x5000) == buf
    called = cache.check(_call(_HOST[0], 24), _owner, lambda a, n: _signal(_HOST[0]),
                         1 << 20, 4)
    assert called.plain is None and called.size == 48
