"""The root of vmm's exceptions (the hierarchy: docs/architecture.md, "Errors").

Every exception the host platform defines derives from `VmmError`, and also from the
builtin its callers catch today (ValueError for a refused request, RuntimeError for a
state the machine cannot continue from), so `except ValueError` keeps working.
"""
from __future__ import annotations


class VmmError(Exception):
    """Root of every exception vmm defines."""


__all__ = ["VmmError"]
