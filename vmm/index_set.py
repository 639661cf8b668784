"""A set of small non-negative integers with rank and select in O(log n).

Why: the machine keeps the guest tasks known to be ready as such a set of task indices,
so that the seeded RNG's pick of "the k-th ready task in task order" costs O(log n) in
the number of tasks instead of a scan of every task (vmm.machine).
"""
from __future__ import annotations

from typing import Iterator


class IndexSet:
    """Members are ints in [0, capacity); the capacity grows on demand. A Fenwick tree
    of membership counts. `count`: how many members (read it, never set it), len()
    without a call for the machine's hot paths."""

    __slots__ = ("_tree", "_member", "_size", "count")

    def __init__(self, capacity: int = 64) -> None:
        size = 1
        while size < max(capacity, 1):
            size *= 2
        self._size = size
        self._tree = [0] * (size + 1)
        self._member = [False] * size
        self.count = 0

    def __len__(self) -> int:
        return self.count

    def __contains__(self, i: object) -> bool:
        return isinstance(i, int) and 0 <= i < self._size and self._member[i]

    def __iter__(self) -> Iterator[int]:
        return (i for i, m in enumerate(self._member) if m)

    def _grow(self, i: int) -> None:
        members = [j for j, m in enumerate(self._member) if m]
        size = self._size
        while size <= i:
            size *= 2
        self._size = size
        self._tree = [0] * (size + 1)
        self._member = [False] * size
        self.count = 0
        for j in members:
            self.add(j)

    def _update(self, i: int, delta: int) -> None:
        tree, size = self._tree, self._size
        i += 1
        while i <= size:
            tree[i] += delta
            i += i & -i

    def add(self, i: int) -> None:
        if i < 0:
            raise ValueError(f"IndexSet holds non-negative ints (got {i})")
        if i >= self._size:
            self._grow(i)
        if not self._member[i]:
            self._member[i] = True
            self.count += 1
            self._update(i, 1)

    def discard(self, i: int) -> None:
        if 0 <= i < self._size and self._member[i]:
            self._member[i] = False
            self.count -= 1
            self._update(i, -1)

    def rank(self, i: int) -> int:
        """How many members are < i."""
        tree = self._tree
        i = min(i, self._size)
        n = 0
        while i > 0:
            n += tree[i]
            i -= i & -i
        return n

    def select(self, k: int) -> int:
        """The k-th smallest member (0-based); IndexError when there are not k+1."""
        if not 0 <= k < self.count:
            raise IndexError(f"select({k}) of a set of {self.count}")
        tree = self._tree
        pos = 0
        step = self._size
        while step:
            nxt = pos + step
            if nxt <= self._size and tree[nxt] <= k:
                pos = nxt
                k -= tree[nxt]
            step //= 2
        return pos
