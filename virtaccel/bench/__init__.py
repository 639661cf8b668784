"""`virtaccel bench`: ratios of the stack's wall time against baselines measured in the
same run (numpy, np.copyto, a bare Python split ring). See docs/benchmarks.md."""
from __future__ import annotations

from .cases import CASES, Sizes
from .rows import Row, format_table, to_json, validate_json
from .runner import run_bench, write_outputs

__all__ = ["CASES", "Row", "Sizes", "format_table", "run_bench", "to_json", "validate_json",
           "write_outputs"]
