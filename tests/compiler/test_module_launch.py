"""Module/Function on the device: load from bytes or a file, look a function up,
launch with numpy inputs; inputs of the wrong dtype, shape or name are refused before
anything is submitted; a device fault names the graph node."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from guest_driver import uapi
from userspace_runtime import Device
from userspace_runtime.compiler import compile_graph, run_reference
from userspace_runtime.module import Module
from virtaccel.models import run_in_vm

from . import models

CODE = compile_graph(models.mlp()).code_object


def _in_guest(program: Any) -> Any:
    return run_in_vm(program, seed=11)


def test_load_from_file_launch_twice_and_look_up(tmp_path: Path) -> None:
    path = tmp_path / "mlp.vaelf"
    path.write_bytes(CODE)
    module = Module.from_file(path)
    assert module.function_names == ["main"]
    x1 = np.random.default_rng(0).standard_normal((4, 16)).astype(np.float32)
    x2 = x1 * 2

    def program(os_: uapi.GuestOS) -> dict[str, Any]:
        with Device(os_) as dev:
            ctx = dev.create_context()
            s = ctx.create_stream()
            loaded = module.load(ctx)
            fn = loaded.function("main")
            with pytest.raises(KeyError, match="no function 'nope'"):
                loaded.function("nope")
            pend = fn.launch(s, {"x": x1})            # asynchronous form
            second = fn(s, [x2])                       # positional, synchronous
            first = {k: p.result() for k, p in pend.items()}
            into = np.zeros((4, 8), np.float32)
            fn.launch(s, {"x": x1}, outputs={"logits": into})["logits"].result()
            assert np.array_equal(into, first["logits"])
            with pytest.raises(ValueError, match="output 'logits' must be a float32 array"):
                fn.launch(s, {"x": x1}, outputs={"logits": np.zeros(3)})
            return {"first": first, "second": second,
                    "inputs": [a.name for a in fn.inputs],
                    "outputs": [(a.name, a.shape, a.dtype) for a in fn.outputs]}

    r = _in_guest(program)
    g = models.mlp()
    np.testing.assert_allclose(r["first"]["logits"], run_reference(g, {"x": x1})["logits"],
                               atol=1e-5)
    np.testing.assert_allclose(r["second"]["logits"], run_reference(g, {"x": x2})["logits"],
                               atol=1e-5)
    assert r["inputs"] == ["x"] and r["outputs"] == [("logits", (4, 8), "float32")]


@pytest.mark.parametrize("inputs, error, message", [
    ({"x": np.zeros((4, 16), np.float64)}, TypeError, "input 'x' has dtype float64, expected float32"),
    ({"x": np.zeros((4, 15), np.float32)}, ValueError, r"input 'x' has shape \(4, 15\), expected \(4, 16\)"),
    ({"y": np.zeros((4, 16), np.float32)}, ValueError, r"unknown inputs \['y'\]"),
    ({}, ValueError, r"missing inputs \['x'\]"),
    ([], ValueError, "0 inputs given, 1 expected"),
])
def test_bad_launch_inputs_are_refused(inputs: Any, error: type[Exception], message: str) -> None:
    module = Module.from_bytes(CODE)

    def program(os_: uapi.GuestOS) -> tuple[int, str]:
        with Device(os_) as dev:
            ctx = dev.create_context()
            s = ctx.create_stream()
            fn = module.load(ctx).function()
            with pytest.raises(error, match=message):
                fn.launch(s, inputs)
            return s.pending_commands, repr(s.error)

    assert _in_guest(program) == (0, "None")


def test_device_fault_names_the_graph_node() -> None:
    """Corrupt one relocated address after loading: the DeviceError names the node."""
    module = Module.from_bytes(CODE)

    def program(os_: uapi.GuestOS) -> str:
        from userspace_runtime import CommandBufferBuilder, DeviceError
        with Device(os_) as dev:
            ctx = dev.create_context()
            s = ctx.create_stream()
            fn = module.load(ctx).function()
            bad = CommandBufferBuilder()
            data = bytearray(fn.commands.bytes())
            data[24:32] = (dev.params["device_memory_size"] - 8).to_bytes(8, "little")
            for rec in fn.commands.commands:
                bad.raw(rec.opcode, bytes(data[rec.offset + 8:rec.offset + rec.length]),
                        flags=int.from_bytes(data[rec.offset + 2:rec.offset + 4], "little"),
                        name=rec.name)
            s.enqueue(bad, module.load(ctx).buffers)
            with pytest.raises(DeviceError) as ei:
                s.synchronize()
            return str(ei.value.command)

    assert "main:" in _in_guest(program)


def test_target_from_device_config_tiles_to_its_scratchpad() -> None:
    """Compile in the guest for the device's own scratchpad_size (GET_PARAM)."""
    from device_model import Va1Config
    from userspace_runtime.compiler import Target
    from virtaccel import Session

    g = models.mlp(batch=16, sizes=(64, 64, 8))
    x = np.random.default_rng(3).standard_normal((16, 64)).astype(np.float32)

    def program(os_: uapi.GuestOS) -> dict[str, Any]:
        with Device(os_) as dev:
            target = Target.from_params(dev.params)
            result = compile_graph(g, target)
            ctx = dev.create_context()
            s = ctx.create_stream()
            out = Module.from_bytes(result.code_object).load(ctx).function()(s, {"x": x})
            return {"scratchpad": target.scratchpad_size, "commands": result.commands,
                    "out": out["logits"]}

    with Session(attach="mmio", seed=1, memory=64 << 20,
                 config=Va1Config(scratchpad_size=4096)) as session:
        r = session.run(program)
    assert r["scratchpad"] == 4096 and r["commands"] > compile_graph(g).commands
    np.testing.assert_allclose(r["out"], run_reference(g, {"x": x})["logits"], atol=1e-5)


def test_int8_graph_for_a_float_only_target_is_refused() -> None:
    from userspace_runtime.compiler import CompileOptions, LoweringError, Target
    g = models.mlp()
    cal = [{"x": np.ones((4, 16), np.float32)}]
    with pytest.raises(LoweringError, match="int8, which the target's dtype_mask 0x3"):
        compile_graph(g, Target(dtype_mask=3), CompileOptions(calibration=cal))
