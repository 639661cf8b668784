"""vmm.msi: one delivery path for a VM's controller (deferred) and the host (synchronous).

Pins what both users share: the decode (window, vector field, allocation, remapping),
the log of refused messages, the delivery count, and the trace events' kinds and
field order (they reach the golden digests)."""
from __future__ import annotations

from hwspec.pci import MSI_ADDRESS_BASE
from vmm.irq import GuestMsiDomain, InterruptController
from vmm.machine import Machine
from vmm.msi import HostMsiDomain, MsiDomain, RequesterMsiPort, UnknownMsi

RID_A, RID_B = 0x0108, 0x0109


def _events(m: Machine, source: str) -> list[tuple[str, tuple[str, ...]]]:
    return [(e.kind, tuple(k for k, _ in e.fields)) for e in m.trace.events if e.source == source]


def test_both_users_are_msi_domains() -> None:
    m = Machine(1)
    chip = InterruptController(m, "vm0.irq")
    host = HostMsiDomain(m.trace.tracer("host.msi"))
    assert isinstance(chip.msi, GuestMsiDomain) and isinstance(chip.msi, MsiDomain)
    assert isinstance(host, MsiDomain)
    assert isinstance(chip.msi_port(), RequesterMsiPort) and chip.msi_port().requester_id is None


def test_host_runs_the_callback_in_the_event_and_remaps_by_requester() -> None:
    m = Machine(1, keep_trace=True)
    host = HostMsiDomain(m.trace.tracer("host.msi"))
    hits: list[str] = []
    mine = host.alloc(lambda: hits.append("a"), "a", requester_id=RID_A)
    anyone = host.alloc(lambda: hits.append("any"), "any")
    host.port(RID_A).send(mine.address, mine.data)
    host.port(RID_B).send(mine.address, mine.data)       # another function: blocked
    host.send(anyone.address, anyone.data)               # no requester: unowned fires
    host.port(RID_B).send(MSI_ADDRESS_BASE, 0x3FFF)      # no such vector
    assert hits == ["a", "any"] and host.delivered == 2 and host.allocated() == 2
    assert [u.reason for u in host.unknown] == [
        f"vector {mine.data} belongs to 01:01.0, not 01:01.1 (remapping)", "no such host vector"]
    assert _events(m, "host.msi") == [
        ("host_msi", ("vector", "name")),
        ("host_msi_blocked", ("address", "data", "reason", "requester")),
        ("host_msi", ("vector", "name")),
        ("host_msi_blocked", ("address", "data", "reason", "requester")),
    ]
    host.free(mine)
    assert host.vector(mine.data) is None and host.allocated() == 1


def test_vm_defers_to_the_guest_and_traces_as_before() -> None:
    m = Machine(1, keep_trace=True)
    chip = InterruptController(m, "vm0.irq", latency_ns=100)
    hits: list[int] = []
    msg = chip.alloc_msi(lambda: hits.append(m.now_ns()), "q0")
    chip.msi_port().send(msg.address, msg.data)
    assert hits == []                                    # pended, not run in the sender
    chip.deliver_msi(msg.address, 0x100 | msg.data)      # above the 8-bit vector
    assert m.wait_until(lambda: bool(hits), 10_000, "msi")
    assert chip.msi.delivered == 1
    assert chip.unknown_msi == [UnknownMsi(msg.address, 0x100 | msg.data,
                                           f"data {0x100 | msg.data:#x} has bits above the vector")]
    assert [k for k, _ in _events(m, "vm0.irq")] == ["msi_alloc", "msi_send", "msi_unknown", "msi"]
    assert _events(m, "vm0.irq")[1:3] == [("msi_send", ("vector",)),
                                          ("msi_unknown", ("address", "data", "reason"))]
