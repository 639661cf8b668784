"""Per-function and per-context counters on known workloads, host view and uAPI."""
from __future__ import annotations

import json
from typing import Any

import pytest

from userspace_runtime import CommandBufferBuilder, Device
from virtaccel.cli import main
from virtaccel.cli.stats import StatsCollector, format_stats, run_stats
from virtaccel import Session


def _run(program: Any) -> tuple[StatsCollector, Any]:
    with Session(attach="mmio", seed=0, memory=32 << 20) as session:
        stats = StatsCollector(session.machine)
        stats.add_vm(session.vm)
        result = session.run(program)
    return stats, result


@pytest.mark.parametrize("n", [1, 5])
def test_n_nop_submissions_count_n_commands_per_function_and_context(n: int) -> None:
    def program(os_: Any) -> dict[str, Any]:
        with Device(os_) as dev:
            ctx = dev.create_context()
            s = ctx.create_stream()
            nop = CommandBufferBuilder()
            nop.nop()
            for _ in range(n):
                s.enqueue(nop)
                s.flush()  # n separate submissions, queued back to back
            s.synchronize()
            cid = ctx.id
            out = {"stats": dev.stats(), "ctx": cid}
            ctx.destroy()
            return out

    stats, result = _run(program)
    f = stats.functions["vm0.va1.0"]
    assert f.submissions == n and f.commands == n and f.faults == 0
    assert f.device_time_ns > 0 and f.interrupts >= 1
    c = stats.contexts[("vm0.va1.0", result["ctx"])]
    assert (c.submissions, c.commands, c.faults) == (n, n, 0)
    assert c.device_time_ns == f.device_time_ns
    assert 1 <= c.queue_depth_hwm <= n
    assert max(f.queue_depth_hwm.values()) == c.queue_depth_hwm
    u = result["stats"]  # through DRM_IOCTL_VA1_GET_STATS
    assert u["submissions"] == n and u["commands"] == n
    assert u["device_time_ns"] == f.device_time_ns
    assert u["interrupts"] >= 1


def test_two_contexts_are_counted_apart_and_a_fault_is_attributed() -> None:
    def program(os_: Any) -> dict[str, int]:
        with Device(os_) as dev:
            good, bad = dev.create_context(), dev.create_context()
            s = good.create_stream()
            nop = CommandBufferBuilder()
            for _ in range(3):
                nop.nop()
            s.enqueue(nop)
            s.synchronize()
            t = bad.create_stream()
            oob = CommandBufferBuilder()
            oob.fill(dev.params["device_memory_size"], 64, 0)  # out of bounds
            t.enqueue(oob)
            with pytest.raises(Exception):
                t.synchronize()
            return {"good": good.id, "bad": bad.id}

    stats, ids = _run(program)
    g = stats.contexts[("vm0.va1.0", ids["good"])]
    b = stats.contexts[("vm0.va1.0", ids["bad"])]
    assert (g.submissions, g.commands, g.faults) == (1, 3, 0)
    assert (b.submissions, b.commands, b.faults) == (1, 0, 1)
    f = stats.functions["vm0.va1.0"]
    assert f.faults == 1 and f.commands == 3


def test_demo_stats_match_the_uapi_and_print() -> None:
    stats, result = run_stats(seed=0)
    assert result["ok"]
    f = stats.functions["vm0.va1.0"]
    assert f.uapi is not None
    assert (f.submissions, f.commands) == (f.uapi["submissions"], f.uapi["commands"])
    assert f.commands == result["commands"]
    assert f.device_time_ns == f.uapi["device_time_ns"]
    assert f.interrupts == f.uapi["interrupts"]
    text = format_stats(stats)
    assert "per function" in text and "per context" in text and "vm0.va1.0" in text


def test_cli_stats_json(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["stats", "--json", "-"]) == 0
    doc = json.loads(capsys.readouterr().out)
    (f,) = doc["functions"]
    assert f["function"] == "vm0.va1.0" and f["commands"] == f["uapi"]["commands"]
    assert doc["contexts"] and doc["contexts"][0]["bytes_moved"] is None
    assert main(["stats"]) == 0
    assert "per context" in capsys.readouterr().out
