"""vDPA errors: errno-style, as the kernel's vhost-vdpa and vdpa netlink answer."""
from __future__ import annotations

from ..errors import VmmError


class VhostError(VmmError, OSError):
    """A vhost-vdpa ioctl, IOTLB message or open refused: OSError(errno, message) naming
    the request and what was wrong. Nothing changed."""


class VdpaError(VmmError, OSError):
    """A vdpa management request refused (the netlink error's errno and extack text;
    also raised by the in-process bus API with the same errno). Nothing changed."""


def vhost_error(code: int, message: str) -> VhostError:
    return VhostError(code, message)


def vdpa_error(code: int, message: str) -> VdpaError:
    return VdpaError(code, message)


__all__ = ["VhostError", "VdpaError", "vhost_error", "vdpa_error"]
