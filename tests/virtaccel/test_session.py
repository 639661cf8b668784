"""The launcher: what it builds for each attachment, its lifecycle guard, images, and
run_model."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

import virtaccel
from virtaccel import (LaunchError, Session, SessionState, SessionStateError, VirtaccelError,
                       VmSpec, run_model)
from virtaccel.guests import mlp
from hwspec.va1 import VfResources

SEED = 20261123
IMAGES = Path(__file__).resolve().parents[2] / "vm_images"
SMALL = {"batch": 4, "sizes": (16, 32, 8)}


def small_mlp(seed: int) -> Any:
    return lambda os_: mlp.main(os_, seed=seed, **SMALL)


@pytest.mark.parametrize("attach", ["mmio", "pci", "vfio"])
def test_each_single_vm_attachment_runs_the_same_mlp_bit_for_bit(attach: str) -> None:
    with Session(attach=attach, seed=SEED, memory=32 << 20) as s:
        result = s.run(small_mlp(SEED), name="mlp")
        vm = s.vm
    assert result["ok"] is True, f"seed {SEED}"
    with Session(attach="mmio", seed=SEED, memory=32 << 20) as ref:
        assert ref.run(small_mlp(SEED), name="mlp") == result
    assert s.state is SessionState.CLOSED and vm.closed
    if attach == "mmio":
        assert len(vm.accelerators) == 1 and s.host is None
    elif attach == "pci":
        assert len(vm.pci_accelerators) == 1 and s.host is None
    else:
        assert len(vm.passthrough) == 1 and s.host is not None
        assert s.direct_accesses > 0   # the BAR is mapped into the guest


def test_sriov_session_gives_each_vm_its_own_vf_and_per_vf_seeds() -> None:
    res = VfResources(device_memory=8 << 20, num_submit_queues=1, max_contexts=2)
    with Session(attach="sriov", seed=SEED, vms=3, memory=16 << 20, resources=res) as s:
        assert [vm.name for vm in s.vms] == ["vm1", "vm2", "vm3"]
        assert [vf.vf_index for vf in s.vfs] == [1, 2, 3]
        assert [vm.passthrough[0].host_function for vm in s.vms] == s.vfs
        seeds = [s.program_seed(i) for i in range(3)]
        tasks = s.run_all([small_mlp(x) for x in seeds])
    assert len(set(seeds)) == 3
    assert [t.result["ok"] for t in tasks] == [True] * 3, f"seed {SEED}"
    assert s.host is not None and s.host.iommu.fault_count == 0


def test_named_vms_with_their_own_resources() -> None:
    specs = [VmSpec("alice", 16 << 20, VfResources(device_memory=8 << 20, weight=2)),
             VmSpec("bob", 8 << 20)]
    with Session(attach="sriov", vms=specs, resources=VfResources(device_memory=4 << 20)) as s:
        assert s.vm_named("bob").memory.size == 8 << 20
        assert s.pf is not None
        drv = s.host.pf_driver(s.pf) if s.host is not None else None
        assert drv is not None
        assert drv.get_resources(1).weight == 2
        assert drv.get_resources(2).device_memory == 4 << 20
        with pytest.raises(KeyError, match="no VM named 'carol'"):
            s.vm_named("carol")


def test_same_seed_same_digest_and_another_seed_another() -> None:
    def digest(seed: int) -> str:
        with Session(seed=seed, memory=32 << 20) as s:
            s.run(small_mlp(seed))
        return s.digest()
    assert digest(5) == digest(5) != digest(6)


def test_lifecycle_guard_names_the_method_and_the_state() -> None:
    s = Session()
    assert s.state is SessionState.NEW
    with pytest.raises(SessionStateError, match=r"Session.spawn\(\) needs state ready; "
                                                r"the session is new"):
        s.spawn(small_mlp(0))
    with pytest.raises(SessionStateError, match="the session is new"):
        _ = s.machine
    s.launch()
    with pytest.raises(SessionStateError, match=r"Session.launch\(\) needs state new; "
                                                r"the session is ready"):
        s.launch()
    s.close()
    s.close()   # idempotent
    with pytest.raises(SessionStateError, match=r"Session.run_tasks\(\) .* the session is closed"):
        s.run_tasks()
    assert s.digest()   # still readable


def test_calls_from_inside_a_running_guest_are_refused() -> None:
    seen: dict[str, str] = {}

    def program(os_: Any) -> None:
        for what, call in (("close", s.close), ("spawn", lambda: s.spawn(small_mlp(0)))):
            try:
                call()
            except SessionStateError as e:
                seen[what] = str(e)

    with Session() as s:
        s.run(program)
    assert "running" in seen["close"] and "running" in seen["spawn"]


def test_a_multi_vm_session_has_no_single_vm() -> None:
    with Session(vms=2, memory=8 << 20) as s:
        assert [vm.name for vm in s.vms] == ["vm0", "vm1"]
        with pytest.raises(SessionStateError, match="has 2 VMs"):
            _ = s.vm
        with pytest.raises(IndexError, match="VM index 2"):
            s.spawn(small_mlp(0), vm=2)


@pytest.mark.parametrize("kwargs, message", [
    ({"attach": "usb"}, "attach 'usb': one of mmio, pci, vfio, sriov"),
    ({"seed": -1}, "seed -1 is outside"),
    ({"seed": 1 << 64}, "is outside 0 .. 2\\*\\*64-1"),
    ({"vms": 0}, "at least one VM"),
    ({"vms": ["a", "a"]}, "a repeated"),
])
def test_bad_arguments_are_refused_before_anything_is_built(kwargs: dict[str, Any],
                                                            message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Session(**kwargs)


def test_a_failed_launch_releases_what_it_built_and_says_what_failed() -> None:
    too_big = VfResources(device_memory=1 << 40)
    s = Session(attach="sriov", vms=2, memory=8 << 20, resources=too_big)
    with pytest.raises(LaunchError, match="sriov attachment") as info:
        s.launch()
    assert isinstance(info.value, VirtaccelError) and info.value.__cause__ is not None
    assert s.state is SessionState.FAILED and s.vms == []
    with pytest.raises(SessionStateError, match="the session is failed"):
        s.spawn(small_mlp(0))


def test_a_guest_exception_reaches_the_caller_unchanged() -> None:
    def program(os_: Any) -> None:
        raise ZeroDivisionError("guest says no")
    with Session() as s:
        with pytest.raises(ZeroDivisionError, match="guest says no"):
            s.run(program)


def test_from_image_builds_what_the_image_says() -> None:
    s = Session.from_image(IMAGES / "tenants-8.toml", seed=3)
    assert s.attach == "sriov" and s.seed == 3
    assert [v.name for v in s.specs] == [f"tenant{i}" for i in range(1, 9)]
    assert s.specs[6].resources is not None and s.specs[6].resources.weight == 4
    pt = Session.from_image(IMAGES / "passthrough-pci.toml")
    assert pt.attach == "vfio" and pt.specs[0].name == "passthrough-pci"
    with Session.from_image(IMAGES / "microvm-mmio.toml") as mm:
        assert mm.attach == "mmio" and len(mm.vm.accelerators) == 1


def test_command_times_and_chrome_trace(tmp_path: Path) -> None:
    with Session(seed=1, memory=32 << 20, keep_trace=True) as s:
        times = s.command_times()
        s.run(small_mlp(1))
    assert [op for op, _ in times.commands].count("GEMM") == 2
    assert times.total_ns > 0 and s.now_ns() >= times.total_ns
    doc = s.write_trace(str(tmp_path / "t.json"))
    assert (tmp_path / "t.json").stat().st_size > 0 and doc["traceEvents"]


def test_run_model_gives_outputs_and_a_report(tmp_path: Path) -> None:
    onnx = pytest.importorskip("onnx", reason="the onnx extra is not installed")
    from onnx import TensorProto, helper, numpy_helper
    w = np.arange(12, dtype=np.float32).reshape(4, 3) / 10
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"])], "mm",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])],
        [numpy_helper.from_array(w, "w")])
    path = tmp_path / "mm.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))
    x = np.ones((2, 4), np.float32)
    outputs, report = run_model(str(path), {"x": x}, seed=4, trace=tmp_path / "r.json")
    np.testing.assert_allclose(outputs["y"], x @ w, rtol=1e-6)
    assert report.commands and report.device_ns == sum(ns for _, ns in report.commands)
    assert report.virtual_ns >= report.device_ns > 0 and report.wall_s > 0
    assert len(report.digest) == 64 and (tmp_path / "r.json").exists()
    np.savez(tmp_path / "in.npz", x=x)
    again, report2 = run_model(path, str(tmp_path / "in.npz"), seed=4)
    np.testing.assert_array_equal(again["y"], outputs["y"])
    assert report2.digest == report.digest


def test_the_package_has_a_version_and_lazy_names() -> None:
    assert virtaccel.__version__ and virtaccel.__version__[0].isdigit()
    assert virtaccel.Session is Session
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        _ = virtaccel.nope  # type: ignore[attr-defined]  # noqa: B018


def test_a_bare_kernel_task_reaches_the_device_without_the_driver() -> None:
    from hwspec import virtio_mmio as VM
    seen: dict[str, int] = {}

    def program(kernel: Any) -> None:
        (dev,) = kernel.platform_devices
        seen["magic"] = kernel.mmio.read(dev.base + VM.MAGIC_VALUE, 4)
        seen["status"] = kernel.mmio.read(dev.base + VM.STATUS, 4)

    with Session(memory=8 << 20) as s:
        task = s.spawn_kernel(program, name="raw")
        s.run_tasks()
    assert task.error is None and task.name == "raw"
    assert seen["magic"] == VM.MAGIC and seen["status"] == 0   # no driver touched it
