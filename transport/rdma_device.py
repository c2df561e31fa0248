"""Which RDMA device, port and GID an rdma:// endpoint uses (sysfs only, no verbs calls).

RoCE v2 over IPv4 is what soft-RoCE and most Ethernet NICs speak: the GID to use is an
IPv4-mapped one (``::ffff:a.b.c.d``) whose ``gid_attrs/types/<idx>`` reads "RoCE v2".
The choice, in order: explicit ``device=``/``gid_index=`` options, then the environment
(``MOE_RDMA_DEVICE``, ``MOE_RDMA_GID_INDEX``), then the first active port with a RoCE v2
IPv4 GID, preferring the GID whose address is the endpoint's own IP.

Reading sysfs rather than querying each device keeps the choice cheap, testable with a
fake tree (``sysfs=``), and usable where no device can be opened (a clear error instead).
"""
from __future__ import annotations

import ipaddress
import os
import threading
from dataclasses import dataclass
from typing import Optional

from .errors import TransportError

#: held while this process opens a device context or a completion channel: rdma_verbs finds a
#: channel's fd as the one new "[infinibandevent]" fd, which another thread's open (a
#: context's async-event fd) must not make ambiguous
OPEN_LOCK = threading.Lock()

IB_SYSFS = "/sys/class/infiniband"
ENV_DEVICE = "MOE_RDMA_DEVICE"
ENV_GID_INDEX = "MOE_RDMA_GID_INDEX"
_V4_MAPPED = "0000:0000:0000:0000:0000:ffff:"


@dataclass(frozen=True)
class DeviceChoice:
    device: str  # e.g. "rxe0"
    port: int  # 1-based port number
    gid_index: int
    gid: str  # as sysfs prints it: 8 groups of 4 hex digits
    ipv4: Optional[str]  # the address a RoCE v2 IPv4 GID maps, else None
    roce_v2: bool


@dataclass(frozen=True)
class _Gid:
    index: int
    gid: str
    type: str
    ipv4: Optional[str]


def _read(path: str) -> Optional[str]:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:  # unpopulated GID entries fail with EINVAL
        return None


def gid_ipv4(gid: str) -> Optional[str]:
    """The IPv4 address of an IPv4-mapped GID (``0000:...:ffff:0a00:020f`` -> 10.0.2.15)."""
    if not gid.startswith(_V4_MAPPED):
        return None
    tail = gid[len(_V4_MAPPED):].replace(":", "")
    try:
        return str(ipaddress.IPv4Address(int(tail, 16)))
    except ValueError:
        return None


def list_devices(sysfs: Optional[str] = None) -> list[str]:
    sysfs = sysfs or IB_SYSFS
    try:
        return sorted(os.listdir(sysfs))
    except OSError:
        return []


def _ports(dev: str, sysfs: str) -> list[int]:
    try:
        return sorted(int(p) for p in os.listdir(os.path.join(sysfs, dev, "ports")) if p.isdigit())
    except OSError:
        return []


def port_active(dev: str, port: int, sysfs: Optional[str] = None) -> bool:
    sysfs = sysfs or IB_SYSFS
    state = _read(os.path.join(sysfs, dev, "ports", str(port), "state"))
    return state is not None and "ACTIVE" in state  # "4: ACTIVE"


def _populated(dev: str, port: int) -> Optional[list[str]]:
    """Indexes of the populated GIDs of a real device, from one verbs query: reading every
    sysfs entry of a 1024-entry table (most of them empty, EINVAL) takes seconds under
    emulation. None when the device cannot be opened (then sysfs is scanned)."""
    try:
        from pyverbs.device import Context
        with OPEN_LOCK, Context(name=dev) as ctx:
            n = ctx.query_port(port).gid_tbl_len
            return [str(e.gid_index) for e in ctx.query_gid_table(max(n, 1)) if e.port_num == port]
    except Exception:
        return None


def _gids(dev: str, port: int, sysfs: str) -> list[_Gid]:
    pdir = os.path.join(sysfs, dev, "ports", str(port))
    names = _populated(dev, port) if sysfs == "/sys/class/infiniband" else None
    if names is None:
        try:
            names = sorted((n for n in os.listdir(os.path.join(pdir, "gids")) if n.isdigit()), key=int)
        except OSError:
            return []
    out = []
    for name in names:
        gid = _read(os.path.join(pdir, "gids", name))
        if not gid or gid.replace("0", "").replace(":", "") == "":
            continue  # empty slot of the table
        typ = _read(os.path.join(pdir, "gid_attrs", "types", name)) or ""
        out.append(_Gid(int(name), gid, typ, gid_ipv4(gid)))
    return out


def _env_int(name: str) -> Optional[int]:
    v = os.environ.get(name)
    if v is None or v.strip() == "":
        return None
    try:
        return int(v)
    except ValueError:
        raise TransportError(f"{name}={v!r} is not a GID index") from None


def pick_device(ip: Optional[str] = None, *, device: Optional[str] = None,
                gid_index: Optional[int] = None, port: Optional[int] = None,
                sysfs: Optional[str] = None) -> DeviceChoice:
    """Choose (device, port, GID) for an endpoint whose local address is ``ip``.

    Raises TransportError with what was found when nothing fits.
    """
    sysfs = sysfs or IB_SYSFS
    device = device or os.environ.get(ENV_DEVICE) or None
    if gid_index is None:
        gid_index = _env_int(ENV_GID_INDEX)
    found = list_devices(sysfs)
    if not found:
        raise TransportError(f"no RDMA device ({sysfs} is empty or missing); on a machine "
                             "without RDMA, `python -m tests.rxe.vm` gives a soft-RoCE guest")
    if device is not None and device not in found:
        raise TransportError(f"RDMA device {device!r} not found (have {found})")
    candidates = []  # (device, port, gid) on active ports
    inactive = []
    for dev in [device] if device else found:
        for p in [port] if port else _ports(dev, sysfs):
            if not port_active(dev, p, sysfs):
                inactive.append(f"{dev}/{p}")
                continue
            for g in _gids(dev, p, sysfs):
                candidates.append((dev, p, g))
    if gid_index is not None:
        for dev, p, g in candidates:
            if g.index == gid_index:
                return DeviceChoice(dev, p, g.index, g.gid, g.ipv4, g.type == "RoCE v2")
        raise TransportError(f"GID index {gid_index} is not populated on an active port of "
                             f"{device or ', '.join(found)} (inactive ports: {', '.join(inactive) or 'none'})")
    v2 = [(d, p, g) for d, p, g in candidates if g.type == "RoCE v2" and g.ipv4]
    if not v2:
        raise TransportError(f"no active port with a RoCE v2 IPv4 GID on {device or ', '.join(found)} "
                             f"(inactive ports: {', '.join(inactive) or 'none'}); set {ENV_GID_INDEX} "
                             "or gid_index= to use another GID")
    chosen = v2[0]
    if ip:
        for c in v2:
            if c[2].ipv4 == ip:
                chosen = c
                break
    dev, p, g = chosen
    return DeviceChoice(dev, p, g.index, g.gid, g.ipv4, True)
