"""``moe-bench chaos``: a gateway and two workers under random SIGKILL and SIGSTOP, client
churn and a background of hostile connections; every answer checked against the reference.

    moe-bench chaos --backend tcp --backend shm --replicas 1 --replicas 2 --duration 180 \\
        --json bench-results/chaos.json --plot bench-results/chaos.png

Per configuration (backend x replicas x worker kind):

1. start two workers (external: this tool restarts a killed one on the same URL; local:
   the gateway spawns, reaps and respawns them) and a gateway;
2. the good client's p99 alone, then with ``--hostile-idle`` idle plus ``--hostile-half``
   half-open connections to the gateway, then alone again (stated: the gateway's connection
   cap and idle timeout, and the handshake deadline);
3. warm-up with steady clients, churn and the chaos-phase hostile background; baseline RSS,
   open fds per role and /dev/shm entries (with the background paused, as at the end);
4. ``--duration`` seconds of chaos: one worker at a time is SIGKILLed (restarted) or
   SIGSTOPped (then SIGCONTed); after its return, the time until the service is whole again
   (a request needing only its experts is answered; with replicas: the gateway reports it
   healthy again) is its recovery time. Only one worker is ever down, so with replicas an
   expert always has a live copy;
5. the end: chaos stops, every worker is back, the background is paused; resources again.

Every request carries a fresh id on its connection; a reply is matched by id, so a second
reply for one id is a duplicate; no reply within ``--deadline`` is lost. A failed request is
"expected" when an expert it needs had no live host at the time (the victim's down window,
from the signal to its recovery); any other failure is unexpected.

Progress goes to stderr, the report to stdout, ``--json`` holds everything with provenance.
"""
from __future__ import annotations

import collections
import itertools
import os
import random
import resource
import select
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from typing import Callable, Optional

import numpy as np

D_MODEL, D_FF, N_EXPERTS, TOP_K = 64, 128, 8, 2
MAX_BATCH = 256
CONFIG_KEYS = ("backend", "replicas", "workers")


