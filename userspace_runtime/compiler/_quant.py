"""Optional int8 post-training quantization (PTQ) from calibration data.

Every gemm / conv2d with constant f32 weights becomes
    quantize(x, sx, zx) -> int8 gemm/conv (int32 accumulate, int32 bias, relu kept)
    -> dequantize(., sx * max(sw)) [-> mul by sw / max(sw) per output channel]
Activations are asymmetric: sx and the zero point zx map the range the calibration
feeds produce at that operand (widened to hold 0) onto all 256 int8 codes, so a ReLU
output [0, m] gets m / 255 steps instead of the m / 127 a symmetric scale gives it; the
zero point's share of every sum (zx * the weights' sum) is folded into the int32 bias,
and a padded int8 conv pads with zx (a real 0). Weights are symmetric per output
channel (BatchNorm folding leaves channels of very different ranges). Other ops stay f32.

Dynamic scales (the default, `scales="dynamic"`): the activation's scale and zero point
are not calibrated but taken from the tensor each time the model runs, so a new input's
range can never be clipped or coarser than it needs:
    [pad in f32] -> quantize_dynamic(x) -> (xq, qparams) -> int8 gemm/conv (int32 sums)
    -> dequantize_dynamic(sums, qparams, sw, sum(wq), bias) [relu]
The device's QUANTIZE_DYNAMIC writes the (scale, zero point) record that
DEQUANTIZE_DYNAMIC reads; the zero point's share of every sum (zx * the weights' sum) is
removed there, and a padded conv's input is padded with 0.0 before it is quantized (0 is
exact: it becomes the zero point). Weights stay symmetric per output channel, static.

Mixed precision: when the quantized graph's cosine to f32 on the calibration feeds is
below `min_cosine`, the layers whose quantization costs most (each measured alone) are
kept in f32, the fewest that meet it. With dynamic scales the calibration feeds are used
only for that choice (each feed scored with its own run-time ranges, as any input is).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence, TypeVar

import numpy as np

from . import _ops
from ._ir import Graph, GraphError, Node, Value
from ._passes import _run, reference_run

_QMAX = 127.0
# Activation ranges are the calibration feeds' widened by this much: a new input's range
# often exceeds them (measured on the fixture CNNs, whose deep 2x2 maps have few values
# per tensor), and clipping costs more than the coarser step.
HEADROOM = 1.25


def _scale(maxabs: float) -> float:
    return float(maxabs) / _QMAX if maxabs > 0 else 1.0


def activation_qparams(lo: float, hi: float) -> tuple[float, int]:
    """(scale, zero point) mapping [min(lo, 0), max(hi, 0)] onto int8's 256 codes (0 is
    exact: ReLU zeros and conv padding stay 0)."""
    lo, hi = min(float(lo), 0.0), max(float(hi), 0.0)
    if hi - lo <= 0:
        return 1.0, 0
    s = (hi - lo) / 255.0
    zp = int(np.clip(round(-128.0 - lo / s), -128, 127))
    return s, zp


@dataclass(frozen=True)
class _Plan:
    """One layer's int8 form, computed once (the fallback rewrites many candidates)."""

    sx: float
    zx: int
    wq: np.ndarray
    bias: np.ndarray        # int32 per output channel (zero point folded in)
    top: float              # the largest weight scale
    chscale: np.ndarray | None   # sw / top per output channel, None when all equal


def _targets(g: Graph) -> list[Node]:
    return [n for n in g.nodes if n.op in ("gemm", "conv2d")
            and n.inputs[0] is not None and n.inputs[0].dtype == "float32"
            and n.inputs[1] is not None and n.inputs[1].is_const
            and (len(n.inputs) < 3 or n.inputs[2] is None or n.inputs[2].is_const)
            and n.attrs.get("activation") in (None, "relu")
            and not (n.op == "gemm" and n.attrs.get("trans_a"))
            and not (n.op == "conv2d" and n.attrs.get("groups", 1) != 1)]


