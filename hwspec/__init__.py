"""The VA-1 datasheet as data: constants, register maps, struct layouts, opcodes.

No behaviour lives here. Both the device model and the guest driver import it, and
each implements its own side of every protocol from these numbers alone.
"""
