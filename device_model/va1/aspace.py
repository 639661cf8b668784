"""Context address spaces (spec "Context address spaces").

A context's device addresses are virtual: each range a command names must lie entirely
inside one mapping [va, va+size) -> [pa, pa+size) of the function's memory, with the
mapping's READ/WRITE rights. A FLAT context sees the whole function memory at VA = PA.
Translation is a bisect over the (few) mappings, done once per operand at validation.
"""
from __future__ import annotations

from bisect import bisect_right
from dataclasses import dataclass

from hwspec import va1
from hwspec.va1 import Status


@dataclass(frozen=True)
class Mapping:
    va: int
    pa: int
    size: int
    flags: int


class AddressSpace:
    def __init__(self) -> None:
        self._vas: list[int] = []
        self._maps: list[Mapping] = []
        # Changes with every change of the mappings: what was resolved through the old
        # ones (commands.ResolveCache) is stale.
        self.generation = 0

    @property
    def mappings(self) -> tuple[Mapping, ...]:
        return tuple(self._maps)

    def map(self, va: int, pa: int, size: int, flags: int, memory_size: int) -> Status:
        page = va1.CTX_PAGE
        if (flags & ~(va1.CTX_MAP_READ | va1.CTX_MAP_WRITE) or not flags or size == 0
                or va % page or pa % page or size % page or va + size > 1 << 64):
            return Status.BAD_ARG
        if pa + size > memory_size:
            return Status.OUT_OF_BOUNDS
        i = bisect_right(self._vas, va)
        if i and self._maps[i - 1].va + self._maps[i - 1].size > va:
            return Status.BAD_ARG
        if i < len(self._maps) and self._maps[i].va < va + size:
            return Status.BAD_ARG
        self._vas.insert(i, va)
        self._maps.insert(i, Mapping(va, pa, size, flags))
        self.generation += 1
        return Status.OK

    def unmap(self, va: int, size: int) -> Status:
        i = bisect_right(self._vas, va) - 1
        if i < 0 or self._maps[i].va != va or self._maps[i].size != size:
            return Status.BAD_ARG
        del self._vas[i]
        del self._maps[i]
        self.generation += 1
        return Status.OK

    def translate(self, va: int, size: int, write: bool) -> int:
        """The function address of [va, va+size); -1 if not inside one mapping with the
        needed right."""
        i = bisect_right(self._vas, va) - 1
        if i < 0:
            return -1
        m = self._maps[i]
        off = va - m.va
        if size < 0 or off + size > m.size:
            return -1
        if not m.flags & (va1.CTX_MAP_WRITE if write else va1.CTX_MAP_READ):
            return -1
        return m.pa + off

    def clear(self) -> None:
        self._vas.clear()
        self._maps.clear()
        self.generation += 1
