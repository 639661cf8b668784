"""`virtaccel compile MODEL.onnx -o OUT.vaelf`: ONNX model -> VA-1 code object."""
from __future__ import annotations

import argparse
import json
import sys
from typing import Any


def cli(args: argparse.Namespace) -> int:
    from userspace_runtime.compiler import GraphError, Target
    try:
        from userspace_runtime.onnx_import import OnnxImportError, compile_onnx_file
    except ImportError as e:  # the onnx extra is not installed
        print(f"virtaccel compile: {e}", file=sys.stderr)
        return 2
    target = Target(scratchpad_size=args.scratchpad) if args.scratchpad else Target()
    try:
        result = compile_onnx_file(args.model, target=target)
        result.write(args.output)
    except (OSError, OnnxImportError, GraphError, ValueError) as e:
        print(f"virtaccel compile: {args.model}: {e}", file=sys.stderr)
        return 2
    print(json.dumps({"output": args.output, "bytes": len(result.code_object),
                      "commands": result.commands, "workspace_peak": result.workspace_bytes,
                      "const_bytes": result.const_bytes, "passes": result.passes}))
    return 0


def add_parser(sub: Any) -> None:
    p = sub.add_parser("compile", help="compile an ONNX model to a VA-1 code object")
    p.add_argument("model", help="an .onnx model")
    p.add_argument("-o", "--output", required=True, help="the .vaelf to write")
    p.add_argument("--scratchpad", type=int, default=None,
                   help="tile for this scratchpad size in bytes (default: the datasheet's)")
    p.set_defaults(func=cli)
