"""`moe-bench chaos`'s hostile background: idle, half-open, non-reading and garbage
connections to the gateway, in this process (:class:`Hostile`) or in one of its own
(:class:`Crowd`, ``python -m bench.chaos_hostile URL BACKEND COUNTS``)."""
from __future__ import annotations

import collections
import itertools
import os
import random
import resource
import select
import socket
import subprocess
import sys
import threading
import time
from typing import Optional

import numpy as np

from bench.chaos_settings import D_MODEL


# -- hostile background --------------------------------------------------------------------------
def _raw(url: str) -> socket.socket:
    scheme, _, rest = url.partition("://")
    if scheme == "tcp":
        host, _, port = rest.rpartition(":")
        s = socket.create_connection((host, int(port)), timeout=5)
    else:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(5)
        s.connect("\0moe-transport/shm/" + rest)
    s.setblocking(False)
    return s


def _closed(s: socket.socket) -> bool:
    try:
        return s.recv(65536) == b""
    except (BlockingIOError, InterruptedError):
        return False
    except OSError:
        return True


class Hostile:
    """Keeps ``counts`` hostile connections open to ``url`` (idle, half-open, non-readers,
    garbage), opening a new one whenever the server drops one."""

    KINDS = ("idle", "half", "nonreader", "garbage")

    def __init__(self, url: str, backend: str, secret: Optional[bytes], counts: dict) -> None:
        self.url, self.backend, self.secret = url, backend, secret
        self.counts = {k: int(counts.get(k, 0)) for k in self.KINDS}
        self.conns: dict = {k: [] for k in self.KINDS}
        self.reconnects = collections.Counter()
        self.failures = collections.Counter()
        self.stop = threading.Event()
        self.thread: Optional[threading.Thread] = None
        from transport import framing

        self._hello = b"".join(framing.encode_hello({
            "transport": "moe-transport", "version": framing.VERSION, "backend": backend, "role": "client",
            "nonce": os.urandom(32), "auth": None, "slot_size": 4096, "nslots": 2}))
        self._rng = random.Random(7)

    def _open(self, kind: str):
        import transport

        if kind == "idle":
            return transport.connect(self.url, slot_size=4096, nslots=2, timeout=5, secret=self.secret)
        if kind == "nonreader":
            c = transport.connect(self.url, slot_size=4096, nslots=2, timeout=5, secret=self.secret)
            c._chaos_ids = itertools.count(1)
            return c
        s = _raw(self.url)
        if kind == "half":
            s.send(self._hello[: self._rng.randrange(1, len(self._hello) - 1)])
        else:
            s.send(self._rng.randbytes(self._rng.randrange(16, 2048)))
        return s

    def _gone(self, kind: str, c) -> bool:
        import transport
        from workers import protocol as P

        if kind in ("half", "garbage"):
            return _closed(c)
        if kind == "idle":  # called when its fd polled readable
            try:
                c.recv(timeout=0).release()
                return False
            except transport.Timeout:
                return False
            except transport.TransportError:
                return True
        # non-reader: one more request each pass, never a read; dropped = its socket says
        # so (peeked, nothing consumed), since a dropped connection is simply never send_ready
        sock = getattr(c, "sock", None) or getattr(c, "_sock", None)
        if sock is not None:
            try:
                if sock.family != socket.AF_UNIX:  # unread replies hide a reset from recv: ask TCP
                    if sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 1)[0] in (7, 8):  # CLOSE(_WAIT)
                        return True
                elif sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b"":
                    return True
            except (BlockingIOError, InterruptedError):
                pass
            except OSError:
                return True
        try:
            if c.send_ready():
                slot = c.alloc(8 * D_MODEL * 4, timeout=0)
                slot.array(np.float32, (8, D_MODEL))[:] = 1.0
                c.send(P.forward_request(next(c._chaos_ids), (8, D_MODEL), np.float32), [slot], timeout=0.1)
            return False
        except transport.Timeout:
            return False
        except transport.TransportError:
            return True

    @staticmethod
    def _close(c) -> None:
        try:
            if hasattr(c, "abort"):
                c.abort()
            else:
                c.close()
        except Exception:
            pass

    def fill(self) -> None:
        """One pass: replace the dropped (one poll over every connection, so a thousand idle
        ones cost one system call), open the missing."""
        p = select.poll()
        for kind in ("idle", "half", "garbage"):
            for c in self.conns[kind]:
                p.register(c.fileno(), select.POLLIN)
        ready = {fd for fd, _ in p.poll(0)}
        for kind in self.KINDS:
            keep = []
            for c in self.conns[kind]:
                if (kind == "nonreader" or c.fileno() in ready) and self._gone(kind, c):
                    self._close(c)
                    self.reconnects[kind] += 1
                else:
                    keep.append(c)
            self.conns[kind] = keep
            while len(self.conns[kind]) < self.counts[kind] and not self.stop.is_set():
                try:
                    self.conns[kind].append(self._open(kind))
                except Exception as e:  # refused at the cap, or the server busy: try later
                    self.failures[f"{kind}: {type(e).__name__}"] += 1
                    break

    def start(self) -> "Hostile":
        def run():
            while not self.stop.is_set():
                self.fill()
                self.stop.wait(0.5)
        self.stop.clear()
        self.thread = threading.Thread(target=run, daemon=True, name="hostile")
        self.thread.start()
        return self

    def close(self) -> None:
        self.stop.set()
        if self.thread is not None:
            self.thread.join(30)
        for kind in self.KINDS:
            for c in self.conns[kind]:
                self._close(c)
            self.conns[kind] = []

    def open_count(self) -> dict:
        return {k: len(v) for k, v in self.conns.items()}


