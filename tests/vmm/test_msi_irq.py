"""MSI in the VM's interrupt controller: alloc, deliver in guest context, unknown vectors."""
from __future__ import annotations

import errno

import pytest

from hwspec.pci import MSI_ADDRESS_BASE
from vmm.irq import MSI_FIRST_VECTOR, MSI_LAST_VECTOR, InterruptController, IrqError
from vmm.machine import Machine

SEED = 7


@pytest.fixture
def chip() -> InterruptController:
    return InterruptController(Machine(SEED, keep_trace=True), "vm0.irq", latency_ns=100)


def test_alloc_gives_distinct_vectors_in_the_msi_window(chip: InterruptController) -> None:
    a = chip.alloc_msi(lambda: None, "a")
    b = chip.alloc_msi(lambda: None, "b")
    assert a.address == b.address == MSI_ADDRESS_BASE
    assert a.data == MSI_FIRST_VECTOR and b.data == MSI_FIRST_VECTOR + 1


def test_alloc_exhausted_is_enospc_and_free_makes_room(chip: InterruptController) -> None:
    msgs = [chip.alloc_msi(lambda: None, f"v{i}") for i in range(MSI_LAST_VECTOR - MSI_FIRST_VECTOR + 1)]
    with pytest.raises(OSError) as e:
        chip.alloc_msi(lambda: None, "one too many")
    assert e.value.errno == errno.ENOSPC
    chip.free_msi(msgs[3])
    assert chip.alloc_msi(lambda: None, "again").data == msgs[3].data
    with pytest.raises(IrqError):
        chip.free_msi(type(msgs[0])(MSI_ADDRESS_BASE, 5))


def test_deliver_runs_the_handler_at_the_next_wait_not_in_the_event(chip: InterruptController) -> None:
    m = chip.machine
    hits: list[int] = []
    msg = chip.alloc_msi(lambda: hits.append(m.now_ns()), "q0")
    m.sched.schedule(1000, lambda: chip.msi_port().send(msg.address, msg.data), "device")
    m.sched.schedule(1000, lambda: (chip.deliver_msi(msg.address, msg.data)), "device again")
    m.charge(5000)  # events run, the guest does not take the interrupt yet
    assert hits == []
    assert m.wait_until(lambda: bool(hits), 10_000, "msi")
    assert hits == [5000]  # queued at 1100, delivered at the guest's wait
    vec = chip.msi_vector(msg.data)
    assert vec is not None and vec.received == 2 and vec.coalesced == 1 and vec.delivered == 1


def test_unknown_vector_is_logged_and_traced_never_raised(chip: InterruptController) -> None:
    chip.deliver_msi(MSI_ADDRESS_BASE, 0x99)
    chip.deliver_msi(0x1234_0000, MSI_FIRST_VECTOR)
    chip.deliver_msi(MSI_ADDRESS_BASE, 0x1_0040)
    reasons = [u.reason for u in chip.unknown_msi]
    assert len(reasons) == 3
    assert "not allocated" in reasons[0] and "outside the MSI window" in reasons[1] and "above" in reasons[2]
    kinds = [e.kind for e in chip.machine.trace.events]
    assert kinds.count("msi_unknown") == 3


def test_freed_vector_in_flight_is_dropped(chip: InterruptController) -> None:
    m = chip.machine
    hits: list[int] = []
    msg = chip.alloc_msi(lambda: hits.append(1), "q")
    chip.deliver_msi(msg.address, msg.data)
    chip.free_msi(msg)
    m.wait_until(lambda: False, 1000, "drain")
    assert hits == []
