"""Modules: compiled code objects loaded onto a device, and their functions.

    mod = Module.from_file("mlp.vaelf")            # parse + check (no device yet)
    loaded = mod.load(ctx)                        # allocate, upload constants, relocate
    fn = loaded.function("main")
    out = fn(stream, {"x": x})                    # {output name: ndarray}

Loading allocates one device buffer for the constants (.va1.const), one for the
workspace (.va1.bss) and one per argument slot, then patches every R_VA1_DEVADDR64
field of the command stream with the device address of its symbol plus the addend.
A launch uploads the inputs, enqueues the patched commands and downloads the outputs.
Functions of one loaded module share its workspace: launches on one stream only.
"""
from __future__ import annotations

import os
import struct
from typing import Any, Mapping, Sequence

import numpy as np

from hwspec import isa, va1

from . import codeobject as co
from ._device import Buffer, Context
from ._errors import UserspaceRuntimeError
from ._stream import Pending, Stream
from .commands import CommandBufferBuilder, decode

__all__ = ["Function", "LoadedModule", "Module", "ModuleError"]


class ModuleError(UserspaceRuntimeError, ValueError):
    """A module cannot be loaded or launched here (device lacks a feature, memory ...)."""


_FEATURE_BITS = {"int8": va1.F_INT8, "fp16": va1.F_FP16}
_DTYPE_CODES = {"float32": isa.DType.F32, "float16": isa.DType.F16, "int8": isa.DType.I8,
                "int32": isa.DType.I32}


class Module:
    """A parsed, checked code object (not yet on a device)."""

    def __init__(self, obj: co.CodeObject, source: str = "<bytes>") -> None:
        self.code = obj
        self.source = source

    @classmethod
    def from_bytes(cls, data: bytes | bytearray | memoryview, source: str = "<bytes>"
                   ) -> Module:
        return cls(co.read(data), source)

    @classmethod
    def from_file(cls, path: str | os.PathLike[str]) -> Module:
        with open(path, "rb") as f:
            data = f.read()
        try:
            return cls(co.read(data), os.fspath(path))
        except co.CodeObjectError as e:
            raise co.CodeObjectError(f"{os.fspath(path)}: {e}") from None

    @property
    def metadata(self) -> dict[str, Any]:
        return self.code.metadata

    @property
    def function_names(self) -> list[str]:
        return [f.name for f in self.code.functions]

    def check_device(self, context: Context) -> None:
        """ModuleError if the device lacks the ISA version, a feature, a dtype or the
        memory the code object needs."""
        params = context.device.params
        need = int(self.metadata["isa_version"])
        have = int(params.get("isa_version", va1.ISA_VERSION))
        if need >> 16 != have >> 16 or (need & 0xFFFF) > (have & 0xFFFF):
            raise ModuleError(f"{self.source}: needs ISA {need >> 16}.{need & 0xFFFF}, the "
                              f"device runs {have >> 16}.{have & 0xFFFF}")
        for feat in self.metadata["features"]:
            bit = _FEATURE_BITS.get(feat)
            if bit is None:
                raise ModuleError(f"{self.source}: unknown feature {feat!r}")
            if not context.device.has_feature(bit):
                raise ModuleError(f"{self.source}: needs feature {feat!r}, which the device "
                                  f"did not negotiate")
            if feat == "int8" and not (context.device.supports_dtype(isa.DType.I8)
                                       and context.device.supports_dtype(isa.DType.I32)):
                raise ModuleError(f"{self.source}: needs int8 and int32 tensors, which the "
                                  f"device's dtype_mask "
                                  f"{context.device.params['dtype_mask']:#x} lacks")
        total = int(self.metadata["memory"]["total"])
        mem = params.get("device_memory_size")
        if mem is not None and total > mem:
            raise ModuleError(f"{self.source}: needs {total} bytes of device memory, the "
                              f"device has {mem}")

    def load(self, context: Context, stream: Stream | None = None) -> LoadedModule:
        """Allocate device memory, upload the constants and resolve relocations."""
        self.check_device(context)
        return LoadedModule(self, context, stream)


