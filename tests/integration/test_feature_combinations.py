"""Issue 13, done when: the MLP gives bit-identical results and device time for every
combination of {split, packed} x {INDIRECT_DESC} x {EVENT_IDX} x {IN_ORDER} x
{NOTIFICATION_DATA}, on virtio-mmio and virtio-pci, emulated and passthrough (mmio,
pci, vfio, sriov): 32 x 4 = 128 runs of a small MLP, each compared with the run of
today's default features on the same attachment, and each checked to have negotiated
exactly the features asked for."""
from __future__ import annotations

import functools
import itertools
from typing import Any

import numpy as np
import pytest

from guest_driver import uapi
from virtaccel.guests.mlp import WEIGHTS, alloc_buffers, enqueue_layers, make_inputs
from virtaccel.session import Session, feature_mask
from userspace_runtime import Device

OPTIONS = ("packed", "indirect", "event_idx", "in_order", "notification_data")
COMBINATIONS = [tuple(n for n, on in zip(OPTIONS, bits) if on)
                for bits in itertools.product((False, True), repeat=len(OPTIONS))]
ATTACHMENTS = ("mmio", "pci", "vfio", "sriov")
SIZES = (32, 48, 16)
BATCH = 8


def _mlp(os: uapi.GuestOS, seed: int) -> dict[str, Any]:
    """The demo MLP, small, returning its output bytes, device time and the features
    the driver negotiated."""
    inp = make_inputs(seed, BATCH, SIZES)
    with Device(os) as dev:
        ctx = dev.create_context()
        bufs = alloc_buffers(ctx, BATCH, SIZES)
        stream = ctx.create_stream(queue=0)
        for name in WEIGHTS:
            stream.upload(bufs[name], inp[name])
        enqueue_layers(stream, bufs)
        out = stream.download(bufs["y"])
        stream.synchronize()
        result = np.asarray(out.result())
        device_ns = [s.device_ns for s in stream.submissions]
        ctx.destroy()
    features = next(iter(os.devices.values())).features  # type: ignore[attr-defined]
    return {"y": result.tobytes(), "device_ns": device_ns, "features": features}


def _run(attach: str, features: tuple[str, ...] | None) -> dict[str, Any]:
    with Session(attach=attach, seed=5, guest_features=features) as s:
        times = s.command_times()
        r = s.run(functools.partial(_mlp, seed=5))
    r["commands"] = list(times.commands)
    return r


@pytest.fixture(scope="module")
def baselines() -> dict[str, dict[str, Any]]:
    """Each attachment with today's default features (no choice made)."""
    return {a: _run(a, None) for a in ATTACHMENTS}


@pytest.mark.parametrize("attach", ATTACHMENTS)
def test_every_ring_feature_combination_gives_the_same_mlp(
        attach: str, baselines: dict[str, dict[str, Any]]) -> None:
    base = baselines[attach]
    assert feature_mask(("indirect", "event_idx")) & base["features"] == \
        feature_mask(("indirect", "event_idx"))
    for combo in COMBINATIONS:
        r = _run(attach, combo)
        optional = feature_mask(OPTIONS)
        assert r["features"] & optional == feature_mask(combo), (attach, combo)
        assert r["y"] == base["y"], (attach, combo)
        assert r["device_ns"] == base["device_ns"], (attach, combo)
        assert r["commands"] == base["commands"], (attach, combo)
