"""The linux/vfio.h numbers and structs this VMM uses, with the kernel's exact values.

Why: the VFIO objects here are meant to be driven exactly as a VMM drives the kernel's
(same ioctl numbers, same flags, same struct layouts), so code written against them
reads like code written against /dev/vfio. tests/vmm/test_vfio_uapi.py checks every
number, size and offset against the installed header with a C compiler.

Struct layouts are a cffi cdef (ABI mode: cffi lays the structs out by the C rules, no
compiler needed). Allocate with `new("struct vfio_iommu_type1_dma_map *")`; structs
that end in a flexible array take the element count: `new("struct vfio_irq_set *",
{"data": 4})`. `argsz(cdata)` is the byte size to store in `.argsz`.

The ioctl encoding is the generic one of <asm-generic/ioctl.h> (x86, arm, riscv...):
nr in bits 0-7, type 8-15, size 16-29, direction 30-31. VFIO encodes none of its
ioctls with a size or direction: every one is _IO(VFIO_TYPE, VFIO_BASE + n).
"""
from __future__ import annotations

from typing import Any

import cffi

# -- <asm-generic/ioctl.h> ----------------------------------------------------------------
IOC_NRBITS = 8
IOC_TYPEBITS = 8
IOC_SIZEBITS = 14
IOC_DIRBITS = 2
IOC_NRSHIFT = 0
IOC_TYPESHIFT = IOC_NRSHIFT + IOC_NRBITS
IOC_SIZESHIFT = IOC_TYPESHIFT + IOC_TYPEBITS
IOC_DIRSHIFT = IOC_SIZESHIFT + IOC_SIZEBITS
IOC_NONE = 0
IOC_WRITE = 1
IOC_READ = 2


def _IOC(direction: int, type_: int, nr: int, size: int) -> int:
    if not (0 <= direction < 1 << IOC_DIRBITS and 0 <= type_ < 1 << IOC_TYPEBITS
            and 0 <= nr < 1 << IOC_NRBITS and 0 <= size < 1 << IOC_SIZEBITS):
        raise ValueError(f"ioctl field out of range: dir={direction} type={type_} nr={nr} size={size}")
    return (direction << IOC_DIRSHIFT | type_ << IOC_TYPESHIFT | nr << IOC_NRSHIFT
            | size << IOC_SIZESHIFT)


def _IO(type_: int, nr: int) -> int:
    return _IOC(IOC_NONE, type_, nr, 0)


def _IOR(type_: int, nr: int, size: int) -> int:
    """`size` is sizeof(the argument type) in bytes (the C macro takes the type)."""
    return _IOC(IOC_READ, type_, nr, size)


def _IOW(type_: int, nr: int, size: int) -> int:
    return _IOC(IOC_WRITE, type_, nr, size)


def _IOWR(type_: int, nr: int, size: int) -> int:
    return _IOC(IOC_READ | IOC_WRITE, type_, nr, size)


# -- API version, IOMMU types and extensions -----------------------------------------------
VFIO_API_VERSION = 0
VFIO_TYPE1_IOMMU = 1
VFIO_SPAPR_TCE_IOMMU = 2
VFIO_TYPE1v2_IOMMU = 3
VFIO_DMA_CC_IOMMU = 4
VFIO_EEH = 5
VFIO_TYPE1_NESTING_IOMMU = 6
VFIO_SPAPR_TCE_v2_IOMMU = 7
VFIO_NOIOMMU_IOMMU = 8
VFIO_UNMAP_ALL = 9
VFIO_UPDATE_VADDR = 10

VFIO_TYPE = ord(";")
VFIO_BASE = 100

# -- ioctls -------------------------------------------------------------------------------
VFIO_GET_API_VERSION = _IO(VFIO_TYPE, VFIO_BASE + 0)
VFIO_CHECK_EXTENSION = _IO(VFIO_TYPE, VFIO_BASE + 1)
VFIO_SET_IOMMU = _IO(VFIO_TYPE, VFIO_BASE + 2)
VFIO_GROUP_GET_STATUS = _IO(VFIO_TYPE, VFIO_BASE + 3)
VFIO_GROUP_SET_CONTAINER = _IO(VFIO_TYPE, VFIO_BASE + 4)
VFIO_GROUP_UNSET_CONTAINER = _IO(VFIO_TYPE, VFIO_BASE + 5)
VFIO_GROUP_GET_DEVICE_FD = _IO(VFIO_TYPE, VFIO_BASE + 6)
VFIO_DEVICE_GET_INFO = _IO(VFIO_TYPE, VFIO_BASE + 7)
VFIO_DEVICE_GET_REGION_INFO = _IO(VFIO_TYPE, VFIO_BASE + 8)
VFIO_DEVICE_GET_IRQ_INFO = _IO(VFIO_TYPE, VFIO_BASE + 9)
VFIO_DEVICE_SET_IRQS = _IO(VFIO_TYPE, VFIO_BASE + 10)
VFIO_DEVICE_RESET = _IO(VFIO_TYPE, VFIO_BASE + 11)
VFIO_IOMMU_GET_INFO = _IO(VFIO_TYPE, VFIO_BASE + 12)
VFIO_IOMMU_MAP_DMA = _IO(VFIO_TYPE, VFIO_BASE + 13)
VFIO_IOMMU_UNMAP_DMA = _IO(VFIO_TYPE, VFIO_BASE + 14)

