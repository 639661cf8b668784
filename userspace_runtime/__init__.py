"""Guest user-space runtime for the VA-1 accelerator.

Reaches the driver only through the device file's uAPI (`guest_driver.uapi`):
`Device` -> `Context` -> `Buffer`/`Stream`/`Event`, and `CommandBufferBuilder` for the
command ISA.
"""
from __future__ import annotations

from ._errors import UserspaceRuntimeError
from .commands import CommandBufferBuilder
from .runtime import (
    Buffer,
    Context,
    ContextMismatchError,
    Device,
    DeviceError,
    DriverError,
    Event,
    Pending,
    Stream,
    SubmissionResult,
    UseAfterFreeError,
)

__all__ = [
    "Buffer",
    "CommandBufferBuilder",
    "Context",
    "ContextMismatchError",
    "Device",
    "DeviceError",
    "DriverError",
    "Event",
    "Pending",
    "Stream",
    "SubmissionResult",
    "UseAfterFreeError",
    "UserspaceRuntimeError",
]
