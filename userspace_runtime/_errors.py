"""Exceptions of the runtime: each one says what went wrong in runtime terms."""
from __future__ import annotations

from hwspec.va1 import NO_OFFSET, Status


class UserspaceRuntimeError(Exception):
    """Root of every exception userspace_runtime defines (docs/architecture.md, "Errors")."""


class DriverError(UserspaceRuntimeError, OSError):
    """An ioctl (or open) on the device file failed; keeps the driver's errno.

    The message names the call and its arguments, so `EINVAL` alone never reaches the
    user without saying which request it came from.
    """


class UseAfterFreeError(UserspaceRuntimeError, RuntimeError):
    """A freed buffer, destroyed stream/context or closed device was used."""


class ContextMismatchError(UserspaceRuntimeError, ValueError):
    """An object of one context was used with another context (or device)."""


def status_name(code: int) -> str:
    try:
        return Status(code).name
    except ValueError:
        return f"UNKNOWN_STATUS_{code}"


class DeviceError(UserspaceRuntimeError, RuntimeError):
    """A submission completed with a status other than OK.

    `status`/`status_name` is the device's code, `error_offset` the byte offset of the
    failing command in its command buffer (None when the error is not tied to one) and
    `command` the name the runtime gave the command at that offset (which call made it).
    """

    def __init__(self, status: int, error_offset: int | None, command: str | None, *,
                 fence_seq: int, context_id: int, queue: int) -> None:
        self.status = status
        self.status_name = status_name(status)
        self.error_offset = None if error_offset in (None, NO_OFFSET) else error_offset
        self.command = command
        self.fence_seq = fence_seq
        self.context_id = context_id
        self.queue = queue
        where = ("not tied to a command" if self.error_offset is None
                 else f"at command buffer offset {self.error_offset}"
                 + (f" ({command})" if command else " (no command starts there)"))
        super().__init__(f"submission failed with {self.status_name} {where}; "
                         f"context {context_id}, queue {queue}, fence {fence_seq}")
