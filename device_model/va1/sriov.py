"""The VA-1 card's SR-IOV hooks (`device_model.virtio.pci.SriovHooks`) for its PF and VFs.

The generic virtio-pci transport calls these at the points where an SR-IOV function
differs from a plain one; everything the card knows about SR-IOV (the capability,
VF Enable, VF memory decoding, scrubbing a VF's memory at FLR) stays on this side.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from hwspec import pci as P
from hwspec import va1

from ..pci.config import ConfigSpace
from ..pci.sriov import SriovCap, make_vf_header

if TYPE_CHECKING:  # pragma: no cover
    from .card import Va1Card


class PfHooks:
    """The PF: it carries the SR-IOV extended capability, whose VF Enable makes the
    card create or drop its VFs, and whose reset at FLR drops them."""

    def __init__(self, card: "Va1Card") -> None:
        self.card = card
        self.cap: SriovCap | None = None

    def init_config(self, config: ConfigSpace) -> None:
        self.cap = SriovCap(config, self.card.total_vfs, va1.SRIOV_VF_DEVICE_ID,
                            va1.PCI_BAR_SIZE, va1.SRIOV_FIRST_VF_OFFSET,
                            va1.SRIOV_VF_STRIDE, self.card.enable_vfs, self.card.disable_vfs,
                            config.log)

    def memory_enabled(self, command: int) -> bool:
        return bool(command & P.COMMAND_MEMORY)

    def after_flr(self) -> None:
        if self.cap is not None:
            self.cap.reset()          # a PF FLR clears VF Enable: the VFs go away


class VfHooks:
    """VF `number` of the card: a VF header, memory decoding by the PF's VF MSE, and
    its partition scrubbed at FLR (the next tenant sees zeros)."""

    def __init__(self, card: "Va1Card", number: int) -> None:
        self.card = card
        self.number = number

    def init_config(self, config: ConfigSpace) -> None:
        make_vf_header(config)

    def memory_enabled(self, command: int) -> bool:
        return self.card.vf_mse

    def after_flr(self) -> None:
        self.card.vf_flr(self.number)
