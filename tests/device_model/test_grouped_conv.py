"""Grouped and depthwise CONV2D (groups > 1) are computed tap by tap, without im2col:
bounded memory, the direct reference's results, and the roofline's (memory-bound) time."""
from __future__ import annotations

import math
import struct
import tracemalloc
from typing import Any

import numpy as np
import pytest
from dm_driver import Rig, hdr

from device_model import Va1Config
from device_model.va1.ops import kernels
from hwspec import isa
from hwspec.isa import Opcode
from hwspec.va1 import NO_OFFSET, Status

CFG = Va1Config(device_memory_size=8 << 20)


def _enc(opcode: Opcode, flags: int = 0, **fields: Any) -> bytes:
    layout = isa.PAYLOAD[opcode]
    return hdr(opcode, isa.command_length(opcode), flags) + struct.pack(
        layout.format, *(fields.get(n, 0) for n in layout.names))


def _direct(x: np.ndarray, w: np.ndarray, groups: int, stride: int, pad: int) -> np.ndarray:
    """float64 direct convolution by kernel taps (the test's own, from the spec)."""
    n, c, h, wd = x.shape
    k, cg, r, s = w.shape
    kg = k // groups
    xp = np.pad(x.astype(np.float64), ((0, 0), (0, 0), (pad, pad), (pad, pad)))
    oh, ow = (h + 2 * pad - r) // stride + 1, (wd + 2 * pad - s) // stride + 1
    y = np.zeros((n, k, oh, ow))
    for o in range(k):
        g = o // kg
        for ci in range(cg):
            for i in range(r):
                for j in range(s):
                    y[:, o] += w[o, ci, i, j] * xp[:, g * cg + ci, i:i + stride * (oh - 1) + 1:stride,
                                                   j:j + stride * (ow - 1) + 1:stride]
    return y


@pytest.mark.parametrize("c,k,groups,stride,pad", [
    (64, 64, 64, 1, 1),     # depthwise (MobileNet, EfficientNet, ShuffleNet)
    (32, 64, 32, 2, 1),     # depthwise with channel multiplier 2, stride 2
    (32, 64, 4, 1, 1),      # grouped (ResNeXt-style)
])
def test_grouped_conv_memory_stays_near_the_image(c: int, k: int, groups: int, stride: int,
                                                  pad: int) -> None:
    """im2col of a 3x3 conv would gather 9 x the image besides the padded image; the
    tap-by-tap path holds the padded image and a few image-sized arrays."""
    rng = np.random.default_rng(7)
    x = rng.standard_normal((1, c, 40, 40)).astype(np.float32)
    w = rng.standard_normal((k, c // groups, 3, 3)).astype(np.float32)
    b = rng.standard_normal(k).astype(np.float32)
    oh = (40 + 2 * pad - 3) // stride + 1
    y = np.empty((1, k, oh, oh), np.float32)
    tracemalloc.start()
    try:
        kernels.conv2d(x, w, b, y, groups=groups, stride=(stride, stride), dilation=(1, 1),
                       pads=(pad,) * 4, activation=1, budget=64 << 20)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    padded = c * (40 + 2 * pad) ** 2 * 4
    im2col = 9 * c * oh * oh * 4
    # the padded image, one shifted tap, the accumulator, a product or the epilogue
    assert peak <= padded + 4 * max(c * oh * oh * 4, y.nbytes) < padded + im2col
    ref = np.maximum(_direct(x, w, groups, stride, pad) + b[None, :, None, None], 0)
    np.testing.assert_allclose(y, ref, rtol=1e-5, atol=1e-5)


def test_depthwise_conv_is_memory_bound_on_the_roofline() -> None:
    """A 3x3 depthwise conv does ~2 flops per byte: its device time is the overhead
    plus its bytes over the bandwidth; the dense conv of the same shape is compute-bound."""
    rig = Rig(CFG)
    ov, peak, bw = CFG.cmd_overhead_ns, CFG.peak_flops, CFG.mem_bandwidth
    c, hw = 64, 56
    rng = np.random.default_rng(3)
    rig.dev.memory.write(0, rng.standard_normal(c * hw * hw).astype(np.float32).tobytes())
    rig.dev.memory.write(1 << 20, rng.standard_normal(c * c * 9).astype(np.float32).tobytes())
    times = {}
    for groups in (c, 1):
        cmd = _enc(Opcode.CONV2D, dtype=0, groups=groups, n=1, c=c, h=hw, w=hw, k=c, r=3, s=3,
                   stride_h=1, stride_w=1, dilation_h=1, dilation_w=1, pad_top=1,
                   pad_left=1, pad_bottom=1, pad_right=1, x=0, weight=1 << 20, y=4 << 20)
        r = rig.submit(rig.create_context(), cmd, fence=1)
        assert (Status(r.status), r.error_offset) == (Status.OK, NO_OFFSET), r
        times[groups] = r.end_ns - r.start_ns
        flops = 2 * c * hw * hw * (c // groups) * 9
        nbytes = 4 * (2 * c * hw * hw + c * (c // groups) * 9)
        mem_ns, flop_ns = math.ceil(nbytes * 1e9 / bw), math.ceil(flops * 1e9 / peak)
        assert times[groups] == ov + max(mem_ns, flop_ns)
        assert (mem_ns > flop_ns) == (groups == c)
    assert times[c] < times[1]
