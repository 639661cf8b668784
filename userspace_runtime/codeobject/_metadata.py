"""The metadata note's JSON: parsed with a nesting limit and checked field by field.

A code object may come from anywhere, so the note is parsed as untrusted text: no
NaN/Infinity, no duplicate keys, at most MAX_DEPTH levels of nesting (checked before
`json.loads`, which recurses), and every field of format 1 (docs/compiler.md) checked
for presence, type and range. Unknown keys are refused: the format number is the way
to add fields. Each error names the field by its path (`functions[0].args[1].shape`).
"""
from __future__ import annotations

import json
import re
from typing import Any, NoReturn

import numpy as np

from ._format import METADATA_FORMAT, CodeObjectError

MAX_DEPTH = 16            # format 1 nests 4 deep (note -> functions -> args -> shape)
MAX_RANK = 32            # dimensions of an argument's shape
MAX_NOTE_BYTES = 1 << 24  # 16 MiB of JSON is far beyond any real graph's metadata
DTYPE_SIZES = {"float32": 4, "float16": 2, "int8": 1, "int32": 4}
_U32 = (1 << 32) - 1
_U64 = (1 << 64) - 1
_STRING = re.compile(rb'"(?:[^"\\]|\\.)*"', re.DOTALL)
_NOT_BRACKETS = bytes(c for c in range(256) if c not in b"[]{}")


def _fail(msg: str) -> NoReturn:
    raise CodeObjectError(f"code object: malformed metadata note: {msg}")


def _depth(raw: bytes) -> int:
    """Deepest [ / { nesting of `raw` outside JSON strings."""
    brackets = _STRING.sub(b"", raw).translate(None, _NOT_BRACKETS)
    if not brackets:
        return 0
    steps = np.frombuffer(brackets, np.uint8)
    return int(np.cumsum(np.where((steps == ord("[")) | (steps == ord("{")), 1, -1)).max())


def _constant(name: str) -> NoReturn:
    _fail(f"{name} is not a JSON number (NaN and Infinity are not allowed)")


