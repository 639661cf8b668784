"""Hostile tenant programs: each tries one way of reaching past its VF, and reports what
the device and its own driver answered (statuses, errnos) and when it attacked (guest
clock), so a test can check that only the attacker was hurt.

Every program is `attack(os, **args) -> dict` with at least `attack_ns` (guest time the
attack began), `done_ns` and `ok` (True when everything was refused as it should be).
They use the device file's uAPI where a user could, and the guest kernel's own view of
its VF (raw MMIO, the bound driver) where the attack needs a malicious guest kernel.
"""
from __future__ import annotations

import errno
import struct
from typing import Any, Callable

import numpy as np

from guest_driver import uapi as U
from guest_driver.pci import scan_host
from hwspec import isa
from hwspec import pci as P
from hwspec import va1 as A
from hwspec import virtio as V
from hwspec import virtio_admin as VA
from hwspec import virtio_pci as VP
from hwspec.va1 import Status
from userspace_runtime import DriverFile
from userspace_runtime.commands import CommandBufferBuilder

from .tenant import call_command, checked_gemm, guest_now, wait_command, wait_signalled

DEV = "/dev/accel/accel0"


def _status(code: int) -> str:
    return Status(code).name if code in Status._value2member_map_ else str(code)


class _Shooter:
    """One context, one host buffer: submit raw command bytes, collect the answer."""

    def __init__(self, acc: DriverFile, size: int = 1 << 16) -> None:
        self.acc = acc
        self.ctx = acc.context_create()
        self.h, self.iova = acc.bo_create(size, U.BO_HOST)
        self.view = acc.mmap(self.h, size)
        self.size = size

    def shoot(self, raw: bytes, queue: int = 0, timeout_ns: int = -1,
              handles: tuple[int, ...] = ()) -> dict[str, Any]:
        self.view[:len(raw)] = np.frombuffer(raw, dtype=np.uint8)
        fence = self.acc.submit(self.ctx, queue, self.h, 0, len(raw), handles)
        w = wait_signalled(self.acc, self.ctx, fence, timeout_ns)
        out: dict[str, Any] = {"status": _status(w.status), "offset": w.error_offset,
                               "start_ns": w.start_ns, "end_ns": w.end_ns}
        try:  # the context must now refuse work (faulted)
            self.acc.submit(self.ctx, queue, self.h, 0, 8)
            out["after"] = "accepted"
        except OSError as e:
            out["after"] = errno.errorcode.get(e.errno or 0, str(e.errno))
        return out


def _cb() -> CommandBufferBuilder:
    return CommandBufferBuilder()


def out_of_partition(os: Any, seed: int = 0) -> dict[str, Any]:
    """Device addresses past the VF's partition (FILL, DMA, GEMM), and a second process
    (device file) naming the first one's buffer from its own context."""
    t0 = guest_now(os)
    acc = DriverFile.open(os, DEV)
    quota = acc.get_param("device_memory_size")
    shots: dict[str, Any] = {}
    shots["fill_across_end"] = _Shooter(acc).shoot(_cb_fill(quota - 64, 4096))
    sh = _Shooter(acc)
    cb = _cb()
    cb.dma_h2d(sh.iova + 4096, quota * 4, 256)
    shots["h2d_past_end"] = sh.shoot(cb.bytes())
    sh = _Shooter(acc)
    cb = _cb()
    cb.gemm(dtype="F32", m=4, n=4, k=4, a=0, b=0, c=1 << 40)
    shots["gemm_far"] = sh.shoot(cb.bytes())
    # two processes: the first one's buffer is not mapped into the second one's context
    owner = DriverFile.open(os, DEV)
    secret_h, secret_addr = owner.bo_create(4096, U.BO_DEVICE)
    o = _Shooter(owner)
    o.shoot(_cb_fill(secret_addr, 4096, 0x5EC2E7))
    thief = _Shooter(acc)
    cb = _cb()
    cb.dma_d2h(secret_addr, thief.iova + 8192, 4096)
    shots["other_context"] = thief.shoot(cb.bytes())
    leaked = bool((thief.view[8192:8192 + 4096].view(np.uint32) == 0x5EC2E7).any())
    ok = all(s["status"] == "OUT_OF_BOUNDS" and s["after"] == "ECANCELED" for s in shots.values())
    return {"ok": ok and not leaked, "shots": shots, "leaked": leaked, "quota": quota,
            "attack_ns": t0, "done_ns": guest_now(os)}


