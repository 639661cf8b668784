import errno

import pytest

from gd_fakes import FakeKernel, FakeVA1, OFFERED, make_machine
from guest_driver.boot import boot
from guest_driver.va1.driver import VA1Device
from guest_driver.mm import PageAllocator
from guest_driver.virtio.mmio import FeaturesRefused, ProbeError, TransportError, VirtioMmio
from hwspec import va1 as A
from hwspec import virtio as V
from hwspec import virtio_mmio as R


def status_writes(k, base):
    return [v for d, a, s, v in k.mmio.log if d == "w" and a == base + R.STATUS]


def test_handshake_order_features_and_queue_setup():
    k, (dev,) = make_machine()
    gos = boot(k)
    assert list(gos.devices) == ["/dev/accel/accel0"]
    base = k.platform_devices[0].base
    seq = status_writes(k, base)
    ack, drv, fok, dok = (V.STATUS_ACKNOWLEDGE, V.STATUS_DRIVER, V.STATUS_FEATURES_OK,
                          V.STATUS_DRIVER_OK)
    assert seq == [0, ack, ack | drv, ack | drv | fok, ack | drv | fok | dok]
    assert dev.violations == []
    # accepted exactly what it wants and the device offered
    assert dev.features == OFFERED
    # every register access below CONFIG is 4 bytes wide
    assert all(s == 4 for _, a, s, _ in k.mmio.log if a - base < R.CONFIG)
    # all queues enabled, sizes are powers of two within QueueNumMax
    assert [q.ready for q in dev.queues] == [1] * 4
    assert all(q.num and q.num & (q.num - 1) == 0 and q.num <= q.num_max for q in dev.queues)
    # the eventq was pre-posted with buffers and the device has taken them
    k.sched.run_all()
    assert len(dev.queues[A.EVENTQ].pending) == dev.queues[A.EVENTQ].num


def test_unaccepted_features_are_not_taken():
    k, (dev,) = make_machine(offered=OFFERED | (1 << A.F_PERF_COUNTERS) | (1 << V.F_RING_PACKED))
    boot(k)
    assert not dev.features >> A.F_PERF_COUNTERS & 1
    assert not dev.features >> V.F_RING_PACKED & 1
    assert dev.violations == []


def test_features_ok_refused_fails_probe_with_clear_error():
    k, (dev,) = make_machine()
    dev.refuse_features = True
    gos = boot(k)
    assert gos.devices == {}
    assert len(gos.probe_errors) == 1 and "FEATURES_OK stayed clear" in gos.probe_errors[0]
    assert dev.status & V.STATUS_FAILED and not dev.status & V.STATUS_DRIVER_OK
    assert k.trace.of("probe_error")
    with pytest.raises(OSError) as ei:
        gos.open("/dev/accel/accel0")
    assert ei.value.errno == errno.ENOENT


def test_version_1_not_offered_is_refused_before_features_ok():
    k, (dev,) = make_machine(offered=OFFERED & ~(1 << V.F_VERSION_1))
    t = VirtioMmio(k.mmio, k.platform_devices[0].base)
    t.probe()
    t.reset()
    t.add_status(V.STATUS_ACKNOWLEDGE | V.STATUS_DRIVER)
    with pytest.raises(FeaturesRefused, match=r"required features \{32\}"):
        t.negotiate(1 << V.F_VERSION_1)


class Junk:
    def __init__(self, magic=R.MAGIC, version=2):
        self.magic, self.version = magic, version

    def mmio_read(self, off, size):
        return {R.MAGIC_VALUE: self.magic, R.VERSION: self.version, R.DEVICE_ID: 0}.get(off, 0)

    def mmio_write(self, off, size, value):
        pass


@pytest.mark.parametrize("junk, msg", [(Junk(magic=0x1234), "bad magic"),
                                       (Junk(version=1), "version 1 not supported")])
def test_probe_rejects_bad_magic_and_legacy(junk, msg):
    k = FakeKernel()
    k.mmio.add(0x2000_0000, 0x1000, junk)
    with pytest.raises(ProbeError, match=msg):
        VirtioMmio(k.mmio, 0x2000_0000).probe()


