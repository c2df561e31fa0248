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


class LocalWorkers:
    """A fleet (gateway/placement.py) of moe-worker child processes: ``commands[i]`` starts
    worker i, ``urls[i]`` is where it listens now. ``make_command(i)``: the command of a
    worker added later (``workers scale``)."""

    def __init__(self, commands: Sequence[Sequence[str]], *, threads: int = 1, start_timeout: float = 60.0,
                 make_command: Optional[Callable[[int], list]] = None) -> None:
        self.commands = [list(c) for c in commands]
        self.make_command = make_command
        self.env = blas_env(threads)
        self.start_timeout = start_timeout
        self.procs: list[Optional[subprocess.Popen]] = [None] * len(self.commands)
        self.urls: list[str] = [""] * len(self.commands)
        self.link = list(range(len(self.commands)))  # worker i is the pool's worker link[i]
        self.restarts = [0] * len(self.commands)
        self._started = [0.0] * len(self.commands)
        self._backoff = [Backoff(*RESPAWN_BACKOFF) for _ in self.commands]
        self._next = [0.0] * len(self.commands)
        self._spawning: set = set()
        self._retired: set = set()  # workers stopped on purpose: not respawned
        self._closed = False
        self.post: Optional[Callable[[Callable[[], None]], None]] = None
        self.on_moved: Optional[Callable[[int, str], None]] = None  # (the pool's index, new url)
        try:
            for i in range(len(self.commands)):  # at start: blocking, in order
                self.procs[i], self.urls[i] = self._spawn(i)
        except BaseException:
            self.close()
            raise

    def attach(self, pool) -> None:
        """Hand a respawned worker's new URL to ``pool``, on its loop (which ticks this)."""
        self.post = pool.loop.call_soon_threadsafe
        self.on_moved = pool.workers.set_url
        pool.loop.add_tick(self.tick)

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
            if self.procs[i] is None and i not in self._spawning and i not in self._retired and not self._closed:
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
        if self._closed or i in self._retired:
            stop_process(proc, timeout=5.0)
            return
        self.procs[i] = proc
        self.restarts[i] += 1
        log.warning("local worker %d restarted (pid %d) at %s", i, proc.pid, url)
        self.urls[i] = url
        if self.on_moved is not None:
            self.on_moved(self.link[i], url)

    # -- workers scale ---------------------------------------------------------------------------
    def start(self, n: int, done: Callable[[list], Optional[list]]) -> None:
        """Start ``n`` more workers in a thread; ``done(urls)`` on the pool's loop returns the
        pool's indices for them (an empty list of URLs: they could not start)."""
        if self.make_command is None:
            raise RuntimeError("these local workers cannot be scaled")
        first = len(self.commands)
        for i in range(first, first + n):
            self.commands.append(self.make_command(i))
            self.procs.append(None)
            self.urls.append("")
            self.link.append(-1)
            self.restarts.append(0)
            self._started.append(0.0)
            self._backoff.append(Backoff(*RESPAWN_BACKOFF))
            self._next.append(float("inf"))  # not respawned by tick() before it first started
            self._spawning.add(i)

        def run() -> None:
            got = []
            for i in range(first, first + n):
                try:
                    got.append(self._spawn(i))
                except (ServiceError, OSError) as e:
                    log.warning("local worker %d did not start: %s", i, e)
                    got.append(None)
            self.post(lambda: self._started_new(first, got, done))

        threading.Thread(target=run, daemon=True, name="scale-up").start()

    def _started_new(self, first: int, got: list, done: Callable[[list], Optional[list]]) -> None:
        urls, positions = [], []
        for k, g in enumerate(got):
            i = first + k
            self._spawning.discard(i)
            if g is None or self._closed:
                self._retired.add(i)
                if g is not None:
                    stop_process(g[0], timeout=5.0)
                continue
            self.procs[i], self.urls[i] = g
            self._next[i] = 0.0
            urls.append(self.urls[i])
            positions.append(i)
        for i, index in zip(positions, done(urls) or []):
            self.link[i] = index

    def stop(self, index: int) -> None:
        """Stop the worker that is the pool's worker ``index`` (drained and removed), in a thread."""
        if index not in self.link:
            return
        i = self.link.index(index)
        self._retired.add(i)
        proc, self.procs[i] = self.procs[i], None
        if proc is not None:
            threading.Thread(target=stop_process, args=(proc,), kwargs={"timeout": 10.0}, daemon=True,
                             name=f"stop-{i}").start()

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


def local_workers(args, secret_path: Optional[str], layers: Optional[dict], flags: Callable[[int, list], list]
                  ) -> LocalWorkers:
    """The local fleet ``--local-workers N`` asks for: contiguous expert blocks (with
    ``--replicas`` copies), pinned by ``--worker-cpus``, with the gateway's secret file (or
    ``--insecure`` as it has it); a worker added later starts with the block its number
    would have had."""
    from gateway.config import served_ids

    n_experts, n_shared, _ = served_ids(args, layers)
    blocks = placement(n_experts, args.local_workers, args.replicas, n_shared)
    cpus = args.worker_cpus or []

    def command(i: int) -> list:
        extra = []
        if cpus:
            extra += ["--cpus", str(cpus[i % len(cpus)])]
        if secret_path:
            extra += ["--secret-file", secret_path]
        if args.insecure:  # as the gateway: no secret but the one named, never the per-user default
            extra += ["--insecure"]
        return [sys.executable, "-m", "workers.cli", "--listen", local_listen_url(args.backend, i, args.rdma_ip),
                "--exit-with-parent", *flags(i, blocks[i % len(blocks)]), *extra]

    return LocalWorkers([command(i) for i in range(len(blocks))], threads=args.worker_blas_threads,
                        make_command=command)


def local_listen_url(backend: str, i: int, rdma_ip: str = "127.0.0.1") -> str:
    if backend == "shm":
        return f"shm://moe-{os.getpid()}-w{i}"
    if backend == "rdma":
        return f"rdma://{rdma_ip}:0"
    return "tcp://127.0.0.1:0"
