"""The PF management API: SR-IOV enable/disable through config space (as Linux's
sriov_enable / sriov_disable), read_sriov, and every VA-1 admin command with every
status/qualifier -> errno mapping."""
import dataclasses
import errno

import pytest

from gd_fakes import OFFERED
from gd_helpers import Client, expect_errno, nop_cmdbuf
from gd_sriov_fakes import VF_BAR0_SIZE, make_pf_machine
from guest_driver.boot import boot
from guest_driver.mm import PageAllocator
from guest_driver.pci import scan_host
from guest_driver.va1.pf import VF_ENABLE_WAIT_NS, VA1Pf, VfStats, admin_errno, probe_pf
from guest_driver.virtio.transport import ProbeError
from hwspec import pci as P
from hwspec import va1 as A
from hwspec import virtio as V
from hwspec import virtio_admin as VA
from hwspec.va1 import VfResources

PATH = "/dev/accel/accel0"
MiB = 1 << 20


def pf_boot(**kw):
    k, d, m = make_pf_machine(**kw)
    gos = boot(k)
    assert gos.probe_errors == [], gos.probe_errors
    return k, d, gos, gos.pfs[PATH]


def writes(d, since=0):
    return [(reg, v) for _, reg, _, v in d.sriov_log[since:]]


# ---------------------------------------------------------------- SR-IOV capability
def test_probe_sizes_vf_bar0_sets_page_size_and_read_sriov_reports_everything():
    k, d, gos, pf = pf_boot()
    assert d.sriov.sys_pgsize == 1
    info = pf.read_sriov()
    assert (info.total_vfs, info.num_vfs, info.enabled) == (64, 0, False)
    assert (info.vf_offset, info.vf_stride, info.vf_device_id) == (1, 1, A.PCI_DEVICE_ID)
    assert info.vf_bar0_size == VF_BAR0_SIZE and info.vf_bar0_64bit
    assert info.vf_bar0_base == 0x8800_0000 and info.vf_bar0(3) == 0x8800_0000 + 2 * VF_BAR0_SIZE
    assert info.vf_routing_id(0x18, 2) == 0x18 + 1 + 1
    # sizing restored the base it found
    assert d.sriov.bar[0] & ~0xF == 0x8800_0000 and d.sriov_violations == []


def test_enable_writes_numvfs_before_vf_enable_and_mse_then_waits():
    k, d, gos, pf = pf_boot()
    n = len(d.sriov_log)
    t0 = k.sched.now
    assert pf.sriov_configure(4) == 4
    log = d.sriov_log[n:]
    regs = [reg for _, reg, _, _ in log]
    assert regs.index(P.SRIOV_NUM_VF) < regs.index(P.SRIOV_CTRL)
    assert (P.SRIOV_NUM_VF, 4) in writes(d, n)
    ctrl_writes = [v for reg, v in writes(d, n) if reg == P.SRIOV_CTRL]
    assert ctrl_writes == [P.SRIOV_CTRL_VFE | P.SRIOV_CTRL_MSE]   # one write, both bits
    assert k.sched.now - t0 >= VF_ENABLE_WAIT_NS
    info = pf.read_sriov()
    assert info.enabled and info.num_vfs == 4 and pf.num_vfs == 4
    assert sorted(d.vfs) == [1, 2, 3, 4] and d.sriov_violations == []
    assert k.trace.of("sriov_enable")[0]["num_vfs"] == 4


def test_above_total_vfs_is_einval_before_touching_anything():
    k, d, gos, pf = pf_boot(total_vfs=8)
    n = len(d.sriov_log)
    expect_errno(errno.EINVAL, pf.sriov_configure, 9, match="TotalVFs 8")
    expect_errno(errno.EINVAL, pf.sriov_configure, -1, match="num_vfs")
    assert d.sriov_log[n:] == [] and d.sriov.num_vf == 0
    assert pf.sriov_configure(8) == 8 and d.sriov_violations == []


