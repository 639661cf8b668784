"""Per-function counters reported by GET_STATS (spec §6, va1_stats_resp)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Metrics:
    submissions: int = 0     # submit requests completed (any status)
    commands: int = 0        # commands executed
    device_time_ns: int = 0  # sum over submissions of end_ns - start_ns
    dma_bytes: int = 0       # bytes moved across the host link (H2D, D2H, SIGNAL, TIMESTAMP)
    faults: int = 0          # contexts marked faulted
    preemptions: int = 0     # runs that yielded their engine at a command boundary
    timeouts: int = 0        # commands stopped at the preemption timeout
    device_errors: int = 0   # commands failed DEVICE_ERROR (the device's own failure)

    def reset(self) -> None:
        self.submissions = self.commands = self.device_time_ns = 0
        self.dma_bytes = self.faults = 0
        self.preemptions = self.timeouts = self.device_errors = 0
