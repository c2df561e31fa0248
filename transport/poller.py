"""One poller over many connections and listeners (selectors underneath).

A connection may already hold a complete message in user space (read ahead while it was
sending), in which case its fd is not readable: ``poll`` reports those first.
"""
from __future__ import annotations

import selectors
from typing import Any, Optional


class Poller:
    def __init__(self) -> None:
        self._sel = selectors.DefaultSelector()
        self._objs: dict[int, tuple[Any, Any]] = {}

    def register(self, obj: Any, data: Any = None, *, write: bool = False) -> None:
        """Watch ``obj.fileno()`` for reading (or, with ``write``, for writing: a handshake
        waiting for room in the kernel)."""
        self._sel.register(obj.fileno(), selectors.EVENT_WRITE if write else selectors.EVENT_READ, data)
        self._objs[obj.fileno()] = (obj, data)

    def modify(self, obj: Any, *, write: bool) -> None:
        fd = obj.fileno()
        self._sel.modify(fd, selectors.EVENT_WRITE if write else selectors.EVENT_READ, self._objs[fd][1])

    def unregister(self, obj: Any) -> None:
        for fd, (o, _) in list(self._objs.items()):
            if o is obj:
                self._sel.unregister(fd)
                del self._objs[fd]

    def __len__(self) -> int:
        return len(self._objs)

    def poll(self, timeout: Optional[float]) -> list[tuple[Any, Any]]:
        """Objects that are ready (a message pending or the fd readable), with their data."""
        ready = [(o, d) for o, d in self._objs.values() if getattr(o, "pending", lambda: False)()]
        # with messages already pending, still look (without waiting) at the fds, so a
        # connection that always has one buffered cannot starve the others
        events = self._sel.select(0 if ready else timeout)
        seen = {id(o) for o, _ in ready}
        return ready + [self._objs[key.fd] for key, _ in events
                        if key.fd in self._objs and id(self._objs[key.fd][0]) not in seen]

    def close(self) -> None:
        self._sel.close()
        self._objs.clear()
