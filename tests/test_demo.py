"""``make run``'s demo as a process: its gateway takes --chunk-rows, and the report says how
many messages a round went in (the README's run is checked by tests/test_readme.py)."""
from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _demo(*flags: str) -> str:
    p = subprocess.run([sys.executable, "-m", "gateway.demo", "--duration", "1", "--concurrency", "1", *flags],
                       cwd=ROOT, capture_output=True, text=True, timeout=180)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    assert "OK" in p.stdout and "/dev/shm left behind: nothing" in p.stdout, p.stdout
    return p.stdout


@pytest.mark.parametrize("chunk_rows", ["off", "32"])
def test_demo_passes_chunk_rows_to_its_gateway(chunk_rows):
    out = _demo("--chunk-rows", chunk_rows)
    m = re.search(r"\(([\d.]+) requests/round, ([\d.]+) messages/round\)", out)
    assert m, out
    per_round = float(m.group(2))
    # two local workers: whole parts are at most two messages a round; 32-row chunks of
    # 64-256-token requests routed top-2 are more
    if chunk_rows == "off":
        assert 1.0 <= per_round <= 2.0, out
    else:
        assert per_round > 3.0, out
