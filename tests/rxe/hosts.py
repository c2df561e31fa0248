"""Several RDMA "hosts" in one soft-RoCE guest, joined by a link the tests control.

Runs in the rxe guest (root, stdlib only, Debian's Python 3.11). Each host is an rxe device
on its own veth, an address from 198.18.0.0/24 (RFC 2544's benchmarking range: used on this
link only, routed nowhere, no default route) and a user id its processes run as. The veths'
other ends sit on a bridge in the network namespace ``moe-wire``: the "switch", where a
test cuts a host's cable (``cut``) or makes its port misbehave (``netem``).

Why not a network namespace per host: Debian bookworm's 6.1 rxe sends from the initial
namespace only (work requests of a device whose netdev was moved complete in error, and
``rdma dev set ... netns`` is not supported). So every host's netdev stays in the initial
namespace, and policy routing makes what a host sends leave through its own veth instead
of the loopback the kernel would otherwise pick for an address of its own:

- the ``local`` table's rule moves from preference 0 to 100;
- rule 10 ``from <host ip> iif lo``: what rxe sends from the host's GID (its route lookup
  carries the source address), and replies of the host's sockets;
- rule 11 ``uidrange <uid>``: sockets of the host's processes that connect without a
  source address (the TCP side channel of rdma://, the gateway's connections);
- both lead to the host's table, which routes the *other* hosts' addresses through its
  veth, with permanent neighbour entries (no ARP on a link a test may cut);
- ``accept_local``: a packet from an address that is local here arrives on another veth.

A packet from host A to host B therefore crosses A's veth, the bridge and B's veth, both
the RoCE v2 datagrams and the TCP side channel, exactly where the faults are applied.
"""
from __future__ import annotations

import dataclasses
import os
import shutil
import subprocess
import time
from typing import Optional, Sequence

SUBNET = "198.18.0"
WIRE_NS = "moe-wire"
BRIDGE = "br-moe"
FIRST_UID = 1001
LOCAL_PREF = 100
HOME_ROOT = "/tmp/moe-hosts"
WIRE_MTU = 9000  # the switch takes jumbo frames; a host's own veth MTU is what limits it
_V4_MAPPED = "0000:0000:0000:0000:0000:ffff:"


