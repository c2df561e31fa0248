"""What the fault, fuzz and chaos tests share: process probes (/proc), raw sockets to a live
service's handshake port, hostile hellos, tokens steered onto chosen experts, and running a
snippet of Python as another local user."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
from typing import Iterable, Optional

import numpy as np

from transport import framing

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHM_SOCK_PREFIX = "\0moe-transport/shm/"
NOBODY = 65534


# -- process probes --------------------------------------------------------------------------
def rss_kb(pid: int) -> int:
    """Resident set size now (VmRSS), in KiB."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise RuntimeError(f"no VmRSS for pid {pid}")


def fd_count(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def proc_state(pid: int) -> Optional[str]:
    """The one-letter state (R, S, T, Z, ...) or None when the pid is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(") ", 1)[1][0]
    except OSError:
        return None


def cpu_seconds(pid: int) -> float:
    """User + system CPU of ``pid`` (its threads included), seconds."""
    with open(f"/proc/{pid}/stat") as f:
        parts = f.read().rsplit(") ", 1)[1].split()
    return (int(parts[11]) + int(parts[12])) / os.sysconf("SC_CLK_TCK")


def children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(p) for p in f.read().split()]
    except OSError:
        return []


# -- raw sockets -------------------------------------------------------------------------------
def raw_connect(url: str, timeout: float = 5.0) -> socket.socket:
    """A plain socket to where ``url``'s handshake happens (the tcp port, or the shm
    listener's abstract Unix socket): a peer that speaks whatever bytes a test likes."""
    scheme, _, rest = url.partition("://")
    if scheme == "tcp":
        host, _, port = rest.rpartition(":")
        s = socket.create_connection((host.strip("[]"), int(port)), timeout=timeout)
    elif scheme == "shm":
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(timeout)
        s.connect(SHM_SOCK_PREFIX + rest)
    else:
        raise ValueError(f"no raw socket for {url}")
    return s


def hello_fields(backend: str, **fields) -> dict:
    """A client HELLO as the real one looks (no auth), with ``fields`` overriding it."""
    h = {"transport": "moe-transport", "version": framing.VERSION, "backend": backend, "role": "client",
         "nonce": os.urandom(32), "auth": None, "slot_size": 4096, "nslots": 2}
    if backend == "shm":
        h["ring_bytes"] = 1 << 16
    h.update(fields)
    return h


def hello_bytes(backend: str, **fields) -> bytes:
    return b"".join(framing.encode_hello(hello_fields(backend, **fields)))


def read_until_closed(s: socket.socket, timeout: float = 5.0, limit: int = 1 << 20) -> bytes:
    """Everything the server sends until it closes (or ``timeout``)."""
    s.settimeout(timeout)
    got = b""
    try:
        while len(got) < limit:
            chunk = s.recv(65536)
            if not chunk:
                break
            got += chunk
    except (socket.timeout, ConnectionResetError):
        pass
    return got


# -- routing -----------------------------------------------------------------------------------
def steered_tokens(router, n: int, *, within: Iterable[int] = (), touching: Iterable[int] = (),
                   seed: int = 0, d_model: Optional[int] = None) -> np.ndarray:
    """``n`` tokens whose top-k experts (by ``router``) all lie ``within`` a set, or at least
    one of which is in ``touching`` (rejection sampling: the router is the gateway's own)."""
    within, touching = set(within), set(touching)
    rng = np.random.default_rng(seed)
    d = d_model or router.d_model
    out: list = []
    while len(out) < n:
        x = rng.standard_normal((256, d)).astype(np.float32)
        idx = router.route(x).topk_idx
        for row, experts in zip(x, idx):
            es = set(int(e) for e in experts if e >= 0)
            if within and not es <= within:
                continue
            if touching and not es & touching:
                continue
            out.append(row)
    return np.stack(out[:n])


# -- another local user ------------------------------------------------------------------------
def run_as_nobody(code: str, imports: str = "", timeout: float = 60.0) -> subprocess.CompletedProcess:
    """Run ``code`` as uid/gid 65534 (nobody), after ``imports`` ran as us (nobody cannot
    read root's venv); needs root. The environment is ours (MOE_SECRET_FILE included: the
    point is that nobody cannot read it)."""
    prog = (f"import os, sys\nsys.path.insert(0, {REPO!r})\n{imports}\n"
            f"os.setgroups([]); os.setgid({NOBODY}); os.setuid({NOBODY})\n{code}\n")
    return subprocess.run([sys.executable, "-c", prog], cwd="/", capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, "PYTHONPATH": REPO})
