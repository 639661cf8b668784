"""VA-1 device identity, feature bits, device config, queues and request layouts.

See docs/spec.md for the prose rules behind each number.
"""
from __future__ import annotations

import struct
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from enum import IntEnum

from .errors import HwspecError
from .layout import Layout

# Identity. Virtio device type 60 is not assigned by OASIS; VA-1 uses it.
VIRTIO_DEVICE_ID = 60
MMIO_VENDOR_ID = 0x312D4156  # "VA-1", little-endian ASCII
PCI_VENDOR_ID = 0x1AF4       # virtio PCI vendor
PCI_DEVICE_ID = 0x1040 + VIRTIO_DEVICE_ID
# Subsystem ids of the virtio-pci function (virtio 1.x §4.1.2: a non-transitional
# device's subsystem device id SHOULD be >= 0x40). 0x4156 is "VA" in ASCII.
PCI_SUBSYSTEM_VENDOR_ID = 0x1AF4
PCI_SUBSYSTEM_ID = 0x4156

# Device-specific feature bits (0-23).
F_FP16 = 0
F_INT8 = 1
F_TIMESTAMP = 2
F_CROSS_QUEUE_FENCE = 3
F_PERF_COUNTERS = 4

# Queue indices.
CONTROLQ = 0
EVENTQ = 1
FIRST_SUBMITQ = 2

# Default device parameters (a device instance may be configured otherwise).
DEFAULT_QUEUE_SIZE_MAX = 256
DEFAULT_NUM_SUBMIT_QUEUES = 2
DEFAULT_DEVICE_MEMORY_SIZE = 256 << 20   # spec §5: device_memory_size default
MAX_DEVICE_MEMORY_SIZE = 16 << 30        # spec §5: device_memory_size range 0 .. 16 GiB

# Device configuration space (offset 0 = transport's device-config window).
CONFIG = Layout("va1_config", (
    ("num_submit_queues", "I"),
    ("num_compute_units", "I"),
    ("device_memory_size", "Q"),
    ("scratchpad_size", "I"),
    ("max_cmdbuf_size", "I"),
    ("isa_version", "I"),
    ("dtype_mask", "I"),
    ("peak_flops", "Q"),          # f32 FLOP/s; f16 runs at twice this
    ("mem_bandwidth", "Q"),       # device memory, bytes/s
    ("link_bandwidth", "Q"),      # host DMA through the link, bytes/s
    ("cmd_overhead_ns", "I"),
    ("max_contexts", "I"),
    ("max_call_depth", "I"),
    ("reserved", "I"),
))

ISA_VERSION = 0x00010000  # 1.0


class Status(IntEnum):
    """Completion status written by the device (submit, control, event)."""
    OK = 0
    ABORTED = 1           # reset while in flight
    BAD_OPCODE = 2
    TRUNCATED = 3         # command extends past the end of the buffer
    BAD_LENGTH = 4        # header length not a multiple of 8, < 8, or wrong for opcode
    OUT_OF_BOUNDS = 5     # device address range outside the function's memory
    BAD_DTYPE = 6
    BAD_SHAPE = 7         # zero or overflowing dimension / size
    DMA_FAULT = 8         # host IOVA not backed by guest memory (or not mapped)
    CONTEXT_FAULTED = 9
    BAD_CONTEXT = 10      # no such context
    BAD_REQUEST = 11      # malformed request (chain shape, sizes, reserved fields)
    CMDBUF_TOO_LARGE = 12
    BAD_ARG = 13          # invalid enum value or flag
    NO_RESOURCES = 14
    CALL_DEPTH = 15       # CALL nesting deeper than max_call_depth
    TIMEOUT = 16          # a command ran past the function's preemption timeout
    STOPPED = 17          # the function was stopped by its PF while this was queued
    DEVICE_ERROR = 18     # the device failed internally carrying out this command
    WORK_LIMIT = 19       # a command over the work or working-memory bound (spec §7)


NO_OFFSET = 0xFFFFFFFF  # error_offset when the error is not tied to a command

# --- controlq -------------------------------------------------------------------


class CtrlType(IntEnum):
    CONTEXT_CREATE = 1
    CONTEXT_DESTROY = 2
    GET_STATS = 3
    CONTEXT_MAP = 4
    CONTEXT_UNMAP = 5


