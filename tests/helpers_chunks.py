"""Helpers of the chunking tests."""
from __future__ import annotations


def groups_of(counts) -> list:
    """Expert groups (expert, first row, rows) of a part whose experts have ``counts`` rows."""
    groups, start = [], 0
    for e, n in enumerate(counts):
        groups.append((e, start, n))
        start += n
    return groups
