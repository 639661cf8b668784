"""An onnx.backend.base.Backend that compiles with the VA-1 compiler and runs on a VA-1.

Each `run` loads the code object in a fresh guest VM built by the launcher (booting one
costs ~20 ms of wall time), as `virtaccel.models.run_module_in_vm` does.

Static operands (Reshape shapes, Reduce axes, quantization parameters, BatchNorm
statistics) that a model feeds as graph inputs are compile-time values for the
compiler: the rep compiles once per distinct set of those values (cached).
"""
from __future__ import annotations

from collections import namedtuple
from typing import Any, Sequence

import numpy as np
import onnx
from onnx.backend.base import Backend, BackendRep

from userspace_runtime.compiler import Target
from userspace_runtime.onnx_import import compile_onnx, static_input_names

from .models import run_module_in_vm


_WIDEN = {onnx.TensorProto.INT64: np.int64, onnx.TensorProto.BOOL: np.bool_}


class VA1BackendRep(BackendRep):
    """A prepared model: compiled now, or per distinct static-input values."""

    def __init__(self, model: onnx.ModelProto, target: Target, seed: int) -> None:
        self.model = model
        self.target = target
        self.seed = seed
        inits = {i.name for i in model.graph.initializer}
        self.input_names = [i.name for i in model.graph.input if i.name not in inits]
        self.output_names = [o.name for o in model.graph.output]
        # int64 and bool outputs (shapes, sizes: folded at compile time) come back from
        # the VA-1 as int32; they are widened to the declared type on the host
        self.output_types = {o.name: _WIDEN.get(o.type.tensor_type.elem_type)
                             for o in model.graph.output}
        self.static = static_input_names(model)
        self._cache: dict[bytes, bytes] = {}
        if not self.static:
            self._cache[b""] = compile_onnx(model, target).code_object

    def _code(self, feeds: dict[str, np.ndarray]) -> bytes:
        key = b"".join(n.encode() + feeds[n].tobytes() + str(feeds[n].shape).encode()
                       for n in sorted(self.static))
        if key not in self._cache:
            static = {n: feeds[n] for n in self.static}
            self._cache[key] = compile_onnx(self.model, self.target, static).code_object
        return self._cache[key]

    def run(self, inputs: Any, **kwargs: Any) -> tuple[Any, ...]:
        if isinstance(inputs, dict):
            feeds = {k: np.asarray(v) for k, v in inputs.items()}
        else:
            if isinstance(inputs, np.ndarray):
                inputs = [inputs]
            vals = list(inputs)
            if len(vals) != len(self.input_names):
                raise ValueError(f"{len(vals)} inputs given, the model takes "
                                 f"{len(self.input_names)}: {self.input_names}")
            feeds = {n: np.asarray(v) for n, v in zip(self.input_names, vals)}
        code = self._code(feeds)
        dyn = {k: v for k, v in feeds.items() if k not in self.static}
        out = run_module_in_vm(code, dyn, seed=self.seed)
        Outputs = namedtuple("Outputs", [f"o{i}" for i in range(len(self.output_names))])  # type: ignore[misc]
        return Outputs(*[out[n] if self.output_types[n] is None else
                         out[n].astype(self.output_types[n]) for n in self.output_names])


class VA1Backend(Backend):
    """onnx.backend.base.Backend over the VA-1 compiler and runtime.

    The ONNX runner's device strings are CPU/CUDA; "CPU" is accepted and means "the
    VA-1 of a fresh guest VM" (there is no host execution)."""

    target = Target()
    seed = 0

    @classmethod
    def is_compatible(cls, model: onnx.ModelProto, device: str = "CPU", **kwargs: Any) -> bool:
        from userspace_runtime.onnx_import import supported_ops
        ops = set(supported_ops())
        return all(n.op_type in ops for n in model.graph.node)

    @classmethod
    def prepare(cls, model: onnx.ModelProto, device: str = "CPU", **kwargs: Any) -> VA1BackendRep:
        super().prepare(model, device, **kwargs)
        return VA1BackendRep(model, cls.target, cls.seed)

    @classmethod
    def run_model(cls, model: onnx.ModelProto, inputs: Any, device: str = "CPU",
                  **kwargs: Any) -> tuple[Any, ...]:
        return cls.prepare(model, device, **kwargs).run(inputs)

    @classmethod
    def run_node(cls, node: onnx.NodeProto, inputs: Any, device: str = "CPU",
                 outputs_info: Sequence[tuple[Any, Any]] | None = None,
                 **kwargs: Any) -> tuple[Any, ...]:
        raise NotImplementedError("run_node: build a model (the compiler needs static shapes)")

    @classmethod
    def supports_device(cls, device: str) -> bool:
        return device == "CPU"


prepare = VA1Backend.prepare
run_model = VA1Backend.run_model
supports_device = VA1Backend.supports_device
backend = VA1Backend
