"""The compiler driver: passes, canonicalization for the ISA, lowering, code object."""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import numpy as np

from hwspec import va1

from .. import codeobject as co
from ._ir import Graph, GraphError, Node, Value
from ._lower import lower
from ._quant import Int8Report, QuantError
from ._passes import (
    eliminate_dead_code,
    fold_batchnorm,
    fold_constants,
    fuse_epilogues,
    fuse_patterns,
    infer_shapes,
)
from ._target import Target
from ._views import fold_matmul_views


@dataclass
class CompileOptions:
    """Which optional passes run (all on by default) and the function's name."""

    function_name: str = "main"
    fold_constants: bool = True
    fold_batchnorm: bool = True
    fuse: bool = True
    fuse_activations: frozenset[str] = frozenset({"relu", "gelu", "sigmoid", "silu"})
    # batched matmuls as GEMM_BATCHED reading transposed / reshaped / scaled operands
    # in place (False: one GEMM per batch on materialized operands)
    fold_views: bool = True
    # int8 post-training quantization: calibration feeds ({input name: array} each);
    # None keeps the graph in float.
    calibration: Sequence[Mapping[str, Any]] | None = None
    # int8 accuracy fallback: layers stay f32 (costliest first) until every calibration
    # feed's output cosine to f32 (each feed scored with ranges from the others) is at
    # least this; the margin above 0.99 is for inputs the calibration did not see.
    # None quantizes every layer it can.
    int8_min_cosine: float | None = 0.998
    # int8 activation scales: "dynamic" (QUANTIZE_DYNAMIC takes each tensor's range at
    # run time; the calibration feeds only choose the layers kept f32) or "static"
    # (calibrated ranges with headroom, immediates in QUANTIZE / DEQUANTIZE).
    int8_scales: str = "dynamic"


@dataclass
class CompileResult:
    """The code object (bytes) and a report of what the passes did."""

    code_object: bytes
    graph: Graph
    passes: dict[str, int] = field(default_factory=dict)
    workspace_bytes: int = 0      # the liveness-planned peak of intermediates
    const_bytes: int = 0
    commands: int = 0
    disassembly: str = ""
    # int8 PTQ: each output's error against the f32 graph on the calibration feeds
    quantization: list[QuantError] = field(default_factory=list)
    # int8 PTQ: the layers put in int8 and those the accuracy fallback kept in f32
    int8: Int8Report | None = None

    def write(self, path: str) -> None:
        with open(path, "wb") as f:
            f.write(self.code_object)


def _sym(s: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.$]", "_", s) or "_"


def _move_axes_last(g: Graph, n: Node, x: Value, axes: Sequence[int]) -> tuple[Value, list[int]]:
    rank = len(x.shape)
    rest = [i for i in range(rank) if i not in axes]
    perm = rest + list(axes)
    t = g.add_node("transpose", [x], {"perm": tuple(perm)}, name=f"{n.name}_pre")[0]
    return t, perm


