"""Fixed little-endian struct layouts, described as data.

A `Layout` names its fields in order with their `struct` format codes; the offsets and
the total size follow from that (no implicit padding: every layout is packed and the
datasheet places fields at natural alignment by hand).
"""
from __future__ import annotations

import struct
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Layout:
    name: str
    fields: tuple[tuple[str, str], ...]
    format: str = field(init=False)
    size: int = field(init=False)
    offsets: dict[str, int] = field(init=False)
    names: tuple[str, ...] = field(init=False)

    def __post_init__(self) -> None:
        fmt = "<" + "".join(code for _, code in self.fields)
        offsets: dict[str, int] = {}
        pos = 0
        for name, code in self.fields:
            offsets[name] = pos
            pos += struct.calcsize("<" + code)
        object.__setattr__(self, "format", fmt)
        object.__setattr__(self, "size", struct.calcsize(fmt))
        object.__setattr__(self, "offsets", offsets)
        object.__setattr__(self, "names", tuple(n for n, _ in self.fields))
