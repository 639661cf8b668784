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
        "malformed metadata note: isa_version is missing"),
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


# --- untrusted metadata notes and sections -----------------------------------------------


def _with_note(data: bytes, desc: bytes) -> bytes:
    """`data` with its metadata note's descriptor replaced by `desc`: the new note is
    appended after the section header table and .note.va1's header points at it."""
    _, hoff, h = _section(data, ".note.va1")
    owner = b"VA-1\0"
    note = F.NHDR.pack(len(owner), len(desc), F.NT_VA1_METADATA) + owner + b"\0" * 3
    note += desc + b"\0" * (-len(desc) % 4)
    base = len(data) + (-len(data) % 4)
    out = bytearray(data + b"\0" * (base - len(data)) + note)
    struct.pack_into("<QQ", out, hoff + 24, base, len(note))
    return bytes(out)


def _note_json(data: bytes) -> dict[str, object]:
    off, _, h = _section(data, ".note.va1")
    namesz, descsz = struct.unpack_from("<II", data, off)
    start = off + 12 + (namesz + 3) // 4 * 4
    doc: dict[str, object] = json.loads(data[start:start + descsz])
    return doc


def _edit(edit: Callable[[dict[str, object]], object]) -> Callable[[bytes], bytes]:
    """A mutation that edits the note's JSON object (edit changes it in place, or
    returns raw bytes to use as the descriptor)."""
    def mutate(data: bytes) -> bytes:
        meta = _note_json(data)
        raw = edit(meta)
        desc = raw if isinstance(raw, bytes) else json.dumps(meta).encode()
        return _with_note(data, desc)
    return mutate


def _memory(meta: dict[str, object]) -> dict[str, object]:
    mem = meta["memory"]
    assert isinstance(mem, dict)
    return mem


def _arg0(meta: dict[str, object]) -> dict[str, object]:
    funcs = meta["functions"]
    assert isinstance(funcs, list)
    arg: dict[str, object] = funcs[0]["args"][0]
    return arg


def _raw(meta: dict[str, object], old: bytes, new: bytes) -> bytes:
    raw = json.dumps(meta, separators=(",", ":")).encode()
    assert old in raw
    return raw.replace(old, new, 1)


def _nested(depth: int) -> Callable[[dict[str, object]], bytes]:
    def edit(meta: dict[str, object]) -> bytes:
        return _raw(meta, b'"compiler":{', b'"deep":' + b"[" * depth + b"]" * depth
                    + b',"compiler":{')
    return edit


def _compressed(data: bytes) -> bytes:
    _, hoff, h = _section(data, ".va1.const")
    return _patch(data, hoff + 8, "<Q", h[2] | F.SHF_COMPRESSED)


UNTRUSTED: dict[str, tuple[Callable[[bytes], bytes], str]] = {
    "memory.total missing": (
        _edit(lambda m: _memory(m).pop("total")), "memory.total is missing"),
    "memory.total Infinity": (
        _edit(lambda m: _raw(m, b'"total":', b'"total":Infinity,"x":')),
        "Infinity is not a JSON number"),
    "memory.total NaN": (
        _edit(lambda m: _raw(m, b'"total":', b'"total":NaN,"x":')), "NaN is not a JSON number"),
    "memory.total 1e400": (
        _edit(lambda m: _raw(m, b'"total":', b'"total":1e400,"x":')),
        "memory.total is a number, expected an integer"),
    "memory.total a float": (
        _edit(lambda m: _memory(m).update(total=1.5)),
        "memory.total is a number, expected an integer"),
    "memory.total wrong": (
        _edit(lambda m: _memory(m).update(total=7)), "memory.total = 7 is not const"),
    "memory.const negative": (
        _edit(lambda m: _memory(m).update(const=-1)), "memory.const = -1 is outside 0"),
    "memory unknown key": (
        _edit(lambda m: _memory(m).update(spare=1)), "memory has unknown key 'spare'"),
    "deeply nested": (_edit(_nested(100_000)), "nested 100001 levels deep"),
    "nested just too deep": (_edit(_nested(16)), "nested 17 levels deep"),
    "brackets in strings do not count": (
        _edit(lambda m: _raw(m, b'"compiler":{', b'"deep":"' + b"[" * 50 + b'",'
                             + b'"compiler":{')), "the note has unknown key 'deep'"),
    "duplicate key": (
        _edit(lambda m: _raw(m, b'"format":1', b'"format":1,"format":1')),
        "key 'format' appears twice"),
    "not utf-8": (_edit(lambda m: _raw(m, b'"main"', b'"m\xffn"')), "not UTF-8"),
    "not an object": (_edit(lambda m: b"[1, 2]"), "is an array, not an object"),
    "isa_version out of range": (
        _edit(lambda m: m.update(isa_version=1 << 40)), "isa_version = 1099511627776 is "
                                                        "outside 0 .. 4294967295"),
    "isa_version differs from e_flags": (
        _edit(lambda m: m.update(isa_version=0x00010001)), "differs from the ELF header's "
                                                           "e_flags 0x10000"),
    "features not strings": (
        _edit(lambda m: m.update(features=[1])), "features[0] is an integer"),
    "features repeated": (
        _edit(lambda m: m.update(features=["int8", "int8"])), "repeat a name"),
    "functions empty": (_edit(lambda m: m.update(functions=[])), "functions is empty"),
    "function twice": (
        _edit(lambda m: m.update(functions=m["functions"] * 2)),  # type: ignore[operator]
        "functions[1].name 'main' is used by an earlier function"),
    "function not an object": (
        _edit(lambda m: m.update(functions=[3])), "functions[0] is an integer"),
    "arg shape negative": (
        _edit(lambda m: _arg0(m).update(shape=[-4, 16])), "args[0].shape[0] = -4 is not a "
                                                          "dimension"),
    "arg shape boolean": (
        _edit(lambda m: _arg0(m).update(shape=[True, 16])), "args[0].shape[0] = True"),
    "arg shape rank": (
        _edit(lambda m: _arg0(m).update(shape=[1] * 40)), "args[0].shape has 40 dimensions"),
    "arg kind": (
        _edit(lambda m: _arg0(m).update(kind="inout")), "args[0].kind 'inout' is not input"),
    "arg name empty": (
        _edit(lambda m: _arg0(m).update(name="")), "args[0].name is empty"),
    "arg unknown key": (
        _edit(lambda m: _arg0(m).update(layout="nchw")),
        "functions[0].args[0] has unknown key 'layout'"),
    "arg symbol of another argument": (
        _edit(lambda m: m["functions"][0]["args"][1].update(  # type: ignore[index]
            symbol=_arg0(m)["symbol"], shape=_arg0(m)["shape"])),
        "functions[0].args[1].symbol 'main.in0.x' is also functions[0].args[0]"),
    "arg symbol not in .va1.args": (
        _edit(lambda m: _arg0(m).update(symbol="main")), "args[0].symbol 'main' is not an "
                                                         "object in .va1.args"),
    "compiler field mistyped": (
        _edit(lambda m: m["compiler"].update(scratchpad_size="big")),  # type: ignore[attr-defined]
        "compiler.scratchpad_size is a string"),
    "unknown top-level key": (
        _edit(lambda m: m.update(extra=1)), "the note has unknown key 'extra'"),
    "compressed section": (
        _compressed, "section .va1.const (#2) has SHF_COMPRESSED set"),
}


