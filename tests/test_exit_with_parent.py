"""A gateway started by a tool with --exit-with-parent goes (with its local workers and their
shared memory) when that tool is killed: a benchmark stopped mid-run leaves nothing behind."""
from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from tests.helpers_procs import pid_alive, shm_entries, wait_until
from transport.service.launch import LISTENING

ROOT = Path(__file__).resolve().parents[1]

# the tool: starts a gateway with one local worker, says its pid and url, then waits to be killed
TOOL = """
import subprocess, sys, time
gw = subprocess.Popen([sys.executable, "-m", "gateway.cli", "--listen", sys.argv[1], "--local-workers", "1",
                       "--backend", "shm", "--n-experts", "2", "--top-k", "1", "--d-model", "16", "--d-ff", "32",
                       *sys.argv[2:]], stdout=subprocess.PIPE, text=True)
print(gw.pid, gw.stdout.readline().strip(), flush=True)
time.sleep(300)
"""


def _readline(proc: subprocess.Popen, timeout: float) -> str:
    ready, _, _ = select.select([proc.stdout], [], [], timeout)
    assert ready, "the tool said nothing"
    return proc.stdout.readline()


@pytest.mark.parametrize("flag", [True, False], ids=["exit-with-parent", "without"])
def test_a_gateway_goes_with_the_tool_that_started_it_only_when_asked(flag):
    name = f"moe-ewp-{os.getpid()}-{int(flag)}"
    before = shm_entries()
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    tool = subprocess.Popen([sys.executable, "-c", TOOL, f"shm://{name}", *(["--exit-with-parent"] if flag else [])],
                            stdout=subprocess.PIPE, text=True, cwd=ROOT, env=env)
    procs: list = []
    try:
        pid, said = _readline(tool, 60).split(" ", 1)
        assert said.startswith(LISTENING), said
        gw = psutil.Process(int(pid))
        procs = [gw, *gw.children(recursive=True)]
        assert len(procs) == 2  # the gateway and its worker
        tool.send_signal(signal.SIGKILL)
        tool.wait(10)
        gone = wait_until(lambda: not any(pid_alive(p.pid) for p in procs), timeout=20 if flag else 3)
        assert gone == flag
        if flag:  # drained and closed: no segment of its own left
            assert not [e for e in shm_entries() - before if name in e or f"moe-{gw.pid}" in e]
    finally:
        tool.kill()
        for p in procs:
            if pid_alive(p.pid):
                p.terminate()
        psutil.wait_procs([p for p in procs if p.is_running()], timeout=15)
