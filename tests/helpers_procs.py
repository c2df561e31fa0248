"""Start and stop real moe-worker / moe-gateway processes for the process-level tests.

Every service is started through a :class:`Services` owner, which stops them all (SIGTERM,
then SIGKILL) when it closes, so a fixture's teardown can never leak a process.
"""
from __future__ import annotations

import itertools
import os
import signal
import subprocess
import sys
import time
from typing import Optional, Sequence

import numpy as np

from transport.service.launch import blas_env, spawn_service, stop_process
from workers.flags import worker_argv

BACKENDS = ("tcp", "shm")
_names = itertools.count()


def secret() -> bytes:
    """The test session's shared secret (tests/conftest.py), for connections a test makes."""
    with open(os.environ["MOE_SECRET_FILE"], "rb") as f:
        return f.read().strip()


def listen_url(backend: str, tag: str = "s") -> str:
    """A fresh URL to listen on (port 0 for tcp; a name unique to this test run for shm)."""
    if backend == "tcp":
        return "tcp://127.0.0.1:0"
    if backend == "shm":
        return f"shm://moe-test-{os.getpid()}-{tag}{next(_names)}"
    if backend == "rdma":  # the rxe guest sets the address of its soft-RoCE device
        return f"rdma://{os.environ.get('MOE_RDMA_IP', '10.0.2.15')}:0"
    raise ValueError(f"no test URL for backend {backend!r}")


def backend_problem(backend: str) -> Optional[str]:
    """Why ``backend`` cannot run here, or None. Tests turn this into a FAILURE (not a
    skip): a backend that does not import yet is work left to do, not an absent feature."""
    try:
        __import__(f"transport.{backend}")
    except Exception as e:
        return f"transport.{backend} does not import: {type(e).__name__}: {e}"
    return None


class Service:
    def __init__(self, proc: subprocess.Popen, url: str, argv: Sequence[str]):
        self.proc, self.url, self.argv = proc, url, list(argv)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self, timeout: float = 10.0) -> Optional[int]:
        return stop_process(self.proc, timeout=timeout)

    def kill(self) -> None:
        if self.alive():
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=5)

    def children(self) -> list[int]:
        """Child pids (Linux /proc), e.g. a gateway's local workers."""
        try:
            with open(f"/proc/{self.pid}/task/{self.pid}/children") as f:
                return [int(p) for p in f.read().split()]
        except OSError:
            return []


class Services:
    """Owns every process a test or fixture starts; ``close()`` stops them all."""

    def __init__(self) -> None:
        self.services: list[Service] = []

    def start(self, argv: Sequence[str], timeout: float = 30.0) -> Service:
        proc, url = spawn_service(argv, timeout=timeout, env=blas_env(1))
        s = Service(proc, url, argv)
        self.services.append(s)
        return s

    def worker(self, backend: str, experts: Sequence[int], *, d_model: int, d_ff: int, seed: int = 0,
               max_tokens: int = 256, extra: Sequence[str] = ()) -> Service:
        return self.start(worker_argv(listen_url(backend, "w"), experts, d_model=d_model, d_ff=d_ff,
                                      seed=seed, max_tokens=max_tokens, extra=extra))

    def gateway(self, backend: str, *, workers: Optional[Sequence[str]] = None, timeout: float = 30.0,
                **flags) -> Service:
        """``flags`` are moe-gateway options with underscores (``top_k=2``, ``no_split=True``);
        ``timeout``: how long it may take to print LISTENING (with local workers, it starts
        them first)."""
        argv = [sys.executable, "-m", "gateway.cli", "--listen", listen_url(backend, "g")]
        if workers is not None:
            argv += ["--workers", ",".join(workers)]
        else:
            flags.setdefault("backend", backend)
        for k, v in flags.items():
            if v is None or v is False:
                continue
            opt = "--" + k.replace("_", "-")
            if v is True:
                argv.append(opt)
            elif isinstance(v, (list, tuple, np.ndarray)):
                argv.append(f"{opt}={','.join(repr(float(b)) for b in v)}")  # "=": values may start with "-"
            else:
                argv += [opt, str(v)]
        return self.start(argv, timeout=timeout)

    def close(self) -> None:
        # SIGTERM all first (they drain in parallel), then wait for each
        for s in self.services:
            if s.alive():
                try:
                    s.proc.send_signal(signal.SIGTERM)
                except ProcessLookupError:
                    pass
        for s in self.services:
            s.stop(timeout=10.0)
        self.services = []

    def __enter__(self) -> "Services":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def wait_until(pred, timeout: float = 10.0, interval: float = 0.02) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(interval)
    return pred()


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # a zombie (exited, not yet reaped) counts as gone
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ", 1)[1][0] != "Z"
    except OSError:
        return False


def shm_entries() -> set:
    try:
        return set(os.listdir("/dev/shm"))
    except OSError:
        return set()
