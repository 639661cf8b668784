"""A virtual machine: guest RAM, an MMIO bus, an interrupt controller, attached
accelerators, and the guest kernel services its drivers run on."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from device_model import DevicePorts, MmioTransport, Va1Config, Va1Device
from guest_driver.kernel import PlatformDevice, RamRange
from guest_driver.uapi import GuestOS
from hwspec import virtio_mmio

from .bus import MmioBus
from .dma import GuestDma
from .guest import GuestKernelServices, GuestMmio, GuestSched
from .irq import InterruptController
from .machine import GuestTask, Machine
from .memory import GuestMemory, HostMemory

MMIO_BASE = 0xD000_0000
FIRST_MMIO_IRQ = 5
KERNEL_RESERVED = 1 << 20  # the guest kernel's own image and data below this


@dataclass
class EmulatedVa1:
    """A VA-1 function attached to one VM over virtio-mmio (no host sharing)."""
    device: Va1Device
    transport: MmioTransport
    platform: PlatformDevice


class Vm:
    def __init__(self, machine: Machine, name: str = "vm0", ram_size: int = 256 << 20,
                 ram_base: int = 0, exit_cost_ns: int = 1000) -> None:
        if ram_size <= KERNEL_RESERVED:
            raise ValueError(f"VM {name!r}: RAM of {ram_size} bytes is too small "
                             f"(more than {KERNEL_RESERVED} needed)")
        self.machine = machine
        self.name = name
        self.host = HostMemory(ram_size, name=f"virtaccel-{name}")
        self.memory = GuestMemory(self.host, ram_base, ram_size)
        self.bus = MmioBus()
        self.irqchip = InterruptController(machine, f"{name}.irq")
        self.mmio = GuestMmio(machine, self.bus, machine.trace.tracer(f"{name}.cpu"), exit_cost_ns)
        self.accelerators: list[EmulatedVa1] = []
        self.kernel = GuestKernelServices(
            memory=self.memory, mmio=self.mmio, irq=self.irqchip, sched=GuestSched(machine),
            trace=machine.trace.tracer(f"{name}.kernel"),
            ram=RamRange(ram_base + KERNEL_RESERVED, ram_size - KERNEL_RESERVED))
        self.os: GuestOS | None = None

    def attach_va1_mmio(self, config: Va1Config | None = None) -> EmulatedVa1:
        index = len(self.kernel.platform_devices)
        base = MMIO_BASE + index * virtio_mmio.REGION_SIZE
        line = FIRST_MMIO_IRQ + index
        source = f"{self.name}.va1.{index}"
        tracer = self.machine.trace.tracer(source)
        device = Va1Device(config or Va1Config(),
                           DevicePorts(dma=GuestDma(self.memory), clock=self.machine.sched, tracer=tracer))
        transport = MmioTransport(device, irq=self.irqchip.line(line), tracer=tracer)
        self.bus.add(base, virtio_mmio.REGION_SIZE, transport, name=source)
        platform = PlatformDevice("virtio,mmio", base, virtio_mmio.REGION_SIZE, line)
        self.kernel.platform_devices = self.kernel.platform_devices + (platform,)
        attached = EmulatedVa1(device, transport, platform)
        self.accelerators.append(attached)
        return attached

    def boot(self) -> GuestOS:
        """Run the guest kernel's probe of its devices (in guest context)."""
        from guest_driver.boot import boot
        self.os = boot(self.kernel)
        return self.os

    def spawn_program(self, program: Callable[[GuestOS], Any], name: str | None = None) -> GuestTask:
        """A guest task that boots this VM's kernel, then runs `program(os)`."""
        def task() -> Any:
            os_ = self.boot()
            return program(os_)
        return self.machine.spawn(task, name or f"{self.name}.init")

    def close(self) -> None:
        self.host.close()
