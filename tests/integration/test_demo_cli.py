"""The walking skeleton end to end: `virtaccel demo` and its determinism."""
from __future__ import annotations

import pytest

from virtaccel.guests import mlp
from virtaccel.cli import main
from virtaccel.cli.demo import run_demo


def test_demo_matches_numpy_and_reports_every_command() -> None:
    report = run_demo(seed=0)
    assert report.ok, report.result
    opcodes = [op for op, _ in report.commands]
    assert opcodes.count("GEMM") == 2
    assert "DMA_H2D" in opcodes and "DMA_D2H" in opcodes
    assert all(ns > 0 for _, ns in report.commands)
    assert report.virtual_ns >= sum(ns for _, ns in report.commands)


def test_same_seed_same_trace_digest_and_another_seed_another() -> None:
    a, b = run_demo(seed=11), run_demo(seed=11)
    assert a.digest == b.digest and len(a.digest) == 64
    assert a.result == b.result
    c = run_demo(seed=12)
    assert c.digest != a.digest
    assert c.result["output_checksum"] != a.result["output_checksum"]


def test_cli_prints_error_timings_and_digest(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "--seed", "3"]) == 0
    out = capsys.readouterr().out
    assert "max abs error vs numpy" in out and "OK" in out
    assert "GEMM" in out and " us" in out
    digest_lines = [ln for ln in out.splitlines() if ln.startswith("trace digest: ")]
    assert len(digest_lines) == 1 and len(digest_lines[0].split()[-1]) == 64
    assert digest_lines[0].split()[-1] == run_demo(seed=3).digest


def test_cli_exits_non_zero_when_the_result_does_not_match(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    real = mlp.reference

    def off_by_one(*args: object, **kwargs: object):  # type: ignore[no-untyped-def]
        return real(*args, **kwargs) + 1.0

    monkeypatch.setattr(mlp, "reference", off_by_one)
    assert main(["demo"]) == 1
    assert "MISMATCH" in capsys.readouterr().out


@pytest.mark.parametrize("argv,needle", [
    (["demo", "--seed", "abc"], "virtaccel demo: argument --seed: 'abc' is not an integer"),
    (["demo", "--seed", "-1"], "virtaccel demo: argument --seed: -1 is outside 0 .. 2**64-1"),
    (["frobnicate"], "virtaccel: argument VERB: invalid choice: 'frobnicate'"),
])
def test_cli_bad_arguments_get_a_clear_error(argv: list[str], needle: str,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(needle) and err.count("\n") == 1
