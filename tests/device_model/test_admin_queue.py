"""The PF's admin virtqueue: virtio 1.3 LIST_QUERY / LIST_USE, the VA-1 SR-IOV group
commands, and every refusal (which must change nothing)."""
from __future__ import annotations

import struct

import dm_sriov as S
import pytest
from dm_sriov import Card

from device_model import Va1Config

MIB = S.MIB
POOL = 64 * MIB - 8 * MIB                      # Card(): 64 MiB card, 8 MiB for the PF


def _card(n: int = 4, use: bool = True) -> Card:
    c = Card()
    if use:
        c.pf.use_all()
    c.pf.enable_vfs(n)
    return c


def _snapshot(c: Card) -> tuple[object, ...]:
    return (tuple(c.pf.get_resources(n) for n in range(1, len(c.card.vf_functions) + 1)),
            tuple(r.base for r in c.card.partitions),
            tuple((f.weight, f.priority, f.stopped) for f in c.card.scheduler.functions),
            tuple(d.num_queues for d in c.card.vf_devices))


def test_list_query_reports_supported_opcodes() -> None:
    c = _card(use=False)
    st, q, res = c.pf.admin_cmd(S.LIST_QUERY, result_len=33 * 8)
    assert (st, q) == (0, 0) and len(res) == 33 * 8
    bitmap = int.from_bytes(res, "little")
    expected = {0, 1} | set(range(0x800, 0x806))
    assert {i for i in range(33 * 64) if bitmap >> i & 1} == expected
    # a short result buffer gets the words that fit
    st, q, res = c.pf.admin_cmd(S.LIST_QUERY, result_len=8)
    assert (st, q) == (0, 0) and int.from_bytes(res, "little") == 0b11


def test_va1_commands_refused_until_list_use() -> None:
    c = _card(use=False)
    st, q, _ = c.pf.admin_cmd(S.RES_GET, 1, result_len=40)
    assert (st, q) == (S.EINVAL, S.Q_INVALID_OPCODE)
    # LIST_USE naming an opcode the device lacks: refused, nothing accepted
    bad = (1 << 0 | 1 << 1 | 1 << 0x800 | 1 << 0x806).to_bytes(33 * 8, "little")
    assert c.pf.admin_cmd(S.LIST_USE, data=bad)[:2] == (S.EINVAL, S.Q_INVALID_FIELD)
    assert c.pf.admin_cmd(S.RES_GET, 1, result_len=40)[:2] == (S.EINVAL, S.Q_INVALID_OPCODE)
    # accept only RESOURCES_GET: it works, STATS still refused
    one = (1 << 0 | 1 << 1 | 1 << 0x801).to_bytes(33 * 8, "little")
    assert c.pf.admin_cmd(S.LIST_USE, data=one)[:2] == (0, 0)
    assert c.pf.admin_cmd(S.RES_GET, 1, result_len=40)[:2] == (0, 0)
    assert c.pf.admin_cmd(S.VF_STATS, 1, result_len=56)[:2] == (S.EINVAL, S.Q_INVALID_OPCODE)


def test_default_provisioning_is_an_equal_share() -> None:
    c = _card(3)
    share = POOL // 3 // MIB * MIB
    for n in (1, 2, 3):
        mem, queues, ctxs, weight, prio, quantum, timeout = c.pf.get_resources(n)
        assert (mem, queues, ctxs, weight, prio) == (share, 2, 16, 1, 0)
        assert quantum == 100_000 and timeout == 1_000_000_000
    bases = [r.base for r in c.card.partitions]
    assert bases == [8 * MIB + i * share for i in range(3)]