def _weights(n: Node) -> tuple[np.ndarray, np.ndarray, tuple[int, ...]]:
    """The int8 weights (symmetric per output channel), their scales and the axes a
    channel's weights span."""
    w = n.inputs[1]
    assert w is not None and w.const is not None
    wf = w.const.astype(np.float64)
    if n.op == "gemm":
        wf = wf * n.attrs.get("alpha", 1.0)
    # per output channel: conv weights' rows (K, C, R, S); gemm B's columns (or rows
    # when transposed)
    if n.op == "conv2d":
        peak = np.max(np.abs(wf).reshape(wf.shape[0], -1), axis=1)
        wshape: tuple[int, ...] = (-1, 1, 1, 1)
        red: tuple[int, ...] = (1, 2, 3)
    elif n.attrs.get("trans_b"):
        peak, wshape, red = np.max(np.abs(wf), axis=1), (-1, 1), (1,)
    else:
        peak, wshape, red = np.max(np.abs(wf), axis=0), (1, -1), (0,)
    sw = np.array([_scale(float(p)) for p in peak])
    wq = np.clip(np.rint(wf / sw.reshape(wshape)), -127, 127).astype(np.int8)
    return wq, sw, red


def _float_bias(n: Node, channels: int) -> np.ndarray | None:
    bias = n.inputs[2] if len(n.inputs) > 2 else None
    if bias is None:
        return None
    assert bias.const is not None
    bf = np.broadcast_to(bias.const, bias.shape).astype(np.float64).reshape(-1)
    if n.op == "gemm":
        bf = bf * n.attrs.get("beta", 1.0)
    return np.broadcast_to(bf, (channels,))


def _plan(n: Node, lo: float, hi: float) -> _Plan:
    sx, zx = activation_qparams(lo, hi)
    wq, sw, red = _weights(n)
    fb = _float_bias(n, len(sw))
    bf = np.zeros(len(sw)) if fb is None else fb
    bq = np.rint(bf / (sx * sw)) - zx * wq.astype(np.int64).sum(axis=red)
    if np.max(np.abs(bq)) >= 2 ** 31:
        raise GraphError(f"node {n.name}: int8 bias does not fit int32 (scale {sx:g})")
    top = float(np.max(sw))
    cs = None if np.all(sw == top) else (sw / top).astype(np.float32)
    return _Plan(sx, zx, wq, bq.astype(np.int32), top, cs)


_P = TypeVar("_P")


def _rewrite_each(g: Graph, plans: Mapping[str, _P], keep: frozenset[str],
                  one: Callable[[Graph, Node, _P, list[Node]], None]) -> int:
    """Rewrite every planned node not in `keep` with `one` (which appends the nodes that
    replace it), in place; returns how many."""
    count = 0
    new_nodes: list[Node] = []
    for n in g.nodes:
        p = plans.get(n.name)
        if p is None or n.name in keep:
            new_nodes.append(n)
            continue
        one(g, n, p, new_nodes)
        count += 1
    g.nodes = new_nodes
    return count


def _rewrite(g: Graph, plans: Mapping[str, _Plan], keep: frozenset[str]) -> int:
    """Put every planned node not in `keep` into int8 (calibrated scales), in place."""
    return _rewrite_each(g, plans, keep, _int8_static)


