"""`virtaccel objdump FILE`: sections, symbols, relocations, metadata and a disassembly
of the command stream of a VA-1 code object (read back with pyelftools)."""
from __future__ import annotations

import argparse
import io
import json
import sys
from typing import TextIO


def dump(data: bytes, out: TextIO, name: str = "<bytes>") -> None:
    """Print everything a code object holds (it is checked by the reader first)."""
    from elftools.elf.elffile import ELFFile

    from userspace_runtime import codeobject as co
    from userspace_runtime.commands import decode, disassemble

    obj = co.read(data)
    elf = ELFFile(io.BytesIO(data))
    w = out.write
    w(f"{name}: VA-1 code object, ELF64 little-endian, machine {co.EM_VA1:#x}, "
      f"ISA {obj.metadata['isa_version'] >> 16}.{obj.metadata['isa_version'] & 0xFFFF}\n\n")
    w("Sections:\n  Nr Name               Type          Offset     Size      Align\n")
    for i, s in enumerate(elf.iter_sections()):
        w(f"  {i:2} {s.name:<18} {s['sh_type'][4:]:<13} {s['sh_offset']:#010x} "
          f"{s['sh_size']:#09x} {s['sh_addralign']}\n")
    w("\nSymbols:\n  Num Value      Size     Type    Bind   Section      Name\n")
    symtab = elf.get_section_by_name(".symtab")
    assert symtab is not None and hasattr(symtab, "iter_symbols")  # read() checked it
    for i, s in enumerate(symtab.iter_symbols()):
        shndx = s["st_shndx"]
        sec = elf.get_section(shndx).name if isinstance(shndx, int) and shndx else str(shndx)
        w(f"  {i:3} {s['st_value']:#010x} {s['st_size']:<8} {s['st_info']['type'][4:]:<7} "
          f"{s['st_info']['bind'][4:]:<6} {sec:<12} {s.name}\n")
    w(f"\nRelocations ({len(obj.relocations)} in .rela.va1.text):\n")
    for r in obj.relocations:
        w(f"  {r.offset:#06x} {r.type_name:<16} {r.symbol} + {r.addend:#x}\n")
    w("\nMetadata (note 'VA-1', type "
      f"{co.NT_VA1_METADATA:#x}):\n")
    for line in json.dumps(obj.metadata, indent=2, sort_keys=True).splitlines():
        w(f"  {line}\n")
    for f in obj.functions:
        w(f"\nDisassembly of {f.name} ({f.symbol}, {f.size} bytes):\n")
        relocs = {r.offset: r for r in obj.relocations}
        labels = dict(f.labels)
        text = obj.text[f.offset:f.offset + f.size]
        names: dict[int, str] = {}
        for cmd in decode(text):
            base = f.offset + cmd.offset
            fixups = [f"{relocs[o].symbol}+{relocs[o].addend:#x}"
                      for o in range(base, base + cmd.length, 8) if o in relocs]
            note = labels.get(base, "")
            names[cmd.offset] = (f"<{note}> " if note else "") + ", ".join(fixups)
        w(disassemble(text, names=names) + "\n")


def cli(args: argparse.Namespace) -> int:
    from userspace_runtime.codeobject import CodeObjectError

    from ._args import CliError
    try:
        with open(args.file, "rb") as f:
            data = f.read()
    except OSError as e:
        raise CliError(f"{args.file}: {e.strerror or e}") from None
    try:
        dump(data, sys.stdout, args.file)
    except CodeObjectError as e:
        raise CliError(f"{args.file}: {e}") from None
    return 0
