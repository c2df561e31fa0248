"""Learn at once that an rdma:// connection's device is being removed.

``rdma link delete`` (or the netdev under a soft-RoCE device going away) deletes the
device's ``/dev/infiniband/uverbsN`` node first, then waits until every process has closed
the device: a driver without "disassociate" support (rxe, siw) cannot take it from under
its users, and tells them nothing. A connection that waits for its peer would keep the
device, and the removal, waiting forever. So each connection watches ``/dev/infiniband``
with inotify (an fd in the same epoll as its completion channels): the node's deletion
wakes it, it fails with a clear error, and closing it lets the removal finish.
"""
from __future__ import annotations

import ctypes
import os
import struct
from typing import Optional

IN_DELETE = 0x200
DEV_DIR = "/dev/infiniband"
VERBS_SYSFS = "/sys/class/infiniband_verbs"
_EVENT = struct.Struct("iIII")  # struct inotify_event: wd, mask, cookie, len; then the name

try:
    _libc: Optional[ctypes.CDLL] = ctypes.CDLL(None, use_errno=True)
    _libc.inotify_init1
except (OSError, AttributeError):  # not glibc/Linux: no watch, the connection works without
    _libc = None


def uverbs_node(device: str, sysfs: str = VERBS_SYSFS) -> Optional[str]:
    """The name of ``device``'s verbs node (``uverbs1`` for ``rxa``), or None."""
    try:
        names = os.listdir(sysfs)
    except OSError:
        return None
    for name in names:
        try:
            with open(os.path.join(sysfs, name, "ibdev")) as f:
                if f.read().strip() == device:
                    return name
        except OSError:
            continue
    return None


def parse_events(data: bytes) -> list[tuple[int, str]]:
    """(mask, name) of each inotify event in ``data``."""
    out, off = [], 0
    while off + _EVENT.size <= len(data):
        _, mask, _, n = _EVENT.unpack_from(data, off)
        name = data[off + _EVENT.size:off + _EVENT.size + n].split(b"\0", 1)[0]
        out.append((mask, name.decode(errors="replace")))
        off += _EVENT.size + n
    return out


class DeviceWatch:
    """An inotify fd that becomes readable when a node of ``dev_dir`` is deleted;
    :meth:`removed` says whether it was ``node`` (draining what was read)."""

    def __init__(self, fd: int, node: str, dev_dir: str):
        self.fd, self.node, self.dev_dir = fd, node, dev_dir
        self.gone = False

    @classmethod
    def open(cls, device: str, *, dev_dir: str = DEV_DIR, sysfs: str = VERBS_SYSFS) -> Optional["DeviceWatch"]:
        """A watch on ``device``, or None where it cannot be watched (no inotify, no verbs
        node in sysfs): the connection then learns of a removal only from its peer."""
        node = uverbs_node(device, sysfs)
        if _libc is None or node is None:
            return None
        fd = _libc.inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC)
        if fd < 0:
            return None
        if _libc.inotify_add_watch(fd, dev_dir.encode(), IN_DELETE) < 0:
            os.close(fd)
            return None
        w = cls(fd, node, dev_dir)
        if not os.path.exists(os.path.join(dev_dir, node)):  # removed before the watch began
            w.gone = True
        return w

    def fileno(self) -> int:
        return self.fd

    def removed(self) -> bool:
        """Read what the fd holds; True once our node was deleted."""
        while not self.gone:
            try:
                data = os.read(self.fd, 4096)
            except (BlockingIOError, InterruptedError):
                break
            if not data:
                break
            self.gone = any(mask & IN_DELETE and name == self.node for mask, name in parse_events(data))
        return self.gone

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