CTRL_REQ = Layout("va1_ctrl_req", (
    ("type", "I"),
    ("context_id", "I"),
    ("flags", "I"),
    ("reserved", "I"),
))
CTRL_RESP = Layout("va1_ctrl_resp", (
    ("status", "I"),
    ("context_id", "I"),
))
STATS_RESP = Layout("va1_stats_resp", (
    ("status", "I"),
    ("reserved", "I"),
    ("submissions", "Q"),
    ("commands", "Q"),
    ("device_time_ns", "Q"),
    ("dma_bytes", "Q"),
    ("faults", "Q"),
))

# --- submit queues ---------------------------------------------------------------

SUBMIT_REQ = Layout("va1_submit_req", (
    ("context_id", "I"),
    ("flags", "I"),
    ("cmdbuf_addr", "Q"),   # IOVA of the command buffer in guest memory
    ("cmdbuf_len", "I"),
    ("reserved", "I"),
    ("fence_seq", "Q"),
))
SUBMIT_RESP = Layout("va1_submit_resp", (
    ("status", "I"),
    ("error_offset", "I"),
    ("fence_seq", "Q"),
    ("start_ns", "Q"),
    ("end_ns", "Q"),
))

# --- eventq -----------------------------------------------------------------------


class EventType(IntEnum):
    CONTEXT_FAULT = 1


EVENT = Layout("va1_event", (
    ("type", "I"),
    ("context_id", "I"),
    ("fence_seq", "Q"),
    ("status", "I"),
    ("error_offset", "I"),
))

# --- virtio-pci function layout (spec "virtio-pci transport") ----------------------
# One 64-bit memory BAR holds every virtio structure and the MSI-X table and PBA, each
# on its own 4 KiB page, so a VMM can trap the MSI-X table page and map the rest.
PCI_BAR = 0
PCI_BAR_SIZE = 0x8000
PCI_COMMON_CFG_OFFSET = 0x0000
PCI_ISR_OFFSET = 0x1000
PCI_DEVICE_CFG_OFFSET = 0x2000
PCI_NOTIFY_OFFSET = 0x3000
PCI_MSIX_TABLE_OFFSET = 0x4000
PCI_MSIX_PBA_OFFSET = 0x5000
PCI_NOTIFY_OFF_MULTIPLIER = 4   # queue_notify_off = queue index


# --- SR-IOV and the admin virtqueue (PF only) ----------------------------------------
# A VA-1 card is one PCIe PF with up to TOTAL_VFS virtual functions. Each VF is a VA-1
# function of its own (same virtio device id) with a partition of the card's device
# memory, its own queues and contexts, and a share of the compute units.

DEFAULT_TOTAL_VFS = 64
SRIOV_FIRST_VF_OFFSET = 1
SRIOV_VF_STRIDE = 1
SRIOV_VF_DEVICE_ID = PCI_DEVICE_ID
DEFAULT_CARD_MEMORY = 8 << 30         # device memory of the whole card
DEFAULT_PF_MEMORY = 256 << 20         # kept by the PF; the rest is the VF pool
PARTITION_ALIGN = 1 << 20             # VF memory quotas are multiples of 1 MiB


class AdminOp(IntEnum):
    """VA-1 admin commands (SR-IOV group, member = VF number 1..NumVFs). Opcodes sit
    well above the generic ones; LIST_QUERY's bitmap therefore spans 33 le64 words."""
    VF_RESOURCES_SET = 0x0800
    VF_RESOURCES_GET = 0x0801
    VF_STOP = 0x0802
    VF_RESUME = 0x0803
    VF_STATS = 0x0804
    VF_RESET = 0x0805


VF_RESOURCES = Layout("va1_vf_resources", (
    ("device_memory", "Q"),        # bytes, multiple of PARTITION_ALIGN
    ("num_submit_queues", "I"),
    ("max_contexts", "I"),
    ("weight", "I"),               # WFQ weight across functions, >= 1
    ("priority", "I"),             # 0 normal, 1 high, 2 realtime: higher runs first
    ("exec_quantum_ns", "Q"),      # device time a function may run before yielding
    ("preemption_timeout_ns", "Q"),  # a command running longer faults its context
))
VF_STATS = Layout("va1_vf_stats", (
    ("submissions", "Q"),
    ("commands", "Q"),
    ("device_time_ns", "Q"),
    ("dma_bytes", "Q"),
    ("faults", "Q"),
    ("preemptions", "Q"),
    ("timeouts", "Q"),
))

# --- Context address spaces (controlq) ------------------------------------------------
# Every context has its own device address space: a command of a context reaches only
# ranges mapped into it (CONTEXT_MAP), each naming a range of the function's memory.

