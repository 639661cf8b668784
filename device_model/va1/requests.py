"""controlq / submitq / eventq wire formats (spec §6), parsed and packed from hwspec.

A request whose readable part is shorter than its structure, or whose writable part is
shorter than its response, is malformed: the reply is a bare BAD_REQUEST status when the
writable part holds 4 bytes, otherwise nothing (used.len = 0).
"""
from __future__ import annotations

import struct
from typing import Callable, NamedTuple

from hwspec import va1
from hwspec.va1 import CtrlType, Status

STATUS_SIZE = struct.calcsize("<" + dict(va1.CTRL_RESP.fields)["status"])  # bare status
_CTRL_REQ = struct.Struct(va1.CTRL_REQ.format)
_SUBMIT_REQ = struct.Struct(va1.SUBMIT_REQ.format)
_new_tuple = tuple.__new__


class CtrlRequest(NamedTuple):
    """A controlq request (a tuple: one is parsed per request)."""
    type: int
    context_id: int
    flags: int
    reserved: int

    @classmethod
    def unpack(cls, data: bytes) -> CtrlRequest:
        return cls._make(_CTRL_REQ.unpack_from(data))


class SubmitRequest(NamedTuple):
    """A submitq request (a tuple: one is parsed per submission)."""
    context_id: int
    flags: int
    cmdbuf_addr: int
    cmdbuf_len: int
    reserved: int
    fence_seq: int

    @classmethod
    def unpack(cls, data: bytes) -> SubmitRequest:
        return _new_tuple(cls, _SUBMIT_REQ.unpack_from(data))   # _make, minus its checks


unpack_submit_from: Callable[..., tuple[int, int, int, int, int, int]] = _SUBMIT_REQ.unpack_from
"""unpack_submit_from(buffer, offset): a submitq request's fields, read in place (for
`tuple.__new__(SubmitRequest, ...)`: SubmitRequest.unpack without its frame or a copy)."""


def ctrl_response_size(type_: int) -> int:
    return va1.STATS_RESP.size if type_ == CtrlType.GET_STATS else va1.CTRL_RESP.size


def bad_request_reply(writable_len: int) -> bytes:
    """The reply to a malformed chain."""
    if writable_len >= STATUS_SIZE:
        return struct.pack("<I", Status.BAD_REQUEST)
    return b""


def pack_ctrl_resp(status: Status, context_id: int = 0) -> bytes:
    return struct.pack(va1.CTRL_RESP.format, status, context_id)


def pack_stats_resp(status: Status, submissions: int, commands: int, device_time_ns: int,
                    dma_bytes: int, faults: int) -> bytes:
    m = (1 << 64) - 1
    return struct.pack(va1.STATS_RESP.format, status, 0, submissions & m, commands & m,
                       device_time_ns & m, dma_bytes & m, faults & m)


_SUBMIT_RESP = struct.Struct(va1.SUBMIT_RESP.format)

pack_submit_resp: Callable[[Status, int, int, int, int], bytes] = _SUBMIT_RESP.pack
"""pack_submit_resp(status, error_offset, fence_seq, start_ns, end_ns): the submitq
response (a Struct's own pack: one is packed per submission)."""

pack_submit_resp_into: Callable[..., None] = _SUBMIT_RESP.pack_into
"""pack_submit_resp_into(buffer, offset, status, error_offset, fence_seq, start_ns,
end_ns): the same response written in place."""


def pack_event(type_: int, context_id: int, fence_seq: int, status: Status,
               error_offset: int) -> bytes:
    return struct.pack(va1.EVENT.format, type_, context_id, fence_seq, status, error_offset)
