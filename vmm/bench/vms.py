"""Building the VMs the benchmarks run in (host side)."""
from __future__ import annotations

from typing import Any, Callable

from device_model import DevicePorts, MmioTransport, Va1Config, Va1Device
from guest_driver.kernel import PlatformDevice
from guest_driver.uapi import GuestOS
from hwspec import virtio_mmio

from ..iommu import Iommu, IommuDma, bdf
from ..machine import Machine
from ..vm import FIRST_MMIO_IRQ, MMIO_BASE, EmulatedVa1, Vm

BENCH_RID = bdf(0, 4, 0)  # the requester ID the benchmark's VA-1 is given behind the IOMMU


def attach_va1_iommu(vm: Vm, config: Va1Config | None = None) -> tuple[EmulatedVa1, Iommu]:
    """A VA-1 over virtio-mmio whose DmaPort is `IommuDma` through an IOMMU domain that
    maps all guest RAM at IOVA = GPA: the DMA path VFIO passthrough gives a function
    (the passthrough attachment itself is another engineer's work in progress)."""
    iommu = Iommu(tracer=vm.machine.trace.tracer(f"{vm.name}.iommu"))
    domain = iommu.create_domain()
    base, size = vm.memory.base, vm.memory.size
    iommu.map(domain, base, vm.memory, base, size)
    iommu.attach(BENCH_RID, domain)
    index = len(vm.kernel.platform_devices)
    mmio_base = MMIO_BASE + index * virtio_mmio.REGION_SIZE
    line = FIRST_MMIO_IRQ + index
    source = f"{vm.name}.va1.{index}"
    tracer = vm.machine.trace.tracer(source)
    device = Va1Device(config or Va1Config(),
                       DevicePorts(dma=IommuDma(iommu, BENCH_RID), clock=vm.machine.sched,
                                   tracer=tracer))
    transport = MmioTransport(device, irq=vm.irqchip.line(line), tracer=tracer)
    vm.bus.add(mmio_base, virtio_mmio.REGION_SIZE, transport, name=source)
    platform = PlatformDevice("virtio,mmio", mmio_base, virtio_mmio.REGION_SIZE, line)
    vm.kernel.platform_devices = vm.kernel.platform_devices + (platform,)
    attached = EmulatedVa1(device, transport, platform)
    vm.accelerators.append(attached)
    return attached, iommu


def run_in_vm(program: Callable[[GuestOS], Any], *, ram_size: int = 256 << 20,
              config: Va1Config | None = None, iommu: bool = False, seed: int = 0,
              profiles: Any = None) -> Any:
    """Boot one VM with one VA-1, run `program(os)` as its guest task, return its result.
    With `profiles` (a ProfileSet), its phase recorder watches the machine's trace."""
    machine = Machine(seed)
    if profiles is not None:
        profiles.attach(machine)
    vm = Vm(machine, "vm0", ram_size=ram_size)
    try:
        if iommu:
            attach_va1_iommu(vm, config)
        else:
            vm.attach_va1_mmio(config)
        task = vm.spawn_program(program, name="bench")
        machine.run_tasks()
        if task.error is not None:
            raise task.error
        return task.result
    finally:
        vm.close()