def _pairs(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in pairs:
        if k in out:
            _fail(f"key {k!r} appears twice in one object")
        out[k] = v
    return out


def parse(raw: bytes) -> dict[str, Any]:
    """The note's descriptor as a JSON object, or CodeObjectError saying why not."""
    if len(raw) > MAX_NOTE_BYTES:
        _fail(f"the description is {len(raw)} bytes (at most {MAX_NOTE_BYTES})")
    deepest = _depth(raw)
    if deepest > MAX_DEPTH:
        _fail(f"JSON nested {deepest} levels deep (at most {MAX_DEPTH})")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        _fail(f"the description is not UTF-8 ({e})")
    try:
        obj = json.loads(text, parse_constant=_constant, object_pairs_hook=_pairs)
    except CodeObjectError:
        raise
    except (ValueError, RecursionError) as e:
        _fail(f"the description is not JSON ({type(e).__name__}: {e})")
    if not isinstance(obj, dict):
        _fail(f"the description is {_type_name(obj)}, not an object")
    return obj


def _type_name(v: Any) -> str:
    """`v`'s JSON type with its article: "an integer", "a string", ..."""
    return {bool: "a boolean", int: "an integer", float: "a number", str: "a string",
            list: "an array", dict: "an object", type(None): "null"}.get(type(v), "a value")


def field(obj: dict[str, Any], key: str, path: str, typ: type) -> Any:
    """obj[key], which must exist and be a `typ` (bool is not an int here)."""
    where = f"{path}.{key}" if path else key
    if key not in obj:
        _fail(f"{where} is missing")
    v = obj[key]
    if not isinstance(v, typ) or (isinstance(v, bool) and typ is not bool):
        _fail(f"{where} is {_type_name(v)}, expected {_type_name(typ())}")
    return v


def integer(obj: dict[str, Any], key: str, path: str, lo: int, hi: int) -> int:
    v: int = field(obj, key, path, int)
    if not lo <= v <= hi:
        _fail(f"{path + '.' if path else ''}{key} = {v} is outside {lo} .. {hi}")
    return v


def string(obj: dict[str, Any], key: str, path: str) -> str:
    v: str = field(obj, key, path, str)
    if not v or "\0" in v:
        _fail(f"{path + '.' if path else ''}{key} is empty or contains a NUL")
    return v


def only_keys(obj: dict[str, Any], path: str, allowed: set[str]) -> None:
    extra = sorted(set(obj) - allowed)
    if extra:
        _fail(f"{path or 'the note'} has unknown key {extra[0]!r} (format {METADATA_FORMAT} "
              f"has {', '.join(sorted(allowed))})")


def check(meta: dict[str, Any], memory: dict[str, int]) -> None:
    """Every field of format 1 except the symbol cross-references (the reader's part).

    `memory`: the sizes of .va1.const, .va1.bss and .va1.args from their headers."""
    fmt = field(meta, "format", "", int)
    if fmt != METADATA_FORMAT:
        _fail(f"format {fmt} is not supported (expected {METADATA_FORMAT})")
    integer(meta, "isa_version", "", 0, _U32)
    feats = field(meta, "features", "", list)
    for i, f in enumerate(feats):
        if not isinstance(f, str) or not f:
            _fail(f"features[{i}] is {_type_name(f)}, expected a feature name")
    if len(set(feats)) != len(feats):
        _fail(f"features {feats} repeat a name")
    mem = field(meta, "memory", "", dict)
    for key in ("const", "workspace", "args"):
        v = integer(mem, key, "memory", 0, _U64)
        if v != memory[key]:
            _fail(f"memory.{key} = {v} but the section holds {memory[key]}")
    total = integer(mem, "total", "memory", 0, _U64)
    if total != sum(memory.values()):
        _fail(f"memory.total = {total} is not const + workspace + args "
              f"({sum(memory.values())})")
    only_keys(mem, "memory", {"const", "workspace", "args", "total"})
    funcs = field(meta, "functions", "", list)
    if not funcs:
        _fail("functions is empty (a code object has at least one function)")
    names: set[str] = set()
    for fi, fm in enumerate(funcs):
        where = f"functions[{fi}]"
        if not isinstance(fm, dict):
            _fail(f"{where} is {_type_name(fm)}, expected an object")
        name = string(fm, "name", where)
        if name in names:
            _fail(f"{where}.name {name!r} is used by an earlier function")
        names.add(name)
        string(fm, "symbol", where)
        arg_names: set[str] = set()
        for ai, am in enumerate(field(fm, "args", where, list)):
            aw = f"{where}.args[{ai}]"
            if not isinstance(am, dict):
                _fail(f"{aw} is {_type_name(am)}, expected an object")
            an = string(am, "name", aw)
            if an in arg_names:
                _fail(f"{aw}.name {an!r} is used by an earlier argument of {name!r}")
            arg_names.add(an)
            kind = field(am, "kind", aw, str)
            if kind not in ("input", "output"):
                _fail(f"{aw}.kind {kind!r} is not input or output")
            shape = field(am, "shape", aw, list)
            if len(shape) > MAX_RANK:
                _fail(f"{aw}.shape has {len(shape)} dimensions (at most {MAX_RANK})")
            for di, d in enumerate(shape):
                if not isinstance(d, int) or isinstance(d, bool) or not 1 <= d <= _U64:
                    _fail(f"{aw}.shape[{di}] = {d!r} is not a dimension (an integer "
                          f">= 1)")
            dtype = field(am, "dtype", aw, str)
            if dtype not in DTYPE_SIZES:
                _fail(f"{aw}.dtype {dtype!r} is not one of {sorted(DTYPE_SIZES)}")
            string(am, "symbol", aw)
            only_keys(am, aw, {"name", "kind", "shape", "dtype", "symbol"})
        only_keys(fm, where, {"name", "symbol", "args"})
    only_keys(meta, "", {"format", "isa_version", "features", "memory", "functions",
                         "compiler"})
    if "compiler" in meta:
        comp = field(meta, "compiler", "", dict)
        only_keys(comp, "compiler", {"passes", "scratchpad_size", "workspace_peak"})
        for key in ("scratchpad_size", "workspace_peak"):
            if key in comp:
                integer(comp, key, "compiler", 0, _U64)
        if "passes" in comp:
            passes = field(comp, "passes", "compiler", dict)
            for key in passes:
                integer(passes, key, "compiler.passes", 0, _U64)
