"""Vm.attach_va1_pci: an emulated VA-1 virtio-pci function on the VM's PCI bus."""
from __future__ import annotations

from device_model import VirtioPciFunction
from hwspec import pci as P
from hwspec import va1
from vmm.dma import GuestDma
from vmm.msi import RequesterMsiPort
from vmm.machine import Machine
from vmm.vm import Vm


def test_attach_va1_pci_puts_the_function_at_00_01_0_with_trapped_bar() -> None:
    m = Machine(2, keep_trace=True)
    vm = Vm(m, "vm0", ram_size=8 << 20)
    acc = vm.attach_va1_pci()
    try:
        assert acc.slot.address == "00:01.0"
        assert isinstance(acc.function, VirtioPciFunction)
        assert isinstance(acc.function.msi, RequesterMsiPort) and acc.function.msi.domain is vm.irqchip.msi
        assert isinstance(acc.device.dma, GuestDma)
        (bridge,) = vm.kernel.pci_hosts
        ecam = bridge.ecam_base + P.ecam_offset(0, 1, 0)
        assert vm.mmio.read(ecam + P.VENDOR_ID, 2) == va1.PCI_VENDOR_ID
        assert vm.mmio.read(ecam + P.DEVICE_ID, 2) == va1.PCI_DEVICE_ID
        assert vm.mmio.read(bridge.ecam_base + P.ecam_offset(0, 2, 0), 4) == 0xFFFF_FFFF
        lo = vm.mmio.read(ecam + P.BASE_ADDRESS_0, 4)
        bar = (lo & ~0xF) | vm.mmio.read(ecam + P.BASE_ADDRESS_0 + 4, 4) << 32
        assert bar % va1.PCI_BAR_SIZE == 0 and bridge.mem_base <= bar < bridge.mem_base + bridge.mem_size
        assert not vm.mmio.read(ecam + P.COMMAND, 2) & P.COMMAND_MEMORY
        assert vm.bus.find(bar, 4) is None
        vm.mmio.write(ecam + P.COMMAND, 2, P.COMMAND_MEMORY | P.COMMAND_MASTER)
        region = vm.bus.find(bar + va1.PCI_NOTIFY_OFFSET, 2)
        assert region is not None and not region.direct  # emulated: every access is an exit
        exits = vm.mmio.exits
        vm.mmio.read(bar + va1.PCI_COMMON_CFG_OFFSET, 4)
        assert vm.mmio.exits == exits + 1
        second = vm.attach_va1_pci()
        assert second.slot.address == "00:02.0"
    finally:
        vm.close()
