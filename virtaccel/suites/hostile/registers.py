"""Register-level scenarios: the device status state machine (virtio 1.x §2.1, §3.1),
virtio-mmio registers (§4.2.2), virtio-pci structures and PCI config space (§4.1, PCIe),
and the admin virtqueue as seen from a VF (§2.12)."""
from __future__ import annotations

import struct
from typing import Callable

from hwspec import isa
from hwspec import pci as P
from hwspec import va1 as A
from hwspec import virtio as V
from hwspec import virtio_admin as VA
from hwspec import virtio_mmio as R
from hwspec import virtio_pci as VP

from .core import ALL, PCI_LIKE, Attack, Scenario, Setup
from .raw import BASE_FEATURES, MmioRaw, PciRaw, cmd

SETTLE_NS = 100_000
ACK, DRV, FOK, DOK = (V.STATUS_ACKNOWLEDGE, V.STATUS_DRIVER, V.STATUS_FEATURES_OK,
                      V.STATUS_DRIVER_OK)
STATES = {"reset": 0, "ack": ACK, "driver": ACK | DRV, "features-ok": ACK | DRV | FOK,
          "driver-ok": ACK | DRV | FOK | DOK}


def _long_work() -> bytes:
    """About 200 us of device time (400 commands of 4 KiB each), cheap in wall time."""
    return b"".join(cmd(isa.Opcode.FILL, dst=4096 * (i % 64), size=4096, pattern=i)
                    for i in range(400))


def _after(a: Attack) -> None:
    """Whatever was written, try to use the function as it stands."""
    if a.ctx is not None:
        a.dev.submit(a.ctx, cmd(isa.Opcode.NOP), timeout_ns=SETTLE_NS)
    else:
        a.dev.t.notify(A.FIRST_SUBMITQ)
        a.sleep(SETTLE_NS)


def _legal(old: int, new: int) -> bool:
    """virtio 1.x §3.1.1 order, as the device checks it (bits only added, in order)."""
    if new == 0:
        return True
    if old & ~new:
        return False
    added = new & ~old
    if added & DRV and not new & ACK:
        return False
    if added & FOK and not new & DRV:
        return False
    if added & DOK and not new & FOK:
        return False
    return not new & ~(ACK | DRV | FOK | DOK | V.STATUS_FAILED)


def _goto(a: Attack, state: str) -> None:
    """Bring the function to `state` by the legal path."""
    d = a.dev
    if state == "driver-ok":
        d.bring_up()
        a.ctx = d.create_context()
        return
    d.reset()
    if state == "reset":
        return
    d.t.set_status(ACK)
    if state == "ack":
        return
    d.t.set_status(ACK | DRV)
    if state == "driver":
        return
    d.t.set_driver_features(BASE_FEATURES & d.t.device_features())
    d.t.set_status(ACK | DRV | FOK)


def _transition(state: str, value: int, rule: str) -> Callable[[Attack], None]:
    def program(a: Attack) -> None:
        _goto(a, state)
        before = a.dev.t.status()
        a.dev.t.set_status(value)
        after = a.dev.t.status()
        # spec §3: an illegal write has no effect (NEEDS_RESET and undefined bits in the
        # value are ignored, so the write is judged on the driver's bits alone)
        if after != before and not _legal(before, value & (ACK | DRV | FOK | DOK
                                                           | V.STATUS_FAILED)):
            a.breach(rule, f"status {before:#x} became {after:#x} after writing {value:#x}")
        _after(a)
    return program


