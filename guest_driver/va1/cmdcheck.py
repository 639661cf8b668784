"""SUBMIT-time check of a command buffer's host addresses, and its shadow copy.

Every host (IOVA) range a command buffer names (DMA_H2D `src`, DMA_D2H `dst`, SIGNAL,
TIMESTAMP and WAIT `addr`, CALL `addr`/`size`, callees included) must lie inside one
HOST buffer of the submitting file; anything else is refused with EFAULT naming the
command. The commands are parsed from the `hwspec.isa` layouts (datasheet §7), not
from any builder.

The device reads the command buffer (and every callee) when the submission starts,
later than SUBMIT, and user space can rewrite its HOST buffers in between. So what was
checked is what runs: the driver copies the buffer and every callee it descended into
(the expanded submission) into kernel memory, and patches each CALL of the copy to the
copy of its callee. Top-level offsets are unchanged, so the device's error offsets
still name the user's commands.

Where the walk stops: at the first command the device refuses before any command runs
(a header it cannot parse, a CALL it will not follow: §7 checks every command before
any runs), nothing after it can run, so nothing after it needs checking. Such a CALL
keeps its own address (already checked to be the caller's own memory), which the
device never reads: BAD_ARG, BAD_SHAPE, CMDBUF_TOO_LARGE, CALL_DEPTH and the expansion
bound come before DMA_FAULT in its CALL checks.
"""
from __future__ import annotations

import errno
import struct
from dataclasses import dataclass, field
from typing import Callable, Generic, Optional, TypeVar

from hwspec import isa

from .driver import VA1Error

T = TypeVar("T")

# host operands per opcode: (address field, size field or fixed size, what it does)
HOST_OPERANDS: dict[isa.Opcode, tuple[tuple[str, str | int, str], ...]] = {
    isa.Opcode.DMA_H2D: (("src", "size", "read"),),
    isa.Opcode.DMA_D2H: (("dst", "size", "write"),),
    isa.Opcode.SIGNAL: (("addr", 8, "write"),),
    isa.Opcode.TIMESTAMP: (("addr", 8, "write"),),
    isa.Opcode.WAIT: (("addr", 8, "read"),),
    isa.Opcode.CALL: (("addr", "size", "call"),),
}
_NOP = isa.Opcode.NOP
_NOP_V = int(_NOP)
_LENGTHS = {o: isa.command_length(o) for o in isa.Opcode}
_HDR = struct.Struct(isa.HEADER.format)
_HDR_SIZE = isa.HEADER.size
_PAYLOAD = {op: struct.Struct(lay.format) for op, lay in isa.PAYLOAD.items()}
_CALL_PATCH = isa.HEADER.size + isa.PAYLOAD[isa.Opcode.CALL].offsets["addr"]
# HOST_OPERANDS by payload position: op -> (payload struct, field names, ((address
# index, size index or -1, fixed size, address field, what it does), ...)).
_HOST_FIELDS: dict[isa.Opcode, tuple[struct.Struct, tuple[str, ...],
                                      tuple[tuple[int, int, int, str, str], ...]]] = {
    op: (_PAYLOAD[op], isa.PAYLOAD[op].names, tuple(
        (isa.PAYLOAD[op].names.index(a),
         isa.PAYLOAD[op].names.index(sz) if isinstance(sz, str) else -1,
         sz if isinstance(sz, int) else 0, a, how)
        for a, sz, how in operands))
    for op, operands in HOST_OPERANDS.items()
}
# The same, keyed by the opcode's value as the header holds it (no enum per command):
# value -> (payload struct, field names, operands, opcode); and every opcode's length.
_HOST_BY_VALUE = {int(op): (st, names, operands, op)
                  for op, (st, names, operands) in _HOST_FIELDS.items()}
_LENGTH_BY_VALUE = {int(o): n for o, n in _LENGTHS.items()}
_CALL_V = int(isa.Opcode.CALL)
# Blocks of 1, 2, 4 ... header-only NOPs without flags: a run of them is skipped a block
# at a time (they have no operands).
_BARE_NOP = _HDR.pack(_NOP_V, 0, isa.HEADER.size)
_BARE_NOPS = [_BARE_NOP * (1 << i) for i in range(13)]
_BARE_NOP_SIZE = len(_BARE_NOP)
_BARE_TOP = len(_BARE_NOPS) - 1


