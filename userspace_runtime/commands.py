"""VA-1 command buffers: build them, decode them, disassemble them.

The public face of `userspace_runtime._builder`; see `CommandBufferBuilder`.
"""
from __future__ import annotations

from ._builder import (
    CommandBufferBuilder,
    CommandRecord,
    DecodedCommand,
    as_activation,
    as_cmpop,
    as_dtype,
    as_eltop,
    as_poolop,
    as_reduceop,
    contiguous_strides,
    conv2d_output_hw,
    decode,
    pool2d_output_hw,
    disassemble,
)

__all__ = [
    "CommandBufferBuilder",
    "CommandRecord",
    "DecodedCommand",
    "as_activation",
    "as_cmpop",
    "as_dtype",
    "as_eltop",
    "as_poolop",
    "as_reduceop",
    "contiguous_strides",
    "conv2d_output_hw",
    "decode",
    "disassemble",
    "pool2d_output_hw",
]
