"""Optional int8 post-training quantization (PTQ) from calibration data.

Every gemm / conv2d with constant f32 weights becomes
    quantize(x, sx) -> int8 gemm/conv (int32 accumulate, int32 bias, relu kept)
    -> dequantize(., sx * max(sw)) [-> mul by sw / max(sw) per output channel]
with symmetric scales: sx per tensor, from the largest |x| the calibration feeds produce
at that operand; sw per output channel, from that channel's weights (BatchNorm folding
leaves channels of very different ranges: one scale for all cost real CNNs their
accuracy). Other ops stay f32.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import numpy as np

from ._ir import Graph, GraphError, Node
from ._passes import _run, reference_run

_QMAX = 127.0


def _scale(maxabs: float) -> float:
    return float(maxabs) / _QMAX if maxabs > 0 else 1.0


def quantize_int8(g: Graph, calibration: Sequence[Mapping[str, Any]]) -> int:
    """Rewrite `g` in place; returns how many gemm/conv2d nodes were quantized."""
    if not calibration:
        raise GraphError("int8 quantization needs at least one calibration feed")
    targets = [n for n in g.nodes if n.op in ("gemm", "conv2d")
               and n.inputs[0] is not None and n.inputs[0].dtype == "float32"
               and n.inputs[1] is not None and n.inputs[1].is_const
               and (len(n.inputs) < 3 or n.inputs[2] is None or n.inputs[2].is_const)
               and n.attrs.get("activation") in (None, "relu")
               and not (n.op == "gemm" and n.attrs.get("trans_a"))
               and not (n.op == "conv2d" and n.attrs.get("groups", 1) != 1)]
    maxabs: dict[int, float] = {}
    for feeds in calibration:
        env = _run(g, feeds)
        for n in targets:
            x = n.inputs[0]
            assert x is not None
            a = x.const if x.const is not None else env[id(x)]
            maxabs[id(n)] = max(maxabs.get(id(n), 0.0), float(np.max(np.abs(a))))
    count = 0
    new_nodes: list[Node] = []
    for n in g.nodes:
        if n not in targets:
            new_nodes.append(n)
            continue
        x, w = n.inputs[0], n.inputs[1]
        assert x is not None and w is not None and w.const is not None
        bias = n.inputs[2] if len(n.inputs) > 2 else None
        sx = _scale(maxabs[id(n)])
        wf = w.const.astype(np.float64)
        if n.op == "gemm":
            wf = wf * n.attrs.get("alpha", 1.0)
        # per output channel: conv weights' rows (K, C, R, S); gemm B's columns (or
        # rows when transposed)
        if n.op == "conv2d":
            peak = np.max(np.abs(wf).reshape(wf.shape[0], -1), axis=1)
            wshape: tuple[int, ...] = (-1, 1, 1, 1)
        elif n.attrs.get("trans_b"):
            peak, wshape = np.max(np.abs(wf), axis=1), (-1, 1)
        else:
            peak, wshape = np.max(np.abs(wf), axis=0), (1, -1)
        sw = np.array([_scale(float(p)) for p in peak])
        wq = np.clip(np.rint(wf / sw.reshape(wshape)), -127, 127).astype(np.int8)
        xq = Node("quantize", [x], [], {"scale": sx, "zero_point": 0}, g.unique(f"{n.name}_q"))
        from ._ir import Value
        xq.outputs = [Value(g.unique(f"{n.name}_xq"), x.shape, "int8", producer=xq)]
        new_nodes.append(xq)
        n.inputs[0] = xq.outputs[0]
        n.inputs[1] = g.constant(wq, name=f"{w.name}_q")
        if bias is not None:
            bf = np.broadcast_to(bias.const, bias.shape).astype(np.float64)  # type: ignore[arg-type]
            if n.op == "gemm":
                bf = bf * n.attrs.get("beta", 1.0)
            n.inputs[2] = g.constant(np.rint(bf / (sx * sw)).astype(np.int32),
                                     name=f"{bias.name}_q")
        if n.op == "gemm":
            n.attrs["alpha"], n.attrs["beta"] = 1.0, 1.0
        y = n.outputs[0]
        yq = Value(g.unique(f"{y.name}_i32"), y.shape, "int32", producer=n)
        n.outputs = [yq]
        new_nodes.append(n)
        top = float(np.max(sw))
        per_channel = not np.all(sw == top)
        yd = Value(g.unique(f"{y.name}_dq"), y.shape, "float32") if per_channel else y
        dq = Node("dequantize", [yq], [yd], {"scale": sx * top, "zero_point": 0},
                  g.unique(f"{n.name}_dq"))
        yd.producer = dq
        new_nodes.append(dq)
        if per_channel:   # then each channel times its own scale / the largest
            cs = (sw / top).astype(np.float32)
            cs = cs.reshape((-1, 1, 1)) if n.op == "conv2d" else cs
            mul = Node("mul", [yd, g.constant(cs, name=f"{w.name}_chscale")], [y], {},
                       g.unique(f"{n.name}_chscale"))
            y.producer = mul
            new_nodes.append(mul)
        count += 1
    g.nodes = new_nodes
    return count


@dataclass(frozen=True)
class QuantError:
    """How far an int8 graph's output is from the f32 graph's, over some feeds:
    cosine similarity of the flattened outputs (1.0 = same direction) and the largest
    absolute difference relative to the f32 output's peak |value|."""

    output: str
    cosine: float
    max_rel_err: float


def quantization_error(f32: Graph, int8: Graph, feeds: Sequence[Mapping[str, Any]]
                       ) -> list[QuantError]:
    """Both graphs evaluated in numpy (the device's arithmetic: int8 products summed
    exactly in int32) on `feeds`, compared output by output."""
    ref: dict[str, list[np.ndarray]] = {}
    got: dict[str, list[np.ndarray]] = {}
    for f in feeds:
        for name, a in reference_run(f32, f).items():
            ref.setdefault(name, []).append(np.asarray(a, np.float64).ravel())
        for name, a in reference_run(int8, f).items():
            got.setdefault(name, []).append(np.asarray(a, np.float64).ravel())
    out = []
    for name in ref:
        r, q = np.concatenate(ref[name]), np.concatenate(got[name])
        norm = float(np.linalg.norm(r) * np.linalg.norm(q))
        cos = float(np.dot(r, q) / norm) if norm > 0 else float(np.array_equal(r, q))
        peak = float(np.max(np.abs(r))) if r.size else 0.0
        diff = float(np.max(np.abs(q - r))) if r.size else 0.0
        out.append(QuantError(name, cos, diff / peak if peak > 0 else diff))
    return out
