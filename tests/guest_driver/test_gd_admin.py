"""The admin virtqueue (virtio 1.3 §2.12) on a VA-1 PF: discovery through the common
config, setup and vectors, LIST_QUERY then LIST_USE, blocking commands with virtual
timeouts, resets; and that non-PF functions never negotiate SR_IOV / ADMIN_VQ."""
import errno
import struct

import pytest

from gd_fakes import OFFERED, FakeKernel, FakeVA1
from gd_helpers import Client, nop_cmdbuf
from gd_pci_fakes import PciMachine, make_pci_machine
from gd_sriov_fakes import LIST_WORDS, PF_OFFERED, SUPPORTED_OPS, make_pf_machine
from guest_driver.boot import boot
from guest_driver.va1.pf import PF_OPCODES
from guest_driver.virtio.admin import (ADMIN_TIMEOUT_NS, bitmap_words, decode_bitmap,
                                       encode_bitmap)
from guest_driver.virtio.pci import MODE_PER_QUEUE, MODE_SHARED
from hwspec import va1 as A
from hwspec import virtio as V
from hwspec import virtio_admin as VA

PATH = "/dev/accel/accel0"


def pf_boot(**kw):
    k, d, m = make_pf_machine(**kw)
    gos = boot(k)
    assert gos.probe_errors == [], gos.probe_errors
    return k, d, gos, gos.pfs[PATH]


def bits(data: bytes) -> set[int]:
    return decode_bitmap(data)


def test_pf_boot_negotiates_admin_vq_and_runs_list_query_then_list_use():
    k, d, gos, pf = pf_boot()
    drv = pf.device
    assert drv.features >> V.F_ADMIN_VQ & 1 and drv.features >> V.F_SR_IOV & 1
    assert d.features == PF_OFFERED
    aq = drv.admin
    assert aq is not None and aq.index == d.admin_index == 2 + d.nsq
    assert d.queues[d.admin_index].ready == 1 and d.queues[d.admin_index].num == 16
    # the first two admin commands: LIST_QUERY, then LIST_USE, on the SR-IOV group, member 0
    (op0, g0, m0, data0), (op1, g1, m1, data1) = d.admin_log[:2]
    assert (op0, g0, m0, data0) == (VA.CMD_LIST_QUERY, VA.GROUP_TYPE_SRIOV, 0, b"")
    assert (op1, g1, m1) == (VA.CMD_LIST_USE, VA.GROUP_TYPE_SRIOV, 0)
    assert len(data1) == 8 * LIST_WORDS == 8 * 33
    assert bits(data1) == SUPPORTED_OPS == set(PF_OPCODES) | {0, 1}
    assert d.admin_in_use == SUPPORTED_OPS and aq.in_use == frozenset(SUPPORTED_OPS)
    # own vector for the admin queue, read back
    t = drv.transport
    assert t.mode == MODE_PER_QUEUE and d.qvec[d.admin_index] == t.vectors[d.admin_index] == 5
    assert d.violations == [] and d.pci.violations == [] and d.lost_interrupts == []
    assert k.trace.of("admin_list_use")[0]["missing"] == ""


def test_command_returns_status_qualifier_result_tuple():
    k, d, gos, pf = pf_boot()
    pf.sriov_configure(2)
    st, q, res = pf.device.admin_command(A.AdminOp.VF_RESOURCES_GET, VA.GROUP_TYPE_SRIOV, 1,
                                         b"", A.VF_RESOURCES.size)
    assert (st, q, len(res)) == (VA.STATUS_OK, 0, A.VF_RESOURCES.size)
    st, q, res = pf.device.admin_command(A.AdminOp.VF_STOP, VA.GROUP_TYPE_SRIOV, 9)
    assert (st, q, res) == (VA.STATUS_EINVAL, VA.STATUS_Q_INVALID_MEMBER, b"")
    st, q, _ = pf.device.admin_command(A.AdminOp.VF_STOP, 7, 1)
    assert (st, q) == (VA.STATUS_EINVAL, VA.STATUS_Q_INVALID_GROUP)
    assert d.admin_log[-1][:3] == (A.AdminOp.VF_STOP, 7, 1)


def test_admin_queue_shares_the_config_vector_when_the_table_is_one_short():
    k, d, gos, pf = pf_boot(msix_n=5)          # config + 4 queues fit, the admin queue not
    t = pf.device.transport
    assert t.mode == MODE_PER_QUEUE and t.config_shared == (d.admin_index,)
    assert d.qvec[d.admin_index] == 0 == d.msix_config
    pf.sriov_configure(1)
    assert pf.stats(1).submissions == 0        # completes via the config vector
    d.set_config(max_contexts=9)               # a config change still seen as one
    k.sched.run_all()
    assert pf.device.config["max_contexts"] == 9
    assert Client(pf.open()).ctx() == 1
    assert d.violations == [] and d.lost_interrupts == []


def test_admin_queue_on_a_single_shared_vector():
    k, d, gos, pf = pf_boot(msix_n=2)
    assert pf.device.transport.mode == MODE_SHARED
    pf.sriov_configure(3)
    pf.stop(3)
    assert d.vfs[3].stopped and d.lost_interrupts == []


