"""Pointwise functions: erf/GELU, sigmoid, SiLU, and the GEMM/CONV2D epilogues.

erf: Numerical Recipes' Chebyshev fit of erfc (Press et al., 2nd ed., §6.2, `erfcc`),
evaluated in float64. Its fractional error is below 1.2e-7 everywhere, for erfc(|z|);
GELU uses erfc on the negative side, so GELU's relative error is below 1.2e-7 for every
x before the final rounding to the output dtype (about 1.5 f32 ulp after it).
"""
from __future__ import annotations

import numpy as np

from hwspec.isa import Activation

_F32 = np.dtype("<f4")
_F64 = np.dtype("<f8")
_NR = (-1.26551223, 1.00002368, 0.37409196, 0.09678418, -0.18628806, 0.27886807,
       -1.13520398, 1.48851587, -0.82215223, 0.17087277)
ERFC_REL_ERROR = 1.2e-7
_SQRT1_2 = 0.7071067811865476


def erfc_abs(z: np.ndarray) -> np.ndarray:
    """erfc(|z|) in float64, fractional error < 1.2e-7."""
    a = np.abs(np.asarray(z, _F64))
    t = 1.0 / (1.0 + 0.5 * a)
    p = np.full_like(t, _NR[-1])
    for c in _NR[-2:0:-1]:
        p *= t
        p += c
    p *= t
    p += _NR[0]
    p -= a * a
    return t * np.exp(p)


def erf(z: np.ndarray) -> np.ndarray:
    """erf in float64 (absolute error < 1.2e-7)."""
    z = np.asarray(z, _F64)
    return np.where(z >= 0, 1.0 - erfc_abs(z), erfc_abs(z) - 1.0)


def gelu64(x: np.ndarray) -> np.ndarray:
    """GELU(x) = 0.5 x (1 + erf(x / sqrt 2)) in float64, relative error < 1.2e-7."""
    x = np.asarray(x, _F64)
    e = erfc_abs(x * _SQRT1_2)                 # erfc(|x|/sqrt2)
    one_plus_erf = np.where(x >= 0, 2.0 - e, e)
    # where 1 + erf underflows to 0 (x -> -inf) the limit is -0, not -inf * 0 = NaN
    return np.where(one_plus_erf == 0, -0.0, 0.5 * x * one_plus_erf)


def sigmoid64(x: np.ndarray) -> np.ndarray:
    """1 / (1 + exp(-x)) in float64, stable for both signs."""
    x = np.asarray(x, _F64)
    e = np.exp(-np.abs(x))
    y: np.ndarray = np.where(x >= 0, 1.0 / (1.0 + e), e / (1.0 + e))
    return y


def silu64(x: np.ndarray) -> np.ndarray:
    """x * sigmoid(x) in float64 (SiLU / swish)."""
    x = np.asarray(x, _F64)
    y: np.ndarray = x * sigmoid64(x)
    return y


def apply_activation(t: np.ndarray, activation: int) -> np.ndarray:
    """The epilogue on an f32 (or integer, RELU only) array; may work in place."""
    if activation == Activation.RELU:
        np.maximum(t, t.dtype.type(0), out=t)
        return t
    if activation == Activation.GELU:
        return gelu64(t).astype(_F32)
    if activation == Activation.SIGMOID:
        return sigmoid64(t).astype(_F32)
    if activation == Activation.SILU:
        return silu64(t).astype(_F32)
    return t
