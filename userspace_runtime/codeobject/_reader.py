"""Reader for VA-1 code objects: pyelftools parses, this module checks every field it
relies on and turns the file into a `CodeObject`, or raises CodeObjectError naming the
part of the file and the problem.
"""
from __future__ import annotations

import io
import math
import struct
from typing import Any

from elftools.common.exceptions import ELFError
from elftools.elf.elffile import ELFFile

from . import _format as F
from . import _metadata
from ._format import ArgSlot, CodeObject, CodeObjectError, FunctionInfo, Relocation

def _fail(msg: str) -> CodeObjectError:
    return CodeObjectError(f"code object: {msg}")


def _check_header(data: bytes) -> None:
    """Check the ELF header and section-header table bounds by hand before pyelftools
    sees the file (its own errors on truncated input are not specific)."""
    if len(data) < F.EHDR.size:
        raise _fail(f"truncated ELF: {len(data)} bytes, the ELF header alone is "
                    f"{F.EHDR.size}")
    if data[:4] != F.ELFMAG:
        raise _fail(f"not an ELF file (magic {data[:4]!r})")
    if data[4] != F.ELFCLASS64:
        raise _fail(f"wrong ELF class {data[4]} (ELFCLASS64 = 2 needed)")
    if data[5] != F.ELFDATA2LSB:
        raise _fail(f"wrong ELF data encoding {data[5]} (little-endian = 1 needed)")
    if data[6] != F.EV_CURRENT:
        raise _fail(f"wrong ELF ident version {data[6]}")
    (_, etype, machine, version, _entry, phoff, shoff, _flags, ehsize, _phentsize, phnum,
     shentsize, shnum, shstrndx) = F.EHDR.unpack_from(data)
    if machine != F.EM_VA1:
        raise _fail(f"wrong machine {machine:#x}: not a VA-1 code object "
                    f"(e_machine {F.EM_VA1:#x} needed)")
    if etype != F.ET_REL:
        raise _fail(f"wrong ELF type {etype} (ET_REL = 1 needed)")
    if version != F.EV_CURRENT or ehsize != F.EHDR.size:
        raise _fail(f"bad ELF header (e_version {version}, e_ehsize {ehsize})")
    if phnum or phoff:
        raise _fail("unexpected program headers in a VA-1 code object")
    if shentsize != F.SHDR.size:
        raise _fail(f"e_shentsize {shentsize}, expected {F.SHDR.size}")
    if shnum == 0 or shnum >= F.SHN_LORESERVE:
        raise _fail(f"bad section count {shnum}")
    if shoff + shnum * shentsize > len(data):
        raise _fail(f"truncated ELF: the section header table [{shoff:#x}, "
                    f"+{shnum * shentsize:#x}) runs past the end of the file "
                    f"({len(data)} bytes)")
    if not 0 < shstrndx < shnum:
        raise _fail(f"section name table index {shstrndx} is out of range")
    headers = [F.SHDR.unpack_from(data, shoff + i * shentsize) for i in range(shnum)]
    for i, (_n, typ, _fl, _a, off, size, _l, _i, _al, _es) in enumerate(headers):
        if typ not in (F.SHT_NOBITS, F.SHT_NULL) and off + size > len(data):
            raise _fail(f"truncated ELF: section {i} [{off:#x}, +{size:#x}) runs past the "
                        f"end of the file ({len(data)} bytes)")
    names = headers[shstrndx]
    for i, (name_off, _t, flags, *_rest) in enumerate(headers):
        if flags & F.SHF_COMPRESSED:
            raise _fail(f"section {_raw_name(data, names, name_off, i)} has SHF_COMPRESSED "
                        f"set (flags {flags:#x}): VA-1 code objects store every section "
                        f"uncompressed")


def _raw_name(data: bytes, strtab: tuple[int, ...], name_off: int, index: int) -> str:
    """A section's name read by hand for an early error, or `#index` if unreadable."""
    off, size = strtab[4], strtab[5]
    if strtab[1] != F.SHT_STRTAB or name_off >= size:
        return f"#{index}"
    end = data.find(b"\0", off + name_off, off + size)
    raw = data[off + name_off:end if end >= 0 else off + size]
    return f"{raw.decode('utf-8', 'replace')} (#{index})"


