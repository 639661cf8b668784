"""The runtime on the real stack: one VM with a VA-1 over virtio-mmio, a guest task."""
from __future__ import annotations

from typing import Any, Callable

from guest_driver import uapi
from virtaccel import Session


def run_guest(program: Callable[[uapi.GuestOS], Any], seed: int, name: str) -> Any:
    """Boot a VM ("vm0") with one VA-1, run `program(os)` as its guest task `name`,
    return its result (or raise its error)."""
    with Session(attach="mmio", seed=seed) as s:
        return s.run(program, name=name)
