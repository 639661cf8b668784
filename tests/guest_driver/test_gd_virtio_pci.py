"""The virtio-pci modern transport against a fake VA-1 function, and boot over PCI."""
import struct

import pytest

from gd_fakes import OFFERED, make_machine
from gd_helpers import Client, nop_cmdbuf
from gd_pci_fakes import (COMMON_OFF, NOTIFY_OFF, VIRTIO_BAR, FakePciFunction, PciMachine,
                          make_pci_machine)
from guest_driver.boot import boot
from guest_driver.mm import PageAllocator
from guest_driver.pci import scan_host
from guest_driver.va1.driver import VA1Device
from guest_driver.virtio.pci import MODE_PER_QUEUE, MODE_SHARED, VirtioPci
from guest_driver.virtio.transport import ProbeError
from hwspec import pci as P
from hwspec import va1 as A
from hwspec import virtio as V
from hwspec import virtio_pci as VP


def booted_pci(n=1, **kw):
    k, devs, m = make_pci_machine(n, **kw)
    gos = boot(k)
    return k, devs, m, gos


def common_accesses(k, dev):
    base = dev.pci.bar_address(VIRTIO_BAR) + COMMON_OFF
    return [(d, a - base, s, v) for d, a, s, v in k.mmio.log
            if base <= a < base + VP.COMMON_CFG_SIZE]


def roundtrip(gos, path="/dev/accel/accel0", n=3):
    c = Client(gos.open(path))
    cid = c.ctx()
    h = c.cmdbuf(nop_cmdbuf(2))
    seqs = [c.submit(cid, h, 16, queue=i % 2) for i in range(n)]
    return [c.wait(cid, s).status for s in seqs]


def test_boot_handshake_features_vectors_and_io():
    k, (dev,), m, gos = booted_pci()
    assert list(gos.devices) == ["/dev/accel/accel0"] and gos.probe_errors == []
    acc = common_accesses(k, dev)
    # natural widths on every common-config access
    assert all(VP.COMMON_FIELD_SIZE[off] == s for _, off, s, _ in acc)
    status = [v for d, off, _, v in acc if d == "w" and off == VP.COMMON_STATUS]
    ack, drv, fok, dok = (V.STATUS_ACKNOWLEDGE, V.STATUS_DRIVER, V.STATUS_FEATURES_OK,
                          V.STATUS_DRIVER_OK)
    assert status == [0, ack, ack | drv, ack | drv | fok, ack | drv | fok | dok]
    assert dev.features == OFFERED and dev.status & dok
    assert [q.ready for q in dev.queues] == [1] * 4
    # one vector for config changes, one per queue, as read back
    t = gos.devices["/dev/accel/accel0"].transport
    assert t.mode == MODE_PER_QUEUE
    assert dev.msix_config == 0 and dev.qvec == {0: 1, 1: 2, 2: 3, 3: 4}
    assert len(k.irq.msi) == 5
    assert dev.pci.command & (P.COMMAND_MEMORY | P.COMMAND_MASTER) == (
        P.COMMAND_MEMORY | P.COMMAND_MASTER)
    assert roundtrip(gos) == [A.Status.OK] * 3
    assert dev.violations == [] and dev.pci.violations == [] and dev.lost_interrupts == []
    assert k.stray_msi == []
    assert any(k_ == "bound" and f.get("pci") == "0000:00:03.0" for k_, f in k.trace.events)


def test_queue_vector_interrupt_reaps_without_touching_the_device():
    k, (dev,), m, gos = booted_pci()
    c = Client(gos.open("/dev/accel/accel0"))
    cid = c.ctx()
    h = c.cmdbuf(nop_cmdbuf(1))
    dev.hold_submits = True
    seq = c.submit(cid, h, 8)
    k.sched.run_all()
    n0 = len(k.mmio.log)
    dev.release_held()
    k.sched.run_all()
    assert c.wait(cid, seq, 0).status == A.Status.OK
    # completion handled by the submitq's own vector: no ISR read, no MMIO at all
    assert len(k.mmio.log) == n0
    vec = dev.qvec[A.FIRST_SUBMITQ]
    handler_names = {d: name for d, (_, name) in k.irq.msi.items()}
    assert handler_names[k.msi_log[-1][1]] == f"accel0-vq{A.FIRST_SUBMITQ}"
    assert vec == 1 + A.FIRST_SUBMITQ