def status_catalogue() -> list[Scenario]:
    cat = "status state machine"
    out: list[Scenario] = []
    values = sorted({ACK, DRV, FOK, DOK, ACK | FOK, ACK | DOK, DRV | FOK, ACK | DRV | DOK,
                     ACK | DRV | FOK | DOK, V.STATUS_DEVICE_NEEDS_RESET, 0x10, 0x20, 0xFF,
                     ACK | DRV | FOK | DOK | V.STATUS_DEVICE_NEEDS_RESET})
    for sname, old in STATES.items():
        for new in values:
            targets = {new}
            for bit in (ACK, DRV, FOK, DOK):
                if old & bit:
                    targets.add(old & ~bit)
            for v in sorted(targets):
                if v == old or _legal(old, v) or (v == 0):
                    continue
                name = f"status/{sname}-to-{v:#04x}"
                if any(s.name == name for s in out):
                    continue
                rule = "status/clear-bit" if old & ~v else "status/order"
                out.append(Scenario(name, cat, rule, _transition(sname, v, rule),
                                    setup=Setup.RAW, doc=f"write {v:#x} to the status of a function in {sname}"))

    def features(accept: int, high: bool = False) -> Callable[[Attack], None]:
        def program(a: Attack) -> None:
            _goto(a, "driver")
            a.dev.t.set_driver_features(accept)
            if high and isinstance(a.dev.t, MmioRaw):
                a.dev.t.wr(R.DRIVER_FEATURES_SEL, 2)
                a.dev.t.wr(R.DRIVER_FEATURES, 1)
            elif high and isinstance(a.dev.t, PciRaw):
                a.dev.t.cwr(VP.COMMON_GFSELECT, 4, 2)
                a.dev.t.cwr(VP.COMMON_GF, 4, 1)
            a.dev.t.set_status(ACK | DRV | FOK)
            a.dev.t.set_status(ACK | DRV | FOK | DOK)
            _after(a)
        return program
    base = BASE_FEATURES
    for name, acc, high in (("no-version-1", base & ~(1 << V.F_VERSION_1), False),
                            ("packed-ring", base | 1 << V.F_RING_PACKED, False),
                            ("in-order", base | 1 << V.F_IN_ORDER, False),
                            ("sr-iov", base | 1 << V.F_SR_IOV, False),
                            ("admin-vq", base | 1 << V.F_ADMIN_VQ, False),
                            ("bit-63", base | 1 << 63, False),
                            ("all-ones", (1 << 64) - 1, False),
                            ("high-select", base, True)):
        out.append(Scenario(f"status/features-{name}", cat, "features/not-offered",
                            features(acc, high), setup=Setup.RAW,
                            doc=f"accept {name} at FEATURES_OK"))

    def features_after_ok(a: Attack) -> None:
        _goto(a, "features-ok")
        a.dev.t.set_driver_features(0)
        a.dev.t.set_status(ACK | DRV | FOK | DOK)
        _after(a)
    out.append(Scenario("status/features-after-features-ok", cat, "features/after-features-ok",
                        features_after_ok, setup=Setup.RAW))

    def driver_ok_no_queues(a: Attack) -> None:
        _goto(a, "features-ok")
        a.dev.t.set_status(ACK | DRV | FOK | DOK)
        for q in range(4):
            a.dev.t.notify(q)
        a.sleep(SETTLE_NS)
    out.append(Scenario("status/driver-ok-without-queues", cat, "queue/not-ready",
                        driver_ok_no_queues, setup=Setup.RAW))

    def notify_early(a: Attack) -> None:
        a.dev.bring_up(driver_ok=False)
        for q in range(4):
            a.dev.t.notify(q)
        a.sleep(SETTLE_NS)
    out.append(Scenario("status/notify-before-driver-ok", cat, "queue/not-ready", notify_early,
                        setup=Setup.RAW))

    def queue_after_ok(a: Attack) -> None:
        q = a.dev.queues[A.FIRST_SUBMITQ]
        a.dev.t.setup_queue(q.index, 4, 0x1000, 0x2000, 0x3000)
        _after(a)
    out.append(Scenario("status/queue-setup-after-driver-ok", cat, "queue/after-driver-ok",
                        queue_after_ok))

    def failed(a: Attack) -> None:
        a.dev.t.set_status(a.dev.t.status() | V.STATUS_FAILED)
        _after(a)
    out.append(Scenario("status/failed-while-live", cat, "status/failed", failed))

    def reset_inflight(a: Attack) -> None:
        """Status 0 while GEMMs run, then check no DMA lands after the reset."""
        assert a.ctx is not None
        host = a.dev.buffer(4096)
        cb = _long_work() + cmd(isa.Opcode.SIGNAL, addr=host, value=7)
        q = a.dev.queues[A.FIRST_SUBMITQ]
        cbuf = a.dev.buffer(cb)
        resp = a.dev.buffer(A.SUBMIT_RESP.size)
        req = a.dev.buffer(struct.pack(A.SUBMIT_REQ.format, a.ctx, 0, cbuf, len(cb), 0, 1))
        q.put_avail(q.add([(req, A.SUBMIT_REQ.size, False), (resp, A.SUBMIT_RESP.size, True)]))
        a.dev.t.notify(q.index)
        a.sleep(2_000)
        if a.dev.mem.read(host, 8) != bytes(8):
            a.note("the work completed before the reset")
            return
        a.dev.t.set_status(0)
        a.dev.mem.write(resp, b"\xee" * A.SUBMIT_RESP.size)
        used = q.used_idx()
        a.sleep(5_000_000)
        if a.dev.mem.read(host, 8) != bytes(8):
            a.breach("reset/no-dma-after-reset", "a SIGNAL landed after status 0")
        if a.dev.mem.read(resp, A.SUBMIT_RESP.size) != b"\xee" * A.SUBMIT_RESP.size \
                or q.used_idx() != used:
            a.breach("reset/no-dma-after-reset", "a response or used entry written after status 0")
    out.append(Scenario("status/reset-with-work-in-flight", cat, "reset/no-dma-after-reset",
                        reset_inflight))

    def reset_storm(a: Attack) -> None:
        for _ in range(20):
            a.dev.t.set_status(0)
            a.dev.t.set_status(ACK)
            a.dev.t.set_status(ACK | DRV)
        _after(a)
    out.append(Scenario("status/reset-storm", cat, "status/reset", reset_storm, setup=Setup.RAW))
    return out


# -- virtio-mmio registers ------------------------------------------------------------------

