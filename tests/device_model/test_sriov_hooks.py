"""The seam between the generic virtio-pci transport and an SR-IOV owner: a fake
`SriovHooks` is called at init (before the power-on image is sealed), for every BAR
decode decision, and after an FLR; without hooks the transport is a plain function."""
from __future__ import annotations

from dm_fakes import FakeClock, FakeDma, RecordingTracer
from dm_pci_driver import RecordingMsi

from device_model import DevicePorts, Va1Config, Va1Device, VirtioPciFunction
from device_model.pci.config import ConfigSpace
from device_model.pci.sriov import make_vf_header
from device_model.virtio.pci import SriovHooks
from hwspec import pci as P
from hwspec import va1

_SCRATCH = 0x100      # an extended-config dword no capability uses


class FakeHooks:
    def __init__(self, decode: bool = True) -> None:
        self.calls: list[str] = []
        self.decode = decode
        self.commands: list[int] = []

    def init_config(self, config: ConfigSpace) -> None:
        self.calls.append("init_config")
        config.put(_SCRATCH, 4, 0xC0FFEE)

    def memory_enabled(self, command: int) -> bool:
        self.commands.append(command)
        return self.decode

    def after_flr(self) -> None:
        self.calls.append("after_flr")


def _fn(hooks: SriovHooks | None) -> VirtioPciFunction:
    dev = Va1Device(Va1Config(), DevicePorts(FakeDma(), FakeClock(), RecordingTracer()))
    return VirtioPciFunction(dev, RecordingMsi(), tracer=RecordingTracer(), sriov_hooks=hooks)


def test_hooks_shape_the_power_on_image_once() -> None:
    hooks = FakeHooks()
    fn = _fn(hooks)
    assert hooks.calls == ["init_config"]
    assert fn.config_read(_SCRATCH, 4) == 0xC0FFEE
    fn.config.put(_SCRATCH, 4, 0)
    fn.function_level_reset()
    assert fn.config_read(_SCRATCH, 4) == 0xC0FFEE      # sealed with the hooks' change
    assert hooks.calls == ["init_config", "after_flr"]


def test_hooks_decide_bar_decoding_from_the_command_register() -> None:
    hooks = FakeHooks(decode=False)
    fn = _fn(hooks)
    fn.config_write(P.COMMAND, 2, P.COMMAND_MEMORY | P.COMMAND_MASTER)
    assert fn.bar_read(va1.PCI_BAR, 0, 4) == 0xFFFF_FFFF
    assert fn.violations[-1].rule == "pci/memory-disabled"
    assert hooks.commands == [P.COMMAND_MEMORY | P.COMMAND_MASTER]
    hooks.decode = True
    fn.config_write(P.COMMAND, 2, 0)
    n = len(fn.violations)
    fn.bar_read(va1.PCI_BAR, 0, 4)
    assert len(fn.violations) == n and hooks.commands[-1] == 0


def test_without_hooks_the_command_register_decides() -> None:
    fn = _fn(None)
    assert fn.bar_read(va1.PCI_BAR, 0, 4) == 0xFFFF_FFFF
    fn.config_write(P.COMMAND, 2, P.COMMAND_MEMORY)
    n = len(fn.violations)
    fn.bar_read(va1.PCI_BAR, 0, 4)
    assert len(fn.violations) == n


def test_vf_header_hides_identity_and_bars() -> None:
    fn = _fn(None)
    make_vf_header(fn.config)
    assert fn.config_read(P.VENDOR_ID, 2) == 0xFFFF and fn.config_read(P.DEVICE_ID, 2) == 0xFFFF
    fn.config_write(P.BASE_ADDRESS_0, 4, 0xFFFF_FFFF)
    assert fn.config_read(P.BASE_ADDRESS_0, 4) == 0
    fn.config_write(P.COMMAND, 2, 0xFFFF)
    assert fn.config_read(P.COMMAND, 2) == P.COMMAND_MASTER
    assert fn.bars()[0].size == va1.PCI_BAR_SIZE      # still reported to the host


def test_the_transport_knows_nothing_of_sr_iov() -> None:
    import pathlib
    import re

    import device_model.virtio as virtio
    root = pathlib.Path(virtio.__file__).parent
    text = "\n".join(p.read_text() for p in sorted(root.glob("*.py")))
    text = text.replace("SriovHooks", "").replace("sriov_hooks", "")
    assert not re.search(r"sriov|\bcard\b|\bvf_|\bVFs?\b|\bPF\b|va1\.card", text, re.I)
