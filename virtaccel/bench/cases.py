"""The benchmark cases (a)-(h). Each measures its value and its baseline in the same
run, interleaving repetitions so that machine noise hits both alike, and returns a Row.

Sizes are parameters so that tests can run a tiny smoke of the real code paths; the
`Sizes.full()` numbers are the issue's.
"""
from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np

from device_model import Va1Config
from guest_driver.uapi import GuestOS

from hwspec.va1 import VfResources

from ..session import Session
from . import ring as bare
from .profile import ProfileSet
from .rows import Row, cost_row, missing_row, rate_row, speed_row

_pc = time.perf_counter
PROFILE_REPS = 20  # repetitions run under the profiler when a row misses its target
_MIB = 1 << 20


@dataclass(frozen=True)
class Sizes:
    """Problem sizes and repetition counts of every case."""
    gemm_n: int = 1024
    gemm_reps: int = 15
    mlp_batch: int = 64
    mlp_sizes: tuple[int, int, int] = (512, 1024, 256)
    mlp_reps: int = 31
    dma_bytes: int = 64 * _MIB
    dma_reps: int = 21
    null_reps: int = 300
    ring_loops: int = 20
    ring_loop_len: int = 1000
    nop_per_buffer: int = 4096
    nop_buffers: int = 4
    nop_reps: int = 5
    ring_batch: int = 256
    vms_small: int = 8
    vms_large: int = 64
    vm_reps: int = 7
    vm_ram: int = 16 * _MIB
    vm_device_memory: int = 4 * _MIB
    startup_reps: int = 9
    resnet_hw: int = 224
    resnet_width: int = 64
    resnet_reps: int = 5
    # BLAS threads of the stack and of every baseline alike (numpy's BLAS through
    # threadpoolctl, onnxruntime's intra-op threads); 0: the library's default.
    blas_threads: int = 1
    rss_submissions: int = 1_000_000
    rss_warmup: int = 10_000
    rss_batch: int = 256

    @classmethod
    def full(cls) -> "Sizes":
        return cls()

    @classmethod
    def smoke(cls) -> "Sizes":
        """Minimal sizes: every code path once or twice, in well under a second each."""
        return cls(gemm_n=32, gemm_reps=2, mlp_batch=4, mlp_sizes=(16, 32, 8), mlp_reps=2,
                   dma_bytes=64 << 10, dma_reps=2, null_reps=3, ring_loops=2,
                   ring_loop_len=10, nop_per_buffer=16, nop_buffers=2, nop_reps=2,
                   ring_batch=16, vms_small=1, vms_large=2, vm_reps=1, startup_reps=2,
                   resnet_hw=32, resnet_width=8, resnet_reps=1, rss_submissions=300,
                   rss_warmup=50, rss_batch=16)


def run_in_vm(program: Callable[[GuestOS], Any], *, attach: str = "mmio",
              memory: int = 256 * _MIB, config: Va1Config | None = None,
              profiles: ProfileSet | None = None) -> Any:
    """`program(os)` in one VM with one VA-1 (`attach`: "mmio" emulated, "vfio" a host
    function assigned by VFIO); its result. With `profiles`, the phase recorder watches
    the trace."""
    with Session(attach=attach, memory=memory, config=config) as session:
        if profiles is not None:
            profiles.attach(session.machine)
        return session.run(program, name="bench")


def _runtime() -> Any:
    import userspace_runtime
    return userspace_runtime


# --- (a) GEMM ------------------------------------------------------------------------

