"""The VMM side of VFIO passthrough, with a small fake function: what the guest sees
(config, BARs at its firmware's addresses), what costs an exit (only the MSI-X table),
irqfd MSI routing with the guest's mask bits, and DMA confined to guest RAM."""
from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
from test_pci_fakes import (BAR0_SIZE, DOORBELL, MSIX_CAP, PBA, TABLE,  # noqa: E402
                            FakeHostRig, fake_factory)

from hwspec import pci as P  # noqa: E402
from vmm.host import Host  # noqa: E402
from vmm.machine import Machine  # noqa: E402
from vmm.vm import PassthroughVa1, Vm  # noqa: E402

SEED = 9


class Rig(FakeHostRig):
    def __init__(self) -> None:
        super().__init__(SEED, bus=3)
        self.vm = Vm(self.machine, "vm0", ram_size=16 << 20)
        self.pt: PassthroughVa1 = self.vm.attach_va1_passthrough(self.host, self.hf)
        self.ecam = self.vm.kernel.pci_hosts[0].ecam_base

    def cfg(self, reg: int, size: int) -> int:
        return self.vm.mmio.read(self.ecam + P.ecam_offset(0, 1, 0, reg), size)

    def wcfg(self, reg: int, size: int, value: int) -> None:
        self.vm.mmio.write(self.ecam + P.ecam_offset(0, 1, 0, reg), size, value)

    def bar0(self) -> int:
        return (self.cfg(P.BASE_ADDRESS_0, 4) & ~0xF) | self.cfg(P.BASE_ADDRESS_0 + 4, 4) << 32

    def enable(self) -> int:
        self.wcfg(P.COMMAND, 2, P.COMMAND_MEMORY | P.COMMAND_MASTER)
        return self.bar0()

    def events(self, kind: str) -> list:  # type: ignore[type-arg]
        return [e for e in self.machine.trace.events if e.kind == kind]


@pytest.fixture
def rig():  # type: ignore[no-untyped-def]
    r = Rig()
    yield r
    r.vm.close()


def test_guest_sees_the_function_at_its_firmware_addresses(rig: Rig) -> None:
    assert rig.pt.slot.address == "00:01.0"
    assert rig.cfg(P.VENDOR_ID, 4) == 0x105A_1AF4
    guest_bar0 = rig.bar0()
    host_bar0 = rig.fake.config_read(P.BASE_ADDRESS_0, 4) & ~0xF | rig.fake.config_read(P.BASE_ADDRESS_0 + 4, 4) << 32
    assert guest_bar0 != host_bar0  # the host's own address stays the host's
    assert guest_bar0 % BAR0_SIZE == 0 and guest_bar0 >= rig.vm.pci.mem_base
    assert host_bar0 != 0 and rig.hf.slot.function is rig.fake
    assert rig.host.iommu.domain_of(rig.hf.requester_id) is rig.pt.container.domain
    assert rig.pt.container.domain is not None and rig.pt.container.domain.mapped_bytes() == 16 << 20


def test_bar_pages_are_direct_but_the_msix_pages_trap(rig: Rig) -> None:
    bar = rig.enable()
    for off, direct in ((0, True), (DOORBELL, True), (TABLE, False), (PBA, False)):
        region = rig.vm.bus.find(bar + off, 4)
        assert region is not None and region.direct is direct, hex(off)
    n0 = len(rig.events("mmio_write"))
    rig.vm.mmio.write(bar + 0x20, 4, 0x1234)           # scratch register
    rig.vm.mmio.write(bar + DOORBELL, 8, 0x2000)        # doorbell
    rig.vm.mmio.write(bar + TABLE + 8, 4, 0x41)         # MSI-X table entry 0 data
    writes = rig.events("mmio_write")[n0:]
    assert [w.get("exit") for w in writes] == [False, False, True]
    assert rig.fake.scratch0[0x20] == 0x34 and rig.fake.doorbells == [0x2000]
    assert rig.pt.endpoint.table[8] == 0x41            # emulated, the physical table untouched
    assert rig.fake.table[8] != 0x41