def _on(transport: type, fn: Callable[..., object]) -> Callable[[Attack], None]:
    """`fn(attack, transport)` on the raw transport of that kind, then the common check."""
    def program(a: Attack) -> None:
        t = a.dev.t
        assert isinstance(t, transport)
        fn(a, t)
        _after(a)
    return program


def _mmio(fn: Callable[..., object]) -> Callable[[Attack], None]:
    return _on(MmioRaw, fn)


def mmio_catalogue() -> list[Scenario]:
    cat = "virtio-mmio registers"
    only = frozenset({"mmio"})
    out: list[Scenario] = []

    def add(name: str, rule: str, fn: Callable[..., object], doc: str,
            setup: Setup = Setup.LIVE) -> None:
        out.append(Scenario(f"mmio/{name}", cat, rule, _mmio(fn), only, setup, doc))

    regs = {"status": R.STATUS, "notify": R.QUEUE_NOTIFY, "queue-sel": R.QUEUE_SEL,
            "queue-num": R.QUEUE_NUM, "driver-features": R.DRIVER_FEATURES,
            "interrupt-ack": R.INTERRUPT_ACK, "queue-ready": R.QUEUE_READY}
    for rname, off in regs.items():
        for size in (1, 2, 8):
            add(f"write{size * 8}-{rname}", "mmio/access-size",
                lambda a, t, o=off, s=size: t.wr(o, 0xFFFF_FFFF_FFFF_FFFF & ((1 << 8 * s) - 1), s),
                f"{size}-byte store to {rname}")
        add(f"read16-{rname}", "mmio/access-size", lambda a, t, o=off: t.rd(o, 2) and None,
            f"2-byte load of {rname}")
        add(f"misaligned-{rname}", "mmio/access-size", lambda a, t, o=off: t.wr(o + 1, 1, 4),
            f"store at {rname} + 1")
    for off in (0x018, 0x028, 0x03C, 0x040, 0x048, 0x04C, 0x054, 0x068, 0x0C4, 0x0F0,
                R.SHM_SEL, R.SHM_BASE_LOW, R.QUEUE_RESET, 0x0F8):
        add(f"reserved-{off:#05x}", "mmio/reserved", lambda a, t, o=off: t.wr(o, 0xFFFF_FFFF),
            f"store to reserved offset {off:#x}")
    for name, off in (("magic", R.MAGIC_VALUE), ("version", R.VERSION),
                      ("device-id", R.DEVICE_ID), ("vendor-id", R.VENDOR_ID),
                      ("device-features", R.DEVICE_FEATURES),
                      ("queue-num-max", R.QUEUE_NUM_MAX),
                      ("interrupt-status", R.INTERRUPT_STATUS),
                      ("config-generation", R.CONFIG_GENERATION)):
        add(f"write-ro-{name}", "mmio/read-only", lambda a, t, o=off: t.wr(o, 0xFFFF_FFFF),
            f"store to read-only {name}")
    for size in (1, 2, 4, 8):
        add(f"config-write{size * 8}", "config/write",
            lambda a, t, s=size: t.wr(R.CONFIG + 8, 0xFF, s), f"{size}-byte device config store")
    add("config-read24", "mmio/access-size", lambda a, t: t.rd(R.CONFIG, 3) and None,
        "3-byte device config load")
    add("config-read-end", "config/read", lambda a, t: t.rd(R.REGION_SIZE - 4, 4) and None,
        "load at the last word of the window")
    add("past-window", "mmio/outside", lambda a, t: t.wr(R.REGION_SIZE + 0x70, 0), "store "
        "just past the window (no device there)")
    for sel in (A.FIRST_SUBMITQ + 16, 0xFFFF, 0xFFFF_FFFF):
        def bad_sel(a: Attack, t: MmioRaw, sel: int = sel) -> None:
            t.wr(R.QUEUE_SEL, sel)
            t.wr(R.QUEUE_NUM, 8)
            t.wr(R.QUEUE_DESC_LOW, 0x1000)
            t.wr(R.QUEUE_READY, 1)
            t.rd(R.QUEUE_NUM_MAX)
        add(f"queue-sel-{sel:#x}", "queue/bad-select", bad_sel, f"queue select {sel}, "
            "then queue registers", Setup.RAW)
    for idx in (A.FIRST_SUBMITQ + 16, 0xFFFF, 0xFFFF_FFFF):
        add(f"notify-{idx:#x}", "queue/not-ready", lambda a, t, i=idx: t.wr(R.QUEUE_NOTIFY, i),
            f"notify queue {idx}")
    add("interrupt-ack-all", "mmio/interrupt-ack",
        lambda a, t: t.wr(R.INTERRUPT_ACK, 0xFFFF_FFFF), "acknowledge every bit")
    add("features-sel-high", "features/select",
        lambda a, t: [t.wr(R.DEVICE_FEATURES_SEL, 0xFFFF_FFFF), t.rd(R.DEVICE_FEATURES)],
        "device feature select 2^32-1")

    def fuzz(a: Attack, t: MmioRaw) -> None:
        for _ in range(300):
            off = a.rng.randrange(0, R.CONFIG, 4)
            if off == R.STATUS:
                continue
            t.wr(off, a.rng.getrandbits(32))
    add("fuzz-registers", "mmio/fuzz", fuzz, "300 seeded stores to random registers")
    return out