class LoadedModule:
    """A module on one context: its buffers and relocated functions."""

    def __init__(self, module: Module, context: Context, stream: Stream | None) -> None:
        self.module = module
        self.context = context
        code = module.code
        self._bufs: list[Buffer] = []
        try:
            self.const = self._alloc(max(len(code.const), 1))
            self.workspace = self._alloc(max(code.workspace_size, 1))
            self.args: dict[str, Buffer] = {}
            for f in code.functions:
                for a in f.args:
                    self.args[a.symbol] = self._typed(a)
            own = stream is None
            s = stream or context.create_stream()
            try:
                s.upload(self.const, np.frombuffer(code.const.ljust(self.const.size, b"\0"),
                                                   np.int8))
                s.synchronize()
            finally:
                if own:
                    s.destroy()
            self._functions = {f.name: Function(self, f) for f in code.functions}
        except BaseException:
            self.free()
            raise

    def _alloc(self, nbytes: int) -> Buffer:
        buf = self.context.alloc((nbytes,), np.int8)
        self._bufs.append(buf)
        return buf

    def _typed(self, a: co.ArgSlot) -> Buffer:
        buf = self.context.alloc(a.shape or (1,), np.dtype(a.dtype))
        self._bufs.append(buf)
        return buf

    def symbol_address(self, name: str) -> int:
        """The device address a relocation against symbol `name` resolves to."""
        if name == co._format.CONST:
            return self.const.addr
        if name == co._format.BSS:
            return self.workspace.addr
        if name in self.args:
            return self.args[name].addr
        raise co.CodeObjectError(f"relocation against unknown symbol {name!r}")

    def function(self, name: str = "main") -> Function:
        try:
            return self._functions[name]
        except KeyError:
            raise KeyError(f"{self.module.source}: no function {name!r} (functions: "
                           f"{', '.join(self._functions)})") from None

    @property
    def buffers(self) -> list[Buffer]:
        return list(self._bufs)

    def free(self) -> None:
        for b in self._bufs:
            if not b.freed:
                b.free()
        self._bufs.clear()


