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
                  calibrate: str | None = None,
                  int8_min_cosine: float | None = None,
                  int8_scales: str | None = None) -> "CompileResult":
    """Compile an ONNX file; every way it can be unusable is a CliError naming the file
    (a missing file, not protobuf, not a graph the compiler takes, no onnx extra).
    `calibrate`: an .npz of calibration inputs; the graph is then quantized to int8,
    keeping layers in f32 down to `int8_min_cosine` (None: the compiler's default; 0:
    every layer it can in int8), with `int8_scales` "dynamic" or "static" (None: the
    compiler's default, dynamic)."""
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
            if int8_min_cosine is not None:
                options.int8_min_cosine = int8_min_cosine or None
            if int8_scales is not None:
                options.int8_scales = int8_scales
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


def _int8_rows(result: "CompileResult") -> list[tuple[str, object]]:
    """The mixed-precision part of the summary: how many layers are int8, which stayed
    f32 and why."""
    r = result.int8
    if r is None:
        return []
    rows: list[tuple[str, object]] = [
        ("int8 layers", f"{len(r.quantized)} int8, {len(r.kept_f32)} kept f32"),
        ("int8 activation scales", "dynamic (taken at run time)" if r.scales == "dynamic"
         else "static (calibrated)")]
    if r.min_cosine is not None:
        rows.append(("int8 worst feed cosine", f"{r.cosine:.6f} (fallback target "
                                               f"{r.min_cosine:g})"))
    rows += [("int8 kept f32", name) for name in r.kept_f32]
    return rows


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
    if args.int8_min_cosine is not None and not args.int8:
        raise CliError("--int8-min-cosine is for --int8 (add --int8 --calibrate IN.npz)")
    if args.int8_scales is not None and not args.int8:
        raise CliError("--int8-scales is for --int8 (add --int8 --calibrate IN.npz)")
    result = compile_model(args.model, target, args.calibrate, args.int8_min_cosine,
                           args.int8_scales)
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
        if result.int8 is not None:
            doc["int8_layers"] = {"int8": result.int8.quantized, "f32": result.int8.kept_f32,
                                  "min_cosine": result.int8.min_cosine,
                                  "worst_feed_cosine": result.int8.cosine,
                                  "scales": result.int8.scales}
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
        *_int8_rows(result),
    ])
    if args.json and args.json != "-":
        print(f"wrote {args.json}")
    return 0
