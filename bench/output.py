"""What every benchmark command writes besides its report: progress notes on stderr, the
plot (when matplotlib is there), and JSON without NaN."""
from __future__ import annotations

import sys
from typing import Any, Callable

import numpy as np


def note(msg: str) -> None:
    """Progress and diagnostics: stderr, never into the report on stdout."""
    print(msg, file=sys.stderr, flush=True)


def write_plot(draw: Callable[[], Any], path: str, anything: bool = True) -> bool:
    """Run ``draw`` (which writes ``path``); without matplotlib, say which extra brings it."""
    if not anything:
        note("no plot: nothing measured")
        return False
    try:
        draw()
    except ImportError as e:
        note(f"no plot: {e} (pip install 'moe-transport[bench]')")
        return False
    note(f"wrote {path}")
    return True


def nan_to_none(x: Any) -> Any:
    """JSON has no NaN: an empty histogram's percentiles become null."""
    if isinstance(x, float):
        return x if np.isfinite(x) else None
    if isinstance(x, dict):
        return {k: nan_to_none(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [nan_to_none(v) for v in x]
    if isinstance(x, np.generic):
        return nan_to_none(x.item())
    return x