def test_notify_address_uses_queue_notify_off_times_multiplier():
    offs = [7, 2, 11, 0]
    k, (dev,), m, gos = booted_pci(notify_mult=256, notify_offs=offs)
    t = gos.devices["/dev/accel/accel0"].transport
    base = dev.pci.bar_address(VIRTIO_BAR) + NOTIFY_OFF
    assert t.notify_multiplier == 256
    assert t.notify_addr == {q: base + offs[q] * 256 for q in range(4)}
    assert roundtrip(gos, n=2) == [A.Status.OK] * 2
    assert dev.violations == []
    assert set(dev.notifies) >= {A.EVENTQ, A.CONTROLQ, A.FIRST_SUBMITQ, A.FIRST_SUBMITQ + 1}
    writes = [(a, s, v) for d, a, s, v in k.mmio.log if d == "w" and base <= a < base + 0x1000]
    assert writes and all(a == base + offs[v] * 256 and s == 2 for a, s, v in writes)


def test_notify_multiplier_zero_shares_one_address():
    k, (dev,), m, gos = booted_pci(notify_mult=0, notify_offs=[0, 0, 0, 0])
    t = gos.devices["/dev/accel/accel0"].transport
    assert len(set(t.notify_addr.values())) == 1
    assert roundtrip(gos, n=2) == [A.Status.OK] * 2


@pytest.mark.parametrize("mult, offs, msg", [
    (3, None, "notify_off_multiplier 3 is neither 0 nor an even power of 2"),
    (1024, [0, 1, 2, 9], "queue 3 notify offset 9 x multiplier 1024"),
])
def test_bad_notify_geometry_fails_probe(mult, offs, msg):
    k, (dev,), m, gos = booted_pci(notify_mult=mult, notify_offs=offs)
    assert gos.devices == {}
    assert len(gos.probe_errors) == 1 and msg in gos.probe_errors[0]
    assert k.irq.msi == {}  # vectors given back
    assert dev.status & V.STATUS_FAILED or "multiplier 3" in msg


@pytest.mark.parametrize("how", ["queue", "config"])
def test_vector_refused_falls_back_to_one_shared_vector(how):
    k, devs, m = make_pci_machine()
    dev = devs[0]
    if how == "queue":
        dev.vector_limit = 3  # the device can route to vectors 0..2 only
    else:
        orig = dev._common
        writes = []

        def common(off, size, value):  # refuses the first msix_config mapping only
            if off == VP.COMMON_MSIX and value is not None:
                writes.append(value)
                dev.refuse_config_vector = len(writes) == 1
            return orig(off, size, value)
        dev._common = common
    gos = boot(k)
    assert list(gos.devices) == ["/dev/accel/accel0"], gos.probe_errors
    t = gos.devices["/dev/accel/accel0"].transport
    assert t.mode == MODE_SHARED and "refused" in t.fallback_reason
    assert dev.msix_config == 0 and set(dev.qvec.values()) == {0}
    assert len(k.irq.msi) == 1 and k.irq.msi_frees == 5
    assert [f["reason"] for f in k.trace.of("msix_fallback")] == [t.fallback_reason]
    assert roundtrip(gos) == [A.Status.OK] * 3
    assert dev.violations == [] and dev.lost_interrupts == []


def test_small_table_or_no_kernel_vectors_use_the_shared_vector():
    k, (dev,), m, gos = booted_pci(msix_n=2)
    t = gos.devices["/dev/accel/accel0"].transport
    assert t.mode == MODE_SHARED and "table has 2 entries, 5 wanted" in t.fallback_reason
    assert roundtrip(gos) == [A.Status.OK] * 3
    k, devs, m = make_pci_machine()
    k.irq.msi_capacity = 3
    gos = boot(k)
    t = gos.devices["/dev/accel/accel0"].transport
    assert t.mode == MODE_SHARED and "no 5 MSI vectors" in t.fallback_reason
    assert roundtrip(gos) == [A.Status.OK] * 3


def test_shared_vector_reads_isr_to_see_config_changes():
    k, (dev,), m, gos = booted_pci(msix_n=1)
    d = gos.devices["/dev/accel/accel0"]
    dev.set_config(max_contexts=5)
    k.sched.run_all()
    assert d.config["max_contexts"] == 5 and k.trace.of("config_change")
    assert dev.isr == 0  # read (and cleared) by the handler


