"""ELF64 code objects: written by the project, read back with pyelftools, clean under
`readelf -a -W`, and every malformed part rejected with an error naming it."""
from __future__ import annotations

import io
import json
import struct
from pathlib import Path
from typing import Callable

import numpy as np
import pytest
from elftools.elf.elffile import ELFFile

from userspace_runtime import codeobject as co
from userspace_runtime.codeobject import _format as F
from userspace_runtime.compiler import CompileOptions, compile_graph
from userspace_runtime.module import Module
from virtaccel.cli import main as cli_main

from . import models
from .conftest import readelf_clean


def _objects() -> dict[str, bytes]:
    rng = np.random.default_rng(0)
    cal = [{"x": rng.standard_normal((4, 16)).astype(np.float32)}]
    return {
        "mlp": compile_graph(models.mlp()).code_object,
        "cnn": compile_graph(models.cnn()).code_object,
        "encoder": compile_graph(models.encoder_block()).code_object,
        "mlp_int8": compile_graph(models.mlp(),
                                  options=CompileOptions(calibration=cal)).code_object,
    }


OBJECTS = _objects()


@pytest.mark.parametrize("name", sorted(OBJECTS))
def test_readelf_reads_every_code_object_without_warnings(name: str, tmp_path: Path) -> None:
    path = tmp_path / f"{name}.vaelf"
    path.write_bytes(OBJECTS[name])
    out = readelf_clean(str(path))
    assert "REL (Relocatable file)" in out and "0x5641" in out
    for sec in (".va1.text", ".va1.const", ".va1.bss", ".va1.args", ".rela.va1.text",
                ".note.va1", ".symtab"):
        assert sec in out
    assert "VA-1" in out            # the note's owner


@pytest.mark.parametrize("name", sorted(OBJECTS))
def test_pyelftools_reads_sections_symbols_relocations_and_note(name: str) -> None:
    data = OBJECTS[name]
    elf = ELFFile(io.BytesIO(data))
    assert elf.elfclass == 64 and elf.little_endian
    assert elf["e_machine"] == F.EM_VA1 and elf["e_type"] == "ET_REL"
    text = elf.get_section_by_name(".va1.text")
    assert text["sh_type"] == "SHT_PROGBITS" and text.data_size % 8 == 0
    syms = {s.name: s for s in elf.get_section_by_name(".symtab").iter_symbols()}
    assert syms["main"]["st_info"]["type"] == "STT_FUNC"
    assert syms["main"]["st_size"] == text.data_size
    rela = elf.get_section_by_name(".rela.va1.text")
    relocs = list(rela.iter_relocations())
    assert relocs and all(r["r_info_type"] == F.R_VA1_DEVADDR64 for r in relocs)
    notes = list(elf.get_section_by_name(".note.va1").iter_notes())
    assert len(notes) == 1 and notes[0]["n_name"] == "VA-1"
    assert notes[0]["n_type"] == F.NT_VA1_METADATA
    assert json.loads(notes[0]["n_desc"].rstrip(b"\0"))["format"] == 1
    obj = co.read(data)
    fn = obj.function("main")
    meta = obj.metadata
    assert meta["isa_version"] == 0x00010000
    assert meta["memory"]["total"] == meta["memory"]["const"] + meta["memory"]["workspace"] \
        + meta["memory"]["args"]
    arg_syms = [a.symbol for a in fn.args]
    assert all(syms[s]["st_info"]["type"] == "STT_OBJECT" for s in arg_syms)
    assert ("int8" in meta["features"]) == name.endswith("int8")


def test_round_trip_is_stable() -> None:
    obj = co.read(OBJECTS["encoder"])
    assert co.write(obj) == OBJECTS["encoder"]


# --- malformed files ------------------------------------------------------------------


def _shdrs(data: bytes) -> list[tuple[str, int, tuple[int, ...]]]:
    ehdr = F.EHDR.unpack_from(data)
    shoff, shnum, shstrndx = ehdr[6], ehdr[12], ehdr[13]
    hdrs = [F.SHDR.unpack_from(data, shoff + i * 64) for i in range(shnum)]
    stroff = hdrs[shstrndx][4]
    out = []
    for i, h in enumerate(hdrs):
        end = data.index(b"\0", stroff + h[0])
        out.append((data[stroff + h[0]:end].decode(), shoff + i * 64, h))
    return out


def _section(data: bytes, name: str) -> tuple[int, int, tuple[int, ...]]:
    for n, hoff, h in _shdrs(data):
        if n == name:
            return h[4], hoff, h
    raise KeyError(name)


def _patch(data: bytes, offset: int, fmt: str, *values: int) -> bytes:
    b = bytearray(data)
    struct.pack_into(fmt, b, offset, *values)
    return bytes(b)


def _reloc_off(data: bytes, field: int) -> int:
    off, _, _ = _section(data, ".rela.va1.text")
    return off + field


