"""`virtaccel compile MODEL.onnx -o OUT.vaelf [--int8 --calibrate IN.npz]`: ONNX model ->
VA-1 code object, optionally quantized to int8 from calibration inputs, with the int8
error against f32 in the summary."""
from __future__ import annotations

import argparse
import os
from typing import TYPE_CHECKING

from ._args import CliError, check_output

if TYPE_CHECKING:
    import numpy as np

    from userspace_runtime.compiler import CompileResult, Graph, Target


def compile_model(path: str, target: "Target | None" = None,
                  calibrate: str | None = None) -> "CompileResult":
    """Compile an ONNX file; every way it can be unusable is a CliError naming the file
    (a missing file, not protobuf, not a graph the compiler takes, no onnx extra).
    `calibrate`: an .npz of calibration inputs; the graph is then quantized to int8."""
    from userspace_runtime.compiler import CompileOptions, GraphError, compile_graph
    try:
        from google.protobuf.message import DecodeError  # type: ignore[import-untyped]

        from userspace_runtime.onnx_import import OnnxImportError, import_model
    except ImportError as e:
        raise CliError(f"{path}: ONNX support is not installed ({e}); "
                       "pip install 'virtaccel[onnx]'") from None
    if not os.path.isfile(path):
        raise CliError(f"{path}: no such file" if not os.path.exists(path)
                       else f"{path}: not a file")
    if os.path.getsize(path) == 0:
        raise CliError(f"{path}: empty file, not an ONNX model")
    try:
        graph = import_model(path)
        options = None
        if calibrate is not None:
            options = CompileOptions(calibration=calibration_feeds(calibrate, graph))
        return compile_graph(graph, target, options)
    except DecodeError as e:
        raise CliError(f"{path}: not an ONNX model (protobuf: {e})") from None
    except (OnnxImportError, GraphError) as e:
        raise CliError(f"{path}: {e}") from None
    except OSError as e:
        raise CliError(f"{path}: {e.strerror or e}") from None
    except ValueError as e:  # onnx's own checks of a decodable but broken model
        raise CliError(f"{path}: not a valid ONNX model: {e}") from None


def calibration_feeds(path: str, graph: "Graph") -> "list[dict[str, np.ndarray]]":
    """The feeds of an .npz of calibration inputs: one array per graph input, of the
    input's shape (one feed) or with one more leading axis (that many feeds, the same
    count for every input). Anything else is a CliError naming the array."""
    import numpy as np

    from .run import read_inputs
    arrays = read_inputs(path, "--calibrate")
    what = f"--calibrate {path}"
    names = [v.name for v in graph.inputs]
    missing = [n for n in names if n not in arrays]
    if missing:
        raise CliError(f"{what}: no array for graph input(s) {', '.join(missing)} "
                       f"(it has {', '.join(sorted(arrays)) or 'none'})")
    extra = sorted(set(arrays) - set(names))
    if extra:
        raise CliError(f"{what}: array(s) {', '.join(extra)} name no graph input "
                       f"(inputs: {', '.join(names)})")
    counts: dict[str, int] = {}
    for v in graph.inputs:
        a = arrays[v.name]
        if a.dtype.kind not in "fiub":
            raise CliError(f"{what}: array {v.name!r} is {a.dtype}, not numbers")
        if tuple(a.shape) == tuple(v.shape):
            arrays[v.name] = a[None]
        elif tuple(a.shape[1:]) != tuple(v.shape) or a.shape[0] == 0:
            raise CliError(f"{what}: array {v.name!r} has shape {list(a.shape)}; graph "
                           f"input {v.name!r} takes {list(v.shape)} (one feed) or [N, "
                           f"{', '.join(map(str, v.shape))}] (N >= 1 feeds)")
        counts[v.name] = arrays[v.name].shape[0]
    if len(set(counts.values())) > 1:
        raise CliError(f"{what}: inputs have different numbers of feeds "
                       f"({', '.join(f'{k}: {c}' for k, c in counts.items())})")
    n = next(iter(counts.values()), 0)
    for v in graph.inputs:
        a = arrays[v.name]
        if a.dtype.kind == "f" and not np.all(np.isfinite(a)):
            raise CliError(f"{what}: array {v.name!r} has NaN or infinite values")
    return [{k: arrays[k][i] for k in names} for i in range(n)]


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
    if args.int8 and args.calibrate is None:
        raise CliError("--int8 needs --calibrate IN.npz (calibration inputs, one array per "
                       "graph input)")
    if args.calibrate is not None and not args.int8:
        raise CliError("--calibrate is for --int8 (add --int8 to quantize)")
    result = compile_model(args.model, target, args.calibrate)
    try:
        result.write(args.output)
    except OSError as e:
        raise CliError(f"--output {args.output}: {e.strerror or e}") from None
    doc = {"model": args.model, "output": args.output, "bytes": len(result.code_object),
           "commands": result.commands, "workspace_peak": result.workspace_bytes,
           "const_bytes": result.const_bytes, "scratchpad": target.scratchpad_size,
           "passes": result.passes, "int8": bool(args.int8)}
    if args.int8:
        doc["int8_error"] = {q.output: {"cosine": q.cosine, "max_rel_err": q.max_rel_err}
                             for q in result.quantization}
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
        *((f"int8 vs f32 {q.output}", f"cosine {q.cosine:.6f}, max rel err "
           f"{q.max_rel_err:.4g}") for q in result.quantization),
    ])
    if args.json and args.json != "-":
        print(f"wrote {args.json}")
    return 0