def test_boot_skips_empty_slots_and_numbers_functions_in_order():
    k, devs = make_machine(2)
    k.mmio.add(0x3000_0000, 0x1000, Junk())  # device id 0: empty slot
    from guest_driver.kernel import PlatformDevice
    k.platform_devices = (PlatformDevice("virtio,mmio", 0x3000_0000, 0x1000, 9),
                          PlatformDevice("ns16550a", 0x3100_0000, 0x100, 10),
                          *k.platform_devices)
    gos = boot(k)
    assert sorted(gos.devices) == ["/dev/accel/accel0", "/dev/accel/accel1"]
    assert gos.probe_errors == []
    assert gos.devices["/dev/accel/accel0"].pdev.base == 0x1000_0000


def test_reset_that_never_reads_back_zero_is_an_error():
    class Stuck(Junk):
        def mmio_read(self, off, size):
            return 1 if off == R.STATUS else super().mmio_read(off, size)
    k = FakeKernel()
    k.mmio.add(0x2000_0000, 0x1000, Stuck())
    with pytest.raises(TransportError, match="did not read back 0"):
        VirtioMmio(k.mmio, 0x2000_0000).reset()


def test_config_read_retries_while_generation_changes():
    k, (dev,) = make_machine(config={"max_contexts": 7})
    gens = iter([1, 2, 2, 2])  # first read pair differs -> re-read
    orig = dev.mmio_read

    def rd(off, size):
        if off == R.CONFIG_GENERATION:
            return next(gens)
        return orig(off, size)
    dev.mmio_read = rd
    cfg = VirtioMmio(k.mmio, k.platform_devices[0].base).read_config(A.CONFIG)
    assert cfg["max_contexts"] == 7 and cfg["device_memory_size"] == 256 << 20
    gen_reads = [a for d, a, s, v in k.mmio.log if a == 0x1000_0000 + R.CONFIG_GENERATION]
    assert len(gen_reads) == 4


def test_torn_config_read_over_mmio_is_retried_with_the_new_values():
    """A fake that re-provisions the device (and bumps ConfigGeneration) after the
    driver read the first fields: the result is all new, never half old."""
    k, (dev,) = make_machine(config={"max_contexts": 7, "num_compute_units": 4})
    gen = [3]
    orig = dev.mmio_read
    mem_off = R.CONFIG + A.CONFIG.offsets["device_memory_size"]

    def rd(off, size):
        if off == R.CONFIG_GENERATION:
            return gen[0]
        if off == mem_off and gen[0] == 3:
            dev.cfg.update(num_compute_units=8, device_memory_size=512 << 20, max_contexts=9)
            gen[0] = 4
        return orig(off, size)
    dev.mmio_read = rd
    cfg = VirtioMmio(k.mmio, k.platform_devices[0].base).read_config(A.CONFIG)
    assert (cfg["num_compute_units"], cfg["device_memory_size"], cfg["max_contexts"]) == (
        8, 512 << 20, 9)
    gen_reads = [a for d, a, s, v in k.mmio.log if a == k.platform_devices[0].base
                 + R.CONFIG_GENERATION]
    assert len(gen_reads) == 4


def test_missing_queue_fails_probe():
    k, (dev,) = make_machine()
    dev.queues[3].num_max = 0
    orig_reset = dev._reset_state

    def reset_state():
        orig_reset()
        dev.queues[3].num_max = 0
    dev._reset_state = reset_state
    alloc = PageAllocator(k.ram.base, k.ram.size)
    d = VA1Device(k, k.platform_devices[0], alloc, "accel0")
    with pytest.raises(ProbeError, match="queue 3 does not exist"):
        d.probe()
    assert dev.status & V.STATUS_FAILED
    assert alloc.bytes_allocated == 0  # rings and slots given back


def test_irq_line_refused_fails_probe_cleanly():
    k, (dev,) = make_machine()
    k.irq.handlers[k.platform_devices[0].irq] = lambda: None  # someone else has the line
    gos = boot(k)
    assert gos.devices == {} and "interrupt line 5" in gos.probe_errors[0]
    assert dev.status & V.STATUS_FAILED