def test_changing_the_count_requires_disabling_first():
    k, d, gos, pf = pf_boot()
    pf.sriov_configure(4)
    n = len(d.sriov_log)
    expect_errno(errno.EBUSY, pf.sriov_configure, 8, match="disable them")
    assert d.sriov_log[n:] == []
    assert pf.sriov_configure(4) == 4 and d.sriov_log[n:] == []   # same count: nothing to do
    assert pf.sriov_configure(0) == 0
    w = writes(d, n)
    assert w == [(P.SRIOV_CTRL, 0), (P.SRIOV_NUM_VF, 0)]          # VF Enable off first
    assert not pf.read_sriov().enabled and d.vfs == {}
    assert pf.sriov_configure(8) == 8 and pf.read_sriov().num_vfs == 8
    assert d.sriov_violations == []


def test_unassigned_vf_bar_is_enomem_and_leaves_vfs_off():
    k, d, gos, pf = pf_boot(vf_bar=False)
    e = expect_errno(errno.ENOMEM, pf.sriov_configure, 2, match="VF BAR0 was not assigned")
    assert "cannot enable 2 VFs" in str(e)
    assert d.sriov.num_vf == 0 and not d.sriov.ctrl & P.SRIOV_CTRL_VFE
    assert all(reg != P.SRIOV_CTRL for reg, _ in writes(d))


def test_vf_routing_ids_beyond_the_bus_range_and_bad_offsets():
    k, d, gos, pf = pf_boot()
    d.sriov.offset = 0x100                       # VF 1 would be on bus 1, bridge ends at 0
    expect_errno(errno.ENOMEM, pf.sriov_configure, 2, match="beyond the host bridge")
    d.sriov.offset = 0
    expect_errno(errno.EIO, pf.sriov_configure, 2, match="First VF Offset 0")
    d.sriov.offset, d.sriov.stride = 1, 0
    expect_errno(errno.EIO, pf.sriov_configure, 2, match="VF Stride 0")
    assert pf.sriov_configure(1) == 1          # one VF needs no stride
    assert d.sriov_violations == []


def test_probe_turns_off_vfs_left_enabled():
    k, d, m = make_pf_machine()
    d.sriov.num_vf, d.sriov.ctrl = 3, P.SRIOV_CTRL_VFE | P.SRIOV_CTRL_MSE
    gos = boot(k)
    pf = gos.pfs[PATH]
    assert not d.sriov.ctrl & P.SRIOV_CTRL_VFE and d.sriov.num_vf == 0
    assert writes(d)[0] == (P.SRIOV_CTRL, 0)
    assert pf.sriov_configure(2) == 2 and d.sriov_violations == []


def test_remove_disables_vfs():
    k, d, gos, pf = pf_boot()
    pf.sriov_configure(2)
    pf.remove()
    assert d.sriov.ctrl == 0 and d.sriov.num_vf == 0
    expect_errno(errno.ENODEV, pf.sriov_configure, 1)


# ---------------------------------------------------------------- admin commands
def test_resources_set_get_stop_resume_stats_reset():
    k, d, gos, pf = pf_boot()
    pf.sriov_configure(3)
    res = VfResources(device_memory=64 * MiB, num_submit_queues=4, max_contexts=8, weight=5,
                      priority=1, exec_quantum_ns=200_000, preemption_timeout_ns=10**8)
    pf.set_resources(2, res)
    assert d.admin_log[-1][:3] == (A.AdminOp.VF_RESOURCES_SET, VA.GROUP_TYPE_SRIOV, 2)
    assert d.admin_log[-1][3] == res.encode() and len(res.encode()) == A.VF_RESOURCES.size
    assert pf.get_resources(2) == res
    assert pf.get_resources(1) == VfResources.decode(bytes(A.VF_RESOURCES.size))
    pf.stop(3)
    assert d.vfs[3].stopped
    pf.resume(3)
    assert not d.vfs[3].stopped
    d.vfs[1].stats = (10, 20, 30, 40, 1, 2, 3)
    assert pf.stats(1) == VfStats(10, 20, 30, 40, 1, 2, 3)
    pf.reset_vf(2)
    assert d.vfs[2].resets == 1
    ops = [(op, member) for op, _, member, _ in d.admin_log[2:]]
    assert ops == [(A.AdminOp.VF_RESOURCES_SET, 2), (A.AdminOp.VF_RESOURCES_GET, 2),
                   (A.AdminOp.VF_RESOURCES_GET, 1), (A.AdminOp.VF_STOP, 3),
                   (A.AdminOp.VF_RESUME, 3), (A.AdminOp.VF_STATS, 1), (A.AdminOp.VF_RESET, 2)]
    assert d.violations == []


