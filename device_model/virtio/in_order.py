"""VIRTIO_F_IN_ORDER on the device side, for either ring layout (virtio 1.x §2.7.9,
§2.8.9): chains are given back in the order they were made available, and a run of
chains ready together may go back as one used entry (a batch).

The device completes work out of order (a bad request is answered at once while the
submissions before it still run; CONTEXT_DESTROY aborts queued work). With IN_ORDER the
ring keeps a finished chain until every chain made available before it has finished too.
A batch's used entry names its last chain; the chains it skips are "assumed to have been
used completely" (spec), so a chain that wrote less than its whole writable part always
ends its batch and gets its own entry with its real length.
"""
from __future__ import annotations

from collections import deque

from .ring import RingError


class UsedOrder:
    """The order chains were taken in, and the finished ones not yet given back."""

    def __init__(self) -> None:
        self._order: deque[int] = deque()     # chain ids (heads / buffer ids), taken order
        self._capacity: dict[int, int] = {}   # id -> writable bytes of the chain
        self._done: dict[int, int] = {}       # id -> bytes written, finished, held

    def taken(self, head: int, writable_len: int) -> None:
        """The device took chain `head` (writable part of `writable_len` bytes). Raises
        RingError (ring/in-flight) when that id is still in flight: before any buffer of
        the chain is touched."""
        if head in self._capacity:
            raise RingError("ring/in-flight", f"chain {head} made available again while in "
                            "flight")
        self._order.append(head)
        self._capacity[head] = writable_len

    def finish(self, head: int, length: int) -> list[tuple[list[int], int]]:
        """Chain `head` finished with `length` bytes written: the batches that may go back
        now, each (ids in order, bytes written by the last). Raises RingError for an id
        the device did not take (a device bug: the function stops)."""
        if head not in self._capacity or head in self._done:
            raise RingError("device/internal", f"used id {head} is not a chain in flight")
        self._done[head] = length
        batches: list[tuple[list[int], int]] = []
        batch: list[int] = []
        last = 0
        while self._order and self._order[0] in self._done:
            hid = self._order.popleft()
            last = self._done.pop(hid)
            full = last == self._capacity.pop(hid)
            batch.append(hid)
            if not full:
                batches.append((batch, last))
                batch = []
        if batch:
            batches.append((batch, last))
        return batches

    def __len__(self) -> int:
        return len(self._order)