def _skip_bare_nops(buf: bytes, pos: int) -> int:
    """The position after the run of header-only NOPs at `pos` (galloping by blocks)."""
    i = 0
    end = len(buf)
    while pos < end:
        if buf.startswith(_BARE_NOPS[i], pos):
            pos += _BARE_NOP_SIZE << i
            if i < _BARE_TOP:
                i += 1
        elif i == 0:
            break
        else:
            i -= 1
    return pos


@dataclass
class Segment:
    """One buffer of the expanded submission: the top level (index 0) or a callee."""
    data: bytearray
    offset: int = 0    # in the shadow copy
    patches: list[tuple[int, int]] = field(default_factory=list)  # (CALL offset, callee)


@dataclass
class Checked(Generic[T]):
    """What a command buffer may touch (`used`: the owners of its host ranges) and the
    buffers of its shadow copy, top level first. `size` (of the shadow copy) and `plain`
    (its image when no CALL was followed: the same at any IOVA) are worked out once
    here, since a memo entry serves many submissions."""
    segments: list[Segment]
    used: list[T]
    size: int = field(init=False)
    plain: bytes | None = field(init=False)

    def __post_init__(self) -> None:
        self.size = sum(len(s.data) for s in self.segments)
        self.plain = (bytes(self.segments[0].data)
                      if len(self.segments) == 1 and not self.segments[0].patches else None)

    def image(self, base: int) -> bytes:
        """The shadow copy laid out at IOVA `base`, every followed CALL patched."""
        if self.plain is not None:
            return self.plain
        off = 0
        for s in self.segments:
            s.offset = off
            off += len(s.data)
        out = bytearray()
        for s in self.segments:
            data = bytearray(s.data)
            for pos, callee in s.patches:
                struct.pack_into("<Q", data, pos + _CALL_PATCH,
                                 base + self.segments[callee].offset)
            out += data
        return bytes(out)


def _only_bare_nops(top: bytes) -> Optional[Checked[T]]:
    """The check of a buffer of only header-only NOPs (no operand, no callee: nothing to
    check, and cheaper to find than a memo entry), or None."""
    if _skip_bare_nops(top, 0) == len(top):
        return Checked([Segment(bytearray(top))], [])
    return None


def check_cmdbuf(top: bytes, owner: Callable[[int, int], Optional[T]],
                 read: Callable[[int, int], bytes], max_cmdbuf_size: int,
                 max_call_depth: int) -> Checked[T]:
    """Walk `top` (and its callees) as the device validates it; `owner(addr, size)` is
    the caller's buffer holding [addr, addr+size) or None; `read` reads guest memory.
    Raises VA1Error(EFAULT) naming the first host range outside the caller's buffers."""
    nops: Optional[Checked[T]] = _only_bare_nops(top)
    if nops is not None:
        return nops
    return _walk_top(top, owner, read, max_cmdbuf_size, max_call_depth)


def _walk_top(top: bytes, owner: Callable[[int, int], Optional[T]],
              read: Callable[[int, int], bytes], max_cmdbuf_size: int,
              max_call_depth: int) -> Checked[T]:
    w = _Walk(owner, read, max_cmdbuf_size, max_call_depth, len(top))
    w.segments.append(Segment(bytearray(top)))
    w.walk(0, 0, ())
    return Checked(w.segments, w.used)


class CheckCache(Generic[T]):
    """A device file's memo of checked buffers that follow no CALL, under their exact
    bytes: such a check depends only on those bytes, the host-buffer index (`owner`,
    which the file makes anew after every BO_CREATE and BO_FREE) and the two limits, so
    the same bytes against the same index give the same result (a buffer of bare NOPs
    too: one dict lookup finds it again). A buffer that follows a CALL is checked every
    time (its callee is read from memory user space may rewrite);
    a refused buffer raises and is not kept. Emptied when the index or the limits change
    and when its buffers hold MAX_BYTES."""

    MAX_BYTES = 1 << 20

    def __init__(self) -> None:
        self._entries: dict[bytes, Checked[T]] = {}
        self._bytes = 0
        self._state: tuple[object, int, int] | None = None

    def check(self, top: bytes, owner: Callable[[int, int], Optional[T]],
              read: Callable[[int, int], bytes], max_cmdbuf_size: int,
              max_call_depth: int) -> Checked[T]:
        """`check_cmdbuf`, served from the memo when it may be."""
        state = self._state
        if (state is None or state[0] is not owner or state[1] != max_cmdbuf_size
                or state[2] != max_call_depth):
            self._clear()
            self._state = (owner, max_cmdbuf_size, max_call_depth)
        hit = self._entries.get(top)
        if hit is not None:
            return hit
        nops: Optional[Checked[T]] = _only_bare_nops(top)
        checked: Checked[T] = (nops if nops is not None else
                               _walk_top(top, owner, read, max_cmdbuf_size, max_call_depth))
        if len(checked.segments) == 1:
            if self._bytes + len(top) > self.MAX_BYTES:
                self._clear()
            if len(top) <= self.MAX_BYTES:
                self._entries[top] = checked
                self._bytes += len(top)
        return checked

    def _clear(self) -> None:
        self._entries.clear()
        self._bytes = 0