def test_timeout_resets_the_device_and_list_use_is_redone_before_the_next_command():
    k, d, gos, pf = pf_boot()
    pf.sriov_configure(2)
    resets0 = d.resets
    d.admin_hold = True
    t0 = k.sched.now
    with pytest.raises(OSError) as ei:
        pf.stop(1)
    assert ei.value.errno == errno.ETIMEDOUT and "did not answer" in str(ei.value)
    assert k.sched.now - t0 >= ADMIN_TIMEOUT_NS and d.resets == resets0 + 1
    assert pf.device.admin.timeouts == 1 and d.admin_in_use is None
    d.admin_hold = False
    n = len(d.admin_log)
    pf.stop(1)
    assert [e[0] for e in d.admin_log[n:]] == [VA.CMD_LIST_QUERY, VA.CMD_LIST_USE,
                                               A.AdminOp.VF_STOP]
    assert d.vfs[1].stopped


def test_device_reset_aborts_a_waiting_command_with_eio():
    k, d, gos, pf = pf_boot()
    pf.sriov_configure(1)
    d.admin_hold = True
    k.sched.at(5000, lambda: d.set_needs_reset("test"))
    with pytest.raises(OSError) as ei:
        pf.resume(1)
    assert ei.value.errno == errno.EIO and "reset during" in str(ei.value)
    d.admin_hold = False
    pf.resume(1)
    assert pf.device.resets == 1


def test_broken_admin_ring_recovers_the_function():
    k, d, gos, pf = pf_boot()
    pf.sriov_configure(1)
    d.corrupt_queue = d.admin_index
    d.corrupt_used = ("id", 200)
    with pytest.raises(OSError) as ei:
        pf.stats(1)
    assert ei.value.errno == errno.EIO
    assert any("admin queue" in f["reason"] for f in k.trace.of("reset"))
    assert pf.stats(1).faults == 0


def test_list_query_subset_makes_missing_commands_eopnotsupp_without_sending():
    k, d, m = make_pf_machine()
    import gd_sriov_fakes as F
    old = set(F.SUPPORTED_OPS)
    F.SUPPORTED_OPS.discard(int(A.AdminOp.VF_STATS))
    try:
        gos = boot(k)
        pf = gos.pfs[PATH]
        assert bits(d.admin_log[1][3]) == old - {int(A.AdminOp.VF_STATS)}
        assert k.trace.of("pf_admin_missing")[0]["opcodes"] == "0x804"
        pf.sriov_configure(1)
        n = len(d.admin_log)
        with pytest.raises(OSError) as ei:
            pf.stats(1)
        assert ei.value.errno == errno.EOPNOTSUPP and len(d.admin_log) == n
    finally:
        F.SUPPORTED_OPS.add(int(A.AdminOp.VF_STATS))


def test_list_query_failure_fails_pf_probe():
    k, d, m = make_pf_machine()
    d.admin_force = (VA.STATUS_EINVAL, VA.STATUS_Q_INVALID_COMMAND)
    gos = boot(k)
    assert gos.devices == {} and gos.pfs == {}
    assert "LIST_QUERY failed" in gos.probe_errors[0] and "INVALID_COMMAND" in gos.probe_errors[0]


def test_admin_vq_offered_without_admin_fields_in_common_cfg_fails_probe():
    k, d, m = make_pf_machine(admin_in_common=False)
    gos = boot(k)
    assert gos.devices == {} and "admin_queue_num is 0" in gos.probe_errors[0]
    assert k.irq.msi == {}


def test_pf_without_admin_vq_offered_binds_as_a_plain_accelerator():
    k, d, m = make_pf_machine(offered=OFFERED | (1 << V.F_SR_IOV))
    gos = boot(k)
    assert list(gos.devices) == [PATH] and gos.pfs == {}
    drv = gos.devices[PATH]
    assert drv.admin is None and d.features >> V.F_SR_IOV & 1
    assert d.admin_log == [] and d.violations == []


def test_non_pf_never_negotiates_sr_iov_or_admin_vq():
    # a function without SR-IOV capability (a VF behind VFIO) whose device offers them
    k, devs, m = make_pci_machine(offered=PF_OFFERED)
    devs[0].pci.cfg[0x100:0x104] = bytes(4)     # no extended capabilities at all
    gos = boot(k)
    drv = gos.devices[PATH]
    assert gos.pfs == {} and drv.admin is None and not drv.want_admin
    assert not devs[0].features >> V.F_SR_IOV & 1 and not devs[0].features >> V.F_ADMIN_VQ & 1
    c = Client(gos.open(PATH))
    cid = c.ctx()
    assert c.wait(cid, c.submit(cid, c.cmdbuf(nop_cmdbuf(1)), 8)).status == A.Status.OK
    # TotalVFs 0 in an SR-IOV capability is not a PF either
    k, devs, m = make_pci_machine(offered=PF_OFFERED)
    gos = boot(k)
    assert gos.pfs == {} and not devs[0].features >> V.F_ADMIN_VQ & 1
    # virtio-mmio: never
    k = FakeKernel()
    dev = FakeVA1(k, offered=PF_OFFERED)
    k.attach(dev, 0x1000_0000, 5)
    gos = boot(k)
    assert gos.devices[PATH].admin is None and not dev.features >> V.F_ADMIN_VQ & 1
    assert dev.violations == []


def test_bitmap_helpers():
    assert bitmap_words(0x805) == 33 and bitmap_words(63) == 1 and bitmap_words(64) == 2
    data = encode_bitmap({0, 1, 0x800, 0x805}, 33)
    assert len(data) == 264 and decode_bitmap(data) == {0, 1, 0x800, 0x805}
    assert struct.unpack_from("<Q", data, 0)[0] == 3
    assert struct.unpack_from("<Q", data, 8 * 32)[0] == 0b100001