def _section(elf: ELFFile, name: str, typ: str) -> Any:
    found = [s for s in elf.iter_sections() if s.name == name]
    if not found:
        raise _fail(f"section {name} is missing")
    if len(found) > 1:
        raise _fail(f"section {name} appears {len(found)} times")
    sec = found[0]
    if sec["sh_type"] != typ:
        raise _fail(f"section {name} has type {sec['sh_type']}, expected {typ}")
    return sec


def _meta_error(msg: str) -> CodeObjectError:
    return _fail(f"malformed metadata note: {msg}")


def _read_note(elf: ELFFile) -> dict[str, Any]:
    notes = [s for s in elf.iter_sections() if s["sh_type"] == "SHT_NOTE"]
    sec = next((s for s in notes if s.name == F.NOTE), None)
    if sec is None:
        raise _fail(f"metadata note missing (no {F.NOTE} section)")
    data = sec.data()
    pos = 0
    found: dict[str, Any] | None = None
    while pos < len(data):
        if len(data) - pos < F.NHDR.size:
            raise _meta_error(f"truncated note header at offset {pos}")
        namesz, descsz, ntype = F.NHDR.unpack_from(data, pos)
        pos += F.NHDR.size
        name_end = pos + namesz
        desc_off = pos + (namesz + 3) // 4 * 4
        desc_end = desc_off + descsz
        if desc_end > len(data):
            raise _meta_error(f"note at offset {pos - F.NHDR.size} runs past its section")
        name = data[pos:name_end].rstrip(b"\0").decode("utf-8", "replace")
        if name == F.NOTE_NAME and ntype == F.NT_VA1_METADATA:
            if found is not None:
                raise _meta_error("more than one VA-1 metadata note")
            found = _metadata.parse(data[desc_off:desc_end].rstrip(b"\0"))
        pos = (desc_end + 3) // 4 * 4
    if found is None:
        raise _fail(f"metadata note missing (no note named {F.NOTE_NAME!r} of type "
                    f"{F.NT_VA1_METADATA} in {F.NOTE})")
    return found


def read(data: bytes | bytearray | memoryview) -> CodeObject:
    """Parse and check a VA-1 code object."""
    buf = bytes(data)
    _check_header(buf)
    try:
        return _read(buf)
    except CodeObjectError:
        raise
    except (ELFError, struct.error, UnicodeDecodeError, ValueError, KeyError, IndexError) as e:
        raise _fail(f"malformed ELF ({type(e).__name__}: {e})") from None


