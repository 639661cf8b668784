"""The CLI's conventions (README, "Commands"): --version, lazy verbs, --json FILE in
every verb, human tables, and bad input: one line `virtaccel <verb>: ...`, exit 2, no
traceback, checked before the work starts."""
from __future__ import annotations

import json
import os
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import virtaccel
from userspace_runtime.compiler import Graph, Target, compile_graph
from virtaccel.cli import main
from virtaccel.cli.tenants import default_duration_us

ROOT = Path(__file__).resolve().parents[2]
MMIO = str(ROOT / "vm_images" / "microvm-mmio.toml")
PT = str(ROOT / "vm_images" / "passthrough-pci.toml")
CLI = [sys.executable, "-m", "virtaccel.cli"]


def one_error_line(capsys: pytest.CaptureFixture[str], verb: str) -> str:
    """The single stderr line of a refused command (no traceback)."""
    err = capsys.readouterr().err
    assert err.startswith(f"virtaccel {verb}: ") and err.count("\n") == 1, err
    assert "Traceback" not in err
    return err


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A small compiled MLP (.vaelf) and an .npz of its input."""
    d = tmp_path_factory.mktemp("model")
    rng = np.random.default_rng(0)
    g = Graph("mlp")
    x = g.input("x", (4, 16))
    h = g.relu(g.add(g.matmul(x, g.constant(rng.standard_normal((16, 8), np.float32))),
                     g.constant(np.zeros(8, np.float32))))
    g.output(h, names=["y"])
    code = d / "mlp.vaelf"
    compile_graph(g, Target()).write(str(code))
    inputs = d / "in.npz"
    np.savez(inputs, x=rng.standard_normal((4, 16)).astype(np.float32))
    return code, inputs


# --- conventions ---------------------------------------------------------------------------

def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--version"]) == 0
    assert capsys.readouterr().out == f"virtaccel {virtaccel.__version__}\n"


def test_help_imports_neither_the_stack_nor_the_benchmarks() -> None:
    code = ("import sys; from virtaccel.cli import main; main(['--help']); "
            "heavy = [m for m in sys.modules if m.split('.')[0] in ('numpy', 'device_model', "
            "'vmm', 'guest_driver', 'userspace_runtime', 'rich', 'matplotlib') "
            "or m.startswith(('virtaccel.bench', 'virtaccel.session'))]; print(heavy)")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip().endswith("[]"), p.stdout[-300:]
    assert "bench" in p.stdout and "tenants" in p.stdout  # the verbs are listed


def test_run_prints_device_time_per_command_and_writes_trace_and_json(
        tmp_path: Path, model: tuple[Path, Path], capsys: pytest.CaptureFixture[str]) -> None:
    code, inputs = model
    out, trace, doc = tmp_path / "outputs", tmp_path / "t.json", tmp_path / "r.json"
    assert main(["run", str(code), "--inputs", str(inputs), "--out", str(out),
                 "--trace", str(trace), "--json", str(doc), "--seed", "0x10"]) == 0
    text = capsys.readouterr().out
    assert "\x1b" not in text  # not a terminal: plain text
    assert "GEMM" in text and "device us" in text and "total device" in text
    assert "virtual time" in text and "wall time:" in text and "seed 16" in text
    with np.load(out) as z:  # written to exactly --out (np.savez would add .npz)
        assert z.files == ["y"] and z["y"].shape == (4, 8)
    assert json.loads(trace.read_text())["traceEvents"]
    report = json.loads(doc.read_text())
    assert report["device_ns"] == sum(c["device_ns"] for c in report["commands"]) > 0
    assert report["virtual_ns"] >= report["device_ns"] and report["outputs"]["y"]["shape"] == [4, 8]


def test_compile_prints_a_summary_and_json_on_request(tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    onnx = pytest.importorskip("onnx")
    from onnx import TensorProto, helper, numpy_helper
    w = numpy_helper.from_array(np.ones((16, 8), np.float32), "w")
    g = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"]),
                           helper.make_node("Relu", ["y"], ["z"])], "m",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 16])],
                          [helper.make_tensor_value_info("z", TensorProto.FLOAT, [4, 8])], [w])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 21)])
    m.ir_version = 10
    src = tmp_path / "m.onnx"
    onnx.save(m, str(src))
    assert main(["compile", str(src), "-o", str(tmp_path / "m.vaelf")]) == 0
    text = capsys.readouterr().out
    assert "commands" in text and "workspace peak" in text and not text.startswith("{")
    assert main(["compile", str(src), "-o", str(tmp_path / "m.vaelf"), "--json", "-"]) == 0
    assert json.loads(capsys.readouterr().out)["commands"] > 0


def test_vm_run_trace_shows_mmio_exits(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace, doc = tmp_path / "pt.json", tmp_path / "run.json"
    assert main(["vm", "run", PT, "--trace", str(trace), "--json", str(doc)]) == 0
    text = capsys.readouterr().out
    assert "guest MMIO accesses" in text and "MSI-X table writes" in text
    mmio = json.loads(doc.read_text())["mmio"]["passthrough-pci"]
    assert mmio["writes_direct"] > 0 and mmio["writes_exit"] > 0 and mmio["msix_table_writes"] > 0
    events = json.loads(trace.read_text())["traceEvents"]
    exits = [e for e in events if e.get("name") in ("mmio_read", "mmio_write")]
    assert {e["args"]["exit"] for e in exits} == {True, False}


def test_json_dash_is_stdout_and_replaces_the_tables(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["vm", "run", MMIO, "--json", "-"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["ok"] is True and len(doc["digest"]) == 64


# --- one seed parser ------------------------------------------------------------------------

@pytest.mark.parametrize("argv", [["demo"], ["stats"], ["vm", "run", MMIO],
                                  ["run", "m.vaelf", "--inputs", "i.npz", "--out", "o.npz"],
                                  ["tenants", "--vfs", "1", "--weights", "1"]])
@pytest.mark.parametrize("seed,words", [("abc", "'abc' is not an integer"),
                                        ("-1", "-1 is outside 0 .. 2**64-1"),
                                        (str(1 << 64), f"{1 << 64} is outside 0 .. 2**64-1")])
def test_every_verb_parses_seeds_alike(argv: list[str], seed: str, words: str,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*argv, "--seed", seed]) == 2
    verb = " ".join(argv[:2]) if argv[0] == "vm" else argv[0]
    err = one_error_line(capsys, verb)
    assert f"argument --seed: {words}" in err


# --- bad input ------------------------------------------------------------------------------

@pytest.mark.parametrize("content,words", [(b"hello, not a model\n", "not an ONNX model"),
                                           (bytes(range(256)) * 4, "not an ONNX model"),
                                           (b"", "empty file")])
def test_compile_and_run_refuse_a_file_that_is_not_onnx(tmp_path: Path, content: bytes,
                                                        words: str, model: tuple[Path, Path],
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("onnx")
    bad = tmp_path / "bad.onnx"
    bad.write_bytes(content)
    assert main(["compile", str(bad), "-o", str(tmp_path / "x.vaelf")]) == 2
    assert words in one_error_line(capsys, "compile")
    assert not (tmp_path / "x.vaelf").exists()
    assert main(["run", str(bad), "--inputs", str(model[1]), "--out", str(tmp_path / "o")]) == 2
    assert words in one_error_line(capsys, "run")


def test_run_refuses_a_file_that_is_not_a_code_object(tmp_path: Path, model: tuple[Path, Path],
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.vaelf"
    bad.write_text("junk")
    assert main(["run", str(bad), "--inputs", str(model[1]), "--out", str(tmp_path / "o")]) == 2
    assert "not a VA-1 code object" in one_error_line(capsys, "run")


def _with_note(elf: bytes, desc: bytes) -> bytes:
    """`elf` with its VA-1 metadata note's descriptor replaced by `desc` (the new note
    is appended to the file and .note.va1's section header points at it)."""
    shoff, shnum, shstrndx = struct.unpack_from("<Q", elf, 40)[0], *struct.unpack_from(
        "<HH", elf, 60)
    strtab = struct.unpack_from("<Q", elf, shoff + shstrndx * 64 + 24)[0]
    for i in range(shnum):
        hdr = shoff + i * 64
        name = struct.unpack_from("<I", elf, hdr)[0]
        if elf[strtab + name:].startswith(b".note.va1\0"):
            note = struct.pack("<III", 5, len(desc), 0x5641) + b"VA-1\0\0\0\0" + desc
            out = bytearray(elf + b"\0" * (-len(elf) % 4))
            struct.pack_into("<QQ", out, hdr + 24, len(out), len(note))
            return bytes(out + note)
    raise AssertionError("no .note.va1")


