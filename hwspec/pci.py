"""PCI / PCIe configuration-space numbers (PCI Local Bus 3.0, PCIe base spec;
Linux include/uapi/linux/pci_regs.h)."""
from __future__ import annotations

CFG_SPACE_SIZE = 256
CFG_SPACE_EXP_SIZE = 4096
STD_HEADER_SIZEOF = 64

# Type-0 header.
VENDOR_ID = 0x00
DEVICE_ID = 0x02
COMMAND = 0x04
STATUS = 0x06
REVISION_ID = 0x08
CLASS_PROG = 0x09
CLASS_DEVICE = 0x0A
HEADER_TYPE = 0x0E
BASE_ADDRESS_0 = 0x10
NUM_BARS = 6
SUBSYSTEM_VENDOR_ID = 0x2C
SUBSYSTEM_ID = 0x2E
CAPABILITY_LIST = 0x34
INTERRUPT_LINE = 0x3C
INTERRUPT_PIN = 0x3D
# INTx pin numbering (PCI Local Bus 3.0 §6.2.4; include/linux/pci.h, not in uapi).
INTERRUPT_PIN_INTA = 1

COMMAND_IO = 0x1
COMMAND_MEMORY = 0x2
COMMAND_MASTER = 0x4
COMMAND_INTX_DISABLE = 0x400
STATUS_INTERRUPT = 0x08
STATUS_CAP_LIST = 0x10
HEADER_TYPE_NORMAL = 0
HEADER_TYPE_MULTI_FUNCTION = 0x80

BASE_ADDRESS_SPACE_IO = 0x01
BASE_ADDRESS_MEM_TYPE_MASK = 0x06
BASE_ADDRESS_MEM_TYPE_32 = 0x00
BASE_ADDRESS_MEM_TYPE_64 = 0x04
BASE_ADDRESS_MEM_PREFETCH = 0x08
BASE_ADDRESS_MEM_MASK = ~0x0F & 0xFFFFFFFF

# Class code of a processing accelerator (PCI code and ID assignment spec: 0x12).
CLASS_PROCESSING_ACCELERATOR = 0x12

# Capability list.
CAP_LIST_ID = 0
CAP_LIST_NEXT = 1
CAP_FLAGS = 2
CAP_ID_VNDR = 0x09
CAP_ID_EXP = 0x10
CAP_ID_MSIX = 0x11

# MSI-X capability.
MSIX_FLAGS = 2
MSIX_FLAGS_QSIZE = 0x07FF
MSIX_FLAGS_MASKALL = 0x4000
MSIX_FLAGS_ENABLE = 0x8000
MSIX_TABLE = 4
MSIX_TABLE_BIR = 0x7
MSIX_TABLE_OFFSET = 0xFFFFFFF8
MSIX_PBA = 8
MSIX_PBA_BIR = 0x7
MSIX_PBA_OFFSET = 0xFFFFFFF8
CAP_MSIX_SIZEOF = 12
MSIX_ENTRY_SIZE = 16
MSIX_ENTRY_LOWER_ADDR = 0x0
MSIX_ENTRY_UPPER_ADDR = 0x4
MSIX_ENTRY_DATA = 0x8
MSIX_ENTRY_VECTOR_CTRL = 0xC
MSIX_ENTRY_CTRL_MASKBIT = 0x1

# PCI Express capability (function level reset).
EXP_FLAGS = 0x02
EXP_FLAGS_VERS = 0x000F
EXP_FLAGS_TYPE = 0x00F0
EXP_DEVCAP = 0x04
EXP_DEVCTL = 0x08
EXP_DEVSTA = 0x0A
EXP_DEVCAP_FLR = 0x10000000
EXP_DEVCTL_PAYLOAD = 0x00E0
EXP_DEVCTL_BCR_FLR = 0x8000
EXP_TYPE_ENDPOINT = 0x0
CAP_EXP_ENDPOINT_SIZEOF_V2 = 0x32   # end of v2 endpoints with a link

# Extended capabilities (offset 0x100 onwards).
EXT_CAP_START = 0x100
EXT_CAP_ID_SRIOV = 0x10
EXT_CAP_SRIOV_SIZEOF = 0x40
SRIOV_CAP = 0x04
SRIOV_CTRL = 0x08
SRIOV_CTRL_VFE = 0x0001
SRIOV_CTRL_MSE = 0x0008
SRIOV_CTRL_ARI = 0x0010
SRIOV_STATUS = 0x0A
SRIOV_INITIAL_VF = 0x0C
SRIOV_TOTAL_VF = 0x0E
SRIOV_NUM_VF = 0x10
SRIOV_FUNC_LINK = 0x12
SRIOV_VF_OFFSET = 0x14
SRIOV_VF_STRIDE = 0x16
SRIOV_VF_DID = 0x1A
SRIOV_SUP_PGSIZE = 0x1C
SRIOV_SYS_PGSIZE = 0x20
SRIOV_BAR = 0x24


def ext_cap_header(cap_id: int, version: int, next_offset: int) -> int:
    return (cap_id & 0xFFFF) | ((version & 0xF) << 16) | ((next_offset & 0xFFC) << 20)


def ext_cap_id(header: int) -> int:
    """PCI_EXT_CAP_ID(header)."""
    return header & 0x0000FFFF


def ext_cap_ver(header: int) -> int:
    """PCI_EXT_CAP_VER(header)."""
    return (header >> 16) & 0xF


def ext_cap_next(header: int) -> int:
    """PCI_EXT_CAP_NEXT(header)."""
    return (header >> 20) & 0xFFC


# MSI messages on x86: a DWORD write into the interrupt window; data carries the vector.
MSI_ADDRESS_BASE = 0xFEE0_0000
MSI_ADDRESS_SIZE = 0x10_0000

# ECAM: config space of bus/device/function at base + (bus << 20 | dev << 15 | fn << 12).
ECAM_BUS_SHIFT = 20
ECAM_DEV_SHIFT = 15
ECAM_FN_SHIFT = 12


def ecam_offset(bus: int, dev: int, fn: int, reg: int = 0) -> int:
    return (bus << ECAM_BUS_SHIFT) | (dev << ECAM_DEV_SHIFT) | (fn << ECAM_FN_SHIFT) | reg