def _read(buf: bytes) -> CodeObject:
    elf = ELFFile(io.BytesIO(buf))
    text = _section(elf, F.TEXT, "SHT_PROGBITS")
    const = _section(elf, F.CONST, "SHT_PROGBITS")
    bss = _section(elf, F.BSS, "SHT_NOBITS")
    args = _section(elf, F.ARGS, "SHT_NOBITS")
    symtab = _section(elf, ".symtab", "SHT_SYMTAB")
    sec_index = {s.name: i for i, s in enumerate(elf.iter_sections())}
    sizes = {sec_index[n]: s["sh_size"] for n, s in
             ((F.TEXT, text), (F.CONST, const), (F.BSS, bss), (F.ARGS, args))}
    text_data = text.data()
    if len(text_data) % 8:
        raise _fail(f"{F.TEXT} is {len(text_data)} bytes, not a multiple of 8")

    # -- symbols ------------------------------------------------------------------------
    if symtab["sh_entsize"] != F.SYM.size or symtab["sh_size"] % F.SYM.size:
        raise _fail(f".symtab entry size {symtab['sh_entsize']} / size {symtab['sh_size']} "
                    f"is not a whole number of {F.SYM.size}-byte symbols")
    strtab_idx = symtab["sh_link"]
    if not 0 < strtab_idx < elf.num_sections() or \
            elf.get_section(strtab_idx)["sh_type"] != "SHT_STRTAB":
        raise _fail(f".symtab links to section {strtab_idx}, not a string table")
    strsize = elf.get_section(strtab_idx)["sh_size"]
    syms: list[tuple[str, int, int, int, int, int]] = []  # name, bind, type, shndx, value, size
    raw_syms = symtab.data()
    for i in range(symtab.num_symbols()):
        st_name, info, _other, shndx, value, size = F.SYM.unpack_from(raw_syms, i * F.SYM.size)
        if st_name >= max(strsize, 1):
            raise _fail(f"symbol {i}: name offset {st_name} is outside .strtab "
                        f"({strsize} bytes)")
        name = symtab.get_symbol(i).name
        if i == 0:
            syms.append(("", 0, 0, 0, 0, 0))
            continue
        if shndx == F.SHN_UNDEF or shndx not in sizes:
            raise _fail(f"symbol {i} {name!r}: section index {shndx} is not a VA-1 section")
        if value + size > sizes[shndx]:
            raise _fail(f"symbol {i} {name!r} out of range: [{value:#x}, +{size:#x}) is "
                        f"outside its section ({sizes[shndx]:#x} bytes)")
        syms.append((name, info >> 4, info & 0xF, shndx, value, size))
    by_name = {s[0]: (i, s) for i, s in enumerate(syms) if s[0]}

    # -- relocations -------------------------------------------------------------------
    relocs: list[Relocation] = []
    rela = _section(elf, F.RELA_TEXT, "SHT_RELA")
    if rela["sh_entsize"] != F.RELA.size or rela["sh_size"] % F.RELA.size:
        raise _fail(f"{F.RELA_TEXT}: entry size {rela['sh_entsize']} / size "
                    f"{rela['sh_size']} is not a whole number of {F.RELA.size}-byte entries")
    if rela["sh_info"] != sec_index[F.TEXT] or rela["sh_link"] != sec_index[".symtab"]:
        raise _fail(f"{F.RELA_TEXT} must apply to {F.TEXT} and use .symtab "
                    f"(sh_info {rela['sh_info']}, sh_link {rela['sh_link']})")
    section_names = {v: k for k, v in sec_index.items()}
    for n, r in enumerate(rela.iter_relocations()):
        off, info, addend = r["r_offset"], r["r_info"], r["r_addend"]
        rtype, rsym = info & 0xFFFF_FFFF, info >> 32
        where = f"relocation {n} at {F.TEXT}+{off:#x}"
        if rtype not in F.RELOC_NAMES or rtype == F.R_VA1_SIZE32:
            raise _fail(f"{where}: unknown relocation type {rtype}")
        width = F.RELOC_WIDTH[rtype]
        if off + width > len(text_data) or off % 8:
            raise _fail(f"{where}: the {width}-byte field is outside its section "
                        f"{F.TEXT} ({len(text_data)} bytes) or misaligned")
        if not 0 < rsym < len(syms):
            raise _fail(f"{where}: symbol index {rsym} is out of range")
        sname, _b, stype, shndx, value, ssize = syms[rsym]
        target = section_names[shndx] if stype == F.STT_SECTION else sname
        if (stype == F.STT_SECTION and target not in (F.CONST, F.BSS)) or \
                (stype != F.STT_SECTION and (section_names[shndx] != F.ARGS
                                             or stype != F.STT_OBJECT)):
            raise _fail(f"{where}: symbol {target!r} is not a device-memory target "
                        f"({F.CONST}, {F.BSS} or an argument slot in {F.ARGS})")
        limit = sizes[shndx] if stype == F.STT_SECTION else ssize
        if addend < 0 or (value if stype != F.STT_SECTION else 0) + addend > \
                (sizes[shndx] if stype == F.STT_SECTION else value + limit):
            raise _fail(f"{where}: addend {addend} points outside symbol {target!r}")
        if rtype != F.R_VA1_NONE:
            relocs.append(Relocation(off, rtype, target, addend))

    # -- metadata ----------------------------------------------------------------------
    meta = _read_note(elf)
    _metadata.check(meta, {"const": const["sh_size"], "workspace": bss["sh_size"],
                           "args": args["sh_size"]})
    if meta["isa_version"] != elf["e_flags"]:
        raise _meta_error(f"isa_version {meta['isa_version']:#x} differs from the ELF "
                          f"header's e_flags {elf['e_flags']:#x}")
    functions: list[FunctionInfo] = []
    labels = sorted((s[4], s[0]) for s in syms[1:] if s[2] == F.STT_NOTYPE
                    and s[3] == sec_index[F.TEXT] and s[1] == F.STB_LOCAL)
    arg_symbols: dict[str, str] = {}
    for fi, fm in enumerate(meta["functions"]):
        where = f"functions[{fi}]"
        fsym = fm["symbol"]
        if fsym not in by_name or by_name[fsym][1][2] != F.STT_FUNC:
            raise _meta_error(f"{where}.symbol {fsym!r} is not a function in .symtab")
        _, (_, _, _, _, foff, fsize) = by_name[fsym]
        f = FunctionInfo(fm["name"], fsym, foff, fsize,
                         labels=[(o, n) for o, n in labels if foff <= o < foff + fsize])
        for ai, am in enumerate(fm["args"]):
            aw = f"{where}.args[{ai}]"
            asym, shape, dtype = am["symbol"], am["shape"], am["dtype"]
            if asym not in by_name or by_name[asym][1][3] != sec_index[F.ARGS] or \
                    by_name[asym][1][2] != F.STT_OBJECT:
                raise _meta_error(f"{aw}.symbol {asym!r} is not an object in {F.ARGS}")
            if asym in arg_symbols:
                raise _meta_error(f"{aw}.symbol {asym!r} is also {arg_symbols[asym]}")
            arg_symbols[asym] = aw
            _, (_, _, _, _, aoff, asize) = by_name[asym]
            nbytes = math.prod(shape) * _metadata.DTYPE_SIZES[dtype]
            if asize != nbytes:
                raise _meta_error(f"{aw}: symbol {asym!r} has {asize} bytes but "
                                  f"{dtype}{shape} needs {nbytes}")
            f.args.append(ArgSlot(am["name"], am["kind"], tuple(shape), dtype, asym, aoff,
                                  asize))
        functions.append(f)
    _check_commands(text_data, functions, relocs)
    consts = [(s[0], s[4], s[5]) for s in syms[1:] if s[3] == sec_index[F.CONST]
              and s[2] == F.STT_OBJECT]
    return CodeObject(text_data, const.data(), bss["sh_size"], functions, relocs, meta, consts)