class _Walk(Generic[T]):
    def __init__(self, owner: Callable[[int, int], Optional[T]],
                 read: Callable[[int, int], bytes], max_cmdbuf_size: int,
                 max_call_depth: int, top_len: int) -> None:
        self.owner = owner
        self.read = read
        self.max_size = max_cmdbuf_size
        self.max_depth = max_call_depth
        self.budget = isa.CALL_EXPANSION_FACTOR * max_cmdbuf_size
        self.expanded = top_len
        self.segments: list[Segment] = []
        self.used: list[T] = []
        self._seen: set[int] = set()

    def walk(self, index: int, depth: int, path: tuple[int, ...]) -> bool:
        """Check one buffer; False once the device refuses the submission at a command
        (nothing after it runs, so the walk stops)."""
        buf = bytes(self.segments[index].data)
        pos, end = 0, len(buf)
        unpack, hdr, align = _HDR.unpack_from, _HDR_SIZE, isa.ALIGN
        startswith = buf.startswith
        owner, seen, used = self.owner, self._seen, self.used
        while pos < end:
            if startswith(_BARE_NOP, pos):
                pos = _skip_bare_nops(buf, pos)
                if pos >= end:
                    break
            if end - pos < hdr:
                return False                                    # TRUNCATED
            opcode, flags, length = unpack(buf, pos)
            if length < hdr or length % align or pos + length > end:
                return False                                    # BAD_LENGTH, TRUNCATED
            if opcode == _NOP_V:
                pos += length   # a good NOP: no operands
                continue
            want = _LENGTH_BY_VALUE.get(opcode)
            if want is None:
                return False                                    # BAD_OPCODE
            if length != want:
                return False                                    # BAD_LENGTH
            host = _HOST_BY_VALUE.get(opcode)
            if host is not None:
                st, names, operands, op = host
                p = st.unpack_from(buf, pos + hdr)
                for ai, si, fixed, addr_f, how in operands:
                    size = p[si] if si >= 0 else fixed
                    if not size:
                        continue  # BAD_SHAPE on the device: no byte is accessed
                    addr = p[ai]
                    bo = owner(addr, size)
                    if bo is None:
                        raise _efault(path + (pos,), op, addr_f, addr, size, how)
                    if id(bo) not in seen:
                        seen.add(id(bo))
                        used.append(bo)
                if opcode == _CALL_V and not self._call(index, pos, flags,
                                                        dict(zip(names, p)), depth,
                                                        path + (pos,)):
                    return False
            pos += length
        return True

    def _call(self, index: int, pos: int, flags: int, v: dict[str, int], depth: int,
              path: tuple[int, ...]) -> bool:
        size = v["size"]
        if (flags or v["reserved"] or size == 0 or size % isa.ALIGN
                or size > self.max_size or depth + 1 > self.max_depth
                or self.expanded + size > self.budget):
            return False   # refused by the device before it reads the callee
        self.expanded += size
        callee = len(self.segments)
        self.segments.append(Segment(bytearray(self.read(v["addr"], size))))
        self.segments[index].patches.append((pos, callee))
        return self.walk(callee, depth + 1, path)


def _efault(path: tuple[int, ...], op: isa.Opcode, name: str, addr: int, size: int,
            how: str) -> VA1Error:
    """The refusal of the host range `name` of the command at `path` (the CALLs above
    it, then its offset)."""
    return VA1Error(errno.EFAULT, f"SUBMIT: {_where(path)} ({op.name}) {how}s host range "
                                  f"[{addr:#x}, +{size:#x}) ({name}), which is not inside a "
                                  "HOST buffer of this file")


def _where(path: tuple[int, ...]) -> str:
    if len(path) == 1:
        return f"command at offset {path[0]}"
    inner = "/".join(str(p) for p in path[1:])
    return f"command at offset {path[0]} (CALL; callee offset {inner})"