@pytest.mark.parametrize("case", sorted(UNTRUSTED))
def test_untrusted_note_and_section_rejected_naming_the_field(case: str) -> None:
    mutate, message = UNTRUSTED[case]
    bad = mutate(GOOD)
    with pytest.raises(co.CodeObjectError) as ei:
        Module.from_bytes(bad)
    assert message in str(ei.value), str(ei.value)
    assert "\n" not in str(ei.value)


def test_a_rewritten_but_unchanged_note_still_loads() -> None:
    """The helpers above change only what each case says."""
    same = _edit(lambda m: None)(GOOD)
    assert same != GOOD
    assert co.read(same).metadata == co.read(GOOD).metadata


class _StubDevice:
    """Just what Module.check_device reads: a device with every feature and dtype."""

    params = {"isa_version": 0x00010000, "device_memory_size": 256 << 20,
              "dtype_mask": 0xF}

    def has_feature(self, bit: int) -> bool:
        return True

    def supports_dtype(self, dtype: object) -> bool:
        return True


class _StubContext:
    device = _StubDevice()


def _fuzz_case(seed: int, good: bytes) -> bytes:
    """A corrupted copy of `good`: a truncation, or a few bit flips anywhere, in the
    headers, or in the metadata note."""
    rng = np.random.default_rng(seed)
    kind = seed % 4
    if kind == 0:
        return good[:int(rng.integers(0, len(good)))]
    b = bytearray(good)
    note_off, _, h = _section(good, ".note.va1")
    shoff = F.EHDR.unpack_from(good)[6]
    spans = {1: (0, len(good)), 2: (shoff, len(good)), 3: (note_off, note_off + h[5])}
    lo, hi = spans[kind]
    for _ in range(int(rng.integers(1, 5))):
        if rng.random() < 0.2:
            i = int(rng.integers(0, F.EHDR.size))
        else:
            i = int(rng.integers(lo, hi))
        b[i] ^= 1 << int(rng.integers(0, 8))
    return bytes(b)


def test_fuzzed_code_objects_load_or_give_a_code_object_error() -> None:
    """400 corrupted copies of a valid object (pinned seeds): each either reads and
    passes the device check, or is a CodeObjectError; never another exception."""
    outcomes = {"rejected": 0, "loaded": 0}
    for seed in range(400):
        bad = _fuzz_case(seed, GOOD)
        try:
            mod = Module.from_bytes(bad)
        except co.CodeObjectError as e:
            assert str(e).startswith("code object: ") and "\n" not in str(e), (seed, e)
            outcomes["rejected"] += 1
            continue
        mod.check_device(_StubContext())  # type: ignore[arg-type]
        assert mod.function_names
        outcomes["loaded"] += 1
    assert outcomes["rejected"] > 200 and outcomes["loaded"] > 20, outcomes
