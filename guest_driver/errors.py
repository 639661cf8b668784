"""The root of guest_driver's exceptions (the hierarchy: docs/architecture.md, "Errors").

Every exception the guest kernel defines derives from `GuestDriverError`, and also from
the builtin its callers catch today (OSError for errno-style errors at the uAPI,
RuntimeError for an unusable device or ring, MemoryError for an exhausted allocator).
"""
from __future__ import annotations


class GuestDriverError(Exception):
    """Root of every exception guest_driver defines."""


__all__ = ["GuestDriverError"]