def test_every_vector_refused_fails_probe_and_boot_goes_on():
    k, devs, m = make_pci_machine(2)
    devs[0].refuse_all_vectors = True
    gos = boot(k)
    assert list(gos.devices) == ["/dev/accel/accel0"]
    assert gos.devices["/dev/accel/accel0"].transport.fn.bdf.dev == 4
    (err,) = gos.probe_errors
    assert "0000:00:03.0" in err and "even with a single shared vector" in err
    assert "INTx is not supported" in err
    assert devs[0].status & V.STATUS_FAILED and not devs[0].status & V.STATUS_DRIVER_OK
    assert len(k.irq.msi) == 5  # only the bound device's vectors are left
    assert roundtrip(gos) == [A.Status.OK] * 3


def test_no_msix_capability_fails_probe_clearly():
    k = make_pci_machine(0)[0]
    m = PciMachine(k, ecam_base=0xE800_0000, mem_base=0x9000_0000)
    from gd_pci_fakes import FakeVA1Pci
    dev = FakeVA1Pci(k)
    dev.pci.cfg[dev.pci.msix_cap] = 0x05  # turn MSI-X into an MSI capability
    m.add(dev.pci, 0, 1)
    gos = boot(k)
    assert gos.devices == {} and "no MSI-X capability; INTx is not supported" in \
        gos.probe_errors[0]


@pytest.mark.parametrize("skip, msg", [
    ((VP.CAP_NOTIFY_CFG,), "no usable virtio NOTIFY_CFG capability"),
    ((VP.CAP_COMMON_CFG, VP.CAP_ISR_CFG), "COMMON_CFG, ISR_CFG"),
])
def test_missing_virtio_caps_fail_probe(skip, msg):
    k, devs, m = make_pci_machine(0)
    from gd_pci_fakes import FakeVA1Pci
    dev = FakeVA1Pci(k, caps="none")
    dev.add_virtio_caps(skip=skip)
    m.add(dev.pci, 0, 2)
    gos = boot(k)
    assert gos.devices == {} and msg in gos.probe_errors[0]
    assert "0000:00:02.0" in gos.probe_errors[0]


def test_caps_with_reserved_bar_or_bad_range_are_skipped_for_later_ones():
    k, devs, m = make_pci_machine(0)
    from gd_pci_fakes import FakeVA1Pci, virtio_cap
    dev = FakeVA1Pci(k, caps="none")
    dev.pci.add_cap(P.CAP_ID_VNDR, virtio_cap(VP.CAP_COMMON_CFG, 7, 0, 0x40))  # reserved
    dev.pci.add_cap(P.CAP_ID_VNDR, virtio_cap(VP.CAP_COMMON_CFG, VIRTIO_BAR, 0x3FF0, 0x40))
    dev.add_virtio_caps()
    m.add(dev.pci, 0, 2)
    gos = boot(k)
    assert list(gos.devices) == ["/dev/accel/accel0"], gos.probe_errors
    t = gos.devices["/dev/accel/accel0"].transport
    assert t.common.offset == COMMON_OFF and t.pci_cfg_offset is not None
    assert roundtrip(gos) == [A.Status.OK] * 3


def test_config_read_uses_32bit_halves_and_retries_on_generation_change():
    k, (dev,), m, gos = booted_pci(config={"device_memory_size": 0x1_2345_6000})
    t = gos.devices["/dev/accel/accel0"].transport
    gens = iter([1, 2, 2, 2])
    orig = dev._common

    def common(off, size, value):
        if off == VP.COMMON_CFGGENERATION and value is None:
            return next(gens)
        return orig(off, size, value)
    dev._common = common
    cfg = t.read_config(A.CONFIG)
    assert cfg["device_memory_size"] == 0x1_2345_6000
    assert dev.violations == []  # no 8-byte access to the device config


def test_torn_config_read_is_retried_and_never_mixes_two_generations():
    """The device re-provisions itself between the low and the high half of
    device_memory_size (and bumps config_generation): the driver's first pass would mix
    old and new words; it sees the generation move, reads again, and returns only the
    new configuration."""
    k, (dev,), m, gos = booted_pci(config={"device_memory_size": 0x1_0000_0000,
                                           "max_contexts": 5})
    t = gos.devices["/dev/accel/accel0"].transport
    from gd_pci_fakes import DEVCFG_OFF
    hi = DEVCFG_OFF + A.CONFIG.offsets["device_memory_size"] + 4
    orig = dev.pci.bar_io
    torn = []

    def bar_io(index, off, size, value):
        if off == hi and value is None and not torn:
            torn.append(orig(index, off - 4, 4, None))   # the low half the driver just read
            dev.set_config(device_memory_size=0x2_0010_0000, max_contexts=9)
        return orig(index, off, size, value)
    dev.pci.bar_io = bar_io
    gen0 = t.config_generation()
    n0 = len(common_accesses(k, dev))
    cfg = t.read_config(A.CONFIG)
    assert torn == [0]                                  # the old low half
    assert cfg["device_memory_size"] == 0x2_0010_0000 and cfg["max_contexts"] == 9
    gens = [a for d, a, s, v in common_accesses(k, dev)[n0:]
            if d == "r" and a == VP.COMMON_CFGGENERATION]
    assert len(gens) == 4 and t.config_generation() == (gen0 + 1) & 0xFF


