"""Context address spaces (CONTEXT_MAP / CONTEXT_UNMAP, FLAT contexts) and the
partition isolation of VFs."""
from __future__ import annotations

import struct

import dm_sriov as S
from dm_pci_driver import PciRig
from dm_sriov import Card

from device_model import Va1Config

MAP, UNMAP = 4, 5
R, W = 1, 2
OK, OOB, BAD_CONTEXT, BAD_REQUEST, BAD_ARG = 0, 5, 10, 11, 13
PAGE = 4096


def _map(rig: PciRig, ctx: int, va: int, pa: int, size: int, flags: int = R | W) -> int:
    st, _ = struct.unpack("<II", rig.ctrl(MAP, ctx, flags=flags,
                                          extra=struct.pack("<QQQ", va, pa, size)))
    return int(st)


def _unmap(rig: PciRig, ctx: int, va: int, size: int) -> int:
    st, _ = struct.unpack("<II", rig.ctrl(UNMAP, ctx, extra=struct.pack("<QQQ", va, 0, size)))
    return int(st)


def _fill(dst: int, size: int, pattern: int) -> bytes:
    return struct.pack("<HHIQQII", 1, 0, 32, dst, size, pattern, 0)


def _d2h(src: int, dst: int, size: int) -> bytes:
    return struct.pack("<HHIQQQ", 3, 0, 32, src, dst, size)


def _d2d(src: int, dst: int, size: int) -> bytes:
    return struct.pack("<HHIQQQ", 4, 0, 32, src, dst, size)


def _pci() -> PciRig:
    return PciRig(Va1Config(device_memory_size=1 << 20))


def test_private_context_reaches_only_its_mappings() -> None:
    rig = _pci()
    mem = rig.dev.memory.data
    a, b = rig.create_context(flat=False), rig.create_context(flat=False)
    # nothing mapped yet: every device address is out of bounds
    r = rig.submit(a, _fill(0, 64, 1))
    assert (r.status, r.error_offset) == (OOB, 0)
    a = rig.create_context(flat=False)    # the fault marked the first one
    assert _map(rig, a, 0x10000, 0x4000, 2 * PAGE) == OK
    assert _map(rig, b, 0x10000, 0x8000, PAGE) == OK
    assert rig.submit(a, _fill(0x10000, 64, 0xAAAAAAAA)).status == OK
    assert rig.submit(b, _fill(0x10000, 64, 0xBBBBBBBB)).status == OK
    assert (mem[0x4000:0x4040] == 0xAA).all() and (mem[0x8000:0x8040] == 0xBB).all()
    # b cannot reach a's second page (VA 0x11000 is not mapped in b)
    r = rig.submit(b, _fill(0x10000, 8, 0) + _fill(0x11000, 64, 0xCCCCCCCC))
    assert (r.status, r.error_offset) == (OOB, 32)
    assert not (mem == 0xCC).any()
    # a range straddling the end of a mapping is refused, though the next page is mapped
    assert _map(rig, a, 0x12000, 0x6000, PAGE) == OK
    r = rig.submit(a, _fill(0x11FC0, 128, 0xDDDDDDDD))
    assert (r.status, r.error_offset) == (OOB, 0)
    assert not (mem == 0xDD).any()


def test_read_only_mapping_refuses_writes_and_allows_reads() -> None:
    rig = _pci()
    c = rig.create_context(flat=False)
    assert _map(rig, c, 0, 0, PAGE, R) == OK
    assert _map(rig, c, PAGE, PAGE, PAGE, R | W) == OK
    rig.dev.memory.data[:16] = 7
    host = rig.alloc.alloc(64)
    assert rig.submit(c, _d2h(0, host, 16)).status == OK
    assert rig.dma.g_read(host, 16) == b"\x07" * 16
    assert rig.submit(c, _d2d(0, PAGE, 16)).status == OK                 # read RO, write RW
    r = rig.submit(c, _d2d(PAGE, 0, 16))                                 # write RO
    assert (r.status, r.error_offset) == (OOB, 0)
    c2 = rig.create_context(flat=False)
    assert _map(rig, c2, 0, 0, PAGE, W) == OK                            # write-only
    r = rig.submit(c2, _d2h(0, host, 16))
    assert (r.status, r.error_offset) == (OOB, 0)


