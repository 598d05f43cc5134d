"""Range structures for the planner: range add and range min over slots (``MinTree``), prefix sums
(``Fenwick``). The hidden-set check and the budget fit keep per-copy slacks and per-point bytes in them."""

from __future__ import annotations

import math
from collections.abc import Sequence

__all__ = ["Fenwick", "MinTree"]


class MinTree:
    """Range add, range min over n slots; inactive slots hold +inf."""

    def __init__(self, n: int) -> None:
        self.n = max(1, n)
        self.low = [math.inf] * (4 * self.n)
        self.lazy = [0.0] * (4 * self.n)

    def _push(self, k: int) -> None:
        if self.lazy[k]:
            for c in (2 * k, 2 * k + 1):
                self.low[c] += self.lazy[k]
                self.lazy[c] += self.lazy[k]
            self.lazy[k] = 0.0

    def add(self, lo: int, hi: int, value: float, k: int = 1, l: int = 0, r: int | None = None) -> None:
        r = self.n - 1 if r is None else r
        if hi < l or r < lo or lo > hi:
            return
        if lo <= l and r <= hi:
            self.low[k] += value
            self.lazy[k] += value
            return
        self._push(k)
        m = (l + r) // 2
        self.add(lo, hi, value, 2 * k, l, m)
        self.add(lo, hi, value, 2 * k + 1, m + 1, r)
        self.low[k] = min(self.low[2 * k], self.low[2 * k + 1])

    @classmethod
    def of(cls, values: Sequence[float]) -> MinTree:
        """A tree holding ``values``, built bottom-up in O(n)."""
        tree = cls(len(values))
        if values:
            tree._build(values, 1, 0, tree.n - 1)
        return tree

    def _build(self, values: Sequence[float], k: int, l: int, r: int) -> None:
        if l == r:
            self.low[k] = values[l]
            return
        m = (l + r) // 2
        self._build(values, 2 * k, l, m)
        self._build(values, 2 * k + 1, m + 1, r)
        self.low[k] = min(self.low[2 * k], self.low[2 * k + 1])

    def set(self, i: int, value: float, k: int = 1, l: int = 0, r: int | None = None) -> None:
        r = self.n - 1 if r is None else r
        if l == r:
            self.low[k] = value
            return
        self._push(k)
        m = (l + r) // 2
        if i <= m:
            self.set(i, value, 2 * k, l, m)
        else:
            self.set(i, value, 2 * k + 1, m + 1, r)
        self.low[k] = min(self.low[2 * k], self.low[2 * k + 1])

    def min(self, lo: int, hi: int, k: int = 1, l: int = 0, r: int | None = None) -> float:
        r = self.n - 1 if r is None else r
        if hi < l or r < lo or lo > hi:
            return math.inf
        if lo <= l and r <= hi:
            return self.low[k]
        self._push(k)
        m = (l + r) // 2
        return min(self.min(lo, hi, 2 * k, l, m), self.min(lo, hi, 2 * k + 1, m + 1, r))

    def argmin(self) -> int:
        """Index of the smallest value (ties go to the lowest index)."""
        k, lo, hi = 1, 0, self.n - 1
        while lo != hi:
            self._push(k)
            mid = (lo + hi) // 2
            if self.low[2 * k] <= self.low[2 * k + 1]:
                k, hi = 2 * k, mid
            else:
                k, lo = 2 * k + 1, mid + 1
        return lo


class Fenwick:
    """Prefix sums with point updates."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.tree = [0.0] * (n + 1)
        self.total = 0.0

    def add(self, i: int, value: float) -> None:
        self.total += value
        i += 1
        while i <= self.n:
            self.tree[i] += value
            i += i & -i

    def sum_to(self, i: int) -> float:  # sum over [0, i]
        s, i = 0.0, i + 1
        while i > 0:
            s += self.tree[i]
            i -= i & -i
        return s

    def sum_from(self, i: int) -> float:  # sum over [i, n)
        return self.total - (self.sum_to(i - 1) if i > 0 else 0.0)
