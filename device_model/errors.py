"""The root of device_model's exceptions (the hierarchy: docs/architecture.md, "Errors").

Every exception the hardware model defines derives from `DeviceModelError`. They are
the device's own verdicts (a bad command, a broken ring, a refused DMA, a refused admin
command); the device turns each into a status, a fault or NEEDS_RESET for the driver,
so none escapes to the platform except `DmaFault` from a DMA port, by contract.
"""
from __future__ import annotations


class DeviceModelError(Exception):
    """Root of every exception device_model defines."""


__all__ = ["DeviceModelError"]
