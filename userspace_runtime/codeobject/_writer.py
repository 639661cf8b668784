"""ELF64 writer for VA-1 code objects, packed with `struct` (no ELF library writes).

Layout: ELF header, section contents in section order (each at its alignment), then the
section header table. Local symbols (sections, node labels, constants) come before the
global ones (functions, argument slots), as the gABI requires.
"""
from __future__ import annotations

import json
from typing import Any

from . import _format as F
from ._format import CodeObject, CodeObjectError


class _StrTab:
    def __init__(self) -> None:
        self.data = bytearray(b"\0")
        self._index: dict[str, int] = {"": 0}

    def add(self, s: str) -> int:
        if s in self._index:
            return self._index[s]
        raw = s.encode("utf-8")
        if b"\0" in raw:
            raise CodeObjectError(f"name {s!r} contains a NUL byte")
        off = len(self.data)
        self.data += raw + b"\0"
        self._index[s] = off
        return off


def metadata_of(co: CodeObject) -> dict[str, Any]:
    """The metadata note's JSON object for `co` (co.metadata supplies the rest)."""
    meta = dict(co.metadata)
    meta["format"] = F.METADATA_FORMAT
    meta.setdefault("isa_version", 0x00010000)
    meta.setdefault("features", [])
    meta["memory"] = {"const": len(co.const), "workspace": co.workspace_size,
                      "args": co.args_size,
                      "total": len(co.const) + co.workspace_size + co.args_size}
    meta["functions"] = [
        {"name": f.name, "symbol": f.symbol,
         "args": [{"name": a.name, "kind": a.kind, "shape": list(a.shape), "dtype": a.dtype,
                   "symbol": a.symbol} for a in f.args]}
        for f in co.functions]
    return meta


def _align(n: int, a: int) -> int:
    return (n + a - 1) // a * a


