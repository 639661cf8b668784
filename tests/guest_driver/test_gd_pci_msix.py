"""MSI-X setup on a fake function: table contents, masking, enable, teardown."""
import errno

import pytest

from gd_pci_fakes import FakePciFunction, PciMachine
from guest_driver.pci import MsixVectors, PciError, enable_device, parse_msix, scan_host
from hwspec import pci as P


def machine(n=8, bir=1, table_off=0, pba_off=0x800, bar_size=0x1000):
    m = PciMachine()
    f = FakePciFunction(m.k, 0x1234, 0x5678)
    f.add_bar(bir, bar_size)
    f.add_msix(n, bir, table_off, pba_off)
    m.add(f, 0, 1)
    (fn,) = scan_host(m.k, m.host).functions
    enable_device(fn)
    return m, f, fn


def test_table_programmed_unmasked_and_enabled():
    m, f, fn = machine(n=8)
    calls = []
    vec = MsixVectors(m.k, fn)
    assert vec.table_size == 8 and vec.info.table_addr == f.bar_address(1)
    assert vec.info.pba_addr == f.bar_address(1) + 0x800
    msgs = vec.setup([(lambda i=i: calls.append(i), f"v{i}") for i in range(3)])
    assert len(msgs) == 3 and len(m.k.irq.msi) == 3
    for i, msg in enumerate(msgs):
        addr, data, ctrl = f.msix_entry(i)
        assert (addr, data, ctrl) == (msg.address, msg.data, 0)
    for i in range(3, 8):
        assert f.msix_entry(i)[2] & P.MSIX_ENTRY_CTRL_MASKBIT  # unused entries masked
    assert f.msix_ctrl & P.MSIX_FLAGS_ENABLE and not f.msix_ctrl & P.MSIX_FLAGS_MASKALL
    assert f.command & P.COMMAND_INTX_DISABLE
    assert f.violations == []
    # a message from the device reaches the right handler
    f.msix_fire(1)
    f.msix_fire(2)
    m.k.sched.run_all()
    assert calls == [1, 2] and m.k.stray_msi == []


def test_entries_are_written_while_the_function_is_masked():
    m, f, fn = machine(n=4)
    seen = []
    orig = f.bar_access

    def spy(index, off, size, value):
        if value is not None and off < 0x800:
            seen.append(f.msix_ctrl)
        return orig(index, off, size, value)
    f.bar_access = spy
    MsixVectors(m.k, fn).setup([(lambda: None, "a")])
    assert seen and all(c & P.MSIX_FLAGS_MASKALL and c & P.MSIX_FLAGS_ENABLE for c in seen)


def test_pending_message_while_masked_is_sent_on_unmask():
    m, f, fn = machine(n=2)
    calls = []
    vec = MsixVectors(m.k, fn)
    vec.setup([(lambda: calls.append(0), "a")])
    f.cfg[f.msix_cap + 3] |= P.MSIX_FLAGS_MASKALL >> 8
    f.msix_fire(0)
    m.k.sched.run_all()
    assert calls == [] and f.msix_pending == {0}
    f.cfg_write(f.msix_cap + 2, 2, f.msix_ctrl & ~P.MSIX_FLAGS_MASKALL)
    m.k.sched.run_all()
    assert calls == [0]


def test_teardown_masks_disables_and_frees():
    m, f, fn = machine(n=4)
    vec = MsixVectors(m.k, fn)
    vec.setup([(lambda: None, "a"), (lambda: None, "b")])
    vec.teardown()
    assert m.k.irq.msi == {} and m.k.irq.msi_frees == 2
    assert not f.msix_ctrl & P.MSIX_FLAGS_ENABLE
    assert all(f.msix_entry(i)[2] & P.MSIX_ENTRY_CTRL_MASKBIT for i in range(4))
    vec.teardown()  # idempotent
    assert m.k.irq.msi_frees == 2


def test_too_many_vectors_and_kernel_exhaustion():
    m, f, fn = machine(n=2)
    vec = MsixVectors(m.k, fn)
    with pytest.raises(PciError, match="3 MSI-X vectors wanted, the table has 2"):
        vec.setup([(lambda: None, "x")] * 3)
    m.k.irq.msi_capacity = 1
    with pytest.raises(OSError) as ei:
        vec.setup([(lambda: None, "x")] * 2)
    assert ei.value.errno == errno.ENOSPC
    assert m.k.irq.msi == {}  # the one it got was given back
    assert not f.msix_ctrl & P.MSIX_FLAGS_ENABLE


@pytest.mark.parametrize("reg, value, msg", [
    (P.MSIX_TABLE, 0xFC0 | 1, "table [0xfc0, +0x80) overruns BAR1"),
    (P.MSIX_PBA, 0x1000 | 1, "PBA [0x1000, +0x8) overruns BAR1"),
])
def test_table_outside_its_bar_is_an_error(reg, value, msg):
    m, f, fn = machine(n=8)
    f.cfg[f.msix_cap + reg:f.msix_cap + reg + 4] = value.to_bytes(4, "little")
    with pytest.raises(PciError, match=msg.replace("[", r"\[").replace("(", r"\(")
                       .replace(")", r"\)").replace("+", r"\+")):
        parse_msix(fn)


def test_table_in_unimplemented_bar_is_an_error():
    m, f, fn = machine(n=4)
    f.cfg[f.msix_cap + 4] = (f.cfg[f.msix_cap + 4] & ~7) | 3  # BIR 3: not implemented
    with pytest.raises(PciError, match="MSI-X table: .*BAR3 is not implemented"):
        parse_msix(fn)


def test_flr_clears_msix_and_restore_reprograms_it():
    from guest_driver.pci import function_level_reset
    m, f, fn = machine(n=4)
    f.add_exp()
    (fn,) = scan_host(m.k, m.host).functions
    enable_device(fn)
    vec = MsixVectors(m.k, fn)
    msgs = vec.setup([(lambda: None, "a")])
    function_level_reset(m.k, fn)
    assert not f.msix_ctrl & P.MSIX_FLAGS_ENABLE and f.msix_entry(0)[2] == 1
    vec.restore()
    assert f.msix_entry(0) == (msgs[0].address, msgs[0].data, 0)
    assert f.msix_ctrl & P.MSIX_FLAGS_ENABLE
