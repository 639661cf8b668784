"""How each opcode is carried out once validated: the `execute` column of the opcode
registry (`commands.OPS`). Every executor takes (command, DMA port, start time) so the
engine runs any opcode the same way.

Host accesses may raise DmaFault (the IOMMU mapping may have changed since
validation); device views cannot fail. Callers enter np.errstate themselves.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable

import numpy as np

from ...ports import DmaPort

if TYPE_CHECKING:  # pragma: no cover
    from ..commands import Command

Executor = Callable[["Command", DmaPort, int], None]

def no_effect(cmd: "Command", dma: DmaPort, start_ns: int) -> None:
    """NOP; WAIT (the engine polls it); CALL (its callee's commands follow it)."""


def bound_kernel(cmd: "Command", dma: DmaPort, start_ns: int) -> None:
    """Opcodes whose resolver bound their kernel to the command (`cmd.run`), with its
    operands, its staging and its memory budget."""
    assert cmd.run is not None
    cmd.run()


def fill(cmd: "Command", dma: DmaPort, start_ns: int) -> None:
    assert cmd.dst is not None
    cmd.dst.view("<u4").fill(cmd.value)


def dma_h2d(cmd: "Command", dma: DmaPort, start_ns: int) -> None:
    assert cmd.dst is not None
    np.copyto(cmd.dst, dma.view(cmd.host_addr, cmd.size))


def dma_d2h(cmd: "Command", dma: DmaPort, start_ns: int) -> None:
    assert cmd.src is not None
    dma.write(cmd.host_addr, cmd.src)


def signal(cmd: "Command", dma: DmaPort, start_ns: int) -> None:
    dma.write(cmd.host_addr, cmd.value.to_bytes(8, "little"))


def timestamp(cmd: "Command", dma: DmaPort, start_ns: int) -> None:
    dma.write(cmd.host_addr, start_ns.to_bytes(8, "little"))
