"""Several "hosts" on this machine, each a network namespace of its own with its own veth
address on one bridge, and a real Ray cluster across them (a head and worker nodes, started
with ``ray start --block``, each in its host's namespace).

Why namespaces: Ray binds the machine's own interface address by default and does not
reliably stay on 127.0.0.1; inside a namespace the test created, the only addresses are the
ones the test gave it, so nothing of Ray is reachable from, or binds, the machine's network.
Every process started here runs inside those namespaces, so "what is left" is exactly
``ip netns pids`` of each: :meth:`RayCluster.close` stops the nodes (SIGTERM to each
``ray start`` process group, which stops its raylet, GCS and workers), and
:meth:`NetnsLan.close` SIGKILLs by pid whatever is still in a namespace it made (reporting it)
and deletes the namespaces. Needs root and iproute2.

Used by the tests (tests/test_ray_cluster.py, tests/test_k8s.py, tests/test_load_run.py) and
by the cluster figures (bench/ray_figures.py). ``ROOT`` (the checkout) goes on the Ray nodes'
PYTHONPATH, so run it from a checkout.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from typing import Optional, Sequence

from transport.service.launch import blas_env

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RAY_PORT = 6379


class NetnsError(RuntimeError):
    """Namespaces cannot be made here (not root, no iproute2, not permitted)."""


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30, check=check)


class NetnsLan:
    """``n`` namespaces ``<tag>-h<i>`` with addresses 10.252.X.(i+1)/24, joined by a bridge
    in a namespace ``<tag>-sw`` of its own (so nothing is added to the machine's namespace).
    ``loopback_only``: one namespace with only ``lo`` up (no veth, no bridge)."""

    def __init__(self, n: int, tag: Optional[str] = None, *, loopback_only: bool = False) -> None:
        self.tag = tag or f"moer{os.getpid() % 100000}"
        self.n = n
        self.loopback_only = loopback_only
        x = (os.getpid() // 7) % 250 + 2
        self.names = [f"{self.tag}-h{i}" for i in range(n)]
        self.switch = f"{self.tag}-sw"
        self.ips = ["127.0.0.1"] * n if loopback_only else [f"10.252.{x}.{i + 1}" for i in range(n)]
        self._made: list[str] = []
        self.leaked: list[str] = []  # processes close() had to kill (pid + command line)

    def open(self) -> "NetnsLan":
        if os.geteuid() != 0:
            raise NetnsError("needs root to create network namespaces")
        if shutil.which("ip") is None:
            raise NetnsError("needs iproute2 (ip)")
        try:
            for name in ([] if self.loopback_only else [self.switch]) + self.names:
                try:
                    _ip("netns", "add", name)
                except subprocess.CalledProcessError as e:
                    raise NetnsError(f"`ip netns add` is not permitted here: {e.stderr.strip()}") from None
                self._made.append(name)
                _ip("-n", name, "link", "set", "lo", "up")
            if not self.loopback_only:
                _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
                _ip("-n", self.switch, "link", "set", "br0", "up")
                for i, name in enumerate(self.names):
                    dev, peer = f"{self.tag}v{i}", f"p{i}"
                    _ip("link", "add", dev, "netns", name, "type", "veth", "peer", "name", peer, "netns", self.switch)
                    _ip("-n", self.switch, "link", "set", peer, "master", "br0")
                    _ip("-n", self.switch, "link", "set", peer, "up")
                    _ip("-n", name, "addr", "add", f"{self.ips[i]}/24", "dev", dev)
                    _ip("-n", name, "link", "set", dev, "up")
        except BaseException:
            self.close()
            raise
        return self

    def exec(self, i: int) -> list[str]:
        """The command prefix that runs a program in host ``i``'s namespace."""
        return ["ip", "netns", "exec", self.names[i]]

    def pids(self) -> list[int]:
        """Every process in a namespace of ours (they can only be ours)."""
        out: list[int] = []
        for name in self._made:
            r = _ip("netns", "pids", name, check=False)
            out += [int(p) for p in r.stdout.split()]
        return out

    def close(self) -> list[str]:
        """Kill (by pid) whatever is still in our namespaces, then delete them; returns what
        had to be killed."""
        for pid in self.pids():
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    cmd = f.read().replace(b"\0", b" ").decode(errors="replace")[:160]
                os.kill(pid, signal.SIGKILL)
                self.leaked.append(f"{pid} {cmd}")
            except (OSError, ProcessLookupError):
                pass
        deadline = time.monotonic() + 10
        while self.pids() and time.monotonic() < deadline:
            time.sleep(0.1)
        for name in reversed(self._made):
            _ip("netns", "del", name, check=False)
        self._made = []
        return self.leaked

    def __enter__(self) -> "NetnsLan":
        return self.open()

    def __exit__(self, *exc) -> None:
        self.close()


def ray_env(temp_dir: Optional[str] = None) -> dict:
    """The environment of everything Ray runs here: our checkout importable (the actors
    import gateway.placement_ray), one BLAS thread, no usage stats, no SIGTERM drain wait.
    Token authentication is off: the cluster is reachable only from namespaces this test
    made (Ray 2.5x enables it by default; the token would be one more file to hand around)."""
    env = blas_env(1)
    env["PYTHONPATH"] = os.pathsep.join(p for p in [ROOT, env.get("PYTHONPATH", "")] if p)
    env.update(RAY_USAGE_STATS_ENABLED="0", RAY_AUTH_MODE="disabled", RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S="0",
               RAY_DEDUP_LOGS="0")
    env.pop("RAY_ADDRESS", None)
    if temp_dir:
        env["RAY_TMPDIR"] = temp_dir
    return env


class RayCluster:
    """A head in host 0 and a worker node in each other host of ``lan``.

    ``cpus[i]``: node i's logical CPUs (Ray's bookkeeping; the machine's cores are shared);
    ``resources[i]``: custom resources of node i. ``address`` is the head's GCS address.
    """

    def __init__(self, lan: NetnsLan, cpus: Sequence[float], resources: Optional[Sequence[dict]] = None,
                 object_store_mb: int = 80, env: Optional[dict] = None) -> None:
        if len(cpus) != lan.n:
            raise ValueError("one cpu count per host")
        self.lan = lan
        self.cpus = list(cpus)
        self.resources = list(resources or [{} for _ in cpus])
        self.object_store = object_store_mb << 20
        self.temp = tempfile.mkdtemp(prefix="moeray", dir="/tmp")  # short: Unix socket paths live under it
        self.env = ray_env(self.temp)
        self.env.update(env or {})  # e.g. RAY_worker_niceness (Ray's config: read by the nodes at start)
        self.procs: list[subprocess.Popen] = []
        self.logs: list[str] = []
        self.address = f"{lan.ips[0]}:{RAY_PORT}"

    def start(self, timeout: float = 180.0) -> "RayCluster":
        ray = os.path.join(os.path.dirname(sys.executable), "ray")
        try:
            for i in range(self.lan.n):
                argv = [ray, "start", "--block", "--node-ip-address", self.lan.ips[i],
                        "--num-cpus", str(self.cpus[i]), "--object-store-memory", str(self.object_store),
                        "--disable-usage-stats", "--include-log-monitor", "false"]
                if self.resources[i]:
                    argv += ["--resources", json.dumps(self.resources[i])]
                if i == 0:
                    argv += ["--head", "--port", str(RAY_PORT), "--include-dashboard", "false",
                             "--temp-dir", self.temp]
                else:
                    argv += ["--address", self.address]
                self._start_node(self.lan.exec(i) + argv, timeout)
        except BaseException:
            self.close()
            raise
        return self

    def _start_node(self, argv: list[str], timeout: float) -> None:
        log = os.path.join(self.temp, f"node{len(self.procs)}.log")
        with open(log, "wb") as out:
            # its own session: close() signals the node's whole process group by its id
            proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    env=self.env, start_new_session=True, cwd=ROOT)
        self.procs.append(proc)
        self.logs.append(log)
        deadline = time.monotonic() + timeout
        while True:
            with open(log, "rb") as f:
                text = f.read().decode(errors="replace")
            if "Ray runtime started" in text:
                return
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"ray node did not start ({'exited ' + str(proc.returncode) if proc.poll() is not None else 'timed out'}):\n{text[-3000:]}")
            time.sleep(0.2)

    def close(self, timeout: float = 30.0) -> None:
        """SIGTERM each node's process group (worker nodes first), wait for them to go."""
        for proc in reversed(self.procs):
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        deadline = time.monotonic() + timeout
        for proc in self.procs:
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        while self.lan.pids() and time.monotonic() < deadline:  # raylets reap their workers
            time.sleep(0.2)
        self.procs = []

    def tail(self, n: int = 2000) -> str:
        out = []
        for log in self.logs:
            try:
                with open(log, "rb") as f:
                    out.append(f"== {log}\n" + f.read().decode(errors="replace")[-n:])
            except OSError:
                pass
        return "\n".join(out)

    def remove_temp(self) -> None:
        shutil.rmtree(self.temp, ignore_errors=True)
