"""The PF's SR-IOV capability, VF appearance through a fake SriovPlatform, VF config
space, VF memory decoding and FLR."""
from __future__ import annotations

import struct

import pytest

import dm_sriov as S
from dm_pci_driver import PciDriver
from dm_sriov import Card, ext_cap

from device_model import DevicePorts, Va1Config
from device_model.va1.card import Va1Card


def _cap(c: Card) -> tuple[PciDriver, int]:
    return c.pf, c.pf.sriov()


def test_sriov_capability_registers() -> None:
    c = Card()
    d, cap = _cap(c)
    assert d.cr(cap) & 0xFFFF == 0x0010 and (d.cr(cap) >> 16) & 0xF == 1
    assert d.cr(cap + S.SR_TOTAL, 2) == 64 and d.cr(cap + S.SR_INITIAL, 2) == 64
    assert d.cr(cap + S.SR_OFFSET, 2) == 1 and d.cr(cap + S.SR_STRIDE, 2) == 1
    assert d.cr(cap + S.SR_DID, 2) == 0x1040 + 60
    assert d.cr(cap + S.SR_SUPPG) & 1 and d.cr(cap + S.SR_SYSPG) == 1
    assert d.cr(cap + S.SR_NUM, 2) == 0 and d.cr(cap + S.SR_CTRL, 2) == 0
    # read-only fields ignore writes
    d.cw(cap + S.SR_TOTAL, 2, 5)
    d.cw(cap + S.SR_OFFSET, 2, 7)
    assert d.cr(cap + S.SR_TOTAL, 2) == 64 and d.cr(cap + S.SR_OFFSET, 2) == 1
    # an unsupported system page size is refused
    d.cw(cap + S.SR_SYSPG, 4, 0x3)
    assert d.cr(cap + S.SR_SYSPG) == 1
    assert c.pf_fn.violations[-1].rule == "sriov/page-size"


def test_total_vfs_is_configurable() -> None:
    c = Card(total_vfs=7)
    d, cap = _cap(c)
    assert d.cr(cap + S.SR_TOTAL, 2) == 7 and d.cr(cap + S.SR_INITIAL, 2) == 7


def test_vf_bar_sizing_protocol() -> None:
    c = Card()
    d, cap = _cap(c)
    lo = d.cr(cap + S.SR_BAR0)
    assert lo & 0x6 == 0x4                                   # 64-bit memory BAR
    d.cw(cap + S.SR_BAR0, 4, 0xFFFF_FFFF)
    d.cw(cap + S.SR_BAR0 + 4, 4, 0xFFFF_FFFF)
    mask = (d.cr(cap + S.SR_BAR0) & ~0xF) | d.cr(cap + S.SR_BAR0 + 4) << 32
    assert (~mask & (2**64 - 1)) + 1 == 0x8000               # per-VF size = PF BAR size
    d.cw(cap + S.SR_BAR0, 4, 0x1234_5000)
    d.cw(cap + S.SR_BAR0 + 4, 4, 0x2)
    assert c.card.sriov is not None
    assert c.card.sriov.vf_bar_base() == 0x2_1234_0000 | 0x0000  # low bits below size: 0
    assert c.card.vf_bar_address(3) == 0x2_1234_0000 + 2 * 0x8000


def _vf_bar_size(d: PciDriver, cap: int) -> int:
    lo, hi = d.cr(cap + S.SR_BAR0), d.cr(cap + S.SR_BAR0 + 4)
    d.cw(cap + S.SR_BAR0, 4, 0xFFFF_FFFF)
    d.cw(cap + S.SR_BAR0 + 4, 4, 0xFFFF_FFFF)
    mask = (d.cr(cap + S.SR_BAR0) & ~0xF) | d.cr(cap + S.SR_BAR0 + 4) << 32
    d.cw(cap + S.SR_BAR0, 4, lo)
    d.cw(cap + S.SR_BAR0 + 4, 4, hi)
    return (~mask & (2**64 - 1)) + 1


def test_supported_page_sizes_are_the_ones_pcie_requires_of_a_pf() -> None:
    d, cap = _cap(Card())
    assert d.cr(cap + S.SR_SUPPG) == 0x553     # 4K, 8K, 64K, 256K, 1M, 4M
    d.cw(cap + S.SR_SUPPG, 4, 0xFFFF_FFFF)     # read-only
    assert d.cr(cap + S.SR_SUPPG) == 0x553


@pytest.mark.parametrize("value", [0x0, 0x3, 0x4, 0x800, 0x8000_0000, 0x11])
def test_system_page_size_not_exactly_one_supported_size_is_refused(value: int) -> None:
    c = Card()
    d, cap = _cap(c)
    d.cw(cap + S.SR_SYSPG, 4, 0x10)
    n = len(c.pf_fn.violations)
    d.cw(cap + S.SR_SYSPG, 4, value)
    assert d.cr(cap + S.SR_SYSPG) == 0x10                   # unchanged
    assert [v.rule for v in c.pf_fn.violations[n:]] == ["sriov/page-size"]
    assert _vf_bar_size(d, cap) == 0x1_0000


