"""The catalogue: every scenario family, in report order."""
from __future__ import annotations

from typing import Iterable

from . import accel, packed, ring, registers, vdpa_user, vfio_user
from .core import Scenario

CATEGORIES = ("split ring", "packed ring", "status state machine", "virtio-mmio registers",
              "virtio-pci", "admin virtqueue", "vfio uAPI", "vDPA", "accelerator")


def catalogue() -> list[Scenario]:
    """Every scenario (names unique), grouped by category in CATEGORIES order."""
    scs = (ring.catalogue() + packed.catalogue() + registers.status_catalogue()
           + registers.mmio_catalogue() + registers.pci_catalogue() + registers.admin_catalogue() + vfio_user.catalogue()
           + vdpa_user.catalogue() + accel.catalogue())
    names = [s.name for s in scs]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise AssertionError(f"hostile catalogue: duplicate scenario names {dup}")
    order = {c: i for i, c in enumerate(CATEGORIES)}
    return sorted(scs, key=lambda s: order[s.category])


def select(scenarios: Iterable[Scenario], *, categories: Iterable[str] = (),
           names: Iterable[str] = ()) -> list[Scenario]:
    """Scenarios in any of `categories` (exact) whose name starts with any of `names`
    (empty: no filter)."""
    cats, prefixes = set(categories), tuple(names)
    return [s for s in scenarios if (not cats or s.category in cats)
            and (not prefixes or s.name.startswith(prefixes))]
