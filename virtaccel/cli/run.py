"""`virtaccel run MODEL(.vaelf|.onnx) --inputs IN.npz --out OUT.npz [--image VM_IMAGE]`.

Boots a VM with one VA-1 (emulated, virtio-mmio; or the attachment a VM image names)
through `virtaccel.models.run_model`, runs the code object's function on the inputs,
writes the outputs under the graph's output names and prints what the device spent
on each command, the virtual total and the wall time.
"""
from __future__ import annotations

import argparse
import os
import zipfile
from typing import TYPE_CHECKING, Any

from ._args import CliError, check_output

if TYPE_CHECKING:
    import numpy as np

NPY_MAGIC = b"\x93NUMPY"
ZIP_MAGIC = b"PK\x03\x04"


def read_code(path: str) -> bytes:
    """A code object's bytes: a .onnx file compiled, any other file read and checked."""
    from userspace_runtime.codeobject import CodeObjectError
    from userspace_runtime.module import Module

    from .compile import compile_model
    if path.endswith(".onnx"):
        return compile_model(path).code_object
    try:
        with open(path, "rb") as f:
            code = f.read()
    except OSError as e:
        raise CliError(f"{path}: {e.strerror or e}") from None
    try:
        Module.from_bytes(code, path)
    except CodeObjectError as e:
        raise CliError(f"{path}: not a VA-1 code object: {e}") from None
    return code


def read_inputs(path: str, flag: str = "--inputs") -> dict[str, "np.ndarray"]:
    """The arrays of an .npz by name; a .npy, a pickle or a broken archive is a CliError
    (naming `flag`) that says what an .npz is."""
    import numpy as np
    what = f"{flag} {path}"
    try:
        with open(path, "rb") as f:
            head = f.read(len(NPY_MAGIC))
    except OSError as e:
        raise CliError(f"{what}: {e.strerror or e}") from None
    if head.startswith(NPY_MAGIC):
        raise CliError(f"{what}: a .npy file (one unnamed array); {flag} takes an .npz "
                       "with one array per graph input (np.savez(path, x=...))")
    if not head.startswith(ZIP_MAGIC):
        raise CliError(f"{what}: not a valid .npz (an .npz is a zip archive of .npy arrays, "
                       "as np.savez writes)")
    try:
        with np.load(path, allow_pickle=False) as npz:
            return {k: npz[k] for k in npz.files}
    except (ValueError, OSError, EOFError, zipfile.BadZipFile, KeyError) as e:
        reason = "holds pickled objects" if "pickle" in str(e) else str(e)
        raise CliError(f"{what}: not a valid .npz ({reason})") from None


def cli(args: argparse.Namespace) -> int:
    from userspace_runtime import DriverError
    from userspace_runtime.module import Module

    from ..errors import ImageError
    from ..models import run_model
    from ._out import print_table, wants_json_on_stdout, write_json

    check_output(args.out, "--out")
    if args.trace is not None:
        check_output(args.trace, "--trace")
    if args.json is not None:
        check_output(args.json, "--json", allow_stdout=True)
    code = read_code(args.model)
    feeds = read_inputs(args.inputs)
    names = Module.from_bytes(code, args.model).function_names
    if args.function not in names:
        raise CliError(f"no function {args.function!r} in {args.model} "
                       f"(functions: {', '.join(names)})")
    try:
        outputs, report = run_model(code, feeds, seed=args.seed, image=args.image,
                                    function=args.function, trace=args.trace)
    except ImageError as e:
        raise CliError(str(e)) from None
    except (TypeError, ValueError, RuntimeError, DriverError) as e:  # from the guest
        raise CliError(f"the run failed: {type(e).__name__}: {e}") from None
    _write_npz(args.out, outputs)
    doc = {"model": args.model, "out": os.fspath(args.out),
           "outputs": {k: {"shape": list(v.shape), "dtype": str(v.dtype)}
                       for k, v in outputs.items()},
           **report.as_dict()}
    if args.trace is not None:
        doc["trace"] = args.trace
    if args.json is not None:
        write_json(args.json, doc)
    if wants_json_on_stdout(args.json):
        return 0
    print(f"virtaccel run: {args.model} ({args.function}) on "
          f"{args.image or 'one VA-1 over virtio-mmio'}, seed {report.seed}")
    rows = [(i, op, f"{ns / 1000:.3f}") for i, (op, ns) in enumerate(report.commands)]
    print_table(("#", "command", "device us"), rows, right=("#", "device us"),
                totals=[("", "total device", f"{report.device_ns / 1000:.3f}"),
                        ("", "virtual time", f"{report.virtual_ns / 1000:.3f}")])
    print_table(("output", "shape", "dtype"),
                [(k, "x".join(map(str, v.shape)) or "scalar", v.dtype)
                 for k, v in outputs.items()])
    print(f"wall time: {report.wall_s:.3f} s")
    print(f"trace digest: {report.digest}")
    print(f"wrote {args.out}" + "".join(f", {p}" for p in (args.trace, args.json)
                                         if p and p != "-"))
    return 0


def _write_npz(path: str, arrays: dict[str, Any]) -> None:
    """np.savez to exactly `path` (given a name, savez would append .npz)."""
    import numpy as np
    try:
        with open(path, "wb") as f:
            np.savez(f, **arrays)
    except OSError as e:
        raise CliError(f"--out {path}: {e.strerror or e}") from None