def gemm(sz: Sizes, profiles: ProfileSet | None = None) -> Row:
    """(a) f32 GEMM n^3 on the device, compute only (operands already in device
    memory; launch + synchronize timed) vs numpy `a @ b` on the same arrays."""
    rt = _runtime()
    n = sz.gemm_n
    rng = np.random.default_rng(1)
    a = rng.standard_normal((n, n), dtype=np.float32)
    b = rng.standard_normal((n, n), dtype=np.float32)

    def program(os_: GuestOS) -> tuple[list[float], list[float]]:
        dev_t: list[float] = []
        base_t: list[float] = []
        with rt.Device(os_) as dev:
            ctx = dev.create_context()
            da, db, dc = (ctx.alloc((n, n), np.float32) for _ in range(3))
            s = ctx.create_stream()
            s.upload(da, a)
            s.upload(db, b)
            s.gemm(da, db, dc)  # warm-up (also pages in device memory)
            s.synchronize()
            _ = a @ b
            for _ in range(sz.gemm_reps):
                t0 = _pc()
                s.gemm(da, db, dc)
                s.synchronize()
                dev_t.append(_pc() - t0)
                t0 = _pc()
                _ = a @ b
                base_t.append(_pc() - t0)
            if profiles is not None:
                with profiles.section():
                    for _ in range(PROFILE_REPS):
                        profiles.mark("begin")
                        s.gemm(da, db, dc)
                        s.synchronize()
                        profiles.mark("end")
            out = s.download(dc)
            s.synchronize()
            if not np.allclose(out.result(), a @ b, rtol=1e-4, atol=1e-3):
                raise AssertionError("bench gemm: device result differs from numpy")
            ctx.destroy()
        return dev_t, base_t

    dev_t, base_t = run_in_vm(program, profiles=profiles)
    return speed_row(f"a_gemm_f32_{n}", dev_t, base_t, 0.90,
                     f"launch+sync of one GEMM, operands on device; median of "
                     f"{sz.gemm_reps}, interleaved", sz.gemm_reps)


# --- (b) MLP end to end ----------------------------------------------------------------

def mlp(sz: Sizes, profiles: ProfileSet | None = None) -> Row:
    """(b) the demo MLP end to end: upload x and the weights, two GEMMs with fused bias and
    ReLU, download y, synchronize; vs the same MLP in numpy (workloads.mlp.reference)."""
    rt = _runtime()
    from virtaccel.guests import mlp as wl

    batch, sizes = sz.mlp_batch, sz.mlp_sizes
    d0, d1, d2 = sizes
    inp = wl.make_inputs(0, batch, sizes)
    ref = wl.reference(inp["x"], inp["w1"], inp["b1"], inp["w2"], inp["b2"])

    def program(os_: GuestOS) -> tuple[list[float], list[float]]:
        dev_t: list[float] = []
        base_t: list[float] = []
        with rt.Device(os_) as dev:
            ctx = dev.create_context()
            bufs = wl.alloc_buffers(ctx, batch, sizes)
            s = ctx.create_stream()
            host = wl.pin_inputs(dev, inp)
            y = dev.alloc_host(bufs["y"].shape, bufs["y"].dtype)

            def once() -> np.ndarray:
                for name in wl.WEIGHTS:
                    s.upload(bufs[name], host[name])
                wl.enqueue_layers(s, bufs)
                out = s.download(bufs["y"], out=y)
                s.synchronize()
                res: np.ndarray = out.result()
                return res

            def numpy_once() -> np.ndarray:
                return wl.reference(inp["x"], inp["w1"], inp["b1"], inp["w2"], inp["b2"])

            once()
            numpy_once()
            for _ in range(sz.mlp_reps):
                t0 = _pc()
                res = once()
                dev_t.append(_pc() - t0)
                t0 = _pc()
                numpy_once()
                base_t.append(_pc() - t0)
            if profiles is not None:
                with profiles.section():
                    for _ in range(PROFILE_REPS):
                        profiles.mark("begin")
                        once()
                        profiles.mark("end")
            if not np.allclose(res, ref, atol=1e-4):
                raise AssertionError("bench mlp: device result differs from numpy")
            ctx.destroy()
        return dev_t, base_t

    dev_t, base_t = run_in_vm(program, profiles=profiles)
    return speed_row("b_mlp_e2e", dev_t, base_t, 0.80,
                     f"batch {batch}, {d0}->{d1}->{d2}: 5 uploads (from pinned host arrays) "
                     f"+ 2 GEMM(+bias,relu) + download (into a pinned array) + sync; median of "
                     f"{sz.mlp_reps}, interleaved", sz.mlp_reps)