# -- virtio-pci and config space --------------------------------------------------------------

def _pci(fn: Callable[..., object]) -> Callable[[Attack], None]:
    return _on(PciRaw, fn)


def pci_catalogue() -> list[Scenario]:
    cat = "virtio-pci"
    out: list[Scenario] = []

    def add(name: str, rule: str, fn: Callable[..., object], doc: str,
            setup: Setup = Setup.LIVE, attach: frozenset[str] = PCI_LIKE) -> None:
        out.append(Scenario(f"pci/{name}", cat, rule, _pci(fn), attach, setup, doc))

    # common configuration
    for fname, off in (("device-feature-select", VP.COMMON_DFSELECT), ("msix-config", VP.COMMON_MSIX),
                       ("status", VP.COMMON_STATUS), ("queue-select", VP.COMMON_Q_SELECT),
                       ("queue-size", VP.COMMON_Q_SIZE), ("queue-enable", VP.COMMON_Q_ENABLE),
                       ("queue-desc-hi", VP.COMMON_Q_DESCHI)):
        width = VP.COMMON_FIELD_SIZE[off]
        for size in (1, 2, 4, 8):
            if size == width or (off in (VP.COMMON_Q_DESCLO,) and size == 8):
                continue
            add(f"common-{fname}-width{size * 8}", "pci/access-size",
                lambda a, t, o=off, s=size: t.cwr(o, s, (1 << 8 * s) - 1),
                f"{size}-byte store to {fname}")
    for name, off, size in (("num-queues", VP.COMMON_NUMQ, 2), ("device-feature", VP.COMMON_DF, 4),
                            ("config-generation", VP.COMMON_CFGGENERATION, 1),
                            ("queue-notify-off", VP.COMMON_Q_NOFF, 2),
                            ("queue-notify-data", VP.COMMON_Q_NDATA, 2),
                            ("queue-reset", VP.COMMON_Q_RESET, 2),
                            ("admin-queue-index", VA.COMMON_ADM_Q_IDX, 2),
                            ("admin-queue-num", VA.COMMON_ADM_Q_NUM, 2),
                            ("past-common", 0x100, 4), ("end-of-page", 0xFFC, 4)):
        add(f"common-write-{name}", "pci/read-only",
            lambda a, t, o=off, s=size: t.cwr(o, s, (1 << 8 * s) - 1), f"store to {name}")
    for sel in (A.FIRST_SUBMITQ + 16, 0x7FFF, 0xFFFF):
        def bad_sel(a: Attack, t: PciRaw, sel: int = sel) -> None:
            t.cwr(VP.COMMON_Q_SELECT, 2, sel)
            t.cwr(VP.COMMON_Q_SIZE, 2, 8)
            t.cwr(VP.COMMON_Q_MSIX, 2, 0)
            t.cwr(VP.COMMON_Q_DESCLO, 4, 0x1000)
            t.cwr(VP.COMMON_Q_ENABLE, 2, 1)
            t.crd(VP.COMMON_Q_NOFF, 2)
        add(f"common-queue-select-{sel:#x}", "queue/bad-select", bad_sel,
            f"queue_select {sel}, then queue fields", Setup.RAW)
    for v in (0, 2, 0xFFFF):
        def enable(a: Attack, t: PciRaw, v: int = v) -> None:
            a.dev.bring_up(driver_ok=False)
            t.cwr(VP.COMMON_Q_SELECT, 2, A.FIRST_SUBMITQ)
            t.cwr(VP.COMMON_Q_ENABLE, 2, v)
        add(f"common-queue-enable-{v}", "queue/enable", enable, f"queue_enable = {v}",
            Setup.RAW)
    for vec in (0x40, 0x7FFE):
        def vector(a: Attack, t: PciRaw, vec: int = vec) -> None:
            t.cwr(VP.COMMON_MSIX, 2, vec)
            t.cwr(VP.COMMON_Q_SELECT, 2, A.FIRST_SUBMITQ)
            t.cwr(VP.COMMON_Q_MSIX, 2, vec)
        add(f"msix-vector-{vec:#x}", "msix/vector-range", vector,
            f"config and queue vector {vec} (past the table)")
    # notifications
    for qi in (A.FIRST_SUBMITQ + 16, 0x3FF):
        add(f"notify-queue-{qi:#x}", "pci/bar-access",
            lambda a, t, q=qi: a.kernel.mmio.write(t.notify_addr(q), 2, q),
            f"notify address of queue {qi}")
    add("notify-wrong-value", "notify/value",
        lambda a, t: a.kernel.mmio.write(t.notify_addr(A.FIRST_SUBMITQ), 2, A.CONTROLQ),
        "write queue 0's index at queue 2's notify address")
    for size in (1, 8):
        add(f"notify-width{size * 8}", "pci/access-size",
            lambda a, t, s=size: a.kernel.mmio.write(t.notify_addr(A.FIRST_SUBMITQ), s,
                                                     A.FIRST_SUBMITQ),
            f"{size}-byte notify")
    add("notify-misaligned", "pci/access-size",
        lambda a, t: a.kernel.mmio.write(t.notify_addr(A.FIRST_SUBMITQ) + 2, 2, A.FIRST_SUBMITQ),
        "notify at an offset between queues")

    def notify_no_bme(a: Attack, t: PciRaw) -> None:
        t.cfg_write(P.COMMAND, 2, (t.command0 & ~P.COMMAND_MASTER) | P.COMMAND_MEMORY)
        t.notify(A.FIRST_SUBMITQ)
    add("notify-bus-master-off", "pci/bus-master", notify_no_bme, "notify with Bus Master off")

    def bme_off_wait(a: Attack, t: PciRaw) -> None:
        """A WAIT parked on a host word; clear Bus Master, release the word: the function
        must issue no memory request until Bus Master is set again (defect 3)."""
        assert a.ctx is not None
        flag = a.dev.buffer(8)
        sig = a.dev.buffer(8)
        cb = cmd(isa.Opcode.WAIT, addr=flag, value=1) + cmd(isa.Opcode.SIGNAL, addr=sig, value=9)
        q = a.dev.queues[A.FIRST_SUBMITQ]
        cbuf = a.dev.buffer(cb)
        resp = a.dev.buffer(A.SUBMIT_RESP.size)
        req = a.dev.buffer(struct.pack(A.SUBMIT_REQ.format, a.ctx, 0, cbuf, len(cb), 0, 1))
        q.put_avail(q.add([(req, A.SUBMIT_REQ.size, False), (resp, A.SUBMIT_RESP.size, True)]))
        t.notify(q.index)
        a.sleep(5_000)
        t.cfg_write(P.COMMAND, 2, (t.command0 & ~P.COMMAND_MASTER) | P.COMMAND_MEMORY)
        used = q.used_idx()
        a.dev.mem.write(flag, struct.pack("<Q", 1))
        a.sleep(500_000)
        if a.dev.mem.read(sig, 8) != bytes(8) or q.used_idx() != used:
            a.breach("pci/bus-master-dma", "DMA (SIGNAL, response or used entry) with Bus "
                     "Master Enable clear")
        t.cfg_write(P.COMMAND, 2, t.command0 | P.COMMAND_MEMORY | P.COMMAND_MASTER)
        q.wait_used(500_000)
    add("bus-master-off-with-wait-parked", "pci/bus-master-dma", bme_off_wait,
        "clear Bus Master while a WAIT is parked, then release it")

    def mem_off(a: Attack, t: PciRaw) -> None:
        t.cfg_write(P.COMMAND, 2, 0)
        t.set_status(0)
        t.crd(VP.COMMON_NUMQ, 2)
        t.notify(A.FIRST_SUBMITQ)
    add("memory-space-off", "pci/memory-disabled", mem_off, "BAR access with Memory Space off")
    # ISR and device config
    for size in (2, 4, 8):
        add(f"isr-read{size * 8}", "pci/access-size",
            lambda a, t, s=size: a.kernel.mmio.read(t.bar + A.PCI_ISR_OFFSET, s) and None,
            f"{size}-byte ISR load")
    add("isr-write", "pci/read-only",
        lambda a, t: a.kernel.mmio.write(t.bar + A.PCI_ISR_OFFSET, 1, 0xFF), "store to ISR")
    add("isr-past", "pci/reserved",
        lambda a, t: a.kernel.mmio.read(t.bar + A.PCI_ISR_OFFSET + 0x10, 1) and None,
        "ISR page past the register")
    for size in (1, 4, 8):
        add(f"device-config-write{size * 8}", "config/write",
            lambda a, t, s=size: a.kernel.mmio.write(t.bar + A.PCI_DEVICE_CFG_OFFSET, s, 0),
            f"{size}-byte device config store")
    add("device-config-read24", "pci/access-size",
        lambda a, t: a.kernel.mmio.read(t.bar + A.PCI_DEVICE_CFG_OFFSET, 3) and None,
        "3-byte device config load")
    add("bar-cross-page", "pci/access-size",
        lambda a, t: a.kernel.mmio.write(t.bar + 0xFFC, 8, 0), "8-byte store across a page")
    add("bar-unused-pages", "pci/reserved",
        lambda a, t: [a.kernel.mmio.write(t.bar + off, 4, 0xFFFF_FFFF)
                      for off in range(0x6000, A.PCI_BAR_SIZE, 0x400)] and None,
        "stores into the BAR's unused pages")

    # PCI_CFG window
    def cfg_window(bar: int, offset: int, length: int, write: bool) -> Callable[[Attack, PciRaw], None]:
        def fn(a: Attack, t: PciRaw) -> None:
            cap = t.pci_cfg_cap
            if cap is None:
                a.note("no PCI_CFG capability")
                return
            o = VP.CAP.offsets
            t.cfg_write(cap + o["bar"], 1, bar)
            t.cfg_write(cap + o["offset"], 4, offset)
            t.cfg_write(cap + o["length"], 4, length)
            if write:
                t.cfg_write(cap + VP.PCI_CFG_CAP_DATA, 4, 0)
            else:
                t.cfg_read(cap + VP.PCI_CFG_CAP_DATA, 4)
        return fn
    for name, bar, off, length in (("bar5", 5, 0, 4), ("offset-past-bar", 0, A.PCI_BAR_SIZE, 4),
                                   ("offset-wrap", 0, 0xFFFF_FFFC, 4), ("length3", 0, 0, 3),
                                   ("length0", 0, 0, 0), ("misaligned", 0, 2, 4),
                                   ("status-reset", 0, VP.COMMON_STATUS, 1),
                                   ("notify", 0, A.PCI_NOTIFY_OFFSET + 8, 2),
                                   ("msix-table", 0, A.PCI_MSIX_TABLE_OFFSET, 4)):
        for write in (False, True):
            add(f"pci-cfg-window-{name}-{'write' if write else 'read'}", "pci/cfg-window",
                cfg_window(bar, off, length, write), f"PCI_CFG window at {name}")
    # MSI-X
    def msix_entry(addr: int, data: int, enable: bool) -> Callable[[Attack, PciRaw], None]:
        def fn(a: Attack, t: PciRaw) -> None:
            tab = t.bar + A.PCI_MSIX_TABLE_OFFSET
            for v in range(3):
                a.kernel.mmio.write(tab + 16 * v + P.MSIX_ENTRY_LOWER_ADDR, 4, addr & 0xFFFF_FFFF)
                a.kernel.mmio.write(tab + 16 * v + P.MSIX_ENTRY_UPPER_ADDR, 4, addr >> 32)
                a.kernel.mmio.write(tab + 16 * v + P.MSIX_ENTRY_DATA, 4, data)
                a.kernel.mmio.write(tab + 16 * v + P.MSIX_ENTRY_VECTOR_CTRL, 4, 0)
            if enable and t.msix_cap is not None:
                t.cfg_write(t.msix_cap + P.MSIX_FLAGS, 2, P.MSIX_FLAGS_ENABLE)
                t.cwr(VP.COMMON_MSIX, 2, 0)
                t.cwr(VP.COMMON_Q_SELECT, 2, A.FIRST_SUBMITQ)
                t.cwr(VP.COMMON_Q_MSIX, 2, 1)
            if a.ctx is not None:
                a.dev.submit(a.ctx, cmd(0x7F), timeout_ns=SETTLE_NS)   # fault: an event
            if t.msix_cap is not None:
                t.cfg_write(t.msix_cap + P.MSIX_FLAGS, 2, 0)
        return fn
    for name, addr, data in (("into-ram", 0x20_0000, 0x41), ("into-victim-window", 0xFEE0_0000, 0xFF),
                             ("high-address", 0xFFFF_FFFF_FFFF_F000, 0x30),
                             ("ecam", 0xE000_0000, 0), ("zero", 0, 0)):
        add(f"msix-entry-{name}", "msi/refused", msix_entry(addr, data, True),
            f"MSI-X entries pointing at {name}, then interrupts")

    def msix_widths(a: Attack, t: PciRaw) -> None:
        tab = t.bar + A.PCI_MSIX_TABLE_OFFSET
        a.kernel.mmio.write(tab + 1, 1, 0xFF)
        a.kernel.mmio.write(tab + 2, 2, 0xFFFF)
        a.kernel.mmio.read(tab + 0x7F8, 8)
        a.kernel.mmio.write(tab + 0xFF0, 8, (1 << 64) - 1)
    add("msix-table-widths", "msix/access-size", msix_widths, "odd widths in the MSI-X table")
    add("msix-pba-write", "msix/pba-read-only",
        lambda a, t: a.kernel.mmio.write(t.bar + A.PCI_MSIX_PBA_OFFSET, 8, (1 << 64) - 1),
        "store to the PBA")

    def maskall(a: Attack, t: PciRaw) -> None:
        if t.msix_cap is None:
            return
        for flags in (P.MSIX_FLAGS_MASKALL, P.MSIX_FLAGS_ENABLE | P.MSIX_FLAGS_MASKALL, 0xFFFF, 0):
            t.cfg_write(t.msix_cap + P.MSIX_FLAGS, 2, flags)
            if a.ctx is not None:
                a.dev.submit(a.ctx, cmd(isa.Opcode.NOP), timeout_ns=SETTLE_NS)
    add("msix-maskall-toggle", "msix/mask", maskall, "toggle MASKALL/enable around work")
    # BARs and config space
    def bar_move(addr: int) -> Callable[[Attack, PciRaw], None]:
        def fn(a: Attack, t: PciRaw) -> None:
            t.cfg_write(P.BASE_ADDRESS_0, 4, addr & 0xFFFF_FFFF)
            t.cfg_write(P.BASE_ADDRESS_0 + 4, 4, addr >> 32)
            a.kernel.mmio.read(addr + VP.COMMON_NUMQ, 2)
            a.kernel.mmio.write(addr + VP.COMMON_STATUS, 1, 0)
        return fn
    for name, addr in (("onto-ram", 0x10_0000), ("onto-ecam", 0xE000_0000),
                       ("onto-msi-window", 0xFEE0_0000), ("zero", 0),
                       ("top", 0xFFFF_FFFF_FFFF_0000), ("onto-mmio-window", 0xD000_0000)):
        add(f"bar-remap-{name}", "pci/bar", bar_move(addr), f"move BAR 0 {name}")

    def bar_sizing(a: Attack, t: PciRaw) -> None:
        for reg in range(P.BASE_ADDRESS_0, P.BASE_ADDRESS_0 + 24, 4):
            t.cfg_write(reg, 4, 0xFFFF_FFFF)
            t.cfg_read(reg, 4)
    add("bar-sizing-all", "pci/bar", bar_sizing, "size every BAR register and leave it so")

    def header_ro(a: Attack, t: PciRaw) -> None:
        for reg, size in ((P.VENDOR_ID, 2), (P.DEVICE_ID, 2), (P.REVISION_ID, 1),
                          (P.CLASS_DEVICE, 2), (P.HEADER_TYPE, 1), (P.SUBSYSTEM_ID, 2),
                          (P.CAPABILITY_LIST, 1), (P.INTERRUPT_PIN, 1), (P.STATUS, 2)):
            t.cfg_write(reg, size, (1 << 8 * size) - 1)
    add("config-header-read-only", "pci/config-read-only", header_ro,
        "stores to read-only header fields")
    add("config-command-all-ones", "pci/command",
        lambda a, t: t.cfg_write(P.COMMAND, 2, 0xFFFF), "Command = 0xFFFF")

    def cap_chain(a: Attack, t: PciRaw) -> None:
        off = t.cfg_read(P.CAPABILITY_LIST, 1)
        for _ in range(8):
            if not off:
                break
            t.cfg_write(off + 1, 1, off)     # next -> itself
            t.cfg_write(off + 2, 2, 0xFFFF)
            off = t.cfg_read(off + 1, 1)
    add("config-capability-headers", "pci/config-read-only", cap_chain,
        "stores over capability headers (next pointers)")

    def virtio_caps(a: Attack, t: PciRaw) -> None:
        off = t.cfg_read(P.CAPABILITY_LIST, 1)
        for _ in range(16):
            if not off:
                break
            if t.cfg_read(off, 1) == P.CAP_ID_VNDR:
                for field in range(4, 16, 4):
                    t.cfg_write(off + field, 4, 0xFFFF_FFFF)
            off = t.cfg_read(off + 1, 1)
    add("config-virtio-caps", "pci/config-read-only", virtio_caps,
        "stores over the virtio capabilities' bar/offset/length")

    def sweep(a: Attack, t: PciRaw) -> None:
        for _ in range(400):
            reg = a.rng.randrange(0x40, P.CFG_SPACE_EXP_SIZE, 4)
            if t.exp_cap is not None and t.exp_cap <= reg < t.exp_cap + 0x10:
                continue
            t.cfg_write(reg, 4, a.rng.getrandbits(32))
    add("config-fuzz", "pci/config", sweep, "400 seeded stores over config space past the header")

    def ext_space(a: Attack, t: PciRaw) -> None:
        for reg in range(P.EXT_CAP_START, P.EXT_CAP_START + 0x80, 4):
            t.cfg_write(reg, 4, 0xFFFF_FFFF)
        t.cfg_write(P.EXT_CAP_START + P.SRIOV_NUM_VF, 2, 64)
        t.cfg_write(P.EXT_CAP_START + P.SRIOV_CTRL, 2, P.SRIOV_CTRL_VFE | P.SRIOV_CTRL_MSE)
    add("config-extended-space", "pci/config", ext_space,
        "stores over extended config space (SR-IOV fields)")
    add("config-out-of-range", "pci/config",
        lambda a, t: t.cfg_write(P.CFG_SPACE_EXP_SIZE - 2, 2, 0xFFFF),
        "store at the end of config space")

    def flr_inflight(a: Attack, t: PciRaw) -> None:
        assert a.ctx is not None
        host = a.dev.buffer(8)
        cb = _long_work() + cmd(isa.Opcode.SIGNAL, addr=host, value=7)
        q = a.dev.queues[A.FIRST_SUBMITQ]
        cbuf = a.dev.buffer(cb)
        resp = a.dev.buffer(A.SUBMIT_RESP.size)
        req = a.dev.buffer(struct.pack(A.SUBMIT_REQ.format, a.ctx, 0, cbuf, len(cb), 0, 1))
        q.put_avail(q.add([(req, A.SUBMIT_REQ.size, False), (resp, A.SUBMIT_RESP.size, True)]))
        t.notify(q.index)
        a.sleep(2_000)
        if a.dev.mem.read(host, 8) != bytes(8):
            a.note("the work completed before the FLR")
            return
        if t.exp_cap is not None:
            t.cfg_write(t.exp_cap + P.EXP_DEVCTL, 2, P.EXP_DEVCTL_BCR_FLR)
        a.dev.mem.write(resp, b"\xee" * A.SUBMIT_RESP.size)
        used = q.used_idx()
        a.sleep(5_000_000)
        if a.dev.mem.read(host, 8) != bytes(8) or q.used_idx() != used \
                or a.dev.mem.read(resp, A.SUBMIT_RESP.size) != b"\xee" * A.SUBMIT_RESP.size:
            a.breach("reset/no-dma-after-reset", "DMA after FLR")
        t.restore()
    add("flr-with-work-in-flight", "reset/no-dma-after-reset", flr_inflight,
        "function-level reset while GEMMs run")

    def flr_storm(a: Attack, t: PciRaw) -> None:
        for _ in range(10):
            if t.exp_cap is not None:
                t.cfg_write(t.exp_cap + P.EXP_DEVCTL, 2, P.EXP_DEVCTL_BCR_FLR)
            t.restore()
            t.set_status(ACK)
    add("flr-storm", "reset/flr", flr_storm, "ten FLRs back to back")
    return out


