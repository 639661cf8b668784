"""Behaviour pinned across refactors: the demo's trace digest for seeds 0..9 and every
shipped VM image's digest and result, recorded before the product layer moved out of
`vmm/`. A change that alters one of these changes what the device or driver does; if it
is meant to, record the new values in the same commit and say why."""
from __future__ import annotations

from pathlib import Path

import pytest

from virtaccel.cli import main

DEMO_DIGESTS = {
    0: "17a16f9e20a70bc4535dbea405ab600d6661565f47d1b47f3c9ddde4da97f2d6",
    1: "b51a84ccc48232248e6f3de8b7d4313e761d7c130f9b12660b458da9fa6db9c2",
    2: "0593b8420ef82d9821a2f0ff09d44d50a9f6a0af778fd4ea08a61504ac5c4bed",
    3: "6b64a8f1307b076f89ab52822c302ba6c1f911501a853ecad4fbff921d6fc238",
    4: "385b7cab4b14b4b092f7d961801962557b3d7553b7180964c8758b51d6a0b909",
    5: "63e4a3f534173becad3f2e1f8f9cad0fc730cfa2ccd022b97ecd4bb33047f137",
    6: "9b673a90a78bc2b4a5035b07cd8e94926958c80f1c98b758da0ebe8c2c9d3e3b",
    7: "7a5548561a4b3dbb4c6139028cff5a15393a646cbde4c3b247008b3f3d7bd40c",
    8: "f259fc4f50e70c0b4c7920a81a8212155ccf711a3c9c5d4d00f9efb3556aecbb",
    9: "ba3709c01f26203a9611535f7c83f87a027689c29040aed4f86e07be7759f2eb",
}

# image -> (trace digest, virtual ns, MMIO exits, direct MMIO accesses)
IMAGE_RUNS = {
    "microvm-mmio": ("b153a7a68f41ef06de887808fcabc22556279f3fe9af155c775ac33ffad56027",
                     255_681, 143, 0),
    "passthrough-pci": ("1471d36328d278a3a29f3ddfd80eaf9e69c6c46625f5b39657dfba676e2f0590",
                        261_881, 137, 124),
    "tenants-8": ("8fbe383230e7eddd1373f6f0855195e28dc8369c141e56dfefd78ca6af1d3c11",
                  101_299_180, 1216, 1088),
}

IMAGES = Path(__file__).resolve().parents[2] / "vm_images"


def _digest(out: str) -> str:
    lines = [ln for ln in out.splitlines() if ln.startswith("trace digest: ")]
    assert len(lines) == 1, out
    return lines[0].split()[-1]


@pytest.mark.parametrize("seed", sorted(DEMO_DIGESTS))
def test_demo_digest_is_unchanged(seed: int, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "--seed", str(seed)]) == 0
    assert _digest(capsys.readouterr().out) == DEMO_DIGESTS[seed], f"seed {seed}"


def test_every_shipped_image_is_pinned() -> None:
    assert sorted(p.stem for p in IMAGES.glob("*.toml")) == sorted(IMAGE_RUNS)


@pytest.mark.parametrize("name", sorted(IMAGE_RUNS))
def test_image_run_is_unchanged(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["vm", "run", str(IMAGES / f"{name}.toml")]) == 0
    out = capsys.readouterr().out
    digest, virtual_ns, exits, direct = IMAGE_RUNS[name]
    assert _digest(out) == digest
    assert (f"virtual time {virtual_ns / 1000:.3f} us, MMIO exits {exits}, "
            f"direct MMIO accesses {direct}") in out
    assert "result: OK" in out
