"""The graph IR: typed tensors (Value), operations (Node) and the Graph that owns them.

A Graph is built with its methods (`g.input`, `g.constant`, `g.matmul`, ...), each of
which checks its operands and infers the output's shape and dtype at once, so a shape
mismatch is reported at the call that made it, naming the node.
"""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

import numpy as np

from hwspec import va1

from .._errors import UserspaceRuntimeError
from . import _ops

DTYPES = ("float32", "float16", "int8", "int32")
MAX_RANK = 32   # the code-object reader's limit on an argument's dimensions


class GraphError(UserspaceRuntimeError, ValueError):
    """A graph is invalid: bad operand shapes/dtypes, unknown op, bad attributes."""


def as_dtype_name(dtype: Any) -> str:
    """'float32' etc. from a numpy dtype, a name or a type; GraphError otherwise."""
    try:
        name: str = np.dtype(dtype).name
    except TypeError:
        raise GraphError(f"dtype {dtype!r} is not a dtype") from None
    if name not in DTYPES:
        raise GraphError(f"dtype {name} is not supported by the VA-1 compiler "
                         f"(one of {', '.join(DTYPES)})")
    return name


@dataclass(eq=False)
class Value:
    """A tensor: name, static shape, dtype; `const` holds the data of a constant."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    producer: Node | None = None
    const: np.ndarray | None = None
    # Set by int8 quantization: (scale, zero_point) of an int8 tensor.
    quant: tuple[float, int] | None = None

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.size * np.dtype(self.dtype).itemsize

    @property
    def is_const(self) -> bool:
        return self.const is not None

    def __repr__(self) -> str:
        kind = "const " if self.is_const else ""
        return f"<{kind}{self.name}: {self.dtype}{list(self.shape)}>"


@dataclass(eq=False)
class Node:
    """One operation: `op` (a name in the op registry), operands, results, attributes."""

    op: str
    inputs: list[Value | None]
    outputs: list[Value]
    attrs: dict[str, Any] = field(default_factory=dict)
    name: str = ""

    def __repr__(self) -> str:
        ins = ", ".join("-" if v is None else v.name for v in self.inputs)
        outs = ", ".join(v.name for v in self.outputs)
        return f"{self.name}: {outs} = {self.op}({ins}) {self.attrs or ''}".rstrip()


class Graph:
    """A dataflow graph in topological order, with named inputs and outputs."""

    def __init__(self, name: str = "main") -> None:
        self.name = name
        self.inputs: list[Value] = []
        self.outputs: list[Value] = []
        self.nodes: list[Node] = []
        self._names: set[str] = set()
        self._counter = 0

    # -- naming -----------------------------------------------------------------------

    def unique(self, base: str) -> str:
        """A value/node name not used yet in this graph, derived from `base`."""
        name = base
        while name in self._names:
            name = f"{base}_{self._counter}"
            self._counter += 1
        self._names.add(name)
        return name

    # -- values -----------------------------------------------------------------------

    def input(self, name: str, shape: Sequence[int], dtype: Any = np.float32) -> Value:
        """A graph input (an argument of the compiled function)."""
        shp = _shape(shape, f"input {name!r}")
        if name in self._names:
            raise GraphError(f"input name {name!r} is already used")
        self._names.add(name)
        v = Value(name, shp, as_dtype_name(dtype))
        _check_fits(v, f"input {name!r}")
        self.inputs.append(v)
        return v

    def constant(self, data: Any, name: str = "const", dtype: Any = None) -> Value:
        """A constant tensor (weights): stored in the code object's constants section."""
        arr = np.array(data, dtype=dtype) if dtype is not None else np.asarray(data)
        if arr.dtype == np.float64:
            arr = arr.astype(np.float32)
        elif arr.dtype == np.int64:
            arr = arr.astype(np.int32)
        dt = as_dtype_name(arr.dtype)
        arr = np.array(arr, order="C", copy=None)   # (ascontiguousarray makes 0-d 1-d)
        arr.setflags(write=False)
        return Value(self.unique(name), tuple(int(d) for d in arr.shape), dt, const=arr)

    def output(self, *values: Value, names: Sequence[str] | None = None) -> None:
        """Mark `values` as graph outputs (optionally renaming them)."""
        for i, v in enumerate(values):
            if not isinstance(v, Value):
                raise GraphError(f"output {i} is not a Value: {v!r}")
            if names is not None:
                self._rename(v, names[i])
            self.outputs.append(v)

    def _rename(self, v: Value, name: str) -> None:
        if v.name == name:
            return
        if name in self._names:
            holder = next((u for u in self.values() if u.name == name), None)
            if holder is None or holder in self.inputs or holder in self.outputs:
                raise GraphError(f"output name {name!r} is already used")
            holder.name = self.unique(name + "_")   # an internal value gives way
        self._names.discard(v.name)
        self._names.add(name)
        v.name = name

    # -- nodes ------------------------------------------------------------------------

    def add_node(self, op: str, inputs: Sequence[Value | None], attrs: dict[str, Any] | None = None,
                 name: str | None = None, out_names: Sequence[str] | None = None) -> list[Value]:
        """Append an `op` node; shapes/dtypes are inferred now (GraphError if invalid)."""
        spec = _ops.get(op)
        node = Node(op, list(inputs), [], dict(attrs or {}), self.unique(name or op))
        for i, v in enumerate(node.inputs):
            if v is not None and not isinstance(v, Value):
                raise GraphError(f"node {node.name} ({op}): operand {i} is not a Value: {v!r}")
        spec.check_attrs(node)
        try:
            results = spec.infer(node)
        except GraphError as e:
            raise GraphError(f"node {node.name} ({op}): {e}") from None
        for i, (shape, dtype) in enumerate(results):
            base = out_names[i] if out_names else f"{node.name}_out{i}" if len(results) > 1 \
                else f"{node.name}_out"
            nm = base if out_names and base not in self._names else self.unique(base)
            self._names.add(nm)
            out = Value(nm, tuple(shape), dtype, producer=node)
            _check_fits(out, f"node {node.name} ({op}): output {nm!r}")
            node.outputs.append(out)
        self.nodes.append(node)
        return node.outputs

    def _one(self, op: str, inputs: Sequence[Value | None], name: str | None = None,
             **attrs: Any) -> Value:
        return self.add_node(op, inputs, attrs, name)[0]

    def matmul(self, a: Value, b: Value, *, name: str | None = None) -> Value:
        """numpy matmul semantics (batched over leading dims of a)."""
        return self._one("matmul", [a, b], name)

    def gemm(self, a: Value, b: Value, bias: Value | None = None, *, trans_a: bool = False,
             trans_b: bool = False, alpha: float = 1.0, beta: float = 1.0,
             activation: str | None = None, name: str | None = None) -> Value:
        """act(alpha * op(a) @ op(b) + beta * bias): 2-D a and b, bias broadcast by rows."""
        return self._one("gemm", [a, b, bias], name, trans_a=bool(trans_a),
                         trans_b=bool(trans_b), alpha=float(alpha), beta=float(beta),
                         activation=activation)

    def conv2d(self, x: Value, w: Value, bias: Value | None = None, *,
               stride: Sequence[int] = (1, 1), padding: Sequence[int] = (0, 0, 0, 0),
               dilation: Sequence[int] = (1, 1), groups: int = 1,
               activation: str | None = None, pad_value: int = 0,
               name: str | None = None) -> Value:
        """NCHW convolution, OIHW weights; padding (top, left, bottom, right), which holds
        `pad_value` (an int8 x's zero point; 0 otherwise)."""
        extra = {"pad_value": pad_value} if pad_value != 0 else {}
        return self._one("conv2d", [x, w, bias], name, stride=tuple(stride),
                         padding=tuple(padding), dilation=tuple(dilation), groups=int(groups),
                         activation=activation, **extra)

    def add(self, a: Value, b: Value, *, name: str | None = None) -> Value:
        return self._one("add", [a, b], name)

    def sub(self, a: Value, b: Value, *, name: str | None = None) -> Value:
        return self._one("sub", [a, b], name)

    def mul(self, a: Value, b: Value, *, name: str | None = None) -> Value:
        return self._one("mul", [a, b], name)

    def div(self, a: Value, b: Value, *, name: str | None = None) -> Value:
        return self._one("div", [a, b], name)

    def relu(self, x: Value, *, name: str | None = None) -> Value:
        return self._one("relu", [x], name)

    def gelu(self, x: Value, *, approximate: str = "none", name: str | None = None) -> Value:
        return self._one("gelu", [x], name, approximate=approximate)

    def sigmoid(self, x: Value, *, name: str | None = None) -> Value:
        return self._one("sigmoid", [x], name)

    def softmax(self, x: Value, axis: int = -1, *, name: str | None = None) -> Value:
        return self._one("softmax", [x], name, axis=int(axis))

    def layernorm(self, x: Value, scale: Value | None = None, bias: Value | None = None, *,
                  axis: int = -1, epsilon: float = 1e-5, name: str | None = None) -> Value:
        """Normalize over dims axis.. (ONNX LayerNormalization), then scale and shift."""
        return self._one("layernorm", [x, scale, bias], name, axis=int(axis),
                         epsilon=float(epsilon))

    def reshape(self, x: Value, shape: Sequence[int], *, name: str | None = None) -> Value:
        """Same data, new shape (one -1 is inferred; 0 copies the input's dim)."""
        return self._one("reshape", [x], name, shape=tuple(int(d) for d in shape))

    def transpose(self, x: Value, perm: Sequence[int] | None = None, *,
                  name: str | None = None) -> Value:
        perm = tuple(reversed(range(len(x.shape)))) if perm is None else tuple(perm)
        return self._one("transpose", [x], name, perm=tuple(int(p) for p in perm))

    def reduce(self, x: Value, op: str, axes: Sequence[int] | None = None,
               keepdims: bool = True, *, name: str | None = None) -> Value:
        """op in sum, mean, max, min over `axes` (all when None)."""
        ax = None if axes is None else tuple(int(a) for a in axes)
        return self._one("reduce", [x], name, reduce_op=op, axes=ax, keepdims=bool(keepdims))

    def quantize(self, x: Value, scale: float, zero_point: int = 0, *,
                 name: str | None = None) -> Value:
        """f32 -> int8: saturate(round_half_even(x / scale) + zero_point)."""
        return self._one("quantize", [x], name, scale=float(scale), zero_point=int(zero_point))

    def dequantize(self, x: Value, scale: float, zero_point: int = 0, *,
                   name: str | None = None) -> Value:
        """int8/int32 -> f32: (x - zero_point) * scale."""
        return self._one("dequantize", [x], name, scale=float(scale),
                         zero_point=int(zero_point))

    def batchnorm(self, x: Value, scale: Value, bias: Value, mean: Value, var: Value, *,
                  epsilon: float = 1e-5, name: str | None = None) -> Value:
        """Inference-form BatchNormalization over channel axis 1."""
        return self._one("batchnorm", [x, scale, bias, mean, var], name,
                         epsilon=float(epsilon))

    def clone(self) -> Graph:
        """A copy whose values and nodes are new objects (constants' data is shared:
        it is read-only). Iterative: a 10 000-node chain copies like a short one
        (copy.deepcopy recursed once per producer link)."""
        g = Graph(self.name)
        g._names = set(self._names)
        g._counter = self._counter
        vmap: dict[int, Value] = {}

        def val(v: Value) -> Value:
            nv = vmap.get(id(v))
            if nv is None:
                nv = Value(v.name, v.shape, v.dtype, None, v.const, v.quant)
                vmap[id(v)] = nv
            return nv

        g.inputs = [val(v) for v in self.inputs]
        for n in self.nodes:
            nn = Node(n.op, [None if v is None else val(v) for v in n.inputs], [],
                      dict(n.attrs), n.name)
            for o in n.outputs:
                no = val(o)
                no.producer = nn
                nn.outputs.append(no)
            g.nodes.append(nn)
        g.outputs = [val(v) for v in self.outputs]
        return g

    # -- inspection ---------------------------------------------------------------------

    def values(self) -> Iterable[Value]:
        seen: set[int] = set()
        for v in itertools.chain(self.inputs, (o for n in self.nodes for o in
                                               [*n.inputs, *n.outputs] if o is not None),
                                 self.outputs):
            if id(v) not in seen:
                seen.add(id(v))
                yield v

    def consumers(self) -> dict[int, list[Node]]:
        """id(value) -> nodes that read it."""
        out: dict[int, list[Node]] = {}
        for n in self.nodes:
            for v in n.inputs:
                if v is not None:
                    out.setdefault(id(v), []).append(n)
        return out

    def __str__(self) -> str:
        lines = [f"graph {self.name}({', '.join(map(repr, self.inputs))})"]
        lines += [f"  {n!r}" for n in self.nodes]
        lines.append(f"  return {', '.join(v.name for v in self.outputs)}")
        return "\n".join(lines)


def _shape(shape: Sequence[int], what: str) -> tuple[int, ...]:
    try:
        dims = tuple(int(d) for d in shape)
    except (TypeError, ValueError):
        raise GraphError(f"{what}: shape {shape!r} is not a sequence of ints") from None
    if any(d <= 0 for d in dims):
        raise GraphError(f"{what}: shape {dims} has a dimension < 1")
    if len(dims) > MAX_RANK:
        raise GraphError(f"{what}: shape has {len(dims)} dimensions (at most {MAX_RANK})")
    return dims


def _check_fits(v: Value, what: str) -> None:
    """No VA-1 could hold `v`: refuse it now, before passes and tiling work on it (a
    2**40-element tensor would otherwise take hours and gigabytes to compile)."""
    if len(v.shape) > MAX_RANK:
        raise GraphError(f"{what}: shape has {len(v.shape)} dimensions (at most {MAX_RANK})")
    if v.nbytes > va1.MAX_DEVICE_MEMORY_SIZE:
        raise GraphError(f"{what}: {v.dtype}{list(v.shape)} is {v.nbytes} bytes, more than "
                         f"any VA-1's device memory ({va1.MAX_DEVICE_MEMORY_SIZE} bytes at "
                         f"most)")
