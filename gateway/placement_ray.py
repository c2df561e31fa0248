"""Ray placement: expert workers as Ray actors; the tensors stay on our transport.

    moe-gateway --placement ray --ray-address HEAD:6379 --ray-workers-per-node 2 --ray-cpus-per-worker 1

What Ray does here, and only this: it *places* each worker (an actor pinned to a node), it
*restarts* a worker whose process dies (``max_restarts``), and it *tells us where the worker
listens now* (a method call on the actor). Each actor runs the ordinary worker serve loop
(:class:`workers.daemon.WorkerDaemon`, the one ``moe-worker`` runs) in a thread of its own
process, listening on its node's address; the gateway connects straight to that URL over
tcp, shm or rdma, authenticated with the shared secret. No tensor ever goes through Ray's
object store or RPC: the only Ray calls are start, ``where`` (a small dict) and stop.

Placement. The nodes that can hold ``--ray-workers-per-node`` workers of
``--ray-cpus-per-worker`` CPUs each (the gateway's own node first) each get that many
workers; ``--ray-strategy`` decides which worker index goes where: ``spread`` deals them
round-robin over the nodes, so neighbouring expert blocks, and so the replicas of a block
(worker i also hosts the blocks of workers i-1, ..., i-replicas+1), sit on different nodes
and one node's loss leaves every replicated expert served; ``pack`` fills a node before
the next. Expert blocks and replicas are :func:`gateway.supervisor.placement`'s, as with
``--local-workers``.

Transport (``--ray-transport``). ``auto``: shm when the actor shares the gateway's host
*as shm needs it* (same kernel boot, same network namespace: the handshake is an abstract
Unix socket, same /dev/shm, same user), else rdma when the node has an RDMA device with a
RoCE v2 GID for its address, else tcp. ``shm`` uses only the gateway's own node; ``tcp`` and
``rdma`` are used as asked.

The shared secret reaches an actor as bytes in its constructor arguments, i.e. through
Ray's control plane (GCS), wrapped so it never prints. Why not a file path: a secret file
every node can read is one more thing to distribute and keep in sync on every node, while
the Ray cluster already is the trust boundary (anyone who may submit work to it runs code
as the worker's user on every node, and could read such a file anyway); the creation
arguments are kept by Ray for restarts, so a worker restarted on its node gets the secret
again with nothing on disk there. It is never on a command line nor in an environment
variable (both show in ``ps``/``/proc``, and a runtime_env's variables in Ray's state API).

Restarts. When a worker's connection is lost, the gateway asks the actor where it listens
(off the serve loop, in a thread: the call waits while Ray restarts the process) and, if
the URL changed, hands it to ``WorkerSet.set_url`` on the loop, which reconnects at once.
A worker restarted by Ray starts from its configured weights (a hot update it had taken is
not replayed). When the gateway goes (even SIGKILLed), Ray ends the actors with the job.

This module imports Ray only when a placement is started; nothing else in moe-transport
imports it.
"""
from __future__ import annotations

import argparse
import logging
import os
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Optional, Sequence

from transport.service.backoff import Backoff
from workers.flags import build_daemon, build_parser

if TYPE_CHECKING:
    from gateway.pool import WorkerPool

log = logging.getLogger("moe.ray")

STRATEGIES = ("spread", "pack")
TRANSPORTS = ("auto", "tcp", "shm", "rdma")
MAX_RESTARTS = -1  # Ray restarts a dead worker actor as often as it dies (-1: no limit)
ASK_TIMEOUT = 60.0  # one "where do you listen now" call at most (it waits out a restart)
ASK_BACKOFF = (0.2, 5.0)  # first and longest pause between asking an actor again
STOP_TIMEOUT = 10.0  # the actors' graceful drain at close, all together
EXIT_SERVE_LOOP_ENDED = 70  # the actor's process exit code when its serve loop ended by itself