def _int8_static(g: Graph, n: Node, p: _Plan, new_nodes: list[Node]) -> None:
    """quantize (calibrated scale) -> int8 `n` -> dequantize [-> per-channel mul]."""
    x, w = n.inputs[0], n.inputs[1]
    assert x is not None and w is not None
    xq = Node("quantize", [x], [], {"scale": p.sx, "zero_point": p.zx},
              g.unique(f"{n.name}_q"))
    xq.outputs = [Value(g.unique(f"{n.name}_xq"), x.shape, "int8", producer=xq,
                        quant=(p.sx, p.zx))]
    new_nodes.append(xq)
    n.inputs[0] = xq.outputs[0]
    n.inputs[1] = g.constant(p.wq, name=f"{w.name}_q")
    if np.any(p.bias) or len(n.inputs) > 2:
        bname = f"{n.name}_bias_q"
        if len(n.inputs) > 2 and n.inputs[2] is not None:
            bname = f"{n.inputs[2].name}_q"
        b = g.constant(p.bias, name=bname)
        n.inputs = [n.inputs[0], n.inputs[1], b]
    if n.op == "gemm":
        n.attrs["alpha"], n.attrs["beta"] = 1.0, 1.0
    if n.op == "conv2d" and p.zx and any(n.attrs["padding"]):
        n.attrs["pad_value"] = p.zx
    y = n.outputs[0]
    yq = Value(g.unique(f"{y.name}_i32"), y.shape, "int32", producer=n)
    n.outputs = [yq]
    new_nodes.append(n)
    yd = Value(g.unique(f"{y.name}_dq"), y.shape, "float32") if p.chscale is not None else y
    dq = Node("dequantize", [yq], [yd], {"scale": p.sx * p.top, "zero_point": 0},
              g.unique(f"{n.name}_dq"))
    yd.producer = dq
    new_nodes.append(dq)
    if p.chscale is not None:   # then each channel times its own scale / the largest
        cs = p.chscale.reshape((-1, 1, 1)) if n.op == "conv2d" else p.chscale
        mul = Node("mul", [yd, g.constant(cs, name=f"{w.name}_chscale")], [y], {},
                   g.unique(f"{n.name}_chscale"))
        y.producer = mul
        new_nodes.append(mul)


SCALES = ("dynamic", "static")


@dataclass(frozen=True)
class _DynPlan:
    """One layer's int8 form with run-time activation scales."""

    wq: np.ndarray
    wscale: np.ndarray       # f32 per output channel
    wsum: np.ndarray         # int32 per output channel: the sum of its int8 weights
    bias: np.ndarray | None  # f32 per output channel


def _dyn_plan(n: Node) -> _DynPlan:
    wq, sw, red = _weights(n)
    bf = _float_bias(n, len(sw))
    return _DynPlan(wq, sw.astype(np.float32), wq.astype(np.int64).sum(axis=red).astype(
        np.int32), None if bf is None else bf.astype(np.float32))


def _rewrite_dynamic(g: Graph, plans: Mapping[str, _DynPlan], keep: frozenset[str]) -> int:
    """Put every planned node not in `keep` into int8 with run-time activation scales,
    in place; returns how many."""
    return _rewrite_each(g, plans, keep, _int8_dynamic)


def _int8_dynamic(g: Graph, n: Node, p: _DynPlan, new_nodes: list[Node]) -> None:
    """[pad in f32 ->] quantize_dynamic -> int8 `n` -> dequantize_dynamic."""
    x, w = n.inputs[0], n.inputs[1]
    assert x is not None and w is not None
    if n.op == "conv2d" and any(n.attrs["padding"]):
        pt, pl, pb, pr = n.attrs["padding"]
        pad = Node("pad", [x], [], {"pads": (0, 0, pt, pl, 0, 0, pb, pr), "value": 0.0},
                   g.unique(f"{n.name}_pad"))
        N, C, H, W = x.shape
        x = Value(g.unique(f"{n.name}_xpad"), (N, C, H + pt + pb, W + pl + pr),
                  x.dtype, producer=pad)
        pad.outputs = [x]
        new_nodes.append(pad)
        n.attrs["padding"] = (0, 0, 0, 0)
    xq = Node("quantize_dynamic", [x], [], {}, g.unique(f"{n.name}_q"))
    xq.outputs = [Value(g.unique(f"{n.name}_xq"), x.shape, "int8", producer=xq),
                  Value(g.unique(f"{n.name}_qparams"), (2,), "int32", producer=xq)]
    new_nodes.append(xq)
    act = n.attrs.pop("activation", None)
    n.inputs = [xq.outputs[0], g.constant(p.wq, name=f"{w.name}_q")]
    if n.op == "gemm":
        n.attrs["alpha"], n.attrs["beta"] = 1.0, 0.0
    y = n.outputs[0]
    acc = Value(g.unique(f"{y.name}_i32"), y.shape, "int32", producer=n)
    n.outputs = [acc]
    new_nodes.append(n)
    ins: list[Value | None] = [acc, xq.outputs[1],
                               g.constant(p.wscale, name=f"{w.name}_wscale"),
                               g.constant(p.wsum, name=f"{w.name}_wsum")]
    if p.bias is not None:
        ins.append(g.constant(p.bias, name=f"{n.name}_bias_f32"))
    dq = Node("dequantize_dynamic", ins, [y], {"activation": act},
              g.unique(f"{n.name}_dq"))
    y.producer = dq
    new_nodes.append(dq)