def test_resources_set_get_and_vf_config_space() -> None:
    c = _card(4)
    assert c.pf.set_resources(2, 5 * MIB, queues=3, ctxs=7, weight=9, prio=2,
                              quantum=1234, timeout=99_999) == (0, 0)
    assert c.pf.get_resources(2) == (5 * MIB, 3, 7, 9, 2, 1234, 99_999)
    fs = c.card.vf_devices[1].processor.fs
    assert (fs.weight, fs.priority, fs.exec_quantum_ns, fs.preemption_timeout_ns) == (
        9, 2, 1234, 99_999)
    vf = c.vf_rig(2)
    assert vf.dev_cfg(0) == 3                          # num_submit_queues
    assert vf.dev_cfg(8, 8) == 5 * MIB                 # device_memory_size
    assert vf.dev_cfg(52) == 7                         # max_contexts
    assert vf.c16(18) == 5 and len(vf.queues) == 5
    ctxs = [vf.create_context() for _ in range(7)]
    assert ctxs == list(range(1, 8))
    st, _ = struct.unpack("<II", vf.ctrl(1, flags=1))
    assert st == 14                                    # NO_RESOURCES at max_contexts


def test_growing_a_vf_repacks_the_idle_ones() -> None:
    c = _card(4)
    share = POOL // 4 // MIB * MIB                     # 14 MiB each, pool full
    for n in (2, 3, 4):
        assert c.pf.set_resources(n, 4 * MIB) == (0, 0)  # shrink in place
    assert c.pf.set_resources(1, POOL - 12 * MIB) == (0, 0)   # needs a repack
    layout = sorted((r.base, r.base + r.device_memory) for r in c.card.partitions)
    assert all(a[1] <= b[0] for a, b in zip(layout, layout[1:]))  # no overlap
    assert layout[0][0] >= 8 * MIB and layout[-1][1] <= 64 * MIB
    assert c.pf.get_resources(1)[0] == POOL - 12 * MIB and share > 4 * MIB
    # a live VF is never moved
    vf3 = c.vf_rig(3)
    vf3.submit(vf3.create_context(), struct.pack("<HHIQQII", 1, 0, 32, 0, 64, 0x77777777, 0))
    base3 = c.card.partitions[2].base
    assert c.pf.set_resources(1, 8 * MIB) == (0, 0)
    assert c.pf.set_resources(2, POOL - 16 * MIB) == (0, 0)
    assert c.card.partitions[2].base == base3
    assert (c.card.vf_devices[2].memory.data[:64] == 0x77).all()


@pytest.mark.parametrize("case", [
    "memory-overcommit", "contexts-overcommit", "too-many-queues", "weight-0",
    "priority-3", "quantum-0", "timeout-0", "unaligned-memory", "zero-memory", "queues-0",
    "contexts-0", "member-0", "member-beyond", "vf-live", "unknown-group",
    "unknown-opcode", "generic-unknown-opcode", "short-data", "stats-short-result",
])
def test_refused_admin_commands_change_nothing(case: str) -> None:
    c = _card(4)
    assert c.pf.set_resources(1, 4 * MIB, queues=2, ctxs=4) == (0, 0)
    before = _snapshot(c)
    ok = dict(mem=4 * MIB, queues=2, ctxs=4, weight=1, prio=0, quantum=100, timeout=1000)
    expect = (S.EINVAL, S.Q_INVALID_FIELD)
    vf, cmd = 1, None
    if case == "memory-overcommit":
        ok["mem"], expect = POOL, (S.ENOMEM, S.Q_NORESOURCE)
    elif case == "contexts-overcommit":
        ok["ctxs"], expect = 1024 - 3 * 16 + 1, (S.ENOMEM, S.Q_NORESOURCE)
    elif case == "too-many-queues":
        ok["queues"], expect = 17, (S.ENOMEM, S.Q_NORESOURCE)
    elif case == "weight-0":
        ok["weight"] = 0
    elif case == "priority-3":
        ok["prio"] = 3
    elif case == "quantum-0":
        ok["quantum"] = 0
    elif case == "timeout-0":
        ok["timeout"] = 0
    elif case == "unaligned-memory":
        ok["mem"] = 4 * MIB + 4096
    elif case == "zero-memory":
        ok["mem"] = 0
    elif case == "queues-0":
        ok["queues"] = 0
    elif case == "contexts-0":
        ok["ctxs"] = 0
    elif case == "member-0":
        vf, expect = 0, (S.EINVAL, S.Q_INVALID_MEMBER)
    elif case == "member-beyond":
        vf, expect = 5, (S.EINVAL, S.Q_INVALID_MEMBER)
    elif case == "vf-live":
        c.vf_rig(1)
        before = _snapshot(c)
        expect = (S.EAGAIN, S.Q_TRYAGAIN)
    elif case == "unknown-group":
        cmd = dict(opcode=S.RES_SET, group=2)
        expect = (S.EINVAL, S.Q_INVALID_GROUP)
    elif case == "unknown-opcode":
        cmd = dict(opcode=0x806)
        expect = (S.EINVAL, S.Q_INVALID_OPCODE)
    elif case == "generic-unknown-opcode":
        cmd = dict(opcode=0x2)
        expect = (S.EINVAL, S.Q_INVALID_OPCODE)
    elif case == "short-data":
        cmd = dict(opcode=S.RES_SET, data=b"\0" * 32)
        expect = (S.EINVAL, 1)                         # Q_INVALID_COMMAND
    elif case == "stats-short-result":
        cmd = dict(opcode=S.VF_STATS, result_len=48)
        expect = (S.EINVAL, 1)
    data = struct.pack(S.RES_FMT, ok["mem"], ok["queues"], ok["ctxs"], ok["weight"],
                       ok["prio"], ok["quantum"], ok["timeout"])
    if cmd is None:
        got = c.pf.admin_cmd(S.RES_SET, vf, data)
    else:
        got = c.pf.admin_cmd(cmd.get("opcode", S.RES_SET), vf, cmd.get("data", data),  # type: ignore[arg-type]
                             result_len=cmd.get("result_len", 0),  # type: ignore[arg-type]
                             group=cmd.get("group", S.GROUP_SRIOV))  # type: ignore[arg-type]
    assert got[:2] == expect, (case, got)
    assert got[2] == b""
    assert _snapshot(c) == before


