"""Choosing features for bring-up: [guest] features / exclude_features in a VM image,
Session(guest_features=...), `virtaccel vm run --features` and `--strict`."""
from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

from hwspec import virtio_mmio as R
from virtaccel.cli import main
from virtaccel.errors import ImageError
from virtaccel.images import load_image, parse_image, run_image
from virtaccel.session import DEFAULT_GUEST_FEATURES, GUEST_FEATURES, Session

ROOT = Path(__file__).resolve().parents[2]
MMIO = str(ROOT / "vm_images" / "microvm-mmio.toml")
BASE = {"name": "x", "accelerator": {"mode": "emulated", "transport": "mmio"},
        "program": {"args": {"batch": 4, "sizes": [16, 16, 16]}}}


def _image(**guest: Any) -> Any:
    return parse_image(dict(BASE, guest=guest), "t.toml")


def test_features_list_and_exclusion_list() -> None:
    assert _image(features=["packed", "event_idx"]).guest_features == ("packed", "event_idx")
    assert _image(features=[]).guest_features == ()
    excl = _image(exclude_features=["packed"]).guest_features
    assert excl == tuple(n for n in GUEST_FEATURES if n != "packed")
    assert parse_image(dict(BASE), "t.toml").guest_features is None
    assert DEFAULT_GUEST_FEATURES == ("indirect", "event_idx")


@pytest.mark.parametrize("guest,where", [
    ({"features": ["packed"], "exclude_features": []}, "guest"),
    ({"features": ["warp"]}, "guest.features[0]"),
    ({"features": "packed"}, "guest.features"),
    ({"exclude_features": ["packed", "packed"]}, "guest.exclude_features"),
    ({"feature": ["packed"]}, "guest.feature"),
])
def test_bad_guest_tables_name_the_field(guest: dict[str, Any], where: str) -> None:
    with pytest.raises(ImageError, match=rf"t\.toml: {where.replace('[', '.').replace(']', '.')}"):
        _image(**guest)


def test_session_refuses_an_unknown_feature_name() -> None:
    with pytest.raises(ValueError, match="guest_features: unknown feature 'warp'"):
        Session(guest_features=["warp"])
    with pytest.raises(ValueError, match="list of names"):
        Session(guest_features="packed")
    with pytest.raises(ValueError, match="va1.features: unknown feature 'warp'"):
        Session(cmdline="va1.features=packed,warp")


def test_the_choice_is_a_driver_parameter_on_the_kernel_command_line() -> None:
    """Session(guest_features=) is `va1.features=` on every guest's command line (the
    driver's parameter), after the session's own and before each VM's."""
    from virtaccel.session import VmSpec
    with Session(attach="pci", guest_features=["packed", "event_idx"], cmdline="quiet",
                 vms=[VmSpec("a"), VmSpec("b", cmdline="va1.poll_ns=5000")]) as s:
        assert [vm.kernel.cmdline for vm in s.vms] == [
            "quiet va1.features=event_idx,packed",
            "quiet va1.features=event_idx,packed va1.poll_ns=5000"]


def test_image_choice_reaches_the_driver(tmp_path: Path) -> None:
    img = tmp_path / "packed.toml"
    img.write_text('name = "packed"\n[accelerator]\nmode = "emulated"\ntransport = "pci"\n'
                   '[guest]\nfeatures = ["packed", "in_order", "notification_data"]\n'
                   '[program]\nentry = "test_feature_choice:features_program"\n')
    sys.path.insert(0, str(Path(__file__).parent))
    try:
        run = run_image(load_image(img), 0)
    finally:
        sys.path.remove(str(Path(__file__).parent))
    assert run.ok and run.result["features"] == ["packed", "in_order", "notification_data"]
    assert run.violations == []


def features_program(os: Any, seed: int = 0) -> dict[str, Any]:
    from virtaccel.session import feature_names
    dev = os.devices["/dev/accel/accel0"]
    return {"ok": True, "features": feature_names(dev.features)}


def bad_notify_program(os: Any, seed: int = 0) -> dict[str, Any]:
    """The MLP, then a notification of a queue that does not exist (queue/not-ready)."""
    from virtaccel.guests.mlp import main as mlp
    r = mlp(os, seed=seed, batch=4, sizes=(16, 16, 16))
    base = os.kernel.platform_devices[0].base
    os.kernel.mmio.write(base + R.QUEUE_NOTIFY, 4, 99)
    return r


def test_vm_run_features_and_strict_pass_on_a_clean_run(
        capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["vm", "run", MMIO, "--features", "packed,in_order,notification_data,"
                 "ring_reset,event_idx,indirect", "--strict"]) == 0
    out = capsys.readouterr().out
    assert "guest features packed, in_order" in out and "result: OK" in out


def test_vm_run_strict_fails_on_a_logged_violation_and_prints_the_rule(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    img = tmp_path / "bad.toml"
    img.write_text('name = "bad"\n[accelerator]\nmode = "emulated"\ntransport = "mmio"\n'
                   '[program]\nentry = "test_feature_choice:bad_notify_program"\n')
    sys.path.insert(0, str(Path(__file__).parent))
    try:
        assert main(["vm", "run", str(img)]) == 0        # right answer: not strict
        capsys.readouterr()
        assert main(["vm", "run", str(img), "--strict"]) == 1
        out = capsys.readouterr().out
        assert "strict: the device logged 1 violation(s) of queue/not-ready" in out
        assert "result: FAILED" in out
        report = tmp_path / "r.json"
        assert main(["vm", "run", str(img), "--strict", "--json", str(report)]) == 1
    finally:
        sys.path.remove(str(Path(__file__).parent))
    data = json.loads(report.read_text())
    assert [v["rule"] for v in data["violations"]] == ["queue/not-ready"]
    assert data["strict"] is True


def test_vm_run_refuses_an_unknown_feature(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["vm", "run", MMIO, "--features", "warp"]) == 2
    assert "--features: unknown feature 'warp'" in capsys.readouterr().err
