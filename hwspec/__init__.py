"""The VA-1 datasheet as data: constants, register maps, struct layouts, opcodes.

No behaviour lives here beyond packing values into layouts (with range checks: a value
that does not fit raises `HwspecError`, the one exception of this package). Both the
device model and the guest driver import it, and each implements its own side of every
protocol from these numbers alone.
"""
from .errors import HwspecError

__all__ = ["HwspecError"]