def canonicalize(g: Graph) -> int:
    """Rewrite ops into the forms the ISA runs: batchnorm -> mul/add with folded
    per-channel constants; softmax and reduce over other axes -> transposes around the
    last-axis form."""
    changed = 0
    old = g.nodes
    g.nodes = []
    for n in old:
        if n.op == "batchnorm" and all(v is not None and v.is_const for v in n.inputs[1:]):
            x = n.inputs[0]
            assert x is not None
            scale, bias, mean, var = (v.const.astype(np.float64) for v in n.inputs[1:])  # type: ignore[union-attr]
            inv = scale / np.sqrt(var + n.attrs["epsilon"])
            shp = (x.shape[1],) + (1,) * (len(x.shape) - 2)
            s = g.constant(inv.reshape(shp).astype(x.dtype), name=f"{n.name}_scale")
            t = g.constant((bias - mean * inv).reshape(shp).astype(x.dtype),
                           name=f"{n.name}_shift")
            y = g.add_node("mul", [x, s], name=f"{n.name}_mul")[0]
            n2 = Node("add", [y, t], n.outputs, {}, f"{n.name}_add")
            n.outputs[0].producer = n2
            g.nodes.append(n2)
            changed += 1
            continue
        if n.op == "gelu" and n.attrs.get("approximate", "none") == "tanh":
            # 0.5 x (1 + tanh(u)) == x * sigmoid(2u), u = sqrt(2/pi) (x + 0.044715 x^3)
            x = n.inputs[0]
            assert x is not None
            c1 = 2.0 * float(np.sqrt(2.0 / np.pi))
            k1 = g.constant(np.array(c1, dtype=x.dtype), name=f"{n.name}_c1")
            k3 = g.constant(np.array(c1 * 0.044715, dtype=x.dtype), name=f"{n.name}_c3")
            x2 = g.add_node("mul", [x, x], name=f"{n.name}_x2")[0]
            x3 = g.add_node("mul", [x2, x], name=f"{n.name}_x3")[0]
            t3 = g.add_node("mul", [x3, k3], name=f"{n.name}_t3")[0]
            t1 = g.add_node("mul", [x, k1], name=f"{n.name}_t1")[0]
            u = g.add_node("add", [t1, t3], name=f"{n.name}_u")[0]
            sg = g.add_node("sigmoid", [u], name=f"{n.name}_sig")[0]
            n2 = Node("mul", [x, sg], n.outputs, {}, f"{n.name}_mul")
            n.outputs[0].producer = n2
            g.nodes.append(n2)
            changed += 1
            continue
        if n.op == "softmax":
            x = n.inputs[0]
            assert x is not None
            ax = n.attrs["axis"] % len(x.shape)
            if ax != len(x.shape) - 1:
                t, perm = _move_axes_last(g, n, x, [ax])
                sm = g.add_node("softmax", [t], {"axis": -1}, name=f"{n.name}_last")[0]
                inv = tuple(int(i) for i in np.argsort(perm))
                n2 = Node("transpose", [sm], n.outputs, {"perm": inv}, f"{n.name}_post")
                n.outputs[0].producer = n2
                g.nodes.append(n2)
                changed += 1
                continue
        if n.op == "reduce":
            from ._ops import reduce_axes
            x = n.inputs[0]
            assert x is not None
            axes = reduce_axes(n, len(x.shape))
            rank = len(x.shape)
            if axes != tuple(range(rank - len(axes), rank)):
                t, _ = _move_axes_last(g, n, x, list(axes))
                r = g.add_node("reduce", [t], {"reduce_op": n.attrs["reduce_op"],
                                               "axes": tuple(range(rank - len(axes), rank)),
                                               "keepdims": False}, name=f"{n.name}_last")[0]
                n2 = Node("reshape", [r], n.outputs, {"shape": n.outputs[0].shape},
                          f"{n.name}_shape")
                n.outputs[0].producer = n2
                g.nodes.append(n2)
                changed += 1
                continue
        g.nodes.append(n)
    return changed


def _check_fits(g: Graph, target: Target) -> None:
    """Every tensor fits the target's device memory, checked before any pass runs (a
    pass or the tiler would otherwise spend hours and gigabytes on an impossible one)."""
    for v in g.values():
        if v.nbytes > target.device_memory_size:
            raise GraphError(f"graph {g.name}: tensor {v.name!r} ({v.dtype}"
                             f"{list(v.shape)}) is {v.nbytes} bytes, more than the target's "
                             f"device memory ({target.device_memory_size} bytes)")


