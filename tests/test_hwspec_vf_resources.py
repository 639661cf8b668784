"""hwspec.va1.VfResources: the one va1_vf_resources value type (packing and widths only)."""
from __future__ import annotations

import dataclasses
import struct

import pytest

from hwspec import HwspecError
from hwspec import va1 as A
from hwspec.va1 import VfResources


def test_fields_follow_the_layout_and_round_trip() -> None:
    assert VfResources.field_names() == A.VF_RESOURCES.names
    r = VfResources(device_memory=32 << 20, num_submit_queues=3, max_contexts=5, weight=7,
                    priority=2, exec_quantum_ns=123, preemption_timeout_ns=456)
    raw = r.encode()
    assert raw == struct.pack(A.VF_RESOURCES.format, *dataclasses.astuple(r))
    assert VfResources.decode(raw + b"tail") == r


def test_from_mapping_takes_dicts_objects_and_itself() -> None:
    r = VfResources(weight=4)
    assert VfResources.from_mapping(r) is r
    assert VfResources.from_mapping({"weight": 4, "not_a_field": 1}) == r
    assert VfResources.from_mapping(dataclasses.make_dataclass("O", [("weight", int)])(4)) == r


@pytest.mark.parametrize("field, value", [("weight", 1 << 32), ("device_memory", -1),
                                          ("priority", "1")])
def test_encode_refuses_a_value_its_field_cannot_hold(field: str, value: object) -> None:
    r = dataclasses.replace(VfResources(), **{field: value})  # type: ignore[arg-type]
    with pytest.raises(HwspecError, match=f"va1_vf_resources.{field}="):
        r.encode()


def test_decode_refuses_short_bytes() -> None:
    with pytest.raises(HwspecError, match="needs 40 bytes, got 8"):
        VfResources.decode(bytes(8))
    assert issubclass(HwspecError, ValueError)
