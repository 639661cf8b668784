"""virtaccel: the product layer over the VA-1 stack (launcher, images, CLI, suites)."""
from __future__ import annotations

from .errors import (GuestProgramError, ImageError, LaunchError, ScenarioError,
                     SessionStateError, VirtaccelError)
from .session import ATTACHMENTS, Session, SessionState, VmSpec

__all__ = ["ATTACHMENTS", "GuestProgramError", "ImageError", "LaunchError", "ScenarioError",
           "Session", "SessionState", "SessionStateError", "VirtaccelError", "VmSpec"]