def _cb_fill(dst: int, size: int, pattern: int = 0xA5A5A5A5) -> bytes:
    """A FILL built by hand (the builder refuses nothing here, but keep it raw)."""
    layout = isa.PAYLOAD[isa.Opcode.FILL]
    return struct.pack(isa.HEADER.format, isa.Opcode.FILL, 0, isa.HEADER.size + layout.size) + \
        struct.pack(layout.format, *[{"dst": dst, "size": size, "pattern": pattern}.get(n, 0)
                                     for n in layout.names])


def unmapped_iova(os: Any, seed: int = 0) -> dict[str, Any]:
    """DMA to and from IOVAs the VMM never mapped for this VF (past guest RAM, far up,
    a SIGNAL into nowhere, a command buffer that is not there). Through the uAPI the
    driver refuses each at SUBMIT (EFAULT: not a HOST buffer of the file); a malicious
    guest kernel that skips that check submits the same bytes and the IOMMU refuses."""
    t0 = guest_now(os)
    acc = DriverFile.open(os, DEV)
    dh, daddr = acc.bo_create(8192, U.BO_DEVICE)
    drv = os.devices[DEV]
    shots: dict[str, Any] = {}
    uapi: dict[str, str | None] = {}
    builds: tuple[tuple[str, Callable[[CommandBufferBuilder], object]], ...] = (
        ("h2d_from_4g", lambda cb: cb.dma_h2d(0x1_0000_0000, daddr, 4096)),
        ("d2h_to_far", lambda cb: cb.dma_d2h(daddr, 0x7FFF_0000_0000, 4096)),
        ("signal_nowhere", lambda cb: cb.signal(0x2_0000_0000, 1)))
    for name, build in builds:
        sh = _Shooter(acc)
        cb = _cb()
        build(cb)
        raw = cb.bytes()
        sh.view[:len(raw)] = np.frombuffer(raw, dtype=np.uint8)
        try:
            acc.submit(sh.ctx, 0, sh.h, 0, len(raw))
            uapi[name] = None
        except OSError as e:
            uapi[name] = errno.errorcode.get(e.errno or 0, str(e.errno))
        ctx = drv.create_context(flat=True)   # the kernel path: no check, no mappings
        fence = drv.submit(ctx, 0, sh.iova, len(raw))
        drv.wait_fence(fence, None)
        shots[name] = {"status": _status(fence.status), "offset": fence.error_offset}
    ctx = drv.create_context()
    fence = drv.submit(ctx, 0, 0x3_0000_0000, 64)   # the command buffer itself is unmapped
    drv.wait_fence(fence, None)
    shots["cmdbuf_unmapped"] = {"status": _status(fence.status), "after": "n/a"}
    ok = (all(s["status"] == "DMA_FAULT" for s in shots.values())
          and all(e == "EFAULT" for e in uapi.values()))
    return {"ok": ok, "shots": shots, "uapi": uapi, "attack_ns": t0, "done_ns": guest_now(os)}


def flood(os: Any, seed: int = 0, duration_ns: int = 300_000, reps: int = 8) -> dict[str, Any]:
    """Every submit queue at the driver's maximum depth, heavy submissions, for a while."""
    t0 = guest_now(os)
    r = checked_gemm(os, seed, duration_ns=duration_ns, queues=A.MAX_SUBMIT_QUEUES_PER_FUNCTION,
                     depth=64, reps=reps, m=32, k=32, n=32)
    r["attack_ns"], r["done_ns"] = t0, guest_now(os)
    return r


