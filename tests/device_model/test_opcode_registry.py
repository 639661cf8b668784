"""One opcode registry (`commands.OPS`) for the decoder and the engine: every opcode of
hwspec.isa has a row, the rows say the truth about what the engine may assume (time-only
commands run nothing, only WAIT polls), and the dispatch goes through it."""
from __future__ import annotations

import dataclasses
import inspect
import re

import pytest
from dm_driver import Rig, fill, nop

from device_model.va1 import commands as C
from device_model.va1 import engine
from device_model.va1.ops import execute as ex
from device_model.ports import DmaPort
from hwspec.isa import Opcode


def test_every_opcode_has_a_row() -> None:
    missing = [op.name for op in Opcode if op not in C.OPS]
    assert missing == [], f"opcodes without a handler in commands.OPS: {missing}"
    assert set(C.OPS) == set(Opcode)


@pytest.mark.parametrize("op", list(Opcode), ids=lambda o: o.name)
def test_rows_are_callable_and_consistent(op: Opcode) -> None:
    spec = C.OPS[op]
    assert callable(spec.resolve) and callable(spec.execute)
    if spec.time_only:
        assert spec.execute is ex.no_effect and not spec.polls
        assert spec.host_bytes(C.Command(op, 0, 0, size=64)) == 0


def test_only_nop_is_time_only_and_only_wait_polls() -> None:
    assert {op for op, s in C.OPS.items() if s.time_only} == {Opcode.NOP}
    assert {op for op, s in C.OPS.items() if s.polls} == {Opcode.WAIT}


def test_exactly_the_commands_that_write_guest_memory_are_host_writes() -> None:
    """They are applied at their end time, never early (spec §6 "Write visibility")."""
    assert {op for op, s in C.OPS.items() if s.host_writes} == {
        Opcode.SIGNAL, Opcode.TIMESTAMP, Opcode.DMA_D2H}


def test_host_bytes_come_from_the_registry() -> None:
    sizes = {op: C.Command(op, 0, 0, size=4096).host_bytes for op in Opcode}
    assert sizes[Opcode.DMA_H2D] == sizes[Opcode.DMA_D2H] == sizes[Opcode.CALL] == 4096
    assert sizes[Opcode.SIGNAL] == sizes[Opcode.TIMESTAMP] == 8
    assert sizes[Opcode.GEMM] == sizes[Opcode.DMA_D2D] == sizes[Opcode.NOP] == 0


def test_engine_and_decoder_dispatch_only_through_the_registry() -> None:
    assert not re.search(r"Opcode\.[A-Z]", inspect.getsource(engine))
    src = inspect.getsource(C)
    for old in ("_RESOLVERS", "_HOST_BYTES", "_FLAGGED", "if opcode == Opcode.",
                "elif opcode"):
        assert old not in src, old


def test_a_row_is_what_the_engine_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[tuple[Opcode, int]] = []
    real = C.OPS[Opcode.FILL]

    def spy(cmd: C.Command, dma: DmaPort, start_ns: int) -> None:
        seen.append((cmd.opcode, cmd.offset))
        real.execute(cmd, dma, start_ns)

    monkeypatch.setitem(C.OPS, Opcode.FILL, dataclasses.replace(real, execute=spy))
    rig = Rig()
    ctx = rig.create_context()
    assert rig.submit(ctx, nop() + fill(0, 64, 0x01020304)).status == 0
    assert seen == [(Opcode.FILL, 8)]
    assert rig.dev.memory.read(0, 4) == bytes([4, 3, 2, 1])
