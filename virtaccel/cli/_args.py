"""Argument types shared by the `virtaccel` subcommands."""
from __future__ import annotations

import argparse


def seed(text: str) -> int:
    """A `--seed` value: an integer literal (any base `int(text, 0)` takes) in 0 .. 2**64-1."""
    try:
        value = int(text, 0)
    except ValueError:
        raise argparse.ArgumentTypeError(f"seed {text!r} is not an integer") from None
    if not 0 <= value < 1 << 64:
        raise argparse.ArgumentTypeError(f"seed {value} is outside 0 .. 2**64-1")
    return value