@pytest.mark.parametrize("total,words", [(b"NaN", "NaN is not a JSON number"),
                                         (b"Infinity", "Infinity is not a JSON number"),
                                         (b"[" * 5000 + b"]" * 5000, "JSON nested 5002 levels deep"),
                                         (None, "memory.total is missing")])
def test_run_refuses_a_code_object_with_a_hostile_note(
        tmp_path: Path, model: tuple[Path, Path], total: bytes | None, words: str,
        capsys: pytest.CaptureFixture[str]) -> None:
    """memory.total NaN/Infinity (an OverflowError once), absent (a KeyError once) or
    nested deeper than json.loads recurses (a RecursionError once)."""
    from userspace_runtime import codeobject
    data = model[0].read_bytes()
    meta = codeobject.read(data).metadata
    del meta["memory"]["total"]
    desc = json.dumps(meta).encode()
    if total is not None:
        desc = desc.replace(b'"memory": {', b'"memory": {"total": ' + total + b", ")
    bad = tmp_path / "bad.vaelf"
    bad.write_bytes(_with_note(data, desc))
    assert main(["run", str(bad), "--inputs", str(model[1]), "--out", str(tmp_path / "o")]) == 2
    err = one_error_line(capsys, "run")
    assert "not a VA-1 code object" in err and "malformed metadata note" in err
    assert words in err
    assert not (tmp_path / "o").exists()


