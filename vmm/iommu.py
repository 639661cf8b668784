"""The host IOMMU: DMA remapping per requester, 4 KiB pages, a fault log.

Why: with passthrough a device is programmed by an untrusted guest, so every address it
emits is an IOVA that must be translated through the domain its requester ID (PCI BDF)
is attached to. A DMA to an IOVA that is not mapped, or without the permission, is
refused: it is logged and it reads or writes nothing (the whole range is checked before
the first byte moves).

Model:
- `Iommu` holds domains, the requester-ID -> domain table and the fault log.
- A domain maps page-aligned IOVA ranges onto a backing memory: a `GuestMemory` (the
  address given is a guest physical address; this is what VFIO's MAP_DMA does with the
  VMM's virtual address of guest RAM), a `HostMemory` (a byte offset into the memfd) or
  a flat uint8 numpy array (a byte offset). A mapping is one range, kept in a list
  sorted by IOVA and found with bisect, so translating a large range costs one lookup
  per mapping it spans, not one per page. Semantically translation is per 4 KiB page:
  unmapping any page-aligned range works (it may split a mapping, as page tables do);
  VFIO's stricter TYPE1v2 rules are enforced one level up, in vmm.vfio.container.
- `IommuDma(iommu, requester_id)` is a device's `device_model.ports.DmaPort` behind the
  IOMMU. The domain is looked up on every access, so attach/detach take effect at once.

Views handed out by `IommuDma.view` alias guest memory; they must not be kept across an
unmap (the device model takes a view per access, as hardware walks the IOTLB per access).
The exception is `IommuDma.ring_view` (the device's virtqueue rings): it is valid only
while `Iommu.epoch`, which every map, unmap, attach and detach bumps, is unchanged.
"""
from __future__ import annotations

import bisect
from collections import deque
from dataclasses import dataclass
from typing import Iterator, Union

import numpy as np
from device_model.ports import DmaFault, Tracer

from .dma import DmaFaultHook
from .errors import VmmError
from .memory import GuestMemory, HostMemory

PAGE_SHIFT = 12
PAGE_SIZE = 1 << PAGE_SHIFT
PAGE_MASK = PAGE_SIZE - 1
U64_LIMIT = 1 << 64

Backing = Union[GuestMemory, HostMemory, np.ndarray]


class IommuError(VmmError, ValueError):
    """A bad request to the IOMMU itself (map, unmap, attach). Nothing was changed."""


def bdf(bus: int, device: int, function: int) -> int:
    """The 16-bit PCI requester ID of bus:device.function."""
    if not (0 <= bus < 256 and 0 <= device < 32 and 0 <= function < 8):
        raise IommuError(f"bad PCI address {bus}:{device}.{function} "
                         "(bus < 256, device < 32, function < 8)")
    return bus << 8 | device << 3 | function


def check_requester_id(requester_id: int) -> None:
    """IommuError unless `requester_id` is a 16-bit PCI BDF."""
    if not 0 <= requester_id <= 0xFFFF:
        raise IommuError(f"requester ID {requester_id:#x} is not a 16-bit PCI BDF")


def format_bdf(requester_id: int) -> str:
    """`bb:dd.f`, as lspci prints it, for messages."""
    return f"{requester_id >> 8 & 0xFF:02x}:{requester_id >> 3 & 0x1F:02x}.{requester_id & 7}"


@dataclass(frozen=True)
class IommuFault:
    """One refused DMA, as the fault log records it."""
    requester_id: int
    iova: int
    length: int
    write: bool
    reason: str


@dataclass(frozen=True)
class Mapping:
    """IOVA [iova, iova + size) -> backing bytes [index, index + size) of `array`."""
    iova: int
    size: int
    backing: Backing
    address: int        # as given to map(): a GPA for GuestMemory, else a byte offset
    array: np.ndarray   # the whole backing as flat uint8 (zero-copy)
    index: int          # where `iova` lands in `array`
    read: bool
    write: bool

    @property
    def end(self) -> int:
        return self.iova + self.size

    def _slice(self, iova: int, size: int) -> "Mapping":
        d = iova - self.iova
        return Mapping(iova, size, self.backing, self.address + d, self.array, self.index + d,
                       self.read, self.write)