class SharedSecret:
    """The secret's bytes, for an actor's constructor: pickles as itself, never prints."""

    __slots__ = ("value",)

    def __init__(self, value: bytes) -> None:
        self.value = bytes(value)

    def __repr__(self) -> str:
        return "SharedSecret(<redacted>)"

    __str__ = __repr__

    def __reduce__(self):
        return (SharedSecret, (self.value,))


# -- pure decisions (tested without Ray) -----------------------------------------------------
def host_key() -> tuple:
    """What two processes must share for shm:// between them: the kernel (boot id), the
    network namespace (the handshake's abstract Unix socket lives there), the /dev/shm mount
    and the user (the shm handshake checks the peer's uid)."""

    def ino(path: str) -> Optional[tuple]:
        try:
            st = os.stat(path)
            return (st.st_dev, st.st_ino)
        except OSError:
            return None

    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = None
    return (boot, ino("/proc/self/ns/net"), ino("/dev/shm"), os.getuid())


def node_has_rdma(ip: str) -> bool:
    """Whether this node has an RDMA device with a RoCE v2 GID for ``ip`` (and pyverbs)."""
    try:
        from transport.rdma_device import pick_device

        choice = pick_device(ip)
        __import__("transport.rdma")
    except Exception:  # no device, no matching GID, no pyverbs: not an rdma node
        return False
    return choice.ipv4 == ip


def choose_transport(requested: str, *, same_host: bool, has_rdma: Callable[[], bool]) -> str:
    """The scheme an actor listens on (``has_rdma`` is asked only when it matters)."""
    if requested not in TRANSPORTS:
        raise ValueError(f"--ray-transport must be one of {', '.join(TRANSPORTS)}, got {requested!r}")
    if requested == "shm" and not same_host:
        raise ValueError("--ray-transport shm: this worker does not share the gateway's host "
                         "(kernel, network namespace, /dev/shm and user)")
    if requested != "auto":
        return requested
    if same_host:
        return "shm"
    return "rdma" if has_rdma() else "tcp"


def listen_url(scheme: str, node_ip: str, name: str) -> str:
    if scheme == "shm":
        return f"shm://{name}"
    return f"{scheme}://{node_ip}:0"


@dataclass(frozen=True)
class NodeInfo:
    node_id: str
    ip: str
    cpus: float


def eligible_nodes(nodes: Sequence[dict], *, per_node: int, cpus_per_worker: float, gateway_node: str,
                   transport: str) -> list[NodeInfo]:
    """The alive nodes (``ray.nodes()`` entries) that can hold ``per_node`` workers, the
    gateway's own node first (then by address, so the order is stable); with shm, only the
    gateway's own node."""
    need = per_node * cpus_per_worker
    out = []
    for n in nodes:
        if not n.get("Alive"):
            continue
        info = NodeInfo(n["NodeID"], n.get("NodeManagerAddress", "?"), float(n.get("Resources", {}).get("CPU", 0.0)))
        if transport == "shm" and info.node_id != gateway_node:
            continue
        if info.cpus + 1e-9 >= need:
            out.append(info)
    return sorted(out, key=lambda i: (i.node_id != gateway_node, _ip_key(i.ip), i.node_id))


def _ip_key(ip: str) -> tuple:
    try:
        return tuple(int(p) for p in ip.split("."))
    except ValueError:
        return (1 << 16, ip)


def assign_nodes(nodes: Sequence[Any], per_node: int, strategy: str) -> list[Any]:
    """Worker index -> node: ``spread`` deals round-robin, ``pack`` fills a node first."""
    if strategy not in STRATEGIES:
        raise ValueError(f"--ray-strategy must be one of {', '.join(STRATEGIES)}, got {strategy!r}")
    if per_node < 1:
        raise ValueError(f"--ray-workers-per-node must be >= 1, got {per_node}")
    if strategy == "spread":
        return [n for _ in range(per_node) for n in nodes]
    return [n for n in nodes for _ in range(per_node)]


