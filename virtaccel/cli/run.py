"""`virtaccel run MODEL(.vaelf|.onnx) --inputs IN.npz --out OUT.npz [--image VM_IMAGE]`.

Boots a VM with one VA-1 (emulated, virtio-mmio; or the attachment a VM image names),
loads the code object in the guest with the runtime's Module loader, runs its `main`
function and writes the outputs under the graph's output names.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any, Callable, Mapping

import numpy as np


from ..models import load_code as _load_code
from ..models import run_module_in_vm


def cli(args: argparse.Namespace) -> int:
    from userspace_runtime.codeobject import CodeObjectError
    from userspace_runtime.module import Module
    try:
        code = _load_code(args.model)
        module = Module.from_bytes(code, args.model)
    except (OSError, CodeObjectError, ValueError, ImportError) as e:
        print(f"virtaccel run: {e}", file=sys.stderr)
        return 2
    try:
        with np.load(args.inputs, allow_pickle=False) as npz:
            feeds = {k: npz[k] for k in npz.files}
    except (OSError, ValueError) as e:
        print(f"virtaccel run: cannot read inputs {args.inputs}: {e}", file=sys.stderr)
        return 2
    fn = module.code.function(args.function) if args.function in module.function_names \
        else None
    if fn is None:
        print(f"virtaccel run: no function {args.function!r} in {args.model} "
              f"(functions: {', '.join(module.function_names)})", file=sys.stderr)
        return 2
    try:
        outputs = run_module_in_vm(code, feeds, seed=args.seed, function=args.function,
                                   image=args.image)
    except (TypeError, ValueError, RuntimeError) as e:   # ImageError, ModuleError, DeviceError
        print(f"virtaccel run: {e}", file=sys.stderr)
        return 2
    arrays: dict[str, Any] = dict(outputs)
    np.savez(args.out, **arrays)
    print(json.dumps({"outputs": {k: list(v.shape) for k, v in outputs.items()},
                      "out": os.fspath(args.out)}))
    return 0


def add_parser(sub: Any) -> None:
    p = sub.add_parser("run", help="run a code object (.vaelf) or an ONNX model in a VM")
    p.add_argument("model", help="a .vaelf code object or a .onnx model (compiled first)")
    p.add_argument("--inputs", required=True, help=".npz with one array per graph input")
    p.add_argument("--out", required=True, help=".npz to write the outputs to")
    p.add_argument("--image", default=None, help="VM image to boot (default: one emulated "
                                                  "VA-1 over virtio-mmio)")
    p.add_argument("--function", default="main", help="entry point (default main)")
    p.add_argument("--seed", type=lambda s: int(s, 0), default=0, help="machine seed")
    p.set_defaults(func=cli)
