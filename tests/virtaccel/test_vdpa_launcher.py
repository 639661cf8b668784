"""The launcher's vdpa attachment: images, Session arguments and a live move refused,
each mistake named with nothing built or changed."""
from __future__ import annotations

import errno
from pathlib import Path
from typing import Any

import pytest

from device_model import Va1Config
from device_model.va1.device import Va1Device
from device_model.ports import DevicePorts
from virtaccel import Session, SessionStateError
from virtaccel.images import ImageError, load_image, parse_image
from vmm.machine import Machine
from vmm.vdpa import VdpaError

ROOT = Path(__file__).resolve().parents[2]


def vdpa(**acc: Any) -> dict[str, Any]:
    return {"name": "v", "accelerator": {"mode": "vdpa", **acc}}


def test_shipped_vdpa_images() -> None:
    for transport in ("pci", "mmio"):
        img = load_image(ROOT / "vm_images" / f"vdpa-{transport}.toml")
        a = img.accelerator
        assert (a.mode, a.transport, a.spare, a.parent) == ("vdpa", transport, 1, "pf")
        s = Session.from_image(img)
        assert (s.attach, s.transport, s.spare, s.vdpa_parent) == ("vdpa", transport, 1, "pf")


@pytest.mark.parametrize("doc, where, words", [
    (vdpa(spare=9), "accelerator.spare", "0 .. 8"),
    (vdpa(spare="1"), "accelerator.spare", ""),
    (vdpa(parent="pci"), "accelerator.parent", "\"pf\""),
    (vdpa(transport="usb"), "accelerator.transport", "unknown transport"),
    ({"name": "e", "accelerator": {"mode": "emulated", "spare": 1}}, "accelerator.spare",
     "only for mode = \"vdpa\""),
    ({"name": "e", "accelerator": {"mode": "passthrough", "parent": "vf"}}, "accelerator.parent",
     "only for mode = \"vdpa\""),
    (vdpa(**{"faults": 1}), "accelerator.", "faults"),
])
def test_bad_vdpa_image_fields_are_named(doc: dict[str, Any], where: str, words: str) -> None:
    with pytest.raises(ImageError) as e:
        parse_image(doc, "img.toml")
    assert where in str(e.value) and words in str(e.value)


def test_flr_fault_in_a_vdpa_image_is_refused() -> None:
    doc = vdpa()
    doc["faults"] = [{"function": "v", "action": "flr", "at_ns": 0}]
    with pytest.raises(ImageError) as e:
        parse_image(doc, "img.toml")
    assert "faults[0].action" in str(e.value) and "vDPA frontend" in str(e.value)


@pytest.mark.parametrize("kw, words", [
    ({"attach": "vdpa", "transport": "usb"}, "transport 'usb'"),
    ({"attach": "pci", "transport": "mmio"}, "attach='vdpa' only"),
    ({"attach": "vfio", "spare": 1}, "spare=1"),
    ({"attach": "vdpa", "spare": 9}, "spare=9"),
    ({"attach": "vdpa", "vdpa_parent": "card"}, "vdpa_parent='card'"),
    ({"attach": "sriov", "vdpa_parent": "vf"}, "vdpa_parent='vf'"),
])
def test_bad_session_arguments(kw: dict[str, Any], words: str) -> None:
    with pytest.raises(ValueError) as e:
        Session(**kw)
    assert words in str(e.value)


def test_a_move_refused_changes_nothing() -> None:
    with Session(attach="pci") as s:
        with pytest.raises(SessionStateError):
            s.move_vdpa("pci/0000:01:00.0")
    with Session(attach="vdpa", spare=1) as s:
        host = s.host
        assert host is not None
        before = sorted(host.vdpa.devices)
        with pytest.raises(VdpaError) as e:
            s.move_vdpa("pci/0000:07:00.0")
        assert e.value.errno == errno.ENODEV
        with pytest.raises(VdpaError) as e:
            s.move_vdpa("pci/0000:01:01.0", name="vdpa0")
        assert e.value.errno == errno.EEXIST
        assert sorted(host.vdpa.devices) == before
        att = s.vm.vdpa[0]
        assert not att.backend.vhost.suspended and att.device_name == "vdpa0"
        from virtaccel.guests import mlp
        assert s.run(lambda os_: mlp.main(os_, seed=1, batch=4, sizes=(16, 32, 8)))["ok"]


def _device(size: int = 1 << 20) -> Va1Device:
    m = Machine(0)
    return Va1Device(Va1Config(device_memory_size=size),
                     DevicePorts(dma=None, clock=m.sched, tracer=m.trace.tracer("d")))  # type: ignore[arg-type]


@pytest.mark.parametrize("mutate, words", [
    (lambda st: st[:10], "shorter than the state header"),
    (lambda st: b"XXXX" + st[4:], "not a VA-1 state"),
    (lambda st: st[:-1], "bytes of memory"),
])
def test_migration_load_refuses_bad_state(mutate: Any, words: str) -> None:
    src, dst = _device(), _device()
    src.migration_port.save()
    src.memory.data[:4] = [1, 2, 3, 4]
    state = src.migration_port.save()
    with pytest.raises(ValueError) as e:
        dst.migration_port.load(mutate(state))
    assert words in str(e.value)
    assert bytes(dst.memory.data[:4]) == bytes(4) and dst.contexts == {}
    with pytest.raises(ValueError) as e:
        _device(2 << 20).migration_port.load(state)
    assert "this function has" in str(e.value)
    with pytest.raises(ValueError):
        dst.migration_port.set_vq_state(2, 0x10000)
    dst.migration_port.load(state)
    assert bytes(dst.memory.data[:4]) == b"\x01\x02\x03\x04"