# -- admin virtqueue from a VF ------------------------------------------------------------------

def admin_catalogue() -> list[Scenario]:
    cat = "admin virtqueue"
    only = frozenset({"sriov"})
    out: list[Scenario] = []

    def add(name: str, rule: str, fn: Callable[..., object], doc: str,
            setup: Setup = Setup.LIVE) -> None:
        out.append(Scenario(f"admin/{name}", cat, rule, _pci(fn), only, setup, doc))

    def admin_cmd(opcode: int, member: int, data: bytes = b"") -> bytes:
        return struct.pack(VA.CMD_HDR.format, opcode, VA.GROUP_TYPE_SRIOV, bytes(12),
                           member) + data

    res = struct.pack(A.VF_RESOURCES.format, 1 << 20, 1, 1, 1000, 2, 1, 1)

    def on_queue(index_of: Callable[[PciRaw], int], opcode: int, member: int,
                 data: bytes = b"") -> Callable[[Attack, PciRaw], None]:
        def fn(a: Attack, t: PciRaw) -> None:
            qi = index_of(t)
            req = a.dev.buffer(admin_cmd(opcode, member, data))
            resp = a.dev.buffer(64)
            q = a.dev.make_queue(qi, 8) if qi not in a.dev.queues else a.dev.queues[qi]
            q.put_avail(q.add([(req, 64, False), (resp, 64, True)]))
            a.kernel.mmio.write(t.notify_addr(qi), 2, qi)
            q.wait_used(SETTLE_NS)
        return fn
    nq = lambda t: t.crd(VP.COMMON_NUMQ, 2)   # noqa: E731  (where a PF's admin queue sits)
    for opname, op, member, data in (("resources-set-victim", A.AdminOp.VF_RESOURCES_SET, 2, res),
                                     ("reset-victim", A.AdminOp.VF_RESET, 2, b""),
                                     ("stop-victim", A.AdminOp.VF_STOP, 2, b""),
                                     ("stats-victim", A.AdminOp.VF_STATS, 2, b""),
                                     ("resources-set-self", A.AdminOp.VF_RESOURCES_SET, 1, res),
                                     ("list-query", VA.CMD_LIST_QUERY, 0, b"")):
        add(f"{opname}-on-submitq", "admin/not-offered",
            on_queue(lambda t: A.FIRST_SUBMITQ, op, member, data),
            f"an admin command ({opname}) on a submit queue")
        add(f"{opname}-on-admin-slot", "queue/not-ready",
            on_queue(nq, op, member, data),
            f"an admin command ({opname}) notified at the PF's admin queue index")

    def features(a: Attack, t: PciRaw) -> None:
        a.dev.reset()
        a.dev.negotiate(BASE_FEATURES | 1 << V.F_ADMIN_VQ | 1 << V.F_SR_IOV)
        a.dev.reset()
    add("accept-admin-features", "features/not-offered", features,
        "accept SR_IOV and ADMIN_VQ on a VF", Setup.RAW)

    def fields(a: Attack, t: PciRaw) -> None:
        for size in (1, 2, 4):
            t.cwr(VA.COMMON_ADM_Q_IDX, size, 0)
            t.cwr(VA.COMMON_ADM_Q_NUM, size, 0xFFFF)
        t.cwr(VP.COMMON_Q_SELECT, 2, t.crd(VA.COMMON_ADM_Q_IDX, 2))
        t.cwr(VP.COMMON_Q_ENABLE, 2, 1)
    add("admin-fields", "pci/read-only", fields, "stores to admin_queue_index / num")

    def sriov_cap(a: Attack, t: PciRaw) -> None:
        for reg in (P.SRIOV_CTRL, P.SRIOV_NUM_VF, P.SRIOV_VF_OFFSET, P.SRIOV_SYS_PGSIZE):
            t.cfg_write(P.EXT_CAP_START + reg, 2, 0xFFFF)
    add("vf-sriov-capability", "sriov/vf-has-none", sriov_cap,
        "stores where a PF's SR-IOV capability would be")
    return out


ALL_ATTACH = ALL
