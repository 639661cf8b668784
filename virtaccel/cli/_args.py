"""Argument types and checks shared by the `virtaccel` verbs.

Kept free of numpy and of the stack so that building the parser stays cheap.
"""
from __future__ import annotations

import argparse
import os
from typing import Callable

from ..errors import VirtaccelError

SEED_MAX = (1 << 64) - 1


class CliError(VirtaccelError):
    """A mistake of the user's: `main` prints `virtaccel <verb>: <message>` and exits 2."""


def _bound(n: int) -> str:
    """2**64-1 rather than 18446744073709551615 in a message."""
    for bits in (64, 32):
        if n == (1 << bits) - 1:
            return f"2**{bits}-1"
    return str(n)


def integer(what: str, lo: int, hi: int) -> Callable[[str], int]:
    """An argparse type: an integer literal (decimal, 0x hex, 0o, 0b) in lo .. hi.
    argparse prefixes its messages with `argument <flag>:`."""
    def parse(text: str) -> int:
        try:
            value = int(text.strip(), 0)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if not lo <= value <= hi:
            raise argparse.ArgumentTypeError(f"{value} is outside {_bound(lo)} .. {_bound(hi)}")
        return value
    parse.__name__ = what  # argparse names the type in some messages
    return parse


def fraction(what: str) -> Callable[[str], float]:
    """An argparse type: a finite decimal number in 0 .. 1."""
    def parse(text: str) -> float:
        try:
            value = float(text.strip())
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        if not 0.0 <= value <= 1.0:   # NaN fails this too
            raise argparse.ArgumentTypeError(f"{text.strip()} is outside 0 .. 1")
        return value
    parse.__name__ = what
    return parse


seed = integer("seed", 0, SEED_MAX)
"""Every verb's `--seed`: 0 .. 2**64-1, decimal or hex, one message for one mistake."""


def check_output(path: str, flag: str, *, allow_stdout: bool = False) -> None:
    """Refuse an output path that cannot be written, before any work is done: `-` (when
    stdout is allowed) is fine; a directory, a missing parent directory or one without
    write permission is a CliError naming the flag."""
    if allow_stdout and path == "-":
        return
    if not path:
        raise CliError(f"{flag}: empty path")
    if os.path.isdir(path):
        raise CliError(f"{flag} {path}: is a directory")
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        raise CliError(f"{flag} {path}: directory {parent} does not exist")
    if os.path.exists(path):
        if not os.access(path, os.W_OK):
            raise CliError(f"{flag} {path}: not writable")
    elif not os.access(parent, os.W_OK | os.X_OK):
        raise CliError(f"{flag} {path}: directory {parent} is not writable")
