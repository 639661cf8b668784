"""Guest user-space runtime for the VA-1 accelerator.

Reaches the driver only through the device file's uAPI (`guest_driver.uapi`):
`Device` -> `Context` -> `Buffer`/`Stream`/`Event`, and `CommandBufferBuilder` for the
command ISA. `DriverFile` is the typed ioctl client under them, for programs that drive
the uAPI themselves (their own command buffers and fences); `WaitResult` is what its
`wait` returns.
"""
from __future__ import annotations

from ._errors import UserspaceRuntimeError
from .commands import CommandBufferBuilder
from .driver_file import DriverFile, WaitResult
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
    "DriverFile",
    "Event",
    "Pending",
    "Stream",
    "SubmissionResult",
    "UseAfterFreeError",
    "UserspaceRuntimeError",
    "WaitResult",
]