def _backing_array(backing: Backing, address: int, size: int) -> tuple[np.ndarray, int]:
    """The flat uint8 array behind `backing` and the index of `address` in it."""
    if isinstance(backing, GuestMemory):
        if not backing.contains(address, size):
            raise IommuError(
                f"guest physical range [{address:#x}, {address + size:#x}) is outside guest RAM "
                f"[{backing.base:#x}, {backing.base + backing.size:#x})")
        return backing.view(backing.base, backing.size), address - backing.base
    if isinstance(backing, HostMemory):
        array = backing.array
    elif isinstance(backing, np.ndarray):
        if backing.dtype != np.uint8 or backing.ndim != 1 or not backing.flags.c_contiguous:
            raise IommuError("an array backing must be flat, contiguous uint8")
        array = backing
    else:
        raise IommuError(f"cannot map onto a {type(backing).__name__}: "
                         "GuestMemory, HostMemory or a uint8 array expected")
    if address < 0 or address + size > array.size:
        raise IommuError(f"backing range [{address:#x}, {address + size:#x}) is outside the "
                         f"backing's {array.size:#x} bytes")
    return array, address


class IommuDomain:
    """One I/O address space: sorted, non-overlapping mappings."""

    def __init__(self, iommu: "Iommu", domain_id: int) -> None:
        self.iommu = iommu
        self.id = domain_id
        self._starts: list[int] = []
        self._maps: list[Mapping] = []
        self.destroyed = False

    def __repr__(self) -> str:
        return f"<IommuDomain {self.id}: {len(self._maps)} mappings>"

    @property
    def mappings(self) -> tuple[Mapping, ...]:
        return tuple(self._maps)

    def mapped_bytes(self) -> int:
        return sum(m.size for m in self._maps)

    def overlapping(self, iova: int, size: int) -> Iterator[Mapping]:
        """Mappings that share at least one byte with [iova, iova + size), in IOVA order."""
        i = max(bisect.bisect_right(self._starts, iova) - 1, 0)
        end = iova + size
        while i < len(self._maps) and self._maps[i].iova < end:
            m = self._maps[i]
            if m.end > iova:
                yield m
            i += 1

    def find(self, iova: int) -> Mapping | None:
        """The mapping that holds byte `iova`, if any."""
        i = bisect.bisect_right(self._starts, iova) - 1
        if i >= 0 and self._maps[i].end > iova:
            return self._maps[i]
        return None

    def _insert(self, m: Mapping) -> None:
        i = bisect.bisect_left(self._starts, m.iova)
        self._starts.insert(i, m.iova)
        self._maps.insert(i, m)

    def _remove(self, m: Mapping) -> None:
        i = bisect.bisect_left(self._starts, m.iova)
        assert self._maps[i] is m
        del self._starts[i]
        del self._maps[i]

    def translate(self, iova: int, length: int, *, read: bool, write: bool
                  ) -> list[tuple[Mapping, int, int]]:
        """[(mapping, offset into it, bytes)] covering the range, or raise _Refused.

        Every page of the range is checked (by walking the mapping ranges) before the
        caller touches anything."""
        out: list[tuple[Mapping, int, int]] = []
        pos, end = iova, iova + length
        i = bisect.bisect_right(self._starts, pos) - 1
        while pos < end:
            if i < 0 or i >= len(self._maps) or self._maps[i].iova > pos or self._maps[i].end <= pos:
                raise _Refused(f"IOVA page {pos & ~PAGE_MASK:#x} is not mapped")
            m = self._maps[i]
            if write and not m.write:
                raise _Refused(f"IOVA page {pos & ~PAGE_MASK:#x} is in read-only mapping "
                               f"[{m.iova:#x}, {m.end:#x}): no write permission")
            if read and not m.read:
                raise _Refused(f"IOVA page {pos & ~PAGE_MASK:#x} is in write-only mapping "
                               f"[{m.iova:#x}, {m.end:#x}): no read permission")
            n = min(end, m.end) - pos
            out.append((m, pos - m.iova, n))
            pos += n
            i += 1
        return out


