"""`virtaccel vm run IMAGE [--seed N]` on both shipped images, and its failure modes."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from virtaccel.cli import main
from virtaccel.images import load_image, run_image

ROOT = Path(__file__).resolve().parents[2]
MMIO = str(ROOT / "vm_images" / "microvm-mmio.toml")
PT = str(ROOT / "vm_images" / "passthrough-pci.toml")
SEED = 17


def digest_of(out: str) -> str:
    lines = [ln for ln in out.splitlines() if ln.startswith("trace digest: ")]
    assert len(lines) == 1
    return lines[0].split()[-1]


@pytest.mark.parametrize("image", [MMIO, PT])
def test_vm_run_boots_the_image_and_prints_result_and_digest(image: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["vm", "run", image, "--seed", str(SEED)]) == 0
    out = capsys.readouterr().out
    assert "result: OK" in out and "max_abs_error" in out and f"seed {SEED}" in out
    d = digest_of(out)
    assert len(d) == 64 and d == run_image(load_image(image), SEED).digest


def test_both_images_compute_the_same_result() -> None:
    a = run_image(load_image(MMIO), SEED)
    b = run_image(load_image(PT), SEED)
    assert a.ok and b.ok
    assert a.result == b.result
    assert a.direct_accesses == 0 and b.direct_accesses > 0  # passthrough: doorbells cost no exit
    assert a.digest != b.digest


def test_seed_defaults_to_the_images(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["vm", "run", MMIO]) == 0
    assert "seed 0" in capsys.readouterr().out


def test_bad_image_exits_2_with_the_field_named(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text('name = "x"\n[accelerator]\nmode = "teleport"\n')
    assert main(["vm", "run", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "accelerator.mode" in err and "teleport" in err


def test_failed_result_exits_non_zero(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    img = tmp_path / "wrong.toml"
    img.write_text('name = "wrong"\n[accelerator]\nmode = "passthrough"\n'
                   '[program]\nentry = "test_vm_run_cli:not_ok_program"\n')
    sys.path.insert(0, str(Path(__file__).parent))
    assert main(["vm", "run", str(img)]) == 1
    out = capsys.readouterr().out
    assert "result: FAILED" in out


def not_ok_program(os: object, seed: int = 0) -> dict[str, object]:
    """A guest program whose result does not match (for the exit-code test)."""
    return {"ok": False, "max_abs_error": 1.0}


def test_console_script_runs_passthrough_image() -> None:
    exe = Path(sys.executable).parent / "virtaccel"
    if not exe.exists():
        pytest.skip(f"no console script at {exe} (package not installed in this venv)")
    p = subprocess.run([str(exe), "vm", "run", PT, "--seed", "5"], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    assert "result: OK" in p.stdout
