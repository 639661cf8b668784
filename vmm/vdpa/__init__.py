"""vDPA-style assignment: a vp_vdpa-like parent on a VA-1 function (parent), the host's
vdpa bus (bus), the "vdpa" generic netlink family (netlink), /dev/vhost-vdpa-N files
(vhost) and the VMM frontend that shows a guest a plain virtio device (frontend), with
the numbers of linux/vhost.h and linux/vdpa.h (uapi). docs/vdpa.md."""
from .bus import MgmtDev, VdpaBus, VdpaDevice
from .errors import VdpaError, VhostError
from .vhost import VhostVdpaFile, iotlb_msg

__all__ = ["MgmtDev", "VdpaBus", "VdpaDevice", "VdpaError", "VhostError", "VhostVdpaFile",
           "iotlb_msg"]