def write(co: CodeObject) -> bytes:
    """Encode `co` as an ELF64 relocatable object for EM_VA1."""
    if len(co.text) % 8:
        raise CodeObjectError(f"command stream of {len(co.text)} bytes is not a multiple of 8")
    shstr = _StrTab()
    strtab = _StrTab()

    # Section indices are fixed by this order.
    names = ["", F.TEXT, F.CONST, F.BSS, F.ARGS, F.RELA_TEXT, F.NOTE, ".symtab", ".strtab",
             ".shstrtab"]
    idx = {n: i for i, n in enumerate(names)}

    # -- symbols ----------------------------------------------------------------------
    syms: list[tuple[int, int, int, int, int, int]] = [(0, 0, 0, 0, 0, 0)]
    sym_index: dict[str, int] = {}
    for sec in (F.TEXT, F.CONST, F.BSS, F.ARGS):
        sym_index[sec] = len(syms)
        syms.append((0, (F.STB_LOCAL << 4) | F.STT_SECTION, F.STV_DEFAULT, idx[sec], 0, 0))
    for f in co.functions:
        for off, label in f.labels:
            syms.append((strtab.add(label), (F.STB_LOCAL << 4) | F.STT_NOTYPE, F.STV_DEFAULT,
                         idx[F.TEXT], off, 0))
    for name, off, size in co.constants:
        syms.append((strtab.add(name), (F.STB_LOCAL << 4) | F.STT_OBJECT, F.STV_DEFAULT,
                     idx[F.CONST], off, size))
    first_global = len(syms)
    for f in co.functions:
        sym_index[f.symbol] = len(syms)
        syms.append((strtab.add(f.symbol), (F.STB_GLOBAL << 4) | F.STT_FUNC, F.STV_DEFAULT,
                     idx[F.TEXT], f.offset, f.size))
        for a in f.args:
            sym_index[a.symbol] = len(syms)
            syms.append((strtab.add(a.symbol), (F.STB_GLOBAL << 4) | F.STT_OBJECT,
                         F.STV_DEFAULT, idx[F.ARGS], a.offset, a.nbytes))
    symtab = b"".join(F.SYM.pack(*s) for s in syms)

    # -- relocations --------------------------------------------------------------------
    rela = bytearray()
    for r in co.relocations:
        if r.symbol not in sym_index:
            raise CodeObjectError(f"relocation at {r.offset:#x} names unknown symbol "
                                  f"{r.symbol!r}")
        rela += F.RELA.pack(r.offset, (sym_index[r.symbol] << 32) | r.type, r.addend)

    # -- note ---------------------------------------------------------------------------
    desc = json.dumps(metadata_of(co), sort_keys=True, separators=(",", ":")).encode()
    owner = F.NOTE_NAME.encode() + b"\0"
    note = F.NHDR.pack(len(owner), len(desc), F.NT_VA1_METADATA)
    note += owner + b"\0" * (_align(len(owner), 4) - len(owner))
    note += desc + b"\0" * (_align(len(desc), 4) - len(desc))

    for n in names[1:]:
        shstr.add(n)

    # (type, flags, data or None for NOBITS, nobits size, link, info, align, entsize)
    sections: list[tuple[int, int, bytes | None, int, int, int, int, int]] = [
        (F.SHT_NULL, 0, b"", 0, 0, 0, 0, 0),
        (F.SHT_PROGBITS, F.SHF_ALLOC | F.SHF_EXECINSTR, bytes(co.text), 0, 0, 0, 8, 0),
        (F.SHT_PROGBITS, F.SHF_ALLOC, bytes(co.const), 0, 0, 0, 64, 0),
        (F.SHT_NOBITS, F.SHF_ALLOC | F.SHF_WRITE, None, co.workspace_size, 0, 0, 64, 0),
        (F.SHT_NOBITS, F.SHF_ALLOC | F.SHF_WRITE, None, co.args_size, 0, 0, 64, 0),
        (F.SHT_RELA, F.SHF_INFO_LINK, bytes(rela), 0, idx[".symtab"], idx[F.TEXT], 8,
         F.RELA.size),
        (F.SHT_NOTE, 0, note, 0, 0, 0, 4, 0),
        (F.SHT_SYMTAB, 0, symtab, 0, idx[".strtab"], first_global, 8, F.SYM.size),
        (F.SHT_STRTAB, 0, bytes(strtab.data), 0, 0, 0, 1, 0),
        (F.SHT_STRTAB, 0, bytes(shstr.data), 0, 0, 0, 1, 0),
    ]
    body = bytearray(F.EHDR.size)
    headers = []
    for i, (typ, flags, data, nob, link, info, align, entsize) in enumerate(sections):
        nm = shstr.add(names[i]) if i else 0
        if i == 0:
            headers.append(F.SHDR.pack(0, 0, 0, 0, 0, 0, 0, 0, 0, 0))
            continue
        pad = _align(len(body), max(align, 1)) - len(body)
        body += b"\0" * pad
        off = len(body)
        if data is None:
            size = nob
        else:
            body += data
            size = len(data)
        headers.append(F.SHDR.pack(nm, typ, flags, 0, off, size, link, info, align, entsize))
    shoff = _align(len(body), 8)
    body += b"\0" * (shoff - len(body))
    ident = F.ELFMAG + bytes([F.ELFCLASS64, F.ELFDATA2LSB, F.EV_CURRENT, F.ELFOSABI_NONE, 0])
    ident += b"\0" * (16 - len(ident))
    isa = int(co.metadata.get("isa_version", 0x00010000))
    body[:F.EHDR.size] = F.EHDR.pack(ident, F.ET_REL, F.EM_VA1, F.EV_CURRENT, 0, 0, shoff,
                                     isa & 0xFFFF_FFFF, F.EHDR.size, 0, 0, F.SHDR.size,
                                     len(sections), idx[".shstrtab"])
    return bytes(body) + b"".join(headers)
