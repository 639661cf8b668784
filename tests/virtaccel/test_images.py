"""VM image loader: the shipped images load, and every bad field gets a clear error."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from virtaccel.images import DEFAULT_PROGRAM, ImageError, load_image, parse_image, parse_size, resolve_program

ROOT = Path(__file__).resolve().parents[2]


def base() -> dict[str, Any]:
    return {"name": "t", "accelerator": {"mode": "emulated", "transport": "mmio"}}


def test_shipped_images_load() -> None:
    mmio = load_image(ROOT / "vm_images" / "microvm-mmio.toml")
    pt = load_image(ROOT / "vm_images" / "passthrough-pci.toml")
    assert (mmio.accelerator.mode, mmio.accelerator.transport) == ("emulated", "mmio")
    assert (pt.accelerator.mode, pt.accelerator.transport) == ("passthrough", "pci")
    assert mmio.memory == pt.memory == 256 << 20
    assert mmio.entry == pt.entry == DEFAULT_PROGRAM
    assert callable(resolve_program(pt))


def test_defaults() -> None:
    img = parse_image(base())
    assert img.seed == 0 and img.memory == 256 << 20 and img.entry == DEFAULT_PROGRAM and img.args == {}
    pt = parse_image({"name": "p", "accelerator": {"mode": "passthrough"}})
    assert pt.accelerator.transport == "pci"


@pytest.mark.parametrize("text,size", [("256M", 256 << 20), ("1G", 1 << 30), ("512KiB", 512 << 10),
                                       ("4096", 4096), (8192, 8192), ("2 MB", 2 << 20)])
def test_parse_size(text: str | int, size: int) -> None:
    assert parse_size(text) == size


def mutate(path: str, value: Any) -> dict[str, Any]:
    doc = base()
    keys = path.split(".")
    t = doc
    for k in keys[:-1]:
        t = t.setdefault(k, {})
    t[keys[-1]] = value
    return doc


@pytest.mark.parametrize("path,value,where,words", [
    ("colour", "blue", "colour", "unknown key"),
    ("machine.cpus", 2, "machine.cpus", "unknown key"),
    ("accelerator.speed", 2, "accelerator.speed", "unknown key"),
    ("program.argz", {}, "program.argz", "unknown key"),
    ("name", 5, "name", "text"),
    ("name", "  ", "name", "empty"),
    ("seed", -1, "seed", "outside"),
    ("seed", "7", "seed", "integer"),
    ("seed", True, "seed", "boolean"),
    ("machine", "big", "machine", "table"),
    ("machine.memory", "lots", "machine.memory", "not a size"),
    ("machine.memory", "1M", "machine.memory", "between"),
    ("machine.memory", 3 << 20 | 1, "machine.memory", "multiple of 4096"),
    ("machine.memory", 1.5, "machine.memory", "a size"),
    ("machine.vcpus", 0, "machine.vcpus", "outside"),
    ("machine.exit_cost_ns", "fast", "machine.exit_cost_ns", "integer"),
    ("accelerator.mode", "vdpa-ish", "accelerator.mode", "unknown mode"),
    ("accelerator.transport", "usb", "accelerator.transport", "unknown transport"),
    ("accelerator.config.num_compute_units", "4", "accelerator.config.num_compute_units", "integer"),
    ("accelerator.config.warp_drive", 1, "accelerator.config.warp_drive", "unknown key"),
    ("accelerator.config.num_compute_units", 0, "accelerator.config.num_compute_units",
     "0 is outside 1 .. 1024"),
    ("program.entry", "virtaccel.guests.mlp", "program.entry", "module:function"),
    ("program.entry", "a b:c", "program.entry", "module:function"),
    ("program.entry", 3, "program.entry", "text"),
    ("program.args", [1], "program.args", "table"),
    ("program.args.seed", 1, "program.args.seed", "--seed"),
])
def test_every_bad_field_is_named(path: str, value: Any, where: str, words: str) -> None:
    with pytest.raises(ImageError) as e:
        parse_image(mutate(path, value), "img.toml")
    msg = str(e.value)
    assert msg.startswith(f"img.toml: {where}:"), msg
    assert words in msg, msg


def test_missing_required_and_passthrough_over_mmio() -> None:
    with pytest.raises(ImageError, match="name: missing"):
        parse_image({"accelerator": {}}, "x")
    with pytest.raises(ImageError, match="accelerator: missing"):
        parse_image({"name": "x"}, "x")
    with pytest.raises(ImageError, match="transport must be \"pci\""):
        parse_image({"name": "x", "accelerator": {"mode": "passthrough", "transport": "mmio"}}, "x")


def test_file_errors(tmp_path: Path) -> None:
    with pytest.raises(ImageError, match="cannot read"):
        load_image(tmp_path / "nope.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("name = \n")
    with pytest.raises(ImageError, match="not valid TOML"):
        load_image(bad)
    binary = tmp_path / "bin.toml"
    binary.write_bytes(b"\xff\xfe\x00")
    with pytest.raises(ImageError, match="UTF-8"):
        load_image(binary)


def test_unresolvable_program_is_named() -> None:
    img = parse_image(mutate("program.entry", "no_such_module_xyz:main"), "i.toml")
    with pytest.raises(ImageError, match="cannot import 'no_such_module_xyz'"):
        resolve_program(img)
    img = parse_image(mutate("program.entry", "virtaccel.guests.mlp:nope"), "i.toml")
    with pytest.raises(ImageError, match="no function 'nope'"):
        resolve_program(img)
