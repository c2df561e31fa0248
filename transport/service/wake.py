"""A pipe a poller watches, so a signal handler or another thread can wake a serve loop."""
from __future__ import annotations

import os


class WakePipe:
    def __init__(self) -> None:
        self.r, self.w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)

    def fileno(self) -> int:
        return self.r

    def wake(self) -> None:
        """Safe from a signal handler and from any thread."""
        try:
            os.write(self.w, b"x")
        except OSError:
            pass  # already awake (the pipe is full) or closing

    def drain(self) -> None:
        try:
            while os.read(self.r, 512):
                pass
        except OSError:
            pass

    def close(self) -> None:
        for fd in (self.r, self.w):
            try:
                os.close(fd)
            except OSError:
                pass
        self.r = self.w = -1
