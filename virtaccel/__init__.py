"""virtaccel: the product layer over the VA-1 stack.

    from virtaccel import Session, run_model

`Session` builds a machine with its host, VMs and accelerator attachments (from keyword
arguments or a VM image) and runs guest programs in it; `run_model` runs an ONNX model
or a code object in a fresh VM and reports device and virtual time. The names are
loaded on first use, so `virtaccel --help` does not import the whole stack.
"""
from __future__ import annotations

import importlib
from importlib import metadata
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .errors import (ImageError, LaunchError, ScenarioError, SessionStateError,
                         VirtaccelError)
    from .models import RunReport, run_model
    from .session import ATTACHMENTS, Session, SessionState, VmSpec

try:
    __version__ = metadata.version("virtaccel")
except metadata.PackageNotFoundError:  # a source tree that was never installed
    __version__ = "0+unknown"

_EXPORTS = {
    "ATTACHMENTS": "session", "Session": "session", "SessionState": "session",
    "VmSpec": "session", "RunReport": "models", "run_model": "models",
    "ImageError": "errors", "LaunchError": "errors",
    "ScenarioError": "errors", "SessionStateError": "errors", "VirtaccelError": "errors",
}

__all__ = sorted(_EXPORTS) + ["__version__"]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'virtaccel' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value