@dataclass
class Int8Report:
    """What quantize_int8 did: the layers put in int8 and those kept in f32 by the
    accuracy fallback (graph node names, in graph order), its target, and the worst
    cosine to f32 it measured (over outputs and calibration feeds, each feed with the
    ranges of the others when there are several); None without a fallback; and whether
    activation scales are taken at run time ("dynamic") or calibrated ("static")."""

    quantized: list[str] = field(default_factory=list)
    kept_f32: list[str] = field(default_factory=list)
    min_cosine: float | None = None
    cosine: float | None = None
    scales: str = "dynamic"     # activation scales: "dynamic" (run time) or "static"


def _cosine(ref: np.ndarray, got: np.ndarray) -> float:
    norm = float(np.linalg.norm(ref) * np.linalg.norm(got))
    return float(np.dot(ref, got) / norm) if norm > 0 else float(np.array_equal(ref, got))


class _Scorer:
    """The worst cosine, over outputs and calibration feeds, of candidate graphs (one
    per feed) against the f32 graph; the f32 values are kept per feed, so a candidate
    whose first k nodes are the f32 graph's starts at node k."""

    def __init__(self, g: Graph, feeds: Sequence[Mapping[str, Any]]) -> None:
        self.envs = [dict((v.name, a) for v, a in _named(g, _run(g, f))) for f in feeds]
        self.outs = [o.name for o in g.outputs]
        self.index = {n.name: i for i, n in enumerate(g.nodes)}

    def score(self, graphs: Sequence[Graph], start: int = 0) -> float:
        worst = 1.0
        for g, env0 in zip(graphs, self.envs):
            env = dict(env0) if start else {v.name: env0[v.name] for v in g.inputs}
            for n in g.nodes[start:]:
                ins = [None if v is None else v.const if v.is_const else env[v.name]
                       for v in n.inputs]
                for v, a in zip(n.outputs, _ops.evaluate(n, ins)):
                    env[v.name] = np.asarray(a, dtype=v.dtype).reshape(v.shape)
            for o in self.outs:
                worst = min(worst, _cosine(np.asarray(env0[o], np.float64).ravel(),
                                           np.asarray(env[o], np.float64).ravel()))
        return worst


def _named(g: Graph, env: Mapping[int, np.ndarray]) -> list[tuple[Value, np.ndarray]]:
    vals = [*g.inputs, *(o for n in g.nodes for o in n.outputs)]
    if len({v.name for v in vals}) != len(vals):
        raise GraphError(f"graph {g.name}: value names are not unique")
    return [(v, env[id(v)]) for v in vals]


def _static_rewriter(plans: Mapping[str, _Plan]) -> Callable[[Graph, frozenset[str]], int]:
    return lambda c, kept: _rewrite(c, plans, kept)


