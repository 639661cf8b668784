"""ONNX -> graph IR, for the operators the VA-1 compiler claims (SUPPORTED_OPS).

Static operands (Reshape's shape, Reduce axes, quantization scales and zero points,
BatchNormalization statistics) must be constants: initializers, Constant nodes, or
values given in `static_inputs`. Anything else is an OnnxImportError naming the
operator and the node.
"""
from __future__ import annotations

import math
from typing import Any, Callable, Mapping, Sequence

import numpy as np
import onnx
from onnx import numpy_helper

from ._ir import Graph, GraphError, Value


class OnnxImportError(GraphError):
    """The model uses something the compiler does not support (names op and node)."""


_Handler = Callable[["_Importer", onnx.NodeProto, list["Value | None"]], list[Value]]
_HANDLERS: dict[str, _Handler] = {}
# Operands that must be compile-time constants, by op: input positions.
STATIC_OPERANDS: dict[str, tuple[int, ...]] = {
    "Reshape": (1,), "ReduceSum": (1,), "ReduceMean": (1,), "ReduceMax": (1,),
    "ReduceMin": (1,), "Squeeze": (1,), "Unsqueeze": (1,),
    "QuantizeLinear": (1, 2), "DequantizeLinear": (1, 2),
    "BatchNormalization": (1, 2, 3, 4),
    "Clip": (1, 2), "Slice": (1, 2, 3, 4), "Split": (1,), "Pad": (1, 2, 3),
    "Expand": (1,), "ConstantOfShape": (0,), "Range": (0, 1, 2),
}


# What each handler takes, checked once for every node before its handler runs:
# (fewest inputs, most inputs, attributes it reads). A trailing optional input may be
# absent or "" and reaches the handler as None; any other attribute is refused rather
# than ignored (an older opset's `broadcast`/`axis` on Add changes the meaning).
_Sig = tuple[int, int, frozenset[str]]
SIGNATURES: dict[str, _Sig] = {}


def _op(name: str, inputs: tuple[int, int], attrs: tuple[str, ...] = ()
        ) -> Callable[[_Handler], _Handler]:
    def deco(fn: _Handler) -> _Handler:
        _HANDLERS[name] = fn
        SIGNATURES[name] = (inputs[0], inputs[1], frozenset(attrs))
        return fn
    return deco


def supported_ops() -> list[str]:
    return sorted(_HANDLERS)


def _attrs(node: onnx.NodeProto) -> dict[str, Any]:
    return {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}


_ONNX_DTYPES = {onnx.TensorProto.FLOAT: np.float32, onnx.TensorProto.FLOAT16: np.float16,
                onnx.TensorProto.INT8: np.int8, onnx.TensorProto.INT32: np.int32,
                # int64 inputs (token ids, indices) are taken as int32: the VA-1 has no
                # 64-bit integers; the runtime narrows int64 feeds, refusing what does
                # not fit
                onnx.TensorProto.INT64: np.int32,
                # booleans are int8 masks of 0 / 1 on the VA-1 (COMPARE, SELECT)
                onnx.TensorProto.BOOL: np.int8}


def _elem_name(code: int) -> str:
    """An ONNX element type's name, also for a number onnx does not know."""
    try:
        return str(onnx.TensorProto.DataType.Name(code))
    except ValueError:
        return f"{code} (not an ONNX element type)"


def _to_array(t: onnx.TensorProto, what: str) -> np.ndarray:
    """numpy_helper.to_array, with an error naming the tensor when its data is broken."""
    if t.data_type not in onnx.TensorProto.DataType.values():
        raise OnnxImportError(f"{what}: element type {_elem_name(t.data_type)}")
    try:
        arr: np.ndarray = numpy_helper.to_array(t)
    except (ValueError, TypeError, KeyError, AssertionError, OverflowError) as e:
        raise OnnxImportError(f"{what}: its data cannot be read as "
                              f"{_elem_name(t.data_type)}{list(t.dims)} ({e})") from None
    return arr


def check_model(model: onnx.ModelProto) -> None:
    """onnx.checker.check_model, its refusal as a one-line OnnxImportError."""
    try:
        onnx.checker.check_model(model)
    except (onnx.checker.ValidationError, ValueError) as e:
        raise OnnxImportError(f"the ONNX checker rejects the model: "
                              f"{' '.join(str(e).split())}") from None


# Operators never evaluated at import even when every input is known: random ones
# (a compile-time draw would freeze them) and control flow (subgraphs may read outer
# values the importer does not track).
_NEVER_FOLD = frozenset({
    "RandomNormal", "RandomNormalLike", "RandomUniform", "RandomUniformLike", "Bernoulli",
    "Multinomial", "If", "Loop", "Scan", "SequenceMap", "Dropout"})
# Operators that only ever produce compile-time values (their input's static shape).
_SHAPE_OPS = frozenset({"Shape", "Size"})
# At most this many names of nodes are listed per unsupported operator.
_LIST_NODES = 8


