"""VA-1 code objects: ELF64 files holding compiled command streams.

`write(CodeObject) -> bytes` packs the file with struct; `read(bytes) -> CodeObject`
parses it with pyelftools and checks every field (CodeObjectError names the problem).
The format is documented in docs/compiler.md.
"""
from __future__ import annotations

from ._format import (
    EM_VA1,
    NOTE_NAME,
    NT_VA1_METADATA,
    R_VA1_DEVADDR64,
    R_VA1_NONE,
    RELOC_NAMES,
    ArgSlot,
    CodeObject,
    CodeObjectError,
    FunctionInfo,
    Relocation,
)
from ._reader import read
from ._writer import metadata_of, write

__all__ = [
    "EM_VA1", "NOTE_NAME", "NT_VA1_METADATA", "R_VA1_DEVADDR64", "R_VA1_NONE",
    "RELOC_NAMES", "ArgSlot", "CodeObject", "CodeObjectError", "FunctionInfo",
    "Relocation", "metadata_of", "read", "write",
]
