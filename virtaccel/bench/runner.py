"""Running the cases, profiling the rows that miss, writing bench.json and bench.png."""
from __future__ import annotations

import os
import platform
import sys
import time
from typing import Any, Callable, Iterable

import numpy as np

from .cases import CASES, Sizes
from .figure import write_figure
from .profile import ProfileSet
from .rows import Row, to_json


def blas_info(threads: int | None = None) -> dict[str, Any]:
    """numpy's BLAS: library, version, threading layer and thread count (now, or as
    `threads` would set it; 0 and None: the library's default)."""
    from threadpoolctl import threadpool_info
    libs = [i for i in threadpool_info() if i.get("user_api") == "blas"]
    if not libs:
        return {"library": "none found", "version": "", "threading_layer": "",
                "threads": threads or 1}
    lib = libs[0]
    return {"library": str(lib.get("internal_api", "?")), "version": str(lib.get("version")),
            "threading_layer": str(lib.get("threading_layer", "")),
            "threads": int(threads) if threads else int(lib.get("num_threads", 1))}


def blas_line(info: dict[str, Any]) -> str:
    """One line for the table's header."""
    layer = f", {info['threading_layer']}" if info.get("threading_layer") else ""
    return (f"BLAS: {info['library']} {info['version']}{layer}; {info['threads']} "
            f"thread(s) for the stack and every baseline")


def run_bench(sizes: Sizes, only: Iterable[str] | None = None, profile: bool = True,
              on_step: Callable[[str], None] | None = None,
              on_start: Callable[[str], None] | None = None) -> list[Row]:
    """Run the selected cases (keys of CASES) with numpy's BLAS on `sizes.blas_threads`
    threads; a row that misses its target is run once more under cProfile and carries
    the top functions in `row.profile`."""
    from threadpoolctl import threadpool_limits
    if sizes.blas_threads:
        with threadpool_limits(limits=sizes.blas_threads, user_api="blas"):
            return _run_cases(sizes, only, profile, on_step, on_start)
    return _run_cases(sizes, only, profile, on_step, on_start)


def _run_cases(sizes: Sizes, only: Iterable[str] | None, profile: bool,
               on_step: Callable[[str], None] | None,
               on_start: Callable[[str], None] | None) -> list[Row]:
    keys = list(CASES) if only is None else [k for k in CASES if k in set(only)]
    rows: list[Row] = []
    for key in keys:
        case = CASES[key]
        if on_start is not None:
            on_start(key)
        got = case(sizes, None)
        case_rows = got if isinstance(got, list) else [got]
        if profile and any(not r.met and r.value is not None for r in case_rows):
            if on_start is not None:
                on_start(f"{key} (profile)")
            timing = ProfileSet(cprofile=False)  # phases without cProfile's overhead
            case(sizes, timing)
            prof = ProfileSet()
            case(sizes, prof)
            top = prof.top()
            top["phases"] = timing.phases.segments()
            for r in case_rows:
                if not r.met:
                    r.profile = top
        rows.extend(case_rows)
        if on_step is not None:
            on_step(key)
    return rows


def png_path_for(json_path: str) -> str:
    """bench.json -> bench.png, beside it."""
    root, _ = os.path.splitext(json_path)
    return root + ".png"


def write_outputs(rows: list[Row], json_path: str, meta: dict[str, object] | None = None
                  ) -> str | None:
    """Write the rows as JSON (`-`: stdout) and the ratio figure as PNG beside it; returns
    the PNG path (None for stdout)."""
    info: dict[str, object] = {
        "python": platform.python_version(), "numpy": np.__version__,
        "machine": platform.machine(), "cpus": os.cpu_count(),
        "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    info.update(meta or {})
    if json_path == "-":
        sys.stdout.write(to_json(rows, info) + "\n")
        return None
    with open(json_path, "w") as f:
        f.write(to_json(rows, info) + "\n")
    png = png_path_for(json_path)
    write_figure(png, rows)
    return png