# --- (c) DMA through the IOMMU -----------------------------------------------------------

DMA_TARGET = 0.90


def dma(sz: Sizes, profiles: ProfileSet | None = None) -> list[Row]:
    """(c) DMA_H2D and DMA_D2H of `dma_bytes` between a pinned HOST buffer and device
    memory, on a host VA-1 function assigned to the VM by VFIO passthrough (its DMA goes
    through the host IOMMU, guest RAM mapped at IOVA = GPA); vs np.copyto of the same
    bytes."""
    rt = _runtime()
    nbytes = sz.dma_bytes
    src = np.random.default_rng(2).integers(-128, 128, nbytes, dtype=np.int8)

    def program(os_: GuestOS) -> dict[str, list[float]]:
        t: dict[str, list[float]] = {"h2d": [], "d2h": [], "copy_h2d": [], "copy_d2h": []}
        with rt.Device(os_) as dev:
            ctx = dev.create_context()
            dbuf = ctx.alloc((nbytes,), np.int8)
            # Public API only: a pinned host array (Device.alloc_host) is the runtime's
            # documented fast way; upload from it and download into it are one DMA each.
            host = dev.alloc_host((nbytes,), np.int8)
            np.copyto(host, src)
            other = np.empty(nbytes, np.int8)
            other.fill(0)  # page it in, as device memory already is
            s = ctx.create_stream()

            def up() -> float:
                t0 = _pc()
                s.upload(dbuf, host)
                s.synchronize()
                return _pc() - t0

            def down() -> float:
                t0 = _pc()
                s.download(dbuf, out=host).result()
                return _pc() - t0

            up()
            down()
            for _ in range(sz.dma_reps):
                t["h2d"].append(up())
                t0 = _pc()
                np.copyto(other, host)
                t["copy_h2d"].append(_pc() - t0)
                t["d2h"].append(down())
                t0 = _pc()
                np.copyto(host, other)
                t["copy_d2h"].append(_pc() - t0)
            if profiles is not None:
                with profiles.section():
                    for _ in range(PROFILE_REPS):
                        profiles.mark("begin")
                        up()
                        down()
                        profiles.mark("end")
            host[:] = 0
            down()
            if not np.array_equal(host, src):
                raise AssertionError("bench dma: D2H(H2D(x)) != x")
            ctx.destroy()
            dev.free_host(host)
        return t

    t = run_in_vm(program, memory=max(256 * _MIB, 3 * nbytes + 32 * _MIB),
                  config=Va1Config(device_memory_size=max(256 * _MIB, 2 * nbytes)),
                  attach="vfio", profiles=profiles)
    mib = nbytes / _MIB
    note = (f"{mib:g} MiB, Stream.upload from / Stream.download into a pinned host array "
            f"(Device.alloc_host), one DMA each, submit+wait; VFIO passthrough of a host VA-1 "
            f"function (vfio-pci, guest RAM mapped at IOVA=GPA, DMA through the host "
            f"IOMMU); median of {sz.dma_reps}, interleaved")
    return [speed_row(f"c_dma_h2d_{mib:g}MiB", t["h2d"], t["copy_h2d"], DMA_TARGET,
                      note, sz.dma_reps),
            speed_row(f"c_dma_d2h_{mib:g}MiB", t["d2h"], t["copy_d2h"], DMA_TARGET,
                      note, sz.dma_reps)]


# --- (d) null command round trip ------------------------------------------------------------

