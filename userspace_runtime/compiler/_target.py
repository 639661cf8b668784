"""What the compiler targets: the device-config numbers lowering depends on."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from hwspec import isa, va1


@dataclass(frozen=True)
class Target:
    """Scratchpad (tiling bound), command-buffer limit, ISA version, dtypes and device
    memory (what the largest tensor and the code object must fit in) of a VA-1;
    defaults are the datasheet's (spec §5). `from_params(device.params)` reads a live
    device's config."""

    scratchpad_size: int = 1 << 20
    max_cmdbuf_size: int = 1 << 20
    isa_version: int = va1.ISA_VERSION
    dtype_mask: int = (1 << isa.DType.F32) | (1 << isa.DType.F16) | (1 << isa.DType.I8) \
        | (1 << isa.DType.I32)
    device_memory_size: int = va1.DEFAULT_DEVICE_MEMORY_SIZE

    def __post_init__(self) -> None:
        if self.scratchpad_size < 64:
            raise ValueError(f"scratchpad_size {self.scratchpad_size} is too small (< 64)")
        if not 0 <= self.device_memory_size <= va1.MAX_DEVICE_MEMORY_SIZE:
            raise ValueError(f"device_memory_size {self.device_memory_size} is outside 0 .. "
                             f"{va1.MAX_DEVICE_MEMORY_SIZE}")

    @classmethod
    def from_params(cls, params: Mapping[str, Any]) -> Target:
        """From `Device.params` (GET_PARAM names) or a Va1Config-like mapping."""
        base = cls()
        return cls(scratchpad_size=int(params.get("scratchpad_size", base.scratchpad_size)),
                   max_cmdbuf_size=int(params.get("max_cmdbuf_size", base.max_cmdbuf_size)),
                   isa_version=int(params.get("isa_version", base.isa_version)),
                   dtype_mask=int(params.get("dtype_mask", base.dtype_mask)),
                   device_memory_size=int(params.get("device_memory_size",
                                                     base.device_memory_size)))

    def supports(self, dtype: isa.DType) -> bool:
        return bool(self.dtype_mask >> int(dtype) & 1)