def compile_graph(graph: Graph, target: Target | None = None,
                  options: CompileOptions | None = None) -> CompileResult:
    """Run the passes on a copy of `graph`, lower it for `target` and write the ELF."""
    target = target or Target()
    opts = options or CompileOptions()
    if not graph.outputs:
        raise GraphError(f"graph {graph.name}: no outputs")
    g = graph.clone()
    report: dict[str, int] = {}
    quant_error: list[QuantError] = []
    int8: Int8Report | None = None
    infer_shapes(g)
    _check_fits(g, target)
    if opts.fold_constants:
        report["fold_constants"] = fold_constants(g)
    report["dce"] = eliminate_dead_code(g)
    if opts.fuse:
        report["fuse_patterns"] = fuse_patterns(g)
        report["dce"] += eliminate_dead_code(g)
    if opts.fold_batchnorm:
        report["fold_batchnorm"] = fold_batchnorm(g)
    if opts.fuse:
        report["fuse_epilogues"] = fuse_epilogues(g, opts.fuse_activations)
    if opts.calibration is not None:
        from ._quant import quantization_error, quantize_int8
        int8 = quantize_int8(g, opts.calibration, opts.int8_min_cosine, opts.int8_scales)
        report["quantize_int8"] = len(int8.quantized)
        quant_error = quantization_error(graph, g, opts.calibration)  # the caller's f32 graph
    if opts.fold_views:
        report["fold_matmul_views"] = fold_matmul_views(g)
    report["canonicalize"] = canonicalize(g)
    report["dce2"] = eliminate_dead_code(g)
    infer_shapes(g)
    from hwspec.isa import DType

    from ._lower import LoweringError
    for v in g.values():
        dt = {"float32": DType.F32, "float16": DType.F16, "int8": DType.I8,
              "int32": DType.I32}[v.dtype]
        if not v.is_const and not target.supports(dt):
            raise LoweringError(f"{v.name} is {v.dtype}, which the target's dtype_mask "
                                f"{target.dtype_mask:#x} does not have")
    fname = _sym(opts.function_name)
    arg_symbols: dict[int, str] = {}
    args: list[co.ArgSlot] = []
    offset = 0
    for kind, vals in (("input", g.inputs), ("output", g.outputs)):
        for i, v in enumerate(vals):
            if id(v) in arg_symbols and kind == "output":
                raise GraphError(f"graph output {v.name} is also an input or repeated; "
                                 f"add an identity copy")
            sym = f"{fname}.{'in' if kind == 'input' else 'out'}{i}.{_sym(v.name)}"
            arg_symbols[id(v)] = sym
            args.append(co.ArgSlot(v.name, kind, v.shape, v.dtype, sym, offset, v.nbytes))
            offset += (v.nbytes + 63) // 64 * 64
    low = lower(g, target, arg_symbols)
    args_bytes = max((a.offset + a.nbytes for a in args), default=0)
    total = len(low.const) + low.workspace_size + args_bytes
    if total > target.device_memory_size:
        raise LoweringError(f"graph {graph.name}: the code object needs {total} bytes of "
                            f"device memory ({len(low.const)} constants, "
                            f"{low.workspace_size} workspace, {args_bytes} arguments), the "
                            f"target has {target.device_memory_size}")
    features = sorted({"int8"} if any(v.dtype == "int8" for v in g.values()) else set())
    fn = co.FunctionInfo(opts.function_name, fname, 0, len(low.text), args,
                         [(o, f"{fname}:{n}") for o, n in low.labels])
    obj = co.CodeObject(low.text, low.const, low.workspace_size, [fn], low.relocations,
                        {"isa_version": target.isa_version, "features": features,
                         "compiler": {"passes": report,
                                      "scratchpad_size": target.scratchpad_size,
                                      "workspace_peak": low.workspace_size}},
                        low.constants)
    data = co.write(obj)
    from ..commands import disassemble
    return CompileResult(data, g, report, low.workspace_size, len(low.const),
                         len(low.names), disassemble(low.text, names=low.names), quant_error,
                         int8)


def feature_bits(features: Sequence[str]) -> int:
    """The VA1_F_* bits a code object's features need."""
    bits = {"int8": va1.F_INT8, "fp16": va1.F_FP16}
    return sum(1 << bits[f] for f in features if f in bits)


def run_reference(graph: Graph, feeds: Mapping[str, Any]) -> dict[str, np.ndarray]:
    """The graph evaluated in numpy (what the device should compute)."""
    from ._passes import reference_run
    return reference_run(graph, feeds)
