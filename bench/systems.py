"""The MoE layers a benchmark drives, behind one interface, so the same load, config and
weights reach each of them in one run:

- ``moe-transport``: a moe-gateway (started here with local workers, or a running one) and
  one GatewayClient per client thread;
- ``reference``: the in-process ReferenceMoE (the compute floor: no transport at all);
- ``multiprocessing``: worker processes fed through multiprocessing pipes (the peer a user
  writes first);
- ``ray``: one Ray actor per expert (``pip install moe-transport[ray]``).

A system hands each client thread a :meth:`System.client` with ``forward(x) -> y``; peers
without a server of their own serve one request at a time (a lock), as the straightforward
implementation a user would write does. :meth:`System.counters` snapshots CPU seconds per
process (and, for moe-transport, the gateway's own counters), so a run reports deltas.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import threading
import time
from typing import Any, Optional, Sequence

import numpy as np

SYSTEMS = ("moe-transport", "reference", "multiprocessing", "ray")


def proc_cpu_seconds(pid: int) -> Optional[float]:
    """User + system CPU seconds of a local process (its children's not included); None
    when it is gone."""
    import psutil

    try:
        t = psutil.Process(pid).cpu_times()
    except psutil.Error:
        return None
    return t.user + t.system


class System:
    name = "?"
    backend = "?"

    def client(self) -> Any:
        """An object with forward(x) and close(), for one client thread."""
        return _Locked(self)

    def forward(self, x: np.ndarray) -> np.ndarray:
        raise NotImplementedError

    def counters(self) -> dict:
        return {"cpu_s": {name: proc_cpu_seconds(pid) for name, pid in self.pids().items()}}

    def pids(self) -> dict:
        return {}

    def close(self) -> None:
        pass


class _Locked:
    """One request at a time through a system that has no server of its own."""

    def __init__(self, system: System):
        self.system = system

    def forward(self, x: np.ndarray) -> np.ndarray:
        with self.system.lock:
            return self.system.forward(x)

    def close(self) -> None:
        pass


# -- moe-transport ----------------------------------------------------------------------
class MoeTransport(System):
    name = "moe-transport"

    def __init__(self, url: str, backend: str, proc=None, timeout: float = 30.0,
                 max_peer_slot_size: Optional[int] = None):
        """``max_peer_slot_size``: what the gateway's slots may be (a gateway this benchmark
        started: what its settings make them; else the client's default)."""
        from gateway.client import GatewayClient
        self.url, self.backend, self.proc, self.timeout = url, backend, proc, timeout
        self.max_peer_slot_size = max_peer_slot_size
        self._admin = GatewayClient(url, timeout=timeout, max_peer_slot_size=max_peer_slot_size)
        self.pong = self._admin.ping(timeout=timeout)

    @classmethod
    def start(cls, backend: str, *, workers: int, n_experts: int, top_k: int, d_model: int, d_ff: int,
              seed: int, max_batch_tokens: int, max_wait_ms: float, capacity_factor: Optional[float] = None,
              max_inflight_rounds: int = 2, timeout: float = 60.0, dtype: str = "float32",
              extra: Sequence[str] = ()) -> "MoeTransport":
        """A moe-gateway with ``workers`` local workers on ``backend`` (its own processes);
        ``extra``: more moe-gateway flags (routing, replicas, policies), passed as they are."""
        import sys

        from transport.service.launch import blas_env, spawn_service
        listen = {"shm": f"shm://moe-load-{os.getpid()}-{time.monotonic_ns() % 10**6}", "tcp": "tcp://127.0.0.1:0",
                  "rdma": f"rdma://{os.environ.get('MOE_RDMA_IP', '127.0.0.1')}:0"}[backend]
        argv = [sys.executable, "-m", "gateway.cli", "--listen", listen, "--local-workers", str(workers),
                "--backend", backend, "--n-experts", str(n_experts), "--top-k", str(top_k),
                "--d-model", str(d_model), "--d-ff", str(d_ff), "--seed", str(seed),
                "--max-batch-tokens", str(max_batch_tokens), "--max-wait", repr(max_wait_ms / 1e3),
                "--max-inflight-rounds", str(max_inflight_rounds), "--dtype", dtype,
                "--exit-with-parent"]  # a benchmark killed mid-run leaves no gateway behind
        if capacity_factor:
            argv += ["--capacity-factor", str(capacity_factor)]
        argv += list(extra)
        from gateway.client import gateway_slot_size
        proc, url = spawn_service(argv, timeout=timeout, env=blas_env(1))
        try:  # its slots hold a whole round: the clients must accept them
            return cls(url, backend, proc, max_peer_slot_size=gateway_slot_size(max_batch_tokens, d_model, dtype))
        except BaseException:
            from transport.service.launch import stop_process
            stop_process(proc)
            raise

    @property
    def config(self) -> dict:
        return self.pong.get("config", {})

    @property
    def placement(self) -> list:
        return [w["experts"] for w in self.pong.get("workers", [])]

    def client(self):
        from gateway.client import GatewayClient
        return GatewayClient(self.url, timeout=self.timeout, max_peer_slot_size=self.max_peer_slot_size)

    def counters(self) -> dict:
        p = self._admin.ping(timeout=self.timeout)
        cpu = {"gateway": p.get("cpu_s")}
        for i, w in enumerate(p.get("workers", [])):
            cpu[f"worker{i}"] = w.get("cpu_s")
        g = p["gateway"]
        return {"cpu_s": cpu, "stage_s": dict(g["stage_seconds"]), "rounds": g["rounds"], "requests": g["requests"],
                "failed_requests": g["failed_requests"], "dropped": g.get("dropped", 0),
                "overflow": g.get("overflow", 0), "errors": dict(g["errors"]), "messages": g.get("messages"),
                # auto's whole-or-chunked choice as it stands (None with a fixed chunk size)
                "chunk_costs": p.get("config", {}).get("chunk_costs"),
                "expert_rows": _expert_rows(p.get("workers", [])),
                "transport_bytes": sum(w.get("transport", {}).get("bytes_sent", 0)
                                       + w.get("transport", {}).get("bytes_received", 0)
                                       for w in p.get("workers", []))}

    def close(self) -> None:
        self._admin.close()
        if self.proc is not None:
            from transport.service.launch import stop_process
            self.rc = stop_process(self.proc, timeout=15.0)


def _expert_rows(workers: list) -> dict:
    rows: dict = {}
    for w in workers:
        for e, n in w.get("expert_rows", []):
            rows[int(e)] = rows.get(int(e), 0) + int(n)
    return rows


# -- the in-process reference ---------------------------------------------------------
class Reference(System):
    name, backend = "reference", "inproc"

    def __init__(self, router, d_ff: int, seed: int, blas_threads: int = 2):
        from threadpoolctl import threadpool_limits

        from gateway.reference import ReferenceMoE
        from workers.expert import SwiGLUExpert
        self.ref = ReferenceMoE(router, [SwiGLUExpert.from_seed(e, router.d_model, d_ff, seed=seed)
                                         for e in range(router.n_experts)])
        self.lock = threading.Lock()
        # the 2-core machine's whole compute: this is the floor the others are held to
        self._limits = threadpool_limits(blas_threads)

    def forward(self, x):
        return self.ref.forward(x)[0]

    def close(self) -> None:
        self._limits.restore_original_limits()


# -- multiprocessing pipes --------------------------------------------------------------
def _mp_worker(conn, experts: list[int], d_model: int, d_ff: int, seed: int, max_rows: int) -> None:
    from threadpoolctl import threadpool_limits

    from workers.expert import SwiGLUExpert
    threadpool_limits(1)
    ex = {e: SwiGLUExpert.from_seed(e, d_model, d_ff, seed=seed, max_tokens=max_rows) for e in experts}
    buf = bytearray(max_rows * d_model * 4)
    out = np.empty((max_rows, d_model), np.float32)
    while True:
        groups = conn.recv()
        if groups is None:
            return
        n = conn.recv_bytes_into(buf) // (4 * d_model)
        x = np.frombuffer(buf, np.float32, n * d_model).reshape(n, d_model)
        for e, start, count in groups:
            ex[e].forward(x[start:start + count], out[start:start + count])
        conn.send_bytes(out[:n])


class Multiprocessing(System):
    """``n_workers`` processes, experts in contiguous blocks, fed through Pipes: route,
    gather each worker's rows, send to all, wait for all, combine."""

    name, backend = "multiprocessing", "pipe"

    def __init__(self, router, n_workers: int, d_ff: int, seed: int, max_rows: int, timeout: float = 60.0):
        from gateway.dispatch import DispatchPlan
        self.router, self.plan_cls, self.timeout = router, DispatchPlan, timeout
        n_exp, d = router.n_experts, router.d_model
        self.owner = [e * n_workers // n_exp for e in range(n_exp)]
        ctx = mp.get_context("fork")
        self.conns, self.procs = [], []
        for w in range(n_workers):
            a, b = ctx.Pipe()
            p = ctx.Process(target=_mp_worker, args=(b, [e for e in range(n_exp) if self.owner[e] == w],
                                                     d, d_ff, seed, max_rows), daemon=True)
            p.start()
            b.close()
            self.conns.append(a)
            self.procs.append(p)
        self.n_workers = n_workers
        self.lock = threading.Lock()

    def forward(self, x: np.ndarray) -> np.ndarray:
        r = self.router.route(x)
        plan = self.plan_cls.build(r.topk_idx, r.topk_weights, self.owner, self.n_workers)
        busy = [w for w in range(self.n_workers) if plan.worker_tokens(w)]
        for w in busy:  # send to all before waiting
            self.conns[w].send(plan.groups(w))
            self.conns[w].send_bytes(plan.gather(x, w))
        outs: list = [None] * self.n_workers
        for w in busy:
            c = self.conns[w]
            if not c.poll(self.timeout):
                raise TimeoutError("multiprocessing worker did not answer")
            outs[w] = np.frombuffer(c.recv_bytes(), np.float32).reshape(-1, x.shape[1])
        return plan.combine(outs, np.empty_like(x))

    def pids(self) -> dict:
        return {f"worker{i}": p.pid for i, p in enumerate(self.procs)}

    def close(self) -> None:
        for c in self.conns:
            try:
                c.send(None)
            except OSError:
                pass
        for p in self.procs:
            p.join(5)
            if p.is_alive():
                p.kill()
                p.join(5)
        for c in self.conns:
            c.close()


# -- pyzmq over tcp ---------------------------------------------------------------------
def _zmq_array(frame, d_model: int) -> np.ndarray:
    """A received frame's rows, in place; copied only where zmq left a small message at an
    odd address inside its read buffer (numpy and the compiled combine want aligned floats)."""
    a = np.frombuffer(frame.buffer, np.float32).reshape(-1, d_model)
    return a if a.flags.aligned else a.copy()


def _zmq_worker(ctrl, experts: list[int], d_model: int, d_ff: int, seed: int, max_rows: int) -> None:
    import pickle

    import zmq
    from threadpoolctl import threadpool_limits

    from workers.expert import SwiGLUExpert
    threadpool_limits(1)
    ex = {e: SwiGLUExpert.from_seed(e, d_model, d_ff, seed=seed, max_tokens=max_rows) for e in experts}
    out = np.empty((max_rows, d_model), np.float32)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PAIR)
    ctrl.send(sock.bind_to_random_port("tcp://127.0.0.1"))
    try:
        while True:
            frames = sock.recv_multipart(copy=False)
            if len(frames) != 2:
                return
            groups = pickle.loads(frames[0].bytes)
            x = _zmq_array(frames[1], d_model)
            for e, start, count in groups:
                ex[e].forward(x[start:start + count], out[start:start + count])
            # zero-copy: the gateway's next request (after it has this reply) is what reuses `out`
            sock.send(out[:x.shape[0]], copy=False)
    finally:
        sock.close(linger=0)
        ctx.term()


class Zmq(System):
    """Multiprocessing's layer with pyzmq PAIR sockets over tcp (loopback) instead of pipes:
    each worker's rows go as one zero-copy message (the groups pickled beside them), its
    reply comes back as one; the same route, gather and combine."""

    name, backend = "pyzmq", "tcp"

    def __init__(self, router, n_workers: int, d_ff: int, seed: int, max_rows: int, timeout: float = 60.0):
        import zmq

        from gateway.dispatch import DispatchPlan
        self.router, self.plan_cls, self.timeout = router, DispatchPlan, timeout
        n_exp, d = router.n_experts, router.d_model
        self.owner = [e * n_workers // n_exp for e in range(n_exp)]
        ctx = mp.get_context("fork")
        self.procs, ports = [], []
        for w in range(n_workers):
            a, b = ctx.Pipe()
            p = ctx.Process(target=_zmq_worker, args=(b, [e for e in range(n_exp) if self.owner[e] == w],
                                                      d, d_ff, seed, max_rows), daemon=True)
            p.start()
            b.close()
            self.procs.append(p)
            if not a.poll(timeout):
                self.close()
                raise TimeoutError("pyzmq worker did not start")
            ports.append(a.recv())
            a.close()
        self.zctx = zmq.Context()  # after the forks: a context does not survive one
        self.socks = []
        for port in ports:
            s = self.zctx.socket(zmq.PAIR)
            s.connect(f"tcp://127.0.0.1:{port}")
            self.socks.append(s)
        self.n_workers = n_workers
        self.lock = threading.Lock()

    def forward(self, x: np.ndarray) -> np.ndarray:
        import pickle
        r = self.router.route(x)
        plan = self.plan_cls.build(r.topk_idx, r.topk_weights, self.owner, self.n_workers)
        busy = [w for w in range(self.n_workers) if plan.worker_tokens(w)]
        for w in busy:  # send to all before waiting
            self.socks[w].send_multipart([pickle.dumps(plan.groups(w)), plan.gather(x, w)], copy=False)
        outs: list = [None] * self.n_workers
        for w in busy:
            s = self.socks[w]
            if not s.poll(self.timeout * 1000):
                raise TimeoutError("pyzmq worker did not answer")
            outs[w] = _zmq_array(s.recv(copy=False), x.shape[1])
        return plan.combine(outs, np.empty_like(x))

    def pids(self) -> dict:
        return {f"worker{i}": p.pid for i, p in enumerate(self.procs)}

    def close(self) -> None:
        for s in getattr(self, "socks", []):
            try:
                s.send(b"", copy=True)  # one frame: quit
            except Exception:
                pass
        for p in self.procs:
            p.join(5)
            if p.is_alive():
                p.kill()
                p.join(5)
        for s in getattr(self, "socks", []):
            s.close(linger=0)
        if hasattr(self, "zctx"):
            self.zctx.term()


# -- Ray --------------------------------------------------------------------------------
class RayActors(System):
    """One Ray actor per expert; each pass routes here, sends every expert its rows as a
    task, ``ray.get``s them all and combines."""

    name, backend = "ray", "ray"

    def __init__(self, router, d_ff: int, seed: int, num_cpus: int = 2):
        try:
            import ray
        except ImportError:
            raise RuntimeError("ray is not installed (pip install 'moe-transport[ray]')") from None
        from gateway.dispatch import DispatchPlan
        self.ray, self.router, self.plan_cls = ray, router, DispatchPlan
        env = {k: "1" for k in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS")}
        ray.init(num_cpus=num_cpus, include_dashboard=False, log_to_driver=False, ignore_reinit_error=True,
                 runtime_env={"env_vars": env}, configure_logging=False)

        @ray.remote(num_cpus=0)  # 8 actors on 2 cores: they share them, as every peer here does
        class Expert:
            def __init__(self, e, d_model, d_ff, seed):
                from workers.expert import SwiGLUExpert
                self.ex = SwiGLUExpert.from_seed(e, d_model, d_ff, seed=seed, max_tokens=0)

            def forward(self, x):
                return self.ex(x)

            def pid(self):
                return os.getpid()

        n = router.n_experts
        self.actors = [Expert.remote(e, router.d_model, d_ff, seed) for e in range(n)]
        self._pids = ray.get([a.pid.remote() for a in self.actors], timeout=120)
        self.owner = list(range(n))
        self.lock = threading.Lock()

    def forward(self, x: np.ndarray) -> np.ndarray:
        r = self.router.route(x)
        plan = self.plan_cls.build(r.topk_idx, r.topk_weights, self.owner, len(self.actors))
        refs = {}
        for e, a in enumerate(self.actors):
            if plan.worker_tokens(e):
                refs[e] = a.forward.remote(plan.gather(x, e))
        got = dict(zip(refs, self.ray.get(list(refs.values()), timeout=120)))
        return plan.combine([got.get(e) for e in range(len(self.actors))], np.empty_like(x))

    def pids(self) -> dict:
        return {f"actor{e}": p for e, p in enumerate(self._pids)}

    def close(self) -> None:
        self.ray.shutdown()
