"""How each opcode is carried out once validated: the `execute` column of the opcode
registry (`commands.OPS`). Every executor takes (command, DMA port, start time) so the
engine runs any opcode the same way.

Host accesses may raise DmaFault (the IOMMU mapping may have changed since
validation); device views cannot fail. Callers enter np.errstate themselves.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable

import numpy as np

from hwspec.isa import Activation, DType, EltOp

from ...ports import DmaPort
from .activations import apply_activation, gelu64, sigmoid64

if TYPE_CHECKING:  # pragma: no cover
    from ..commands import Command

Executor = Callable[["Command", DmaPort, int], None]

_F32 = np.dtype("<f4")


def no_effect(cmd: "Command", dma: DmaPort, start_ns: int) -> None:
    """NOP; WAIT (the engine polls it); CALL (its callee's commands follow it)."""


def bound_kernel(cmd: "Command", dma: DmaPort, start_ns: int) -> None:
    """Opcodes whose resolver bound their kernel to the command (`cmd.run`)."""
    assert cmd.run is not None
    cmd.run()


def gemm(cmd: "Command", dma: DmaPort, start_ns: int) -> None:
    if cmd.run is not None:      # I8: the resolver bound the integer kernel
        cmd.run()
        return
    _gemm(cmd)


def _gemm(cmd: "Command") -> None:
    a, b, c = cmd.a, cmd.b, cmd.c
    assert a is not None and b is not None and c is not None
    act = cmd.activation
    bias = cmd.bias
    if (cmd.dtype == DType.F32 and cmd.alpha == 1.0 and cmd.beta == 0.0
            and act in (Activation.NONE, Activation.RELU)
            and (bias is None or (bias.dtype == _F32 and not np.may_share_memory(bias, c)))):
        # Fast path: BLAS writes straight into device memory; the epilogue (bias, ReLU)
        # runs in place on it. Same f32 operations in the same order as the slow path.
        np.matmul(a, b, out=c)
        if bias is not None:
            np.add(c, bias, out=c)
        if act == Activation.RELU:
            np.maximum(c, 0, out=c)
        return
    if cmd.dtype == DType.F32:
        t = np.matmul(a, b)
    else:
        t = np.matmul(a.astype(_F32), b.astype(_F32))
    if cmd.alpha != 1.0:
        t *= np.float32(cmd.alpha)
    if cmd.beta != 0.0:
        t += np.float32(cmd.beta) * c.astype(_F32)
    if cmd.bias is not None:
        t += cmd.bias.astype(_F32)
    np.copyto(c, apply_activation(t, act), casting="unsafe")


_BINARY = {EltOp.ADD: np.add, EltOp.MUL: np.multiply, EltOp.SUB: np.subtract,
           EltOp.DIV: np.divide}


def elementwise(cmd: "Command", dma: DmaPort, start_ns: int) -> None:
    """One numpy ufunc per command; f16 binary ops round once (numpy computes them in
    f32), GELU and SIGMOID go through f64 and round once to the dtype."""
    a, b, out = cmd.a, cmd.b, cmd.dst
    assert a is not None and out is not None
    if cmd.op == EltOp.RELU:
        np.maximum(a, a.dtype.type(0), out=out)
    elif cmd.op == EltOp.GELU:
        np.copyto(out, gelu64(a), casting="unsafe")
    elif cmd.op == EltOp.SIGMOID:
        np.copyto(out, sigmoid64(a), casting="unsafe")
    else:
        assert b is not None
        _BINARY[EltOp(cmd.op)](a, b, out=out)  # b of shape [cols] broadcasts over rows


def fill(cmd: "Command", dma: DmaPort, start_ns: int) -> None:
    assert cmd.dst is not None
    cmd.dst.view("<u4").fill(cmd.value)


def dma_h2d(cmd: "Command", dma: DmaPort, start_ns: int) -> None:
    assert cmd.dst is not None
    np.copyto(cmd.dst, dma.view(cmd.host_addr, cmd.size))


def dma_d2h(cmd: "Command", dma: DmaPort, start_ns: int) -> None:
    assert cmd.src is not None
    dma.write(cmd.host_addr, cmd.src)


def dma_d2d(cmd: "Command", dma: DmaPort, start_ns: int) -> None:
    assert cmd.dst is not None and cmd.src is not None
    cmd.dst[...] = cmd.src  # numpy copies through a temporary when ranges overlap


def signal(cmd: "Command", dma: DmaPort, start_ns: int) -> None:
    dma.write(cmd.host_addr, cmd.value.to_bytes(8, "little"))


def timestamp(cmd: "Command", dma: DmaPort, start_ns: int) -> None:
    dma.write(cmd.host_addr, start_ns.to_bytes(8, "little"))