def ring_overrun(os: Any, seed: int = 0) -> dict[str, Any]:
    """A malicious guest kernel publishes more entries than the ring holds (avail idx
    far ahead) and notifies: the device must flag only this VF DEVICE_NEEDS_RESET."""
    t0 = guest_now(os)
    drv = os.devices[DEV]
    q = drv._queues[A.FIRST_SUBMITQ]
    ring = q.ring
    mem = os.kernel.memory
    idx_addr = ring.base + ring.layout.avail_idx
    resets0 = drv.resets
    cur = int.from_bytes(mem.read(idx_addr, 2), "little")
    mem.write(idx_addr, ((cur + ring.num + 7) & 0xFFFF).to_bytes(2, "little"))
    drv.transport.notify(q.index)
    status = drv.transport.read_status()
    os.kernel.sched.sleep(50_000)
    # the driver's config-change handler may already have reset and recovered the VF
    needs_reset = bool(status & V.STATUS_DEVICE_NEEDS_RESET) or drv.resets > resets0
    if drv.resets == resets0:
        drv.recover("ring overrun test")
    after = checked_gemm(os, seed, count=2)
    return {"ok": needs_reset and after["ok"], "needs_reset": needs_reset, "status": status,
            "after_ok": after["ok"], "attack_ns": t0, "done_ns": guest_now(os)}


def long_cmdbuf(os: Any, seed: int = 0, gemms: int = 2048) -> dict[str, Any]:
    """A long legal command buffer (thousands of GEMMs: preemptible at each command),
    then one longer than max_cmdbuf_size through the uAPI (refused) and raw (refused by
    the device, the context faulted)."""
    t0 = guest_now(os)
    acc = DriverFile.open(os, DEV)
    max_size = acc.get_param("max_cmdbuf_size")
    dh, daddr = acc.bo_create(3 * 32 * 32 * 4, U.BO_DEVICE)
    cb = _cb()
    for _ in range(gemms):
        cb.gemm(dtype="F32", m=32, n=32, k=32, a=daddr, b=daddr + 4096, c=daddr + 8192)
    raw = cb.bytes()
    sh = _Shooter(acc, size=max(len(raw), max_size) + 4096)
    sh.view[:len(raw)] = np.frombuffer(raw, dtype=np.uint8)
    fence = acc.submit(sh.ctx, 0, sh.h, 0, len(raw), (dh,))
    w = wait_signalled(acc, sh.ctx, fence)
    long_run = {"status": _status(w.status), "start_ns": w.start_ns, "end_ns": w.end_ns,
                "bytes": len(raw)}
    uapi_errno = None
    try:
        acc.submit(sh.ctx, 0, sh.h, 0, max_size + 8)
    except OSError as e:
        uapi_errno = errno.errorcode.get(e.errno or 0)
    drv = os.devices[DEV]
    ctx = drv.create_context()
    fence = drv.submit(ctx, 0, sh.iova, max_size + 8)   # a malicious kernel skips the check
    drv.wait_fence(fence, None)
    raw_status = _status(fence.status)
    ok = long_run["status"] == "OK" and uapi_errno == "EINVAL" and raw_status == "CMDBUF_TOO_LARGE"
    return {"ok": ok, "long_run": long_run, "uapi_errno": uapi_errno, "raw_status": raw_status,
            "context_faulted": bool(ctx.faulted), "attack_ns": t0, "done_ns": guest_now(os)}


def deep_call(os: Any, seed: int = 0) -> dict[str, Any]:
    """A command buffer that CALLs itself (unbounded recursion) and a chain of nested
    CALLs one deeper than max_call_depth."""
    t0 = guest_now(os)
    acc = DriverFile.open(os, DEV)
    depth = acc.get_param("max_call_depth")
    sh = _Shooter(acc)
    selfcall = call_command(sh.iova, 24)
    shots = {"self_call": sh.shoot(selfcall)}
    sh = _Shooter(acc)
    chain = b""
    # buffer i at iova + 64*i calls buffer i+1; the last is a NOP
    n = depth + 2
    for i in range(n - 1):
        piece = call_command(sh.iova + 64 * (i + 1), 24 if i + 1 < n - 1 else 8)
        chain += piece + bytes(64 - len(piece))
    chain += struct.pack(isa.HEADER.format, isa.Opcode.NOP, 0, 8)
    sh.view[:len(chain)] = np.frombuffer(chain, dtype=np.uint8)
    fence = acc.submit(sh.ctx, 0, sh.h, 0, 24)
    w = wait_signalled(acc, sh.ctx, fence)
    shots["too_deep"] = {"status": _status(w.status), "offset": w.error_offset}
    ok = all(s["status"] == "CALL_DEPTH" for s in shots.values())
    return {"ok": ok, "shots": shots, "max_call_depth": depth, "attack_ns": t0,
            "done_ns": guest_now(os)}