def _symbol_offset(data: bytes, name: str) -> int:
    off, _, h = _section(data, ".symtab")
    stroff = _section(data, ".strtab")[0]
    for i in range(h[5] // 24):
        st_name = struct.unpack_from("<I", data, off + i * 24)[0]
        end = data.index(b"\0", stroff + st_name)
        if data[stroff + st_name:end].decode() == name:
            return off + i * 24
    raise KeyError(name)


def _note_desc(data: bytes) -> int:
    off, _, _ = _section(data, ".note.va1")
    namesz = struct.unpack_from("<I", data, off)[0]
    return off + 12 + (namesz + 3) // 4 * 4


GOOD = OBJECTS["mlp"]

BAD: dict[str, tuple[Callable[[bytes], bytes], str]] = {
    "empty": (lambda d: b"", "truncated ELF"),
    "truncated header": (lambda d: d[:40], "truncated ELF"),
    "truncated sections": (lambda d: d[:len(d) // 2], "truncated ELF"),
    "truncated last byte": (lambda d: d[:-1], "truncated ELF"),
    "not elf": (lambda d: b"\x7fELG" + d[4:], "not an ELF file"),
    "wrong class": (lambda d: d[:4] + b"\x01" + d[5:], "wrong ELF class"),
    "big endian": (lambda d: d[:5] + b"\x02" + d[6:], "data encoding"),
    "wrong machine": (lambda d: _patch(d, 18, "<H", 62), "wrong machine 0x3e"),
    "wrong type": (lambda d: _patch(d, 16, "<H", 2), "wrong ELF type"),
    "relocation outside its section": (
        lambda d: _patch(d, _reloc_off(d, 0), "<Q", 0x10000),
        "outside its section .va1.text"),
    "relocation misaligned": (
        lambda d: _patch(d, _reloc_off(d, 0), "<Q", 4), "misaligned"),
    "relocation not on an address field": (
        lambda d: _patch(d, _reloc_off(d, 0), "<Q", 8), "does not land on a u64 field"),
    "unknown relocation type": (
        lambda d: _patch(d, _reloc_off(d, 8), "<I", 77), "unknown relocation type 77"),
    "relocation symbol out of range": (
        lambda d: _patch(d, _reloc_off(d, 12), "<I", 9999), "symbol index 9999"),
    "relocation against the command stream": (
        lambda d: _patch(d, _reloc_off(d, 12), "<I", 1), "is not a device-memory target"),
    "relocation addend out of range": (
        lambda d: _patch(d, _reloc_off(d, 16), "<q", 1 << 40), "points outside symbol"),
    "note missing": (
        lambda d: d.replace(b".note.va1\0", b".note.xx1\0"), "metadata note missing"),
    "note of another owner": (
        lambda d: d.replace(b"VA-1\0\0\0\0{", b"VB-1\0\0\0\0{"), "metadata note missing"),
    "note not json": (
        lambda d: _patch(d, _note_desc(d), "<B", ord("x")), "malformed metadata note"),
    "note field missing": (
        lambda d: d.replace(b'"isa_version"', b'"isa_versiom"'),
        "malformed metadata note: note: missing 'isa_version'"),
    "note memory mismatch": (
        lambda d: d.replace(b'"workspace":', b'"workspacf":'),
        "malformed metadata note"),
    "note arg dtype": (
        lambda d: d.replace(b'"dtype":"float32"', b'"dtype":"float64"', 1),
        "dtype 'float64'"),
    "note length past section": (
        lambda d: _patch(d, _section(d, ".note.va1")[0] + 4, "<I", 0xFFFF),
        "runs past its section"),
    "symbol out of range": (
        lambda d: _patch(d, _symbol_offset(d, "main") + 8, "<Q", 0x100000),
        "'main' out of range: [0x100000"),
    "symbol size out of range": (
        lambda d: _patch(d, _symbol_offset(d, "main.in0.x") + 16, "<Q", 1 << 20),
        "'main.in0.x' out of range"),
    "symbol in no section": (
        lambda d: _patch(d, _symbol_offset(d, "main") + 6, "<H", 0),
        "is not a VA-1 section"),
    "symbol name outside strtab": (
        lambda d: _patch(d, _symbol_offset(d, "main"), "<I", 0xFFFFFF), "outside .strtab"),
    "section past end": (
        lambda d: _patch(d, _section(d, ".va1.const")[1] + 32, "<Q", 1 << 30),
        "runs past the end of the file"),
    "command stream corrupt": (
        lambda d: _patch(d, _section(d, ".va1.text")[0] + 4, "<I", 12),
        "does not decode as VA-1 commands"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_malformed_code_objects_are_rejected_with_a_clear_error(case: str) -> None:
    mutate, message = BAD[case]
    bad = mutate(GOOD)
    assert bad != GOOD or case == "empty"
    with pytest.raises(co.CodeObjectError) as ei:
        Module.from_bytes(bad)
    assert message in str(ei.value), str(ei.value)


def test_from_file_names_the_file(tmp_path: Path) -> None:
    p = tmp_path / "broken.vaelf"
    p.write_bytes(GOOD[:100])
    with pytest.raises(co.CodeObjectError, match="broken.vaelf: code object: truncated"):
        Module.from_file(p)


# --- objdump ----------------------------------------------------------------------------


def test_objdump_prints_sections_symbols_relocations_metadata_disassembly(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    p = tmp_path / "enc.vaelf"
    p.write_bytes(OBJECTS["encoder"])
    assert cli_main(["objdump", str(p)]) == 0
    out = capsys.readouterr().out
    for needle in ("Sections:", ".va1.text", "Symbols:", "FUNC", "main.in0.x",
                   "Relocations (", "R_VA1_DEVADDR64", "Metadata (note 'VA-1'",
                   '"isa_version": 65536', "Disassembly of main", "SOFTMAX", "LAYERNORM",
                   "GEMM", "<main:"):
        assert needle in out, needle
    meta = co.read(OBJECTS["encoder"]).metadata
    assert json.dumps(meta["memory"]["total"]) in out


def test_objdump_rejects_a_bad_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    p = tmp_path / "bad.vaelf"
    p.write_bytes(GOOD[:-3])
    assert cli_main(["objdump", str(p)]) == 2
    assert "truncated ELF" in capsys.readouterr().err
