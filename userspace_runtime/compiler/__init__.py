"""The VA-1 graph compiler: build a Graph, compile it to an ELF code object.

    g = Graph("mlp")
    x = g.input("x", (4, 16))
    h = g.relu(g.gemm(x, g.constant(w1), g.constant(b1)))
    g.output(h)
    result = compile_graph(g, Target.from_params(device.params))
    open("mlp.vaelf", "wb").write(result.code_object)

Passes (shape inference, constant folding, DCE, BatchNorm folding, epilogue fusion,
tiling to the scratchpad, liveness memory planning, optional int8 PTQ) are in the
private modules; docs/compiler.md describes them and the code-object format.
"""
from __future__ import annotations

from ._compile import CompileOptions, CompileResult, compile_graph, run_reference
from ._ir import Graph, GraphError, Node, Value
from ._lower import LoweringError
from ._target import Target

__all__ = [
    "CompileOptions", "CompileResult", "Graph", "GraphError", "LoweringError", "Node",
    "Target", "Value", "compile_graph", "run_reference",
]