def test_member_checks_apply_to_every_vf_command() -> None:
    c = _card(2)
    for op, rl in ((S.RES_GET, 40), (S.VF_STOP, 0), (S.VF_RESUME, 0), (S.VF_STATS, 56),
                   (S.VF_RESET, 0)):
        for member in (0, 3, 1 << 40):
            assert c.pf.admin_cmd(op, member, result_len=rl)[:2] == (S.EINVAL,
                                                                     S.Q_INVALID_MEMBER)
    c.pf.disable_vfs()
    assert c.pf.admin_cmd(S.RES_GET, 1, result_len=40)[:2] == (S.EINVAL, S.Q_INVALID_MEMBER)


def test_vf_stats_and_get_stats_per_function() -> None:
    c = _card(2)
    a, b = c.vf_rig(1), c.vf_rig(2)
    ca = a.create_context()
    fill = struct.pack("<HHIQQII", 1, 0, 32, 0, 4096, 1, 0)
    d2h = struct.pack("<HHIQQQ", 3, 0, 32, 0, a.alloc.alloc(4096), 4096)
    for _ in range(3):
        assert a.submit(ca, fill + d2h).status == 0
    st, q, raw = c.pf.admin_cmd(S.VF_STATS, 1, result_len=56)
    assert (st, q) == (0, 0)
    subs, cmds, dev_ns, dma, faults, pre, tmo = struct.unpack(S.STATS_FMT, raw)
    assert (subs, cmds, dma, faults, pre, tmo) == (3, 6, 3 * 4096, 0, 0, 0)
    assert dev_ns > 0
    st, q, raw = c.pf.admin_cmd(S.VF_STATS, 2, result_len=56)
    assert struct.unpack(S.STATS_FMT, raw) == (0,) * 7
    # GET_STATS on the VF's own controlq agrees
    resp = struct.unpack("<IIQQQQQ", a.ctrl(3, resp_len=48))
    assert resp[2:] == (3, 6, dev_ns, 3 * 4096, 0)


def test_admin_commands_sent_from_a_vf_do_nothing() -> None:
    c = _card(2)
    vf = c.vf_rig(1)
    before = _snapshot(c)
    # the VF has no admin queue: notify on the would-be index is refused
    vf.bw(vf.vcaps[2].offset + 4 * 4, 2, 4)
    assert vf.fn.violations[-1].rule == "queue/not-ready"
    assert _snapshot(c) == before


