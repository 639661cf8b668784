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


def _state(a: RangeAllocator) -> tuple[list[int], list[int], dict[int, int]]:
    return list(a._free_starts), list(a._free_ends), dict(a._allocated)


@pytest.mark.parametrize("seed", [4, 5, 6])
def test_an_allocation_freed_and_made_again_matches_first_fit(seed):
    """alloc_dma right after the free of the newest allocation reuses its edit of the free
    list: same address and same free list as the search on an allocator that never
    reuses, whatever came before and after (frees, other sizes, resizes)."""
    import random
    rng = random.Random(seed)
    fast = PageAllocator(0x1010, 1 << 16)
    ref = PageAllocator(0x1010, 1 << 16)
    live: list[int] = []
    reused = 0
    for _ in range(3000):
        ref._newest = ref._undone = None   # the reference always searches
        r = rng.random()
        if live and r < 0.4:
            addr = live.pop(rng.randrange(len(live)) if rng.random() < 0.3 else -1)
            fast.free(addr)
            ref.free(addr)
        elif r < 0.42:
            size = rng.choice([1 << 15, 1 << 16, 3 << 14])
            fast.resize(size)
            ref.resize(size)
        else:
            size, align = rng.choice([(16, 64), (24, 16), (100, 64), (5000, 4096)])
            undone = fast._undone
            try:
                got = fast.alloc_dma(size, align)
            except AllocError:
                with pytest.raises(AllocError):
                    ref.alloc_dma(size, align)
                continue
            if undone is not None and fast._newest is undone:
                reused += 1
            assert got == ref.alloc_dma(size, align)
            live.append(got)
        assert _state(fast) == _state(ref)
    assert reused > 20   # the reuse was taken, not only the search


def test_the_reuse_is_not_taken_after_any_other_operation():
    a = PageAllocator(0x1000, 1 << 16)
    x = a.alloc_dma(16, 64)
    a.free(x)
    assert a._undone is not None
    assert a.alloc_dma(32, 64) == x      # another size: searched (and the same place)
    assert a._undone is None
    a.free(x)
    y = a.alloc_pages(1)                 # anything between the free and the next one
    assert a._undone is None and a.alloc_dma(16, 64) != y
    b = PageAllocator(0x1000, 1 << 16)
    x = b.alloc_dma(16, 64)
    z = b.alloc_dma(16, 64)
    b.free(x)                            # not the newest: a search-and-merge free
    assert b._undone is None and b.alloc_dma(16, 64) == x and z != x