def _check_commands(text: bytes, functions: list[FunctionInfo], relocs: list[Relocation]
                    ) -> None:
    """The command stream decodes; functions cover whole commands; every relocation
    patches a u64 address field of a command inside a function."""
    from hwspec import isa

    from ..commands import decode
    try:
        cmds = decode(text)
    except ValueError as e:
        raise _fail(f"{F.TEXT} does not decode as VA-1 commands: {e}") from None
    starts = {c.offset: c for c in cmds}
    ends = {c.offset + c.length for c in cmds} | {0}
    for f in functions:
        if f.offset not in starts and not (f.size == 0 and f.offset in ends) or \
                f.offset + f.size not in ends:
            raise _fail(f"function {f.name!r} [{f.offset:#x}, +{f.size:#x}) does not cover "
                        f"whole commands")
    offsets = sorted(starts)
    import bisect
    for r in relocs:
        where = f"relocation at {F.TEXT}+{r.offset:#x}"
        if not any(f.offset <= r.offset < f.offset + f.size for f in functions):
            raise _fail(f"{where} is outside every function")
        c = starts[offsets[bisect.bisect_right(offsets, r.offset) - 1]]
        rel = r.offset - c.offset - isa.HEADER.size
        try:
            layout = isa.PAYLOAD[isa.Opcode(c.opcode)]
        except (ValueError, KeyError):
            raise _fail(f"{where} patches an unknown command {c.opcode_name}") from None
        ok = any(layout.offsets[n] == rel and code == "Q" for n, code in layout.fields)
        if not ok:
            raise _fail(f"{where} does not land on a u64 field of {c.opcode_name} at "
                        f"{c.offset:#x}")
