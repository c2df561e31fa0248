"""One look for every benchmark plot: a fixed colour per implementation (the same in every
figure and panel, so moe-transport is always the same blue) and a line style per medium."""
from __future__ import annotations

import zlib

COLOURS = {  # matplotlib's tab10, one each
    "moe-transport": "#1f77b4", "moe-transport-py": "#17becf", "raw": "#7f7f7f", "pyzmq": "#d62728",
    "pipe": "#2ca02c", "perftest": "#9467bd", "reference": "#8c564b", "multiprocessing": "#ff7f0e",
    "ray": "#e377c2", "moe-transport+chunks": "#bcbd22",
}
SPARE = ("#aec7e8", "#ffbb78", "#98df8a", "#ff9896", "#c5b0d5", "#c49c94", "#f7b6d2", "#dbdb8d")
LINESTYLES = {"shm": "-", "tcp": "--", "rdma": ":", "ipc": "-.", "pipe": "-", "inproc": "-"}


def colour(impl: str) -> str:
    """The implementation's colour; one not listed gets a spare colour fixed by its name."""
    if impl in COLOURS:
        return COLOURS[impl]
    base = impl.split("/")[0]
    return COLOURS.get(base, SPARE[zlib.crc32(impl.encode()) % len(SPARE)])


def linestyle(medium: str) -> str:
    return LINESTYLES.get(medium, "-")