def test_vf_resources_defaults_come_from_hwspec():
    r = VfResources()
    assert (r.num_submit_queues, r.max_contexts, r.weight, r.priority) == (
        A.DEFAULT_VF_NUM_SUBMIT_QUEUES, A.DEFAULT_VF_MAX_CONTEXTS, A.DEFAULT_WEIGHT,
        A.DEFAULT_PRIORITY)
    assert VfResources.decode(r.encode()) == r


@pytest.mark.parametrize("field, value, match", [
    ("device_memory", MiB + 4096, "device_memory=1052672 is not a non-zero multiple of 1048576"),
    ("weight", 0, "weight=0 must be >= 1"),
    ("priority", 3, "priority=3"),
    ("max_contexts", -1, "max_contexts=-1"),
    ("num_submit_queues", A.MAX_SUBMIT_QUEUES_PER_FUNCTION + 1, "num_submit_queues=17"),
    ("exec_quantum_ns", 1 << 64, "exec_quantum_ns="),
    ("device_memory", 0, "device_memory=0 is not a non-zero multiple"),
    ("num_submit_queues", 0, "num_submit_queues=0 is not in 1..16"),
    ("max_contexts", 0, "max_contexts=0 must be >= 1"),
    ("exec_quantum_ns", 0, "exec_quantum_ns=0 must be >= 1"),
    ("preemption_timeout_ns", 0, "preemption_timeout_ns=0 must be >= 1"),
])
def test_bad_resource_fields_are_einval_naming_the_field_and_nothing_is_sent(field, value,
                                                                            match):
    k, d, gos, pf = pf_boot()
    pf.sriov_configure(1)
    n = len(d.admin_log)
    res = dataclasses.replace(VfResources(device_memory=16 * MiB), **{field: value})
    expect_errno(errno.EINVAL, pf.set_resources, 1, res, match=f"field {match}")
    assert len(d.admin_log) == n


@pytest.mark.parametrize("vf", [0, 3, -1, "1"])
def test_member_outside_1_to_numvfs_is_einval_naming_it(vf):
    k, d, gos, pf = pf_boot()
    pf.sriov_configure(2)
    n = len(d.admin_log)
    for call in (lambda: pf.stop(vf), lambda: pf.stats(vf), lambda: pf.get_resources(vf),
                 lambda: pf.set_resources(vf, VfResources()), lambda: pf.reset_vf(vf),
                 lambda: pf.resume(vf)):
        expect_errno(errno.EINVAL, call, match=f"member vf {vf!r} does not exist")
    assert len(d.admin_log) == n


def test_over_commit_is_enomem():
    k, d, gos, pf = pf_boot(pool_memory=128 * MiB, pool_queues=6)
    pf.sriov_configure(3)
    pf.set_resources(1, VfResources(device_memory=100 * MiB, num_submit_queues=2))
    e = expect_errno(errno.ENOMEM, pf.set_resources, 2,
                     VfResources(device_memory=64 * MiB), match="over-commit")
    assert "device_memory=67108864" in str(e) and "NORESOURCE" in str(e)
    pf.set_resources(2, VfResources(device_memory=16 * MiB, num_submit_queues=4))
    expect_errno(errno.ENOMEM, pf.set_resources, 3,
                 VfResources(device_memory=MiB, num_submit_queues=1), match="over-commit")
    # shrinking a VF frees room for another
    pf.set_resources(1, VfResources(device_memory=MiB, num_submit_queues=1))
    pf.set_resources(3, VfResources(device_memory=64 * MiB, num_submit_queues=1))


def test_live_vf_is_eagain():
    k, d, gos, pf = pf_boot()
    pf.sriov_configure(1)
    d.vfs[1].live = True
    e = expect_errno(errno.EAGAIN, pf.set_resources, 1, VfResources(device_memory=MiB),
                     match="VF is live")
    assert "TRYAGAIN" in str(e)
    pf.stop(1)   # stopping a live VF is fine