def test_admin_queue_ignored_without_admin_vq_negotiated() -> None:
    c = Card()
    c.pf.enable_vfs(1)
    # re-init the PF declining ADMIN_VQ: the admin queue may be set up but is not served
    c.pf.offered = lambda: (1 << 32) | (1 << 33)  # type: ignore[method-assign]
    c.pf.init()
    c.pf.admin.add([(c.pf.put(b"\0" * 24), 24, False), (c.pf.alloc.alloc(8), 8, True)])
    c.pf.kick(c.pf.adm_index)
    c.clock.run()
    assert c.pf.admin.pop_used() is None


def test_config_generation_moves_when_resources_set_changes_a_vfs_config() -> None:
    """virtio 1.x §4.1.4.3: config_generation changes whenever the device configuration
    does. A VF_RESOURCES_SET that changes what the VF's config reports bumps it; one
    that changes only scheduling (not in the config), or is refused, does not."""
    from hwspec import virtio_pci as VP
    c = _card(4)

    def gen(n: int) -> int:
        return c.card.vf_functions[n - 1].bar_read(0, VP.COMMON_CFGGENERATION, 1)

    before = [gen(n) for n in (1, 2, 3, 4)]
    assert c.pf.set_resources(2, 5 * MIB, queues=3, ctxs=7) == (0, 0)
    assert gen(2) == (before[1] + 1) & 0xFF
    assert [gen(n) for n in (1, 3, 4)] == [before[0], before[2], before[3]]
    vf = c.card.vf_functions[1]
    assert vf.bar_read(0, 0x2000 + 8, 8) == 5 * MIB     # the new config, read by the BAR
    assert c.pf.set_resources(2, 5 * MIB, queues=3, ctxs=7, weight=4) == (0, 0)
    assert gen(2) == (before[1] + 1) & 0xFF             # weight is not in the config
    assert c.pf.set_resources(2, 0) == (S.EINVAL, S.Q_INVALID_FIELD)
    assert gen(2) == (before[1] + 1) & 0xFF             # refused: nothing changed
    assert c.pf.set_resources(2, 6 * MIB, queues=3, ctxs=7) == (0, 0)
    assert gen(2) == (before[1] + 2) & 0xFF
    # a virtio reset or an FLR changes no configuration: the generation stays
    vf.bar_write(0, VP.COMMON_STATUS, 1, 0)
    vf.function_level_reset()
    assert gen(2) == (before[1] + 2) & 0xFF


def test_ring_reset_of_the_admin_queue_with_a_command_in_flight() -> None:
    """RING_RESET of the admin queue while a command is in flight (spec §4.7,
    queue/reset-busy): NEEDS_RESET with the rule named, the command never answered from
    the old ring; after a device reset the admin queue works again."""
    from device_model.va1.config import DEFAULT_VIRTIO_FEATURES
    from dm_pci_driver import QSEL
    from hwspec import virtio as V
    from hwspec.virtio_pci import COMMON_Q_RESET
    c = Card(Va1Config(virtio_features=DEFAULT_VIRTIO_FEATURES | 1 << V.F_RING_RESET))
    pf = c.pf
    assert pf.offered() >> V.F_RING_RESET & 1
    pf.use_all()
    hdr = struct.pack("<HH12sQ", S.RES_GET, S.GROUP_SRIOV, b"", 1)
    resp = pf.alloc.alloc(8 + 40, 8)
    pf.admin.add([(pf.put(hdr, 8), len(hdr), False), (resp, 48, True)])
    pf.kick(pf.adm_index)                      # taken by the device, not yet answered
    before = len(pf.fn.violations)
    pf.w16(QSEL, pf.adm_index)
    pf.w16(COMMON_Q_RESET, 1)
    assert [v.rule for v in pf.fn.violations[before:]] == ["queue/reset-busy"]
    assert pf.c8(S.DSTATUS) & V.STATUS_DEVICE_NEEDS_RESET
    c.clock.run()
    assert pf.admin.pop_used() is None         # the dropped command is not answered
    pf.init()                                  # status 0, then the whole bring-up again
    assert not pf.c8(S.DSTATUS) & V.STATUS_DEVICE_NEEDS_RESET
    pf.use_all()
    st, q, res = pf.admin_cmd(S.LIST_QUERY, result_len=8)
    assert (st, q) == (0, 0) and int.from_bytes(res, "little") == 0b11
