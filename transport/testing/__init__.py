"""Testing helpers shipped with moe-transport.

- :mod:`transport.testing.conformance` — the behavioural checks every backend must pass
  (``CHECKS``, ``PairEnv``, ``run_check``), in the style of trio's ``_check_streams``.
- :mod:`transport.testing.peer` — a peer program run in a subprocess
  (``python -m transport.testing.peer URL --mode ...``) for the cross-process and
  peer-killed checks.
"""
from .conformance import CHECKS, PairEnv, check_ids, run_check

__all__ = ["CHECKS", "PairEnv", "check_ids", "run_check"]
