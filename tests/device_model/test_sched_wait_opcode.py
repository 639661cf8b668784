"""The WAIT opcode: encoding (builder, decode, disassemble), validation, and its
behaviour on a single-function device."""
from __future__ import annotations

import struct

import pytest
from dm_driver import Rig

from device_model import Va1Config
from hwspec import isa
from userspace_runtime._builder import CommandBufferBuilder, decode, disassemble


def test_builder_encodes_wait_and_decode_round_trips() -> None:
    b = CommandBufferBuilder()
    off = b.wait(0x4000_1000, 7)
    assert off == 0
    raw = b.bytes()
    assert raw == struct.pack("<HHIQQ", 0x22, 0, 24, 0x4000_1000, 7)
    (cmd,) = decode(raw)
    assert cmd.opcode == isa.Opcode.WAIT and cmd.fields == {"addr": 0x4000_1000, "value": 7}
    text = disassemble(raw)
    assert "WAIT" in text and "addr=0x40001000" in text and "value=7" in text
    with pytest.raises(ValueError):
        b.wait(-1, 0)
    with pytest.raises(ValueError):
        b.wait(0x1000, 1 << 64)


def test_wait_validation_checks_the_iova_and_length() -> None:
    rig = Rig(Va1Config(device_memory_size=1 << 20))
    ctx = rig.create_context()
    bad = struct.pack("<HHIQQ", 0x22, 0, 24, 0x10, 1)            # outside guest RAM
    r = rig.submit(ctx, struct.pack("<HHI", 0, 0, 8) + bad)
    assert (r.status, r.error_offset) == (8, 8)                 # DMA_FAULT at the WAIT
    ctx = rig.create_context()
    short = struct.pack("<HHIQ", 0x22, 0, 16, rig.dma.base)
    r = rig.submit(ctx, short)
    assert (r.status, r.error_offset) == (4, 0)                 # BAD_LENGTH


def test_wait_satisfied_at_once_costs_one_command() -> None:
    cfg = Va1Config(device_memory_size=1 << 20)
    rig = Rig(cfg)
    ctx = rig.create_context()
    flag = rig.alloc.alloc(8, 8)
    rig.dma.g_write(flag, struct.pack("<Q", 10))
    r = rig.submit(ctx, struct.pack("<HHIQQ", 0x22, 0, 24, flag, 10))
    assert r.status == 0 and r.end_ns - r.start_ns == cfg.cmd_overhead_ns


def test_wait_on_a_single_function_times_out_after_the_default_timeout() -> None:
    from hwspec import va1
    rig = Rig(Va1Config(device_memory_size=1 << 20))
    ctx = rig.create_context()
    flag = rig.alloc.alloc(8, 8)
    n0 = rig.clock.seq
    r = rig.submit(ctx, struct.pack("<HHIQQ", 0x22, 0, 24, flag, 1))
    assert (r.status, r.error_offset) == (16, 0)
    assert r.end_ns - r.start_ns == va1.DEFAULT_PREEMPTION_TIMEOUT_NS
    # backoff: about timeout / WAIT_POLL_MAX_NS events, not timeout / 1 us
    assert rig.clock.seq - n0 < va1.DEFAULT_PREEMPTION_TIMEOUT_NS // isa.WAIT_POLL_MAX_NS + 50
    assert rig.dev.contexts[ctx].faulted