def quantize_int8(g: Graph, calibration: Sequence[Mapping[str, Any]],
                  min_cosine: float | None = None, scales: str = "dynamic") -> Int8Report:
    """Rewrite `g` in place. With `min_cosine`, layers are kept in f32 (most costly
    first, a layer's cost = 1 - cosine with it alone in int8) until the worst output's
    cosine to `g`'s f32 outputs is >= min_cosine on every calibration feed. Static
    scales score each feed with the ranges of the other feeds (as an input the
    calibration did not see; with one feed, its own); dynamic ones with its own run-time
    ranges, as every input is run."""
    if not calibration:
        raise GraphError("int8 quantization needs at least one calibration feed")
    if min_cosine is not None and not 0.0 <= min_cosine <= 1.0:   # NaN too
        raise GraphError(f"int8 min_cosine must be in 0 .. 1, got {min_cosine!r}")
    if scales not in SCALES:
        raise GraphError(f"int8 scales must be one of {', '.join(SCALES)}, got {scales!r}")
    targets = _targets(g)
    names = [n.name for n in targets]
    every = range(len(calibration))
    report = Int8Report(min_cosine=min_cosine, scales=scales)
    rewrite: Callable[[Graph, frozenset[str]], int]
    held: list[Callable[[Graph, frozenset[str]], int]]
    if scales == "dynamic":
        dplans = {n.name: _dyn_plan(n) for n in targets}

        def rewrite(c: Graph, kept: frozenset[str]) -> int:
            return _rewrite_dynamic(c, dplans, kept)

        held = [rewrite] * len(calibration)
    else:
        # each target input's (min, max) on each feed
        seen: list[dict[str, tuple[float, float]]] = []
        for feeds in calibration:
            env = _run(g, feeds)
            seen.append({})
            for n in targets:
                x = n.inputs[0]
                assert x is not None
                a = x.const if x.const is not None else env[id(x)]
                seen[-1][n.name] = (float(np.min(a)), float(np.max(a)))

        def plans_from(feeds: Sequence[int]) -> dict[str, _Plan]:
            h = HEADROOM
            return {n.name: _plan(n, h * min(seen[i][n.name][0] for i in feeds),
                                  h * max(seen[i][n.name][1] for i in feeds))
                    for n in targets}

        plans = plans_from(every)

        def rewrite(c: Graph, kept: frozenset[str]) -> int:
            return _rewrite(c, plans, kept)

        # scored on each feed with ranges from the others (held out, as a new input
        # would be) when there are several
        held_plans = [plans] if len(calibration) == 1 else \
            [plans_from([j for j in every if j != i]) for i in every]
        held = [_static_rewriter(p) for p in held_plans]
    keep: frozenset[str] = frozenset()
    if min_cosine is not None and targets:
        scorer = _Scorer(g, calibration)

        def cos_with(kept: frozenset[str], start: int = 0) -> float:
            graphs = []
            for rw in held:
                c = g.clone()
                rw(c, kept)
                graphs.append(c)
            return scorer.score(graphs, start)

        report.cosine = cos_with(keep)
        if report.cosine < min_cosine:
            everyone = frozenset(names)
            cost = {nm: 1.0 - cos_with(everyone - {nm}, scorer.index[nm]) for nm in names}
            order = sorted(names, key=lambda nm: -cost[nm])
            # the fewest costliest layers in f32 that meet min_cosine (binary search:
            # keeping more layers in f32 does not, in practice, make it worse)
            lo_k, hi_k, best = 0, len(order), 1.0
            while hi_k - lo_k > 1:
                mid = (lo_k + hi_k) // 2
                c = cos_with(frozenset(order[:mid]))
                if c >= min_cosine:
                    hi_k, best = mid, c
                else:
                    lo_k = mid
            keep = frozenset(order[:hi_k])
            report.cosine = best if hi_k < len(order) else 1.0
    rewrite(g, keep)
    report.quantized = [nm for nm in names if nm not in keep]
    report.kept_f32 = [nm for nm in names if nm in keep]
    return report


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
        peak = float(np.max(np.abs(r))) if r.size else 0.0
        diff = float(np.max(np.abs(q - r))) if r.size else 0.0
        out.append(QuantError(name, _cosine(r, q), diff / peak if peak > 0 else diff))
    return out
