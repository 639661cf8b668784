"""ONNX models -> VA-1 code objects (needs the `onnx` extra: pip install virtaccel[onnx]).

    result = compile_onnx_file("model.onnx")      # a CompileResult
    result.write("model.vaelf")

The importer (userspace_runtime.compiler._onnx) maps the operators in
`supported_ops()` to the graph IR; any other operator is an OnnxImportError naming the
operator and the node.
"""
from __future__ import annotations

import os
from typing import Any, Mapping

from .compiler import CompileOptions, CompileResult, Graph, Target, compile_graph
from .compiler._onnx import (
    OnnxImportError,
    import_model,
    static_input_names,
    supported_ops,
)

__all__ = ["OnnxImportError", "compile_onnx", "compile_onnx_file", "import_model",
           "static_input_names", "supported_ops"]


def compile_onnx(model: Any, target: Target | None = None,
                 static_inputs: Mapping[str, Any] | None = None,
                 options: CompileOptions | None = None) -> CompileResult:
    """Import (a ModelProto, bytes or path) and compile; see import_model."""
    graph: Graph = import_model(model, static_inputs)
    return compile_graph(graph, target, options)


def compile_onnx_file(path: str | os.PathLike[str], target: Target | None = None
                      ) -> CompileResult:
    if not os.path.exists(path):
        raise OSError(f"{os.fspath(path)}: no such file")
    return compile_onnx(os.fspath(path), target)
