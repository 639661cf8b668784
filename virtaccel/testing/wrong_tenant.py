"""A tenant program that lies about its results (tests that the host's check catches it)."""
from __future__ import annotations

from typing import Any

from ..guests.tenant import checked_gemm, verify


def main(os: Any, seed: int = 0, **kw: Any) -> dict[str, Any]:
    r = checked_gemm(os, seed, **kw)
    r["checksums"] = [c ^ 1 for c in r["checksums"]]
    return r


main.verify = verify  # type: ignore[attr-defined]
