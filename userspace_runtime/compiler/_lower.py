"""Lowering: a checked, optimized Graph -> VA-1 commands with relocations, tiled to the
scratchpad, with intermediates placed in one workspace by liveness.

Addresses are never known at compile time: every address field is emitted as 0 with a
R_VA1_DEVADDR64 relocation against .va1.const, .va1.bss (workspace) or an argument
slot symbol; the loader patches them after it allocates device memory.
"""
from __future__ import annotations

import math
import struct
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from hwspec import isa
from hwspec.isa import DType, Opcode

from ..codeobject import _format as F
from ..commands import CommandBufferBuilder
from ._ir import Graph, GraphError, Node, Value
from ._target import Target

_ALIGN = 64
_NP_TO_ISA = {"float32": DType.F32, "float16": DType.F16, "int8": DType.I8,
              "int32": DType.I32}
_ACT = {None: 0, "relu": 1, "gelu": 2, "sigmoid": 3, "silu": 4}
_COMMUTATIVE = (isa.EltOp.ADD, isa.EltOp.MUL, isa.EltOp.MAX, isa.EltOp.MIN)
_UNARY = {"erf": isa.EltOp.ERF, "sqrt": isa.EltOp.SQRT, "tanh": isa.EltOp.TANH,
          "exp": isa.EltOp.EXP, "neg": isa.EltOp.NEG, "reciprocal": isa.EltOp.RECIPROCAL,
          "abs": isa.EltOp.ABS, "log": isa.EltOp.LOG, "silu": isa.EltOp.SILU}


class LoweringError(GraphError):
    """The graph cannot be lowered to the VA-1 ISA (the message names the node)."""


@dataclass(frozen=True)
class Ref:
    """A device address to be: `symbol` (a section or an argument slot) plus offset."""

    symbol: str
    offset: int = 0

    def at(self, nbytes: int) -> Ref:
        return Ref(self.symbol, self.offset + nbytes)


@dataclass
class Lowered:
    """What lowering produced for one function."""

    text: bytes
    relocations: list[F.Relocation]
    labels: list[tuple[int, str]]
    const: bytes
    constants: list[tuple[str, int, int]]
    workspace_size: int
    names: dict[int, str] = field(default_factory=dict)


class Emitter:
    """Packs commands from the hwspec layouts and records a relocation for every
    address field given as a Ref."""

    def __init__(self) -> None:
        self.builder = CommandBufferBuilder()
        self.relocs: list[F.Relocation] = []
        self.labels: list[tuple[int, str]] = []

    def label(self, name: str) -> None:
        """Name the next command; a node that emitted nothing loses its label."""
        if self.labels and self.labels[-1][0] == self.builder.size:
            self.labels.pop()
        self.labels.append((self.builder.size, name))

    def cmd(self, opcode: Opcode, fields: dict[str, Any], *, flags: int = 0,
            name: str = "") -> None:
        layout = isa.PAYLOAD[opcode]
        unknown = set(fields) - set(layout.names)
        if unknown:
            raise AssertionError(f"{opcode.name}: unknown fields {sorted(unknown)}")
        base = self.builder.size + isa.HEADER.size
        values = []
        for fname, code in layout.fields:
            v = fields.get(fname, 0)
            if isinstance(v, Ref):
                self.relocs.append(F.Relocation(base + layout.offsets[fname],
                                                F.R_VA1_DEVADDR64, v.symbol, v.offset))
                v = 0
            values.append(v)
        self.builder.raw(opcode, struct.pack(layout.format, *values), flags=flags,
                         name=name or opcode.name)


# --- memory planning ---------------------------------------------------------------------


@dataclass
class MemoryPlan:
    """Where each value lives, and the workspace size (the liveness peak)."""

    loc: dict[int, Ref]
    temps: dict[int, Ref]          # id(node) -> its temporary workspace
    workspace_size: int
    const: bytes
    constants: list[tuple[str, int, int]]
    copies_out: list[tuple[Ref, Value]]   # (source, output value) to copy at the end


def _align(n: int, a: int = _ALIGN) -> int:
    return (n + a - 1) // a * a


def plan_memory(g: Graph, arg_symbols: dict[int, str],
                temp_bytes: Callable[[Node], int]) -> MemoryPlan:
    """Constants get offsets in .va1.const; arguments live in their slots; reshape
    outputs alias their input; every other value gets a workspace block by first-fit
    over its live range [defining node, last reader]."""
    # constants
    const = bytearray()
    constants: list[tuple[str, int, int]] = []
    loc: dict[int, Ref] = {}
    for v in g.values():
        if v.is_const and id(v) not in loc:
            off = _align(len(const))
            const += b"\0" * (off - len(const))
            const += np.ascontiguousarray(v.const).tobytes()
            loc[id(v)] = Ref(F.CONST, off)
            constants.append((f"const.{v.name}", off, v.nbytes))
    if not const:
        const = bytearray(b"\0" * 8)  # never empty: the section symbol needs a home
    # alias classes for reshape (same bytes)
    parent: dict[int, Value] = {}

    def root(v: Value) -> Value:
        while id(v) in parent:
            v = parent[id(v)]
        return v

    for n in g.nodes:
        if n.op == "reshape":
            parent[id(n.outputs[0])] = n.inputs[0]  # type: ignore[assignment]
    members: dict[int, list[Value]] = {}
    for v in g.values():
        members.setdefault(id(root(v)), []).append(v)
    in_ids = {id(i) for i in g.inputs}
    for rid, vals in members.items():
        r = root(vals[0])
        if id(r) in loc:      # a constant class
            for v in vals:
                loc[id(v)] = loc[id(r)].at(0)
            continue
        inputs = [v for v in vals if id(v) in in_ids]
        outs = [v for v in vals if id(v) in arg_symbols and id(v) not in in_ids]
        home = inputs[0] if inputs else outs[0] if outs else None
        if home is not None:
            for v in vals:
                loc[id(v)] = Ref(arg_symbols[id(home)])
    copies: list[tuple[Ref, Value]] = []
    for v in g.outputs:
        if loc.get(id(v)) is not None and loc[id(v)] != Ref(arg_symbols[id(v)]):
            copies.append((loc[id(v)], v))
    # live ranges of workspace classes (and node temps)
    index = {id(n): i for i, n in enumerate(g.nodes)}
    start: dict[int, int] = {}
    end: dict[int, int] = {}
    size: dict[int, int] = {}
    for n in g.nodes:
        i = index[id(n)]
        for v in n.outputs:
            r = root(v)
            if id(r) in loc or id(v) in loc:
                continue
            start.setdefault(id(r), i)
            end[id(r)] = max(end.get(id(r), i), i)
            size[id(r)] = max(size.get(id(r), 0), r.nbytes)
        for u in n.inputs:
            if u is None:
                continue
            r = root(u)
            if id(r) in start:
                end[id(r)] = max(end[id(r)], i)
    for v in g.outputs:
        r = root(v)
        if id(r) in start:
            end[id(r)] = len(g.nodes)
    items = [(start[k], end[k], size[k], k) for k in start]
    temps_needed = [(index[id(n)], index[id(n)], temp_bytes(n), -1 - index[id(n)])
                    for n in g.nodes if temp_bytes(n) > 0]
    placed: list[tuple[int, int, int, int]] = []   # (start, end, offset, size)
    offsets: dict[int, int] = {}
    peak = 0
    for s, e, sz, key in sorted(items + temps_needed, key=lambda t: (t[0], -t[2])):
        sz = _align(max(sz, 1))
        # blocks are placed in order of their start: one that ended before this start
        # overlaps nothing later (dropping it keeps a long chain linear, not quadratic)
        placed = [p for p in placed if p[1] >= s]
        busy = sorted((o, o + z) for ps, pe, o, z in placed if not (pe < s or ps > e))
        off = 0
        for lo, hi in busy:
            if off + sz <= lo:
                break
            off = max(off, hi)
        placed.append((s, e, off, sz))
        offsets[key] = off
        peak = max(peak, off + sz)
    for v in g.values():
        if id(v) not in loc:
            r = root(v)
            if id(r) in offsets:
                loc[id(v)] = Ref(F.BSS, offsets[id(r)])
    temps = {id(n): Ref(F.BSS, offsets[-1 - index[id(n)]]) for n in g.nodes
             if -1 - index[id(n)] in offsets}
    return MemoryPlan(loc, temps, peak, bytes(const), constants, copies)


