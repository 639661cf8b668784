"""`virtaccel vdpa`: iproute2's vdpa commands over the netlink family of a host built
from a vdpa image, text and -j JSON, batches, and every mistake a one-line error."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from virtaccel.cli import main

IMAGES = Path(__file__).resolve().parents[2] / "vm_images"


def run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = main(["vdpa", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_batch_adds_shows_and_deletes_on_one_host(tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    batch = tmp_path / "cmds"
    batch.write_text("# on the spare function\n"
                     "dev add name acc1 mgmtdev pci/0000:01:01.0\n\n"
                     "dev show\n"
                     "dev del acc1\n"
                     "dev show\n")
    code, out, _ = run(["--no-run", "-j", "-b", str(batch)], capsys)
    assert code == 0
    docs = [json.loads(line) for line in out.splitlines()]
    assert sorted(docs[0]["dev"]) == ["acc1", "vdpa0"]
    assert docs[0]["dev"]["acc1"]["mgmtdev"] == "pci/0000:01:01.0"
    assert sorted(docs[1]["dev"]) == ["vdpa0"]


@pytest.mark.parametrize("image", ["vdpa-pci", "vdpa-mmio"])
def test_vstats_and_config_after_the_guest_ran(image: str,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["vdpa", "--image", str(IMAGES / f"{image}.toml"), "-j", "dev", "vstats",
                 "show", "vdpa0", "qidx", "2"])
    doc = json.loads(capsys.readouterr().out)
    assert code == 0
    stats = doc["vstats"]["vdpa0"]
    assert stats["queue_index"] == 2
    assert stats["received_desc"] == stats["completed_desc"] == stats["kicks"] >= 1
    code, out, _ = run(["--image", str(IMAGES / f"{image}.toml"), "--no-run", "dev", "config",
                        "show", "vdpa0"], capsys)
    assert code == 0 and out.startswith("vdpa0: num_submit_queues 2 ")
    assert "negotiated_features" not in out       # the guest never ran


def test_mgmtdev_show_text(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(["--no-run", "mgmtdev", "show", "pci/0000:01:00.0"], capsys)
    assert code == 0
    assert out.startswith("pci/0000:01:00.0: supported_classes va1 max_supported_vqs 4 ")
    assert "VERSION_1" in out and "SR_IOV" not in out


@pytest.mark.parametrize("argv, words", [
    (["dev", "bogus"], "unknown command"),
    (["dev", "add", "name", "x"], "give 'name NAME mgmtdev MGMTDEV'"),
    (["dev", "vstats", "show", "vdpa0", "qidx", "two"], "qidx 'two' is not an integer"),
    ([], "no command"),
    (["dev", "del", "vdpa0"], "kernel answers EBUSY"),
    (["dev", "add", "name", "vdpa0", "mgmtdev", "pci/0000:01:01.0"], "kernel answers EEXIST"),
    (["dev", "add", "name", "y", "mgmtdev", "pci/0000:09:00.0"], "kernel answers ENODEV"),
    (["--image", str(IMAGES / "microvm-mmio.toml"), "dev", "show"], "a vdpa image"),
])
def test_mistakes_are_one_line_and_status_2(argv: list[str], words: str,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(["--no-run", *argv], capsys)
    assert code == 2
    assert err.startswith("virtaccel vdpa: ") and words in err and err.count("\n") == 1