# -- group status flags ---------------------------------------------------------------------
VFIO_GROUP_FLAGS_VIABLE = 1 << 0
VFIO_GROUP_FLAGS_CONTAINER_SET = 1 << 1

# -- device info flags ----------------------------------------------------------------------
VFIO_DEVICE_FLAGS_RESET = 1 << 0
VFIO_DEVICE_FLAGS_PCI = 1 << 1
VFIO_DEVICE_FLAGS_PLATFORM = 1 << 2
VFIO_DEVICE_FLAGS_AMBA = 1 << 3
VFIO_DEVICE_FLAGS_CCW = 1 << 4
VFIO_DEVICE_FLAGS_AP = 1 << 5
VFIO_DEVICE_FLAGS_FSL_MC = 1 << 6
VFIO_DEVICE_FLAGS_CAPS = 1 << 7
VFIO_DEVICE_API_PCI_STRING = "vfio-pci"

# -- regions --------------------------------------------------------------------------------
VFIO_REGION_INFO_FLAG_READ = 1 << 0
VFIO_REGION_INFO_FLAG_WRITE = 1 << 1
VFIO_REGION_INFO_FLAG_MMAP = 1 << 2
VFIO_REGION_INFO_FLAG_CAPS = 1 << 3
VFIO_REGION_INFO_CAP_SPARSE_MMAP = 1
VFIO_REGION_INFO_CAP_TYPE = 2
VFIO_REGION_INFO_CAP_MSIX_MAPPABLE = 3

VFIO_PCI_BAR0_REGION_INDEX = 0
VFIO_PCI_BAR1_REGION_INDEX = 1
VFIO_PCI_BAR2_REGION_INDEX = 2
VFIO_PCI_BAR3_REGION_INDEX = 3
VFIO_PCI_BAR4_REGION_INDEX = 4
VFIO_PCI_BAR5_REGION_INDEX = 5
VFIO_PCI_ROM_REGION_INDEX = 6
VFIO_PCI_CONFIG_REGION_INDEX = 7
VFIO_PCI_VGA_REGION_INDEX = 8
VFIO_PCI_NUM_REGIONS = 9

# -- IRQs -----------------------------------------------------------------------------------
VFIO_PCI_INTX_IRQ_INDEX = 0
VFIO_PCI_MSI_IRQ_INDEX = 1
VFIO_PCI_MSIX_IRQ_INDEX = 2
VFIO_PCI_ERR_IRQ_INDEX = 3
VFIO_PCI_REQ_IRQ_INDEX = 4
VFIO_PCI_NUM_IRQS = 5

VFIO_IRQ_INFO_EVENTFD = 1 << 0
VFIO_IRQ_INFO_MASKABLE = 1 << 1
VFIO_IRQ_INFO_AUTOMASKED = 1 << 2
VFIO_IRQ_INFO_NORESIZE = 1 << 3

VFIO_IRQ_SET_DATA_NONE = 1 << 0
VFIO_IRQ_SET_DATA_BOOL = 1 << 1
VFIO_IRQ_SET_DATA_EVENTFD = 1 << 2
VFIO_IRQ_SET_ACTION_MASK = 1 << 3
VFIO_IRQ_SET_ACTION_UNMASK = 1 << 4
VFIO_IRQ_SET_ACTION_TRIGGER = 1 << 5
VFIO_IRQ_SET_DATA_TYPE_MASK = VFIO_IRQ_SET_DATA_NONE | VFIO_IRQ_SET_DATA_BOOL | VFIO_IRQ_SET_DATA_EVENTFD
VFIO_IRQ_SET_ACTION_TYPE_MASK = (VFIO_IRQ_SET_ACTION_MASK | VFIO_IRQ_SET_ACTION_UNMASK
                                 | VFIO_IRQ_SET_ACTION_TRIGGER)