def test_compile_refuses_a_conv_with_stride_0(tmp_path: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    """A ZeroDivisionError once: now one line naming the node and the attribute."""
    onnx = pytest.importorskip("onnx")
    from onnx import TensorProto, helper, numpy_helper
    w = numpy_helper.from_array(np.ones((4, 3, 3, 3), np.float32), "w")
    g = helper.make_graph([helper.make_node("Conv", ["x", "w"], ["y"], name="stem",
                                            strides=[0, 0], auto_pad="SAME_UPPER")], "m",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 8, 8])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT,
                                                         [1, 4, 8, 8])], [w])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 21)])
    m.ir_version = 10
    src = tmp_path / "m.onnx"
    onnx.save(m, str(src))
    assert main(["compile", str(src), "-o", str(tmp_path / "m.vaelf")]) == 2
    err = one_error_line(capsys, "compile")
    assert "node stem (Conv): attribute strides [0, 0]" in err
    assert not (tmp_path / "m.vaelf").exists()


@pytest.mark.parametrize("flag", ["--out", "--trace", "--json"])
@pytest.mark.parametrize("kind", ["missing-dir", "directory"])
def test_unwritable_output_paths_are_refused_before_the_run(
        tmp_path: Path, flag: str, kind: str, capsys: pytest.CaptureFixture[str]) -> None:
    path = str(tmp_path / "no" / "such" / "f") if kind == "missing-dir" else str(tmp_path)
    argv = {"--out": str(tmp_path / "o.npz"), "--trace": None, "--json": None}
    argv[flag] = path
    # the model does not exist: the output check must come first to be named
    cmd = ["run", str(tmp_path / "missing.vaelf"), "--inputs", "in.npz"]
    for f, v in argv.items():
        if v is not None:
            cmd += [f, v]
    assert main(cmd) == 2
    err = one_error_line(capsys, "run")
    assert f"{flag} {path}: " in err
    assert ("does not exist" if kind == "missing-dir" else "is a directory") in err


