"""Behaviour pinned across refactors: the demo's trace digest for seeds 0..9 and every
shipped VM image's digest and result, recorded before the product layer moved out of
`vmm/`. A change that alters one of these changes what the device or driver does; if it
is meant to, record the new values in the same commit and say why."""
from __future__ import annotations

from pathlib import Path

import pytest

from virtaccel.cli import main

DEMO_DIGESTS = {
    0: "313052d79062d8049d3e05a40610677d8386b6d0130aa3278b9c9273e468f697",
    1: "c6cc56a991adee2259b712bdc84cf733063e08627b47fab5774873c29f2707cc",
    2: "9c9130916cbfeac5233d4faafb28175faea3abbf1bfc27724fc0cca80dad7ef2",
    3: "8153c0beacf6fe3a9a6ef3136cf51f805d24b9c348ad24f310ab6224d97a6a3f",
    4: "f1b7a46429467b3bfba4a9110875490fba75419127daf25b92c58bd01d574bb2",
    5: "4b4af131e87be49e68131291e40c7e09dfb03df18b7059e4de62389021b96fa8",
    6: "0daf01208faea7acc11807e07e7251936a81731836d2b3e5a4c411656b2e4c15",
    7: "228976ff6011a0854985744128dd30499e6de64f39109f73badbf3e503cd4b23",
    8: "007daf5900d0f6c0639c3fd792c3a3a3cbed0a8649604437b4ff7369f308d558",
    9: "cb41118e88043e32dffffbd6f63923df90a15b0af3ed9c6cae1833f524b665fa",
}

# image -> (trace digest, virtual ns, MMIO exits, direct MMIO accesses)
IMAGE_RUNS = {
    "microvm-mmio": ("a5194bd1d3efc59ffa6477981fa2b5ba75dc62d512134f13588020d42b61d176",
                     255_681, 143, 0),
    "passthrough-pci": ("1f989c44c816ece7053977e37b079201a301dbf8d50ed1b42a1d3132b5631615",
                        261_881, 137, 124),
    "tenants-8": ("8fbe383230e7eddd1373f6f0855195e28dc8369c141e56dfefd78ca6af1d3c11",
                  101_299_180, 1216, 1088),
    # vDPA (issue 12): pinned when the images were added
    "vdpa-mmio": ("579983a804acc2715de0fba7a5fe24d4bde2c60e0bf863ed3d39accf47339893",
                  255_681, 143, 0),
    "vdpa-pci": ("9e39cdd2cfa766d56f5b2cf85be0b44876be41c9a2aa6b3dd59c24702cb1533c",
                 373_681, 261, 0),
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
