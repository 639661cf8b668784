"""A VFIO container (/dev/vfio/vfio) with the TYPE1v2 IOMMU backend.

Why: this is how the VMM gives an assigned function DMA into guest RAM, and how a
hostile or buggy guest is kept out of everything else: the VMM maps guest RAM at
IOVA = guest physical address, the IOMMU domain of the container applies it to every
device of every group in the container, and nothing else is reachable.

The semantics and errnos are those of drivers/vfio/container.c and
vfio_iommu_type1.c (v2 mode), check for check:
- SET_IOMMU needs at least one group in the container and no IOMMU yet (EINVAL); an
  IOMMU type this host does not offer is ENODEV. Only VFIO_TYPE1v2_IOMMU is offered
  (CHECK_EXTENSION answers 1 for it and for VFIO_UNMAP_ALL, 0 for anything else).
- IOMMU ioctls before SET_IOMMU: EINVAL. Unknown ioctl numbers: EINVAL without an
  IOMMU, ENOTTY with one (the kernel passes them to the IOMMU driver).
- MAP_DMA: argsz below offsetofend(size) or unknown flags: EINVAL; neither READ nor
  WRITE: EINVAL; zero size or size/iova/vaddr not 4 KiB aligned: EINVAL; iova or vaddr
  range wrapping 2^64: EINVAL; any overlap with an existing mapping: EEXIST; more than
  `dma_entry_limit` mappings: ENOSPC; outside the IOMMU aperture: EINVAL; vaddr not
  inside one registered guest RAM region: EFAULT (pinning the pages would fail).
  VFIO_DMA_MAP_FLAG_VADDR is refused (VFIO_UPDATE_VADDR is not offered).
- UNMAP_DMA: iova not aligned, zero or unaligned size, or wrapping: EINVAL; a range
  that starts or ends inside a mapping (it would split it): EINVAL; otherwise every
  mapping inside the range is removed and `size` is set to the bytes unmapped (0 when
  nothing was mapped). FLAG_ALL (iova = size = 0) unmaps everything. Dirty bitmaps and
  FLAG_VADDR are refused (EINVAL).
- GET_INFO: argsz below offsetofend(iova_pgsizes): EINVAL; flags = PGSIZES,
  iova_pgsizes = 4 KiB (bit 12). No capability chain is reported.
A failed call changes nothing, in the container or in the struct.

"vaddr" is the VMM's virtual address of guest RAM. Here the VMM's address space is
its host memory file: vaddr = byte offset in the HostMemory memfd, so guest RAM at
guest physical `gpa` of GuestMemory `m` has vaddr `m.host_offset + gpa - m.base`
(`vaddr_of`). The container is given the VM's GuestMemory objects (`register_memory`),
which is what makes a vaddr resolvable, as the VMM's mmap of guest RAM does for the
kernel's pin_user_pages.
"""
from __future__ import annotations

import errno
from typing import TYPE_CHECKING, Any, Callable, Iterable, Mapping

from ..iommu import PAGE_MASK, PAGE_SIZE, Iommu, IommuDomain, IommuError, format_bdf
from ..memory import GuestMemory
from . import uapi
from .uapi import CData

if TYPE_CHECKING:
    from .group import VfioGroup

U64_MAX = (1 << 64) - 1
DMA_ENTRY_LIMIT = 65535  # vfio_iommu_type1's dma_entry_limit module parameter default
_SUPPORTED_EXTENSIONS = frozenset({uapi.VFIO_TYPE1v2_IOMMU, uapi.VFIO_UNMAP_ALL})


def vfio_error(code: int, message: str) -> OSError:
    """OSError(errno, message): the shape every failed call here raises."""
    return OSError(code, message)


def _expect(arg: CData, struct: str) -> CData:
    """The struct behind `arg` (a `struct X *` or `struct X` cdata), else TypeError."""
    if not isinstance(arg, uapi.ffi.CData):
        raise TypeError(f"expected a cffi 'struct {struct} *', got {type(arg).__name__}")
    t = uapi.ffi.typeof(arg)
    want = uapi.ffi.typeof(f"struct {struct}")
    if t is want:
        return arg
    if t.kind == "pointer" and t.item is want:
        return arg[0]
    raise TypeError(f"expected a cffi 'struct {struct} *', got {t.cname!r}")


def _check_argsz(s: CData, struct: str, field: str, name: str) -> int:
    """EINVAL unless `s.argsz` covers `struct` up to the end of `field`; returns that
    minimum (minsz)."""
    minsz = uapi.offsetofend(struct, field)
    if s.argsz < minsz:
        raise vfio_error(errno.EINVAL, f"{name}: argsz {s.argsz} < {minsz}")
    return minsz


