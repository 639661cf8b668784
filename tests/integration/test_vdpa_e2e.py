"""vDPA end to end: a host VA-1 function under vp_vdpa, a vdpa device, its
/dev/vhost-vdpa-N driven by the VMM frontend, the unchanged guest driver and runtime."""
from __future__ import annotations

from typing import Any

import pytest

from virtaccel import Session
from virtaccel.guests import mlp

SEED = 20261121
ARGS: dict[str, Any] = {"batch": 16, "sizes": (64, 128, 32)}


def run_mlp(attach: str, transport: str | None = None, seed: int = SEED
            ) -> tuple[dict[str, Any], Session]:
    with Session(attach=attach, seed=seed, transport=transport) as s:
        result = s.run(lambda os_: mlp.main(os_, seed=seed, **ARGS), name="mlp")
    return dict(result), s


def test_mlp_bit_identical_over_emulated_vfio_and_vdpa_on_both_transports() -> None:
    ref = run_mlp("pci")[0]
    assert ref["ok"] is True
    assert run_mlp("vfio")[0] == ref
    assert run_mlp("vdpa", "pci")[0] == ref     # results and device time, bit for bit
    assert run_mlp("vdpa", "mmio")[0] == ref


@pytest.mark.parametrize("transport", ["pci", "mmio"])
def test_vdpa_data_path_goes_to_the_function(transport: str) -> None:
    _, s = run_mlp("vdpa", transport)
    host, vm = s.host, s.vm
    assert host is not None
    att = vm.vdpa[0]
    frontend = att.frontend
    parent = host.vdpa.mgmtdevs[f"pci/{host.functions['0000:01:00.0'].name}"].parent
    # kicks: guest store -> ioeventfd -> kick eventfd -> the function's doorbell
    assert frontend.ioeventfd.signals > 0
    assert sum(parent.kicks) == frontend.ioeventfd.signals
    # interrupts: the function's MSI-X -> host vector -> call eventfd -> irqfd
    assert sum(parent.calls) > 0 and vm.irqfd(host.eventfds).injections > 0
    assert host.msi.delivered > 0
    # the emulated transport never built a ring: the device behind it did the work
    assert frontend.violations == []
    assert host.iommu.fault_count == 0


def test_vdpa_closes_clean() -> None:
    _, s = run_mlp("vdpa", "pci")
    host = s.host
    assert host is not None
    dev = host.vdpa.devices["vdpa0"]
    assert dev.opened is None                         # the VMM closed its vhost file
    rid = dev.parent.hf.requester_id
    assert host.iommu.domain_of(rid) is None          # and its IOTLB domain is gone


@pytest.mark.parametrize("transport", ["pci", "mmio"])
def test_vdpa_passes_the_ring_features_and_hides_what_vhost_cannot_carry(transport: str) -> None:
    """With every optional feature offered and wanted, a vdpa guest negotiates the
    packed ring, IN_ORDER, indirect and EVENT_IDX straight through, but never
    NOTIFICATION_DATA (an ioeventfd kick has no data) nor RING_RESET (vhost-vdpa has no
    queue reset); the MLP is still bit-identical to the emulated run."""
    from virtaccel.session import GUEST_FEATURES, feature_names

    def program(os_: Any) -> tuple[list[str], Any]:
        dev = os_.devices["/dev/accel/accel0"]
        return feature_names(dev.features), mlp.main(os_, seed=4, batch=4, sizes=(16, 16, 16))

    runs = {}
    for attach in ("pci", "vdpa"):
        kw = {"transport": transport} if attach == "vdpa" else {}
        with Session(attach=attach, seed=4, guest_features=GUEST_FEATURES, **kw) as s:
            runs[attach] = s.run(program)
    features, result = runs["vdpa"]
    assert features == ["indirect", "event_idx", "packed", "in_order"]
    assert set(runs["pci"][0]) == set(GUEST_FEATURES)
    assert result["ok"] and result == runs["pci"][1]
