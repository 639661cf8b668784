#!/usr/bin/env python3
"""Wall time of the submission phases of row b's MLP iteration (virtaccel bench).

Runs the row's loop (5 uploads from pinned arrays, 2 GEMM layers, download into a pinned
array, synchronize: one submission of 8 commands) in a VM on one BLAS thread, with the
numpy reference run between iterations as the row does, and marks phase boundaries with
`perf_counter` by wrapping these functions: the runtime's `Stream._submit_open`, the
driver's SUBMIT check, its doorbell write (`VirtioMmio.notify`), the device's `_drain_submitq` and `decode`, and the
first DMA_H2D's execution. Prints one JSON line of medians over the iterations, in µs:

- submit_kick: the runtime's submit to the driver's kick (runtime, SUBMIT ioctl, check);
- check: the driver's check of the command buffer (`cmdcheck`);
- drain_first: the device's drain of the submit queue to its first command executing;
- decode: the device's decode of the command buffer (`commands.decode`).

The wrappers cost about 1 µs a mark. It measures the tree it is run from: run it from
the repository root, and alternately from a checkout of the tree to compare against
(`git worktree add`, with that checkout on PYTHONPATH), since the machine's speed
changes:

    .venv/bin/python tools/mlp_phases.py [--iterations 80] [--no-reference]
    (cd ../before && PYTHONPATH=$PWD ../repo/.venv/bin/python ../repo/tools/mlp_phases.py)
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np
from threadpoolctl import threadpool_limits

sys.path[:0] = [str(Path.cwd())]   # the tree measured: the one it is run from

import device_model.va1.commands as commands  # noqa: E402
import device_model.va1.device as device  # noqa: E402
import guest_driver.va1.cmdcheck as cmdcheck  # noqa: E402
import guest_driver.va1.devfile as devfile  # noqa: E402
import guest_driver.virtio.mmio as mmio  # noqa: E402
import userspace_runtime as rt  # noqa: E402
import userspace_runtime._stream as stream  # noqa: E402
from hwspec.isa import Opcode  # noqa: E402
from virtaccel.bench.cases import run_in_vm  # noqa: E402
from virtaccel.guests import mlp as wl  # noqa: E402

BATCH, SIZES = 64, (512, 1024, 256)
MARKS: list[tuple[str, float]] = []


def _wrap(fn: Callable[..., Any], label: str) -> Callable[..., Any]:
    clock = time.perf_counter

    def marked(*a: Any, **k: Any) -> Any:
        MARKS.append((label + ">", clock()))
        try:
            return fn(*a, **k)
        finally:
            MARKS.append((label + "<", clock()))
    return marked


def _mark(obj: Any, name: str, label: str) -> None:
    setattr(obj, name, _wrap(getattr(obj, name), label))


def _install() -> None:
    spec = commands.OPS[Opcode.DMA_H2D]
    object.__setattr__(spec, "execute", _wrap(spec.execute, "h2d"))
    _mark(stream.Stream, "_submit_open", "submit")
    _mark(mmio.VirtioMmio, "notify", "kick")   # the driver's kick: the doorbell write
    if hasattr(cmdcheck, "CheckCache"):
        _mark(cmdcheck.CheckCache, "check", "check")
    else:  # a tree from before the check was kept per buffer
        _mark(devfile, "check_cmdbuf", "check")
    _mark(device.Va1Device, "_drain_submitq", "drain")
    _mark(device, "decode", "decode")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--iterations", type=int, default=80)
    ap.add_argument("--no-reference", action="store_true",
                    help="do not run the numpy reference between iterations")
    args = ap.parse_args()
    _install()
    inp = wl.make_inputs(0, BATCH, SIZES)

    def program(os_: Any) -> None:
        with rt.Device(os_) as dev:
            ctx = dev.create_context()
            bufs = wl.alloc_buffers(ctx, BATCH, SIZES)
            s = ctx.create_stream()
            host = wl.pin_inputs(dev, inp)
            y = dev.alloc_host((BATCH, SIZES[2]), np.float32)

            def once() -> None:
                for name in wl.WEIGHTS:
                    s.upload(bufs[name], host[name])
                wl.enqueue_layers(s, bufs)
                s.download(bufs["y"], out=y)
                s.synchronize()

            for _ in range(5):
                once()
            windows: dict[str, list[float]] = {"submit_kick": [], "check": [],
                                               "drain_first": [], "decode": []}
            for _ in range(args.iterations):
                if not args.no_reference:
                    wl.reference(inp["x"], inp["w1"], inp["b1"], inp["w2"], inp["b2"])
                MARKS.clear()
                once()
                t: dict[str, float] = {}
                for label, at in MARKS:
                    t.setdefault(label, at)
                windows["submit_kick"].append(t["kick>"] - t["submit>"])
                windows["check"].append(t["check<"] - t["check>"])
                windows["drain_first"].append(t["h2d>"] - t["drain>"])
                windows["decode"].append(t["decode<"] - t["decode>"])
            print(json.dumps({k: round(statistics.median(v) * 1e6, 1)
                              for k, v in windows.items()}))

    with threadpool_limits(1):
        run_in_vm(program)


if __name__ == "__main__":
    main()