# --- lowering helpers ---------------------------------------------------------------------


def isa_dtype(v: Value) -> DType:
    return _NP_TO_ISA[v.dtype]


def _merge_dims(shape: tuple[int, ...], *strides: tuple[int, ...]
                ) -> tuple[tuple[int, ...], list[tuple[int, ...]]]:
    """Drop extent-1 dims and merge dims that are contiguous in every stride set."""
    dims = [(d, [s[i] for s in strides]) for i, d in enumerate(shape) if d != 1]
    if not dims:
        return (1,), [(0,) for _ in strides]
    out = [dims[0]]
    for d, st in dims[1:]:
        pd, pst = out[-1]
        if all(ps == s * d for ps, s in zip(pst, st)):
            out[-1] = (pd * d, st)
        else:
            out.append((d, st))
    return tuple(d for d, _ in out), [tuple(st[k] for _, st in out) for k in range(len(strides))]


def contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    st = []
    acc = 1
    for d in reversed(shape):
        st.append(acc)
        acc *= d
    return tuple(reversed(st))


class Lowerer:
    """Emits the commands of one graph."""

    def __init__(self, g: Graph, target: Target, plan: MemoryPlan, em: Emitter) -> None:
        self.g, self.target, self.plan, self.em = g, target, plan, em
        self.extra_consts: list[np.ndarray] = []

    def ref(self, v: Value) -> Ref:
        return self.plan.loc[id(v)]

    # -- generic strided copy -----------------------------------------------------------

    def copy(self, dt: DType, src: Ref, dst: Ref, shape: tuple[int, ...],
             src_strides: tuple[int, ...], dst_strides: tuple[int, ...], name: str) -> None:
        """dst[idx] = src[idx] with element strides; > 4 merged dims loop outside."""
        es = isa.DTYPE_SIZE[dt]
        shp, (ss, ds) = _merge_dims(shape, src_strides, dst_strides)
        if shp == (1,) or (len(shp) == 1 and ss[0] == 1 and ds[0] == 1):
            self.em.cmd(Opcode.DMA_D2D, {"src": src, "dst": dst, "size": shp[0] * es},
                        name=name)
            return
        if len(shp) > isa.COPY_MAX_DIMS:
            lead = len(shp) - isa.COPY_MAX_DIMS
            for idx in np.ndindex(*shp[:lead]):
                so = sum(i * s for i, s in zip(idx, ss[:lead]))
                do = sum(i * s for i, s in zip(idx, ds[:lead]))
                self.copy(dt, src.at(so * es), dst.at(do * es), shp[lead:], ss[lead:],
                          ds[lead:], name)
            return
        f: dict[str, Any] = {"dtype": dt, "ndim": len(shp), "src": src, "dst": dst}
        for i, (d, s, t) in enumerate(zip(shp, ss, ds)):
            f[f"shape{i}"], f[f"src_stride{i}"], f[f"dst_stride{i}"] = d, s, t
        self.em.cmd(Opcode.COPY, f, name=name)

    def broadcast_into(self, v: Value, out_shape: tuple[int, ...], dst: Ref, name: str
                       ) -> None:
        """Materialize `v` broadcast to `out_shape` at `dst` (COPY, source stride 0)."""
        rank = len(out_shape)
        vs = (1,) * (rank - len(v.shape)) + v.shape
        cs = contiguous_strides(vs)
        ss = tuple(0 if d == 1 else s for d, s in zip(vs, cs))
        self.copy(isa_dtype(v), self.ref(v), dst, out_shape, ss,
                  contiguous_strides(out_shape), name)

    def const_ref(self, arr: np.ndarray) -> Ref:
        """A constant created during lowering (ones, zeros): appended to .va1.const."""
        arr = np.ascontiguousarray(arr)
        self.extra_consts.append(arr)
        off = sum(_align(a.nbytes) for a in self.extra_consts[:-1])
        return Ref("@extra", off)

    # -- per-op ---------------------------------------------------------------------------

    def lower(self, n: Node) -> None:
        self.em.label(f"{n.name}")
        fn = getattr(self, f"_{n.op}", None)
        if fn is None:
            raise LoweringError(f"node {n.name}: op {n.op} has no VA-1 lowering")
        fn(n)

    def _reshape(self, n: Node) -> None:
        src, dst = self.ref(n.inputs[0]), self.ref(n.outputs[0])  # type: ignore[arg-type]
        if src != dst:
            self.em.cmd(Opcode.DMA_D2D, {"src": src, "dst": dst, "size": n.outputs[0].nbytes},
                        name=f"{n.name}: reshape copy")

    def _transpose(self, n: Node) -> None:
        x = n.inputs[0]
        assert x is not None
        perm = n.attrs["perm"]
        st = contiguous_strides(x.shape)
        out = n.outputs[0]
        self.copy(isa_dtype(x), self.ref(x), self.ref(out), out.shape,
                  tuple(st[p] for p in perm), contiguous_strides(out.shape),
                  f"{n.name}: transpose {list(perm)}")

    # elementwise
    def _rows(self, count: int, es: int, per: int) -> int:
        """Elements per tile so that `per` operands of `es` bytes fit the scratchpad."""
        return max(1, self.target.scratchpad_size // (per * es))

    def _eltwise(self, n: Node, op: isa.EltOp) -> None:
        out = n.outputs[0]
        dt = isa_dtype(out)
        es = isa.DTYPE_SIZE[dt]
        a = n.inputs[0]
        assert a is not None
        if op in isa.UNARY_ELT_OPS:
            self._elt_tiles(n, op, dt, self.ref(a), None, self.ref(out), out.size, 0)
            return
        b = n.inputs[1]
        assert b is not None
        ra, rb = self.ref(a), self.ref(b)
        if a.shape != out.shape and b.shape == out.shape and op in _COMMUTATIVE:
            a, b, ra, rb = b, a, rb, ra
        if a.shape != out.shape:
            tmp = self.plan.temps[id(n)]
            self.broadcast_into(a, out.shape, tmp, f"{n.name}: broadcast a")
            ra = tmp
            tmp2: Ref | None = tmp.at(_align(out.nbytes))
        else:
            tmp2 = self.plan.temps.get(id(n))
        if b.shape == out.shape:
            self._elt_tiles(n, op, dt, ra, rb, self.ref(out), out.size, 0)
            return
        # b broadcasts: a suffix vector -> BROADCAST_B; otherwise materialize it
        bs = (1,) * (len(out.shape) - len(b.shape)) + b.shape
        k = next((i for i, d in enumerate(bs) if d != 1), len(bs))
        if bs[k:] == out.shape[k:]:
            cols = math.prod(out.shape[k:])
            self._elt_tiles(n, op, dt, ra, rb, self.ref(out), out.size, cols)
            return
        assert tmp2 is not None
        self.broadcast_into(b, out.shape, tmp2, f"{n.name}: broadcast b")
        self._elt_tiles(n, op, dt, ra, tmp2, self.ref(out), out.size, 0)

    def _elt_tiles(self, n: Node, op: isa.EltOp, dt: DType, a: Ref, b: Ref | None, out: Ref,
                   count: int, cols: int) -> None:
        es = isa.DTYPE_SIZE[dt]
        per = 2 if b is None else 3
        chunk = self._rows(count, es, per)
        if cols:
            chunk = max(cols, chunk // cols * cols)
        for lo in range(0, count, chunk):
            c = min(chunk, count - lo)
            f: dict[str, Any] = {"op": op, "dtype": dt, "count": c, "a": a.at(lo * es),
                                 "out": out.at(lo * es)}
            flags = 0
            if b is not None:
                if cols:
                    f["b"], f["cols"] = b, cols
                    flags = isa.ELT_BROADCAST_B
                else:
                    f["b"] = b.at(lo * es)
            self.em.cmd(Opcode.ELEMENTWISE, f, flags=flags,
                        name=f"{n.name}: {op.name.lower()} [{lo}, {lo + c})")

    # masks ---------------------------------------------------------------------------

    def _materialize(self, v: Value, out_shape: tuple[int, ...], tmp: Ref | None,
                     name: str) -> tuple[Ref, Ref | None]:
        """v as a dense tensor of out_shape: itself, or broadcast into the temp (and the
        temp's next free block)."""
        if v.shape == out_shape:
            return self.ref(v), tmp
        assert tmp is not None
        self.broadcast_into(v, out_shape, tmp, name)
        return tmp, tmp.at(_align(math.prod(out_shape) * isa.DTYPE_SIZE[isa_dtype(v)]))

    def _compare(self, n: Node) -> None:
        a, b = n.inputs[0], (n.inputs[1] if len(n.inputs) > 1 else None)
        assert a is not None
        out = n.outputs[0]
        dt = isa_dtype(a)
        es = isa.DTYPE_SIZE[dt]
        op = isa.CmpOp[n.attrs["fn"].upper()]
        ra, tmp = self._materialize(a, out.shape, self.plan.temps.get(id(n)),
                                    f"{n.name}: broadcast a")
        rb: Ref | None = None
        cols = 0
        if b is not None:
            if b.shape != out.shape and _suffix_broadcast(b.shape, out.shape):
                bs = (1,) * (len(out.shape) - len(b.shape)) + b.shape
                k = next((i for i, d in enumerate(bs) if d != 1), len(bs))
                rb, cols = self.ref(b), math.prod(out.shape[k:])
            else:
                rb, tmp = self._materialize(b, out.shape, tmp, f"{n.name}: broadcast b")
        count = out.size
        chunk = max(1, self.target.scratchpad_size // (2 * es + 1))
        if cols:
            chunk = max(cols, chunk // cols * cols)
        for lo in range(0, count, chunk):
            c = min(chunk, count - lo)
            f: dict[str, Any] = {"op": op, "dtype": dt, "count": c, "a": ra.at(lo * es),
                                 "out": self.ref(out).at(lo)}
            if rb is not None:
                f["b"], f["cols"] = (rb, cols) if cols else (rb.at(lo * es), 0)
            self.em.cmd(Opcode.COMPARE, f, flags=isa.CMP_BROADCAST_B if cols else 0,
                        name=f"{n.name}: {op.name.lower()} [{lo}, {lo + c})")

    def _select(self, n: Node) -> None:
        c, a, b = n.inputs[0], n.inputs[1], n.inputs[2]
        assert c is not None and a is not None and b is not None
        out = n.outputs[0]
        dt = isa_dtype(out)
        es = isa.DTYPE_SIZE[dt]
        tmp = self.plan.temps.get(id(n))
        rc, tmp = self._materialize(c, out.shape, tmp, f"{n.name}: broadcast cond")
        ra, tmp = self._materialize(a, out.shape, tmp, f"{n.name}: broadcast a")
        rb, tmp = self._materialize(b, out.shape, tmp, f"{n.name}: broadcast b")
        chunk = max(1, self.target.scratchpad_size // (3 * es + 1))
        for lo in range(0, out.size, chunk):
            k = min(chunk, out.size - lo)
            self.em.cmd(Opcode.SELECT, {"dtype": dt, "count": k, "cond": rc.at(lo),
                                        "a": ra.at(lo * es), "b": rb.at(lo * es),
                                        "out": self.ref(out).at(lo * es)},
                        name=f"{n.name}: select [{lo}, {lo + k})")

    def _add(self, n: Node) -> None:
        self._eltwise(n, isa.EltOp.ADD)

    def _sub(self, n: Node) -> None:
        self._eltwise(n, isa.EltOp.SUB)

    def _mul(self, n: Node) -> None:
        self._eltwise(n, isa.EltOp.MUL)

    def _div(self, n: Node) -> None:
        self._eltwise(n, isa.EltOp.DIV)

    def _relu(self, n: Node) -> None:
        self._eltwise(n, isa.EltOp.RELU)

    def _gelu(self, n: Node) -> None:
        if n.attrs.get("approximate", "none") != "none":
            raise LoweringError(f"node {n.name}: gelu approximate={n.attrs['approximate']!r} "
                                f"has no VA-1 lowering (exact erf form only)")
        self._eltwise(n, isa.EltOp.GELU)

    def _sigmoid(self, n: Node) -> None:
        self._eltwise(n, isa.EltOp.SIGMOID)

    def _silu(self, n: Node) -> None:
        self._eltwise(n, isa.EltOp.SILU)

    def _unary(self, n: Node) -> None:
        self._eltwise(n, _UNARY[n.attrs["fn"]])

    def _max(self, n: Node) -> None:
        self._eltwise(n, isa.EltOp.MAX)

    def _min(self, n: Node) -> None:
        self._eltwise(n, isa.EltOp.MIN)

    def _pow(self, n: Node) -> None:
        self._eltwise(n, isa.EltOp.POW)

    # pooling and data movement ----------------------------------------------------------

    def _pool2d(self, n: Node) -> None:
        x, y = n.inputs[0], n.outputs[0]
        assert x is not None
        at = n.attrs
        N, C, H, W = x.shape
        (r, s), (sh, sw), (dh, dw) = at["kernel"], at["stride"], at["dilation"]
        pt, pl, pb, pr = at["padding"]
        if max(pt, pb) >= dh * (r - 1) + 1 or max(pl, pr) >= dw * (s - 1) + 1:
            raise LoweringError(f"node {n.name}: pool2d padding {list(at['padding'])} not "
                                f"below the kernel extent")
        dt = isa_dtype(x)
        es = isa.DTYPE_SIZE[dt]
        oh, ow = y.shape[2:]
        flags = (isa.POOL_CEIL if at.get("ceil") else 0) | (
            isa.POOL_COUNT_INCLUDE_PAD if at.get("count_include_pad") else 0)
        per_image = C * (H * W + oh * ow) * es
        imgs = max(1, self.target.scratchpad_size // max(per_image, 1))
        for n0 in range(0, N, imgs):
            nb = min(imgs, N - n0)
            self.em.cmd(Opcode.POOL2D, {
                "dtype": dt, "op": isa.PoolOp.MAX if at["mode"] == "max" else isa.PoolOp.AVG,
                "n": nb, "c": C, "h": H, "w": W, "r": r, "s": s, "stride_h": sh,
                "stride_w": sw, "dilation_h": dh, "dilation_w": dw, "pad_top": pt,
                "pad_left": pl, "pad_bottom": pb, "pad_right": pr,
                "x": self.ref(x).at(n0 * C * H * W * es),
                "y": self.ref(y).at(n0 * C * oh * ow * es)}, flags=flags,
                name=f"{n.name}: {at['mode']}pool images [{n0}, {n0 + nb})")

    def _concat(self, n: Node) -> None:
        out = n.outputs[0]
        ax = n.attrs["axis"] % len(out.shape)
        outer = math.prod(out.shape[:ax])
        inner = math.prod(out.shape[ax + 1:])
        dt = isa_dtype(out)
        es = isa.DTYPE_SIZE[dt]
        pos = 0
        for v in n.inputs:
            assert v is not None
            cols = v.shape[ax] * inner
            self.copy(dt, self.ref(v), self.ref(out).at(pos * inner * es), (outer, cols),
                      (cols, 1), (out.shape[ax] * inner, 1), f"{n.name}: concat {v.name}")
            pos += v.shape[ax]

    def _slice(self, n: Node) -> None:
        x, out = n.inputs[0], n.outputs[0]
        assert x is not None
        dt = isa_dtype(x)
        es = isa.DTYPE_SIZE[dt]
        st = contiguous_strides(x.shape)
        sl = n.attrs["slices"]
        neg = [i for i, t in enumerate(sl) if t[2] < 0]
        ost = contiguous_strides(out.shape)
        for idx in np.ndindex(*[sl[i][1] for i in neg]):
            # axes with a negative step are walked index by index (COPY strides are
            # unsigned); the others are one strided COPY
            fixed = dict(zip(neg, idx))
            src = sum((t[0] + fixed.get(i, 0) * t[2]) * st[i] for i, t in enumerate(sl))
            dst = sum(fixed.get(i, 0) * ost[i] for i in range(len(sl)))
            shape = tuple(1 if i in fixed else t[1] for i, t in enumerate(sl))
            sst = tuple(0 if i in fixed else t[2] * st[i] for i, t in enumerate(sl))
            self.copy(dt, self.ref(x).at(src * es), self.ref(out).at(dst * es), shape, sst,
                      ost, f"{n.name}: slice")

    def _gather(self, n: Node) -> None:
        data, idx = n.inputs[0], n.inputs[1]
        out = n.outputs[0]
        assert data is not None and idx is not None
        ax = n.attrs["axis"] % len(data.shape)
        outer = math.prod(data.shape[:ax])
        rows = data.shape[ax]
        cols = math.prod(data.shape[ax + 1:])
        dt = isa_dtype(data)
        es = isa.DTYPE_SIZE[dt]
        count = idx.size
        for a in range(outer):
            self.em.cmd(Opcode.GATHER, {
                "dtype": dt, "rows": rows, "cols": cols, "count": count,
                "table": self.ref(data).at(a * rows * cols * es), "indices": self.ref(idx),
                "out": self.ref(out).at(a * count * cols * es)},
                name=f"{n.name}: gather [{a}] {count} of {rows}x{cols}")

    def _pad(self, n: Node) -> None:
        x, out = n.inputs[0], n.outputs[0]
        assert x is not None
        dt = isa_dtype(x)
        es = isa.DTYPE_SIZE[dt]
        value = np.array(n.attrs.get("value", 0.0), dtype=x.dtype)
        pattern = np.frombuffer(np.resize(value.reshape(1), 4 // es).tobytes(), "<u4")[0]
        whole = out.nbytes // 4 * 4
        if whole:
            self.em.cmd(Opcode.FILL, {"dst": self.ref(out), "size": whole,
                                      "pattern": int(pattern)}, name=f"{n.name}: pad value")
        if whole != out.nbytes:   # an odd number of 2-byte elements: the last one
            self.em.cmd(Opcode.DMA_D2D, {"src": self.const_ref(value.reshape(1)),
                                         "dst": self.ref(out).at(whole), "size": es},
                        name=f"{n.name}: pad value (last)")
        p = n.attrs["pads"]
        r = len(x.shape)
        ost = contiguous_strides(out.shape)
        off = sum(p[i] * ost[i] for i in range(r))
        self.copy(dt, self.ref(x), self.ref(out).at(off * es), x.shape,
                  contiguous_strides(x.shape), ost, f"{n.name}: pad interior")

    def _expand(self, n: Node) -> None:
        x = n.inputs[0]
        assert x is not None
        self.broadcast_into(x, n.outputs[0].shape, self.ref(n.outputs[0]),
                            f"{n.name}: expand")

    # rows x cols ops (softmax, layernorm, reduce) over trailing axes
    def _rows_cols_op(self, n: Node, x: Value, axis: int, emit: Callable[[Ref, Ref, int, int,
                                                                        int], None],
                      out_per_row: int) -> None:
        """Run `emit(src, dst, row0, rows, cols)` tiles over a [rows, cols] view of x
        whose cols are the dims from `axis` on (x is moved there by a COPY if needed)."""
        rows = math.prod(x.shape[:axis])
        cols = math.prod(x.shape[axis:])
        es = isa.DTYPE_SIZE[isa_dtype(x)]
        per_row = (cols + out_per_row) * es
        tile = max(1, self.target.scratchpad_size // max(per_row, 1))
        src, dst = self.ref(x), self.ref(n.outputs[0])
        for r0 in range(0, rows, tile):
            r = min(tile, rows - r0)
            emit(src.at(r0 * cols * es), dst.at(r0 * out_per_row * es), r0, r, cols)

    def _softmax(self, n: Node) -> None:
        x = n.inputs[0]
        assert x is not None
        ax = n.attrs["axis"] % len(x.shape)
        dt = isa_dtype(x)
        if ax != len(x.shape) - 1:
            raise LoweringError(f"node {n.name}: softmax over axis {ax} (not the last) was "
                                f"not canonicalized")
        cols_all = x.shape[-1]
        self._rows_cols_op(n, x, ax, lambda s, d, r0, r, c: self.em.cmd(
            Opcode.SOFTMAX, {"dtype": dt, "rows": r, "cols": c, "x": s, "y": d},
            name=f"{n.name}: softmax rows [{r0}, {r0 + r})"), cols_all)

    def _layernorm(self, n: Node) -> None:
        x, scale, bias = (n.inputs + [None, None])[:3]
        assert x is not None
        ax = n.attrs["axis"] % len(x.shape)
        dt = isa_dtype(x)
        cols = math.prod(x.shape[ax:])
        norm = x.shape[ax:]

        def param(v: Value | None, fill: float, what: str, slot: int) -> Ref:
            if v is None:
                return self.const_ref(np.full(cols, fill, dtype=x.dtype))
            if v.const is not None:
                return self.const_ref(np.broadcast_to(v.const, norm).reshape(cols)
                                      .astype(x.dtype))
            if v.size == cols:
                return self.ref(v)
            tmp = self.plan.temps[id(n)].at(slot * _align(cols * 4))
            self.broadcast_into(v, norm, tmp, f"{n.name}: broadcast {what}")
            return tmp

        g = param(scale, 1.0, "scale", 0)
        b = param(bias, 0.0, "bias", 1)
        eps = float(n.attrs["epsilon"])
        self._rows_cols_op(n, x, ax, lambda s, d, r0, r, c: self.em.cmd(
            Opcode.LAYERNORM, {"dtype": dt, "rows": r, "cols": c, "epsilon": eps, "x": s,
                               "gamma": g, "beta": b, "y": d},
            name=f"{n.name}: layernorm rows [{r0}, {r0 + r})"), cols)

    def _reduce(self, n: Node) -> None:
        x = n.inputs[0]
        assert x is not None
        from ._ops import reduce_axes
        axes = reduce_axes(n, len(x.shape))
        rank = len(x.shape)
        if axes != tuple(range(rank - len(axes), rank)):
            raise LoweringError(f"node {n.name}: reduce over axes {axes} (not trailing) was "
                                f"not canonicalized")
        op = {"sum": isa.ReduceOp.SUM, "max": isa.ReduceOp.MAX,
              "mean": isa.ReduceOp.MEAN, "min": isa.ReduceOp.MIN}[n.attrs["reduce_op"]]
        dt = isa_dtype(x)
        self._rows_cols_op(n, x, rank - len(axes), lambda s, d, r0, r, c: self.em.cmd(
            Opcode.REDUCE, {"op": op, "dtype": dt, "rows": r, "cols": c, "x": s, "y": d},
            name=f"{n.name}: reduce {op.name.lower()} rows [{r0}, {r0 + r})"), 1)

    def _quant(self, n: Node, opcode: Opcode) -> None:
        x, y = n.inputs[0], n.outputs[0]
        assert x is not None
        fdt, idt = (isa_dtype(x), isa_dtype(y)) if opcode == Opcode.QUANTIZE else \
            (isa_dtype(y), isa_dtype(x))
        fes, ies = isa.DTYPE_SIZE[fdt], isa.DTYPE_SIZE[idt]
        xes, yes = (fes, ies) if opcode == Opcode.QUANTIZE else (ies, fes)
        chunk = max(1, self.target.scratchpad_size // (fes + ies))
        for lo in range(0, x.size, chunk):
            c = min(chunk, x.size - lo)
            self.em.cmd(opcode, {"dtype": fdt, "int_dtype": idt,
                                 "scale": n.attrs["scale"], "zero_point": n.attrs["zero_point"],
                                 "count": c, "x": self.ref(x).at(lo * xes),
                                 "y": self.ref(y).at(lo * yes)},
                        name=f"{n.name}: {opcode.name.lower()} [{lo}, {lo + c})")

    def _quantize(self, n: Node) -> None:
        self._quant(n, Opcode.QUANTIZE)

    def _dequantize(self, n: Node) -> None:
        self._quant(n, Opcode.DEQUANTIZE)

    def _quantize_dynamic(self, n: Node) -> None:
        """One QUANTIZE_DYNAMIC over the whole tensor (its range is the tensor's: the
        device tiles it within its work memory, the scratchpad does not split it)."""
        x, y, qp = n.inputs[0], n.outputs[0], n.outputs[1]
        assert x is not None
        self.em.cmd(Opcode.QUANTIZE_DYNAMIC, {"dtype": isa_dtype(x), "int_dtype": DType.I8,
                                              "count": x.size, "x": self.ref(x),
                                              "y": self.ref(y), "qparams": self.ref(qp)},
                    name=f"{n.name}: quantize_dynamic [0, {x.size})")

    def _dequantize_dynamic(self, n: Node) -> None:
        """DEQUANTIZE_DYNAMIC over [outer, channels, inner] in pieces that fit the
        scratchpad: whole outer rows, else channel blocks of one (their vectors offset),
        else pieces of one channel's elements."""
        acc, qp, ws, wsum = n.inputs[0], n.inputs[1], n.inputs[2], n.inputs[3]
        bias = n.inputs[4] if len(n.inputs) > 4 else None
        assert acc is not None and qp is not None and ws is not None and wsum is not None
        y = n.outputs[0]
        dt = isa_dtype(y)
        oes = isa.DTYPE_SIZE[dt]
        ch = acc.shape[1]
        inner = math.prod(acc.shape[2:])
        outer = acc.shape[0]
        per = 4 + oes
        sp = self.target.scratchpad_size
        act = _ACT[n.attrs.get("activation")]
        flags = isa.DQD_BIAS if bias is not None else 0

        def emit(o0: int, no: int, c0: int, nc: int, i0: int, ni: int) -> None:
            first = (o0 * ch + c0) * inner + i0
            f: dict[str, Any] = {
                "dtype": dt, "activation": act, "channels": nc, "inner": ni,
                "count": no * nc * ni, "x": self.ref(acc).at(first * 4),
                "y": self.ref(y).at(first * oes), "qparams": self.ref(qp),
                "wscale": self.ref(ws).at(c0 * 4), "wsum": self.ref(wsum).at(c0 * 4)}
            if bias is not None:
                f["bias"] = self.ref(bias).at(c0 * 4)
            self.em.cmd(Opcode.DEQUANTIZE_DYNAMIC, f, flags=flags,
                        name=f"{n.name}: dequantize_dynamic rows [{o0}, {o0 + no}) "
                             f"channels [{c0}, {c0 + nc}) elements [{i0}, {i0 + ni})")

        rows = sp // max(1, ch * inner * per)
        if rows:
            for o0 in range(0, outer, rows):
                emit(o0, min(rows, outer - o0), 0, ch, 0, inner)
            return
        cb = sp // (inner * per)
        for o0 in range(outer):
            if cb:
                for c0 in range(0, ch, cb):
                    emit(o0, 1, c0, min(cb, ch - c0), 0, inner)
                continue
            ib = max(1, sp // per)
            for c0 in range(ch):
                for i0 in range(0, inner, ib):
                    emit(o0, 1, c0, 1, i0, min(ib, inner - i0))

    def _batchnorm(self, n: Node) -> None:
        raise LoweringError(f"node {n.name}: batchnorm was not decomposed")

    # gemm ---------------------------------------------------------------------------------

    def _gemm(self, n: Node) -> None:
        a, b = n.inputs[0], n.inputs[1]
        bias = n.inputs[2] if len(n.inputs) > 2 else None
        assert a is not None and b is not None
        out = n.outputs[0]
        m, nn = out.shape
        k = a.shape[0] if n.attrs.get("trans_a") else a.shape[1]
        alpha, beta = n.attrs.get("alpha", 1.0), n.attrs.get("beta", 1.0)
        act = _ACT[n.attrs.get("activation")]
        dt = isa_dtype(a)
        oes = isa.DTYPE_SIZE[isa_dtype(out)]
        bias_ref: Ref | None = None
        gemm_beta = 0.0
        if bias is not None:
            bs = (1,) * (2 - len(bias.shape)) + bias.shape
            if bs == (1, nn) and (beta == 1.0 or bias.is_const):
                bias_ref = self.ref(bias) if beta == 1.0 else self.const_ref(
                    (bias.const.reshape(nn) * np.float32(beta)).astype(bias.dtype))  # type: ignore[union-attr]
            else:
                # C := broadcast(bias) first, then accumulate with beta.
                self.broadcast_into(bias, (m, nn), self.ref(out), f"{n.name}: bias into C")
                gemm_beta = beta
        if dt == DType.I8 and alpha != 1.0:
            raise LoweringError(f"node {n.name}: int8 gemm with alpha {alpha}")
        self.gemm_tiles(n.name, dt, m, nn, k, self.ref(a), self.ref(b), self.ref(out),
                        bias_ref, alpha, gemm_beta, bool(n.attrs.get("trans_a")),
                        bool(n.attrs.get("trans_b")), act, oes, self.plan.temps.get(id(n)))

    def gemm_tiles(self, name: str, dt: DType, m: int, n: int, k: int, a: Ref, b: Ref, c: Ref,
                   bias: Ref | None, alpha: float, beta: float, trans_a: bool, trans_b: bool,
                   act: int, oes: int, tmp: Ref | None) -> None:
        """GEMM tiled so that one tile's A, B, C (and bias) fit the scratchpad: over
        rows of C, then, if B alone is too big, over column blocks of C (B and C
        blocks moved through the node's temporary with strided COPYs)."""
        es = isa.DTYPE_SIZE[dt]
        flags = (isa.GEMM_TRANS_A if trans_a else 0) | (isa.GEMM_TRANS_B if trans_b else 0)
        odt = DType.I32 if dt == DType.I8 else dt
        mt, nt = gemm_tile_sizes(m, n, k, es, oes, bias is not None,
                                 self.target.scratchpad_size)
        if (mt < m and trans_a) or (nt < n and tmp is None):
            if tmp is None:
                raise LoweringError(f"{name}: tiling needs a temporary")
        a_src = a
        if mt < m and trans_a:
            # op(A) rows are columns of the stored A: transpose it once into the temp.
            assert tmp is not None
            self.copy(dt, a, tmp, (m, k), (1, m), (k, 1), f"{name}: transpose A for tiling")
            a_src, trans_a = tmp, False
            flags &= ~isa.GEMM_TRANS_A
            tmp = tmp.at(_align(m * k * es))
        for j0 in range(0, n, nt):
            jn = min(nt, n - j0)
            if jn == n:
                b_blk = b
            elif trans_b:
                b_blk = b.at(j0 * k * es)          # rows j0.. of the stored n x k B
            else:
                assert tmp is not None
                b_blk = tmp
                self.copy(dt, b.at(j0 * es), b_blk, (k, jn), (n, 1), (jn, 1), f"{name}: B columns "
                          f"[{j0}, {j0 + jn})")
            # the C block after the B block (none when B's rows are read in place)
            c_tmp = None if jn == n else tmp.at(  # type: ignore[union-attr]
                0 if trans_b else _align(k * nt * es))
            for i0 in range(0, m, mt):
                im = min(mt, m - i0)
                a_blk = a_src if trans_a else a_src.at(i0 * k * es)
                if c_tmp is None:
                    c_blk = c.at(i0 * n * oes)
                else:
                    c_blk = c_tmp
                    if beta != 0.0:
                        self.copy(odt, c.at((i0 * n + j0) * oes), c_blk, (im, jn), (n, 1),
                                  (jn, 1), f"{name}: C block in")
                f: dict[str, Any] = {"dtype": dt, "activation": act, "m": im, "n": jn, "k": k,
                                     "a": a_blk, "b": b_blk, "c": c_blk, "alpha": alpha,
                                     "beta": beta}
                fl = flags
                if bias is not None:
                    f["bias"] = bias.at(j0 * oes)
                    fl |= isa.GEMM_BIAS
                self.em.cmd(Opcode.GEMM, f, flags=fl,
                            name=f"{name}: gemm rows [{i0}, {i0 + im}) cols [{j0}, {j0 + jn})")
                if c_tmp is not None:
                    self.copy(odt, c_blk, c.at((i0 * n + j0) * oes), (im, jn), (jn, 1), (n, 1),
                              f"{name}: C block out")

    def _matmul(self, n: Node) -> None:
        a, b = n.inputs[0], n.inputs[1]
        assert a is not None and b is not None
        out = n.outputs[0]
        dt = isa_dtype(a)
        es = isa.DTYPE_SIZE[dt]
        oes = isa.DTYPE_SIZE[isa_dtype(out)]
        ash = a.shape if len(a.shape) > 1 else (1,) + a.shape
        bsh = b.shape if len(b.shape) > 1 else b.shape + (1,)
        m, k = ash[-2:]
        nn = bsh[-1]
        batch = out.shape[:len(out.shape) - (len(a.shape) > 1) - (len(b.shape) > 1)]
        if not batch:
            self.gemm_tiles(n.name, dt, m, nn, k, self.ref(a), self.ref(b), self.ref(out),
                            None, 1.0, 0.0, False, False, 0, oes, self.plan.temps.get(id(n)))
            return
        ab = (1,) * (len(batch) - len(ash[:-2])) + ash[:-2]
        bb = (1,) * (len(batch) - len(bsh[:-2])) + bsh[:-2]
        if all(d == 1 for d in bb):
            # B shared by every batch: one GEMM with the batch folded into M.
            if ab == batch:
                self.gemm_tiles(n.name, dt, math.prod(batch) * m, nn, k, self.ref(a),
                                self.ref(b), self.ref(out), None, 1.0, 0.0, False, False, 0,
                                oes, self.plan.temps.get(id(n)))
                return
        ast, bst = contiguous_strides(ab), contiguous_strides(bb)
        for idx in np.ndindex(*batch):
            ai = sum((i if d > 1 else 0) * s for i, d, s in zip(idx, ab, ast))
            bi = sum((i if d > 1 else 0) * s for i, d, s in zip(idx, bb, bst))
            oi = int(np.ravel_multi_index(idx, batch))
            self.gemm_tiles(f"{n.name}[{','.join(map(str, idx))}]", dt, m, nn, k,
                            self.ref(a).at(ai * m * k * es), self.ref(b).at(bi * k * nn * es),
                            self.ref(out).at(oi * m * nn * oes), None, 1.0, 0.0, False, False,
                            0, oes, self.plan.temps.get(id(n)))

    def _bmm(self, n: Node) -> None:
        """GEMM_BATCHED over operand views: the batch dims merged where every operand's
        strides allow (the innermost run is one command, up to 65535 batches; outer
        ones loop), each batch tiled to the scratchpad in row and column blocks that
        are read and written in place through the leading dimensions."""
        a, b = n.inputs[0], n.inputs[1]
        assert a is not None and b is not None
        out = n.outputs[0]
        (sa, sta), (sb, stb) = n.attrs["a_view"], n.attrs["b_view"]
        dt = isa_dtype(a)
        es, oes = isa.DTYPE_SIZE[dt], isa.DTYPE_SIZE[isa_dtype(out)]
        batch, (m, nn), k = out.shape[:-2], out.shape[-2:], sa[-1]

        def batch_strides(shape: tuple[int, ...], st: tuple[int, ...]) -> tuple[int, ...]:
            pad = len(batch) - (len(shape) - 2)
            return (0,) * pad + tuple(0 if d == 1 else s for d, s in
                                      zip(shape[:-2], st[:-2]))

        # stored matrices: A (m x k, or k x m with TRANS_A), B (k x n, or n x k)
        ta = not (k == 1 or sta[-1] == 1)
        lda = (sta[-1] if k > 1 else m) if ta else (sta[-2] if m > 1 else k)
        tb = not (nn == 1 or stb[-1] == 1)
        ldb = (stb[-1] if nn > 1 else k) if tb else (stb[-2] if k > 1 else nn)
        shp, (bsa, bsb, bsc) = _merge_dims(batch or (1,), batch_strides(sa, sta),
                                           batch_strides(sb, stb),
                                           contiguous_strides(batch or (1,)))
        mt, nt = gemm_tile_sizes(m, nn, k, es, oes, False, self.target.scratchpad_size)
        flags = (isa.GEMM_TRANS_A if ta else 0) | (isa.GEMM_TRANS_B if tb else 0)
        alpha = n.attrs.get("alpha", 1.0)
        inner, outer = shp[-1], shp[:-1]
        for idx in np.ndindex(*outer):
            oa = sum(i * s for i, s in zip(idx, bsa))
            ob = sum(i * s for i, s in zip(idx, bsb))
            oc = sum(i * s for i, s in zip(idx, bsc))
            for b0 in range(0, inner, isa.GEMM_BATCHED_MAX_BATCH):
                bn = min(isa.GEMM_BATCHED_MAX_BATCH, inner - b0)
                for j0 in range(0, nn, nt):
                    for i0 in range(0, m, mt):
                        ea = oa + b0 * bsa[-1] + i0 * (1 if ta else lda)
                        eb = ob + b0 * bsb[-1] + j0 * (ldb if tb else 1)
                        ec = (oc + b0 * bsc[-1]) * m * nn + i0 * nn + j0
                        self.em.cmd(Opcode.GEMM_BATCHED, {
                            "dtype": dt, "batch": bn, "m": min(mt, m - i0),
                            "n": min(nt, nn - j0), "k": k, "a": self.ref(a).at(ea * es),
                            "b": self.ref(b).at(eb * es), "c": self.ref(out).at(ec * oes),
                            "lda": lda, "ldb": ldb, "ldc": nn, "stride_a": bsa[-1],
                            "stride_b": bsb[-1], "stride_c": bsc[-1] * m * nn,
                            "alpha": alpha, "beta": 0.0}, flags=flags,
                            name=f"{n.name}: gemm_batched {bn}x rows [{i0}, "
                                 f"{min(m, i0 + mt)}) cols [{j0}, {min(nn, j0 + nt)})")

    # conv2d -------------------------------------------------------------------------------

    def _conv2d(self, n: Node) -> None:
        x, w = n.inputs[0], n.inputs[1]
        bias = n.inputs[2] if len(n.inputs) > 2 else None
        assert x is not None and w is not None
        y = n.outputs[0]
        at = n.attrs
        N, C, H, W = x.shape
        K, cg, R, S = w.shape
        groups = at["groups"]
        dt = isa_dtype(x)
        es = isa.DTYPE_SIZE[dt]
        pt, pl, pb, pr = at["padding"]
        dh, dw = at["dilation"]
        if dt == DType.I8:
            self._conv2d_int8(n)
            return
        src = self.ref(x)
        # The ISA needs padding below the dilated kernel extent: pad explicitly otherwise.
        if max(pt, pb) >= dh * (R - 1) + 1 or max(pl, pr) >= dw * (S - 1) + 1:
            tmp = self.plan.temps[id(n)]
            Hp, Wp = H + pt + pb, W + pl + pr
            self.em.cmd(Opcode.FILL, {"dst": tmp, "size": _align(N * C * Hp * Wp * es, 4)},
                        name=f"{n.name}: zero padded input")
            self.copy(dt, src, tmp.at((pt * Wp + pl) * es), (N, C, H, W),
                      contiguous_strides((N, C, H, W)), (C * Hp * Wp, Hp * Wp, Wp, 1),
                      f"{n.name}: pad input")
            src, H, W, (pt, pl, pb, pr) = tmp, Hp, Wp, (0, 0, 0, 0)
        oh, ow = y.shape[2:]
        per_image = (C * H * W + K * oh * ow) * es
        wbytes = w.nbytes
        flags = isa.CONV_BIAS if bias is not None else 0
        imgs = max(1, (self.target.scratchpad_size - wbytes) // max(per_image, 1))
        for n0 in range(0, N, imgs):
            nb = min(imgs, N - n0)
            f: dict[str, Any] = {
                "dtype": dt, "activation": _ACT[at.get("activation")], "groups": groups,
                "n": nb, "c": C, "h": H, "w": W, "k": K, "r": R, "s": S,
                "stride_h": at["stride"][0], "stride_w": at["stride"][1],
                "dilation_h": dh, "dilation_w": dw, "pad_top": pt, "pad_left": pl,
                "pad_bottom": pb, "pad_right": pr,
                "x": src.at(n0 * C * H * W * es), "weight": self.ref(w),
                "y": self.ref(y).at(n0 * K * oh * ow * es)}
            if bias is not None:
                f["bias"] = self.ref(bias)
            self.em.cmd(Opcode.CONV2D, f, flags=flags,
                        name=f"{n.name}: conv2d images [{n0}, {n0 + nb})")


    def _conv2d_int8(self, n: Node) -> None:
        """int8 conv2d (CONV2D computes floats only): im2col by strided COPY into the
        temp, then int8 GEMMs  y (K x P) = W (K x C*R*S) @ cols + bias  (+ relu), int32
        bias broadcast into the output first (beta = 1). When one image's columns do not
        fit the scratchpad, the output pixels go in blocks (whole output rows, or pieces
        of one row) whose columns and int32 result live in the temp, each block's result
        copied into y by a strided COPY: no GEMM then needs column tiling."""
        x, w = n.inputs[0], n.inputs[1]
        bias = n.inputs[2] if len(n.inputs) > 2 else None
        assert x is not None and w is not None
        y = n.outputs[0]
        at = n.attrs
        if at["groups"] != 1:
            raise LoweringError(f"node {n.name}: int8 conv2d with groups > 1")
        N, C, H, W = x.shape
        K, _, R, S = w.shape
        OH, OW = y.shape[2:]
        P = OH * OW
        pt, pl, pb, pr = at["padding"]
        sh, sw = at["stride"]
        dh, dw = at["dilation"]
        tmp = self.plan.temps[id(n)]
        lay = _conv_int8_layout(n, self.target)
        src, Hp, Wp = self.ref(x), H, W
        if lay.pad_bytes:
            Hp, Wp = H + pt + pb, W + pl + pr
            zp = at.get("pad_value", 0)   # the input's zero point: a real 0
            self.em.cmd(Opcode.FILL, {"dst": tmp, "size": _align(N * C * Hp * Wp, 4),
                                      "pattern": (zp & 0xFF) * 0x01010101},
                        name=f"{n.name}: {'zero ' if not zp else ''}padded input"
                             + (f" (fill {zp})" if zp else ""))
            self.copy(DType.I8, src, tmp.at(pt * Wp + pl), (N, C, H, W),
                      contiguous_strides((N, C, H, W)), (C * Hp * Wp, Hp * Wp, Wp, 1),
                      f"{n.name}: pad input")
            src = tmp
        cols = tmp.at(lay.pad_bytes)
        act = _ACT[at.get("activation")]
        red = C * R * S
        for i in range(N):
            img = src.at(i * C * Hp * Wp)
            yi = self.ref(y).at(i * K * P * 4)
            for r0, c0, nr, nc in lay.blocks:
                nb = nr * nc
                whole = nb == P
                self.copy(DType.I8, img.at(r0 * sh * Wp + c0 * sw), cols, (C, R, S, nr, nc),
                          (Hp * Wp, dh * Wp, dw, sh * Wp, sw),
                          contiguous_strides((C, R, S, nr, nc)),
                          f"{n.name}: im2col image {i}" + ("" if whole else
                                                           f" rows {r0}+{nr} cols {c0}+{nc}"))
                out = yi if whole else cols.at(lay.cols_bytes)
                beta = 0.0
                if bias is not None:
                    self.copy(DType.I32, self.ref(bias), out, (K, nb), (1, 0), (nb, 1),
                              f"{n.name}: bias into y image {i}")
                    beta = 1.0
                self.gemm_tiles(f"{n.name}[{i}]" if whole else f"{n.name}[{i}] r{r0}c{c0}",
                                DType.I8, K, nb, red, self.ref(w), cols, out, None, 1.0, beta,
                                False, False, act, 4, None)
                if not whole:
                    self.copy(DType.I32, out, yi.at((r0 * OW + c0) * 4), (K, nr, nc),
                              (nb, nc, 1), (P, OW, 1), f"{n.name}: block into y image {i}")


def gemm_tile_sizes(m: int, n: int, k: int, es: int, oes: int, bias: bool,
                    scratchpad: int) -> tuple[int, int]:
    """(rows, columns) of C per GEMM tile: columns halved until one row of A with the
    block of B (and C, bias) fits the scratchpad, then rows halved."""
    def fits(mt: int, nt: int) -> bool:
        return (mt * k + k * nt) * es + (mt * nt + (nt if bias else 0)) * oes <= scratchpad

    nt = n
    while nt > 1 and not fits(1, nt):
        nt = (nt + 1) // 2
    mt = m
    while mt > 1 and not fits(mt, nt):
        mt = (mt + 1) // 2
    return mt, nt


def gemm_temp_bytes(m: int, n: int, k: int, es: int, oes: int, trans_a: bool,
                    trans_b: bool, scratchpad: int) -> int:
    """The workspace gemm_tiles needs for one GEMM (either bias case): A transposed
    once when its rows are tiled, a block of B's columns (not with TRANS_B: B's rows
    are read in place) and a block of C when the columns are tiled."""
    need = 0
    for bias in (False, True):
        mt, nt = gemm_tile_sizes(m, n, k, es, oes, bias, scratchpad)
        t = _align(m * k * es) if mt < m and trans_a else 0
        if nt < n:
            t += (0 if trans_b else _align(k * nt * es)) + _align(mt * nt * oes)
        need = max(need, t)
    return need


@dataclass(frozen=True)
class _ConvInt8Layout:
    """An int8 conv2d's temp: [padded input][im2col block][int32 result block], and the
    output-pixel blocks (first row, first column, rows, columns) it goes through."""

    pad_bytes: int
    cols_bytes: int
    out_bytes: int
    blocks: tuple[tuple[int, int, int, int], ...]

    @property
    def total(self) -> int:
        return self.pad_bytes + self.cols_bytes + self.out_bytes


def _conv_int8_layout(n: Node, target: Target) -> _ConvInt8Layout:
    """Pixel blocks such that a block's GEMM (one row of W, the block's columns, one
    row of int32 results) fits the scratchpad; the whole image when it fits."""
    x, w, y = n.inputs[0], n.inputs[1], n.outputs[0]
    assert x is not None and w is not None
    N, C, H, W = x.shape
    K, _, R, S = w.shape
    OH, OW = y.shape[2:]
    pt, pl, pb, pr = n.attrs["padding"]
    padded = 0 if not any(n.attrs["padding"]) else N * C * (H + pt + pb) * (W + pl + pr)
    pad_bytes = _align(padded + 4) if padded else 0
    red = C * R * S
    sp = target.scratchpad_size
    per = max(1, (sp - red) // (red + 4))   # pixels whose B columns + C row fit with a row of A
    if per >= OH * OW:
        return _ConvInt8Layout(pad_bytes, _align(red * OH * OW), 0, ((0, 0, OH, OW),))
    blocks: list[tuple[int, int, int, int]] = []
    if per >= OW:
        rows = per // OW
        blocks = [(r0, 0, min(rows, OH - r0), OW) for r0 in range(0, OH, rows)]
        nb = rows * OW
    else:
        blocks = [(r0, c0, 1, min(per, OW - c0)) for r0 in range(OH)
                  for c0 in range(0, OW, per)]
        nb = per
    return _ConvInt8Layout(pad_bytes, _align(red * nb), _align(K * nb * 4), tuple(blocks))


def _suffix_broadcast(b: tuple[int, ...], out: tuple[int, ...]) -> bool:
    bs = (1,) * (len(out) - len(b)) + b
    k = next((i for i, d in enumerate(bs) if d != 1), len(bs))
    return bs[k:] == out[k:]


def temp_bytes(n: Node, target: Target) -> int:  # noqa: C901
    """Workspace a node needs beyond its operands while it runs (lowering temps)."""
    out = n.outputs[0]
    if n.op in ("add", "sub", "mul", "div", "max", "min", "pow"):
        a, b = n.inputs[0], n.inputs[1]
        assert a is not None and b is not None
        if a.shape != out.shape and b.shape == out.shape and n.op in ("add", "mul", "max",
                                                                       "min"):
            a, b = b, a
        need = 0 if a.shape == out.shape else _align(out.nbytes)
        if b.shape != out.shape and not _suffix_broadcast(b.shape, out.shape):
            need += _align(out.nbytes)
        return need
    if n.op in ("compare", "select"):
        need = 0
        for i, v in enumerate(n.inputs):
            if v is None or v.shape == out.shape:
                continue
            if n.op == "compare" and i == 1 and _suffix_broadcast(v.shape, out.shape):
                continue
            need += _align(out.size * np.dtype(v.dtype).itemsize)
        return need
    if n.op == "layernorm":
        x = n.inputs[0]
        assert x is not None
        cols = math.prod(x.shape[n.attrs["axis"] % len(x.shape):])
        return 2 * _align(cols * 4)
    if n.op in ("gemm", "matmul"):
        a, b = n.inputs[0], n.inputs[1]
        assert a is not None and b is not None
        es = np.dtype(a.dtype).itemsize
        oes = np.dtype(out.dtype).itemsize
        ta, tb = bool(n.attrs.get("trans_a")), bool(n.attrs.get("trans_b"))
        m = a.shape[-1] if ta else a.shape[-2] if len(a.shape) > 1 else 1
        nn = b.shape[0] if tb else b.shape[-1] if len(b.shape) > 1 else 1
        k = a.shape[0] if ta else a.shape[-1]
        sp = target.scratchpad_size
        need = gemm_temp_bytes(m, nn, k, es, oes, ta, tb, sp)
        if n.op == "matmul":   # batches folded into M when B is shared
            batch = math.prod(out.shape[:-2]) if len(out.shape) > 2 else 1
            need = max(need, gemm_temp_bytes(batch * m, nn, k, es, oes, ta, tb, sp))
        return need
    if n.op == "conv2d" and n.inputs[0] is not None and n.inputs[0].dtype == "int8":
        return _conv_int8_layout(n, target).total
    if n.op == "conv2d":
        x, w = n.inputs[0], n.inputs[1]
        assert x is not None and w is not None
        N, C, H, W = x.shape
        R, S = w.shape[2:]
        pt, pl, pb, pr = n.attrs["padding"]
        dh, dw = n.attrs["dilation"]
        if max(pt, pb) < dh * (R - 1) + 1 and max(pl, pr) < dw * (S - 1) + 1:
            return 0
        es = np.dtype(x.dtype).itemsize
        return _align(N * C * (H + pt + pb) * (W + pl + pr) * es + 4)
    return 0


def transpose_tiled_weights(g: Graph, target: Target) -> int:
    """A constant B whose columns a GEMM must tile is stored transposed (TRANS_B): each
    column block is then rows read in place from .va1.const, never copied into the
    workspace (a 128 MiB weight took another 128 MiB of workspace)."""
    changed = 0
    for n in g.nodes:
        if n.op != "gemm" or n.attrs.get("trans_b"):
            continue
        a, b = n.inputs[0], n.inputs[1]
        if a is None or b is None or b.const is None:
            continue
        out = n.outputs[0]
        m, nn = out.shape
        k = b.shape[0]
        es, oes = np.dtype(a.dtype).itemsize, np.dtype(out.dtype).itemsize
        if any(gemm_tile_sizes(m, nn, k, es, oes, bias, target.scratchpad_size)[1] < nn
               for bias in (False, True)):
            n.inputs[1] = g.constant(np.ascontiguousarray(b.const.T), name=f"{b.name}_t")
            n.attrs["trans_b"] = True
            changed += 1
    return changed


def lower(g: Graph, target: Target, arg_symbols: dict[int, str]) -> Lowered:
    """Plan memory and emit the commands of `g` (already canonicalized)."""
    transpose_tiled_weights(g, target)
    plan = plan_memory(g, arg_symbols, lambda n: temp_bytes(n, target))
    em = Emitter()
    lw = Lowerer(g, target, plan, em)
    for node in g.nodes:
        lw.lower(node)
    if em.labels and em.labels[-1][0] == em.builder.size:
        em.labels.pop()
    for src, dst in plan.copies_out:
        em.label(f"copy_out.{dst.name}")
        em.cmd(Opcode.DMA_D2D, {"src": src, "dst": Ref(arg_symbols[id(dst)]),
                                "size": dst.nbytes}, name=f"copy to output {dst.name}")
    # constants made during lowering go after the planned ones
    const = bytearray(plan.const)
    base = _align(len(const))
    const += b"\0" * (base - len(const))
    constants = list(plan.constants)
    for i, arr in enumerate(lw.extra_consts):
        off = _align(len(const))
        const += b"\0" * (off - len(const)) + arr.tobytes()
        constants.append((f"const.lowering{i}", off, arr.nbytes))
    relocs = [F.Relocation(r.offset, r.type, F.CONST, r.addend + base) if r.symbol == "@extra"
              else r for r in em.relocs]
    return Lowered(em.builder.bytes(), relocs, em.labels, bytes(const), constants,
                   max(plan.workspace_size, 0),
                   {rec.offset: rec.name for rec in em.builder.commands})
