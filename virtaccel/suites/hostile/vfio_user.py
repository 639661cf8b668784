"""A hostile VMM user of the VFIO uAPI (linux/vfio.h semantics): the process that owns
the attacker VM's container, group and device file misuses them while the victim VM
(its own function, another group) works. Every refusal must be an OSError with nothing
changed; anything else escaping is a FAIL, and reaching the victim is a breach."""
from __future__ import annotations

import errno
from typing import Any, Callable

from vmm.vfio import uapi
from vmm.vfio.container import vaddr_of

from .core import Attack, Scenario, Setup

CAT = "vfio uAPI"
PASSTHROUGH = frozenset({"vfio", "sriov"})
PAGE = 4096


def _parts(a: Attack) -> tuple[Any, Any, Any, Any]:
    """(container, group, device file, the attacker VM's GuestMemory)."""
    vm = a.session.vms[0]
    p = vm.passthrough[0]
    return p.container, p.host_function.group, p.endpoint.devfile, vm.memory


def _victim(a: Attack) -> tuple[Any, Any]:
    vm = a.session.vms[1]
    p = vm.passthrough[0]
    return p.host_function, vm.memory


def _refused(a: Attack, what: str, fn: Callable[[], object], want: int | None = None,
             breach: str | None = None) -> None:
    """Call `fn`: an OSError is the refusal expected (its errno noted when it is not
    `want`); success is noted, or a breach of `breach` when it must never succeed."""
    try:
        fn()
    except OSError as e:
        if want is not None and e.errno != want:
            a.note(f"{what}: errno {errno.errorcode.get(e.errno or 0, e.errno)}, "
                   f"expected {errno.errorcode.get(want, want)}")
        return
    if breach is not None:
        a.breach(breach, f"{what} succeeded")
    else:
        a.note(f"{what}: accepted")


def _dma_map(iova: int, size: int, vaddr: int, flags: int = -1, argsz: int | None = None) -> Any:
    m = uapi.new("struct vfio_iommu_type1_dma_map *")
    m.flags = (uapi.VFIO_DMA_MAP_FLAG_READ | uapi.VFIO_DMA_MAP_FLAG_WRITE) if flags < 0 else flags
    m.iova, m.size, m.vaddr = iova, size, vaddr
    if argsz is not None:
        m.argsz = argsz
    return m


def _dma_unmap(iova: int, size: int, flags: int = 0) -> Any:
    u = uapi.new("struct vfio_iommu_type1_dma_unmap *")
    u.iova, u.size, u.flags = iova, size, flags
    return u