def null_round_trip(sz: Sizes, profiles: ProfileSet | None = None) -> Row:
    """(d) one NOP command buffer: Stream.enqueue + synchronize (SUBMIT ioctl, ring add,
    kick, device pop/decode/run/push, interrupt, WAIT) vs a bare ring round trip.

    The bare ring's loops run between blocks of the stack's round trips, in the same
    seconds, so that a machine that speeds up or slows down during the row moves both."""
    rt = _runtime()
    base: list[float] = []
    ring = bare.BareRing(256)

    def bare_loop() -> None:
        t0 = _pc()
        for _ in range(sz.ring_loop_len):
            bare.round_trip(ring)
        base.append((_pc() - t0) / sz.ring_loop_len)

    def program(os_: GuestOS) -> list[float]:
        out: list[float] = []
        with rt.Device(os_) as dev:
            ctx = dev.create_context()
            s = ctx.create_stream()
            nop = rt.CommandBufferBuilder()
            nop.nop()
            for _ in range(3):
                s.enqueue(nop)
                s.synchronize()
            every = max(1, sz.null_reps // max(1, sz.ring_loops))
            for i in range(sz.null_reps):
                if i % every == 0 and len(base) < sz.ring_loops:
                    bare_loop()
                t0 = _pc()
                s.enqueue(nop)
                s.synchronize()
                out.append(_pc() - t0)
            while len(base) < sz.ring_loops:
                bare_loop()
            if profiles is not None:
                with profiles.section():
                    for _ in range(max(PROFILE_REPS, sz.null_reps // 3)):
                        profiles.mark("begin")
                        s.enqueue(nop)
                        s.synchronize()
                        profiles.mark("end")
            ctx.destroy()
        return out

    dev = run_in_vm(program, profiles=profiles)
    return cost_row("d_null_roundtrip", dev, base, 20.0, "s",
                    f"median of {sz.null_reps} NOP submit->wait vs median of {sz.ring_loops} "
                    f"loops of {sz.ring_loop_len} bare-ring round trips run between them",
                    sz.null_reps,
                    paired=False)


# --- (e) NOP throughput --------------------------------------------------------------------

def bare_rate(sz: Sizes) -> list[float]:
    """Descriptors/s of the bare ring, batches of ring_batch descriptors, one sample per
    loop."""
    r = bare.BareRing(max(sz.ring_batch, 1))
    samples = []
    for _ in range(sz.ring_loops):
        t0 = _pc()
        n = 0
        for _ in range(max(1, sz.ring_loop_len // sz.ring_batch) * 4):
            n += bare.batch(r, sz.ring_batch)
        samples.append(n / (_pc() - t0))
    return samples


def nop_rate(sz: Sizes, profiles: ProfileSet | None = None) -> Row:
    """(e) NOPs/s: `nop_buffers` command buffers of `nop_per_buffer` NOPs each, submitted
    back to back then synchronized, vs the bare ring's descriptor rate."""
    rt = _runtime()
    per = sz.nop_per_buffer

    def program(os_: GuestOS) -> list[float]:
        rates: list[float] = []
        with rt.Device(os_) as dev:
            ctx = dev.create_context()
            s = ctx.create_stream()
            buf = rt.CommandBufferBuilder()
            for _ in range(per):
                buf.nop()

            def once() -> float:
                t0 = _pc()
                for _ in range(sz.nop_buffers):
                    s.enqueue(buf)
                    s.flush()
                s.synchronize()
                return per * sz.nop_buffers / (_pc() - t0)

            once()
            for _ in range(sz.nop_reps):
                rates.append(once())
            if profiles is not None:
                with profiles.section():
                    profiles.mark("begin")
                    once()
                    profiles.mark("end")
            ctx.destroy()
        return rates

    value = run_in_vm(program, profiles=profiles)
    base = bare_rate(sz)
    return rate_row("e_nop_rate", value, base, 0.70, "1/s",
                    f"{sz.nop_buffers} buffers x {per} NOPs per sync vs bare ring batches of "
                    f"{sz.ring_batch}; median of {sz.nop_reps} vs median of "
                    f"{sz.ring_loops} loops", sz.nop_reps, paired=False)


# --- (f) VM scaling -------------------------------------------------------------------------

def _vm_workload(seed: int) -> Callable[[GuestOS], Any]:
    from virtaccel.guests import mlp as wl

    def program(os_: GuestOS) -> Any:
        r = wl.main(os_, seed=seed, batch=16, sizes=(64, 128, 32))
        if not r["ok"]:
            raise AssertionError(f"VM workload {seed} mismatched numpy")
        return r
    return program


def _vf_resources(sz: Sizes) -> VfResources:
    """What each benchmark VF is provisioned with: small, so that 64 fit."""
    return VfResources(device_memory=sz.vm_device_memory, num_submit_queues=1, max_contexts=2)


def sriov_fleet(count: int, sz: Sizes) -> Session:
    """One host with one VA-1 card laid out for `max(vms_large, vms_small)` VFs whatever
    `count` is (so fleets of both sizes share one card layout), `count` VFs enabled,
    each assigned by VFIO to its own VM."""
    slots = max(count, sz.vms_large, sz.vms_small)
    pf_memory = 16 * _MIB
    return Session(attach="sriov", vms=count, memory=sz.vm_ram, resources=_vf_resources(sz),
                   card_options={"memory_size": pf_memory + slots * sz.vm_device_memory,
                                 "pf_memory": pf_memory})


def vm_fleet(count: int, sz: Sizes, profiles: ProfileSet | None = None) -> float:
    """Wall seconds to build one host with one VA-1 card, enable `count` VFs, assign each
    by VFIO to its own VM and run the small workload in all of them on one machine, start
    to finish. With `profiles`, each guest task profiles itself (the host thread only
    waits for them)."""
    t0 = _pc()
    programs: list[Callable[[GuestOS], Any] | None] = []
    for i in range(count):
        prog = _vm_workload(i)
        if profiles is not None:
            def prof_prog(os_: GuestOS, prog: Callable[[GuestOS], Any] = prog,
                          ps: ProfileSet = profiles) -> Any:
                with ps.section():
                    return prog(os_)
            programs.append(prof_prog)
        else:
            programs.append(prog)
    with sriov_fleet(count, sz) as fleet:
        for task in fleet.run_all(programs):
            if task.error is not None:
                raise task.error
    return _pc() - t0


VM_TARGET = 1.05


def vm_scaling(sz: Sizes, profiles: ProfileSet | None = None) -> Row:
    """(f) per-VM wall cost with `vms_large` VMs vs `vms_small` VMs on SR-IOV: one card,
    one VF per VM, each VF assigned by VFIO passthrough."""
    name = f"f_per_vm_{sz.vms_large}v{sz.vms_small}"
    small: list[float] = []
    large: list[float] = []
    try:
        vm_fleet(sz.vms_small, sz)
        for _ in range(sz.vm_reps):
            small.append(vm_fleet(sz.vms_small, sz) / sz.vms_small)
            large.append(vm_fleet(sz.vms_large, sz) / sz.vms_large)
        if profiles is not None:
            vm_fleet(sz.vms_large, sz, profiles)
    except (MemoryError, OSError) as e:
        return missing_row(name, VM_TARGET, "<=", "s", f"{sz.vms_large} VMs with one VF "
                                                       f"each do not fit on this machine ({e})")
    return cost_row(name, large, small, VM_TARGET, "s",
                    f"per-VM wall time (host+card+VFs, build+boot+MLP 16x64->128->32), "
                    f"{sz.vms_large} vs {sz.vms_small} VMs on SR-IOV: one VA-1 card, one VF "
                    f"per VM assigned by VFIO ({sz.vm_ram >> 20} MiB RAM per VM, "
                    f"{sz.vm_device_memory >> 20} MiB device memory per VF); "
                    f"median of {sz.vm_reps}, interleaved", sz.vm_reps)


def cli_command() -> list[str]:
    """How a user starts `virtaccel`: the console script beside this Python when there
    is one, else the same entry point through `python -c`."""
    script = Path(sys.executable).parent / "virtaccel"
    if script.is_file() and os.access(script, os.X_OK):
        return [str(script)]
    return [sys.executable, "-c", "import sys; from virtaccel.cli import main; sys.exit(main())"]


def _spawn_s(argv: list[str]) -> float:
    """Wall seconds of one run of `argv` to its exit (output discarded)."""
    t0 = _pc()
    subprocess.run(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=True)
    return _pc() - t0


def cli_startup(sz: Sizes, profiles: ProfileSet | None = None) -> Row:
    """(g) `virtaccel --help` as a subprocess against `python -c pass`: the parser must
    not import the stack, numpy or the benchmarks (the verbs are imported lazily)."""
    help_cmd = cli_command() + ["--help"]
    bare_cmd = [sys.executable, "-c", "pass"]
    if profiles is not None:
        # The cost is in the child's imports, which no in-process profile sees; see
        # `python -X importtime -m virtaccel.cli --help` instead.
        return missing_row("g_cli_help_startup", 3.0, "<=", "s", "not profiled")
    _spawn_s(help_cmd)  # warm the page cache and the .pyc files
    _spawn_s(bare_cmd)
    ours: list[float] = []
    base: list[float] = []
    for _ in range(sz.startup_reps):
        ours.append(_spawn_s(help_cmd))
        base.append(_spawn_s(bare_cmd))
    return cost_row("g_cli_help_startup", ours, base, 3.0, "s",
                    "`virtaccel --help` startup vs `python -c pass`, each spawned as a "
                    f"subprocess, median of {sz.startup_reps}", sz.startup_reps)


# --- (h) ResNet-18 against onnxruntime ---------------------------------------------------

RESNET_TARGET = 3.0


def _ort_session(model_bytes: bytes, threads: int = 1) -> Any:
    """onnxruntime on `threads` intra-op threads (0: its default; the bench's BLAS
    threads) and one inter-op thread (the `bench` extra), or None when it is not
    installed."""
    try:
        import onnxruntime as ort
    except ImportError:
        return None
    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    so.inter_op_num_threads = 1
    so.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    return ort.InferenceSession(model_bytes, so, providers=["CPUExecutionProvider"])


def resnet18(sz: Sizes, profiles: ProfileSet | None = None) -> Row:
    """(h) ResNet-18 (random weights, batch 1) through the whole stack: ONNX compiled
    once, the code object loaded once in a VM, then per inference upload the image,
    launch, download, synchronize; vs onnxruntime single-threaded on the same input, in
    the same run. A model the compiler does not take yet is a row that says so."""
    from .resnet import resnet18_onnx
    hw, width = sz.resnet_hw, sz.resnet_width
    name = f"h_resnet18_{hw}_vs_onnxruntime"
    what = f"ResNet-18 batch 1, {hw}x{hw}" + ("" if width == 64 else f", width {width}")
    try:
        import onnx  # noqa: F401
    except ImportError:
        return missing_row(name, RESNET_TARGET, "<=", "s", f"{what}: the onnx extra is not "
                                                           "installed")
    model = resnet18_onnx(hw=hw, width=width).SerializeToString()
    sess = _ort_session(model, sz.blas_threads)
    if sess is None:
        return missing_row(name, RESNET_TARGET, "<=", "s",
                           f"{what}: onnxruntime is not installed (pip install "
                           "'virtaccel[bench]'; make bench installs it)")
    from userspace_runtime.compiler import GraphError
    from userspace_runtime.onnx_import import compile_onnx
    try:
        code = compile_onnx(model).code_object
    except GraphError as e:
        first = str(e).splitlines()[0].split(" (supported:")[0]
        return missing_row(name, RESNET_TARGET, "<=", "s",
                           f"{what}: does not compile yet: {first}")
    x = np.random.default_rng(0).standard_normal((1, 3, hw, hw)).astype(np.float32)
    ref = sess.run(["logits"], {"input": x})[0]
    from userspace_runtime.module import Module
    module = Module.from_bytes(code)

    def program(os_: GuestOS) -> tuple[list[float], list[float], np.ndarray]:
        rt = _runtime()
        ours: list[float] = []
        base: list[float] = []
        with rt.Device(os_) as dev:
            ctx = dev.create_context()
            stream = ctx.create_stream()
            fn = module.load(ctx, stream).function("main")
            out = fn(stream, {"input": x})["logits"]   # warm-up
            sess.run(["logits"], {"input": x})
            for _ in range(sz.resnet_reps):
                t0 = _pc()
                out = fn(stream, {"input": x})["logits"]
                ours.append(_pc() - t0)
                t0 = _pc()
                sess.run(["logits"], {"input": x})
                base.append(_pc() - t0)
            if profiles is not None:
                with profiles.section():
                    for _ in range(min(PROFILE_REPS, 3)):
                        profiles.mark("begin")
                        fn(stream, {"input": x})
                        profiles.mark("end")
            ctx.destroy()
        return ours, base, out

    ours, base, out = run_in_vm(program, memory=512 * _MIB, profiles=profiles,
                                config=Va1Config(device_memory_size=256 * _MIB))
    err = float(np.max(np.abs(out - ref)) / max(float(np.max(np.abs(ref))), 1e-30))
    if not err <= 1e-4:
        raise AssertionError(f"bench resnet18: device logits differ from onnxruntime's "
                             f"(max rel err {err:.3g})")
    return cost_row(name, ours, base, RESNET_TARGET, "s",
                    f"{what}, random weights: upload + launch + download + sync of the "
                    f"compiled model in a VM vs onnxruntime (1 thread) on the same input; "
                    f"max rel err {err:.1e}; median of {sz.resnet_reps}, interleaved",
                    sz.resnet_reps)


# --- (i) memory over many submissions ------------------------------------------------------

RSS_TARGET_MIB = 20.0


def rss_bytes() -> int:
    """This process's resident set now (/proc/self/statm; elsewhere the peak, from
    getrusage)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        import resource
        return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


def rss_growth(sz: Sizes, profiles: ProfileSet | None = None) -> Row:
    """(i) RSS growth over `rss_submissions` one-NOP submissions on one stream, after a
    warm-up of `rss_warmup`: each is its own submission (enqueue + flush), synchronized
    every `rss_batch` submissions so that a run of a million takes minutes, not the
    ~270 us of a full round trip each. An absolute bound: value = growth in MiB,
    baseline = 1 MiB."""
    import gc
    rt = _runtime()
    n = sz.rss_submissions

    def program(os_: GuestOS) -> tuple[int, int]:
        with rt.Device(os_) as dev:
            ctx = dev.create_context()
            s = ctx.create_stream()
            nop = rt.CommandBufferBuilder()
            nop.nop()

            def submit(count: int) -> None:
                for i in range(count):
                    s.enqueue(nop)
                    s.flush()
                    if i % sz.rss_batch == sz.rss_batch - 1:
                        s.synchronize()
                s.synchronize()

            submit(sz.rss_warmup)
            gc.collect()
            before = rss_bytes()
            with maybe_section(profiles):
                submit(n if profiles is None else min(n, 2000))
            gc.collect()
            after = rss_bytes()
            ctx.destroy()
        return before, after

    before, after = run_in_vm(program, profiles=profiles)
    growth = max(0, after - before) / _MIB
    return cost_row(f"i_rss_{n}_submissions", growth, 1.0, RSS_TARGET_MIB, "MiB",
                    f"RSS growth over {n} one-NOP submissions (enqueue+flush, synchronize "
                    f"every {sz.rss_batch}) after {sz.rss_warmup} warm-up ones: "
                    f"{before / _MIB:.0f} -> {after / _MIB:.0f} MiB; one run; baseline "
                    "1 MiB (ratio = MiB)", 1)


def maybe_section(profiles: ProfileSet | None) -> Any:
    from .profile import maybe
    return maybe(profiles)


CASES: dict[str, Callable[[Sizes, ProfileSet | None], Row | list[Row]]] = {
    "a": gemm, "b": mlp, "c": dma, "d": null_round_trip, "e": nop_rate, "f": vm_scaling,
    "g": cli_startup, "h": resnet18, "i": rss_growth,
}