# -- TYPE1 IOMMU ----------------------------------------------------------------------------
VFIO_IOMMU_INFO_PGSIZES = 1 << 0
VFIO_IOMMU_INFO_CAPS = 1 << 1
VFIO_DMA_MAP_FLAG_READ = 1 << 0
VFIO_DMA_MAP_FLAG_WRITE = 1 << 1
VFIO_DMA_MAP_FLAG_VADDR = 1 << 2
VFIO_DMA_UNMAP_FLAG_GET_DIRTY_BITMAP = 1 << 0
VFIO_DMA_UNMAP_FLAG_ALL = 1 << 1
VFIO_DMA_UNMAP_FLAG_VADDR = 1 << 2

# -- struct layouts -------------------------------------------------------------------------
CDEF = """
struct vfio_info_cap_header {
    uint16_t id;
    uint16_t version;
    uint32_t next;
};
struct vfio_group_status {
    uint32_t argsz;
    uint32_t flags;
};
struct vfio_device_info {
    uint32_t argsz;
    uint32_t flags;
    uint32_t num_regions;
    uint32_t num_irqs;
    uint32_t cap_offset;
};
struct vfio_region_info {
    uint32_t argsz;
    uint32_t flags;
    uint32_t index;
    uint32_t cap_offset;
    uint64_t size;
    uint64_t offset;
};
struct vfio_region_sparse_mmap_area {
    uint64_t offset;
    uint64_t size;
};
struct vfio_region_info_cap_sparse_mmap {
    struct vfio_info_cap_header header;
    uint32_t nr_areas;
    uint32_t reserved;
    struct vfio_region_sparse_mmap_area areas[];
};
struct vfio_irq_info {
    uint32_t argsz;
    uint32_t flags;
    uint32_t index;
    uint32_t count;
};
struct vfio_irq_set {
    uint32_t argsz;
    uint32_t flags;
    uint32_t index;
    uint32_t start;
    uint32_t count;
    uint8_t data[];
};
struct vfio_iommu_type1_info {
    uint32_t argsz;
    uint32_t flags;
    uint64_t iova_pgsizes;
    uint32_t cap_offset;
};
struct vfio_iommu_type1_dma_map {
    uint32_t argsz;
    uint32_t flags;
    uint64_t vaddr;
    uint64_t iova;
    uint64_t size;
};
struct vfio_iommu_type1_dma_unmap {
    uint32_t argsz;
    uint32_t flags;
    uint64_t iova;
    uint64_t size;
    uint8_t data[];
};
"""

STRUCTS: tuple[str, ...] = (
    "vfio_info_cap_header", "vfio_group_status", "vfio_device_info", "vfio_region_info",
    "vfio_region_sparse_mmap_area", "vfio_region_info_cap_sparse_mmap", "vfio_irq_info",
    "vfio_irq_set", "vfio_iommu_type1_info", "vfio_iommu_type1_dma_map",
    "vfio_iommu_type1_dma_unmap",
)

ffi = cffi.FFI()
ffi.cdef(CDEF)

# A cffi cdata. Its fields are those of the C struct, known only at run time: the cffi
# stubs type cdata as an opaque object, so struct cdata is Any here.
CData = Any


def new(ctype: str, init: Any = None) -> CData:
    """ffi.new, with `argsz` set to the allocated size when the struct has one."""
    p: CData = ffi.new(ctype, init)
    t = ffi.typeof(p)
    if t.kind == "pointer" and t.item.kind == "struct" and any(n == "argsz" for n, _ in t.item.fields):
        p.argsz = ffi.sizeof(p[0])
    return p


def argsz(cdata: CData) -> int:
    """Bytes of the struct (with its flexible array) that a pointer cdata points to."""
    size: int = ffi.sizeof(cdata[0]) if ffi.typeof(cdata).kind == "pointer" else ffi.sizeof(cdata)
    return size


def offsetofend(struct: str, field: str) -> int:
    """The kernel's offsetofend(): how VFIO computes each ioctl's `minsz`."""
    t = ffi.typeof(f"struct {struct}")
    f = dict(t.fields)[field]
    end: int = f.offset + ffi.sizeof(f.type)
    return end


IOCTLS: tuple[str, ...] = (
    "VFIO_GET_API_VERSION", "VFIO_CHECK_EXTENSION", "VFIO_SET_IOMMU", "VFIO_GROUP_GET_STATUS",
    "VFIO_GROUP_SET_CONTAINER", "VFIO_GROUP_UNSET_CONTAINER", "VFIO_GROUP_GET_DEVICE_FD",
    "VFIO_DEVICE_GET_INFO", "VFIO_DEVICE_GET_REGION_INFO", "VFIO_DEVICE_GET_IRQ_INFO",
    "VFIO_DEVICE_SET_IRQS", "VFIO_DEVICE_RESET", "VFIO_IOMMU_GET_INFO", "VFIO_IOMMU_MAP_DMA",
    "VFIO_IOMMU_UNMAP_DMA",
)
IOCTL_NAMES: dict[int, str] = {globals()[n]: n for n in IOCTLS}  # number -> name, for messages
