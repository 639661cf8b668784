"""Processes inside one guest do not reach each other (end to end, real device model):
two opened device files in one guest program are two processes. Host addresses are
checked per file at SUBMIT, reused device memory reads zeros, a closed file's late
fault never lands on another file's new context, and a VF resized by its PF is seen
the same by GET_PARAM and the allocator."""
from __future__ import annotations

import errno
import struct
from dataclasses import asdict
from typing import Any

import numpy as np
import pytest

from guest_driver import uapi as U
from hwspec import isa
from hwspec.va1 import Status, VfResources
from userspace_runtime import DriverFile
from virtaccel import Session

DEV = "/dev/accel/accel0"
SEED = 4242


def cmd(op: isa.Opcode, **fields: int) -> bytes:
    """One command from the datasheet layouts (independent of the runtime's builder)."""
    lay = isa.PAYLOAD[op]
    return struct.pack(isa.HEADER.format, op, 0, isa.HEADER.size + lay.size) + struct.pack(
        lay.format, *(fields.get(n, 0) for n in lay.names))


class Proc:
    """One process: a device file, a context and a HOST buffer for its command buffers."""

    def __init__(self, os: Any) -> None:
        self.f = DriverFile.open(os, DEV)
        self.ctx = self.f.context_create()
        self.cb, self.cb_iova = self.f.bo_create(1 << 16, U.BO_HOST)
        self.view = self.f.mmap(self.cb, 1 << 16)

    def submit(self, raw: bytes, handles: tuple[int, ...] = ()) -> int:
        self.view[:len(raw)] = np.frombuffer(raw, dtype=np.uint8)
        return self.f.submit(self.ctx, 0, self.cb, 0, len(raw), handles)

    def run(self, raw: bytes, handles: tuple[int, ...] = ()) -> int:
        r = self.f.wait(self.ctx, self.submit(raw, handles))
        assert r is not None
        return r.status


def refused(fn: Any, *a: Any) -> OSError:
    with pytest.raises(OSError) as ei:
        fn(*a)
    return ei.value


def test_dma_into_another_files_host_buffer_or_the_rings_is_refused() -> None:
    def program(os: Any) -> dict[str, Any]:
        a, b = Proc(os), Proc(os)
        ha, ia = a.f.bo_create(4096, U.BO_HOST)
        secret = np.arange(4096, dtype=np.uint8)
        a.f.mmap(ha, 4096)[:] = secret
        dh, daddr = b.f.bo_create(4096, U.BO_DEVICE)
        hb, ib = b.f.bo_create(4096, U.BO_HOST)
        drv = os.devices[DEV]
        ring = drv._queues[2].ring.desc_addr
        subs0 = drv._queues[2].ring.num_free
        out = {}
        for name, raw in (
                ("steal", cmd(isa.Opcode.DMA_H2D, src=ia, dst=daddr, size=4096)),
                ("scribble", cmd(isa.Opcode.DMA_H2D, src=ib, dst=daddr, size=64)
                 + cmd(isa.Opcode.DMA_D2H, src=daddr, dst=ia + 64, size=64)),
                ("ring", cmd(isa.Opcode.DMA_D2H, src=daddr, dst=ring, size=64)),
                ("signal", cmd(isa.Opcode.SIGNAL, addr=ia, value=7)),
                ("timestamp", cmd(isa.Opcode.TIMESTAMP, addr=ring)),
                ("wait", cmd(isa.Opcode.WAIT, addr=ia, value=1)),
                ("call", cmd(isa.Opcode.CALL, addr=a.cb_iova, size=64))):
            e = refused(b.submit, raw, (dh, hb))
            out[name] = (e.errno, str(e))
        # the same through a CALL into b's own buffer: refused, naming the CALL
        b.view[4096:4096 + 32] = np.frombuffer(
            cmd(isa.Opcode.DMA_D2H, src=daddr, dst=ia, size=32), dtype=np.uint8)
        e = refused(b.submit, cmd(isa.Opcode.NOP) + cmd(isa.Opcode.CALL,
                                                        addr=b.cb_iova + 4096, size=32))
        out["callee"] = (e.errno, str(e))
        ok = b.run(cmd(isa.Opcode.DMA_H2D, src=ib, dst=daddr, size=4096)
                   + cmd(isa.Opcode.SIGNAL, addr=ib, value=9), (dh, hb))
        return {"out": out, "intact": bool((a.f.mmap(ha, 4096) == secret).all()),
                "queued": subs0 - drv._queues[2].ring.num_free, "own": ok,
                "signalled": int(b.f.mmap(hb, 8).view("<u8")[0])}

    with Session(attach="mmio", seed=SEED) as s:
        r = s.run(program)
    assert r["intact"], "process A's buffer was changed"
    for name, (err, msg) in r["out"].items():
        assert err == errno.EFAULT, (name, msg)
        assert "not inside a HOST buffer of this file" in msg, msg
    assert "command at offset 32 (DMA_D2H)" in r["out"]["scribble"][1]
    assert "command at offset 8 (CALL; callee offset 0) (DMA_D2H)" in r["out"]["callee"][1]
    assert r["own"] == Status.OK and r["signalled"] == 9


