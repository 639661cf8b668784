#!/usr/bin/env python3
"""Measure the int8 bar on the CNN fixtures: cosine to f32 on random inputs.

For each fixture (tests/fixtures/models/) the model is compiled to int8 as
`virtaccel compile --int8` does by default, calibrated on the fixture input and seven
random inputs drawn like it (seeds 100..106), then run on N other random inputs
(seeds SEED0 .. SEED0+N-1) in numpy, whose int8 arithmetic is the device's. One JSON
line per model and configuration: layers kept f32, the min and median over the inputs of
the worst output's cosine to f32, how many inputs fall below 0.99 and the worst seed.
Run from the repository root:

    .venv/bin/python tools/int8_bar.py [--configs dynamic:0.998,static:0.995]
                                       [--inputs 50] [--seed0 5000] [--only NAME ...]
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from compiler import model_fixtures  # noqa: E402

from userspace_runtime.compiler import CompileOptions, compile_graph, run_reference  # noqa: E402
from userspace_runtime.onnx_import import import_model  # noqa: E402


def cosine(a: np.ndarray, b: np.ndarray) -> float:
    a, b = a.ravel().astype(np.float64), b.ravel().astype(np.float64)
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--configs", default="dynamic:0.998",
                    help="comma-separated SCALES:MIN_COSINE (default dynamic:0.998)")
    ap.add_argument("--inputs", type=int, default=50)
    ap.add_argument("--seed0", type=int, default=5000)
    ap.add_argument("--only", nargs="*", default=list(model_fixtures.CNNS))
    args = ap.parse_args()
    configs = [(c.split(":")[0], float(c.split(":")[1])) for c in args.configs.split(",")]
    for name in args.only:
        fx = model_fixtures.load(name)
        graph = import_model(str(fx.path))
        (inp, arr), = fx.inputs.items()

        def draw(seed: int) -> dict[str, np.ndarray]:
            return {inp: np.random.default_rng(seed).standard_normal(arr.shape)
                    .astype(arr.dtype)}

        cal = [fx.inputs, *(draw(100 + i) for i in range(7))]
        seeds = range(args.seed0, args.seed0 + args.inputs)
        feeds = [draw(s) for s in seeds]
        refs = [run_reference(graph, f) for f in feeds]
        for scales, mc in configs:
            t0 = time.time()
            res = compile_graph(graph, options=CompileOptions(
                calibration=cal, int8_scales=scales, int8_min_cosine=mc or None))
            assert res.int8 is not None
            cs = np.array([min(cosine(run_reference(res.graph, f)[o], v) for o, v in r.items())
                           for f, r in zip(feeds, refs)])
            print(json.dumps({
                "model": name, "scales": scales, "min_cosine": mc,
                "f32": len(res.int8.kept_f32),
                "layers": len(res.int8.kept_f32) + len(res.int8.quantized),
                "min": round(float(cs.min()), 5), "median": round(float(np.median(cs)), 5),
                "below_0.99": int((cs < 0.99).sum()), "worst_seed": seeds[int(np.argmin(cs))],
                "seconds": round(time.time() - t0)}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