def never_finishing(os: Any, seed: int = 0) -> dict[str, Any]:
    """WAIT on a host word that never reaches its value: the preemption timeout ends it."""
    t0 = guest_now(os)
    acc = DriverFile.open(os, DEV)
    sh = _Shooter(acc)
    flag = sh.iova + 8192
    sh.view[8192:8200] = 0
    shot = sh.shoot(wait_command(flag, 1))
    ok = shot["status"] == "TIMEOUT" and shot["after"] == "ECANCELED"
    return {"ok": ok, "shot": shot, "attack_ns": t0, "done_ns": guest_now(os)}


def huge_command(os: Any, seed: int = 0) -> dict[str, Any]:
    """The isolation issue's CONV2D: n=1 c=1 h=2048 w=4096 with a 2048x2048 kernel
    (17 GFLOP, 32 GiB of im2col if done naively), its weight inside its input so that it
    fits a 37 MiB partition: refused WORK_LIMIT at validation (spec §7, Work bounds)."""
    t0 = guest_now(os)
    acc = DriverFile.open(os, DEV)
    sh = _Shooter(acc)
    mib = 1 << 20
    dh, daddr = acc.bo_create(36 * mib, U.BO_DEVICE)
    op = isa.Opcode.CONV2D
    fields = dict(dtype=int(isa.DType.F32), groups=1, n=1, c=1, h=2048, w=4096, k=1, r=2048,
                  s=2048, stride_h=1, stride_w=1, dilation_h=1, dilation_w=1, x=daddr,
                  weight=daddr + 4 * mib, y=daddr + 36 * mib - 16384)
    layout = isa.PAYLOAD[op]
    raw = struct.pack(isa.HEADER.format, op, 0, isa.command_length(op)) + struct.pack(
        layout.format, *(fields.get(name, 0) for name in layout.names))
    shot = sh.shoot(raw, handles=(dh,))
    ok = shot["status"] == "WORK_LIMIT" and shot["offset"] == 0 and shot["after"] == "ECANCELED"
    return {"ok": ok, "shot": shot, "attack_ns": t0, "done_ns": guest_now(os)}


def _vf_function(os: Any) -> Any:
    host = os.kernel.pci_hosts[0]
    fns = [f for f in scan_host(os.kernel, host).functions if f.vendor_id == A.PCI_VENDOR_ID]
    return host, fns


def reset_storm(os: Any, seed: int = 0, rounds: int = 3) -> dict[str, Any]:
    """Work in flight, then a device reset (status 0), then an FLR (PCIe DEVCTL), over
    and over: the attacker's fences complete ABORTED; nothing leaks to other VFs."""
    t0 = guest_now(os)
    drv = os.devices[DEV]
    host, fns = _vf_function(os)
    fn = fns[0]
    exp = fn.find_cap(P.CAP_ID_EXP)
    statuses: list[str] = []
    for i in range(rounds):
        for how in ("status0", "flr"):
            acc = DriverFile.open(os, DEV)
            dh, daddr = acc.bo_create(3 * 4096, U.BO_DEVICE)
            ctx = acc.context_create()
            h, iova = acc.bo_create(1 << 16, U.BO_HOST)
            cb = _cb()
            for _ in range(64):
                cb.gemm(dtype="F32", m=32, n=32, k=32, a=daddr, b=daddr + 4096, c=daddr + 8192)
            raw = cb.bytes()
            acc.mmap(h, 1 << 16)[:len(raw)] = np.frombuffer(raw, dtype=np.uint8)
            fences = [acc.submit(ctx, q, h, 0, len(raw), (dh,)) for q in (0, 1)]
            if how == "status0":
                drv.reset("reset storm")
            else:
                fn.cfg.write16(exp + P.EXP_DEVCTL, P.EXP_DEVCTL_BCR_FLR)
                os.kernel.sched.sleep(1_000)
                drv.recover("reset storm: FLR")
            for f in fences:
                try:
                    statuses.append(_status(wait_signalled(acc, ctx, f).status))
                except OSError as e:
                    statuses.append(errno.errorcode.get(e.errno or 0, "?"))
            try:
                acc.close()
            except OSError:
                pass
    after = checked_gemm(os, seed, count=2)
    ok = all(s in ("ABORTED",) for s in statuses) and after["ok"]
    return {"ok": ok, "statuses": statuses, "resets": drv.resets, "after_ok": after["ok"],
            "attack_ns": t0, "done_ns": guest_now(os)}