def sh(*args: str, timeout: float = 30.0, check: bool = True) -> str:
    """Run a command; its stdout. ``check=False``: failures (a timeout too) give ""."""
    try:
        r = subprocess.run(list(args), capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        if check:
            raise
        return ""
    if check and r.returncode != 0:
        raise RuntimeError(f"{' '.join(args)}: exit {r.returncode}: {r.stderr.strip()}")
    return r.stdout


def wire(*args: str, check: bool = True) -> str:
    """``ip``/``tc`` inside the switch's namespace."""
    return sh("ip", "netns", "exec", WIRE_NS, *args, check=check)


@dataclasses.dataclass
class Host:
    name: str  # "a", "b", ...
    index: int  # 1-based: the address's last byte
    device: str  # rxe device, e.g. "rxa"
    netdev: str  # the host's veth end (initial namespace)
    port: str  # the switch's veth end (in WIRE_NS)
    uid: int
    mac: str

    @property
    def ip(self) -> str:
        return f"{SUBNET}.{self.index}"

    @property
    def table(self) -> int:
        return 100 + self.index

    @property
    def home(self) -> str:
        return f"{HOME_ROOT}/{self.name}"

    def gid_index(self) -> Optional[int]:
        """The RoCE v2 GID index of the host's address, or None (not populated yet)."""
        want = _V4_MAPPED + "{:02x}{:02x}:{:02x}{:02x}".format(*map(int, self.ip.split(".")))
        base = f"/sys/class/infiniband/{self.device}/ports/1"
        for i in range(16):
            try:
                with open(f"{base}/gids/{i}") as f:
                    gid = f.read().strip()
                with open(f"{base}/gid_attrs/types/{i}") as f:
                    typ = f.read().strip()
            except OSError:
                continue
            if gid == want and typ == "RoCE v2":
                return i
        return None

    def env(self, base: Optional[dict] = None) -> dict:
        """The environment of a process on this host: its device, address and own copy of
        the shared secret (a host's processes cannot read another user's files)."""
        env = dict(os.environ if base is None else base)
        env.update(MOE_RDMA_DEVICE=self.device, MOE_RDMA_IP=self.ip, HOME=self.home,
                   MOE_SECRET_FILE=f"{self.home}/secret")
        env.pop("MOE_RDMA_GID_INDEX", None)
        return env

    def argv(self, argv: Sequence[str]) -> list:
        """``argv`` run as this host's user (setpriv execs: the pid is the program's)."""
        return ["setpriv", f"--reuid={self.uid}", f"--regid={self.uid}", "--clear-groups", "--", *argv]

    @property
    def python(self) -> str:
        """A python3 that runs as this host's user (for tools that take an interpreter path)."""
        return f"{HOME_ROOT}/bin/python-{self.name}"

    def popen(self, argv: Sequence[str], **kw) -> subprocess.Popen:
        kw["env"] = self.env(kw.get("env"))
        return subprocess.Popen(self.argv(argv), **kw)

    def run(self, argv: Sequence[str], timeout: float = 120.0, **kw) -> subprocess.CompletedProcess:
        kw["env"] = self.env(kw.get("env"))
        return subprocess.run(self.argv(argv), timeout=timeout, capture_output=True, text=True, **kw)

    def port_state(self) -> str:
        try:
            with open(f"/sys/class/infiniband/{self.device}/ports/1/state") as f:
                return f.read().split(":")[-1].strip()
        except OSError:
            return "GONE"


class Link:
    """The hosts and their switch; ``close()`` (or the context manager) undoes everything."""

    def __init__(self, names: Sequence[str] = ("a", "b", "c"), secret: Optional[bytes] = None):
        self.hosts = [Host(n, i + 1, f"rx{n}", f"mh-{n}", f"mw-{n}", FIRST_UID + i, f"02:00:c6:12:00:{i + 1:02x}")
                      for i, n in enumerate(names)]
        self._secret = secret
        self._made = False

    def __getitem__(self, name: str) -> Host:
        for h in self.hosts:
            if h.name == name:
                return h
        raise KeyError(name)

    # ------------------------------------------------------------------ set-up
    def up(self, timeout: float = 30.0) -> "Link":
        sh("modprobe", "-a", "bridge", "sch_netem")
        self._made = True
        sh("ip", "netns", "add", WIRE_NS)
        wire("ip", "link", "add", BRIDGE, "type", "bridge")
        wire("ip", "link", "set", BRIDGE, "mtu", str(WIRE_MTU), "up")
        for k in ("all", "default"):
            sh("sysctl", "-qw", f"net.ipv4.conf.{k}.rp_filter=0", f"net.ipv4.conf.{k}.accept_local=1")
        for h in self.hosts:
            self._plug(h)
        # the local table after the hosts' rules: an address of our own must not short-cut
        sh("ip", "rule", "add", "pref", str(LOCAL_PREF), "lookup", "local")
        sh("ip", "rule", "del", "pref", "0", "lookup", "local")
        for h in self.hosts:
            self._route(h)
            self._home(h)
            sh("rdma", "link", "add", h.device, "type", "rxe", "netdev", h.netdev)
        self.wait_ready(timeout)
        return self

    def _plug(self, h: Host) -> None:
        sh("ip", "link", "add", h.netdev, "type", "veth", "peer", "name", h.port)
        sh("ip", "link", "set", h.port, "netns", WIRE_NS)
        wire("ip", "link", "set", h.port, "mtu", str(WIRE_MTU), "master", BRIDGE, "up")
        sh("ip", "link", "set", h.netdev, "address", h.mac, "up")
        sh("ip", "addr", "add", f"{h.ip}/24", "dev", h.netdev, "noprefixroute")
        sh("sysctl", "-qw", f"net.ipv4.conf.{h.netdev}.rp_filter=0", f"net.ipv4.conf.{h.netdev}.accept_local=1")

    def _route(self, h: Host) -> None:
        for o in self.hosts:
            if o is h:
                continue
            sh("ip", "route", "add", f"{o.ip}/32", "dev", h.netdev, "src", h.ip, "table", str(h.table))
            sh("ip", "neigh", "replace", o.ip, "lladdr", o.mac, "dev", h.netdev, "nud", "permanent")
        sh("ip", "rule", "add", "pref", "10", "from", h.ip, "iif", "lo", "lookup", str(h.table))
        sh("ip", "rule", "add", "pref", "11", "uidrange", f"{h.uid}-{h.uid}", "lookup", str(h.table))

    def _home(self, h: Host) -> None:
        os.makedirs(f"{HOME_ROOT}/bin", mode=0o755, exist_ok=True)
        with open(h.python, "w") as f:
            f.write("#!/bin/sh\nexec " + " ".join(h.argv(["python3"])) + ' "$@"\n')
        os.chmod(h.python, 0o755)
        os.makedirs(h.home, mode=0o700, exist_ok=True)
        os.chown(h.home, h.uid, h.uid)
        src = os.environ.get("MOE_SECRET_FILE")
        secret = self._secret
        if secret is None and src:
            with open(src, "rb") as f:
                secret = f.read().strip()
        if secret is not None:
            path = f"{h.home}/secret"
            with open(path, "wb") as f:
                f.write(secret + b"\n")
            os.chmod(path, 0o600)
            os.chown(path, h.uid, h.uid)

    def wait_ready(self, timeout: float = 30.0, hosts: Optional[Sequence[Host]] = None) -> None:
        """Until every host's device is ACTIVE with its RoCE v2 address GID."""
        end = time.monotonic() + timeout
        for h in hosts or self.hosts:
            while h.port_state() != "ACTIVE" or h.gid_index() is None:
                if time.monotonic() > end:
                    raise RuntimeError(f"{h.device}: port {h.port_state()}, GID {h.gid_index()} after {timeout} s")
                time.sleep(0.05)

    # ------------------------------------------------------------------ faults
    def netem(self, h: Host, spec: str) -> None:
        """tc netem ``spec`` (e.g. "loss 1% reorder 0.1% delay 2ms") on both directions of
        the host's cable: its veth's egress and the switch port's egress towards it."""
        args = spec.split()
        sh("tc", "qdisc", "replace", "dev", h.netdev, "root", "netem", *args)
        wire("tc", "qdisc", "replace", "dev", h.port, "root", "netem", *args)

    def clear(self, h: Host) -> None:
        sh("tc", "qdisc", "del", "dev", h.netdev, "root", check=False)
        wire("tc", "qdisc", "del", "dev", h.port, "root", check=False)

    def cut(self, h: Host) -> None:
        """Pull the host's cable: the switch port goes down, the host's veth loses carrier."""
        wire("ip", "link", "set", h.port, "down")

    def mend(self, h: Host, wait: bool = True) -> None:
        wire("ip", "link", "set", h.port, "up")
        if wait:
            self.wait_ready(hosts=[h])

    def set_mtu(self, h: Host, mtu: int) -> None:
        """The host's veth MTU: rxe's active path MTU follows it (1500 -> 1024, 9000 -> 4096)."""
        sh("ip", "link", "set", h.netdev, "mtu", str(mtu))

    def delete_device(self, h: Host) -> subprocess.Popen:
        """``rdma link delete``: it returns only once every process has closed the device
        (rxe cannot take a device from under its users), so it runs in the background."""
        return subprocess.Popen(["rdma", "link", "delete", h.device], stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True)

    def add_device(self, h: Host) -> None:
        sh("rdma", "link", "add", h.device, "type", "rxe", "netdev", h.netdev)
        self.wait_ready(hosts=[h])

    def counters(self, h: Host) -> dict:
        """The host veth's packet counters (what crossed its cable)."""
        base = f"/sys/class/net/{h.netdev}/statistics"
        return {k: int(open(f"{base}/{k}").read()) for k in ("tx_packets", "rx_packets", "tx_bytes", "rx_bytes")}

    # ------------------------------------------------------------------ teardown
    def restore(self) -> None:
        """Undo every fault (between tests): no qdisc, cables in, MTUs back, devices there."""
        for h in self.hosts:
            self.clear(h)
            wire("ip", "link", "set", h.port, "up", check=False)
            sh("ip", "link", "set", h.netdev, "mtu", "1500", check=False)
            if not os.path.exists(f"/sys/class/infiniband/{h.device}"):
                self.add_device(h)
        self.wait_ready()

    def close(self) -> None:
        if not self._made:
            return
        self._made = False
        for h in self.hosts:
            sh("rdma", "link", "delete", h.device, check=False, timeout=60)
            sh("ip", "rule", "del", "pref", "10", "from", h.ip, "iif", "lo", check=False)
            sh("ip", "rule", "del", "pref", "11", "uidrange", f"{h.uid}-{h.uid}", check=False)
            sh("ip", "route", "flush", "table", str(h.table), check=False)
            sh("ip", "link", "del", h.netdev, check=False)
            shutil.rmtree(h.home, ignore_errors=True)
        shutil.rmtree(HOME_ROOT, ignore_errors=True)
        sh("ip", "rule", "add", "pref", "0", "lookup", "local", check=False)  # EEXIST if there
        sh("ip", "rule", "del", "pref", str(LOCAL_PREF), "lookup", "local", check=False)
        sh("ip", "netns", "del", WIRE_NS, check=False)

    def __enter__(self) -> "Link":
        return self.up()

    def __exit__(self, *exc) -> None:
        self.close()