@pytest.mark.parametrize("status, qual, err, match", [
    (VA.STATUS_EINVAL, VA.STATUS_Q_INVALID_MEMBER, errno.EINVAL, "no such member"),
    (VA.STATUS_EINVAL, VA.STATUS_Q_INVALID_FIELD, errno.EINVAL, "rejected a field"),
    (VA.STATUS_EINVAL, VA.STATUS_Q_INVALID_OPCODE, errno.EOPNOTSUPP, "does not support"),
    (VA.STATUS_EINVAL, VA.STATUS_Q_INVALID_GROUP, errno.EINVAL, "invalid group type"),
    (VA.STATUS_EINVAL, VA.STATUS_Q_INVALID_COMMAND, errno.EINVAL, "malformed command"),
    (VA.STATUS_EINVAL, VA.STATUS_Q_OK, errno.EINVAL, "invalid command"),
    (VA.STATUS_ENOMEM, VA.STATUS_Q_NORESOURCE, errno.ENOMEM, "over-commit"),
    (VA.STATUS_ENOMEM, VA.STATUS_Q_OK, errno.ENOMEM, "over-commit"),
    (VA.STATUS_EAGAIN, VA.STATUS_Q_TRYAGAIN, errno.EAGAIN, "is live"),
    (VA.STATUS_EAGAIN, VA.STATUS_Q_OK, errno.EAGAIN, "is live"),
    (5, VA.STATUS_Q_OK, errno.EIO, "failed (status 5"),
])
def test_device_status_and_qualifier_to_errno(status, qual, err, match):
    k, d, gos, pf = pf_boot()
    pf.sriov_configure(2)
    for call in (lambda: pf.stop(2), lambda: pf.set_resources(1, VfResources(
            device_memory=2 * MiB))):
        d.admin_force = (status, qual)
        e = expect_errno(err, call, match=match)
        assert "vf" in str(e)
    e = admin_errno("accel9", "VF_STOP vf 4", status, qual)
    assert e.errno == err and e.strerror.startswith("accel9: VF_STOP vf 4: ")


def test_short_result_is_eio():
    k, d, gos, pf = pf_boot()
    pf.sriov_configure(1)
    d.vfs[1].resources = bytes(8)    # the device answers OK with 8 bytes only
    expect_errno(errno.EIO, pf.get_resources, 1, match="result of 8 bytes")


def test_raw_admin_command_reaches_the_device_unchecked():
    k, d, gos, pf = pf_boot()
    pf.sriov_configure(2)
    r = pf.admin_command(A.AdminOp.VF_RESET, 40)
    assert (r.status, r.qualifier) == (VA.STATUS_EINVAL, VA.STATUS_Q_INVALID_MEMBER)
    assert d.admin_log[-1][:3] == (A.AdminOp.VF_RESET, VA.GROUP_TYPE_SRIOV, 40)


# ---------------------------------------------------------------- the PF as an accelerator
def test_pf_keeps_working_as_the_hosts_accelerator_with_vfs_enabled():
    k, d, gos, pf = pf_boot()
    pf.sriov_configure(4)
    pf.set_resources(1, VfResources(device_memory=32 * MiB))
    for c in (Client(gos.open(PATH)), Client(pf.open())):
        cid = c.ctx()
        h, addr = c.bo(4096, 1)
        seqs = [c.submit(cid, c.cmdbuf(nop_cmdbuf(2)), 16, queue=q) for q in (0, 1)]
        assert [c.wait(cid, s).status for s in seqs] == [A.Status.OK] * 2
    pf.stop(1)
    assert d.violations == [] and d.lost_interrupts == []


def test_probe_pf_standalone_and_refusals():
    k, d, m = make_pf_machine()
    fn = next(f for f in scan_host(k, m.host).functions)
    alloc = PageAllocator(k.ram.base, k.ram.size)
    pf = probe_pf(k, fn, alloc, "accel7", m.host)
    assert pf.device.admin is not None and pf.sriov_configure(64) == 64
    assert pf.read_sriov().num_vfs == 64
    # not a PF: no SR-IOV capability
    k, d, m = make_pf_machine()
    d.pci.cfg[0x100:0x104] = bytes(4)
    fn = next(f for f in scan_host(k, m.host).functions)
    with pytest.raises(ProbeError, match="no SR-IOV capability"):
        probe_pf(k, fn)
    # a PF that does not offer ADMIN_VQ
    k, d, m = make_pf_machine(offered=OFFERED | (1 << V.F_SR_IOV))
    fn = next(f for f in scan_host(k, m.host).functions)
    with pytest.raises(ProbeError, match="VIRTIO_F_ADMIN_VQ"):
        VA1Pf(k, fn).probe()
    assert k.irq.msi == {} and d.status == 0
