"""The environment a conformance check runs in: fresh endpoints of one backend, peer
processes, capabilities, and cleanup that finds leaks."""
from __future__ import annotations

import functools
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any, Callable, Optional

import transport

#: what a backend may be unable to do; a check that needs a capability the environment
#: lacks is reported as not applicable by the kit (it returns NOT_APPLICABLE), never run
CAPABILITIES = {
    "cross_process": "its two ends can live in two processes (the kit spawns peer processes)",
}


class _NotApplicable:
    def __repr__(self) -> str:
        return "NOT_APPLICABLE"


#: what a check returns when the environment lacks a capability it requires
NOT_APPLICABLE = _NotApplicable()


def requires(*capabilities: str) -> Callable:
    """Decorate a check that needs ``capabilities`` (keys of :data:`CAPABILITIES`): on an
    env without one of them it records why and returns :data:`NOT_APPLICABLE`."""
    unknown = set(capabilities) - set(CAPABILITIES)
    if unknown:
        raise ValueError(f"unknown capabilities {sorted(unknown)}")

    def wrap(check: Callable) -> Callable:
        @functools.wraps(check)
        def run(env: "PairEnv"):
            missing = [c for c in capabilities if not env.capabilities[c]]
            if missing:
                env.not_applicable.append((check.__name__, missing))
                return NOT_APPLICABLE
            return check(env)
        run.requires = frozenset(capabilities)
        return run
    return wrap


DEFAULT_OPTIONS = {"slot_size": 2 << 20, "nslots": 8, "timeout": 10.0}