def setup_msix(rig: Rig, hits: list[int]) -> tuple[int, int]:
    bar = rig.enable()
    msg = rig.vm.irqchip.alloc_msi(lambda: hits.append(rig.machine.now_ns()), "fake-q0")
    rig.vm.mmio.write(bar + TABLE, 4, msg.address & 0xFFFF_FFFF)
    rig.vm.mmio.write(bar + TABLE + 4, 4, msg.address >> 32)
    rig.vm.mmio.write(bar + TABLE + 8, 4, msg.data)
    rig.vm.mmio.write(bar + TABLE + 12, 4, 0)
    rig.wcfg(MSIX_CAP + 2, 2, P.MSIX_FLAGS_ENABLE)
    return bar, msg.data


def test_device_msi_reaches_the_guest_through_eventfd_and_irqfd(rig: Rig) -> None:
    hits: list[int] = []
    bar, vector = setup_msix(rig, hits)
    assert rig.cfg(MSIX_CAP + 2, 2) & P.MSIX_FLAGS_ENABLE
    assert rig.fake._enabled() == (True, False)  # the host enabled physical MSI-X
    rig.vm.memory.write(0x10_0000, bytes(range(64)))
    rig.vm.mmio.write(bar + DOORBELL, 8, 0x10_0000)
    assert rig.vm.memory.read(0x10_0040, 64) == bytes(b + 1 for b in range(64))  # DMA at IOVA = GPA
    assert rig.machine.wait_until(lambda: bool(hits), 100_000, "msi")
    assert rig.pt.endpoint.injected == 1
    assert rig.vm.irqfd(rig.host.eventfds).injections == 1
    kinds = [e.kind for e in rig.machine.trace.events]
    assert kinds.index("host_msi") < kinds.index("msix_inject") < kinds.index("msi")


def test_guest_mask_bit_pends_then_unmask_delivers(rig: Rig) -> None:
    hits: list[int] = []
    bar, _ = setup_msix(rig, hits)
    rig.vm.mmio.write(bar + TABLE + 12, 4, 1)  # guest masks entry 0
    rig.fake.fire(0)
    rig.machine.wait_until(lambda: False, 10_000, "idle")
    assert hits == [] and rig.vm.mmio.read(bar + PBA, 8) == 1
    rig.vm.mmio.write(bar + TABLE + 12, 4, 0)
    assert rig.machine.wait_until(lambda: bool(hits), 10_000, "msi")
    assert rig.vm.mmio.read(bar + PBA, 8) == 0
    # MASKALL in the guest's MSI-X control works the same way
    rig.wcfg(MSIX_CAP + 2, 2, P.MSIX_FLAGS_ENABLE | P.MSIX_FLAGS_MASKALL)
    rig.fake.fire(0)
    rig.machine.wait_until(lambda: False, 10_000, "idle")
    assert len(hits) == 1
    rig.wcfg(MSIX_CAP + 2, 2, P.MSIX_FLAGS_ENABLE)
    assert rig.machine.wait_until(lambda: len(hits) == 2, 10_000, "msi")


def test_msix_disable_tears_down_eventfds(rig: Rig) -> None:
    hits: list[int] = []
    setup_msix(rig, hits)
    reg = rig.vm.irqfd(rig.host.eventfds)
    assert len(reg.assigned()) == 4 and rig.host.msi.allocated() == 4
    rig.wcfg(MSIX_CAP + 2, 2, 0)
    assert reg.assigned() == () and rig.host.msi.allocated() == 0
    rig.fake.fire(0)
    rig.machine.wait_until(lambda: False, 10_000, "idle")
    assert hits == []


def test_dma_aimed_at_the_devices_own_bar_is_refused(rig: Rig) -> None:
    bar = rig.enable()
    rig.vm.mmio.write(bar + DOORBELL, 8, bar)  # "buffer" at the function's own BAR
    assert len(rig.fake.faults) == 1 and rig.fake.doorbells == [bar]  # no re-entrant dispatch
    f = rig.host.iommu.faults[-1]
    assert f.iova == bar and f.requester_id == rig.hf.requester_id
    assert bytes(rig.fake.scratch0[:128]) == bytes(128)