class Function:
    """An entry point, relocated for its LoadedModule."""

    def __init__(self, loaded: LoadedModule, info: co.FunctionInfo) -> None:
        self.loaded = loaded
        self.info = info
        self.name = info.name
        code = loaded.module.code
        text = bytearray(code.text[info.offset:info.offset + info.size])
        for r in code.relocations:
            if info.offset <= r.offset < info.offset + info.size:
                addr = loaded.symbol_address(r.symbol) + r.addend
                struct.pack_into("<Q", text, r.offset - info.offset, addr)
        labels = sorted(info.labels)
        self.commands = CommandBufferBuilder()
        li = 0
        label = info.name
        for cmd in decode(bytes(text)):
            while li < len(labels) and labels[li][0] - info.offset <= cmd.offset:
                label = labels[li][1]
                li += 1
            payload = bytes(text[cmd.offset + isa.HEADER.size:cmd.offset + cmd.length])
            self.commands.raw(cmd.opcode, payload, flags=cmd.flags,
                              name=f"{label} ({cmd.opcode_name} at {info.symbol}+"
                                   f"{cmd.offset:#x})")

    def _chunks(self, limit: int) -> list[CommandBufferBuilder]:
        """The commands split at command boundaries into submissions <= `limit` bytes."""
        if len(self.commands) <= limit:
            return [self.commands]
        out = [CommandBufferBuilder()]
        data = self.commands.view()
        for rec in self.commands.commands:
            if out[-1].size + rec.length > limit:
                out.append(CommandBufferBuilder())
            out[-1].raw(rec.opcode, bytes(data[rec.offset + isa.HEADER.size:
                                               rec.offset + rec.length]),
                        flags=int.from_bytes(data[rec.offset + 2:rec.offset + 4], "little"),
                        name=rec.name)
        return out

    @property
    def inputs(self) -> list[co.ArgSlot]:
        return self.info.inputs

    @property
    def outputs(self) -> list[co.ArgSlot]:
        return self.info.outputs

    def _feeds(self, inputs: Mapping[str, Any] | Sequence[Any]) -> list[np.ndarray]:
        slots = self.inputs
        if isinstance(inputs, Mapping):
            unknown = set(inputs) - {a.name for a in slots}
            if unknown:
                raise ValueError(f"{self.name}: unknown inputs {sorted(unknown)} (inputs: "
                                 f"{[a.name for a in slots]})")
            missing = [a.name for a in slots if a.name not in inputs]
            if missing:
                raise ValueError(f"{self.name}: missing inputs {missing}")
            values = [inputs[a.name] for a in slots]
        else:
            values = list(inputs)
            if len(values) != len(slots):
                raise ValueError(f"{self.name}: {len(values)} inputs given, "
                                 f"{len(slots)} expected")
        out = []
        for a, v in zip(slots, values):
            arr = np.asarray(v)
            if a.dtype == "int32" and arr.dtype == np.int64:
                # token ids and indices from int64 models: the VA-1 has no int64, the
                # compiler took the argument as int32; narrowing must lose nothing
                if arr.size and (arr.min() < -2**31 or arr.max() >= 2**31):
                    raise ValueError(f"{self.name}: input {a.name!r} has int64 values "
                                     f"outside int32 ([{arr.min()}, {arr.max()}])")
                arr = arr.astype(np.int32)
            if a.dtype == "int8" and arr.dtype == np.bool_:
                arr = arr.astype(np.int8)     # booleans are int8 masks of 0 / 1
            if arr.dtype != np.dtype(a.dtype):
                raise TypeError(f"{self.name}: input {a.name!r} has dtype {arr.dtype}, "
                                f"expected {a.dtype}")
            if arr.shape != tuple(a.shape):
                raise ValueError(f"{self.name}: input {a.name!r} has shape {arr.shape}, "
                                 f"expected {tuple(a.shape)}")
            out.append(arr.reshape(a.shape or (1,)))
        return out

    def launch(self, stream: Stream, inputs: Mapping[str, Any] | Sequence[Any],
               outputs: Mapping[str, np.ndarray] | None = None) -> dict[str, Pending]:
        """Upload inputs, run the function, download outputs (Pending per output);
        `outputs` may give arrays (right shape and dtype) to download into."""
        if stream.context is not self.loaded.context:
            raise ValueError(f"{self.name}: the stream belongs to another context")
        feeds = self._feeds(inputs)
        outs = dict(outputs or {})
        unknown = set(outs) - {a.name for a in self.outputs}
        if unknown:
            raise ValueError(f"{self.name}: unknown outputs {sorted(unknown)}")
        for a in self.outputs:
            o = outs.get(a.name)
            if o is not None and (not isinstance(o, np.ndarray) or o.dtype != np.dtype(a.dtype)
                                  or o.shape != (a.shape or (1,))):
                raise ValueError(f"{self.name}: output {a.name!r} must be a "
                                 f"{a.dtype} array of shape {a.shape or (1,)}")
        args = self.loaded.args
        for a, arr in zip(self.inputs, feeds):
            stream.upload(args[a.symbol], arr)
        for chunk in self._chunks(int(stream.context.device.params["max_cmdbuf_size"])):
            stream.enqueue(chunk, self.loaded.buffers)
        return {a.name: stream.download(args[a.symbol], out=outs.get(a.name))
                for a in self.outputs}

    def __call__(self, stream: Stream, inputs: Mapping[str, Any] | Sequence[Any]
                 ) -> dict[str, np.ndarray]:
        """launch() and wait: {output name: array}."""
        pend = self.launch(stream, inputs)
        stream.synchronize()
        return {k: p.result().reshape(next(a.shape for a in self.outputs if a.name == k))
                for k, p in pend.items()}
