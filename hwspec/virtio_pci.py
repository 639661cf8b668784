"""virtio-pci modern transport numbers (virtio 1.x §4.1; linux/virtio_pci.h)."""
from __future__ import annotations

from .layout import Layout

MSI_NO_VECTOR = 0xFFFF
ISR_QUEUE = 0x1
ISR_CONFIG = 0x2

CAP_COMMON_CFG = 1
CAP_NOTIFY_CFG = 2
CAP_ISR_CFG = 3
CAP_DEVICE_CFG = 4
CAP_PCI_CFG = 5
CAP_SHARED_MEMORY_CFG = 8

# struct virtio_pci_cap (in PCI config space, a vendor-specific capability)
CAP = Layout("virtio_pci_cap", (
    ("cap_vndr", "B"), ("cap_next", "B"), ("cap_len", "B"), ("cfg_type", "B"),
    ("bar", "B"), ("id", "B"), ("padding", "H"), ("offset", "I"), ("length", "I")))
NOTIFY_CAP_MULT = 16          # notify_off_multiplier follows the cap: 20 bytes in all
NOTIFY_CAP_SIZE = 20
PCI_CFG_CAP_DATA = 16         # pci_cfg_data[4] follows the cap: 20 bytes in all
PCI_CFG_CAP_SIZE = 20

# struct virtio_pci_common_cfg (in a BAR)
COMMON_DFSELECT = 0
COMMON_DF = 4
COMMON_GFSELECT = 8
COMMON_GF = 12
COMMON_MSIX = 16
COMMON_NUMQ = 18
COMMON_STATUS = 20
COMMON_CFGGENERATION = 21
COMMON_Q_SELECT = 22
COMMON_Q_SIZE = 24
COMMON_Q_MSIX = 26
COMMON_Q_ENABLE = 28
COMMON_Q_NOFF = 30
COMMON_Q_DESCLO = 32
COMMON_Q_DESCHI = 36
COMMON_Q_AVAILLO = 40
COMMON_Q_AVAILHI = 44
COMMON_Q_USEDLO = 48
COMMON_Q_USEDHI = 52
COMMON_Q_NDATA = 56
COMMON_Q_RESET = 58
COMMON_CFG_SIZE = 60

# Field widths of the common config, for the strict device and the driver.
COMMON_FIELD_SIZE = {
    COMMON_DFSELECT: 4, COMMON_DF: 4, COMMON_GFSELECT: 4, COMMON_GF: 4,
    COMMON_MSIX: 2, COMMON_NUMQ: 2, COMMON_STATUS: 1, COMMON_CFGGENERATION: 1,
    COMMON_Q_SELECT: 2, COMMON_Q_SIZE: 2, COMMON_Q_MSIX: 2, COMMON_Q_ENABLE: 2,
    COMMON_Q_NOFF: 2, COMMON_Q_DESCLO: 4, COMMON_Q_DESCHI: 4, COMMON_Q_AVAILLO: 4,
    COMMON_Q_AVAILHI: 4, COMMON_Q_USEDLO: 4, COMMON_Q_USEDHI: 4, COMMON_Q_NDATA: 2,
    COMMON_Q_RESET: 2,
}

# PCI identity of modern virtio devices.
PCI_VENDOR_ID = 0x1AF4
PCI_DEVICE_ID_BASE = 0x1040
PCI_REVISION_MODERN = 1