class PairEnv:
    """Everything a check may use: fresh URLs, endpoints, peer processes, cleanup.

    ``url_factory()``
        returns a fresh URL to listen on (``tcp://127.0.0.1:0``, ``shm://moe-test-<uuid>``,
        ``rdma://10.0.2.15:0``); called once per listener.
    ``options``
        connection options passed to every ``listen``/``connect`` (merged over
        :data:`DEFAULT_OPTIONS`); a check may override some per call.
    ``shares_sender_memory``
        True when a received buffer *is* the sender's slot (shm, in-process pairs too).
    ``leak_dirs``
        directories (``/dev/shm``) where an entry that appeared during the check and is
        still there after cleanup is a leak: the check fails.
    ``slack``
        seconds added to every time bound.
    ``peer_python``, ``peer_env``
        the interpreter and extra environment for :mod:`transport.testing.peer`.
    ``capabilities``
        what the backend cannot do, e.g. ``{"cross_process": False}`` (every capability of
        :data:`CAPABILITIES` defaults to True); checks that need it are not applicable.
    """

    def __init__(self, url_factory: Callable[[], str], *, name: Optional[str] = None,
                 options: Optional[dict] = None, shares_sender_memory: bool = False,
                 leak_dirs: tuple = (), slack: float = 0.5,
                 peer_python: Optional[str] = None, peer_env: Optional[dict] = None,
                 capabilities: Optional[dict] = None):
        unknown = set(capabilities or ()) - set(CAPABILITIES)
        if unknown:
            raise ValueError(f"unknown capabilities {sorted(unknown)}; known: {sorted(CAPABILITIES)}")
        self.capabilities = {c: True for c in CAPABILITIES}
        self.capabilities.update(capabilities or {})
        #: (check name, missing capabilities) of every check that was not applicable here
        self.not_applicable: list[tuple[str, list]] = []
        self.url_factory = url_factory
        self.name = name or url_factory().split("://", 1)[0]
        self.options = {**DEFAULT_OPTIONS, **(options or {})}
        self.shares_sender_memory = shares_sender_memory
        self.leak_dirs = tuple(leak_dirs)
        self.slack = slack
        self.peer_python = peer_python or sys.executable
        self.peer_env = dict(peer_env or {})
        self._cleanups: list[Callable[[], None]] = []
        self._before = {d: _listdir(d) for d in self.leak_dirs}
        self._closed = False

    # -- endpoints ------------------------------------------------------------------
    def listen_url(self) -> str:
        """A fresh URL for this backend."""
        return self.url_factory()

    def conn_options(self, **overrides: Any) -> dict:
        return {**self.options, **overrides}

    def listen(self, url: Optional[str] = None, **options: Any):
        """A listener on a fresh URL (closed at cleanup)."""
        lst = transport.listen(url or self.listen_url(), **self.conn_options(**options))
        self.defer(lst.close)
        return lst

    def connect(self, url: str, **options: Any):
        """A client connection to ``url`` (closed at cleanup). Needs someone accepting."""
        conn = transport.connect(url, **self.conn_options(**options))
        self.defer(conn.close)
        return conn

    def accept_pair(self, listener, **options: Any):
        """Connect a new client to ``listener`` from a thread and accept it here:
        returns ``(client, server)``."""
        timeout = self.options["timeout"] + self.slack
        box = Worker(lambda: self.connect(listener.url, **options), name="connect")
        try:
            server = listener.accept(timeout=timeout)
        except BaseException:
            box.join(timeout, swallow=True)
            raise
        self.defer(server.close)
        client = box.join(timeout)
        return client, server

    def pair(self, **options: Any):
        """``(client, server)``: a fresh listener, one client connected to it, accepted.
        ``options`` go to both ends."""
        return self.accept_pair(self.listen(**options), **options)

    # -- peer processes -------------------------------------------------------------
    def spawn_peer(self, url: str, mode: str, **args: Any) -> "PeerProcess":
        """Start ``python -m transport.testing.peer URL --mode MODE`` connecting to ``url``;
        ``args`` become ``--key value`` (``options`` defaults to this env's options)."""
        argv = [self.peer_python, "-m", "transport.testing.peer", url, "--mode", mode,
                "--options", json.dumps(args.pop("options", self.options))]
        for k, v in args.items():
            argv += [f"--{k.replace('_', '-')}", str(v)]
        peer = PeerProcess(argv, {**os.environ, **self.peer_env})
        self.defer(peer.kill)
        return peer

    # -- cleanup --------------------------------------------------------------------
    def defer(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` at cleanup (last registered, first run)."""
        self._cleanups.append(fn)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        errors = []
        while self._cleanups:
            fn = self._cleanups.pop()
            try:
                fn()
            except Exception as e:  # cleanup must not hide the check's own failure
                errors.append(f"{fn!r}: {e!r}")
        leaked = self.leaks(wait=2.0 + self.slack)
        if leaked:
            raise AssertionError(f"left behind after the check: {leaked}")
        if errors:
            raise AssertionError(f"cleanup failed: {errors}")

    def leaks(self, wait: float = 0.0) -> list[str]:
        """Entries of ``leak_dirs`` that appeared since this env started (polls up to
        ``wait`` seconds for them to go)."""
        end = time.monotonic() + wait
        while True:
            new = [os.path.join(d, n) for d in self.leak_dirs
                   for n in sorted(_listdir(d) - self._before[d])]
            if not new or time.monotonic() >= end:
                return new
            time.sleep(0.05)

    def __enter__(self) -> "PairEnv":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:
            try:
                self.close()
            except AssertionError:
                pass  # the check's failure is the one to report

    def __repr__(self) -> str:
        return f"<PairEnv {self.name} {self.options}>"


def run_check(check: Callable[[PairEnv], None], url_factory: Callable[[], str], *,
              name: Optional[str] = None, shares_sender_memory: bool = False,
              leak_dirs: tuple = (), slack: float = 0.5, peer_python: Optional[str] = None,
              peer_env: Optional[dict] = None, capabilities: Optional[dict] = None,
              **conn_options: Any):
    """Run one check in a fresh :class:`PairEnv` (``conn_options`` go to listen/connect);
    returns what the check returned (None, or NOT_APPLICABLE)."""
    with PairEnv(url_factory, name=name, options=conn_options,
                 shares_sender_memory=shares_sender_memory, leak_dirs=leak_dirs, slack=slack,
                 peer_python=peer_python, peer_env=peer_env, capabilities=capabilities) as env:
        return check(env)


def _listdir(d: str) -> set:
    try:
        return set(os.listdir(d))
    except FileNotFoundError:
        return set()


class Worker:
    """Run ``fn`` in a daemon thread; ``join`` returns its result or re-raises its error,
    and fails (instead of hanging) if it is still running after ``timeout``."""

    def __init__(self, fn: Callable[[], Any], name: str = "worker"):
        self._result: Any = None
        self._error: Optional[BaseException] = None
        self._thread = threading.Thread(target=self._run, args=(fn,), name=name, daemon=True)
        self._thread.start()

    def _run(self, fn) -> None:
        try:
            self._result = fn()
        except BaseException as e:
            self._error = e

    def join(self, timeout: float, swallow: bool = False) -> Any:
        self._thread.join(timeout)
        if self._thread.is_alive():
            if swallow:
                return None
            raise AssertionError(f"thread {self._thread.name} still running after {timeout:.1f} s")
        if self._error is not None and not swallow:
            raise self._error
        return self._result


class PeerProcess:
    """A :mod:`transport.testing.peer` subprocess; its stderr is kept for diagnostics."""

    def __init__(self, argv: list, env: dict):
        self._err = tempfile.TemporaryFile()
        self.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                     stderr=self._err, env=env)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def wait_line(self, expect: str, timeout: float) -> str:
        """The next stdout line, which must start with ``expect`` (e.g. "ready")."""
        box: dict = {}
        t = threading.Thread(target=lambda: box.setdefault("line", self.proc.stdout.readline()),
                             daemon=True)
        t.start()
        t.join(timeout)
        line = box.get("line", b"").decode(errors="replace").strip()
        if not line.startswith(expect):
            raise AssertionError(f"peer said {line!r}, expected {expect!r}; stderr: {self.stderr()}")
        return line

    def stderr(self) -> str:
        self._err.seek(0)
        return self._err.read().decode(errors="replace")[-4000:]

    def kill(self, sig: int = signal.SIGKILL) -> None:
        # send_signal, not os.kill: a check's thread may be reaping the peer at this moment
        # (poll() then says "running" without looking), and a reaped pid is gone (ESRCH)
        self.proc.send_signal(sig)
        try:
            self.proc.wait(10)
        finally:
            if self.proc.stdout:
                self.proc.stdout.close()

    def wait(self, timeout: float) -> int:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"peer still running after {timeout:.1f} s; stderr: {self.stderr()}")