def log(msg: str) -> None:
    print(f"[chaos {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# -- process probes (psutil: None for a process that is gone) -----------------------------------
def _proc(pid: int, what):
    import psutil

    try:
        return what(psutil.Process(pid))
    except psutil.Error:
        return None


def _rss_kb(pid: int) -> Optional[int]:
    return _proc(pid, lambda p: p.memory_info().rss // 1024)


def _fds(pid: int) -> Optional[int]:
    return _proc(pid, lambda p: p.num_fds())


def _dev_shm() -> list:
    try:
        return sorted(os.listdir("/dev/shm"))
    except OSError:
        return []


def _children(pid: int) -> list[int]:
    return _proc(pid, lambda p: [c.pid for c in p.children()]) or []


# -- outcomes -----------------------------------------------------------------------------------
@dataclass
class Outcome:
    t_sent: float
    t_done: float
    result: str  # ok, wrong, lost, error:<code>
    experts: tuple
    source: str  # steady, churn, probe


class Tally:
    """Every request's outcome, thread-safe."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.outcomes: list[Outcome] = []
        self.duplicated = 0
        self.late = 0  # replies that came after their request was counted lost
        self.send_failed = 0  # requests that could not even be sent (connection gone)
        self.latencies: list[float] = []  # ok steady requests, seconds

    def add(self, o: Outcome) -> None:
        with self.lock:
            self.outcomes.append(o)
            if o.result == "ok" and o.source == "steady":
                self.latencies.append(o.t_done - o.t_sent)

    def note(self, what: str) -> None:
        with self.lock:
            setattr(self, what, getattr(self, what) + 1)


class Layer:
    """Token batches and their reference outputs, computed once (the checks stay cheap)."""

    def __init__(self, seed: int, n: int = 96) -> None:
        from gateway.reference import ReferenceMoE

        self.ref = ReferenceMoE.from_seed(D_MODEL, D_FF, N_EXPERTS, TOP_K, seed=seed)
        rng = np.random.default_rng(seed + 1)
        self.pairs = []
        for i in range(n):
            x = rng.standard_normal((int(rng.integers(1, 33)), D_MODEL)).astype(np.float32)
            y = self.ref.forward(x)[0]
            experts = tuple(sorted({int(e) for e in self.ref.router.route(x).topk_idx.ravel() if e >= 0}))
            self.pairs.append((x, y, experts))

    def steered(self, experts: set, n: int = 4, seed: int = 0):
        """Tokens routed only to ``experts`` and their reference output (recovery probes)."""
        rng = np.random.default_rng(seed)
        rows: list = []
        while len(rows) < n:
            x = rng.standard_normal((256, D_MODEL)).astype(np.float32)
            for row, idx in zip(x, self.ref.router.route(x).topk_idx):
                if set(int(e) for e in idx) <= experts:
                    rows.append(row)
        x = np.stack(rows[:n])
        return x, self.ref.forward(x)[0], tuple(sorted(experts))


class Client:
    """A well-behaved client on a raw transport connection: each request gets a fresh id and
    its reply is matched by id, so duplicates and losses are seen (GatewayClient hides them)."""

    def __init__(self, url: str, secret: Optional[bytes], tally: Tally, deadline: float,
                 checker: Optional[Callable] = None) -> None:
        import transport

        self.conn = transport.connect(url, slot_size=1 << 16, nslots=4, timeout=10.0, secret=secret)
        self.tally, self.deadline = tally, deadline
        # checker(x, y, {expert: version}, t_sent, t_done) -> ok/wrong/stale/mixed: with hot updates
        # the right answer is the layer at the versions the answer names (bench/chaos_updates.py)
        self.checker = checker
        self.ids = itertools.count(1)
        self.done: set = set()
        self.abandoned: set = set()

    def request(self, x: np.ndarray, y_ref: np.ndarray, experts: tuple, source: str) -> str:
        import transport
        from workers import protocol as P

        rid = next(self.ids)
        t0 = time.monotonic()
        try:
            slot = self.conn.alloc(x.nbytes, timeout=self.deadline)
            np.copyto(slot.array(np.float32, x.shape), x)
            self.conn.send(P.forward_request(rid, x.shape, np.float32), [slot], timeout=self.deadline)
        except transport.TransportError:
            self.tally.note("send_failed")
            raise
        end = t0 + self.deadline
        while True:
            left = end - time.monotonic()
            if left <= 0:
                self.abandoned.add(rid)
                self.tally.add(Outcome(t0, time.monotonic(), "lost", experts, source))
                return "lost"
            try:
                msg = self.conn.recv(timeout=min(left, 0.5))
            except transport.Timeout:
                continue
            except transport.ConnectionClosed:
                self.tally.add(Outcome(t0, time.monotonic(), "lost", experts, source))
                log(f"{source} request {rid}: the gateway closed the connection before answering")
                raise
            with msg:
                h = msg.header
                got = P.request_id_of(h)
                if got != rid:
                    self.tally.note("late" if got in self.abandoned else "duplicated")
                    continue
                if got in self.done:
                    self.tally.note("duplicated")
                    continue
                self.done.add(rid)
                if h.get("op") == P.RESULT:
                    y = msg.array(0, np.float32, tuple(h["shape"]))
                    if self.checker is not None:
                        ev = h.get("expert_versions") or []
                        result = self.checker(x, y, {int(e): int(v) for e, v in ev}, t0, time.monotonic())
                    else:
                        ok = y.shape == y_ref.shape and np.allclose(y, y_ref, rtol=1e-4, atol=1e-5)
                        result = "ok" if ok else "wrong"
                else:
                    result = f"error:{h.get('code')}"
            self.tally.add(Outcome(t0, time.monotonic(), result, experts, source))
            # duplicates of this id may still come: check the socket briefly without waiting
            return result

    def drain_duplicates(self) -> None:
        """Read what is left (a duplicate reply would be here), briefly."""
        import transport
        from workers import protocol as P

        try:
            while True:
                with self.conn.recv(timeout=0.05) as msg:
                    self.tally.note("late" if P.request_id_of(msg.header) in self.abandoned else "duplicated")
        except transport.TransportError:
            pass

    def close(self) -> None:
        try:
            self.conn.close()
        except Exception:
            pass


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
    """A :class:`Hostile` in its own process (``python -m bench.chaos --crowd``), so its
    Python work never competes with the measuring client for this process's GIL."""

    def __init__(self, url: str, backend: str, secret_file: str, counts: dict, ready_timeout: float = 180.0) -> None:
        import json

        self.counts = counts
        self.proc = subprocess.Popen([sys.executable, "-m", "bench.chaos", "--crowd", url, backend, json.dumps(counts)],
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


# -- the cluster ---------------------------------------------------------------------------------
class Cluster:
    """Two workers and a gateway; ``workers`` is external (this tool restarts a killed worker
    on its URL) or local (the gateway's own, respawned by it)."""

    def __init__(self, args, backend: str, replicas: int, kind: str, secret_file: str) -> None:
        from gateway.supervisor import placement
        from transport.service.launch import blas_env, spawn_service

        self.backend, self.replicas, self.kind = backend, replicas, kind
        self.args = args
        self.env = blas_env(1, {**os.environ, "MOE_SECRET_FILE": secret_file})
        self.spawn = spawn_service
        self.placement = placement(N_EXPERTS, 2, replicas)
        self.procs: list = [None, None]
        self.urls: list = ["", ""]
        self.gateway = None
        tag = f"{os.getpid()}-{backend}-{replicas}-{kind}"
        gw_flags = ["--d-model", str(D_MODEL), "--d-ff", str(D_FF), "--n-experts", str(N_EXPERTS),
                    "--top-k", str(TOP_K), "--seed", str(args.seed), "--max-batch-tokens", str(MAX_BATCH),
                    "--max-wait-ms", "1", "--worker-timeout", str(args.worker_timeout),
                    "--max-connections", str(args.max_connections), "--idle-timeout", str(args.idle_timeout),
                    "--connect-timeout", "30"]
        from bench.chaos_eplb import gateway_flags as eplb_flags
        gw_flags += eplb_flags(args)
        gw_listen = "tcp://127.0.0.1:0" if backend == "tcp" else f"shm://moe-chaos-{tag}-gw"
        try:
            if kind == "external":
                for i in range(2):
                    listen = "tcp://127.0.0.1:0" if backend == "tcp" else f"shm://moe-chaos-{tag}-w{i}"
                    self.procs[i], self.urls[i] = self._spawn_worker(i, listen)
                argv = [sys.executable, "-m", "gateway.cli", "--listen", gw_listen, "--workers",
                        ",".join(self.urls), *gw_flags]
            else:
                argv = [sys.executable, "-m", "gateway.cli", "--listen", gw_listen, "--local-workers", "2",
                        "--backend", backend, "--replicas", str(replicas), *gw_flags]
            self.gateway, self.url = spawn_service(argv, timeout=90, env=self.env, stderr=self._log("gateway"))
        except BaseException:
            self.close()
            raise

    def _log(self, role: str):
        path = self.args.log_dir and os.path.join(self.args.log_dir, f"{self.backend}-r{self.replicas}-"
                                                                     f"{self.kind}-{role}.log")
        return open(path, "ab") if path else subprocess.DEVNULL

    def _spawn_worker(self, i: int, listen: str):
        from workers.cli import worker_argv

        argv = worker_argv(listen, self.placement[i], d_model=D_MODEL, d_ff=D_FF, seed=self.args.seed,
                           max_tokens=MAX_BATCH * TOP_K)
        return self.spawn(argv, timeout=60, env=self.env, stderr=self._log(f"worker{i}"))

    def worker_pids(self, pong: Optional[dict] = None) -> list:
        if self.kind == "external":
            return [p.pid if p is not None else None for p in self.procs]
        return [w.get("pid") for w in pong["workers"]] if pong else [None, None]

    def restart(self, i: int) -> None:
        """External worker ``i`` again on its URL (the same tcp port or shm name)."""
        proc = self.procs[i]
        if proc is not None and proc.poll() is None:
            raise RuntimeError(f"worker {i} still runs")
        for attempt in range(50):  # a tcp port may take a moment to be free again
            try:
                self.procs[i], url = self._spawn_worker(i, self.urls[i])
                assert url == self.urls[i], (url, self.urls[i])
                return
            except Exception as e:
                if attempt == 49:
                    raise
                log(f"restarting worker {i} failed ({e}); again")
                time.sleep(0.1)

    def close(self) -> None:
        from transport.service.launch import stop_process

        if self.gateway is not None:
            stop_process(self.gateway, timeout=20)
        for p in self.procs:
            if p is not None:
                try:
                    os.kill(p.pid, signal.SIGCONT)
                except ProcessLookupError:
                    pass
                stop_process(p, timeout=10)


# -- one configuration ---------------------------------------------------------------------------
def _percentile(xs: list, q: float) -> Optional[float]:
    if not xs:
        return None
    return float(np.percentile(np.asarray(xs), q))


class Run:
    def __init__(self, args, backend: str, replicas: int, kind: str, secret: bytes, secret_file: str,
                 layer: Layer) -> None:
        self.args, self.backend, self.replicas, self.kind = args, backend, replicas, kind
        self.secret, self.secret_file, self.layer = secret, secret_file, layer
        self.tally = Tally()
        self.stop = threading.Event()
        self.events: list[dict] = []  # the chaos timeline
        self.threads: list[threading.Thread] = []
        self.t0 = time.monotonic()
        self.churn_pause, self.churn_idle = threading.Event(), threading.Event()
        self.book = self.versions = self.driver = None
        self.eplb = None
        if getattr(args, "eplb", False):
            from bench.chaos_eplb import ChaosEplb

            self.eplb = ChaosEplb(args, layer)
        if args.updates:
            from bench.chaos_updates import VersionBook
            from bench.versioned import VersionedReference

            self.book = VersionBook(N_EXPERTS)
            self.versions = VersionedReference(D_MODEL, D_FF, N_EXPERTS, TOP_K, seed=args.seed)

    def client(self, tally: Optional[Tally] = None) -> "Client":
        return Client(self.cluster.url, self.secret, tally or self.tally, self.args.deadline,
                      checker=self._check if self.book is not None else None)

    def _check(self, x, y, versions: dict, t0: float, t1: float) -> str:
        """With hot updates: right at the versions it names, each served during its life."""
        if not self.versions.matches(x, y, versions):
            return "wrong"
        if not all(self.book.allowed(e, v, t0, t1) for e, v in versions.items()):
            return "stale"
        return "mixed" if self.book.mixed(versions, t0, t1) else "ok"

    def _settled_resources(self) -> dict:
        """Resources with the churn paused (its clients come and go: a descriptor or two)."""
        self.churn_pause.set()
        self.churn_idle.wait(self.args.deadline + 5)
        time.sleep(0.5)
        try:
            return self.resources()
        finally:
            self.churn_pause.clear()

    # -- clients ---------------------------------------------------------------------------
    def _steady(self, idx: int) -> None:
        rng = random.Random(100 + idx)
        client = None
        while not self.stop.is_set():
            try:
                if client is None:
                    client = self.client()
                x, y, ex = self._pick(rng)
                client.request(x, y, ex, "steady")
                time.sleep(self.args.pace)
            except Exception as e:
                log(f"steady client {idx}: {type(e).__name__}: {e}; reconnecting")
                if client is not None:
                    client.close()
                client = None
                time.sleep(0.2)
        if client is not None:
            client.drain_duplicates()
            client.close()

    def _pick(self, rng) -> tuple:
        """A batch and its reference: skewed and shifting under --eplb, else any."""
        return self.eplb.pick(rng) if self.eplb is not None else rng.choice(self.layer.pairs)

    def _churn(self) -> None:
        rng = random.Random(5)
        while not self.stop.is_set():
            if self.churn_pause.is_set():  # resources are being measured: no client coming or going
                self.churn_idle.set()
                time.sleep(0.05)
                continue
            self.churn_idle.clear()
            try:
                c = self.client()
            except Exception as e:
                log(f"churn client could not connect: {e}")
                time.sleep(0.5)
                continue
            try:
                for _ in range(rng.randint(1, 5)):
                    x, y, ex = self._pick(rng)
                    c.request(x, y, ex, "churn")
                c.drain_duplicates()
            except Exception as e:
                log(f"churn client: {type(e).__name__}: {e}")
            finally:
                c.close()
            time.sleep(rng.uniform(0.05, 0.3))

    # -- p99 with and without a hostile crowd ------------------------------------------------------
    def _p99_window(self, seconds: float) -> list:
        lat = []
        tally = Tally()
        c = self.client(tally)
        try:
            end = time.monotonic() + seconds
            i = 0
            while time.monotonic() < end:
                x, y, ex = self.layer.pairs[i % len(self.layer.pairs)]
                i += 1
                t = time.monotonic()
                if c.request(x, y, ex, "p99") == "ok":
                    lat.append(time.monotonic() - t)
                time.sleep(self.args.pace)
        finally:
            c.close()
        bad = [o.result for o in tally.outcomes if o.result != "ok"]
        if bad:
            log(f"p99 window: {len(bad)} bad answers {collections.Counter(bad)}")
        return lat

    def p99_phase(self) -> dict:
        a = self.args
        log(f"p99 alone for {a.p99_seconds:.0f} s")
        alone = self._p99_window(a.p99_seconds)
        t = time.monotonic()
        crowd = Crowd(self.cluster.url, self.backend, self.secret_file, {"idle": a.hostile_idle, "half": a.hostile_half})
        log(f"hostile crowd open in {time.monotonic() - t:.1f} s: {crowd.ready['open']}; p99 with it")
        try:
            crowded = self._p99_window(a.p99_seconds)
        finally:
            res = crowd.close()
        held = res.get("held")
        time.sleep(1.0)
        log("p99 alone again")
        alone += self._p99_window(a.p99_seconds)
        p_alone, p_crowd = _percentile(alone, 99), _percentile(crowded, 99)
        return {"alone_p99_ms": p_alone and p_alone * 1e3, "crowded_p99_ms": p_crowd and p_crowd * 1e3,
                "alone_p50_ms": _percentile(alone, 50) * 1e3 if alone else None,
                "crowded_p50_ms": _percentile(crowded, 50) * 1e3 if crowded else None,
                "alone_n": len(alone), "crowded_n": len(crowded),
                "ratio": (p_crowd / p_alone) if p_alone and p_crowd else None,
                "crowd_requested": {"idle": a.hostile_idle, "half_open": a.hostile_half},
                "crowd_open_at_start": crowd.ready["open"], "crowd_held_at_end": held,
                "crowd_reconnects": res.get("reconnects"), "crowd_open_failures": res.get("failures"),
                "gateway_max_connections": a.max_connections, "gateway_idle_timeout_s": a.idle_timeout,
                "handshake_timeout_s": 5.0}

    # -- resources -------------------------------------------------------------------------------
    def _ping(self) -> Optional[dict]:
        from gateway.client import GatewayClient

        try:
            with GatewayClient(self.cluster.url, timeout=5.0, secret=self.secret) as c:
                return c.ping(timeout=5.0)
        except Exception:
            return None

    def resources(self) -> dict:
        pong = self._ping()
        roles = {"gateway": self.cluster.gateway.pid}
        for i, pid in enumerate(self.cluster.worker_pids(pong)):
            roles[f"worker{i}"] = pid
        return {"processes": {r: {"pid": p, "rss_kb": p and _rss_kb(p), "fds": p and _fds(p)}
                              for r, p in roles.items()},
                "dev_shm": _dev_shm()}

    # -- chaos -----------------------------------------------------------------------------------
    def _healthy(self, i: int, pid: Optional[int]) -> bool:
        pong = self._ping()
        if pong is None:
            return False
        w = pong["workers"][i]
        return bool(w.get("healthy")) and not w.get("draining") and (pid is None or w.get("pid") == pid)

    def _wait_whole(self, i: int, pid: Optional[int], probe, limit: float = 30.0) -> Optional[float]:
        """Seconds until worker ``i`` serves again (None: not within ``limit``)."""
        t0 = time.monotonic()
        c = None
        while time.monotonic() - t0 < limit and not self.stop.is_set():
            if self.replicas > 1 or probe is None:
                if self._healthy(i, pid):
                    return time.monotonic() - t0
            else:
                try:
                    if c is None:
                        c = self.client()
                    if c.request(*probe, "probe") == "ok":
                        c.close()
                        return time.monotonic() - t0
                except Exception:
                    if c is not None:
                        c.close()
                    c = None
            time.sleep(0.01)
        if c is not None:
            c.close()
        return None

    def _chaos(self, end: float) -> None:
        rng = random.Random(self.args.seed + 1000 * self.replicas + (0 if self.backend == "tcp" else 1))
        probes = [self.layer.steered(set(self.cluster.placement[i]) - set(self.cluster.placement[1 - i]) or
                                     set(self.cluster.placement[i]), seed=i) for i in range(2)]
        while time.monotonic() < end and not self.stop.is_set():
            time.sleep(max(0.0, min(rng.uniform(*self.args.gap), end - time.monotonic())))
            if time.monotonic() >= end:
                break
            i = rng.randrange(2)
            action = "stop" if rng.random() < self.args.stop_fraction else "kill"
            down = rng.uniform(*self.args.down)
            move = None
            if self.eplb is not None:  # aimed at a move in progress, if one comes before the next gap
                i, move = self.eplb.aim(i, wait=max(0.0, min(self.args.gap[1], end - time.monotonic())))
            pong = self._ping()
            pids = self.cluster.worker_pids(pong)
            pid = pids[i]
            if pid is None:
                log(f"worker {i} has no pid now; skipping")
                continue
            ev = {"worker": i, "action": action, "pid": pid, "t_signal": time.monotonic() - self.t0,
                  "experts": self.cluster.placement[i]}
            if self.eplb is not None:
                ev["experts"] = self.eplb.watch.experts_on(i, time.monotonic())
                self.eplb.note_action(ev, move)
            if action == "kill":
                os.kill(pid, signal.SIGKILL)
                if self.cluster.kind == "external":
                    self.cluster.procs[i].wait(timeout=10)
                    time.sleep(down)
                    self.cluster.restart(i)
                    new_pid = self.cluster.procs[i].pid
                else:
                    new_pid = None
                    t = time.monotonic()
                    while time.monotonic() - t < 60:
                        kids = [k for k in _children(self.cluster.gateway.pid) if k not in pids]
                        if kids:
                            new_pid = kids[0]
                            break
                        time.sleep(0.01)
            else:
                os.kill(pid, signal.SIGSTOP)
                time.sleep(down)
                os.kill(pid, signal.SIGCONT)
                new_pid = pid
            t_return = time.monotonic()
            ev["t_return"] = t_return - self.t0
            ev["new_pid"] = new_pid
            probe = None if self.replicas > 1 or self.eplb is not None else probes[i]
            rec = self._wait_whole(i, new_pid, probe)
            ev["recovery_s"] = rec
            ev["t_whole"] = (t_return + rec - self.t0) if rec is not None else None
            self.events.append(ev)
            log(f"{action} worker {i} (pid {pid}), back after {ev['t_return'] - ev['t_signal']:.2f} s"
                f" (pid {new_pid}), whole again {'never' if rec is None else f'{rec * 1e3:.0f} ms'} later")

    # -- the whole configuration ------------------------------------------------------------------
    def execute(self) -> dict:
        a = self.args
        name = f"{self.backend} replicas={self.replicas} workers={self.kind}"
        log(f"== {name}: starting")
        shm_before = _dev_shm()
        self.cluster = Cluster(a, self.backend, self.replicas, self.kind, self.secret_file)
        report: dict = {"backend": self.backend, "replicas": self.replicas, "workers": self.kind,
                        "placement": self.cluster.placement, "duration_s": a.duration}
        hostile = []
        try:
            if self.eplb is not None:
                self.eplb.start(self.cluster.url, self.secret)
            report["p99"] = self.p99_phase()
            log(f"warm-up {a.warmup:.0f} s (steady clients, churn, hostile background)")
            for i in range(a.clients):
                self.threads.append(threading.Thread(target=self._steady, args=(i,), daemon=True))
            self.threads.append(threading.Thread(target=self._churn, daemon=True))
            for t in self.threads:
                t.start()
            bg = {"idle": a.bg_idle, "half": a.bg_half, "nonreader": a.bg_nonreaders, "garbage": a.bg_garbage}
            targets_bg = [(self.cluster.url, bg)]
            if self.kind == "external":  # the workers get garbage and half-open handshakes too
                targets_bg += [(url, {"half": 2, "garbage": 1}) for url in self.cluster.urls]
            hostile = [Crowd(url, self.backend, self.secret_file, counts) for url, counts in targets_bg]
            time.sleep(a.warmup)
            for h in hostile:  # resources are compared with the background paused at both ends
                h.close()
            time.sleep(1.0)
            report["baseline"] = self._settled_resources()
            hostile = [Crowd(url, self.backend, self.secret_file, counts) for url, counts in targets_bg]
            n_before = len(self.tally.outcomes)
            self.t0 = time.monotonic()
            log(f"chaos for {a.duration:.0f} s" + (" with hot updates" if self.book is not None else ""))
            if self.book is not None:
                from bench.chaos_updates import UpdateDriver

                self.driver = UpdateDriver(self.cluster.url, self.secret, self.book, self.versions,
                                           gap=a.update_gap, seed=a.seed + self.replicas, log=log).start()
            self._chaos(self.t0 + a.duration)
            chaos_s = time.monotonic() - self.t0
            if self.driver is not None:
                report["updates"] = self._end_updates()
            log("chaos over; letting the last requests finish")
            t = time.monotonic()
            while time.monotonic() - t < 30 and not all(self._healthy(i, None) for i in range(2)):
                time.sleep(0.1)
            time.sleep(2.0)
            bg_results = [h.close() for h in hostile]
            time.sleep(1.0)
            report["end"] = self._settled_resources()  # as at the baseline: clients on, background paused
            self.stop.set()
            for t in self.threads:
                t.join(a.deadline + 10)
            report["chaos_s"] = chaos_s
            report["hostile_background"] = {"requested": [c for _, c in targets_bg], "results": bg_results}
            pong = self._ping()
            report["gateway_serve_stats"] = pong and pong.get("serve")
            report["gateway_stats"] = pong and {k: pong["gateway"][k] for k in ("requests", "replies", "retried",
                                                                             "failed_requests", "errors")}
            report.update(self.summarize(n_before))
            if self.eplb is not None:
                report["eplb"] = self.eplb.report()
        finally:
            self.stop.set()
            if self.eplb is not None:
                self.eplb.close()
            for h in hostile:
                h.close()
            self.cluster.close()
        report["dev_shm_left_after_stop"] = sorted(set(_dev_shm()) - set(shm_before))
        report["targets"] = targets(report)
        log(f"== {name}: done")
        return report

    def _end_updates(self) -> dict:
        """Stop the update driver (a running update is rolled back) and say what it did."""
        from gateway.client import GatewayClient

        counts = self.driver.close()
        try:
            with GatewayClient(self.cluster.url, timeout=10.0, secret=self.secret) as c:
                self.driver.finish(c)
        except Exception as e:
            log(f"could not end the last update: {e}")
        pong = self._ping() or {}
        return {"commands": counts, "spans": len(self.book.spans), "admission": pong.get("admission"),
                "served_generation": (pong.get("served") or {}).get("generation")}

    def summarize(self, n_before: int) -> dict:
        outs = self.tally.outcomes
        warm = outs[:n_before]
        chaos = outs[n_before:]
        counts = collections.Counter(o.result for o in chaos)
        errors = {k.split(":", 1)[1]: v for k, v in counts.items() if k.startswith("error:")}
        # a failure is expected if an expert it needs had no live host during its life
        windows = []
        for ev in self.events:
            end = ev["t_whole"] if ev["t_whole"] is not None else float("inf")
            only = (self.eplb.only(ev, self.t0) if self.eplb is not None else
                    set(ev["experts"]) - set(self.cluster.placement[1 - ev["worker"]]))
            windows.append((ev["t_signal"] + self.t0 - 0.05, end + self.t0 + 0.5, only))
        unexpected, fail_lat = [], []
        lost = [{"t": o.t_sent - self.t0, "waited_s": o.t_done - o.t_sent, "experts": list(o.experts),
                 "source": o.source} for o in chaos if o.result == "lost"]
        for o in chaos:
            if not o.result.startswith("error:"):
                continue
            fail_lat.append(o.t_done - o.t_sent)
            if not any(lo <= o.t_done and o.t_sent <= hi and set(o.experts) & only for lo, hi, only in windows):
                unexpected.append({"t": o.t_sent - self.t0, "result": o.result, "experts": list(o.experts),
                                   "source": o.source})
        kills = [e["recovery_s"] for e in self.events if e["action"] == "kill" and e["recovery_s"] is not None]
        stops = [e["recovery_s"] for e in self.events if e["action"] == "stop" and e["recovery_s"] is not None]
        sent = len(chaos)
        per_s = collections.defaultdict(collections.Counter)
        for o in chaos:
            per_s[int(o.t_done - self.t0)][o.result.split(":")[0]] += 1
        return {
            "requests": {"sent": sent, "ok": counts.get("ok", 0), "failed": sum(errors.values()),
                         "failed_by_code": errors, "wrong": counts.get("wrong", 0), "lost": counts.get("lost", 0),
                         "stale": counts.get("stale", 0), "mixed": counts.get("mixed", 0),
                         "duplicated": self.tally.duplicated, "late": self.tally.late,
                         "send_failed": self.tally.send_failed, "unexpected_failures": len(unexpected),
                         "unexpected_examples": unexpected[:10], "lost_examples": lost[:10],
                         "by_source": dict(collections.Counter(o.source for o in chaos))},
            "warmup_requests": {"sent": len(warm), "ok": sum(o.result == "ok" for o in warm)},
            "failure_latency_s": {"max": max(fail_lat) if fail_lat else None,
                                  "p50": _percentile(fail_lat, 50)},
            "deadline_s": self.args.deadline, "worker_timeout_s": self.args.worker_timeout,
            "events": self.events,
            "recovery_s": {"kills": len([e for e in self.events if e["action"] == "kill"]),
                           "stops": len([e for e in self.events if e["action"] == "stop"]),
                           "kill_median": statistics.median(kills) if kills else None,
                           "kill_max": max(kills) if kills else None,
                           "stop_median": statistics.median(stops) if stops else None,
                           "stop_max": max(stops) if stops else None,
                           "never": sum(1 for e in self.events if e["recovery_s"] is None)},
            "timeline": [{"t": s, **dict(c)} for s, c in sorted(per_s.items())],
        }


def _within(base: Optional[int], end: Optional[int], frac: float = 0.10) -> Optional[bool]:
    if not base or end is None:
        return None
    return end <= base * (1 + frac)


def targets(r: dict) -> list[dict]:
    """The fault-tolerance targets, each met or missed (None: not measured)."""
    out = []

    def add(name, met, value):
        out.append({"target": name, "met": met, "value": value})

    if "requests" not in r:
        return out
    q = r["requests"]
    add("wrong 0", q["wrong"] == 0, q["wrong"])
    add("lost 0", q["lost"] == 0, q["lost"])
    add("duplicated 0", q["duplicated"] == 0, q["duplicated"])
    if "updates" in r:
        add("answers from versions not served at that moment 0", q.get("stale", 0) == 0, q.get("stale", 0))
        add("answers mixing an update's sides 0", q.get("mixed", 0) == 0, q.get("mixed", 0))
    if r["replicas"] > 1:
        add("replicated: 0 failed requests", q["failed"] == 0, q["failed"])
    else:
        add("unreplicated: only requests needing the dead worker fail", q["unexpected_failures"] == 0,
            q["unexpected_failures"])
        fl = r["failure_latency_s"]["max"]
        add(f"failures within their deadline ({r['deadline_s']:.0f} s)", fl is None or fl < r["deadline_s"], fl)
        km = r["recovery_s"]["kill_max"]
        add("whole again within 2 s of a killed worker's return (max)", km is not None and km <= 2.0, km)
    add("every worker came back", r["recovery_s"]["never"] == 0, r["recovery_s"]["never"])
    base, end = r["baseline"]["processes"], r["end"]["processes"]
    for role in base:
        for k in ("rss_kb", "fds"):
            add(f"{role} {k} at end within 10% of baseline", _within(base[role][k], end[role][k]),
                f"{base[role][k]} -> {end[role][k]}")
    ratio = r["p99"]["ratio"]
    add("good client's p99 with the hostile crowd <= 2x without", ratio is not None and ratio <= 2.0, ratio)
    add("nothing left in /dev/shm after stop", not r["dev_shm_left_after_stop"], r["dev_shm_left_after_stop"])
    from bench.chaos_eplb import targets as eplb_targets
    return out + eplb_targets(r)


# -- command line --------------------------------------------------------------------------------
from bench import chaos_cli  # noqa: E402  (the subcommand's interface: add_arguments, validate)
add_arguments, configurations, plan, validate = (chaos_cli.add_arguments, chaos_cli.configurations, chaos_cli.plan,
                                                 chaos_cli.validate)


def run(args) -> int:
    import tempfile

    from bench.provenance import provenance, write_json_atomic

    log(plan(args))
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))  # the crowd holds ~1100 connections
    if args.log_dir:
        os.makedirs(args.log_dir, exist_ok=True)
    tmpdir = None
    if args.secret_file is None:
        tmpdir = tempfile.mkdtemp(prefix="moe-chaos-")
        args.secret_file = os.path.join(tmpdir, "secret")
        fd = os.open(args.secret_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        os.write(fd, os.urandom(16).hex().encode() + b"\n")
        os.close(fd)
    from transport.service.secrets import read

    secret = read(args.secret_file)
    layer = Layer(args.seed)
    doc: dict = {"provenance": provenance(), "settings": {
        "duration": args.duration, "warmup": args.warmup, "clients": args.clients, "pace": args.pace,
        "deadline": args.deadline, "worker_timeout": args.worker_timeout, "gap": list(args.gap),
        "down": list(args.down), "stop_fraction": args.stop_fraction, "max_connections": args.max_connections,
        "idle_timeout": args.idle_timeout, "hostile_idle": args.hostile_idle, "hostile_half": args.hostile_half,
        "p99_seconds": args.p99_seconds, "seed": args.seed, "updates": args.updates, "eplb": args.eplb,
        "bg": {"idle": args.bg_idle, "half_open": args.bg_half, "nonreaders": args.bg_nonreaders,
               "garbage": args.bg_garbage},
        "layer": {"d_model": D_MODEL, "d_ff": D_FF, "n_experts": N_EXPERTS, "top_k": TOP_K,
                  "max_batch_tokens": MAX_BATCH}}, "configs": []}
    try:
        for backend, replicas, kind in configurations(args):
            try:
                r = Run(args, backend, replicas, kind, secret, args.secret_file, layer).execute()
            except Exception as e:
                log(f"{backend} r{replicas} {kind} failed: {type(e).__name__}: {e}")
                r = {"name": f"{backend} r{replicas} {kind}", "backend": backend, "replicas": replicas,
                     "workers": kind, "error": f"{type(e).__name__}: {e}"}
            doc["configs"].append(r)
            if args.json:  # after each configuration: a long run interrupted keeps what it measured
                write_json_atomic(args.json, doc)
    finally:
        if tmpdir:
            os.unlink(args.secret_file)
            os.rmdir(tmpdir)
    from bench.chaos_report import plot, print_report

    print_report(doc)
    if args.plot:
        plot(doc, args.plot)
    missed = [t for r in doc["configs"] for t in r.get("targets", []) if t["met"] is False]
    return 1 if missed or any("error" in r for r in doc["configs"]) else 0


if __name__ == "__main__":
    if len(sys.argv) == 5 and sys.argv[1] == "--crowd":
        sys.exit(crowd_main(*sys.argv[2:]))
    sys.exit("usage: moe-bench chaos ... (python -m bench.chaos --crowd URL BACKEND COUNTS is internal)")
