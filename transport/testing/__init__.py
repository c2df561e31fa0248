"""Testing helpers shipped with moe-transport.

- :mod:`transport.testing.conformance` -- the behavioural checks every backend must pass
  (``CHECKS``, ``PairEnv``, ``run_check``), in the style of trio's ``_check_streams``.
- :mod:`transport.testing.inproc` -- ``inproc://name``, both ends of a connection in one
  process: a test double with registered slots, credits, close semantics and a pollable
  fd (registered in transport.registry; it cannot reach another process).
- :mod:`transport.testing.raw` -- raw frames onto a connection's wire, for the kit's
  malformed-frame checks (no such hook on the public classes).
- :mod:`transport.testing.peer` -- a peer program run in a subprocess
  (``python -m transport.testing.peer URL --mode ...``) for the cross-process and
  peer-killed checks.
"""
from .conformance import CHECKS, NOT_APPLICABLE, PairEnv, check_ids, run_check

__all__ = ["CHECKS", "NOT_APPLICABLE", "PairEnv", "check_ids", "run_check"]