class _Importer:
    def __init__(self, model: onnx.ModelProto, static_inputs: Mapping[str, Any]) -> None:
        self.model = model
        self.g = Graph(model.graph.name or "main")
        self.env: dict[str, Value] = {}
        # Compile-time values by tensor name, exactly as ONNX defines them (int64 shapes,
        # bools): initializers, Constant nodes, static inputs and every node evaluated at
        # import because all its inputs were known (static shape folding). They become
        # graph constants only when a runtime node reads them.
        self.known: dict[str, np.ndarray] = {}
        self.static = {k: np.asarray(v) for k, v in static_inputs.items()}
        self.opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")),
                          1)
        self.node: onnx.NodeProto | None = None
        self.folded = 0

    def fail(self, msg: str) -> OnnxImportError:
        n = self.node
        where = f"node {n.name or '(unnamed)'} ({n.op_type})" if n is not None else "model"
        return OnnxImportError(f"{where}: {msg}")

    def const(self, v: Value | None, what: str) -> np.ndarray:
        if v is None or not v.is_const:
            raise self.fail(f"{what} must be a constant (an initializer or Constant)")
        assert v.const is not None
        return v.const

    def value(self, name: str) -> Value:
        """The graph Value of tensor `name`; a known (compile-time) tensor becomes a
        constant the first time a runtime node reads it."""
        v = self.env.get(name)
        if v is None:
            arr = self.known[name]
            try:
                v = self.constant(arr, name)
            except GraphError as e:
                what = "initializer" if name in self.inits else "constant"
                raise OnnxImportError(f"{what} {name!r}: {e}") from None
            self.env[name] = v
        return v

    def run(self) -> Graph:
        graph = self.model.graph
        self.inits = {i.name for i in graph.initializer}
        for init in graph.initializer:
            self.known[init.name] = _to_array(init, f"initializer {init.name!r}")
        for vi in graph.input:
            if vi.name in self.known:
                self._check_initializer(vi)
                continue
            if vi.name in self.static:
                self.known[vi.name] = self.static[vi.name]
                continue
            t = vi.type.tensor_type
            if t.elem_type not in _ONNX_DTYPES:
                raise OnnxImportError(f"input {vi.name!r}: element type "
                                      f"{_elem_name(t.elem_type)} is not supported (one of "
                                      f"{', '.join(map(_elem_name, _ONNX_DTYPES))})")
            dims = []
            for i, d in enumerate(t.shape.dim):
                if not d.HasField("dim_value") or d.dim_value <= 0:
                    raise OnnxImportError(f"input {vi.name!r}: dimension {i} "
                                          f"({d.dim_param or d.dim_value or '?'}) is not "
                                          f"static (the compiler needs fixed shapes >= 1)")
                dims.append(d.dim_value)
            try:
                self.env[vi.name] = self.g.input(vi.name, dims, _ONNX_DTYPES[t.elem_type])
            except GraphError as e:
                raise OnnxImportError(str(e)) from None
        unsupported: dict[str, list[str]] = {}
        poisoned: set[str] = set()   # outputs of unsupported nodes (and what reads them)
        for node in graph.node:
            self.node = node
            ins_named = [i for i in node.input if i]
            std = node.domain in ("", "ai.onnx")
            if std and self._fold(node):
                continue
            h = _HANDLERS.get(node.op_type) if std else None
            if h is None:
                op = node.op_type if std else f"{node.domain}.{node.op_type}"
                unsupported.setdefault(op, []).append(node.name or "(unnamed)")
                poisoned.update(o for o in node.output if o)
                continue
            if any(i in poisoned for i in ins_named):
                poisoned.update(o for o in node.output if o)
                continue
            ins = self._operands(node)
            try:
                outs = h(self, node, ins)
            except OnnxImportError:
                raise
            except GraphError as e:
                raise self.fail(str(e)) from None
            real = [o for o in node.output]
            if len([o for o in real if o]) > len(outs):
                raise self.fail(f"only {len(outs)} output(s) supported, the node asks for "
                                f"{len(real)}")
            for name, v in zip(real, outs):
                if name:
                    self.env[name] = v
        self.node = None
        if unsupported:
            raise OnnxImportError(_unsupported_message(unsupported))
        outs = []
        for vo in graph.output:
            if vo.name not in self.env and vo.name not in self.known:
                raise OnnxImportError(f"graph output {vo.name} is not computed")
            outs.append(self.value(vo.name))
        seen: set[int] = set()
        for vo, v in zip(graph.output, outs):
            if v.is_const or id(v) in seen or any(v is i for i in self.g.inputs):
                v = self.g.reshape(v, v.shape, name=f"{vo.name}_copy")
            seen.add(id(v))
            self.g.output(v, names=[vo.name])
        return self.g

    def _fold(self, node: onnx.NodeProto) -> bool:
        """Evaluate `node` now when its result is a compile-time value: Shape and Size
        of any tensor (shapes are static), and any operator whose inputs are all
        known (exported shape arithmetic: Gather, Concat, Cast, Equal, Where, Range,
        ConstantOfShape, ...), with ONNX's reference semantics."""
        op = node.op_type
        names = [i for i in node.input if i]
        if op in SIGNATURES:
            self._check_signature(node)
        if op in _SHAPE_OPS and names and names[0] in self.env and names[0] not in self.known:
            shape = np.array(self.env[names[0]].shape, dtype=np.int64)
            if op == "Size":
                self.known[node.output[0]] = np.array(int(np.prod(shape)), dtype=np.int64)
            else:
                a = _attrs(node)
                r = len(shape)
                lo, hi = int(a.get("start", 0)), int(a.get("end", r))
                lo, hi = (max(0, min(r, v + r if v < 0 else v)) for v in (lo, hi))
                self.known[node.output[0]] = shape[lo:hi]
            self.folded += 1
            return True
        if op in _NEVER_FOLD or any(n not in self.known for n in names):
            return False
        self._check_fold_size(node)
        from onnx.reference import ReferenceEvaluator
        try:
            ref = ReferenceEvaluator(node, opsets={"": self.opset})
            res = ref.run(None, {n: self.known[n] for n in names})
        except MemoryError:
            raise self.fail("evaluating it at compile time needs more memory than the host "
                            "has") from None
        except Exception as e:   # the reference's own verdict on a bad node
            raise self.fail(f"cannot be evaluated at compile time: "
                            f"{' '.join(str(e).split()) or type(e).__name__}") from None
        for name, arr in zip(node.output, res):
            if name:
                self.known[name] = np.asarray(arr)
        self.folded += 1
        return True

    def _check_fold_size(self, node: onnx.NodeProto) -> None:
        """Operators whose output size comes from their inputs' values are checked
        before they are evaluated: no device holds more than MAX_DEVICE_MEMORY_SIZE."""
        from hwspec import va1
        op, ins = node.op_type, [self.known.get(i) for i in node.input]
        count: int | None = None
        try:
            if op in ("ConstantOfShape", "Expand") and len(ins) >= 1 and ins[-1] is not None:
                dims = [int(d) for d in np.asarray(ins[-1]).reshape(-1)]
                if op == "Expand" and ins[0] is not None:
                    dims = list(np.broadcast_shapes(tuple(max(d, 1) for d in dims),
                                                    ins[0].shape))
                count = math.prod(max(d, 0) for d in dims)
            elif op == "Range" and all(v is not None for v in ins[:3]):
                start, limit, delta = (float(np.asarray(v).reshape(-1)[0]) for v in ins[:3])
                if delta == 0 or not all(map(math.isfinite, (start, limit, delta))):
                    raise self.fail(f"Range start {start}, limit {limit}, delta {delta}: "
                                    f"delta must be non-zero and all finite")
                count = max(0, math.ceil((limit - start) / delta))
            elif op == "Tile" and len(ins) == 2 and ins[0] is not None and ins[1] is not None:
                count = ins[0].size * math.prod(max(int(r), 0)
                                                for r in np.asarray(ins[1]).reshape(-1))
        except ValueError:
            return
        if count is not None and count * 8 > va1.MAX_DEVICE_MEMORY_SIZE:
            raise self.fail(f"its output would have {count} elements ({count * 8} bytes as "
                            f"int64), more than any VA-1's device memory "
                            f"({va1.MAX_DEVICE_MEMORY_SIZE} bytes at most)")

    def _operands(self, node: onnx.NodeProto) -> list[Value | None]:
        """The node's operands, padded with None to the op's most inputs, after the
        checks every handler relies on (`_check_signature`)."""
        hi = self._check_signature(node)
        n = len(node.input)
        ins: list[Value | None] = []
        for name in node.input:
            if name == "":
                ins.append(None)
            elif name not in self.env and name not in self.known:
                raise self.fail(f"input {name!r} is not defined")
            else:
                ins.append(self.value(name))
        return ins + [None] * (hi - n)

    def _check_signature(self, node: onnx.NodeProto) -> int:
        """Input count, required inputs present, every attribute one the handler reads;
        returns the op's most inputs."""
        lo, hi, known = SIGNATURES[node.op_type]
        n = len(node.input)
        if not lo <= n <= hi:
            want = f"{lo}" if lo == hi else f"{lo} to {hi}"
            raise self.fail(f"has {n} input(s), {node.op_type} takes {want}")
        for i, name in enumerate(node.input[:lo]):
            if name == "":
                raise self.fail(f"input {i} is required but empty")
        for a in node.attribute:
            if a.name not in known:
                raise self.fail(f"attribute {a.name!r} is not supported (the VA-1 compiler's "
                                f"{node.op_type} takes "
                                f"{', '.join(sorted(known)) or 'no attributes'})")
        return hi

    def _check_initializer(self, vi: onnx.ValueInfoProto) -> None:
        """A graph input with an initializer (its default value) must be declared with
        the initializer's element type and shape."""
        init = next(i for i in self.model.graph.initializer if i.name == vi.name)
        if not vi.type.HasField("tensor_type"):
            raise OnnxImportError(f"input {vi.name!r}: has an initializer but is not "
                                  f"declared as a tensor")
        t = vi.type.tensor_type
        if t.elem_type != init.data_type:
            raise OnnxImportError(f"input {vi.name!r}: declared "
                                  f"{_elem_name(t.elem_type)}, its initializer is "
                                  f"{_elem_name(init.data_type)}")
        if t.HasField("shape"):
            dims = [d.dim_value if d.HasField("dim_value") else None for d in t.shape.dim]
            have = list(init.dims)
            if len(dims) != len(have) or any(d is not None and d != h
                                             for d, h in zip(dims, have)):
                shown = ["?" if d is None else d for d in dims]
                raise OnnxImportError(f"input {vi.name!r}: declared shape {shown}, its "
                                      f"initializer has shape {have}")

    def constant(self, arr: np.ndarray, name: str) -> Value:
        if arr.dtype == np.float64:
            arr = arr.astype(np.float32)
        if arr.dtype == np.bool_:      # a mask a runtime node reads: int8 0 / 1
            return self.g.constant(arr.astype(np.int8), name=name)
        if arr.dtype in (np.int64, np.int16, np.uint8):
            # shape-like tensors: kept as int32 constants (only ever read at compile time)
            if arr.dtype == np.uint8 and arr.size and arr.max() > 127:
                return self.g.constant(arr.astype(np.int32), name=name)
            arr = arr.astype(np.int32)
        return self.g.constant(arr, name=name)


