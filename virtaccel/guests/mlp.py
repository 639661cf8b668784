"""The demo guest program: a two-layer f32 MLP on the device, checked against numpy.

    y = relu(relu(x @ W1 + b1) @ W2 + b2)

Both layers are one GEMM each, with bias and ReLU fused in the GEMM epilogue. Inputs
and weights come from `np.random.default_rng(seed)`, so a seed names a run.
"""
from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from guest_driver import uapi
from hwspec import va1

from userspace_runtime import Buffer, Context, Device, Stream

TOLERANCE = 1e-4


def reference(x: np.ndarray, w1: np.ndarray, b1: np.ndarray, w2: np.ndarray,
              b2: np.ndarray) -> np.ndarray:
    """The same MLP in numpy, in float32 as the device computes it."""
    h = np.maximum(x @ w1 + b1, np.float32(0))
    y: np.ndarray = np.maximum(h @ w2 + b2, np.float32(0))
    return y


def make_inputs(seed: int, batch: int, sizes: Sequence[int]) -> dict[str, np.ndarray]:
    """x, W1, b1, W2, b2 (float32), weights scaled by 1/sqrt(fan_in)."""
    d0, d1, d2 = sizes
    rng = np.random.default_rng(seed)
    f32 = np.float32
    return {
        "x": rng.standard_normal((batch, d0), dtype=f32),
        "w1": (rng.standard_normal((d0, d1), dtype=f32) / f32(np.sqrt(d0))).astype(f32),
        "b1": (rng.standard_normal(d1, dtype=f32) * f32(0.1)).astype(f32),
        "w2": (rng.standard_normal((d1, d2), dtype=f32) / f32(np.sqrt(d1))).astype(f32),
        "b2": (rng.standard_normal(d2, dtype=f32) * f32(0.1)).astype(f32),
    }


WEIGHTS = ("x", "w1", "b1", "w2", "b2")


def alloc_buffers(ctx: Context, batch: int, sizes: Sequence[int]) -> dict[str, Buffer]:
    """Device buffers for the inputs and weights (named as in make_inputs), h and y."""
    d0, d1, d2 = sizes
    shapes = {"x": (batch, d0), "w1": (d0, d1), "b1": (d1,), "w2": (d1, d2), "b2": (d2,),
              "h": (batch, d1), "y": (batch, d2)}
    return {name: ctx.alloc(shape, np.float32) for name, shape in shapes.items()}


def pin_inputs(dev: Device, inp: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Copies of the inputs and weights in pinned host arrays (`Device.alloc_host`), the
    runtime's fast way to feed the device: each upload from them is one DMA."""
    host = {}
    for name in WEIGHTS:
        host[name] = dev.alloc_host(inp[name].shape, inp[name].dtype)
        host[name][...] = inp[name]
    return host


def enqueue_layers(stream: Stream, bufs: dict[str, Buffer]) -> None:
    """Both layers: one GEMM each with the bias and ReLU in its epilogue."""
    stream.gemm(bufs["x"], bufs["w1"], bufs["h"], bias=bufs["b1"], activation="relu")
    stream.gemm(bufs["h"], bufs["w2"], bufs["y"], bias=bufs["b2"], activation="relu")


def main(os: uapi.GuestOS, seed: int = 0, batch: int = 64,
         sizes: Sequence[int] = (512, 1024, 256)) -> dict[str, Any]:
    """Run the MLP on /dev/accel/accel0 and compare with numpy; a JSON-able report."""
    sizes = tuple(int(s) for s in sizes)
    if len(sizes) != 3:
        raise ValueError(f"sizes must be (in, hidden, out), got {sizes!r}")
    d0, d1, d2 = sizes
    inp = make_inputs(seed, batch, sizes)
    with Device(os) as dev:
        ctx = dev.create_context()
        bufs = alloc_buffers(ctx, batch, sizes)
        stream = ctx.create_stream(queue=0)
        for name in WEIGHTS:
            stream.upload(bufs[name], inp[name])
        timed = dev.has_feature(va1.F_TIMESTAMP)  # events need TIMESTAMP
        start = stream.record_event() if timed else None
        enqueue_layers(stream, bufs)
        end = stream.record_event() if timed else None
        out = stream.download(bufs["y"])
        stream.synchronize()
        result = out.result()
        compute_ns = start.elapsed_ns(end) if start and end else None
        submissions = list(stream.submissions)
        ctx.destroy()

    expected = reference(inp["x"], inp["w1"], inp["b1"], inp["w2"], inp["b2"])
    err = float(np.max(np.abs(result.astype(np.float64) - expected.astype(np.float64))))
    return {
        "ok": bool(err <= TOLERANCE),
        "max_abs_error": err,
        "tolerance": TOLERANCE,
        "output_checksum": float(np.sum(result, dtype=np.float64)),
        "reference_checksum": float(np.sum(expected, dtype=np.float64)),
        "device_ns": int(sum(s.device_ns for s in submissions)),
        "compute_ns": compute_ns,  # device time of the two GEMMs (None without events)
        "submissions": len(submissions),
        "commands": int(sum(s.commands for s in submissions)),
        "flops": 2 * batch * (d0 * d1 + d1 * d2),
        "seed": int(seed),
        "batch": int(batch),
        "sizes": list(sizes),
        "output_shape": [int(n) for n in result.shape],
    }