def catalogue() -> list[Scenario]:
    out: list[Scenario] = []

    def add(name: str, rule: str, fn: Callable[..., object], doc: str) -> None:
        out.append(Scenario(f"vfio/{name}", CAT, rule, fn, PASSTHROUGH, Setup.HOST, doc))

    def map_case(iova: Callable[[Any], int], size: int, vaddr: Callable[[Attack, Any], int],
                 flags: int = -1, argsz: int | None = None, want: int | None = None
                 ) -> Callable[[Attack], None]:
        def program(a: Attack) -> None:
            c, _, _, mem = _parts(a)
            m = _dma_map(iova(mem), size, vaddr(a, mem), flags, argsz)
            _refused(a, "MAP_DMA", lambda: c.iommu_map_dma(m), want)
        return program

    def ram(a: Attack, mem: Any) -> int:
        return vaddr_of(mem, mem.base)

    def top(mem: Any) -> int:
        return int(mem.base + mem.size)
    cases: list[tuple[str, Callable[[Any], int], int, Callable[[Attack, Any], int],
                      dict[str, int]]] = [
            ("map-overlap", lambda m: m.base, PAGE, ram, {"want": errno.EEXIST}),
            ("map-unaligned", lambda m: top(m) + 12, PAGE, ram, {"want": errno.EINVAL}),
            ("map-size-zero", top, 0, ram, {"want": errno.EINVAL}),
            ("map-wraps", lambda m: (1 << 64) - PAGE, 2 * PAGE, ram, {"want": errno.EINVAL}),
            ("map-past-aperture", lambda m: 1 << 62, PAGE, ram, {"want": errno.EINVAL}),
            ("map-vaddr-outside", top, PAGE, lambda a, m: 1 << 40, {"want": errno.EFAULT}),
            ("map-no-access", top, PAGE, ram, {"flags": 0, "want": errno.EINVAL}),
            ("map-unknown-flags", top, PAGE, ram, {"flags": 0xF0, "want": errno.EINVAL}),
            ("map-flag-vaddr", top, PAGE, ram,
             {"flags": uapi.VFIO_DMA_MAP_FLAG_VADDR | 1, "want": errno.EINVAL}),
            ("map-short-argsz", top, PAGE, ram, {"argsz": 8, "want": errno.EINVAL})]
    for name, iova, size, vaddr, kw in cases:
        add(name, "vfio/map-dma", map_case(iova, size, vaddr, **kw),
            f"VFIO_IOMMU_MAP_DMA: {name.replace('-', ' ')}")

    def map_victim_vaddr(a: Attack) -> None:
        """The victim's RAM at its own VMM's vaddr: in this process that vaddr can only
        name the attacker's own memory; whatever the map does, the IOVA must not reach
        the victim's RAM."""
        c, _, _, mem = _parts(a)
        vmem = _victim(a)[1]
        iova = 1 << 32
        _refused(a, "MAP_DMA", lambda: c.iommu_map_dma(
            _dma_map(iova, PAGE, vaddr_of(vmem, vmem.base + (1 << 20)))))
        m = c.domain.find(iova) if c.domain is not None else None
        if m is not None and m.backing is vmem:
            a.breach("vfio/foreign-memory", "an IOVA of the attacker's container maps the "
                     "victim VM's RAM")
    add("map-victim-vaddr", "vfio/map-dma", map_victim_vaddr,
        "MAP_DMA naming the victim VMM's vaddr of its RAM")

    def unmap_case(iova: Callable[[Any], int], size: int, flags: int = 0,
                   want: int | None = errno.EINVAL) -> Callable[[Attack], None]:
        def program(a: Attack) -> None:
            c, _, _, mem = _parts(a)
            u = _dma_unmap(iova(mem), size, flags)
            _refused(a, "UNMAP_DMA", lambda: c.iommu_unmap_dma(u), want)
        return program
    for name, iova, size, flags in (("unmap-split", lambda m: m.base + PAGE, PAGE, 0),
                                    ("unmap-unaligned", lambda m: m.base + 1, PAGE, 0),
                                    ("unmap-size-odd", lambda m: m.base, 12, 0),
                                    ("unmap-wraps", lambda m: (1 << 64) - PAGE, 2 * PAGE, 0),
                                    ("unmap-all-with-range", lambda m: m.base, PAGE,
                                     uapi.VFIO_DMA_UNMAP_FLAG_ALL),
                                    ("unmap-dirty-bitmap", lambda m: m.base, PAGE,
                                     uapi.VFIO_DMA_UNMAP_FLAG_GET_DIRTY_BITMAP)):
        add(name, "vfio/unmap-dma", unmap_case(iova, size, flags),
            f"VFIO_IOMMU_UNMAP_DMA: {name.replace('-', ' ')}")

    def unmap_nothing(a: Attack) -> None:
        c, _, _, mem = _parts(a)
        u = _dma_unmap(1 << 36, PAGE)
        c.iommu_unmap_dma(u)
        if u.size:
            a.breach("vfio/unmap-dma", f"unmapping an empty range reported {u.size} bytes")
    add("unmap-nothing", "vfio/unmap-dma", unmap_nothing, "UNMAP_DMA of a range never mapped")

    def remap_storm(a: Attack) -> None:
        """Unmap all guest RAM while the guest's function works, then map it back."""
        c, _, _, mem = _parts(a)
        if a.ctx is not None:
            from .raw import cmd
            from hwspec import isa
            a.dev.submit(a.ctx, cmd(isa.Opcode.NOP), timeout_ns=100_000)
        u = _dma_unmap(mem.base, mem.size)
        c.iommu_unmap_dma(u)
        a.sleep(50_000)
        c.iommu_map_dma(_dma_map(mem.base, mem.size, vaddr_of(mem, mem.base)))
    add("unmap-ram-and-remap", "vfio/unmap-dma", remap_storm,
        "unmap all guest RAM under the function, then map it back")

    container_cases: list[tuple[str, Callable[[Any], object], int]] = [
            ("set-iommu-again", lambda c: c.set_iommu(uapi.VFIO_TYPE1v2_IOMMU), errno.EINVAL),
            ("set-iommu-bad-type", lambda c: c.set_iommu(99), errno.EINVAL),
            ("container-unknown-ioctl", lambda c: c.ioctl(0xDEAD), errno.ENOTTY),
            ("get-info-short-argsz", lambda c: c.iommu_get_info(
                _argsz(uapi.new("struct vfio_iommu_type1_info *"), 4)), errno.EINVAL)]
    for name, cfn, cwant in container_cases:
        def container_case(a: Attack, fn: Callable[[Any], object] = cfn, want: int = cwant,
                           n: str = name) -> None:
            _refused(a, n, lambda: fn(_parts(a)[0]), want)
        add(name, "vfio/container", container_case, f"container: {name.replace('-', ' ')}")
    add("check-extension-garbage", "vfio/container",
        lambda a: _parts(a)[0].check_extension(0xFFFF_FFFF) and None,
        "CHECK_EXTENSION with garbage")

    def group_case(fn: Callable[[Attack, Any], object], want: int | None,
                   breach: str | None = None) -> Callable[[Attack], None]:
        def program(a: Attack) -> None:
            _, g, _, _ = _parts(a)
            _refused(a, "group ioctl", lambda: fn(a, g), want, breach)
        return program
    add("group-set-container-again", "vfio/group",
        group_case(lambda a, g: g.set_container(_parts(a)[0]), errno.EINVAL),
        "SET_CONTAINER on a group already in one")
    add("group-unset-with-device-open", "vfio/group",
        group_case(lambda a, g: g.unset_container(), errno.EBUSY),
        "UNSET_CONTAINER while the device file is open")
    add("group-device-fd-bad-name", "vfio/group",
        group_case(lambda a, g: g.get_device_fd("0000:ff:1f.7"), errno.ENODEV),
        "GET_DEVICE_FD of a device not in the group")
    add("group-device-fd-victim", "vfio/group",
        group_case(lambda a, g: g.get_device_fd(_victim(a)[0].name), errno.ENODEV,
                   "vfio/foreign-device"),
        "GET_DEVICE_FD naming the victim's function")
    add("group-unknown-ioctl", "vfio/group",
        group_case(lambda a, g: g.ioctl(0xBEEF), None), "an unknown group ioctl")

    def dev_case(fn: Callable[[Any], object], want: int | None) -> Callable[[Attack], None]:
        def program(a: Attack) -> None:
            _, _, d, _ = _parts(a)
            _refused(a, "device ioctl", lambda: fn(d), want)
        return program

    def region_info(index: int) -> Callable[[Any], object]:
        def fn(d: Any) -> object:
            info = uapi.new("struct vfio_region_info *")
            info.index = index
            return d.get_region_info(info)
        return fn

    def irq_info(index: int) -> Callable[[Any], object]:
        def fn(d: Any) -> object:
            info = uapi.new("struct vfio_irq_info *")
            info.index = index
            return d.get_irq_info(info)
        return fn

    def set_irqs(flags: int, index: int, start: int, count: int, fds: tuple[int, ...] = (),
                 argsz: int | None = None) -> Callable[[Any], object]:
        def fn(d: Any) -> object:
            data = b"".join(int(f).to_bytes(4, "little", signed=True) for f in fds)
            s = uapi.new("struct vfio_irq_set *", {"data": max(len(data), 1)})
            s.argsz = uapi.offsetofend("vfio_irq_set", "count") + len(data) \
                if argsz is None else argsz
            s.flags, s.index, s.start, s.count = flags, index, start, count
            if data:
                uapi.ffi.buffer(s.data, len(data))[:] = data
            return d.set_irqs(s)
        return fn
    trig = uapi.VFIO_IRQ_SET_DATA_EVENTFD | uapi.VFIO_IRQ_SET_ACTION_TRIGGER
    msix = uapi.VFIO_PCI_MSIX_IRQ_INDEX
    device_cases: list[tuple[str, Callable[[Any], object], int | None]] = [
            ("region-info-index-99", region_info(99), errno.EINVAL),
            ("region-info-vga", region_info(uapi.VFIO_PCI_VGA_REGION_INDEX), None),
            ("irq-info-index-99", irq_info(99), errno.EINVAL),
            ("set-irqs-two-actions", set_irqs(trig | uapi.VFIO_IRQ_SET_ACTION_MASK, msix, 0, 1,
                                              (-1,)), errno.EINVAL),
            ("set-irqs-no-data-type", set_irqs(uapi.VFIO_IRQ_SET_ACTION_TRIGGER, msix, 0, 0),
             errno.EINVAL),
            ("set-irqs-intx", set_irqs(trig, uapi.VFIO_PCI_INTX_IRQ_INDEX, 0, 1, (-1,)),
             errno.EINVAL),
            ("set-irqs-start-beyond", set_irqs(trig, msix, 4096, 1, (-1,)), errno.EINVAL),
            ("set-irqs-count-overflow", set_irqs(trig, msix, 1, 0xFFFF_FFFF, (-1,)),
             errno.EINVAL),
            ("set-irqs-not-eventfd", set_irqs(trig, msix, 0, 1, (0,)), errno.EBADF),
            ("set-irqs-fd-garbage", set_irqs(trig, msix, 0, 1, (123456,)), errno.EBADF),
            ("set-irqs-short-argsz", set_irqs(trig, msix, 0, 2, (-1, -1), argsz=12),
             errno.EINVAL),
            ("set-irqs-index-99", set_irqs(trig, 99, 0, 1, (-1,)), errno.EINVAL),
            ("region-read-past-config", lambda d: d.region_read(
                uapi.VFIO_PCI_CONFIG_REGION_INDEX, 4094, 8), errno.EINVAL),
            ("region-read-past-bar", lambda d: d.region_read(0, 1 << 20, 4), errno.EINVAL),
            ("region-write-past-bar", lambda d: d.region_write(0, (1 << 64) - 4, b"\xff" * 8),
             errno.EINVAL),
            ("region-write-rom", lambda d: d.region_write(uapi.VFIO_PCI_ROM_REGION_INDEX, 0,
                                                         b"\0" * 4), errno.EINVAL),
            ("region-mmap-msix-page", lambda d: d.region_mmap(0, 0x4000, 0x1000), errno.EINVAL),
            ("region-mmap-unaligned", lambda d: d.region_mmap(0, 12, 0x1000), errno.EINVAL),
            ("device-unknown-ioctl", lambda d: d.ioctl(0xF00D), errno.ENOTTY)]
    for name, fn, want in device_cases:
        add(name, "vfio/device", dev_case(fn, want), f"device: {name.replace('-', ' ')}")

    def reset_live(a: Attack) -> None:
        _, _, d, _ = _parts(a)
        for _ in range(5):
            d.reset()
            a.sleep(10_000)
    add("device-reset-storm", "vfio/reset", reset_live, "VFIO_DEVICE_RESET five times")

    def config_region(a: Attack) -> None:
        _, _, d, _ = _parts(a)
        for _ in range(200):
            off = a.rng.randrange(0x40, 0x1000, 4)
            try:
                d.region_write(uapi.VFIO_PCI_CONFIG_REGION_INDEX, off,
                               a.rng.getrandbits(32).to_bytes(4, "little"))
            except OSError:
                pass
    add("config-region-fuzz", "vfio/config", config_region,
        "200 seeded stores through the config region")
    return out


def _argsz(s: Any, n: int) -> Any:
    s.argsz = n
    return s