def _unsupported_message(found: dict[str, list[str]]) -> str:
    """Every unsupported operator at once: its count and the nodes that use it."""
    parts = []
    for op, nodes in sorted(found.items()):
        shown = ", ".join(nodes[:_LIST_NODES])
        more = f" and {len(nodes) - _LIST_NODES} more" if len(nodes) > _LIST_NODES else ""
        parts.append(f"{op} x{len(nodes)} ({shown}{more})")
    total = sum(len(v) for v in found.values())
    return (f"{len(found)} operator(s) not supported by the VA-1 compiler, in {total} "
            f"node(s): {'; '.join(parts)} (supported: {', '.join(supported_ops())})")


def _float_act(op: str) -> _Handler:
    def h(im: _Importer, n: onnx.NodeProto, x: list[Value | None]) -> list[Value]:
        return [im.g.add_node(op, [x[0]], {}, name=n.name or None)[0]]
    return h


_op("Relu", (1, 1))(_float_act("relu"))
_op("Sigmoid", (1, 1))(_float_act("sigmoid"))


@_op("Gelu", (1, 1), ("approximate",))
def _gelu(im: _Importer, n: onnx.NodeProto, x: list[Value | None]) -> list[Value]:
    approx = _attrs(n).get("approximate", b"none")
    approx = approx.decode() if isinstance(approx, bytes) else approx
    return [im.g.gelu(x[0], approximate=approx, name=n.name or None)]  # type: ignore[arg-type]


def _binary(op: str) -> _Handler:
    def h(im: _Importer, n: onnx.NodeProto, x: list[Value | None]) -> list[Value]:
        return [im.g.add_node(op, x[:2], {}, name=n.name or None)[0]]
    return h


_op("Add", (2, 2))(_binary("add"))
_op("Sub", (2, 2))(_binary("sub"))
_op("Mul", (2, 2))(_binary("mul"))
_op("Div", (2, 2))(_binary("div"))


@_op("MatMul", (2, 2))
def _matmul(im: _Importer, n: onnx.NodeProto, x: list[Value | None]) -> list[Value]:
    return [im.g.matmul(x[0], x[1], name=n.name or None)]  # type: ignore[arg-type]


@_op("Gemm", (2, 3), ("alpha", "beta", "transA", "transB"))
def _gemm(im: _Importer, n: onnx.NodeProto, x: list[Value | None]) -> list[Value]:
    a = _attrs(n)
    bias = x[2] if len(x) > 2 else None
    return [im.g.gemm(x[0], x[1], bias, trans_a=bool(a.get("transA", 0)),  # type: ignore[arg-type]
                      trans_b=bool(a.get("transB", 0)), alpha=a.get("alpha", 1.0),
                      beta=a.get("beta", 1.0), name=n.name or None)]


def _ints(im: _Importer, a: dict[str, Any], key: str, default: Sequence[int], count: int,
          least: int) -> tuple[int, ...]:
    """Attribute `key` as `count` ints each >= `least` (the default when absent)."""
    v = a.get(key, default)
    vals = (v,) if isinstance(v, int) else tuple(v)
    if len(vals) != count or any(not isinstance(i, int) or i < least for i in vals):
        raise im.fail(f"attribute {key} {list(vals)}: needs {count} integer(s), each "
                      f">= {least}")
    return tuple(vals)


@_op("Conv", (2, 3),
     ("auto_pad", "dilations", "group", "kernel_shape", "pads", "strides"))