@pytest.mark.parametrize("bit,aperture", [(0x1, 0x8000), (0x2, 0x8000), (0x10, 0x1_0000),
                                          (0x40, 0x4_0000), (0x100, 0x10_0000),
                                          (0x400, 0x40_0000)])
def test_vf_bar_aperture_follows_the_system_page_size(bit: int, aperture: int) -> None:
    """Each VF's BAR0 starts on a system page: the sizing protocol reports max(32 KiB,
    page), the base keeps no bits below it, and VF n sits at base + (n-1) * aperture."""
    c = Card()
    d, cap = _cap(c)
    d.cw(cap + S.SR_SYSPG, 4, bit)
    assert d.cr(cap + S.SR_SYSPG) == bit and c.pf_fn.violations == []
    assert _vf_bar_size(d, cap) == aperture
    d.cw(cap + S.SR_BAR0, 4, 0x1234_5000)
    d.cw(cap + S.SR_BAR0 + 4, 4, 0x2)
    base = (0x2_1234_5000 & ~(aperture - 1))
    assert c.card.sriov is not None and c.card.sriov.vf_bar_base() == base
    assert c.card.vf_bar_address(3) == base + 2 * aperture
    c.pf.enable_vfs(3)          # (rewrites VF BAR0 with an aligned base and sets VF MSE)
    vf3 = c.card.vf_functions[2]
    assert vf3.bars()[0].size == 0x8000                     # its registers stay 32 KiB
    assert vf3.bar_read(0, 0x12, 2) == 4                    # and decode: num_queues


def test_system_page_size_cannot_change_while_vfs_are_enabled_and_flr_resets_it() -> None:
    c = Card()
    d, cap = _cap(c)
    d.cw(cap + S.SR_SYSPG, 4, 0x10)
    c.pf.enable_vfs(2)
    d.cw(cap + S.SR_SYSPG, 4, 0x1)
    assert d.cr(cap + S.SR_SYSPG) == 0x10
    assert c.pf_fn.violations[-1].rule == "sriov/page-size-while-enabled"
    assert len(c.card.vf_functions) == 2
    c.pf_fn.function_level_reset()
    assert d.cr(cap + S.SR_SYSPG) == 0x1 and _vf_bar_size(d, cap) == 0x8000


def test_num_vfs_above_total_refused() -> None:
    c = Card(total_vfs=8)
    d, cap = _cap(c)
    d.cw(cap + S.SR_NUM, 2, 9)
    assert d.cr(cap + S.SR_NUM, 2) == 0
    assert c.pf_fn.violations[-1].rule == "sriov/num-vfs"
    d.cw(cap + S.SR_NUM, 2, 8)
    assert d.cr(cap + S.SR_NUM, 2) == 8


def test_num_vfs_change_while_enabled_refused() -> None:
    c = Card()
    c.pf.enable_vfs(3)
    d, cap = _cap(c)
    d.cw(cap + S.SR_NUM, 2, 4)
    assert d.cr(cap + S.SR_NUM, 2) == 3
    assert c.pf_fn.violations[-1].rule == "sriov/num-vfs-while-enabled"
    assert len(c.card.vf_functions) == 3 and c.platform.asked == [1, 2, 3]


def test_vfs_appear_with_rids_bars_and_config_space() -> None:
    c = Card()
    c.pf.enable_vfs(4)
    assert c.platform.asked == [1, 2, 3, 4]
    assert len(c.platform.enabled) == 1 and len(c.platform.enabled[0]) == 4
    vfs = c.card.vf_functions
    assert list(c.platform.enabled[0]) == list(vfs)
    for n, vf in enumerate(vfs, 1):
        assert vf.config_read(0x00, 2) == 0xFFFF and vf.config_read(0x02, 2) == 0xFFFF
        assert vf.config_read(0x10, 4) == 0 and vf.config_read(0x14, 4) == 0
        vf.config_write(0x10, 4, 0xFFFF_FFFF)               # VF BAR registers are RO 0
        assert vf.config_read(0x10, 4) == 0
        assert vf.bars()[0].size == 0x8000
        assert c.card.vf_bar_address(n) == S.VF_BAR_BASE + (n - 1) * 0x8000
        assert c.card.vf_routing_id_offset(n) == n
        assert vf.config_read(0x2C, 2) == 0x1AF4          # subsystem ids stay
    # the PF keeps its own identity
    assert c.pf.cr(0x00, 2) == 0x1AF4 and c.pf.cr(0x02, 2) == 0x1040 + 60


def test_vf_disable_drops_vfs_and_tells_the_platform() -> None:
    c = Card()
    c.pf.enable_vfs(2)
    c.pf.disable_vfs()
    assert c.platform.disabled == 1 and c.card.vf_functions == []
    assert c.card.scheduler.functions[0].index == 0 and len(c.card.scheduler.functions) == 1
    c.pf.enable_vfs(2)     # NumVFs may change again while disabled; re-enable works
    assert len(c.card.vf_functions) == 2 and c.platform.asked == [1, 2, 1, 2]


