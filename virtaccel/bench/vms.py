"""Building the VMs the benchmarks run in (host side)."""
from __future__ import annotations

from typing import Any, Callable, Sequence

from device_model import Va1Config
from guest_driver.uapi import GuestOS
from hwspec.va1 import VfResources

from vmm.host import Host, HostPciFunction
from vmm.machine import Machine
from vmm.vm import PassthroughVa1, Vm

ATTACHMENTS = ("mmio", "passthrough")


def attach_va1_passthrough(vm: Vm, config: Va1Config | None = None) -> tuple[PassthroughVa1, Host]:
    """A host VA-1 function (virtio-pci behind the host IOMMU) assigned to `vm` by VFIO:
    bound to vfio-pci, all guest RAM mapped at IOVA = GPA (`Vm.attach_va1_passthrough`).
    The device's DMA is `IommuDma` through the VM's container domain."""
    host = Host(vm.machine)
    hf = host.add_va1(config)
    return vm.attach_va1_passthrough(host, hf), host


def run_in_vm(program: Callable[[GuestOS], Any], *, ram_size: int = 256 << 20,
              config: Va1Config | None = None, attachment: str = "mmio", seed: int = 0,
              profiles: Any = None, inspect: Callable[[Vm], None] | None = None) -> Any:
    """Boot one VM with one VA-1 (`attachment`: "mmio" = emulated virtio-mmio,
    "passthrough" = a host function assigned by VFIO), run `program(os)` as its guest
    task, return its result. With `profiles` (a ProfileSet), its phase recorder watches
    the machine's trace. `inspect(vm)` runs after the task, before the VM is closed."""
    if attachment not in ATTACHMENTS:
        raise ValueError(f"attachment {attachment!r}: one of {ATTACHMENTS}")
    machine = Machine(seed)
    if profiles is not None:
        profiles.attach(machine)
    vm = Vm(machine, "vm0", ram_size=ram_size)
    host: Host | None = None
    try:
        if attachment == "passthrough":
            host = attach_va1_passthrough(vm, config)[1]
        else:
            vm.attach_va1_mmio(config)
        task = vm.spawn_program(program, name="bench")
        machine.run_tasks()
        if task.error is not None:
            raise task.error
        if inspect is not None:
            inspect(vm)
        return task.result
    finally:
        vm.close()
        if host is not None:
            host.close()


class SriovFleet:
    """One machine, one host, one VA-1 card with `count` VFs (each provisioned with
    `resources` and bound to vfio-pci), one VM per VF with its VF assigned by VFIO.
    The card is sized to hold `card_vfs` such VFs (default `count`), so fleets of
    different sizes can share one card layout."""

    def __init__(self, count: int, *, ram_size: int, resources: VfResources,
                 card_vfs: int | None = None, pf_memory: int = 16 << 20,
                 card_config: Va1Config | None = None, seed: int = 0) -> None:
        self.machine = Machine(seed)
        self.host = Host(self.machine)
        self.vms: list[Vm] = []
        slots = max(count, card_vfs or count)
        self.pf: HostPciFunction = self.host.add_va1_card(
            card_config, memory_size=pf_memory + slots * resources.device_memory,
            pf_memory=pf_memory)
        try:
            self.vfs = self.host.enable_sriov(count, [resources] * count, pf=self.pf)
            for vf in self.vfs:
                vm = Vm(self.machine, f"vm{vf.vf_index}", ram_size=ram_size)
                self.vms.append(vm)
                vm.attach_va1_passthrough(self.host, vf)
        except BaseException:
            self.close()
            raise

    def run(self, programs: Sequence[Callable[[GuestOS], Any]]) -> list[Any]:
        """programs[i] in VM i (VF i+1), all to the end; the results, VM 1 first."""
        if len(programs) != len(self.vms):
            raise ValueError(f"{len(programs)} programs for {len(self.vms)} VMs")
        tasks = [vm.spawn_program(p) for vm, p in zip(self.vms, programs)]
        self.machine.run_tasks()
        for t in tasks:
            if t.error is not None:
                raise t.error
        return [t.result for t in tasks]

    def close(self) -> None:
        for vm in self.vms:
            vm.close()
        self.host.close()
