"""VA-1 device configuration (spec §5) and its 72-byte config-space image."""
from __future__ import annotations

import struct
from dataclasses import dataclass, fields

from hwspec import isa, va1

_MIB = 1 << 20


@dataclass(frozen=True)
class Va1Config:
    """One function's parameters; defaults are the datasheet's (spec §5)."""
    num_submit_queues: int = va1.DEFAULT_NUM_SUBMIT_QUEUES
    num_compute_units: int = 4
    device_memory_size: int = 256 * _MIB
    scratchpad_size: int = 1 * _MIB
    max_cmdbuf_size: int = 1 * _MIB
    isa_version: int = va1.ISA_VERSION
    dtype_mask: int = sum(1 << d for d in isa.DType)  # F32, F16, I8, I32
    peak_flops: int = 50 * 10**12
    mem_bandwidth: int = 10**12
    link_bandwidth: int = 32 * 10**9
    cmd_overhead_ns: int = 500
    max_contexts: int = 64
    max_call_depth: int = 8
    queue_size_max: int = va1.DEFAULT_QUEUE_SIZE_MAX  # not in config space

    def __post_init__(self) -> None:
        for f in fields(self):
            if not isinstance(getattr(self, f.name), int):
                raise TypeError(f"Va1Config.{f.name} must be an int")
        if self.num_submit_queues < 1 or self.num_compute_units < 1:
            raise ValueError("need at least one submit queue and one compute unit")
        if min(self.peak_flops, self.mem_bandwidth, self.link_bandwidth) <= 0:
            raise ValueError("performance-model numbers must be positive")
        q = self.queue_size_max
        if q < 1 or q & (q - 1) or q > 32768:
            raise ValueError("queue_size_max must be a power of two <= 32768")
        if self.device_memory_size < 0 or self.max_contexts < 0:
            raise ValueError("sizes must not be negative")

    def pack(self) -> bytes:
        """The config space image, laid out by hwspec.va1.CONFIG."""
        values = [0 if name == "reserved" else getattr(self, name) for name in va1.CONFIG.names]
        return struct.pack(va1.CONFIG.format, *values)