# -- what runs in the actor's process ----------------------------------------------------------
class WorkerHost:
    """A moe-worker inside a Ray actor's process: the serve loop in a thread of its own.

    ``argv``: moe-worker flags (``--experts``, ``--d-model``, ...; not ``--listen``, which the
    host decides from ``transport``, nor a secret). ``gateway_host``: the gateway's
    :func:`host_key`. ``cpu``: pin the serve thread there. Plain Python (Ray wraps it with
    ``ray.remote`` at run time), so it also runs without Ray, in tests.
    """

    def __init__(self, index: int, argv: Sequence[str], *, transport: str = "auto", gateway_host: tuple = (),
                 name: str = "moe-ray", secret: Optional[SharedSecret] = None, insecure: bool = False,
                 cpu: Optional[int] = None, node_ip: Optional[str] = None) -> None:
        from threadpoolctl import threadpool_limits

        from transport.service import options

        if node_ip is None:
            import ray

            node_ip = ray.util.get_node_ip_address()
        self.index, self.node_ip = index, node_ip
        args = build_parser().parse_args(list(argv))
        options.setup_logging(args.log_level, f"moe-worker[ray w{index}]")
        key = host_key()
        self.transport = choose_transport(transport, same_host=bool(gateway_host) and tuple(gateway_host) == key,
                                          has_rdma=lambda: node_has_rdma(node_ip))
        url = listen_url(self.transport, node_ip, f"{name}-w{index}-{os.getpid()}")
        value = secret.value if secret is not None else None
        try:
            options.check_exposure(url, value, insecure, "moe-worker (ray actor)")
        except options.UsageError as e:  # a plain error travels to the gateway through Ray
            raise ValueError(str(e)) from None
        self._limits = threadpool_limits(limits=args.blas_threads)
        self.daemon = build_daemon(args, url, value)
        self.url = self.daemon.url
        from transport.service.metrics import maybe_serve
        from workers.metrics import worker_registry

        # --metrics-port in argv (the gateway's --worker-metrics): a free port on the node
        self.metrics_url = maybe_serve(lambda: worker_registry(self.daemon), args)
        self.cpu = cpu
        self._stopping = False
        self._thread = threading.Thread(target=self._serve, daemon=True, name="moe-worker-serve")
        self._thread.start()

    def _serve(self) -> None:
        if self.cpu is not None:
            os.sched_setaffinity(0, [self.cpu])  # this thread: it does all the serving
        try:
            self.daemon.serve()
        except BaseException:
            log.exception("worker %d: the serve loop failed", self.index)
        if not self._stopping:
            # a worker that no longer serves must not look alive to Ray: end the process so
            # Ray restarts the actor (and the gateway learns the new URL)
            log.error("worker %d: the serve loop ended unasked; exiting for a restart", self.index)
            os._exit(EXIT_SERVE_LOOP_ENDED)

    def where(self) -> dict:
        """Where this worker listens, and what it is (small: Ray carries it)."""
        return {"index": self.index, "url": self.url, "pid": os.getpid(), "node_ip": self.node_ip,
                "transport": self.transport, "serving": self._thread.is_alive(), "metrics": self.metrics_url}

    def stop(self, timeout: float = STOP_TIMEOUT) -> bool:
        """Drain (answer what was sent, tell the gateway) and end the serve loop."""
        self._stopping = True
        self.daemon.request_stop()
        self._thread.join(timeout)
        return not self._thread.is_alive()


# -- the gateway's side -------------------------------------------------------------------------
@dataclass
class RayPlacement:
    """The ``--ray-*`` flags."""

    address: Optional[str] = None  # None: $RAY_ADDRESS, else what ray.init() does by itself
    workers_per_node: int = 1
    cpus_per_worker: float = 1.0
    strategy: str = "spread"
    transport: str = "auto"
    worker_cpus: Optional[Sequence[int]] = None  # pin worker i's serve thread to worker_cpus[i % len]
    start_timeout: float = 120.0
    max_restarts: int = MAX_RESTARTS


