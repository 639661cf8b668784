import pytest

from guest_driver.mm import AllocError, PageAllocator, RangeAllocator
from guest_driver.va1.devmem import DEVMEM_ALIGN, DeviceMemory


def test_alignment_and_no_overlap():
    a = RangeAllocator(0x1003, 0x10000)
    got = [(a.alloc(n, al), n) for n, al in ((5, 1), (100, 16), (64, 4096), (3, 8))]
    for (addr, n), al in zip(got, (1, 16, 4096, 8)):
        assert addr % al == 0 and 0x1003 <= addr and addr + n <= 0x11003
    spans = sorted(got)
    for (a1, n1), (a2, _) in zip(spans, spans[1:]):
        assert a1 + n1 <= a2


def test_free_coalesces_and_enomem_is_named():
    a = RangeAllocator(0, 4096, "pool")
    x = a.alloc(1024)
    y = a.alloc(1024)
    z = a.alloc(2048)
    with pytest.raises(AllocError, match="pool: out of memory"):
        a.alloc(1)
    a.free(y)
    a.free(x)
    a.free(z)
    assert a.bytes_free == 4096 and a.alloc(4096) == 0


def test_bad_free_and_bad_args_raise():
    a = RangeAllocator(0, 4096)
    with pytest.raises(ValueError, match="not allocated"):
        a.free(8)
    with pytest.raises(ValueError):
        a.alloc(0)
    with pytest.raises(ValueError):
        a.alloc(8, 3)


def test_page_allocator_and_devmem():
    p = PageAllocator(0x4000_0000, 1 << 20)
    assert p.alloc_pages(1) % 4096 == 0
    assert p.alloc_dma(5) % 16 == 0
    d = DeviceMemory(1 << 20)
    x = d.alloc(1)
    assert x % DEVMEM_ALIGN == 0
    with pytest.raises(AllocError):
        d.alloc(2 << 20)
    d.free(x)


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_random_alloc_free_never_overlaps_and_fully_coalesces(seed):
    import random
    rng = random.Random(seed)
    a = RangeAllocator(0x10, 1 << 16)
    live: dict[int, int] = {}
    for _ in range(2000):
        if live and rng.random() < 0.45:
            addr = rng.choice(sorted(live))
            a.free(addr)
            del live[addr]
        else:
            size, align = rng.randint(1, 3000), 1 << rng.randint(0, 8)
            try:
                addr = a.alloc(size, align)
            except AllocError:
                continue
            assert addr % align == 0 and 0x10 <= addr and addr + size <= 0x10 + (1 << 16)
            for s, n in live.items():
                assert addr + size <= s or s + n <= addr, f"seed {seed}: overlap"
            live[addr] = size
    for addr in list(live):
        a.free(addr)
    assert a.bytes_free == 1 << 16 and a.alloc(1 << 16) == 0x10
