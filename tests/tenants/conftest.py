"""Fixtures of the multi-tenant test kit (virtaccel.testing.tenants): a host with one VA-1
card, N VFs provisioned through the admin queue and bound to vfio-pci, one VM per VF.

Seeds are pinned; a failing test prints the seed that replays it (every assertion
message carries `SEED`)."""
from __future__ import annotations

from typing import Any, Callable, Iterator

import pytest

from device_model import Va1Config
from hwspec.va1 import VfResources
from virtaccel.testing.tenants import TenantBed

SEED = 20261122
SMALL_VF = VfResources(device_memory=16 << 20, num_submit_queues=2, max_contexts=16,
                       exec_quantum_ns=2_000, preemption_timeout_ns=10_000_000)


@pytest.fixture
def seed() -> int:
    return SEED


@pytest.fixture
def make_bed() -> Iterator[Callable[..., TenantBed]]:
    """make_bed(n, resources=..., **kw): a TenantBed closed at the end of the test."""
    beds: list[TenantBed] = []

    def make(n: int, *, resources: Any = None, seed: int = SEED, memory: int = 8 << 20,
             compute_units: int = 4, **kw: Any) -> TenantBed:
        bed = TenantBed(n, seed=seed, resources=resources if resources is not None else SMALL_VF,
                        memory=memory, card_config=Va1Config(num_compute_units=compute_units),
                        **kw)
        beds.append(bed)
        return bed

    yield make
    for b in beds:
        b.close()
