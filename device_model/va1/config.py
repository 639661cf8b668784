"""VA-1 device configuration (spec §5) and its 72-byte config-space image."""
from __future__ import annotations

import struct
from dataclasses import dataclass, fields

from hwspec import isa, va1

from ..errors import DeviceModelError
from ..virtio.ring_factory import RING_FEATURES
from ..virtio.status import TRANSPORT_FEATURES

_MIB = 1 << 20
_GIB = 1 << 30
_U32 = (1 << 32) - 1
_U64 = (1 << 64) - 1
ALL_DTYPES = sum(1 << d for d in isa.DType)
# Optional virtio features a function can be built to offer (spec §2, "Feature bits"),
# and those it offers unless configured otherwise (a device property, as QEMU's packed=,
# in_order=, notification_data=, queue_reset= are).
VIRTIO_OPTIONS = RING_FEATURES | TRANSPORT_FEATURES
DEFAULT_VIRTIO_FEATURES = 1 << 28 | 1 << 29          # RING_INDIRECT_DESC, RING_EVENT_IDX

# What a function can be configured with (spec §5, "Limits"): the register's width, and
# tighter where a bigger value is no device a host can model (memory is allocated, one
# engine per compute unit) or one the driver refuses (submit queues, command buffers).
LIMITS: dict[str, tuple[int, int, str]] = {
    "num_submit_queues": (1, 64, "the driver sets up at most 64 submit queues"),
    "num_compute_units": (1, 1024, "one modelled engine each"),
    "device_memory_size": (0, 16 * _GIB, "allocated in host memory"),
    "scratchpad_size": (64, _U32, "u32; the compiler tiles for at least 64 bytes"),
    "max_cmdbuf_size": (8, _U32, "u32; a command is at least 8 bytes"),
    "isa_version": (0, _U32, "u32"),
    "dtype_mask": (0, ALL_DTYPES, "bits of the dtypes the ISA has"),
    "peak_flops": (1, _U64, "u64, non-zero"),
    "mem_bandwidth": (1, _U64, "u64, non-zero"),
    "link_bandwidth": (1, _U64, "u64, non-zero"),
    "cmd_overhead_ns": (0, _U32, "u32"),
    "max_contexts": (1, 65536, "at least one context"),
    "max_call_depth": (0, 64, "CALL nesting the command processor recurses through"),
    "queue_size_max": (1, 32768, "a power of two (virtio split ring)"),
    "work_memory_size": (_MIB, 16 * _GIB, "host bytes of one command's temporaries; "
                         "numpy's own buffers and the smallest tiles need 1 MiB"),
    "max_command_flops": (1, _U64, "u64, non-zero"),
    "virtio_features": (0, VIRTIO_OPTIONS, "optional virtio feature bits the device "
                        "implements"),
}


class ConfigError(DeviceModelError, ValueError):
    """A Va1Config field outside its range; names the field, the value and the range."""

    def __init__(self, field: str, value: int, lo: int, hi: int, why: str,
                 problem: str | None = None) -> None:
        self.field, self.value, self.lo, self.hi = field, value, lo, hi
        self.problem = problem or f"{value} is outside {lo} .. {hi} ({why})"
        super().__init__(f"{field}: {self.problem}")


@dataclass(frozen=True)
class Va1Config:
    """One function's parameters; defaults are the datasheet's (spec §5)."""
    num_submit_queues: int = va1.DEFAULT_NUM_SUBMIT_QUEUES
    num_compute_units: int = 4
    device_memory_size: int = 256 * _MIB
    scratchpad_size: int = 1 * _MIB
    max_cmdbuf_size: int = 1 * _MIB
    isa_version: int = va1.ISA_VERSION
    dtype_mask: int = ALL_DTYPES  # F32, F16, I8, I32
    peak_flops: int = 50 * 10**12
    mem_bandwidth: int = 10**12
    link_bandwidth: int = 32 * 10**9
    cmd_overhead_ns: int = 500
    max_contexts: int = 64
    max_call_depth: int = 8
    queue_size_max: int = va1.DEFAULT_QUEUE_SIZE_MAX  # not in config space
    # The model's own bounds on one command (spec §7, "Work bounds"; not in config space):
    # host memory its kernel may allocate, and the flops it may ask for.
    work_memory_size: int = 32 * _MIB
    max_command_flops: int = 1 << 33
    # Optional virtio features offered (not in config space): ring layouts and options
    # (INDIRECT_DESC, EVENT_IDX, RING_PACKED, IN_ORDER) and transport ones
    # (NOTIFICATION_DATA, RING_RESET); VERSION_1, ACCESS_PLATFORM and the VA-1 bits are
    # always offered.
    virtio_features: int = DEFAULT_VIRTIO_FEATURES

    def __post_init__(self) -> None:
        """Every field checked here, so that nothing is built from a config the
        registers cannot hold or the host cannot model."""
        for f in fields(self):
            value = getattr(self, f.name)
            if not isinstance(value, int) or isinstance(value, bool):
                raise TypeError(f"Va1Config.{f.name} must be an int")
            lo, hi, why = LIMITS[f.name]
            if not lo <= value <= hi:
                raise ConfigError(f.name, value, lo, hi, why)
        extra = self.virtio_features & ~VIRTIO_OPTIONS
        if extra:
            raise ConfigError("virtio_features", self.virtio_features, 0, VIRTIO_OPTIONS, "",
                              f"{self.virtio_features:#x} has bits {extra:#x} that are not "
                              f"optional virtio features of VA-1 (mask {VIRTIO_OPTIONS:#x})")
        q = self.queue_size_max
        if q & (q - 1):
            raise ConfigError("queue_size_max", q, 1, 32768, "",
                              f"{q} is not a power of two (1 .. 32768)")

    def pack(self) -> bytes:
        """The config space image, laid out by hwspec.va1.CONFIG."""
        values = [0 if name == "reserved" else getattr(self, name) for name in va1.CONFIG.names]
        return struct.pack(va1.CONFIG.format, *values)