def test_vf_memory_decoding_follows_vf_mse() -> None:
    c = Card()
    d, cap = _cap(c)
    d.cw(cap + S.SR_NUM, 2, 1)
    d.cw(cap + S.SR_CTRL, 2, S.VFE)                 # VF MSE clear
    vf = c.card.vf_functions[0]
    vf.config_write(0x04, 2, 0x6)
    assert vf.config_read(0x04, 2) == 0x4           # Memory Space is RsvdP in a VF
    assert vf.bar_read(0, 0x12, 2) == 0xFFFF        # not decoding
    assert vf.violations[-1].rule == "pci/memory-disabled"
    d.cw(cap + S.SR_CTRL, 2, S.VFE | S.VF_MSE)
    assert vf.bar_read(0, 0x12, 2) == 4             # num_queues: 2 + 2 submit queues


def test_features_and_admin_queue_only_on_the_pf() -> None:
    c = Card()
    c.pf.enable_vfs(1)
    pf_feats = c.pf.offered()
    assert pf_feats >> S.F_SR_IOV & 1 and pf_feats >> S.F_ADMIN_VQ & 1
    assert c.pf.c16(S.ADM_Q_IDX) == c.pf.c16(18) == 4   # after controlq, eventq, 2 submitqs
    vf = c.vf_rig(1)
    vf_feats = vf.offered()
    assert not vf_feats >> S.F_SR_IOV & 1 and not vf_feats >> S.F_ADMIN_VQ & 1
    # no admin fields: the VF's common config is 60 bytes long
    common = next(cap for cap in vf.virtio_caps().values() if cap.cfg_type == 1)
    assert common.length == 60 and c.pf.vcaps[1].length == 64
    # selecting the queue after the VF's last one is a bad select
    n = vf.c16(18)
    vf.w16(22, n)
    assert vf.c16(24) == 0
    vf.w16(24, 8)
    assert vf.fn.violations[-1].rule == "queue/bad-select"


def test_pf_flr_clears_vf_enable_and_drops_the_vfs() -> None:
    c = Card()
    c.pf.enable_vfs(2)
    c.pf_fn.function_level_reset()
    d, cap = _cap(c)
    assert d.cr(cap + S.SR_CTRL, 2) == 0 and d.cr(cap + S.SR_NUM, 2) == 0
    assert c.card.vf_functions == [] and c.platform.disabled == 1
    assert ext_cap(d, 0x10) == cap                            # capability still there


def test_vf_flr_resets_only_that_vf() -> None:
    c = Card()
    c.pf.enable_vfs(2)
    a, b = c.vf_rig(1), c.vf_rig(2)
    a.create_context()
    b.create_context()
    c.card.vf_functions[0].function_level_reset()
    assert c.card.vf_functions[0].status == 0 and c.card.vf_devices[0].contexts == {}
    assert c.card.vf_functions[1].status == 0xF and len(c.card.vf_devices[1].contexts) == 1


def test_card_parameters_are_checked() -> None:
    ports = DevicePorts(dma=S.FakeDma(), clock=S.FakeClock())
    for kw in ({"pf_memory": 3}, {"pf_memory": 2 << 20, "memory_size": 1 << 20},
               {"total_vfs": 1 << 16}):
        try:
            Va1Card(Va1Config(), ports, **kw)
        except ValueError:
            continue
        raise AssertionError(kw)
    card = Va1Card(Va1Config(), ports, memory_size=16 << 20, pf_memory=4 << 20)
    fn = card.physical_function(S.RecordingMsi(),
                                S.FakeSriovPlatform(ports.clock, S.RecordingTracer()))
    assert fn.device is card.pf_device and card.pf_device.memory.size == 4 << 20
    assert struct.unpack_from("<Q", card.pf_device.read_config(8, 8))[0] == 4 << 20


def test_sixty_four_vfs_each_run_a_workload_correctly() -> None:
    c = Card(memory=256 * S.MIB, ram=256 << 10)
    c.pf.use_all()
    c.pf.enable_vfs(64)
    assert len(c.card.vf_functions) == 64 and c.platform.asked == list(range(1, 65))
    share = (256 - 8) * S.MIB // 64 // S.MIB * S.MIB
    rigs = [c.vf_rig(n) for n in range(1, 65)]
    for n, rig in enumerate(rigs, 1):
        ctx = rig.create_context()
        host = rig.alloc.alloc(64, 64)
        buf = (struct.pack("<HHIQQII", 1, 0, 32, share - 64, 64, 0x01010101 * n, 0)
               + struct.pack("<HHIQQQ", 3, 0, 32, share - 64, host, 64))
        assert rig.submit(ctx, buf).status == 0
        assert rig.dma.g_read(host, 64) == bytes([n]) * 64
    for n in range(1, 65):
        assert c.card.vf_devices[n - 1].memory.read(share - 1, 1) == bytes([n])