def test_reused_device_memory_reads_zeros() -> None:
    def program(os: Any) -> dict[str, Any]:
        a, b = Proc(os), Proc(os)
        da, addr_a = a.f.bo_create(8192, U.BO_DEVICE)
        ha, ia = a.f.bo_create(8192, U.BO_HOST)
        a.f.mmap(ha, 8192)[:] = 0xAB
        assert a.run(cmd(isa.Opcode.DMA_H2D, src=ia, dst=addr_a, size=8192), (da, ha)) == 0
        a.f.bo_free(da)
        db, addr_b = b.f.bo_create(8192, U.BO_DEVICE)
        hb, ib = b.f.bo_create(8192, U.BO_HOST)
        b.f.mmap(hb, 8192)[:] = 0x55
        st = b.run(cmd(isa.Opcode.DMA_D2H, src=addr_b, dst=ib, size=8192), (db, hb))
        return {"same": addr_a == addr_b, "status": st,
                "bytes": set(b.f.mmap(hb, 8192).tolist())}

    with Session(attach="mmio", seed=SEED, keep_trace=True) as s:
        r = s.run(program)
        scrubs = [e for e in s.trace.events if e.kind == "scrub"]
    assert r["same"] and r["status"] == Status.OK
    assert r["bytes"] == {0}, "the new buffer holds the previous owner's data"
    assert len(scrubs) == 1 and scrubs[0].get("bytes") == 8192


def test_closed_files_late_fault_never_faults_a_new_context_of_another_file() -> None:
    def program(os: Any) -> dict[str, Any]:
        drv = os.devices[DEV]
        a = Proc(os)
        flag, fiova = a.f.bo_create(4096, U.BO_HOST)
        a.submit(cmd(isa.Opcode.WAIT, addr=fiova, value=1))   # never satisfied: TIMEOUT
        os.kernel.sched.sleep(20_000)                         # it is running now
        old = next(c for c in drv._contexts.values() if c.uid == a.ctx)
        a.f.close()                                           # mid-submission
        b = Proc(os)
        new = next(c for c in drv._contexts.values() if c.uid == b.ctx)
        first = b.run(cmd(isa.Opcode.NOP))
        os.kernel.sched.sleep(2_000_000_000)                  # past A's preemption timeout
        late = old.timeline.get(1)
        assert late is not None
        second = b.run(cmd(isa.Opcode.NOP))
        os.kernel.sched.sleep(10_000)
        b.f.stats()                                           # an ioctl: deferred work runs
        return {"old_id": old.device_id, "new_id": new.device_id, "first": first,
                "second": second, "late": late.status, "faulted": new.faulted,
                "quarantine": dict(drv._quarantine), "held": dict(drv._held)}

    with Session(attach="mmio", seed=SEED) as s:
        r = s.run(program)
    assert r["late"] == Status.TIMEOUT
    assert r["new_id"] != r["old_id"]
    assert (r["first"], r["second"], r["faulted"]) == (Status.OK, Status.OK, False)
    assert r["quarantine"] == {} and r["held"] == {}


def test_vf_resize_through_the_pf_driver_get_param_and_allocator_agree() -> None:
    new_size = 32 << 20
    with Session(attach="sriov", seed=SEED, vms=1,
                 resources=VfResources(device_memory=64 << 20)) as s:
        pf = s.host.pf_driver()
        host_done: list[bool] = []

        def host() -> None:
            s.machine.sleep(200_000)
            pf.reset_vf(1)
            res = pf.get_resources(1)
            pf.set_resources(1, VfResources(**{**asdict(res), "device_memory": new_size}))
            host_done.append(True)

        def program(os: Any) -> dict[str, Any]:
            f = DriverFile.open(os, DEV)
            before = f.get_param("device_memory_size")
            f.bo_create(4096, U.BO_DEVICE)
            os.kernel.sched.sleep(1_000_000)
            assert host_done
            try:
                f.stats()          # the FLR'd VF does not answer: the driver resets it
            except OSError as e:
                assert e.errno == errno.ETIMEDOUT, e
            drv = os.devices[DEV]
            after = f.get_param("device_memory_size")
            big = refused(f.bo_create, new_size, U.BO_DEVICE)
            h, addr = f.bo_create(new_size - 4 * 4096, U.BO_DEVICE)
            return {"before": before, "after": after, "alloc": drv.devmem.size,
                    "free": drv.devmem.bytes_free, "big": big.errno, "addr": addr}

        s.spawn_host(host)
        task = s.spawn(program)
        s.run_tasks()
        assert task.error is None, task.error
        r = task.result
    assert r["before"] == 64 << 20
    assert r["after"] == r["alloc"] == new_size
    assert r["big"] == errno.ENOMEM
    assert r["free"] == 3 * 4096
