"""VA-1 code objects: the numbers of the ELF64 format (docs/compiler.md) and the
in-memory form the writer takes and the reader returns.
"""
from __future__ import annotations

import struct
from dataclasses import dataclass, field
from typing import Any

from .._errors import UserspaceRuntimeError

# --- ELF numbers (System V gABI) -------------------------------------------------------
ELFMAG = b"\x7fELF"
ELFCLASS64 = 2
ELFDATA2LSB = 1
EV_CURRENT = 1
ELFOSABI_NONE = 0
ET_REL = 1
# Unofficial machine number for VA-1 ("VA" little-endian); not assigned in the gABI
# registry or binutils' elf/common.h, so readelf shows it as an unknown machine.
EM_VA1 = 0x5641

SHT_NULL, SHT_PROGBITS, SHT_SYMTAB, SHT_STRTAB, SHT_RELA = 0, 1, 2, 3, 4
SHT_NOTE, SHT_NOBITS = 7, 8
SHF_WRITE, SHF_ALLOC, SHF_EXECINSTR, SHF_INFO_LINK = 0x1, 0x2, 0x4, 0x40
SHF_COMPRESSED = 0x800
SHN_UNDEF, SHN_LORESERVE, SHN_ABS = 0, 0xFF00, 0xFFF1
STB_LOCAL, STB_GLOBAL = 0, 1
STT_NOTYPE, STT_OBJECT, STT_FUNC, STT_SECTION = 0, 1, 2, 3
STV_DEFAULT = 0

EHDR = struct.Struct("<16sHHIQQQIHHHHHH")      # Elf64_Ehdr, 64 bytes
SHDR = struct.Struct("<IIQQQQIIQQ")            # Elf64_Shdr, 64 bytes
SYM = struct.Struct("<IBBHQQ")                 # Elf64_Sym, 24 bytes
RELA = struct.Struct("<QQq")                   # Elf64_Rela, 24 bytes
NHDR = struct.Struct("<III")                   # Elf64_Nhdr (namesz, descsz, type)

# --- VA-1 specifics ----------------------------------------------------------------
TEXT = ".va1.text"        # the command stream (VA-1 ISA commands, little-endian)
CONST = ".va1.const"      # constants and weights, uploaded once at load
BSS = ".va1.bss"          # workspace for intermediates (NOBITS: size only)
ARGS = ".va1.args"        # argument slots (NOBITS); one device buffer per slot
RELA_TEXT = ".rela.va1.text"
NOTE = ".note.va1"
SECTION_ALIGN = {TEXT: 8, CONST: 64, BSS: 64, ARGS: 64}

# Relocation types (ELF64_R_TYPE).
R_VA1_NONE = 0
R_VA1_DEVADDR64 = 1       # u64 at r_offset := device address of S, plus A
R_VA1_SIZE32 = 2          # u32 at r_offset := st_size of S, plus A (reserved, unused)
RELOC_NAMES = {R_VA1_NONE: "R_VA1_NONE", R_VA1_DEVADDR64: "R_VA1_DEVADDR64",
               R_VA1_SIZE32: "R_VA1_SIZE32"}
RELOC_WIDTH = {R_VA1_NONE: 0, R_VA1_DEVADDR64: 8, R_VA1_SIZE32: 4}

NOTE_NAME = "VA-1"
NT_VA1_METADATA = 0x5641  # desc: UTF-8 JSON object (docs/compiler.md); readelf: unknown type
METADATA_FORMAT = 1


class CodeObjectError(UserspaceRuntimeError, ValueError):
    """A code object is malformed; the message names the part and the problem."""


@dataclass
class ArgSlot:
    """One argument of a function: a device buffer the loader allocates."""

    name: str
    kind: str                     # "input" or "output"
    shape: tuple[int, ...]
    dtype: str                    # numpy dtype name
    symbol: str
    offset: int = 0               # st_value in .va1.args
    nbytes: int = 0


@dataclass
class FunctionInfo:
    """An entry point: a command range of .va1.text and its arguments."""

    name: str
    symbol: str
    offset: int
    size: int
    args: list[ArgSlot] = field(default_factory=list)
    # (offset in .va1.text, label) for the first command of each graph node
    labels: list[tuple[int, str]] = field(default_factory=list)

    @property
    def inputs(self) -> list[ArgSlot]:
        return [a for a in self.args if a.kind == "input"]

    @property
    def outputs(self) -> list[ArgSlot]:
        return [a for a in self.args if a.kind == "output"]


@dataclass
class Relocation:
    offset: int                   # in .va1.text
    type: int
    symbol: str                   # a section name (section symbol) or an arg symbol
    addend: int

    @property
    def type_name(self) -> str:
        return RELOC_NAMES.get(self.type, f"R_VA1_{self.type:#x}")


@dataclass
class CodeObject:
    """Everything a code object holds, independent of its byte encoding."""

    text: bytes
    const: bytes
    workspace_size: int
    functions: list[FunctionInfo]
    relocations: list[Relocation]
    metadata: dict[str, Any]
    # (name, offset, size) of each constant in .va1.const (local data symbols)
    constants: list[tuple[str, int, int]] = field(default_factory=list)

    @property
    def args_size(self) -> int:
        return max((a.offset + a.nbytes for f in self.functions for a in f.args), default=0)

    def function(self, name: str) -> FunctionInfo:
        for f in self.functions:
            if f.name == name:
                return f
        names = ", ".join(f.name for f in self.functions) or "none"
        raise KeyError(f"no function {name!r} in the code object (functions: {names})")