def admin_from_vf(os: Any, seed: int = 0) -> dict[str, Any]:
    """Try to use an admin queue on the VF: feature bits, the admin fields of the
    common configuration, a notification of the queue index after the last one."""
    t0 = guest_now(os)
    drv = os.devices[DEV]
    t = drv.transport
    mm = os.kernel.mmio
    host, fns = _vf_function(os)
    fn = fns[0]
    bar = fn.bar(A.PCI_BAR).address
    common = bar + A.PCI_COMMON_CFG_OFFSET
    # the device offers neither SR_IOV nor ADMIN_VQ
    mm.write(common + VP.COMMON_DFSELECT, 4, 1)
    hi = mm.read(common + VP.COMMON_DF, 4)
    offered = hi << 32
    no_admin_features = not offered >> V.F_ADMIN_VQ & 1 and not offered >> V.F_SR_IOV & 1
    # the admin queue fields read 0 and ignore writes
    mm.write(common + VA.COMMON_ADM_Q_IDX, 2, 5)
    adm_idx = mm.read(common + VA.COMMON_ADM_Q_IDX, 2)
    adm_num = mm.read(common + VA.COMMON_ADM_Q_NUM, 2)
    nq = mm.read(common + VP.COMMON_NUMQ, 2)
    # notify the queue after the last one (where a PF's admin queue would be), with an
    # admin command laid out in guest memory
    mm.write(bar + A.PCI_NOTIFY_OFFSET + nq * A.PCI_NOTIFY_OFF_MULTIPLIER, 2, nq)
    os.kernel.sched.sleep(10_000)
    has_sriov_cap = fn.find_ext_cap(P.EXT_CAP_ID_SRIOV) is not None
    after = checked_gemm(os, seed, count=2)
    ok = no_admin_features and adm_idx == 0 and adm_num == 0 and not has_sriov_cap
    return {"ok": ok and after["ok"], "offered_hi": hi, "admin_q_idx": adm_idx,
            "admin_q_num": adm_num, "num_queues": nq, "sriov_cap": has_sriov_cap,
            "after_ok": after["ok"], "transport": type(t).__name__, "attack_ns": t0,
            "done_ns": guest_now(os)}


def touch_pf(os: Any, seed: int = 0, pf_bar: int = 0, other_vf_bar: int = 0) -> dict[str, Any]:
    """Reach for the PF's registers (and another VF's) at their host physical addresses,
    and look for the PF on the guest's PCI bus: nothing there."""
    t0 = guest_now(os)
    mm = os.kernel.mmio
    reads = {}
    for name, base in (("pf", pf_bar), ("other_vf", other_vf_bar)):
        common = base + A.PCI_COMMON_CFG_OFFSET
        mm.write(common + VP.COMMON_STATUS, 1, 0)                 # reset it!
        mm.write(common + VP.COMMON_STATUS, 1, V.STATUS_FAILED)
        reads[name] = mm.read(common + VP.COMMON_NUMQ, 2)
    host, fns = _vf_function(os)
    visible = [str(f.bdf) for f in fns]
    sriov = [f.find_ext_cap(P.EXT_CAP_ID_SRIOV) is not None for f in fns]
    after = checked_gemm(os, seed, count=2)
    ok = all(v == 0xFFFF for v in reads.values()) and len(fns) == 1 and not any(sriov)
    return {"ok": ok and after["ok"], "reads": reads, "visible": visible, "sriov_cap": sriov,
            "after_ok": after["ok"], "attack_ns": t0, "done_ns": guest_now(os)}


ATTACKS = {
    "out_of_partition": out_of_partition,
    "unmapped_iova": unmapped_iova,
    "flood": flood,
    "ring_overrun": ring_overrun,
    "long_cmdbuf": long_cmdbuf,
    "deep_call": deep_call,
    "never_finishing": never_finishing,
    "huge_command": huge_command,
    "reset_storm": reset_storm,
    "admin_from_vf": admin_from_vf,
    "touch_pf": touch_pf,
}
