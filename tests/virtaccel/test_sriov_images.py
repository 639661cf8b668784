"""VM images with mode = "sriov-vf": the [[tenant]] format, its errors, and runs."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from virtaccel.images import ImageError, load_image, parse_image, run_image, tenant_seed
from virtaccel.guests.tenant import expected_checksums
from virtaccel.testing.fake_card import FakePfDriver, fake_card_factory

ROOT = Path(__file__).resolve().parents[2]


def doc(**over: Any) -> dict[str, Any]:
    d: dict[str, Any] = {
        "name": "t", "machine": {"memory": "8M"},
        "accelerator": {"mode": "sriov-vf", "resources": {"device_memory": "16M"}},
        "program": {"entry": "virtaccel.guests.tenant:checked_gemm", "args": {"count": 2}},
        "tenant": [{"name": "a"}, {"name": "b", "memory": "16M", "resources": {"weight": 3},
                                   "args": {"count": 3}}],
    }
    d.update(over)
    return d


def test_tenants_8_image_loads() -> None:
    img = load_image(ROOT / "vm_images" / "tenants-8.toml")
    assert img.accelerator.mode == "sriov-vf" and img.accelerator.transport == "pci"
    assert [t.index for t in img.tenants] == list(range(1, 9))
    assert [t.resources["weight"] for t in img.tenants] == [1, 1, 1, 1, 2, 2, 4, 4]
    assert img.tenants[6].resources["device_memory"] == 64 << 20
    assert img.tenants[7].memory == 32 << 20 and img.tenants[7].args["queues"] == 4
    assert img.tenants[0].args == {"count": 16, "depth": 2, "m": 32, "k": 32, "n": 32}


def test_tenant_fields_merge_over_the_defaults() -> None:
    img = parse_image(doc())
    a, b = img.tenants
    assert (a.name, a.memory, a.resources, a.args) == ("a", 8 << 20, {"device_memory": 16 << 20},
                                                       {"count": 2})
    assert (b.memory, b.resources, b.args["count"]) == (16 << 20, {"device_memory": 16 << 20, "weight": 3}, 3)


@pytest.mark.parametrize("mutate,where,words", [
    (lambda d: d.pop("tenant"), "tenant", "missing"),
    (lambda d: d.update(tenant=[]), "tenant", "0 tenants"),
    (lambda d: d.update(tenant={"name": "x"}), "tenant", "array of tables"),
    (lambda d: d["tenant"].append({"name": "a"}), "tenant[2].name", "used by another"),
    (lambda d: d["tenant"][0].update(colour=1), "tenant[0].colour", "unknown key"),
    (lambda d: d["tenant"][0].update(name="a b"), "tenant[0].name", "letters"),
    (lambda d: d["tenant"][0].update(resources={"weight": 0}), "tenant[0].resources.weight", "0 is outside 1 .."),
    (lambda d: d["tenant"][0].update(resources={"speed": 1}), "tenant[0].resources.speed", "unknown key"),
    (lambda d: d["tenant"][0].update(memory="1M"), "tenant[0].memory", "between"),
    (lambda d: d["tenant"][0].update(entry="nope"), "tenant[0].entry", "module:function"),
    (lambda d: d["tenant"][0].update(args={"seed": 1}), "tenant[0].args.seed", "seed"),
    (lambda d: d["accelerator"].update(transport="mmio"), "accelerator.transport", "pci"),
    (lambda d: d["accelerator"].update(total_vfs=65), "accelerator.total_vfs", "outside"),
    (lambda d: d["accelerator"].update(total_vfs=1), "tenant", "2 tenants: 1 .. 1"),
    (lambda d: d["accelerator"]["resources"].update(device_memory="lots"), "accelerator.resources.device_memory", "size"),
])
def test_bad_tenant_images_name_file_and_field(mutate: Any, where: str, words: str) -> None:
    d = doc()
    mutate(d)
    with pytest.raises(ImageError) as e:
        parse_image(d, "x.toml")
    assert f"x.toml: {where}" in str(e.value) and words in str(e.value)


def test_tenant_tables_only_for_sriov_vf() -> None:
    d = doc()
    d["accelerator"] = {"mode": "passthrough"}
    with pytest.raises(ImageError, match="only for mode"):
        parse_image(d, "x.toml")


def test_run_checks_every_tenant_against_numpy_and_is_deterministic() -> None:
    img = parse_image(doc(), "x.toml")
    r1 = run_image(img, seed=5)
    r2 = run_image(img, seed=5)
    assert r1.ok and r1.error is None
    tenants = r1.result["tenants"]
    assert set(tenants) == {"a", "b"}
    assert tenants["b"]["completions"] == 3 and tenants["b"]["correct"] is True
    assert tenants["a"]["checksums"] == expected_checksums(tenant_seed(5, 1), 2)
    assert r1.digest == r2.digest != run_image(img, seed=6).digest


def test_a_wrong_result_fails_the_run() -> None:
    d = doc()
    d["tenant"][1]["entry"] = "virtaccel.testing.wrong_tenant:main"
    img = parse_image(d, "x.toml")
    r = run_image(img)
    assert not r.ok and r.result["tenants"]["b"]["correct"] is False
    assert r.result["tenants"]["a"]["correct"] is True


def test_runs_on_the_fake_card_too() -> None:
    img = parse_image(doc(), "x.toml")
    r = run_image(img, card_factory=fake_card_factory(total_vfs=4), pf_driver_factory=FakePfDriver)
    assert r.ok
