"""Running a model on the stack from Python: `run_model(model, inputs)`.

Why: a runtime developer's first job is "does my model give the right numbers on this
device, and how long does the device take"; that should be one call, not a VM built by
hand. A model is an ONNX file (compiled first, needs the `onnx` extra), a `.vaelf` code
object, or code-object bytes; it runs in a fresh VM built by the launcher (by default
one emulated VA-1 over virtio-mmio, or the machine a VM image describes).

    outputs, report = run_model("model.onnx", {"x": x})
    report.commands      # [(opcode, device ns), ...] in completion order
    report.device_ns, report.virtual_ns, report.wall_s, report.digest
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping

import numpy as np

from .errors import ImageError
from .session import Session

ALL_DTYPES = 0xF  # F32, F16, I8, I32: the int8 path needs I8 and I32
DEFAULT_RAM = 128 << 20

Model = str | os.PathLike[str] | bytes


@dataclass
class RunReport:
    """What one model run cost: device time per command, virtual and wall time."""
    commands: list[tuple[str, int]] = field(default_factory=list)   # (opcode, device ns)
    virtual_ns: int = 0
    wall_s: float = 0.0
    digest: str = ""
    seed: int = 0

    @property
    def device_ns(self) -> int:
        return sum(ns for _, ns in self.commands)

    def as_dict(self) -> dict[str, Any]:
        return {"commands": [{"opcode": op, "device_ns": ns} for op, ns in self.commands],
                "device_ns": self.device_ns, "virtual_ns": self.virtual_ns,
                "wall_s": self.wall_s, "digest": self.digest, "seed": self.seed}


def session_for(*, seed: int = 0, int8: bool = True, image: str | os.PathLike[str] | None = None,
                attach: str = "mmio", keep_trace: bool = False) -> Session:
    """The one-VM session a model runs in: the image's machine when given (its program
    is not run), else one VA-1 attached as `attach` with every dtype when `int8`."""
    if image is not None:
        from .images import load_image
        img = load_image(os.fspath(image))
        if img.tenants:
            raise ImageError(f"{img.path}: an sriov-vf image has many VMs: run one of its "
                             "tenants' images instead")
        return Session.from_image(img, seed=seed, keep_trace=keep_trace)
    from device_model import Va1Config
    config = Va1Config(dtype_mask=ALL_DTYPES) if int8 else Va1Config()
    return Session(attach=attach, seed=seed, memory=DEFAULT_RAM, config=config,
                   keep_trace=keep_trace)


def run_in_vm(program: Callable[[Any], Any], *, seed: int = 0, int8: bool = True,
              image: str | os.PathLike[str] | None = None) -> Any:
    """Run `program(os)` as the guest program of a fresh VM; return its result."""
    with session_for(seed=seed, int8=int8, image=image) as session:
        return session.run(program, name="virtaccel-run")


def load_code(model: Model) -> bytes:
    """Code-object bytes of `model`: bytes as they are, a .onnx file compiled, any other
    file read (the loader checks it is a VA-1 code object)."""
    if isinstance(model, bytes):
        return model
    path = os.fspath(model)
    if path.endswith(".onnx"):
        from userspace_runtime.onnx_import import compile_onnx_file
        return compile_onnx_file(path).code_object
    return Path(path).read_bytes()


def _program(code: bytes, feeds: Mapping[str, Any], function: str
             ) -> Callable[[Any], dict[str, np.ndarray]]:
    from userspace_runtime import Device
    from userspace_runtime.module import Module

    module = Module.from_bytes(code)

    def program(os_: Any) -> dict[str, np.ndarray]:
        with Device(os_) as dev:
            ctx = dev.create_context()
            stream = ctx.create_stream()
            loaded = module.load(ctx, stream)
            return loaded.function(function)(stream, feeds)
    return program


def run_module_in_vm(code: bytes, feeds: Mapping[str, Any], *, seed: int = 0,
                     int8: bool = True, function: str = "main",
                     image: str | None = None) -> dict[str, np.ndarray]:
    """Load code object `code` in a fresh VM, run `function` on `feeds`, return outputs."""
    result: dict[str, np.ndarray] = run_in_vm(_program(code, feeds, function), seed=seed,
                                              int8=int8, image=image)
    return result


def run_model(model: Model, inputs: Mapping[str, Any] | str | os.PathLike[str], *,
              seed: int = 0, image: str | os.PathLike[str] | None = None,
              attach: str = "mmio", function: str = "main", int8: bool = True,
              trace: str | os.PathLike[str] | None = None
              ) -> tuple[dict[str, np.ndarray], RunReport]:
    """Run `model` (a .onnx or .vaelf path, or code-object bytes) on `inputs` (arrays by
    graph input name, or an .npz path) in a fresh VM; its outputs by graph output name
    and a RunReport. `trace` writes a Chrome trace-event JSON of the run."""
    code = load_code(model)
    if isinstance(inputs, (str, os.PathLike)):
        with np.load(os.fspath(inputs), allow_pickle=False) as npz:
            feeds: dict[str, Any] = {k: npz[k] for k in npz.files}
    else:
        feeds = dict(inputs)
    program = _program(code, feeds, function)
    session = session_for(seed=seed, int8=int8, image=image, attach=attach,
                          keep_trace=trace is not None)
    with session:
        times = session.command_times()
        outputs: dict[str, np.ndarray] = session.run(program, name="virtaccel-run")
    if trace is not None:
        session.write_trace(os.fspath(trace))
    return outputs, RunReport(times.commands, session.now_ns(), session.wall_s,
                              session.digest(), seed)