@pytest.mark.parametrize("argv,flag", [
    (["compile", "m.onnx", "-o", "{bad}"], "--output"),
    (["demo", "--trace", "{bad}"], "--trace"),
    (["demo", "--json", "{bad}"], "--json"),
    (["stats", "--json", "{bad}"], "--json"),
    (["vm", "run", MMIO, "--trace", "{bad}"], "--trace"),
    (["vm", "run", MMIO, "--json", "{bad}"], "--json"),
    (["tenants", "--vfs", "2", "--weights", "1,1", "--json", "{bad}"], "--json"),
    (["bench", "--only", "a", "--json", "{bad}"], "--json"),
])
def test_every_verb_checks_its_outputs_first(tmp_path: Path, argv: list[str], flag: str,
                                             monkeypatch: pytest.MonkeyPatch,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    import virtaccel.cli.stats as stats_mod
    import virtaccel.bench as bench_mod

    def never(*a: Any, **k: Any) -> Any:
        raise AssertionError("the work started before the output path was checked")
    monkeypatch.setattr(stats_mod, "run_stats", never)
    monkeypatch.setattr(bench_mod, "run_bench", never)
    monkeypatch.setattr("virtaccel.cli.demo.run_demo", never)
    monkeypatch.setattr("virtaccel.images.run_image", never)
    monkeypatch.setattr("virtaccel.suites.tenants.run_tenants", never)
    bad = str(tmp_path / "missing" / "x")
    assert main([a.replace("{bad}", bad) for a in argv]) == 2
    verb = " ".join(argv[:2]) if argv[0] == "vm" else argv[0]
    assert f"{flag} {bad}: directory" in one_error_line(capsys, verb)


def test_inputs_must_be_a_valid_npz(tmp_path: Path, model: tuple[Path, Path],
                                    capsys: pytest.CaptureFixture[str]) -> None:
    code = str(model[0])
    npy = tmp_path / "x.npy"
    np.save(npy, np.ones(3, np.float32))
    corrupt = tmp_path / "corrupt.npz"
    corrupt.write_bytes(b"PK\x03\x04" + b"garbage" * 20)
    text = tmp_path / "text.npz"
    text.write_text("x = 1, 2, 3\n")
    pickled = tmp_path / "pickled.npz"
    np.savez(pickled, x=np.array([{"a": 1}], dtype=object))
    cases = [(npy, "a .npy file"), (corrupt, "not a valid .npz"),
             (text, "not a valid .npz"), (pickled, "not a valid .npz (holds pickled objects)")]
    for path, words in cases:
        assert main(["run", code, "--inputs", str(path), "--out", str(tmp_path / "o")]) == 2
        err = one_error_line(capsys, "run")
        assert f"--inputs {path}: {words}" in err and "allow_pickle" not in err


@pytest.mark.parametrize("value", ["-5", "0", "63", str(1 << 32)])
def test_scratchpad_must_be_a_sane_size(value: str, tmp_path: Path,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["compile", "m.onnx", "-o", str(tmp_path / "x"), "--scratchpad", value]) == 2
    assert f"argument --scratchpad: {int(value)} is outside 64 .. 2**32-1" in \
        one_error_line(capsys, "compile")


@pytest.mark.parametrize("field,value", [
    ("num_compute_units", 5_000_000_000),   # wider than its u32 register
    ("device_memory_size", 1 << 40),        # more than a host holds
    ("num_compute_units", 100_000),         # minutes of engine set-up
    ("num_submit_queues", 65),
    ("max_cmdbuf_size", 0),
    ("max_contexts", 0),
    ("scratchpad_size", 1 << 32),
    ("peak_flops", 1 << 64),
])
def test_image_config_out_of_range_is_refused_before_anything_is_built(
        tmp_path: Path, field: str, value: int, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    import virtaccel.images as images
    from virtaccel.session import Session
    img = tmp_path / "big.toml"
    img.write_text(f'name = "x"\n[accelerator]\nmode = "emulated"\n'
                   f'[accelerator.config]\n{field} = {value}\n')

    def built(*a: object, **k: object) -> None:
        raise AssertionError("the image was run or a session launched")
    monkeypatch.setattr(images, "run_image", built)
    monkeypatch.setattr(Session, "launch", built)
    assert main(["vm", "run", str(img)]) == 2
    err = one_error_line(capsys, "vm run")
    assert f"{img}: accelerator.config.{field}: {value} is outside" in err


@pytest.mark.parametrize("resources,words", [
    ("max_contexts = 5000", "not enough free resources"),          # refused by the PF
    ("num_submit_queues = 20", "num_submit_queues: 20 is outside 1 .. 16"),
    ('device_memory = "1500K"', "must be a multiple of 1 MiB"),
])
def test_sriov_image_with_refused_vf_resources(tmp_path: Path, resources: str, words: str,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    img = tmp_path / "vf.toml"
    img.write_text('name = "vf"\n[accelerator]\nmode = "sriov-vf"\n'
                   f'[accelerator.resources]\n{resources}\n[[tenant]]\nname = "a"\n')
    assert main(["vm", "run", str(img)]) == 2
    err = one_error_line(capsys, "vm run")
    assert str(img) in err and words in err and "Errno" not in err


# --- interrupts, pipes, unexpected errors ---------------------------------------------------

def test_ctrl_c_is_one_line_and_130(monkeypatch: pytest.MonkeyPatch,
                                    capsys: pytest.CaptureFixture[str]) -> None:
    def interrupted(*a: Any, **k: Any) -> Any:
        raise KeyboardInterrupt
    monkeypatch.setattr("virtaccel.cli.demo.run_demo", interrupted)
    assert main(["demo"]) == 130
    assert capsys.readouterr().err == "virtaccel: interrupted\n"


def test_sigint_during_a_long_tenants_run() -> None:
    p = subprocess.Popen([*CLI, "tenants", "--vfs", "4", "--weights", "1,1,1,1",
                          "--duration-us", "1000000"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    time.sleep(2.0)
    assert p.poll() is None
    p.send_signal(signal.SIGINT)
    out, err = p.communicate(timeout=60)
    assert p.returncode == 130
    assert err == "virtaccel: interrupted\n"


def test_closed_stdout_ends_quietly(model: tuple[Path, Path]) -> None:
    """`virtaccel objdump X | head -1`: the reader is gone; no traceback."""
    r, w = os.pipe()
    os.close(r)
    try:
        p = subprocess.run([*CLI, "objdump", str(model[0])], stdout=w, stderr=subprocess.PIPE,
                           text=True, timeout=60)
    finally:
        os.close(w)
    assert p.stderr == "" and p.returncode == 1


def test_pipe_into_head() -> None:
    p = subprocess.run(f"{sys.executable} -m virtaccel.cli --help | head -1",
                       shell=True, capture_output=True, text=True, timeout=60)
    assert p.stdout.startswith("usage: virtaccel") and p.stderr == ""


def test_unexpected_error_is_one_line_and_exit_1(monkeypatch: pytest.MonkeyPatch,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    def boom(*a: Any, **k: Any) -> Any:
        raise RuntimeError("boom\nsecond line")
    monkeypatch.setattr("virtaccel.cli.demo.run_demo", boom)
    assert main(["demo"]) == 1
    err = capsys.readouterr().err
    assert err == ("virtaccel demo: internal error: RuntimeError: boom "
                   "(set VIRTACCEL_DEBUG=1 for the traceback)\n")
    monkeypatch.setenv("VIRTACCEL_DEBUG", "1")
    with pytest.raises(RuntimeError, match="boom"):
        main(["demo"])


# --- tenants: a default duration for every N ------------------------------------------------

def test_default_duration_outlasts_the_boot_spread_at_every_n() -> None:
    # start spread of the tenants with an aggressor flooding (virtual us, measured)
    spread = {2: 180, 16: 500, 32: 1610, 48: 4312, 64: 6379}
    for n, s in spread.items():
        assert default_duration_us(n, 1) - s >= 1000
        assert default_duration_us(n, None) == 1000  # no aggressor: a few us of spread
    assert all(default_duration_us(n, 1) >= default_duration_us(n - 1, 1) for n in range(2, 65))


def test_tenants_64_vfs_with_the_default_duration(tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "t.json"
    assert main(["tenants", "--vfs", "64", "--weights", ",".join(["1"] * 64),
                 "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "window is empty" not in text and "1000 us each" in text
    doc = json.loads(out.read_text())
    assert doc["all_correct"] and doc["window_ns"][1] > doc["window_ns"][0]


@pytest.mark.parametrize("value,words", [("-1", "--blas-threads -1: a count >= 0"),
                                         ("two", "--blas-threads: invalid int value")])
def test_bench_refuses_a_bad_blas_thread_count(value: str, words: str,
                                               monkeypatch: pytest.MonkeyPatch,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    import virtaccel.bench as bench_mod

    def never(*a: Any, **k: Any) -> Any:
        raise AssertionError("the bench ran with a bad --blas-threads")
    monkeypatch.setattr(bench_mod, "run_bench", never)
    assert main(["bench", "--only", "g", "--blas-threads", value]) == 2
    assert words in one_error_line(capsys, "bench")
