"""`virtaccel compile MODEL.onnx -o OUT.vaelf`: ONNX model -> VA-1 code object."""
from __future__ import annotations

import argparse
import os
from typing import TYPE_CHECKING

from ._args import CliError, check_output

if TYPE_CHECKING:
    from userspace_runtime.compiler import CompileResult, Target


def compile_model(path: str, target: "Target | None" = None) -> "CompileResult":
    """Compile an ONNX file; every way it can be unusable is a CliError naming the file
    (a missing file, not protobuf, not a graph the compiler takes, no onnx extra)."""
    from userspace_runtime.compiler import GraphError
    try:
        from google.protobuf.message import DecodeError  # type: ignore[import-untyped]

        from userspace_runtime.onnx_import import OnnxImportError, compile_onnx_file
    except ImportError as e:
        raise CliError(f"{path}: ONNX support is not installed ({e}); "
                       "pip install 'virtaccel[onnx]'") from None
    if not os.path.isfile(path):
        raise CliError(f"{path}: no such file" if not os.path.exists(path)
                       else f"{path}: not a file")
    if os.path.getsize(path) == 0:
        raise CliError(f"{path}: empty file, not an ONNX model")
    try:
        return compile_onnx_file(path, target=target)
    except DecodeError as e:
        raise CliError(f"{path}: not an ONNX model (protobuf: {e})") from None
    except (OnnxImportError, GraphError) as e:
        raise CliError(f"{path}: {e}") from None
    except OSError as e:
        raise CliError(f"{path}: {e.strerror or e}") from None
    except ValueError as e:  # onnx's own checks of a decodable but broken model
        raise CliError(f"{path}: not a valid ONNX model: {e}") from None


def cli(args: argparse.Namespace) -> int:
    from userspace_runtime.compiler import Target

    from ._out import print_table, wants_json_on_stdout, write_json
    check_output(args.output, "--output")
    if args.json is not None:
        check_output(args.json, "--json", allow_stdout=True)
    try:
        target = Target(scratchpad_size=args.scratchpad) if args.scratchpad else Target()
    except ValueError as e:
        raise CliError(f"--scratchpad {args.scratchpad}: {e}") from None
    result = compile_model(args.model, target)
    try:
        result.write(args.output)
    except OSError as e:
        raise CliError(f"--output {args.output}: {e.strerror or e}") from None
    doc = {"model": args.model, "output": args.output, "bytes": len(result.code_object),
           "commands": result.commands, "workspace_peak": result.workspace_bytes,
           "const_bytes": result.const_bytes, "scratchpad": target.scratchpad_size,
           "passes": result.passes}
    if args.json is not None:
        write_json(args.json, doc)
    if wants_json_on_stdout(args.json):
        return 0
    print(f"virtaccel compile: {args.model} -> {args.output} ({len(result.code_object)} bytes)")
    print_table(("what", "value"), [
        ("commands", result.commands),
        ("workspace peak", f"{result.workspace_bytes} bytes"),
        ("constants", f"{result.const_bytes} bytes"),
        ("scratchpad", f"{target.scratchpad_size} bytes"),
        *((f"pass {name}", n) for name, n in result.passes.items()),
    ])
    if args.json and args.json != "-":
        print(f"wrote {args.json}")
    return 0
