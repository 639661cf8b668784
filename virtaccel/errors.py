"""virtaccel's exceptions: one root, so a caller of the product layer can catch
everything it raises on purpose with `except VirtaccelError`.

    VirtaccelError
    ├── ImageError         a VM image that cannot be used (names the file and field)
    ├── SessionStateError  a Session method called in the wrong lifecycle state
    ├── LaunchError        a Session could not build its machine (names what failed)
    ├── ScenarioError      a tenant scenario with impossible settings
    └── CliError           a command-line mistake (virtaccel.cli._args): exit 2

Errors of the layers below keep their own roots (VmmError, DeviceModelError, ...);
`LaunchError` chains the original as `__cause__`; a guest program's own exception
reaches the caller of `Session.run` unchanged.
"""
from __future__ import annotations


class VirtaccelError(Exception):
    """Root of every exception the product layer raises on purpose."""


class ImageError(VirtaccelError, ValueError):
    """A VM image that cannot be used; the message names the file and the field."""


class SessionStateError(VirtaccelError, RuntimeError):
    """A Session method was called in a state that does not allow it."""


class LaunchError(VirtaccelError, RuntimeError):
    """Building the machine (host, card, VFs, VMs, attachments) failed."""


class ScenarioError(VirtaccelError, ValueError):
    """A tenant scenario whose settings cannot run."""
