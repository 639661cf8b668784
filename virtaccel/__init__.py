"""virtaccel: the product layer over the VA-1 stack.

    from virtaccel import Session, run_model

`Session` builds a machine with its host, VMs and accelerator attachments (from keyword
arguments or a VM image) and runs guest programs in it; `run_model` runs an ONNX model
or a code object in a fresh VM and reports device and virtual time. The names are
loaded on first use, so `virtaccel --help` does not import the whole stack.
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:   # `X as X`: explicit re-exports for type checkers
    __version__: str
    from vmm.faults import FaultEntry as FaultEntry
    from vmm.faults import FaultPlan as FaultPlan
    from vmm.faults import FaultPlanError as FaultPlanError

    from .errors import ImageError as ImageError
    from .errors import LaunchError as LaunchError
    from .errors import ScenarioError as ScenarioError
    from .errors import SessionStateError as SessionStateError
    from .errors import VirtaccelError as VirtaccelError
    from .models import RunReport as RunReport
    from .models import run_model as run_model
    from .session import ATTACHMENTS as ATTACHMENTS
    from .session import Session as Session
    from .session import SessionState as SessionState
    from .session import VmSpec as VmSpec

_EXPORTS = {
    "ATTACHMENTS": "session", "Session": "session", "SessionState": "session",
    "VmSpec": "session", "RunReport": "models", "run_model": "models",
    "ImageError": "errors", "LaunchError": "errors",
    "ScenarioError": "errors", "SessionStateError": "errors", "VirtaccelError": "errors",
    "FaultEntry": "faults", "FaultPlan": "faults", "FaultPlanError": "faults",
}

__all__ = sorted(_EXPORTS) + ["__version__"]


def _version() -> str:
    """The installed distribution's version; importlib.metadata costs ~25 ms of import,
    so it is read on first use of `__version__`, not at `import virtaccel`."""
    from importlib import metadata
    try:
        return metadata.version("virtaccel")
    except metadata.PackageNotFoundError:  # a source tree that was never installed
        return "0+unknown"


def __getattr__(name: str) -> Any:
    if name == "__version__":
        value = globals()["__version__"] = _version()
        return value
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'virtaccel' has no attribute {name!r}")
    source = "vmm.faults" if module == "faults" else f"{__name__}.{module}"
    value = getattr(importlib.import_module(source), name)
    globals()[name] = value
    return value