def _conv(im: _Importer, n: onnx.NodeProto, x: list[Value | None]) -> list[Value]:
    a = _attrs(n)
    inp, w = x[0], x[1]
    assert inp is not None and w is not None
    if len(inp.shape) != 4 or len(w.shape) != 4:
        raise im.fail(f"only 2-D convolution (NCHW input, OIHW weights) is supported, the "
                      f"input is {list(inp.shape)} and the weights {list(w.shape)}")
    kh, kw = _ints(im, a, "kernel_shape", w.shape[2:], 2, 1)
    if (kh, kw) != w.shape[2:]:
        raise im.fail(f"attribute kernel_shape {[kh, kw]} differs from the weights' "
                      f"{list(w.shape[2:])}")
    strides = _ints(im, a, "strides", (1, 1), 2, 1)
    dil = _ints(im, a, "dilations", (1, 1), 2, 1)
    pads = _ints(im, a, "pads", (0, 0, 0, 0), 4, 0)
    group = _ints(im, a, "group", (1,), 1, 1)[0]
    c_in, c_out = inp.shape[1], w.shape[0]
    if c_in % group or c_out % group or w.shape[1] * group != c_in:
        raise im.fail(f"attribute group {group}: the input has {c_in} channels and the "
                      f"weights {list(w.shape)} ({c_out} outputs, {w.shape[1]} channels "
                      f"per group); group must divide both and channels per group x group "
                      f"must equal {c_in}")
    auto = a.get("auto_pad", b"NOTSET")
    auto = auto.decode() if isinstance(auto, bytes) else auto
    if auto not in ("NOTSET", "SAME_UPPER", "SAME_LOWER", "VALID"):
        raise im.fail(f"attribute auto_pad {auto!r} is not NOTSET, SAME_UPPER, SAME_LOWER "
                      f"or VALID")
    if auto in ("SAME_UPPER", "SAME_LOWER"):
        pads_hw = []
        for d, k, s, dl in zip(inp.shape[2:], (kh, kw), strides, dil):
            out = -(-d // s)
            total = max(0, (out - 1) * s + (k - 1) * dl + 1 - d)
            lo = total // 2 if auto == "SAME_UPPER" else total - total // 2
            pads_hw.append((lo, total - lo))
        pads = (pads_hw[0][0], pads_hw[1][0], pads_hw[0][1], pads_hw[1][1])
    elif auto == "VALID":
        pads = (0, 0, 0, 0)
    # ONNX pads: [h_begin, w_begin, h_end, w_end] == (top, left, bottom, right)
    return [im.g.conv2d(inp, w, x[2] if len(x) > 2 else None, stride=strides, padding=pads,
                        dilation=dil, groups=group, name=n.name or None)]


def _axis(im: _Importer, axis: int, rank: int, end: bool = False) -> int:
    """`axis` in [-rank, rank) (or [-rank, rank] with `end`), made non-negative."""
    hi = rank + 1 if end else rank
    if not -rank <= axis < hi:
        raise im.fail(f"attribute axis {axis} is out of range for an input of rank {rank}")
    return axis + rank if axis < 0 else axis


def _finite(im: _Importer, a: dict[str, Any], key: str, default: float) -> float:
    v = float(a.get(key, default))
    if not math.isfinite(v) or v < 0:
        raise im.fail(f"attribute {key} {v} must be finite and >= 0")
    return v


@_op("Softmax", (1, 1), ("axis",))
def _softmax(im: _Importer, n: onnx.NodeProto, x: list[Value | None]) -> list[Value]:
    inp = x[0]
    assert inp is not None
    axis = int(_attrs(n).get("axis", -1 if im.opset >= 13 else 1))
    if im.opset >= 13:
        return [im.g.softmax(inp, axis, name=n.name or None)]
    ax = _axis(im, axis, len(inp.shape))
    rows = int(np.prod(inp.shape[:ax]))
    flat = im.g.reshape(inp, (rows, -1))
    return [im.g.reshape(im.g.softmax(flat, -1), inp.shape, name=n.name or None)]


@_op("LayerNormalization", (2, 3), ("axis", "epsilon", "stash_type"))
def _layernorm(im: _Importer, n: onnx.NodeProto, x: list[Value | None]) -> list[Value]:
    a = _attrs(n)
    inp = x[0]
    assert inp is not None
    if a.get("stash_type", 1) != onnx.TensorProto.FLOAT:
        raise im.fail(f"attribute stash_type {a['stash_type']}: only 1 (float32) is "
                      f"supported")
    axis, eps = int(a.get("axis", -1)), _finite(im, a, "epsilon", 1e-5)
    y = im.g.layernorm(inp, x[1], x[2] if len(x) > 2 else None, axis=axis, epsilon=eps,
                       name=n.name or None)
    if len(n.output) < 2 or not any(n.output[1:]):
        return [y]
    # Mean and InvStdDev on the device: mean by REDUCE; with d = x - mean and
    # z = layernorm(x) = d * inv, inv = sum(z * d) / sum(d * d) per row (exact
    # algebraically; ill-conditioned only when a row is constant).
    g = im.g
    ax = axis % len(inp.shape)
    axes = list(range(ax, len(inp.shape)))
    mean = g.reduce(inp, "mean", axes, keepdims=True)
    d = g.sub(inp, mean)
    z = g.layernorm(inp, None, None, axis=axis, epsilon=eps)
    num = g.reduce(g.mul(z, d), "sum", axes, keepdims=True)
    den = g.reduce(g.mul(d, d), "sum", axes, keepdims=True)
    return [y, mean, g.add_node("div", [num, den])[0]]


@_op("BatchNormalization", (5, 5), ("epsilon", "momentum", "training_mode"))
def _bn(im: _Importer, n: onnx.NodeProto, x: list[Value | None]) -> list[Value]:
    a = _attrs(n)
    if a.get("training_mode", 0):
        raise im.fail("training_mode=1 is not supported (inference form only)")
    for i, what in enumerate(("scale", "B", "input_mean", "input_var"), 1):
        im.const(x[i], what)
    return [im.g.batchnorm(x[0], x[1], x[2], x[3], x[4],  # type: ignore[arg-type]
                           epsilon=_finite(im, a, "epsilon", 1e-5), name=n.name or None)]


@_op("Reshape", (2, 2), ("allowzero",))
def _reshape(im: _Importer, n: onnx.NodeProto, x: list[Value | None]) -> list[Value]:
    shape = im.const(x[1], "the shape operand").astype(np.int64).tolist()
    inp = x[0]
    assert inp is not None
    if _attrs(n).get("allowzero", 0) and 0 in shape:
        raise im.fail("allowzero with a 0 dimension (an empty tensor) is not supported")
    return [im.g.reshape(inp, shape, name=n.name or None)]


@_op("Flatten", (1, 1), ("axis",))
def _flatten(im: _Importer, n: onnx.NodeProto, x: list[Value | None]) -> list[Value]:
    inp = x[0]
    assert inp is not None
    ax = _axis(im, int(_attrs(n).get("axis", 1)), len(inp.shape), end=True)
    rows = int(np.prod(inp.shape[:ax]))
    return [im.g.reshape(inp, (rows, -1), name=n.name or None)]


@_op("Identity", (1, 1))
def _identity(im: _Importer, n: onnx.NodeProto, x: list[Value | None]) -> list[Value]:
    inp = x[0]
    assert inp is not None
    return [im.g.reshape(inp, inp.shape, name=n.name or None)]


@_op("Transpose", (1, 1), ("perm",))
def _transpose(im: _Importer, n: onnx.NodeProto, x: list[Value | None]) -> list[Value]:
    perm = _attrs(n).get("perm")
    return [im.g.transpose(x[0], None if perm is None else list(perm),  # type: ignore[arg-type]
                           name=n.name or None)]


def _reduce(op: str) -> _Handler:
    def h(im: _Importer, n: onnx.NodeProto, x: list[Value | None]) -> list[Value]:
        a = _attrs(n)
        axes: list[int] | None
        if len(x) > 1 and x[1] is not None:
            axes = im.const(x[1], "the axes operand").astype(np.int64).reshape(-1).tolist()
        else:
            axes = list(a["axes"]) if "axes" in a else None
        if not axes:
            if a.get("noop_with_empty_axes", 0):
                inp = x[0]
                assert inp is not None
                return [im.g.reshape(inp, inp.shape, name=n.name or None)]
            axes = None
        return [im.g.reduce(x[0], op, axes, bool(a.get("keepdims", 1)),  # type: ignore[arg-type]
                            name=n.name or None)]
    return h


_REDUCE_ATTRS = ("axes", "keepdims", "noop_with_empty_axes")
_op("ReduceSum", (1, 2), _REDUCE_ATTRS)(_reduce("sum"))
_op("ReduceMean", (1, 2), _REDUCE_ATTRS)(_reduce("mean"))
_op("ReduceMax", (1, 2), _REDUCE_ATTRS)(_reduce("max"))
_op("ReduceMin", (1, 2), _REDUCE_ATTRS)(_reduce("min"))


def _axes_operand(im: _Importer, n: onnx.NodeProto, x: list[Value | None]) -> list[int] | None:
    if len(x) > 1 and x[1] is not None:
        return [int(a) for a in im.const(x[1], "the axes operand").reshape(-1)]
    a = _attrs(n).get("axes")
    return None if a is None else [int(v) for v in a]


@_op("Squeeze", (1, 2), ("axes",))
def _squeeze(im: _Importer, n: onnx.NodeProto, x: list[Value | None]) -> list[Value]:
    inp = x[0]
    assert inp is not None
    axes = _axes_operand(im, n, x)
    rank = len(inp.shape)
    if axes is None:
        drop = {i for i, d in enumerate(inp.shape) if d == 1}
    else:
        drop = {a + rank if a < 0 else a for a in axes}
        if any(not 0 <= a < rank or inp.shape[a] != 1 for a in drop):
            raise im.fail(f"axes {axes} do not name dimensions of size 1 in "
                          f"{list(inp.shape)}")
    shape = [d for i, d in enumerate(inp.shape) if i not in drop]
    return [im.g.reshape(inp, shape, name=n.name or None)]


@_op("Unsqueeze", (1, 2), ("axes",))
def _unsqueeze(im: _Importer, n: onnx.NodeProto, x: list[Value | None]) -> list[Value]:
    inp = x[0]
    assert inp is not None
    axes = _axes_operand(im, n, x)
    if axes is None:
        raise im.fail("axes are required")
    rank = len(inp.shape) + len(axes)
    ins = sorted(a + rank if a < 0 else a for a in axes)
    if len(set(ins)) != len(ins) or any(not 0 <= a < rank for a in ins):
        raise im.fail(f"axes {axes} are out of range or repeated for rank {rank}")
    shape = list(inp.shape)
    for a in ins:
        shape.insert(a, 1)
    return [im.g.reshape(inp, shape, name=n.name or None)]


def _qparams(im: _Importer, n: onnx.NodeProto, x: list[Value | None]) -> tuple[float, int]:
    a = _attrs(n)
    scale = im.const(x[1], "the scale")
    if scale.size != 1:
        raise im.fail("per-axis (non-scalar) scales are not supported")
    zp = 0
    if len(x) > 2 and x[2] is not None:
        zpa = im.const(x[2], "the zero point")
        if zpa.size != 1:
            raise im.fail("per-axis (non-scalar) zero points are not supported")
        if x[2].dtype != "int8" and not (n.op_type == "DequantizeLinear"
                                          and x[2].dtype == "int32"):
            raise im.fail(f"zero point of type {x[2].dtype} (int8 only)")
        zp = int(zpa.reshape(-1)[0])
    elif n.op_type == "QuantizeLinear" and a.get("output_dtype", 0) == 0:
        raise im.fail("QuantizeLinear without a zero point means uint8 (not supported)")
    out = a.get("output_dtype", 0)
    want = onnx.TensorProto.INT8 if n.op_type == "QuantizeLinear" else onnx.TensorProto.FLOAT
    if out not in (0, want):
        raise im.fail(f"attribute output_dtype {_elem_name(out)}: only "
                      f"{_elem_name(want)} is supported")
    if a.get("precision", 0) not in (0, onnx.TensorProto.FLOAT):
        raise im.fail(f"attribute precision {_elem_name(a['precision'])}: only FLOAT is "
                      f"supported")
    if a.get("block_size", 0):
        raise im.fail("blocked quantization is not supported")
    return float(scale.reshape(-1)[0]), zp


@_op("QuantizeLinear", (2, 3),
     ("axis", "block_size", "output_dtype", "precision", "saturate"))
def _quantize(im: _Importer, n: onnx.NodeProto, x: list[Value | None]) -> list[Value]:
    scale, zp = _qparams(im, n, x)
    inp = x[0]
    assert inp is not None
    if inp.dtype != "float32":
        raise im.fail(f"input of type {inp.dtype} (float32 only)")
    return [im.g.quantize(inp, scale, zp, name=n.name or None)]


@_op("DequantizeLinear", (2, 3), ("axis", "block_size", "output_dtype"))
def _dequantize(im: _Importer, n: onnx.NodeProto, x: list[Value | None]) -> list[Value]:
    scale, zp = _qparams(im, n, x)
    if x[1] is not None and x[1].dtype != "float32":
        raise im.fail(f"scale of type {x[1].dtype} (float32 only)")
    return [im.g.dequantize(x[0], scale, zp, name=n.name or None)]  # type: ignore[arg-type]


@_op("Constant", (0, 0), ("value", "value_float", "value_floats", "value_int",
                          "value_ints"))
def _constant(im: _Importer, n: onnx.NodeProto, x: list[Value | None]) -> list[Value]:
    """Not reached: a Constant has no operands, so it is always folded at import (with
    ONNX's reference semantics for each of its forms)."""
    raise im.fail("a Constant was not folded")  # pragma: no cover


# --- operators of exported models ---------------------------------------------------------

def _fold_only(im: _Importer, n: onnx.NodeProto, x: list[Value | None]) -> list[Value]:
    """Reached only when the operands are not all known: these run at compile time."""
    raise im.fail("its operands must be compile-time values (initializers, Constant nodes "
                  "or static shapes), not tensors computed at run time")


_op("Shape", (1, 1), ("start", "end"))(_fold_only)
_op("Size", (1, 1))(_fold_only)
_op("ConstantOfShape", (1, 1), ("value",))(_fold_only)
_op("Range", (3, 3))(_fold_only)

def _unary(fn: str) -> _Handler:
    def h(im: _Importer, n: onnx.NodeProto, x: list[Value | None]) -> list[Value]:
        return [im.g.add_node("unary", [x[0]], {"fn": fn}, name=n.name or None)[0]]
    return h


for _onnx_op, _fn in (("Erf", "erf"), ("Sqrt", "sqrt"), ("Tanh", "tanh"), ("Exp", "exp"),
                      ("Neg", "neg"), ("Reciprocal", "reciprocal"), ("Abs", "abs"),
                      ("Log", "log")):
    _op(_onnx_op, (1, 1))(_unary(_fn))


def _variadic(op: str) -> _Handler:
    def h(im: _Importer, n: onnx.NodeProto, x: list[Value | None]) -> list[Value]:
        vals = [v for v in x if v is not None]
        acc = vals[0]
        if len(vals) == 1:
            return [im.g.reshape(acc, acc.shape, name=n.name or None)]
        for i, v in enumerate(vals[1:]):
            last = i == len(vals) - 2
            acc = im.g.add_node(op, [acc, v], {}, name=(n.name or None) if last else None)[0]
        return [acc]
    return h


_op("Max", (1, 64))(_variadic("max"))
_op("Min", (1, 64))(_variadic("min"))


def _scalar(im: _Importer, like: Value, value: float, name: str) -> Value:
    return im.g.constant(np.array(value, dtype=like.dtype), name=name)


@_op("Pow", (2, 2))
def _pow(im: _Importer, n: onnx.NodeProto, x: list[Value | None]) -> list[Value]:
    a, b = x[0], x[1]
    assert a is not None and b is not None
    if b.dtype != a.dtype:
        if not b.is_const:
            raise im.fail(f"exponent of type {b.dtype} computed at run time (it must have "
                          f"the base's type {a.dtype} or be a constant)")
        b = im.g.constant(im.const(b, "the exponent").astype(a.dtype), name=f"{b.name}_f")
    return [im.g.add_node("pow", [a, b], {}, name=n.name or None)[0]]


@_op("Clip", (1, 3), ("min", "max"))
def _clip(im: _Importer, n: onnx.NodeProto, x: list[Value | None]) -> list[Value]:
    inp = x[0]
    assert inp is not None
    a = _attrs(n)
    lo: float | None = a.get("min")
    hi: float | None = a.get("max")
    if len(x) > 1 and x[1] is not None:
        lo = float(im.const(x[1], "min").reshape(-1)[0])
    if len(x) > 2 and x[2] is not None:
        hi = float(im.const(x[2], "max").reshape(-1)[0])
    y = inp
    if lo is not None:
        y = im.g.add_node("max", [y, _scalar(im, inp, lo, "clip_min")], {},
                          name=(n.name or None) if hi is None else None)[0]
    if hi is not None:
        y = im.g.add_node("min", [y, _scalar(im, inp, hi, "clip_max")], {},
                          name=n.name or None)[0]
    if y is inp:
        y = im.g.reshape(inp, inp.shape, name=n.name or None)
    return [y]


def _hard_sigmoid(im: _Importer, x: Value, alpha: float, beta: float,
                  name: str | None) -> Value:
    g = im.g
    t = g.add(g.mul(x, _scalar(im, x, alpha, "hs_alpha")), _scalar(im, x, beta, "hs_beta"))
    t = g.add_node("max", [t, _scalar(im, x, 0.0, "hs_zero")], {})[0]
    return g.add_node("min", [t, _scalar(im, x, 1.0, "hs_one")], {}, name=name)[0]


@_op("HardSigmoid", (1, 1), ("alpha", "beta"))
def _hardsigmoid(im: _Importer, n: onnx.NodeProto, x: list[Value | None]) -> list[Value]:
    a = _attrs(n)
    assert x[0] is not None
    return [_hard_sigmoid(im, x[0], float(a.get("alpha", 0.2)), float(a.get("beta", 0.5)),
                          n.name or None)]


@_op("HardSwish", (1, 1))
def _hardswish(im: _Importer, n: onnx.NodeProto, x: list[Value | None]) -> list[Value]:
    assert x[0] is not None
    return [im.g.mul(x[0], _hard_sigmoid(im, x[0], 1 / 6, 0.5, None), name=n.name or None)]


def _auto_pads(im: _Importer, a: dict[str, Any], spatial: Sequence[int],
               kernel: Sequence[int], strides: Sequence[int], dil: Sequence[int],
               pads: tuple[int, ...]) -> tuple[int, ...]:
    """ONNX auto_pad resolved to explicit (top, left, bottom, right) pads."""
    auto = a.get("auto_pad", b"NOTSET")
    auto = auto.decode() if isinstance(auto, bytes) else auto
    if auto not in ("NOTSET", "SAME_UPPER", "SAME_LOWER", "VALID"):
        raise im.fail(f"attribute auto_pad {auto!r} is not NOTSET, SAME_UPPER, SAME_LOWER "
                      f"or VALID")
    if auto == "VALID":
        return (0, 0, 0, 0)
    if auto == "NOTSET":
        return pads
    lo_hi = []
    for d, k, st, dl in zip(spatial, kernel, strides, dil):
        out = -(-d // st)
        total = max(0, (out - 1) * st + (k - 1) * dl + 1 - d)
        lo = total // 2 if auto == "SAME_UPPER" else total - total // 2
        lo_hi.append((lo, total - lo))
    return (lo_hi[0][0], lo_hi[1][0], lo_hi[0][1], lo_hi[1][1])


def _pool(mode: str) -> _Handler:
    def h(im: _Importer, n: onnx.NodeProto, x: list[Value | None]) -> list[Value]:
        inp = x[0]
        assert inp is not None
        a = _attrs(n)
        if len(inp.shape) != 4:
            raise im.fail(f"only 2-D pooling (an NCHW input) is supported, the input is "
                          f"{list(inp.shape)}")
        kernel = _ints(im, a, "kernel_shape", (), 2, 1)
        strides = _ints(im, a, "strides", (1, 1), 2, 1)
        dil = _ints(im, a, "dilations", (1, 1), 2, 1)
        pads = _ints(im, a, "pads", (0, 0, 0, 0), 4, 0)
        pads = _auto_pads(im, a, inp.shape[2:], kernel, strides, dil, pads)
        if a.get("storage_order", 0):
            raise im.fail("attribute storage_order 1 (column-major indices) is not supported")
        attrs = {"mode": mode, "kernel": kernel, "stride": strides, "dilation": dil,
                 "padding": pads, "ceil": bool(a.get("ceil_mode", 0)),
                 "count_include_pad": bool(a.get("count_include_pad", 0))}
        return [im.g.add_node("pool2d", [inp], attrs, name=n.name or None)[0]]
    return h


_op("MaxPool", (1, 1), ("auto_pad", "ceil_mode", "dilations", "kernel_shape", "pads",
                        "storage_order", "strides"))(_pool("max"))
_op("AveragePool", (1, 1), ("auto_pad", "ceil_mode", "count_include_pad", "dilations",
                            "kernel_shape", "pads", "strides"))(_pool("avg"))


def _global_pool(op: str) -> _Handler:
    def h(im: _Importer, n: onnx.NodeProto, x: list[Value | None]) -> list[Value]:
        inp = x[0]
        assert inp is not None
        if len(inp.shape) < 3:
            raise im.fail(f"needs an input of rank >= 3 (N, C, spatial...), got "
                          f"{list(inp.shape)}")
        return [im.g.reduce(inp, op, list(range(2, len(inp.shape))), True,
                            name=n.name or None)]
    return h


_op("GlobalAveragePool", (1, 1))(_global_pool("mean"))
_op("GlobalMaxPool", (1, 1))(_global_pool("max"))


@_op("Concat", (1, 1 << 16), ("axis",))
def _concat(im: _Importer, n: onnx.NodeProto, x: list[Value | None]) -> list[Value]:
    vals = [v for v in x if v is not None]
    if "axis" not in _attrs(n):
        raise im.fail("attribute axis is required")
    ax = _axis(im, int(_attrs(n)["axis"]), len(vals[0].shape))
    if len(vals) == 1:
        return [im.g.reshape(vals[0], vals[0].shape, name=n.name or None)]
    return [im.g.add_node("concat", vals, {"axis": ax}, name=n.name or None)[0]]


def _slice_axis(dim: int, start: int, end: int, step: int) -> tuple[int, int, int]:
    """ONNX Slice on one axis: (first index, count, step); count 0 when empty."""
    if step == 0:
        raise ValueError("step 0")
    if start < 0:
        start += dim
    if end < 0:
        end += dim
    if step > 0:
        start, end = max(0, min(dim, start)), max(0, min(dim, end))
        count = max(0, -(-(end - start) // step))
    else:
        start, end = max(0, min(dim - 1, start)), max(-1, min(dim - 1, end))
        count = max(0, -(-(start - end) // -step))
    return start, count, step


def _slice_to(im: _Importer, inp: Value, per_axis: dict[int, tuple[int, int, int]],
              name: str | None) -> Value:
    sl = []
    for ax, d in enumerate(inp.shape):
        start, end, step = per_axis.get(ax, (0, d, 1))
        try:
            first, count, step = _slice_axis(d, start, end, step)
        except ValueError:
            raise im.fail(f"axis {ax}: step 0") from None
        if count == 0:
            raise im.fail(f"axis {ax}: the slice [{start}:{end}:{step}] of {d} elements is "
                          f"empty (empty tensors are not supported)")
        sl.append((first, count, step))
    if all(t == (0, d, 1) for t, d in zip(sl, inp.shape)):
        return im.g.reshape(inp, inp.shape, name=name)
    return im.g.add_node("slice", [inp], {"slices": tuple(sl)}, name=name)[0]


@_op("Slice", (1, 5), ("starts", "ends", "axes"))
def _slice(im: _Importer, n: onnx.NodeProto, x: list[Value | None]) -> list[Value]:
    inp = x[0]
    assert inp is not None
    a = _attrs(n)
    rank = len(inp.shape)

    def ints(i: int, key: str) -> list[int] | None:
        if len(x) > i and x[i] is not None:
            return [int(v) for v in im.const(x[i], f"the {key} operand").reshape(-1)]
        return [int(v) for v in a[key]] if key in a else None

    starts, ends = ints(1, "starts"), ints(2, "ends")
    if starts is None or ends is None:
        raise im.fail("starts and ends are required")
    axes = ints(3, "axes") or list(range(len(starts)))
    steps = ints(4, "steps") or [1] * len(starts)
    if not len(starts) == len(ends) == len(axes) == len(steps):
        raise im.fail(f"starts {starts}, ends {ends}, axes {axes} and steps {steps} differ "
                      f"in length")
    per_axis: dict[int, tuple[int, int, int]] = {}
    for st, en, ax, sp in zip(starts, ends, axes, steps):
        axn = _axis(im, ax, rank)
        if axn in per_axis:
            raise im.fail(f"axis {ax} is repeated")
        per_axis[axn] = (st, en, sp)
    return [_slice_to(im, inp, per_axis, n.name or None)]


@_op("Split", (1, 2), ("axis", "split", "num_outputs"))
def _split(im: _Importer, n: onnx.NodeProto, x: list[Value | None]) -> list[Value]:
    inp = x[0]
    assert inp is not None
    a = _attrs(n)
    ax = _axis(im, int(a.get("axis", 0)), len(inp.shape))
    d = inp.shape[ax]
    if len(x) > 1 and x[1] is not None:
        sizes = [int(v) for v in im.const(x[1], "the split operand").reshape(-1)]
    elif "split" in a:
        sizes = [int(v) for v in a["split"]]
    else:
        k = int(a.get("num_outputs", len(n.output)))
        if k < 1:
            raise im.fail(f"num_outputs {k} must be >= 1")
        part = -(-d // k)
        sizes = [min(part, d - i * part) for i in range(k)]
    if sum(sizes) != d or any(v < 1 for v in sizes) or len(sizes) != len(n.output):
        raise im.fail(f"split {sizes} into {len(n.output)} output(s) does not cover axis "
                      f"{ax} of {d} elements with non-empty parts")
    outs, pos = [], 0
    for i, sz in enumerate(sizes):
        nm = f"{n.name}_{i}" if n.name else None
        outs.append(_slice_to(im, inp, {ax: (pos, pos + sz, 1)}, nm))
        pos += sz
    return outs


@_op("Gather", (2, 2), ("axis",))
def _gather(im: _Importer, n: onnx.NodeProto, x: list[Value | None]) -> list[Value]:
    data, idx = x[0], x[1]
    assert data is not None and idx is not None
    ax = _axis(im, int(_attrs(n).get("axis", 0)), len(data.shape))
    if idx.dtype != "int32":
        raise im.fail(f"indices of type {idx.dtype} (int32 or int64 only)")
    if idx.is_const:
        d = data.shape[ax]
        c = im.const(idx, "the indices").astype(np.int64)
        if np.any((c < -d) | (c >= d)):
            raise im.fail(f"indices {c.reshape(-1).tolist()[:8]} outside [-{d}, {d})")
    return [im.g.add_node("gather", [data, idx], {"axis": ax}, name=n.name or None)[0]]


@_op("Pad", (1, 4), ("mode", "pads", "value"))
def _pad(im: _Importer, n: onnx.NodeProto, x: list[Value | None]) -> list[Value]:
    inp = x[0]
    assert inp is not None
    a = _attrs(n)
    mode = a.get("mode", b"constant")
    mode = mode.decode() if isinstance(mode, bytes) else mode
    if mode not in ("constant", "edge", "reflect", "wrap"):
        raise im.fail(f"mode {mode!r}: one of constant, edge, reflect, wrap")
    r = len(inp.shape)
    if len(x) > 1 and x[1] is not None:
        pads = [int(v) for v in im.const(x[1], "the pads operand").reshape(-1)]
    else:
        pads = [int(v) for v in a.get("pads", [])]
    value = float(a.get("value", 0.0))
    if len(x) > 2 and x[2] is not None:
        cv = im.const(x[2], "the constant value")
        value = float(cv.reshape(-1)[0]) if cv.size else 0.0
    axes = list(range(r))
    if len(x) > 3 and x[3] is not None:
        axes = [_axis(im, int(v), r) for v in im.const(x[3], "the axes operand").reshape(-1)]
    if len(pads) != 2 * len(axes):
        raise im.fail(f"pads {pads} must have 2 x {len(axes)} entries")
    full = [0] * (2 * r)
    for i, ax in enumerate(axes):
        full[ax], full[ax + r] = pads[i], pads[i + len(axes)]
    y = inp
    if any(p < 0 for p in full):   # negative pads crop: a slice first
        crop = {ax: (max(0, -full[ax]), inp.shape[ax] - max(0, -full[ax + r]), 1)
                for ax in range(r) if full[ax] < 0 or full[ax + r] < 0}
        y = _slice_to(im, y, crop, None)
        full = [max(0, p) for p in full]
    if not any(full):
        return [im.g.reshape(y, y.shape, name=n.name or None)]
    if mode != "constant":
        return [_pad_by_index(im, n, y, full, mode)]
    return [im.g.add_node("pad", [y], {"pads": tuple(full), "value": value},
                          name=n.name or None)[0]]


def _pad_by_index(im: _Importer, n: onnx.NodeProto, y: Value, full: list[int],
                  mode: str) -> Value:
    """edge / reflect / wrap padding: each padded axis is one GATHER of the source
    positions the padded positions copy (clamped, mirrored without the edge, or modulo),
    so no new instruction is needed."""
    r = len(y.shape)
    for ax in range(r):
        before, after = full[ax], full[ax + r]
        if not before and not after:
            continue
        d = y.shape[ax]
        pos = np.arange(-before, d + after)
        if mode == "edge":
            idx = np.clip(pos, 0, d - 1)
        elif mode == "wrap":
            idx = pos % d
        else:
            if d < 2 or before >= d or after >= d:
                raise im.fail(f"reflect padding of {before}+{after} on an axis of {d} "
                              f"elements (each pad must be less than the axis)")
            idx = np.abs(pos)
            idx = np.where(idx >= d, 2 * (d - 1) - idx, idx)
        c = im.constant(idx.astype(np.int32), f"{n.name or 'pad'}_{mode}_idx{ax}")
        y = im.g.add_node("gather", [y, c], {"axis": ax},
                          name=(f"{n.name}_{ax}" if n.name else None))[0]
    return y


@_op("Expand", (2, 2))
def _expand(im: _Importer, n: onnx.NodeProto, x: list[Value | None]) -> list[Value]:
    inp = x[0]
    assert inp is not None
    shape = [int(v) for v in im.const(x[1], "the shape operand").reshape(-1)]
    try:
        out = tuple(int(d) for d in np.broadcast_shapes(inp.shape, tuple(shape)))
    except ValueError:
        raise im.fail(f"{list(inp.shape)} does not broadcast with {shape}") from None
    if out == inp.shape:
        return [im.g.reshape(inp, inp.shape, name=n.name or None)]
    return [im.g.add_node("expand", [inp], {"shape": out}, name=n.name or None)[0]]


def _as_dtype_of(im: _Importer, v: Value, other: Value, what: str) -> Value:
    """A constant operand in the dtype of the runtime one (ONNX types both alike; the
    importer may have narrowed one side: int64 -> int32, bool -> int8)."""
    if v.dtype == other.dtype:
        return v
    if v.is_const:
        arr = im.const(v, what)
        cast = arr.astype(other.dtype)
        if np.array_equal(cast.astype(arr.dtype), arr):
            return im.g.constant(cast, name=f"{v.name}_{other.dtype}")
    raise im.fail(f"{what} is {v.dtype} but the other operand is {other.dtype}")


def _compare(fn: str) -> _Handler:
    def h(im: _Importer, n: onnx.NodeProto, x: list[Value | None]) -> list[Value]:
        a = x[0]
        assert a is not None
        if fn == "not":
            return [im.g.add_node("compare", [a], {"fn": fn}, name=n.name or None)[0]]
        b = x[1]
        assert b is not None
        if a.is_const and not b.is_const:
            a = _as_dtype_of(im, a, b, "operand A")
        else:
            b = _as_dtype_of(im, b, a, "operand B")
        return [im.g.add_node("compare", [a, b], {"fn": fn}, name=n.name or None)[0]]
    return h


for _onnx_op, _fn in (("Equal", "equal"), ("Less", "less"), ("Greater", "greater"),
                      ("LessOrEqual", "less_equal"), ("GreaterOrEqual", "greater_equal"),
                      ("And", "and"), ("Or", "or"), ("Xor", "xor")):
    _op(_onnx_op, (2, 2))(_compare(_fn))
_op("Not", (1, 1))(_compare("not"))


@_op("Where", (3, 3))
def _where(im: _Importer, n: onnx.NodeProto, x: list[Value | None]) -> list[Value]:
    """Where with a condition computed at run time: SELECT (the condition an int8 mask,
    branches of any dtype, exact for inf and NaN). With a compile-time condition (the
    masks exporters make from shapes) and float branches: out = a * m + b * (1 - m), a
    constant branch folded into the added term (exact for finite values of the
    branch(es) computed at run time)."""
    c, a, b = x
    assert c is not None and a is not None and b is not None
    if a.is_const and not b.is_const:
        a = _as_dtype_of(im, a, b, "branch X")
    else:
        b = _as_dtype_of(im, b, a, "branch Y")
    try:
        shape = tuple(int(d) for d in np.broadcast_shapes(c.shape, a.shape, b.shape))
    except ValueError:
        raise im.fail(f"condition {list(c.shape)}, {list(a.shape)} and {list(b.shape)} "
                      f"do not broadcast") from None
    g, dt = im.g, a.dtype
    if not c.is_const or dt not in ("float32", "float16"):
        if c.is_const:
            c = g.constant((im.const(c, "the condition") != 0).astype(np.int8),
                           name=f"{n.name or 'where'}_mask")
        elif c.dtype != "int8":
            raise im.fail(f"condition of type {c.dtype} (a bool tensor is needed)")
        return [g.add_node("select", [c, a, b], {}, name=n.name or None)[0]]
    cond = im.const(c, "the condition").astype(bool)
    m = np.broadcast_to(cond, shape)
    terms: list[Value] = []
    fixed = np.zeros(shape, dt)
    for v, sel in ((a, m), (b, ~m)):
        if v.is_const:
            fixed = np.where(sel, np.broadcast_to(im.const(v, "a branch"), shape), fixed)
        else:
            terms.append(g.mul(v, g.constant(sel.astype(dt), name=f"{n.name or 'where'}_m")))
    if not terms:
        return [g.reshape(g.constant(fixed.astype(dt)), shape, name=n.name or None)]
    out = terms[0] if len(terms) == 1 else g.add(terms[0], terms[1])
    if len(terms) == 1 or np.any(fixed):
        out = g.add(out, g.constant(fixed.astype(dt), name=f"{n.name or 'where'}_fill"),
                    name=n.name or None)
    return [out]


def import_model(model: onnx.ModelProto | bytes | str,
                 static_inputs: Mapping[str, Any] | None = None) -> Graph:
    """An ONNX model (proto, serialized bytes or a path) as a Graph."""
    from google.protobuf.message import DecodeError  # type: ignore[import-untyped]
    try:
        if isinstance(model, (bytes, bytearray)):
            model = onnx.load_model_from_string(bytes(model))
        elif isinstance(model, str):
            model = onnx.load(model)
    except DecodeError as e:
        raise OnnxImportError(f"not an ONNX model (protobuf: {e})") from None
    if not isinstance(model, onnx.ModelProto):
        raise OnnxImportError(f"not an ONNX model: {type(model).__name__}")
    check_model(model)
    return _Importer(model, static_inputs or {}).run()


def static_input_names(model: onnx.ModelProto) -> set[str]:
    """Graph inputs (without an initializer) used as static operands (STATIC_OPERANDS).
    Only graph inputs: an operand made by a Constant node or an initializer is known
    to the importer already."""
    inits = {i.name for i in model.graph.initializer}
    inputs = {i.name for i in model.graph.input} - inits
    names: set[str] = set()
    for node in model.graph.node:
        for pos in STATIC_OPERANDS.get(node.op_type, ()):
            if pos < len(node.input) and node.input[pos] in inputs:
                names.add(node.input[pos])
    return names
