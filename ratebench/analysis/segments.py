"""Grouping events by a key without a Python loop over events.

Every analysis groups events (by user, by request, by phase and user) and then
works on each group's time-ordered slice. ``group_by`` does that with one
stable sort, so the slices keep the input order (time order, when the input is
time-sorted).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class Groups:
    """A stable grouping: ``order[starts[g]:ends[g]]`` are the indices of group ``g``."""

    order: np.ndarray  # int64 indices into the grouped arrays
    keys: np.ndarray  # the key of each group, ascending
    starts: np.ndarray  # int64
    ends: np.ndarray  # int64
    _codes: np.ndarray | None = None
    _input: np.ndarray | None = None

    def __len__(self) -> int:
        return len(self.keys)

    @property
    def sizes(self) -> np.ndarray:
        return self.ends - self.starts

    @property
    def codes(self) -> np.ndarray:
        """Group number of every input element (input order); computed on first use."""
        if self._codes is None:
            self._codes = np.searchsorted(self.keys, self._input) if len(self.keys) else np.empty(0, np.int64)
        return self._codes

    def slices(self):
        """(group number, key, slice into ``order``) for each group."""
        for g in range(len(self.keys)):
            yield g, self.keys[g], slice(int(self.starts[g]), int(self.ends[g]))


def dense_codes(keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Map integer keys to 0..G-1 in ascending key order: (codes, unique keys).

    Non-negative keys below 2**26 use a counting pass (O(n)); others use np.unique.
    """
    keys = np.asarray(keys)
    if keys.size == 0:
        return np.empty(0, dtype=np.int64), keys[:0]
    if keys.dtype.kind in "iu":
        lo, hi = int(keys.min()), int(keys.max())
        if lo >= 0 and hi < 2**26:
            present = np.bincount(keys, minlength=hi + 1) > 0
            remap = np.cumsum(present) - 1
            return remap[keys], np.flatnonzero(present).astype(keys.dtype)
    uniq, codes = np.unique(keys, return_inverse=True)
    return codes.reshape(-1), uniq


def group_by(keys: np.ndarray) -> Groups:
    """Group element indices by key, keeping input order inside each group."""
    keys = np.asarray(keys)
    if keys.size and keys.dtype.kind in "iu" and int(keys.min()) >= 0 and int(keys.max()) < 2**16:
        # small keys: a stable sort of uint16 is a radix sort in numpy, O(n); no renumbering
        sizes_all = np.bincount(keys)
        present = np.flatnonzero(sizes_all)
        order = np.argsort(keys.astype(np.uint16, copy=False), kind="stable")
        sizes = sizes_all[present]
        ends = np.cumsum(sizes)
        return Groups(order=order, keys=present.astype(keys.dtype), starts=ends - sizes, ends=ends, _input=keys)
    codes, uniq = dense_codes(keys)
    n_groups = len(uniq)
    sort_codes = codes.astype(np.uint16) if n_groups <= 2**16 else codes
    order = np.argsort(sort_codes, kind="stable")
    sizes = np.bincount(codes, minlength=n_groups) if n_groups else np.zeros(0, dtype=np.int64)
    ends = np.cumsum(sizes)
    starts = ends - sizes
    return Groups(order=order, keys=uniq, starts=starts, ends=ends, _codes=codes)


def time_order(t_ns: np.ndarray) -> np.ndarray | None:
    """None when ``t_ns`` is already non-decreasing, else a stable sorting order."""
    t_ns = np.asarray(t_ns)
    if t_ns.size < 2 or bool(np.all(t_ns[1:] >= t_ns[:-1])):
        return None
    return np.argsort(t_ns, kind="stable")


def diffs_within(t_sorted: np.ndarray, codes_sorted: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Differences between consecutive elements of the same group.

    Inputs are grouped (equal codes contiguous) and time-sorted inside each group.
    Returns (diffs, code of each diff).
    """
    if t_sorted.size < 2:
        return np.empty(0, dtype=np.int64), np.empty(0, dtype=codes_sorted.dtype)
    same = codes_sorted[1:] == codes_sorted[:-1]
    d = np.diff(t_sorted)[same]
    return d, codes_sorted[1:][same]
