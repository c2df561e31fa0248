"""Local workers: moe-worker child processes a gateway starts, supervises and stops.

A local worker that dies is reaped at once (no zombie) and started again with a growing
back-off (with jitter); the respawn runs in a thread (starting Python takes a while) and its new URL is
handed to the serve loop, where the pool reconnects to it. Workers exit with the gateway
(--exit-with-parent), and are stopped for sure when it closes.
"""
from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading
import time
from typing import Callable, Optional, Sequence

from transport.service.backoff import Backoff
from transport.service.launch import ServiceError, blas_env, spawn_service, stop_process

log = logging.getLogger("moe.supervisor")

RESPAWN_BACKOFF = (0.2, 5.0)  # first and longest wait before starting a dead worker again
STABLE_AFTER = 30.0  # a worker that lived this long resets its back-off


def placement(n_experts: int, n_workers: int, replicas: int = 1, n_shared: int = 0) -> list[list[int]]:
    """Contiguous blocks of experts per worker; with replicas > 1, worker i also hosts
    the blocks of workers i-1, ..., i-replicas+1 (so each expert lives on that many).

    Shared-expert pieces (ids n_experts .. n_experts + n_shared - 1, a checkpoint's) get
    every token, so each is as hot as top_k routed experts together: with replicas > 1
    each lives on EVERY worker (the gateway then splits its rows over all of them by
    load); with replicas == 1 piece j lives on worker j mod n_workers (one copy each, as
    asked, spread so no worker holds two before each holds one)."""
    if not 1 <= n_workers:
        raise ValueError("need at least one worker")
    replicas = max(1, min(replicas, n_workers))
    blocks = [[e for e in range(n_experts) if e * n_workers // n_experts == w] for w in range(n_workers)]
    out = [sorted({e for r in range(replicas) for e in blocks[(w - r) % n_workers]}) for w in range(n_workers)]
    for j in range(n_shared):
        for w in (range(n_workers) if replicas > 1 else [j % n_workers]):
            out[w].append(n_experts + j)
    return out


def worker_command(listen: str, experts: Sequence[int], *, d_model: int, d_ff: int, seed: int, dtype: str,
                   max_tokens: int, extra: Sequence[str] = ()) -> list[str]:
    """The moe-worker command line (the process interface, not an import of workers/)."""
    return [sys.executable, "-m", "workers.cli", "--listen", listen, "--experts", ",".join(map(str, experts)),
            "--d-model", str(d_model), "--d-ff", str(d_ff), "--seed", str(seed), "--dtype", dtype,
            "--max-tokens", str(max_tokens), "--exit-with-parent", *extra]


class LocalWorkers:
    """``commands[i]`` starts worker i; ``urls[i]`` is where it listens now."""

    def __init__(self, commands: Sequence[Sequence[str]], *, threads: int = 1, start_timeout: float = 60.0) -> None:
        self.commands = [list(c) for c in commands]
        self.env = blas_env(threads)
        self.start_timeout = start_timeout
        self.procs: list[Optional[subprocess.Popen]] = [None] * len(self.commands)
        self.urls: list[str] = [""] * len(self.commands)
        self.restarts = [0] * len(self.commands)
        self._started = [0.0] * len(self.commands)
        self._backoff = [Backoff(*RESPAWN_BACKOFF) for _ in self.commands]
        self._next = [0.0] * len(self.commands)
        self._spawning: set = set()
        self._closed = False
        self.post: Optional[Callable[[Callable[[], None]], None]] = None
        self.on_moved: Optional[Callable[[int, str], None]] = None  # (index, new url)
        try:
            for i in range(len(self.commands)):  # at start: blocking, in order
                self.procs[i], self.urls[i] = self._spawn(i)
        except BaseException:
            self.close()
            raise

    def _spawn(self, i: int):
        proc, url = spawn_service(self.commands[i], timeout=self.start_timeout, env=self.env)
        self._started[i] = time.monotonic()
        return proc, url

    def tick(self, now: float) -> Optional[float]:
        """Reap the dead and start them again (in a thread); when to look next."""
        nxt = now + 0.25
        for i, proc in enumerate(self.procs):
            if proc is not None and proc.poll() is not None:  # poll() reaps it: no zombie stays
                rc = proc.returncode
                if proc.stdout is not None:
                    proc.stdout.close()
                self.procs[i] = None
                lived = now - self._started[i]
                if lived > STABLE_AFTER:
                    self._backoff[i].reset()
                pause = self._backoff[i].next()
                self._next[i] = now + pause
                log.warning("local worker %d (pid %d) exited with %s after %.1f s: restarting in %.1f s",
                            i, proc.pid, rc, lived, pause)
            if self.procs[i] is None and i not in self._spawning and not self._closed:
                if now >= self._next[i]:
                    self._respawn(i)
                else:
                    nxt = min(nxt, self._next[i])
        return nxt

    def _respawn(self, i: int) -> None:
        self._spawning.add(i)

        def run() -> None:
            try:
                got = self._spawn(i)
            except (ServiceError, OSError) as e:
                got = e
            if self.post is not None:
                self.post(lambda: self._respawned(i, got))
            elif not isinstance(got, Exception):
                stop_process(got[0], timeout=5.0)

        threading.Thread(target=run, daemon=True, name=f"respawn-{i}").start()

    def _respawned(self, i: int, got) -> None:
        self._spawning.discard(i)
        if isinstance(got, Exception):
            pause = self._backoff[i].next()
            self._next[i] = time.monotonic() + pause
            log.warning("local worker %d did not start: %s; retrying in %.1f s", i, got, pause)
            return
        proc, url = got
        if self._closed:
            stop_process(proc, timeout=5.0)
            return
        self.procs[i] = proc
        self.restarts[i] += 1
        log.warning("local worker %d restarted (pid %d) at %s", i, proc.pid, url)
        self.urls[i] = url
        if self.on_moved is not None:
            self.on_moved(i, url)

    def pids(self) -> list[Optional[int]]:
        return [p.pid if p is not None else None for p in self.procs]

    def close(self) -> None:
        self._closed = True
        for i, proc in enumerate(self.procs):
            if proc is None:
                continue
            rc = stop_process(proc, timeout=10.0)
            if rc not in (0, None):
                log.warning("local worker %d exited with %s", proc.pid, rc)
            self.procs[i] = None


def local_listen_url(backend: str, i: int, rdma_ip: str = "127.0.0.1") -> str:
    if backend == "shm":
        return f"shm://moe-{os.getpid()}-w{i}"
    if backend == "rdma":
        return f"rdma://{rdma_ip}:0"
    return "tcp://127.0.0.1:0"
