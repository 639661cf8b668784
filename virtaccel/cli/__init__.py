"""`virtaccel`: the command line.

Conventions every verb keeps (README, "Commands"):
- human tables on stdout; `--json FILE` writes the verb's machine-readable result to
  FILE (`-`: to stdout, instead of the tables);
- a mistake of the user's is one line on stderr, `virtaccel <verb>: <what was wrong>`,
  and exit status 2, checked before any work starts where it can be;
- Ctrl-C is `virtaccel: interrupted` and 130; a closed stdout (`| head`) ends quietly;
  any other exception is one line and status 1 (VIRTACCEL_DEBUG=1 shows the traceback).

The parser is built from argparse and `_args` alone; a verb's module (and numpy, the
stack, rich, matplotlib) is imported only when that verb runs, so `virtaccel --help`
starts fast.
"""
from __future__ import annotations

import argparse
import importlib
import os
import sys
from typing import Sequence

from ._args import CliError

__all__ = ["CliError", "main", "build_parser"]

DEBUG_ENV = "VIRTACCEL_DEBUG"


def build_parser() -> argparse.ArgumentParser:
    from ._parser import build_parser as build
    return build()


def _run_verb(argv: Sequence[str] | None) -> int:
    from ._parser import ParseExit
    from ._parser import build_parser as build
    try:
        args = build().parse_args(argv)
    except ParseExit as e:
        return e.code
    verb: str = args.verb
    module_name, _, func_name = args.handler.partition(":")
    try:
        func = getattr(importlib.import_module(module_name, __name__), func_name)
        code: int = func(args)
    except CliError as e:
        _say(f"{verb}: {e}")
        return 2
    except BrokenPipeError:
        raise  # main's: the reader went away, not a fault of the verb
    except Exception as e:  # the guard: one line, not a traceback
        if os.environ.get(DEBUG_ENV):
            raise
        first = str(e).splitlines()[0] if str(e) else ""
        _say(f"{verb}: internal error: {type(e).__name__}: {first} "
             f"(set {DEBUG_ENV}=1 for the traceback)")
        return 1
    return code


def _say(line: str) -> None:
    sys.stdout.flush()
    print(line.splitlines()[0] if line else line, file=sys.stderr)


def main(argv: Sequence[str] | None = None) -> int:
    """Run `virtaccel` with `argv` (default sys.argv[1:]); the exit status."""
    try:
        code = _run_verb(argv)
        sys.stdout.flush()
        return code
    except KeyboardInterrupt:
        print("virtaccel: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # The reader went away (`| head`). The Python docs' recipe: point stdout at
        # devnull so that the flush at exit does not raise again on the dead pipe.
        try:
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
            os.close(devnull)
        except (OSError, ValueError):  # stdout without a descriptor (captured)
            pass
        return 1


if __name__ == "__main__":
    sys.exit(main())
