"""Start a service as a child process, learn where it listens, and stop it for sure.

A service prints ``LISTENING <url>`` as its first stdout line (the bound URL: a port of 0
replaced), so a parent that asked for port 0 learns the port; logs go to stderr.
"""
from __future__ import annotations

import os
import select
import signal
import subprocess
import time
from typing import Optional, Sequence

#: the first stdout line of a service: "LISTENING <url>"
LISTENING = "LISTENING"
BLAS_ENV = ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS")


class ServiceError(RuntimeError):
    """A child service did not start (its stderr tail is in the message)."""


def blas_env(threads: int = 1, base: Optional[dict] = None) -> dict:
    env = dict(os.environ if base is None else base)
    for k in BLAS_ENV:
        env[k] = str(threads)
    return env


def spawn_service(argv: Sequence[str], *, timeout: float = 30.0, env: Optional[dict] = None,
                  stderr=None) -> tuple[subprocess.Popen, str]:
    """Start ``argv`` and wait (bounded) for its ``LISTENING <url>`` line.

    Returns (process, url). On failure the process is killed and ServiceError raised.
    ``stderr`` defaults to inheriting ours (so a service's logs show up beside ours).
    """
    proc = subprocess.Popen(list(argv), stdout=subprocess.PIPE, stderr=stderr, env=env,
                            stdin=subprocess.DEVNULL)
    try:
        url = _read_listening(proc, timeout)
    except BaseException:
        stop_process(proc, timeout=2.0)
        raise
    return proc, url


def _read_listening(proc: subprocess.Popen, timeout: float) -> str:
    deadline = time.monotonic() + timeout
    fd = proc.stdout.fileno()
    line = b""
    while not line.endswith(b"\n"):
        left = deadline - time.monotonic()
        if left <= 0:
            raise ServiceError(f"{proc.args!r} printed no {LISTENING} line within {timeout:.0f} s")
        r, _, _ = select.select([fd], [], [], left)
        if not r:
            continue
        chunk = os.read(fd, 1)  # one byte at a time: nothing beyond the line is consumed
        if not chunk:
            rc = proc.wait(timeout=5)
            raise ServiceError(f"{' '.join(map(str, proc.args))} exited with {rc} before listening")
        line += chunk
    text = line.decode().strip()
    word, _, url = text.partition(" ")
    if word != LISTENING or not url:
        raise ServiceError(f"expected '{LISTENING} <url>', got {text!r}")
    return url


def stop_process(proc: subprocess.Popen, timeout: float = 10.0) -> Optional[int]:
    """SIGTERM (graceful drain), then SIGKILL after ``timeout``; returns the exit code."""
    if proc.poll() is None:
        try:
            proc.send_signal(signal.SIGTERM)
        except ProcessLookupError:
            pass
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=5)
    if proc.stdout is not None:
        proc.stdout.close()
    return proc.returncode
