"""The one exception of hwspec: a value does not fit a datasheet layout."""
from __future__ import annotations


class HwspecError(ValueError):
    """Root of hwspec's exceptions. Raised when packing or unpacking a layout's values
    (`va1.VfResources.encode` / `decode`): a field out of its width, a buffer shorter
    than the layout. A ValueError, as struct's own errors are for callers."""


__all__ = ["HwspecError"]