class RayWorkers:
    """Worker actors placed by Ray; ``urls[i]`` is where worker i listens now.

    A fleet (gateway/placement.py), like :class:`gateway.supervisor.LocalWorkers`;
    :meth:`attach` also lets it see which workers the pool has lost (the cue to ask their
    actors for a new URL). ``link[i]``: the pool's index of worker i.
    """

    def __init__(self, spec: RayPlacement, worker_flags: Callable[[int, list[int]], list[str]], *,
                 n_experts: int, replicas: int = 1, n_shared: int = 0, secret: Optional[bytes] = None,
                 insecure: bool = False) -> None:
        try:
            import ray
        except ImportError:
            raise RuntimeError("--placement ray needs Ray: pip install 'moe-transport[ray]'") from None
        from gateway.supervisor import placement

        choose_transport(spec.transport, same_host=True, has_rdma=lambda: False)  # validates the name
        self.ray = ray
        self.spec = spec
        self._owns_ray = not ray.is_initialized()
        if self._owns_ray:
            ray.init(address=spec.address, namespace="moe-transport", include_dashboard=False,
                     log_to_driver=True, configure_logging=False)
        self.actors: list = []
        self.urls: list[str] = []
        self.where: list[dict] = []
        self.restarts: list[int] = []
        self.post: Optional[Callable[[Callable[[], None]], None]] = None
        self.on_moved: Optional[Callable[[int, str], None]] = None
        self.links = None  # the pool's WorkerSet, once attached
        self.link: list[int] = []
        self._flags, self._secret, self._insecure = worker_flags, secret, insecure
        self._blocks: list = []
        self._gw_host, self._name = host_key(), f"moe-ray-{os.getpid()}-{os.urandom(3).hex()}"
        self._asking: set = set()
        self._next: list[float] = []
        self._backoff: list[Backoff] = []
        self._closed = False
        try:
            gateway_node = ray.get_runtime_context().get_node_id()
            nodes = eligible_nodes(ray.nodes(), per_node=spec.workers_per_node, cpus_per_worker=spec.cpus_per_worker,
                                   gateway_node=gateway_node, transport=spec.transport)
            if not nodes:
                raise RuntimeError(
                    f"no Ray node can hold {spec.workers_per_node} worker(s) of {spec.cpus_per_worker:g} CPU(s)"
                    + (" on the gateway's own node (--ray-transport shm)" if spec.transport == "shm" else "")
                    + f"; the cluster's nodes: {_describe(ray.nodes())}")
            order = assign_nodes(nodes, spec.workers_per_node, spec.strategy)
            self._blocks = placement(n_experts, len(order), replicas, n_shared)
            for i, node in enumerate(order):
                self.actors.append(self._actor(i, node.node_id))
            refs = [a.where.remote() for a in self.actors]
            ready, pending = ray.wait(refs, num_returns=len(refs), timeout=spec.start_timeout)
            if pending:
                raise RuntimeError(f"{len(pending)} of {len(refs)} Ray worker actor(s) did not start within "
                                   f"{spec.start_timeout:.0f} s (not enough free CPUs on their nodes?); "
                                   f"the cluster's nodes: {_describe(ray.nodes())}")
            self.where = ray.get(refs)
        except BaseException:
            self.close()
            raise
        self.urls = [w["url"] for w in self.where]
        self.link = list(range(len(self.actors)))
        self.restarts = [0] * len(self.actors)
        self._next = [0.0] * len(self.actors)
        self._backoff = [Backoff(*ASK_BACKOFF) for _ in self.actors]
        for w, node in zip(self.where, order):
            log.info("ray worker %d on node %s (%s): %s, pid %d%s", w["index"], node.ip, node.node_id[:8], w["url"],
                     w["pid"], f", metrics {w['metrics']}" if w.get("metrics") else "")

    def _actor(self, i: int, node_id: Optional[str]) -> Any:
        """Worker i's actor, with the block its number has: on node ``node_id``, or (None)
        wherever Ray finds a free CPU."""
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        spec, cpus = self.spec, list(self.spec.worker_cpus or [])
        wrapped = SharedSecret(self._secret) if self._secret is not None else None
        where = NodeAffinitySchedulingStrategy(node_id, soft=False) if node_id is not None else "SPREAD"
        return self.ray.remote(WorkerHost).options(
            num_cpus=spec.cpus_per_worker, max_restarts=spec.max_restarts,
            max_task_retries=-1,  # where/stop are idempotent: retried across a restart
            max_concurrency=2,  # stop() must run while where() may be waiting
            scheduling_strategy=where,
        ).remote(i, self._flags(i, self._blocks[i % len(self._blocks)]), transport=spec.transport,
                 gateway_host=self._gw_host, name=self._name, secret=wrapped, insecure=self._insecure,
                 cpu=cpus[i % len(cpus)] if cpus else None)

    # -- workers scale ---------------------------------------------------------------------------
    def start(self, n: int, done: Callable[[list], Optional[list]]) -> None:
        """Start ``n`` more worker actors wherever Ray finds room (in a thread); ``done(urls)``
        on the pool's loop returns the pool's indices for them."""
        ray, spec = self.ray, self.spec
        first = len(self.actors)

        def run() -> None:
            got = []
            for k in range(n):
                actor = self._actor(first + k, None)
                try:
                    got.append((actor, ray.get(actor.where.remote(), timeout=spec.start_timeout)))
                except Exception as e:  # no room on the cluster, say: what started serves
                    log.warning("ray: worker %d did not start: %s: %s", first + k, type(e).__name__, e)
                    try:
                        ray.kill(actor, no_restart=True)
                    except Exception:
                        pass
            self.post(lambda: self._started_new(got, done))

        threading.Thread(target=run, daemon=True, name="ray-scale-up").start()

    def _started_new(self, got: list, done: Callable[[list], Optional[list]]) -> None:
        first = len(self.actors)
        for actor, where in got:
            self.actors.append(actor)
            self.where.append(where)
            self.urls.append(where["url"])
            self.link.append(-1)
            self.restarts.append(0)
            self._next.append(0.0)
            self._backoff.append(Backoff(*ASK_BACKOFF))
        for k, index in enumerate(done([w["url"] for _, w in got]) or []):
            self.link[first + k] = index

    def stop(self, index: int) -> None:
        """End the actor of the pool's worker ``index`` (drained and removed), for good."""
        if index not in self.link:
            return
        i = self.link.index(index)
        actor, ray = self.actors[i], self.ray
        self.link[i] = -1

        def run() -> None:
            try:
                ray.get(actor.stop.remote(), timeout=STOP_TIMEOUT)
            except Exception as e:
                log.debug("stopping ray worker %d: %s", i, e)
            try:
                ray.kill(actor, no_restart=True)
            except Exception as e:
                log.debug("ray.kill: %s", e)

        threading.Thread(target=run, daemon=True, name=f"ray-stop-{i}").start()

    def attach(self, pool: "WorkerPool") -> None:
        """Follow ``pool``'s workers: hand moved URLs to it, on its loop."""
        self.links = pool.workers
        self.post = pool.loop.call_soon_threadsafe
        self.on_moved = pool.workers.set_url
        pool.loop.add_tick(self.tick)

    def pids(self) -> list[Optional[int]]:
        return [w.get("pid") for w in self.where]

    # -- on the loop ---------------------------------------------------------------------------
    def tick(self, now: float) -> Optional[float]:
        """Ask the actors of lost workers where they listen now (in threads)."""
        if self.links is None or self._closed:
            return None
        from gateway.worker_link import Health

        nxt = now + 0.25
        for i, index in enumerate(self.link):
            if index < 0:
                continue
            link = self.links[index]
            if link.state not in (Health.LOST, Health.REFUSED) or i in self._asking:
                continue
            if now >= self._next[i]:
                self._ask(i)
            else:
                nxt = min(nxt, self._next[i])
        return nxt

    def _ask(self, i: int) -> None:
        self._asking.add(i)
        actor, ray = self.actors[i], self.ray

        def run() -> None:
            try:
                got: Any = ray.get(actor.where.remote(), timeout=ASK_TIMEOUT)
            except Exception as e:  # the actor is dead for good, or slow to come back
                got = e
            post = self.post
            if post is not None and not self._closed:
                post(lambda: self._answered(i, got))

        threading.Thread(target=run, daemon=True, name=f"ray-where-{i}").start()

    def _answered(self, i: int, got: Any) -> None:
        self._asking.discard(i)
        if self._closed:
            return
        if isinstance(got, Exception):
            pause = self._backoff[i].next()
            self._next[i] = time.monotonic() + pause
            log.warning("ray worker %d: cannot learn where it listens (%s: %s); asking again in %.1f s",
                        i, type(got).__name__, got, pause)
            return
        old = self.where[i]
        self.where[i] = got
        if got["url"] == self.urls[i]:
            # same process, same URL: the pool's own reconnection takes it back; look again
            # later in case the process is replaced meanwhile
            self._next[i] = time.monotonic() + self._backoff[i].next()
            return
        self.restarts[i] += 1
        self._backoff[i].reset()
        self._next[i] = time.monotonic() + ASK_BACKOFF[0]
        log.warning("ray worker %d restarted (pid %s -> %s) at %s", i, old.get("pid"), got["pid"], got["url"])
        self.urls[i] = got["url"]
        if self.on_moved is not None and self.link[i] >= 0:
            self.on_moved(self.link[i], got["url"])

    # -- end -----------------------------------------------------------------------------------
    def close(self) -> None:
        """Drain the workers, end their actors for good, and leave the cluster."""
        self._closed = True
        ray = self.ray
        if self.actors:
            try:
                ray.wait([a.stop.remote() for a in self.actors], num_returns=len(self.actors), timeout=STOP_TIMEOUT)
            except Exception as e:  # a dead actor has nothing to drain
                log.debug("stopping ray workers: %s", e)
            for a in self.actors:
                try:
                    ray.kill(a, no_restart=True)
                except Exception as e:
                    log.debug("ray.kill: %s", e)
            self.actors = []
        if self._owns_ray and ray.is_initialized():
            ray.shutdown()
            self._owns_ray = False