class Crowd:
    """A :class:`Hostile` in its own process (``python -m bench.chaos_hostile``), so its
    Python work never competes with the measuring client for this process's GIL."""

    def __init__(self, url: str, backend: str, secret_file: str, counts: dict, ready_timeout: float = 180.0) -> None:
        import json

        self.counts = counts
        self.proc = subprocess.Popen([sys.executable, "-m", "bench.chaos_hostile", url, backend, json.dumps(counts)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                     env={**os.environ, "MOE_SECRET_FILE": secret_file})
        r, _, _ = select.select([self.proc.stdout], [], [], ready_timeout)
        line = self.proc.stdout.readline() if r else ""
        if not line.startswith("READY "):
            self.proc.kill()
            self.proc.wait()
            raise RuntimeError(f"hostile crowd did not open: {line!r}")
        self.ready = json.loads(line[6:])
        self.result: dict = {}

    def close(self) -> dict:
        import json

        if self.proc.poll() is None:
            try:
                self.proc.stdin.close()
                line = self.proc.stdout.readline()
                self.result = json.loads(line[5:]) if line.startswith("DONE ") else {}
                self.proc.wait(timeout=60)
            except Exception:
                self.proc.kill()
                self.proc.wait()
        return self.result


def crowd_main(url: str, backend: str, counts_json: str) -> int:
    """The crowd process: open the connections, say READY, keep them until stdin closes."""
    import json

    from transport.service.secrets import resolve

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    secret = resolve(None, use_default=False)[0]
    h = Hostile(url, backend, secret, json.loads(counts_json))
    t = time.monotonic()
    want = sum(h.counts.values())
    while sum(h.open_count().values()) < want and time.monotonic() - t < 120:
        h.fill()
    print("READY " + json.dumps({"open": h.open_count(), "seconds": time.monotonic() - t}), flush=True)
    h.start()
    sys.stdin.read()  # until the parent closes it
    held = h.open_count()
    h.close()
    print("DONE " + json.dumps({"held": held, "reconnects": dict(h.reconnects), "failures": dict(h.failures)}),
          flush=True)
    return 0


if __name__ == "__main__":
    if len(sys.argv) == 4:
        sys.exit(crowd_main(*sys.argv[1:]))
    sys.exit("usage: python -m bench.chaos_hostile URL BACKEND COUNTS (started by moe-bench chaos)")