def test_map_and_unmap_rules() -> None:
    rig = _pci()
    c = rig.create_context(flat=False)
    size = rig.dev.memory.size
    assert _map(rig, c, 0x10000, 0, 4 * PAGE) == OK
    assert _map(rig, c, 0x12000, 0x80000, PAGE) == BAD_ARG               # overlapping VA
    assert _map(rig, c, 0xF000, 0x80000, 2 * PAGE) == BAD_ARG            # overlaps from below
    assert _map(rig, c, 0x20000, size - PAGE, 2 * PAGE) == OOB           # pa past the end
    assert _map(rig, c, 0x20001, 0, PAGE) == BAD_ARG                     # unaligned
    assert _map(rig, c, 0x20000, 0, 100) == BAD_ARG
    assert _map(rig, c, 0x20000, 0, PAGE, 0) == BAD_ARG                  # no rights
    assert _map(rig, c, 0x20000, 0, PAGE, 4) == BAD_ARG                  # unknown flag
    assert _map(rig, 99, 0x20000, 0, PAGE) == BAD_CONTEXT
    assert _map(rig, c, 0x14000, 0, PAGE) == OK                          # adjacent: fine
    assert _unmap(rig, c, 0x10000, PAGE) == BAD_ARG                      # not whole
    assert _unmap(rig, c, 0x11000, 3 * PAGE) == BAD_ARG
    assert _unmap(rig, 99, 0x10000, 4 * PAGE) == BAD_CONTEXT
    assert _unmap(rig, c, 0x10000, 4 * PAGE) == OK
    assert _unmap(rig, c, 0x10000, 4 * PAGE) == BAD_ARG
    r = rig.submit(c, _fill(0x10000, 8, 1))
    assert r.status == OOB
    # UNMAP with flags, or MAP of a FLAT context, are refused
    f = rig.create_context()
    assert _map(rig, f, 0, 0, PAGE) == BAD_ARG
    st, _ = struct.unpack("<II", rig.ctrl(UNMAP, c, flags=1,
                                          extra=struct.pack("<QQQ", 0x14000, 0, PAGE)))
    assert st == BAD_REQUEST
    # a short MAP request
    st, _ = struct.unpack("<II", rig.ctrl(MAP, c, extra=struct.pack("<QQ", 0, 0)))
    assert st == BAD_REQUEST


def test_flat_context_sees_the_whole_function_memory() -> None:
    rig = _pci()
    f = rig.create_context()
    size = rig.dev.memory.size
    assert rig.submit(f, _fill(size - 64, 64, 0x01020304)).status == OK
    r = rig.submit(f, _fill(size - 60, 64, 0))
    assert (r.status, r.error_offset) == (OOB, 0)


def test_every_operand_of_a_gemm_is_translated() -> None:
    rig = _pci()
    c = rig.create_context(flat=False)
    m = 8
    # A at VA 0x100000 -> PA 0x10000, B VA 0x200000 -> 0x20000, C VA 0x300000 -> 0x30000
    for va, pa in ((0x100000, 0x10000), (0x200000, 0x20000), (0x300000, 0x30000)):
        assert _map(rig, c, va, pa, PAGE) == OK
    import numpy as np
    rng = np.random.default_rng(4)
    a = rng.standard_normal((m, m), dtype=np.float32)
    b = rng.standard_normal((m, m), dtype=np.float32)
    rig.dev.memory.data[0x10000:0x10000 + a.nbytes] = a.view(np.uint8).ravel()
    rig.dev.memory.data[0x20000:0x20000 + b.nbytes] = b.view(np.uint8).ravel()
    gemm = struct.pack("<HHIBBHIIIQQQQff", 0x10, 0, 64, 0, 0, 0, m, m, m, 0x100000,
                       0x200000, 0x300000, 0, 1.0, 0.0)
    assert rig.submit(c, gemm).status == OK
    got = rig.dev.memory.data[0x30000:0x30000 + 4 * m * m].view(np.float32).reshape(m, m)
    np.testing.assert_allclose(got, a @ b, rtol=1e-5)


# --- partitions -----------------------------------------------------------------------------

