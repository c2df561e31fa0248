"""One poller over many connections and listeners (selectors underneath).

A connection may already hold a complete message in user space (read ahead while it was
sending), in which case its fd is not readable: ``poll`` reports those first.

Asking every connection whether it holds one costs a call per connection per poll, which a
server with a thousand idle clients pays on every request. An object registered ``lazy`` is
asked only when it could have read ahead: it was reported ready by the previous poll (the
caller then used it), or the caller :meth:`mark`-ed it (it sent on it).
"""
from __future__ import annotations

import selectors
from typing import Any, Optional


class Poller:
    def __init__(self) -> None:
        self._sel = selectors.DefaultSelector()
        self._objs: dict[int, tuple[Any, Any]] = {}
        self._fds: dict[int, int] = {}  # id(obj) -> fd (unregister works after obj closed its fd)
        self._eager: dict[int, tuple[Any, Any]] = {}  # asked for pending() at every poll
        self._hot: dict[int, tuple[Any, Any]] = {}  # lazy ones to ask at the next poll

    def register(self, obj: Any, data: Any = None, *, write: bool = False, lazy: bool = False) -> None:
        """Watch ``obj.fileno()`` for reading (or, with ``write``, for writing: a handshake
        waiting for room in the kernel). ``lazy``: see the module docstring."""
        fd = obj.fileno()
        self._sel.register(fd, selectors.EVENT_WRITE if write else selectors.EVENT_READ, data)
        self._objs[fd] = (obj, data)
        self._fds[id(obj)] = fd
        if hasattr(obj, "pending"):
            (self._hot if lazy else self._eager)[fd] = (obj, data)  # a new one may hold a message

    def mark(self, obj: Any) -> None:
        """``obj`` was used outside a poll (sent on): ask it for a pending message next time."""
        fd = self._fds.get(id(obj))
        if fd is not None and fd not in self._eager and hasattr(obj, "pending"):
            self._hot[fd] = self._objs[fd]

    def modify(self, obj: Any, *, write: bool, read: bool = False) -> None:
        """Watch for writing (with ``read``: for reading too) or, without ``write``, for
        reading only."""
        fd = obj.fileno()
        events = (selectors.EVENT_WRITE | (selectors.EVENT_READ if read else 0)) if write else selectors.EVENT_READ
        self._sel.modify(fd, events, self._objs[fd][1])

    def unregister(self, obj: Any) -> None:
        fd = self._fds.pop(id(obj), None)
        if fd is None or self._objs.get(fd, (None,))[0] is not obj:
            return
        self._sel.unregister(fd)
        del self._objs[fd]
        self._eager.pop(fd, None)
        self._hot.pop(fd, None)

    def __len__(self) -> int:
        return len(self._objs)

    def poll(self, timeout: Optional[float]) -> list[tuple[Any, Any]]:
        """Objects that are ready (a message pending or the fd readable), with their data."""
        hot, self._hot = self._hot, {}
        ready = [(o, d) for o, d in self._eager.values() if o.pending()]
        ready += [(o, d) for o, d in hot.values() if o.pending()]
        # with messages already pending, still look (without waiting) at the fds, so a
        # connection that always has one buffered cannot starve the others
        events = self._sel.select(0 if ready else timeout)
        seen = {id(o) for o, _ in ready}
        out = ready + [self._objs[key.fd] for key, _ in events
                       if key.fd in self._objs and id(self._objs[key.fd][0]) not in seen]
        for o, d in out:  # the caller uses these now: they may read ahead
            fd = self._fds.get(id(o))
            if fd is not None and fd not in self._eager and hasattr(o, "pending"):
                self._hot[fd] = (o, d)
        return out

    def close(self) -> None:
        self._sel.close()
        self._objs.clear()
        self._fds.clear()
        self._eager.clear()
        self._hot.clear()
