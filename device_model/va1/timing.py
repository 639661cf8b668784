"""The VA-1 roofline (spec §7): every command costs overhead + max(compute, memory)."""
from __future__ import annotations


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def roofline_ns(overhead_ns: int, flops: int = 0, peak_flops: int = 1,
                nbytes: int = 0, bandwidth: int = 1) -> int:
    """`overhead + max(flops/peak, bytes/bandwidth)` in whole ns, rounded up, exactly
    (integer arithmetic: the same inputs give the same time on every host)."""
    compute = ceil_div(flops * 10**9, peak_flops) if flops else 0
    memory = ceil_div(nbytes * 10**9, bandwidth) if nbytes else 0
    return overhead_ns + max(compute, memory)