def test_vf_addresses_run_from_zero_to_its_quota() -> None:
    c = Card()
    c.pf.use_all()
    c.pf.enable_vfs(2)
    assert c.pf.set_resources(1, 4 * S.MIB) == (0, 0)
    v1 = c.vf_rig(1)
    ctx = v1.create_context()
    assert v1.submit(ctx, _fill(4 * S.MIB - 64, 64, 0x5A5A5A5A)).status == OK
    r = v1.submit(ctx, _fill(4 * S.MIB - 60, 64, 0x5A5A5A5A))
    assert (r.status, r.error_offset) == (OOB, 0)
    base = c.card.partitions[0].base
    assert (c.card.memory.data[base + 4 * S.MIB - 64:base + 4 * S.MIB] == 0x5A).all()


def test_a_vf_cannot_reach_another_vfs_bytes() -> None:
    c = Card()
    c.pf.use_all()
    c.pf.enable_vfs(3)
    rigs = [c.vf_rig(n) for n in (1, 2, 3)]
    ctxs = [r.create_context() for r in rigs]
    quota = c.card.partitions[0].device_memory
    secret = 0x5EC2E7E5
    # VF 2 fills its whole partition
    assert rigs[1].submit(ctxs[1], _fill(0, quota, secret)).status == OK
    # VF 1 and VF 3 read all of theirs back to the host: no secret anywhere
    for i in (0, 2):
        host = rigs[i].alloc.alloc(1 << 20, 4096)
        for off in range(0, quota, 1 << 20):
            assert rigs[i].submit(ctxs[i], _d2h(off, host, 1 << 20)).status == OK
            assert not any(rigs[i].dma.g_read(host, 1 << 20))
        r = rigs[i].submit(ctxs[i], _d2h(quota, host, 8))
        assert r.status == OOB
    # the card memory holds the secret exactly in VF 2's partition
    base = c.card.partitions[1].base
    words = c.card.memory.data.view("<u4")
    assert (words[base // 4:(base + quota) // 4] == secret).all()
    assert not (words[:base // 4] == secret).any()
    assert not (words[(base + quota) // 4:] == secret).any()


def test_card_memory_scrub_zeroes_exactly_the_range() -> None:
    from device_model.va1.memory import CardMemory
    m = CardMemory(1 << 20)
    m.data[:] = 0xFF
    m.scrub(4096 + 100, 3 * 4096)
    assert (m.data[:4196] == 0xFF).all()
    assert not m.data[4196:4196 + 3 * 4096].any()
    assert (m.data[4196 + 3 * 4096:] == 0xFF).all()
    p = m.partition(8192, 4096)
    p.write(0, b"\x01\x02")
    assert m.data[8192] == 1 and p.base == 8192 and p.size == 4096


def test_qparams_record_is_written_by_quantize_dynamic_and_read_by_dequantize() -> None:
    """QUANTIZE_DYNAMIC writes its qparams record: a read-only mapping refuses it at
    validation (nothing runs); DEQUANTIZE_DYNAMIC only reads it: read-only is enough."""
    from hwspec import isa
    from hwspec.isa import Opcode

    def enc(op: Opcode, **f: int) -> bytes:
        lay = isa.PAYLOAD[op]
        return struct.pack("<HHI", op, 0, isa.command_length(op)) + struct.pack(
            lay.format, *(f.get(n, 0) for n in lay.names))

    rig = _pci()
    c = rig.create_context(flat=False)
    assert _map(rig, c, 0, 0, PAGE) == OK
    assert _map(rig, c, PAGE, PAGE, PAGE, R) == OK
    rig.dev.memory.data[PAGE:PAGE + 8] = 0x55
    q = enc(Opcode.QUANTIZE_DYNAMIC, count=16, int_dtype=2, x=0, y=64, qparams=PAGE)
    r = rig.submit(c, _fill(128, 8, 1) + q)
    assert (r.status, r.error_offset) == (OOB, 32)
    assert bytes(rig.dev.memory.data[PAGE:PAGE + 8]) == b"\x55" * 8
    assert bytes(rig.dev.memory.data[128:136]) == bytes(8)        # nothing ran
    c = rig.create_context(flat=False)
    assert _map(rig, c, 0, 0, PAGE) == OK
    assert _map(rig, c, PAGE, PAGE, PAGE, R) == OK
    rig.dev.memory.data[PAGE:PAGE + 8] = list(struct.pack("<fi", 1.0, 0))
    dq = enc(Opcode.DEQUANTIZE_DYNAMIC, channels=1, inner=1, count=4, x=0, y=64,
             qparams=PAGE, wscale=PAGE, wsum=PAGE + 4)
    assert rig.submit(c, dq).status == OK