def test_dma_to_unmapped_iova_faults_and_touches_no_memory(rig: Rig) -> None:
    bar = rig.enable()
    end = 16 << 20
    rig.vm.memory.write(end - 64, b"\x07" * 64)
    rig.vm.mmio.write(bar + DOORBELL, 8, end - 64)  # the write-back half lands past RAM
    assert len(rig.fake.faults) == 1 and "not mapped" in rig.host.iommu.faults[-1].reason
    assert rig.vm.memory.read(end - 64, 64) == b"\x07" * 64


def test_guest_flr_resets_the_host_function(rig: Rig) -> None:
    hits: list[int] = []
    setup_msix(rig, hits)
    rig.wcfg(0x50 + P.EXP_DEVCTL, 2, P.EXP_DEVCTL_BCR_FLR)
    assert rig.fake.resets == 1
    assert rig.fake._enabled() == (True, False)  # the host restored its MSI-X setup
    rig.fake.fire(0)
    assert rig.machine.wait_until(lambda: bool(hits), 10_000, "msi")


def test_close_releases_container_and_mappings(rig: Rig) -> None:
    domain = rig.pt.container.domain
    rig.vm.close()
    assert rig.host.iommu.domain_of(rig.hf.requester_id) is None
    assert domain is not None and domain.destroyed


def test_interrupt_remapping_blocks_a_message_aimed_at_another_functions_vector(rig: Rig) -> None:
    """A device backdoor (like virtio's PCI_CFG window) lets a guest rewrite its
    function's physical MSI-X table; it still cannot raise another function's host
    vector, because host vectors only fire for the requester they were allocated to."""
    from vmm.eventfd import drain, new_eventfd
    from vmm.vfio import uapi
    from vmm.vfio.passthrough import set_irqs
    hits: list[int] = []
    setup_msix(rig, hits)
    other = rig.host.add_function(fake_factory, bus=3, dev=1)
    group = rig.host.bind_vfio(other)
    from vmm.memory import GuestMemory, HostMemory
    from vmm.vfio import VfioContainer
    mem = HostMemory(1 << 20)
    container = VfioContainer(rig.host.iommu, [GuestMemory(mem, 0, 1 << 20)])
    group.set_container(container)
    container.set_iommu(uapi.VFIO_TYPE1v2_IOMMU)
    dev = group.get_device_fd(other.name)
    fd = new_eventfd()
    set_irqs(dev, uapi.VFIO_IRQ_SET_DATA_EVENTFD | uapi.VFIO_IRQ_SET_ACTION_TRIGGER,
             uapi.VFIO_PCI_MSIX_IRQ_INDEX, 0, [fd])
    other_vector = int.from_bytes(other.function.table[8:12], "little")  # type: ignore[attr-defined]
    rig.fake.table[8:12] = other_vector.to_bytes(4, "little")  # the backdoor write
    rig.fake.fire(0)
    assert drain(fd) == 0
    blocked = rig.host.msi.unknown[-1]
    assert blocked.data == other_vector and "remapping" in blocked.reason
    other.function.fire(0)  # type: ignore[attr-defined]
    assert drain(fd) == 1  # the owner still gets its own interrupts
    dev.close()
    os.close(fd)
    mem.close()


def test_after_vm_close_the_function_is_quiet_and_reset(rig: Rig) -> None:
    hits: list[int] = []
    setup_msix(rig, hits)
    resets = rig.fake.resets
    rig.vm.close()
    assert rig.fake.resets == resets + 1 and not rig.fake._enabled()[0]
    assert rig.host.msi.allocated() == 0
    rig.fake.work(0x1000)  # a late doorbell: no mapping, no interrupt route
    assert rig.fake.faults and "attached to no IOMMU domain" in rig.host.iommu.faults[-1].reason


def test_failed_attach_leaves_nothing_behind() -> None:
    m = Machine(SEED)
    host = Host(m)
    hf = host.add_function(fake_factory, bus=3, dev=0)
    vm = Vm(m, "vm0", ram_size=8 << 20)
    vm._free_dev = lambda: (_ for _ in ()).throw(ValueError("bus full"))  # type: ignore[method-assign]
    with pytest.raises(ValueError, match="bus full"):
        vm.attach_va1_passthrough(host, hf)
    assert hf.group is not None and hf.group.container is None
    assert host.iommu.domain_of(hf.requester_id) is None
    vm.close()
