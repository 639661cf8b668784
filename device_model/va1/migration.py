"""The migration port of a VA-1 function (spec §15): suspend, queue state, device state.

Why: moving a running tenant from one function to another (a vDPA live move) needs the
device to stop at a clean point and to hand over what the driver cannot rebuild: where
each ring's device side stands (last_avail_idx) and the function's own state (contexts,
their address spaces, device memory). A vendor's parent driver reaches it (as mlx5_vdpa
reaches its firmware); no driver can, and unused it changes nothing.

- suspend(): the function takes no new buffer from any ring (a notify is ignored; the
  owner re-kicks after resume) and finishes what it took; `quiescent` tells when
  nothing is queued, running or held. resume() undoes it and looks at every ring again.
- vq_state(i): the ring's last_avail_idx; set_vq_state(i, idx) before DRIVER_OK makes
  the ring start there (used index too: a suspended function has completed all it took).
- save() / load(): contexts, their mappings and the memory, as bytes; load() only
  before DRIVER_OK, into a function with the same memory size (ValueError otherwise).
"""
from __future__ import annotations

import struct
from typing import TYPE_CHECKING

from ..virtio.ring import DeviceRing

if TYPE_CHECKING:
    from .device import Va1Device

_MAGIC = b"VA1S"
_HEAD = struct.Struct("<4sIQI")          # magic, version, memory size, contexts
_CTX = struct.Struct("<IBBI")            # id, faulted, flat, mappings
_MAP = struct.Struct("<QQQI")            # va, pa, size, flags


class MigrationPort:
    def __init__(self, device: "Va1Device") -> None:
        self._device = device
        self.suspended = False
        self._bases: dict[int, int] = {}

    # -- suspend ------------------------------------------------------------------------

    def suspend(self) -> None:
        self.suspended = True
        self._device.tracer.emit("suspend")

    @property
    def quiescent(self) -> bool:
        d = self._device
        p = d.processor
        return p.idle() and not p._timers and not d._held

    def resume(self) -> None:
        d = self._device
        self.suspended = False
        d.tracer.emit("resume")
        for i in range(len(d.queues)):
            d.notify(i)

    # -- queue state --------------------------------------------------------------------

    def vq_state(self, index: int) -> int:
        d = self._device
        if 0 <= index < len(d.queues):
            return int(getattr(d.queues[index], "last_avail_idx", 0))
        return self._bases.get(index, 0)

    def set_vq_state(self, index: int, last_avail_idx: int) -> None:
        if not 0 <= last_avail_idx <= 0xFFFF:
            raise ValueError(f"queue {index}: last_avail_idx {last_avail_idx} is not 16 bits")
        self._bases[index] = last_avail_idx

    def apply(self, queues: list[DeviceRing]) -> None:
        """At DRIVER_OK: rings start where set_vq_state said (then forgotten)."""
        for i, base in self._bases.items():
            if 0 <= i < len(queues) and hasattr(queues[i], "last_avail_idx"):
                ring = queues[i]
                setattr(ring, "last_avail_idx", base)
                setattr(ring, "next_used_idx", base)
                setattr(ring, "_signalled_used", base)
        self._bases.clear()

    def forget(self) -> None:
        """Reset: queue state and suspension dropped."""
        self._bases.clear()
        self.suspended = False

    # -- device state -------------------------------------------------------------------

    def save(self) -> bytes:
        d = self._device
        out = [_HEAD.pack(_MAGIC, 1, d.memory.size, len(d.contexts))]
        for cid in sorted(d.contexts):
            c = d.contexts[cid]
            maps = c.aspace.mappings
            out.append(_CTX.pack(cid, int(c.faulted), int(c.flat), len(maps)))
            out.extend(_MAP.pack(m.va, m.pa, m.size, m.flags) for m in maps)
        out.append(bytes(d.memory.data))
        return b"".join(out)

    def load(self, state: bytes) -> None:
        from .aspace import AddressSpace
        from .device import Context
        d = self._device
        if d.active:
            raise ValueError("load: the function is live (load before DRIVER_OK)")
        if len(state) < _HEAD.size:
            raise ValueError(f"load: {len(state)} bytes, shorter than the state header")
        magic, version, size, n = _HEAD.unpack_from(state)
        if magic != _MAGIC or version != 1:
            raise ValueError(f"load: not a VA-1 state (magic {magic!r}, version {version})")
        if size != d.memory.size:
            raise ValueError(f"load: state of {size:#x} bytes of memory, this function has "
                             f"{d.memory.size:#x}")
        pos = _HEAD.size
        contexts: dict[int, Context] = {}
        try:
            for _ in range(n):
                cid, faulted, flat, nmaps = _CTX.unpack_from(state, pos)
                pos += _CTX.size
                aspace = AddressSpace()
                for _ in range(nmaps):
                    va, pa, msize, flags = _MAP.unpack_from(state, pos)
                    pos += _MAP.size
                    aspace.map(va, pa, msize, flags, size)
                contexts[cid] = Context(cid, bool(faulted), bool(flat), aspace)
        except struct.error:
            raise ValueError("load: truncated context table") from None
        if len(state) - pos != size:
            raise ValueError(f"load: {len(state) - pos} bytes of memory, {size} expected")
        d.memory.data[:] = memoryview(state)[pos:]
        d.contexts = contexts
        d.tracer.emit("state_loaded", contexts=len(contexts))