def test_features_refused_over_pci():
    k, devs, m = make_pci_machine()
    devs[0].refuse_features = True
    gos = boot(k)
    assert gos.devices == {} and "FEATURES_OK stayed clear" in gos.probe_errors[0]
    assert k.irq.msi == {}


def test_missing_queue_over_pci():
    k, devs, m = make_pci_machine(nsq=1)
    devs[0].cfg["num_submit_queues"] = 2  # config says 2, the device has 3 queues
    gos = boot(k)
    assert gos.devices == {} and "queue 3 does not exist" in gos.probe_errors[0]
    assert k.irq.msi == {}


def test_mixed_boot_mmio_first_then_pci_in_bdf_order():
    k, mdevs = make_machine(1)
    m = PciMachine(k)
    d5 = m.add_va1(5)
    d2 = m.add_va1(2)
    other = FakePciFunction(k, 0x8086, 0x1234)
    other.add_bar(0, 0x1000)
    m.add(other, 0, 1)
    bad = m.add_va1(4)
    bad.pci.cfg[bad.pci.last_cap + 1] = bad.pci.cfg[P.CAPABILITY_LIST]  # cap list loops
    gos = boot(k)
    assert sorted(gos.devices) == ["/dev/accel/accel0", "/dev/accel/accel1",
                                   "/dev/accel/accel2"]
    assert gos.devices["/dev/accel/accel0"].pdev is not None
    assert str(gos.devices["/dev/accel/accel1"].transport.fn.bdf) == "0000:00:02.0"
    assert str(gos.devices["/dev/accel/accel2"].transport.fn.bdf) == "0000:00:05.0"
    assert len(gos.probe_errors) == 1 and "0000:00:04.0" in gos.probe_errors[0]
    assert "loops back" in gos.probe_errors[0]
    for p in sorted(gos.devices):
        assert roundtrip(gos, p, n=2) == [A.Status.OK] * 2
    assert d2.violations == d5.violations == [] and mdevs[0].violations == []


def test_remove_frees_vectors_disables_msix_and_aborts_in_flight():
    k, (dev,), m, gos = booted_pci()
    d = gos.devices["/dev/accel/accel0"]
    c = Client(gos.open("/dev/accel/accel0"))
    cid = c.ctx()
    h = c.cmdbuf(nop_cmdbuf(1))
    dev.hold_submits = True
    seq = c.submit(cid, h, 8)
    d.remove()
    assert c.wait(cid, seq, 0).status == A.Status.ABORTED
    assert k.irq.msi == {} and not dev.pci.msix_ctrl & P.MSIX_FLAGS_ENABLE
    assert dev.status == 0
    import errno
    with pytest.raises(OSError) as ei:
        c.ctx()
    assert ei.value.errno == errno.ENODEV


def test_transport_rejects_non_virtio_and_legacy_ids():
    k, devs, m = make_pci_machine(0)
    for dev_no, (vendor, device) in enumerate([(0x8086, 0x1040 + 60), (0x1AF4, 0x1000)]):
        f = FakePciFunction(k, vendor, device)
        m.add(f, 0, 10 + dev_no)
    fns = scan_host(k, m.host).functions
    for fn, msg in zip(fns, ["is not virtio", "legacy and transitional"]):
        with pytest.raises(ProbeError, match=msg):
            VirtioPci(k, fn).probe()


def test_va1_device_accepts_a_transport_directly():
    k, devs, m = make_pci_machine()
    (fn,) = scan_host(k, m.host).functions
    d = VA1Device(k, VirtioPci(k, fn), PageAllocator(k.ram.base, k.ram.size), "accelX")
    d.probe()
    assert d.ready and d.pdev is None and devs[0].status & V.STATUS_DRIVER_OK