def _check_index(name: str, index: int, count: int) -> None:
    """EINVAL unless 0 <= `index` < `count` (a region or IRQ index)."""
    if index >= count:
        raise vfio_error(errno.EINVAL, f"{name}: index {index} out of range "
                                       f"(0..{count - 1})")


def _dispatch(request: int, arg: Any, handlers: Mapping[int, Callable[[Any], Any]],
              unknown: str) -> Any:
    """Call the handler of ioctl number `request` with `arg`: what it returns, or 0 if
    it returns nothing; a number not in `handlers`: ENOTTY with `unknown`."""
    handler = handlers.get(request)
    if handler is None:
        raise vfio_error(errno.ENOTTY, unknown)
    result = handler(arg)
    return 0 if result is None else result


def vaddr_of(memory: GuestMemory, gpa: int) -> int:
    """The VMM 'virtual address' of guest physical `gpa` (see module docstring)."""
    if not memory.contains(gpa, 0) or gpa == memory.base + memory.size:
        raise ValueError(f"guest physical address {gpa:#x} is outside guest RAM "
                         f"[{memory.base:#x}, {memory.base + memory.size:#x})")
    return memory.host_offset + gpa - memory.base


def _host_base(memory: GuestMemory) -> int:
    """The process address of host offset 0 of the HostMemory `memory` was carved from."""
    ptr: int = memory.view(memory.base, 0).__array_interface__["data"][0]
    return ptr - memory.host_offset