class _Refused(VmmError):
    """Internal: a translation failed; IommuDma turns it into a logged DmaFault."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class Iommu:
    """Domains, the requester-ID table and the fault log of one host IOMMU.

    `address_bits` bounds the IOVA space (48: four-level page tables). The fault log
    keeps the last `fault_log_size` faults, like a hardware fault-record ring, so a
    device that faults forever cannot grow host memory; `fault_count` counts them all.
    """

    def __init__(self, address_bits: int = 48, fault_log_size: int = 4096,
                 tracer: Tracer | None = None) -> None:
        if not 12 < address_bits <= 64:
            raise IommuError(f"address_bits {address_bits} outside (12, 64]")
        self.aperture_end = 1 << address_bits
        self.faults: deque[IommuFault] = deque(maxlen=fault_log_size)
        self.fault_count = 0
        self.tracer = tracer
        self._domains: dict[int, IommuDomain] = {}
        self._next_domain = 1
        self._attached: dict[int, IommuDomain] = {}
        # Bumped by every change to translations (attach, detach, map, unmap, destroy)
        # and by installing a DMA fault hook: ends IommuDma's cached translation and ring
        # views (DmaPort.view_epoch).
        self.epoch = 0

    # -- domains and requesters -------------------------------------------------------

    def create_domain(self) -> IommuDomain:
        d = IommuDomain(self, self._next_domain)
        self._next_domain += 1
        self._domains[d.id] = d
        return d

    def destroy_domain(self, domain: IommuDomain) -> None:
        """Drop a domain and all its mappings; no requester may still be attached."""
        self._own(domain)
        users = [format_bdf(r) for r, d in self._attached.items() if d is domain]
        if users:
            raise IommuError(f"domain {domain.id} still has requesters attached: {', '.join(users)}")
        domain._starts.clear()
        domain._maps.clear()
        domain.destroyed = True
        self.epoch += 1
        del self._domains[domain.id]

    def attach(self, requester_id: int, domain: IommuDomain) -> None:
        """Route DMA of `requester_id` through `domain` (it must be detached first)."""
        check_requester_id(requester_id)
        self._own(domain)
        cur = self._attached.get(requester_id)
        if cur is not None:
            raise IommuError(f"requester {format_bdf(requester_id)} is already attached "
                             f"to domain {cur.id}")
        self._attached[requester_id] = domain
        self.epoch += 1

    def detach(self, requester_id: int) -> None:
        check_requester_id(requester_id)
        if requester_id not in self._attached:
            raise IommuError(f"requester {format_bdf(requester_id)} is attached to no domain")
        del self._attached[requester_id]
        self.epoch += 1

    def domain_of(self, requester_id: int) -> IommuDomain | None:
        return self._attached.get(requester_id)

    # -- mappings ---------------------------------------------------------------------

    def map(self, domain: IommuDomain, iova: int, backing: Backing, offset: int, size: int,
            *, read: bool = True, write: bool = True) -> Mapping:
        """Map IOVA [iova, iova+size) onto `backing` at `offset` (a guest physical
        address for GuestMemory, a byte offset otherwise). All page-aligned; the range
        must be free; at least one of read/write."""
        self._own(domain)
        if size <= 0 or (iova | offset | size) & PAGE_MASK:
            raise IommuError(f"map of {size:#x} bytes at IOVA {iova:#x} (backing {offset:#x}): "
                             f"size must be positive and all three {PAGE_SIZE}-byte aligned")
        if iova < 0 or iova + size > self.aperture_end:
            raise IommuError(f"IOVA range [{iova:#x}, {iova + size:#x}) is outside the "
                             f"IOMMU aperture [0, {self.aperture_end:#x})")
        if not (read or write):
            raise IommuError("a mapping needs read or write permission")
        clash = next(domain.overlapping(iova, size), None)
        if clash is not None:
            raise IommuError(f"IOVA range [{iova:#x}, {iova + size:#x}) overlaps mapping "
                             f"[{clash.iova:#x}, {clash.end:#x}) in domain {domain.id}")
        array, index = _backing_array(backing, offset, size)
        m = Mapping(iova, size, backing, offset, array, index, bool(read), bool(write))
        domain._insert(m)
        self.epoch += 1
        return m

    def unmap(self, domain: IommuDomain, iova: int, size: int) -> int:
        """Unmap every mapped page in [iova, iova+size), splitting mappings at the
        edges; returns the bytes that were mapped there."""
        self._own(domain)
        if size <= 0 or (iova | size) & PAGE_MASK or iova < 0 or iova + size > U64_LIMIT:
            raise IommuError(f"unmap of {size:#x} bytes at IOVA {iova:#x}: size must be "
                             f"positive, both {PAGE_SIZE}-byte aligned, inside 64 bits")
        end = iova + size
        removed = 0
        self.epoch += 1
        for m in list(domain.overlapping(iova, size)):
            domain._remove(m)
            lo, hi = max(m.iova, iova), min(m.end, end)
            removed += hi - lo
            if m.iova < lo:
                domain._insert(m._slice(m.iova, lo - m.iova))
            if hi < m.end:
                domain._insert(m._slice(hi, m.end - hi))
        return removed

    # -- faults -----------------------------------------------------------------------

    def record_fault(self, requester_id: int, iova: int, length: int, write: bool,
                     reason: str) -> DmaFault:
        """Log a refused DMA and return the DmaFault to raise."""
        f = IommuFault(requester_id, iova, length, write, reason)
        self.faults.append(f)
        self.fault_count += 1
        if self.tracer is not None:
            self.tracer.emit("iommu_fault", requester=format_bdf(requester_id), iova=iova,
                             length=length, write=write, reason=reason)
        return DmaFault(iova, length, write, f"requester {format_bdf(requester_id)}: {reason}")

    def _own(self, domain: IommuDomain) -> None:
        if domain.iommu is not self or self._domains.get(domain.id) is not domain:
            raise IommuError(f"domain {domain.id} is not a live domain of this IOMMU")


_EMPTY = np.empty(0, dtype=np.uint8)


def _as_bytes(data: bytes | bytearray | memoryview | np.ndarray) -> np.ndarray:
    if isinstance(data, np.ndarray):
        return np.ascontiguousarray(data).reshape(-1).view(np.uint8)
    return np.frombuffer(memoryview(data).cast("B"), dtype=np.uint8)


class IommuDma:
    """The DmaPort of one PCI function behind the IOMMU (see module docstring).

    Like a hardware IOTLB it remembers the last mapping an access fell in (only a
    readable and writable one, and only while no fault plan watches), so an access
    inside it skips the walk; any change to translations (`Iommu.epoch`) drops it.
    """

    def __init__(self, iommu: Iommu, requester_id: int) -> None:
        check_requester_id(requester_id)
        self.iommu = iommu
        self.requester_id = requester_id
        self.bytes_read = 0
        self.bytes_written = 0
        self._hook: DmaFaultHook | None = None
        # (epoch, first IOVA, end IOVA, backing array, its memoryview, index - IOVA)
        self._tlb: tuple[int, int, int, np.ndarray, memoryview, int] = (
            -1, 0, 0, _EMPTY, _EMPTY.data, 0)

    @property
    def fault_hook(self) -> DmaFaultHook | None:
        """None unless a fault plan is installed; installing one ends the cached
        translation and every ring view, since the plan must see every access."""
        return self._hook

    @fault_hook.setter
    def fault_hook(self, hook: DmaFaultHook | None) -> None:
        self._hook = hook
        self.iommu.epoch += 1

    @property
    def view_epoch(self) -> int:
        """ring_view()s stay valid while this is unchanged (device_model.ports.DmaPort)."""
        return self.iommu.epoch

    def _translate(self, iova: int, length: int, *, read: bool, write: bool, probe: bool = False
                   ) -> list[tuple[Mapping, int, int]]:
        """Translate the whole range or log the fault and raise DmaFault (a probe moves
        no data: a fault plan neither counts nor fails it)."""
        if self._hook is not None and not probe:
            injected = self._hook.dma(iova, length, read, write)
            if injected is not None:
                raise self.iommu.record_fault(self.requester_id, iova, length, write, injected)
        domain = self.iommu.domain_of(self.requester_id)
        if domain is None:
            reason = "attached to no IOMMU domain"
        elif length < 0:
            reason = "negative length"
        elif iova < 0 or iova + length > U64_LIMIT:
            reason = "address range overflows 64 bits"
        else:
            try:
                segs = domain.translate(iova, length, read=read, write=write)
            except _Refused as e:
                reason = e.reason
            else:
                if len(segs) == 1 and self._hook is None:
                    m = segs[0][0]
                    if m.read and m.write:
                        self._tlb = (self.iommu.epoch, m.iova, m.iova + m.size, m.array,
                                     m.array.data, m.index - m.iova)
                return segs
        raise self.iommu.record_fault(self.requester_id, iova, length, write, reason)

    def check(self, iova: int, length: int, write: bool) -> None:
        """Probe: raises (and logs) the DmaFault the access would raise; touches nothing."""
        self._translate(iova, length, read=not write, write=write, probe=True)

    # The hot paths first try the cached mapping inline: it is readable and writable,
    # so a range inside it needs no other check.

    def read(self, iova: int, length: int) -> bytes:
        epoch, lo, hi, _, mv, delta = self._tlb
        if (epoch == self.iommu.epoch and lo <= iova and 0 < length
                and iova + length <= hi and self._hook is None):
            self.bytes_read += length
            return mv[iova + delta:iova + delta + length].tobytes()
        segs = self._translate(iova, length, read=True, write=False)
        self.bytes_read += length
        if len(segs) == 1:
            m, off, n = segs[0]
            return m.array[m.index + off:m.index + off + n].tobytes()
        return b"".join(m.array[m.index + off:m.index + off + n].tobytes() for m, off, n in segs)

    def write(self, iova: int, data: bytes | bytearray | memoryview | np.ndarray) -> None:
        epoch, lo, hi, arr, mv, delta = self._tlb
        if epoch == self.iommu.epoch and self._hook is None and lo <= iova:
            if type(data) is bytes or type(data) is bytearray:
                n = len(data)
                if 0 < n and iova + n <= hi:
                    mv[iova + delta:iova + delta + n] = data
                    self.bytes_written += n
                    return
            else:
                src = _as_bytes(data)
                n = src.size
                if 0 < n and iova + n <= hi:
                    arr[iova + delta:iova + delta + n] = src
                    self.bytes_written += n
                    return
        src = _as_bytes(data)
        segs = self._translate(iova, src.size, read=False, write=True)
        if len(segs) > 1 and any(np.may_share_memory(src, m.array) for m, _, _ in segs):
            src = src.copy()  # the source aliases a target segment: copy before scattering
        pos = 0
        for m, off, n in segs:
            m.array[m.index + off:m.index + off + n] = src[pos:pos + n]
            pos += n
        self.bytes_written += src.size

    def view(self, iova: int, length: int, write: bool = True) -> np.ndarray:
        """A zero-copy uint8 view. Needs read permission, and write permission unless
        `write=False` (then the view is read-only). Raises DmaFault, not logged as an
        IOMMU fault, when the range is mapped but not contiguous in one backing: then
        use read()/write()."""
        epoch, lo, hi, arr, _, delta = self._tlb
        if (epoch == self.iommu.epoch and lo <= iova and 0 < length
                and iova + length <= hi and self._hook is None):
            v = arr[iova + delta:iova + delta + length]
        else:
            v = self._view(iova, length, write)
        if not write and length:
            v = v.view()
            v.flags.writeable = False
        return v

    def _view(self, iova: int, length: int, write: bool) -> np.ndarray:
        segs = self._translate(iova, length, read=True, write=write)
        if not segs:
            return np.empty(0, dtype=np.uint8)
        m0, off0, _ = segs[0]
        start = m0.index + off0
        pos = start
        for m, off, n in segs:
            if m.backing is not m0.backing or m.index + off != pos:
                raise DmaFault(iova, length, write,
                               f"requester {format_bdf(self.requester_id)}: range is mapped but "
                               f"not contiguous in one backing memory (at IOVA {m.iova + off:#x}); "
                               "no zero-copy view, use read()/write()")
            pos += n
        return m0.array[start:pos]

    def probe_view(self, iova: int, length: int) -> None:
        """Raises exactly the DmaFault view(iova, length) would, without making the view
        (device_model.ports.DmaPort's optional probe_view)."""
        epoch, lo, hi, _, _, _ = self._tlb
        if not (epoch == self.iommu.epoch and lo <= iova and 0 < length
                and iova + length <= hi and self._hook is None):
            self._view(iova, length, True)

    def ring_view(self, iova: int, length: int) -> memoryview | None:
        """[iova, iova+length) as a byte view for ring fields when it lies in one readable
        and writable mapping, else None (then every access goes through read/write and
        is checked, faults logged); None too while a fault plan watches. Valid until
        view_epoch changes, which every change to translations does. Accesses through
        it are not counted in bytes_read/bytes_written."""
        if self._hook is not None or length <= 0:
            return None
        domain = self.iommu.domain_of(self.requester_id)
        m = None if domain is None else domain.find(iova)
        if m is None or not (m.read and m.write) or iova + length > m.end:
            return None
        i = m.index + iova - m.iova
        return m.array[i:i + length].data
