"""The runtime on the real stack: one VM with a VA-1 over virtio-mmio, a guest task."""
from __future__ import annotations

from typing import Any, Callable

from guest_driver import uapi
from vmm.machine import Machine
from vmm.vm import Vm


def run_guest(program: Callable[[uapi.GuestOS], Any], seed: int, name: str) -> Any:
    """Boot a VM with one VA-1, run `program(os)` as its guest task `name`, return its
    result (or raise its error)."""
    machine = Machine(seed)
    vm = Vm(machine, "vm0")
    vm.attach_va1_mmio()
    task = vm.spawn_program(program, name=name)
    machine.run_tasks()
    vm.close()
    if task.error is not None:
        raise task.error
    return task.result
