"""`virtaccel tenants` and `virtaccel vm run vm_images/tenants-8.toml`, end to end."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from virtaccel.cli import main

ROOT = Path(__file__).resolve().parents[2]


def test_tenants_writes_per_vf_rows_and_fairness(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "t.json"
    code = main(["tenants", "--vfs", "4", "--weights", "1,2,4,8", "--seed", "3",
                 "--duration-us", "300", "--json", str(out)])
    text = capsys.readouterr().out
    assert code == 0, text
    doc = json.loads(out.read_text())
    rows = doc["vfs"]
    assert [r["vf"] for r in rows] == [1, 2, 3, 4] and [r["weight"] for r in rows] == [1, 2, 4, 8]
    for r in rows:
        assert r["correct"] is True and r["completed"] > 0 and r["commands"] >= r["completed"]
        assert 0 < r["p50_ns"] <= r["p99_ns"] and r["device_ns"] > 0
    shares = [r["share"] for r in rows]
    assert shares == sorted(shares) and abs(sum(shares) - 1) < 1e-9
    assert 0 < doc["jain"] <= 1 and doc["all_correct"] is True
    assert "Jain's fairness index" in text and "wrote" in text


def test_tenants_with_aggressor_reports_victims_against_solo(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "a.json"
    code = main(["tenants", "--vfs", "3", "--weights", "1,1,1", "--aggressor", "3",
                 "--duration-us", "200", "--json", str(out)])
    assert code == 0, capsys.readouterr().out
    doc = json.loads(out.read_text())
    roles = [r["role"] for r in doc["vfs"]]
    assert roles == ["victim", "victim", "aggressor"]
    for r in doc["vfs"][:2]:
        assert r["solo_p99_ns"] > 0 and r["p99_ratio"] <= 2.0
    assert doc["baseline"]["vfs"][0]["role"] == "victim" and len(doc["baseline"]["vfs"]) == 2


def test_tenants_is_deterministic(tmp_path: Path) -> None:
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    for f in (a, b):
        assert main(["tenants", "--vfs", "2", "--weights", "1,2", "--seed", "9", "--duration-us", "100",
                     "--json", str(f)]) == 0
    assert json.loads(a.read_text()) == json.loads(b.read_text())


@pytest.mark.parametrize("argv,words", [
    (["--vfs", "3", "--weights", "1,2"], "2 weights for 3 VFs"),
    (["--vfs", "65", "--weights", ",".join(["1"] * 65)], "1 .. 64"),
    (["--vfs", "0", "--weights", "1"], "1 .. 64"),
    (["--vfs", "2", "--weights", "1,1", "--aggressor", "3"], "--aggressor 3"),
    (["--vfs", "2", "--weights", "1,1", "--aggressor", "0"], "--aggressor 0"),
    (["--vfs", "2", "--weights", "1,x"], "'x' is not an integer"),
    (["--vfs", "2", "--weights", "1,0"], "0 is not a weight"),
    (["--vfs", "1", "--weights", "1", "--aggressor", "1"], "at least 2 VFs"),
])
def test_bad_arguments_get_clear_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                        argv: list[str], words: str) -> None:
    out = tmp_path / "x.json"
    assert main(["tenants", *argv, "--json", str(out)]) == 2
    err = capsys.readouterr().err
    assert words in err and err.startswith("virtaccel tenants: ")
    assert not out.exists()


def test_vm_run_tenants_8(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["vm", "run", str(ROOT / "vm_images" / "tenants-8.toml")]) == 0
    out = capsys.readouterr().out
    assert "(sriov-vf, pci)" in out and "result: OK" in out
    lines = [ln for ln in out.splitlines() if ln.strip().startswith("tenant") and "yes" in ln]
    assert len(lines) == 8