class VfioContainer:
    """One open /dev/vfio/vfio: groups, and once SET_IOMMU is done, one IOMMU domain."""

    def __init__(self, iommu: Iommu, memory: Iterable[GuestMemory] = (),
                 dma_entry_limit: int = DMA_ENTRY_LIMIT) -> None:
        self.iommu = iommu
        self.dma_entry_limit = dma_entry_limit
        self.groups: list[VfioGroup] = []
        self.iommu_type: int | None = None
        self.domain: IommuDomain | None = None
        self._memory: list[GuestMemory] = []
        for m in memory:
            self.register_memory(m)

    def register_memory(self, memory: GuestMemory) -> None:
        """Make guest RAM `memory` resolvable as MAP_DMA vaddrs (the VMM's mmap of it).

        All registered RAM must come from one HostMemory: vaddrs are offsets in it."""
        if any(m is memory for m in self._memory):
            return
        base = _host_base(memory)
        if self._memory and _host_base(self._memory[0]) != base:
            raise ValueError("guest memory from another HostMemory: a container's vaddrs are "
                             "offsets into one host memory file")
        self._memory.append(memory)

    # -- container ioctls -------------------------------------------------------------

    def get_api_version(self) -> int:
        return uapi.VFIO_API_VERSION

    def check_extension(self, extension: int) -> int:
        """1 if offered, 0 otherwise (never an error, as in the kernel)."""
        return 1 if extension in _SUPPORTED_EXTENSIONS else 0

    def set_iommu(self, iommu_type: int) -> None:
        if not self.groups:
            raise vfio_error(errno.EINVAL, "VFIO_SET_IOMMU: no group is attached to the container yet "
                                           "(VFIO_GROUP_SET_CONTAINER first)")
        if self.iommu_type is not None:
            raise vfio_error(errno.EINVAL, f"VFIO_SET_IOMMU: the container already has IOMMU type "
                                           f"{self.iommu_type}")
        if iommu_type != uapi.VFIO_TYPE1v2_IOMMU:
            raise vfio_error(errno.ENODEV, f"VFIO_SET_IOMMU: IOMMU type {iommu_type} is not offered "
                                           f"(only VFIO_TYPE1v2_IOMMU = {uapi.VFIO_TYPE1v2_IOMMU})")
        domain = self.iommu.create_domain()
        done: list[int] = []
        try:
            for g in self.groups:
                for rid in g.requester_ids():
                    self._attach_rid(rid, domain)
                    done.append(rid)
        except OSError:
            for rid in done:
                self.iommu.detach(rid)
            self.iommu.destroy_domain(domain)
            raise
        self.domain = domain
        self.iommu_type = iommu_type

    # -- IOMMU (TYPE1v2) ioctls -------------------------------------------------------

    def _need_iommu(self, what: str) -> IommuDomain:
        if self.domain is None:
            raise vfio_error(errno.EINVAL, f"{what}: no IOMMU set on the container (VFIO_SET_IOMMU first)")
        return self.domain

    def iommu_get_info(self, info: CData) -> None:
        s = _expect(info, "vfio_iommu_type1_info")
        self._need_iommu("VFIO_IOMMU_GET_INFO")
        _check_argsz(s, "vfio_iommu_type1_info", "iova_pgsizes", "VFIO_IOMMU_GET_INFO")
        s.flags = uapi.VFIO_IOMMU_INFO_PGSIZES
        s.iova_pgsizes = PAGE_SIZE
        if s.argsz >= uapi.offsetofend("vfio_iommu_type1_info", "cap_offset"):
            s.cap_offset = 0

    def iommu_map_dma(self, dma_map: CData) -> None:
        s = _expect(dma_map, "vfio_iommu_type1_dma_map")
        domain = self._need_iommu("VFIO_IOMMU_MAP_DMA")
        name = "VFIO_IOMMU_MAP_DMA"
        minsz = uapi.offsetofend("vfio_iommu_type1_dma_map", "size")
        known = uapi.VFIO_DMA_MAP_FLAG_READ | uapi.VFIO_DMA_MAP_FLAG_WRITE | uapi.VFIO_DMA_MAP_FLAG_VADDR
        if s.argsz < minsz or s.flags & ~known:
            raise vfio_error(errno.EINVAL, f"{name}: argsz {s.argsz} < {minsz} or unknown flags "
                                           f"{s.flags & ~known:#x}")
        if s.flags & uapi.VFIO_DMA_MAP_FLAG_VADDR:
            raise vfio_error(errno.EINVAL, f"{name}: VFIO_DMA_MAP_FLAG_VADDR is not supported "
                                           "(VFIO_UPDATE_VADDR is not offered)")
        read = bool(s.flags & uapi.VFIO_DMA_MAP_FLAG_READ)
        write = bool(s.flags & uapi.VFIO_DMA_MAP_FLAG_WRITE)
        if not (read or write):
            raise vfio_error(errno.EINVAL, f"{name}: neither VFIO_DMA_MAP_FLAG_READ nor _WRITE is set")
        iova, size, vaddr = int(s.iova), int(s.size), int(s.vaddr)
        if not size or (size | iova | vaddr) & PAGE_MASK:
            raise vfio_error(errno.EINVAL, f"{name}: iova {iova:#x}, vaddr {vaddr:#x}, size {size:#x}: "
                                           f"size must be non-zero and all three {PAGE_SIZE:#x}-aligned")
        if iova + size - 1 > U64_MAX or vaddr + size - 1 > U64_MAX:
            raise vfio_error(errno.EINVAL, f"{name}: iova {iova:#x} or vaddr {vaddr:#x} + size "
                                           f"{size:#x} wraps past 2^64")
        clash = next(domain.overlapping(iova, size), None)
        if clash is not None:
            raise vfio_error(errno.EEXIST, f"{name}: IOVA [{iova:#x}, {iova + size:#x}) overlaps the "
                                           f"existing mapping [{clash.iova:#x}, {clash.end:#x})")
        if len(domain.mappings) >= self.dma_entry_limit:
            raise vfio_error(errno.ENOSPC, f"{name}: the container already holds "
                                           f"{self.dma_entry_limit} mappings (dma_entry_limit)")
        if iova + size > self.iommu.aperture_end:
            raise vfio_error(errno.EINVAL, f"{name}: IOVA [{iova:#x}, {iova + size:#x}) is outside the "
                                           f"IOMMU's IOVA range [0, {self.iommu.aperture_end:#x})")
        memory = self._resolve(vaddr, size)
        if memory is None:
            raise vfio_error(errno.EFAULT, f"{name}: vaddr [{vaddr:#x}, {vaddr + size:#x}) is not "
                                           "inside registered guest RAM")
        gpa = memory.base + vaddr - memory.host_offset
        try:
            self.iommu.map(domain, iova, memory, gpa, size, read=read, write=write)
        except IommuError as e:  # every check above should have caught it first
            raise vfio_error(errno.EINVAL, f"{name}: {e}") from None

    def iommu_unmap_dma(self, dma_unmap: CData) -> None:
        s = _expect(dma_unmap, "vfio_iommu_type1_dma_unmap")
        domain = self._need_iommu("VFIO_IOMMU_UNMAP_DMA")
        name = "VFIO_IOMMU_UNMAP_DMA"
        minsz = uapi.offsetofend("vfio_iommu_type1_dma_unmap", "size")
        known = (uapi.VFIO_DMA_UNMAP_FLAG_GET_DIRTY_BITMAP | uapi.VFIO_DMA_UNMAP_FLAG_ALL
                 | uapi.VFIO_DMA_UNMAP_FLAG_VADDR)
        if s.argsz < minsz or s.flags & ~known:
            raise vfio_error(errno.EINVAL, f"{name}: argsz {s.argsz} < {minsz} or unknown flags "
                                           f"{s.flags & ~known:#x}")
        if s.flags & (uapi.VFIO_DMA_UNMAP_FLAG_GET_DIRTY_BITMAP | uapi.VFIO_DMA_UNMAP_FLAG_VADDR):
            raise vfio_error(errno.EINVAL, f"{name}: dirty bitmaps and FLAG_VADDR are not supported")
        iova, size = int(s.iova), int(s.size)
        if iova & PAGE_MASK:
            raise vfio_error(errno.EINVAL, f"{name}: iova {iova:#x} is not {PAGE_SIZE:#x}-aligned")
        if s.flags & uapi.VFIO_DMA_UNMAP_FLAG_ALL:
            if iova or size:
                raise vfio_error(errno.EINVAL, f"{name}: VFIO_DMA_UNMAP_FLAG_ALL needs iova = size = 0")
            unmapped = domain.mapped_bytes()
            for m in domain.mappings:
                self.iommu.unmap(domain, m.iova, m.size)
            s.size = unmapped
            return
        if not size or size & PAGE_MASK or iova + size - 1 > U64_MAX:
            raise vfio_error(errno.EINVAL, f"{name}: size {size:#x} at iova {iova:#x} must be non-zero, "
                                           f"{PAGE_SIZE:#x}-aligned and not wrap past 2^64")
        last = iova + size - 1
        first = domain.find(iova)
        if first is not None and first.iova != iova:
            raise vfio_error(errno.EINVAL, f"{name}: [{iova:#x}, {iova + size:#x}) starts inside the "
                                           f"mapping [{first.iova:#x}, {first.end:#x}); TYPE1v2 does "
                                           "not split mappings")
        tail = domain.find(last)
        if tail is not None and tail.end != last + 1:
            raise vfio_error(errno.EINVAL, f"{name}: [{iova:#x}, {iova + size:#x}) ends inside the "
                                           f"mapping [{tail.iova:#x}, {tail.end:#x}); TYPE1v2 does "
                                           "not split mappings")
        s.size = self.iommu.unmap(domain, iova, size)

    # -- by number --------------------------------------------------------------------

    def ioctl(self, request: int, arg: int | CData = 0) -> int:
        """Dispatch by linux/vfio.h ioctl number; returns what the ioctl returns."""
        if request == uapi.VFIO_GET_API_VERSION:
            return self.get_api_version()
        if request == uapi.VFIO_CHECK_EXTENSION:
            return self.check_extension(int(arg))
        if request == uapi.VFIO_SET_IOMMU:
            self.set_iommu(int(arg))
            return 0
        if self.domain is None:
            raise vfio_error(errno.EINVAL, f"container ioctl {request:#x}: no IOMMU set on the container")
        result: int = _dispatch(request, arg, {uapi.VFIO_IOMMU_GET_INFO: self.iommu_get_info,
                                               uapi.VFIO_IOMMU_MAP_DMA: self.iommu_map_dma,
                                               uapi.VFIO_IOMMU_UNMAP_DMA: self.iommu_unmap_dma},
                                f"container ioctl {request:#x} is not a TYPE1 IOMMU ioctl")
        return result

    # -- for groups -------------------------------------------------------------------

    def _resolve(self, vaddr: int, size: int) -> GuestMemory | None:
        for m in self._memory:
            if m.host_offset <= vaddr and vaddr + size <= m.host_offset + m.size:
                return m
        return None

    def _attach_rid(self, rid: int, domain: IommuDomain) -> None:
        try:
            self.iommu.attach(rid, domain)
        except IommuError as e:
            raise vfio_error(errno.EBUSY, f"requester {format_bdf(rid)} cannot join the container's "
                                          f"IOMMU domain: {e}") from None

    def _add_group(self, group: "VfioGroup") -> None:
        """SET_CONTAINER's container half: join the IOMMU domain if there is one."""
        if self.domain is not None:
            done: list[int] = []
            try:
                for rid in group.requester_ids():
                    self._attach_rid(rid, self.domain)
                    done.append(rid)
            except OSError:
                for rid in done:
                    self.iommu.detach(rid)
                raise
        self.groups.append(group)

    def _attach_device(self, rid: int) -> None:
        """A device joined a group of this container after SET_IOMMU."""
        if self.domain is not None:
            self._attach_rid(rid, self.domain)

    def _remove_group(self, group: "VfioGroup") -> None:
        """UNSET_CONTAINER's container half. The last group out releases the IOMMU:
        every mapping goes and the container is back to no IOMMU type, as in Linux."""
        self.groups.remove(group)
        if self.domain is not None:
            for rid in group.requester_ids():
                if self.iommu.domain_of(rid) is self.domain:
                    self.iommu.detach(rid)
            if not self.groups:
                self.iommu.destroy_domain(self.domain)
                self.domain = None
                self.iommu_type = None