CTX_MAP_REQ = Layout("va1_ctx_map_req", (
    ("type", "I"),                 # CtrlType.CONTEXT_MAP / CONTEXT_UNMAP
    ("context_id", "I"),
    ("flags", "I"),                # CTX_MAP_READ | CTX_MAP_WRITE (MAP); 0 (UNMAP)
    ("reserved", "I"),
    ("va", "Q"),                   # context device address, PARTITION-page aligned
    ("pa", "Q"),                   # function device address (MAP only)
    ("size", "Q"),
))
CTX_PAGE = 4096
CTX_MAP_READ = 1
CTX_MAP_WRITE = 2

# CONTEXT_CREATE flags (va1_ctrl_req.flags).
CTX_CREATE_FLAT = 1    # the context sees the whole function memory at VA = PA
CTX_CREATE_FLAGS_ALL = CTX_CREATE_FLAT

# Scheduling defaults of a function (spec "Scheduling"); the admin queue sets a VF's.
DEFAULT_VF_NUM_SUBMIT_QUEUES = 2
DEFAULT_VF_MAX_CONTEXTS = 16
DEFAULT_WEIGHT = 1
DEFAULT_PRIORITY = 0
MAX_PRIORITY = 2
DEFAULT_EXEC_QUANTUM_NS = 100_000            # 100 us
DEFAULT_PREEMPTION_TIMEOUT_NS = 1_000_000_000  # 1 s of device time per command
MAX_SUBMIT_QUEUES_PER_FUNCTION = 16
# What a provisioning request asks for when it names no device memory (VF Enable itself
# gives every VF an equal share of the pool; this is only the request's default).
DEFAULT_VF_DEVICE_MEMORY = 64 << 20


@dataclass(frozen=True)
class VfResources:
    """va1_vf_resources (`VF_RESOURCES`) as values: what the PF provisions for one VF
    through the admin queue (VF_RESOURCES_SET / GET). Fields in layout order.

    Only packing lives here: `encode` checks each field against its width, `decode`
    the length. The rules on values (device_memory a non-zero multiple of
    PARTITION_ALIGN, weight >= 1, ...) are the datasheet's, checked by the device and,
    first, by the driver, each its own way."""
    device_memory: int = DEFAULT_VF_DEVICE_MEMORY   # bytes, multiple of PARTITION_ALIGN
    num_submit_queues: int = DEFAULT_VF_NUM_SUBMIT_QUEUES
    max_contexts: int = DEFAULT_VF_MAX_CONTEXTS
    weight: int = DEFAULT_WEIGHT                   # WFQ weight across functions, >= 1
    priority: int = DEFAULT_PRIORITY               # 0 normal, 1 high, 2 realtime
    exec_quantum_ns: int = DEFAULT_EXEC_QUANTUM_NS
    preemption_timeout_ns: int = DEFAULT_PREEMPTION_TIMEOUT_NS

    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls))

    @classmethod
    def field_limits(cls) -> dict[str, int]:
        """The largest value each field's width holds ({name: 2**bits - 1})."""
        return {name: (1 << 8 * struct.calcsize("<" + code)) - 1
                for name, code in VF_RESOURCES.fields}

    def as_dict(self) -> dict[str, int]:
        return asdict(self)

    @classmethod
    def from_mapping(cls, values: "VfResources | Mapping[str, int] | object") -> "VfResources":
        """From a mapping (keys other than the field names are ignored) or any object
        with the field names as attributes; missing fields take their defaults."""
        if isinstance(values, cls):
            return values
        names = cls.field_names()
        if isinstance(values, Mapping):
            return cls(**{k: int(v) for k, v in values.items() if k in names})
        return cls(**{k: int(getattr(values, k)) for k in names if hasattr(values, k)})

    def encode(self) -> bytes:
        """The va1_vf_resources bytes; HwspecError naming a field that does not fit."""
        limits = self.field_limits()
        values = []
        for name in VF_RESOURCES.names:
            v = getattr(self, name)
            if not isinstance(v, int) or not 0 <= v <= limits[name]:
                raise HwspecError(f"va1_vf_resources.{name}={v!r} is not an integer in "
                                  f"0..{limits[name]:#x}")
            values.append(v)
        return struct.pack(VF_RESOURCES.format, *values)

    @classmethod
    def decode(cls, data: bytes) -> "VfResources":
        """From va1_vf_resources bytes (extra bytes ignored); HwspecError when short."""
        if len(data) < VF_RESOURCES.size:
            raise HwspecError(f"va1_vf_resources needs {VF_RESOURCES.size} bytes, "
                              f"got {len(data)}")
        return cls(*struct.unpack_from(VF_RESOURCES.format, data))


assert VfResources.field_names() == VF_RESOURCES.names, "VfResources drifted from VF_RESOURCES"