def _describe(nodes: Sequence[dict]) -> str:
    return "; ".join(f"{n.get('NodeManagerAddress', '?')} {'alive' if n.get('Alive') else 'dead'} "
                     f"CPU={n.get('Resources', {}).get('CPU', 0):g}" for n in nodes) or "none"


def ray_workers(args: argparse.Namespace, secret: Optional[bytes], layers: Optional[dict],
                flags: Callable[[int, list], list]) -> RayWorkers:
    """The Ray placement ``moe-gateway --placement ray`` asks for (``args``: its flags;
    ``layers``: the gateway's checkpoint layers, whose experts every node reads from the
    same --checkpoint path; ``flags``: gateway/placement.py's worker flags)."""
    from gateway.config import served_ids

    spec = RayPlacement(address=args.ray_address, workers_per_node=args.ray_workers_per_node,
                        cpus_per_worker=args.ray_cpus_per_worker, strategy=args.ray_strategy,
                        transport=args.ray_transport, worker_cpus=args.worker_cpus,
                        start_timeout=args.ray_start_timeout)
    n_experts, n_shared, _ = served_ids(args, layers)

    build_parser().parse_args(flags(0, [0]))  # bad worker flags fail here, not in every actor
    return RayWorkers(spec, flags, n_experts=n_experts, replicas=args.replicas, n_shared=n_shared, secret=secret,
                      insecure=args.insecure)
