"""ComputeThread: the worker's expert compute, off the serve loop's thread.

With compute on the loop's thread, everything the transport does for a connection waits
while a batch computes: over tcp the next chunk's bytes stay in the kernel (the gateway,
which sends only to a connection whose socket has room, waits too) and a reply's socket
copy starts only after the batch. With one compute thread the loop keeps receiving into
the connection's slots and sending finished replies while the kernels run (they release
the GIL), and batches are still computed one at a time, in the order they came.

Jobs go in from the loop's thread; each job's result (its reply header, or the exception
it raised) goes back to the loop's thread through ``post`` (ServeLoop.call_soon_threadsafe),
where the message is released and the reply sent: a connection is only ever used by the
loop's thread.
"""
from __future__ import annotations

import queue
import threading
from typing import Any, Callable, Optional

_STOP = object()


class ComputeThread:
    def __init__(self, post: Callable[[Callable[[], None]], None], name: str = "moe-compute") -> None:
        self._post = post
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self.queued = 0  # submitted, not yet handed back (read by the loop's thread)
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, run: Callable[[], Any], done: Callable[[Any, Optional[BaseException]], None]) -> None:
        """Run ``run()`` on the compute thread, then ``done(result, None)`` -- or
        ``done(None, exception)`` -- on the loop's thread."""
        if not self._thread.is_alive():
            raise RuntimeError("the compute thread has stopped")
        self.queued += 1
        self._jobs.put((run, done))

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            if job is _STOP:
                return
            run, done = job
            try:
                result, err = run(), None
            except BaseException as e:  # handed back: the loop's thread decides what it costs
                result, err = None, e
            self._post(lambda done=done, result=result, err=err: self._finish(done, result, err))

    def _finish(self, done, result, err) -> None:
        self.queued -= 1
        done(result, err)

    def stop(self, timeout: float) -> bool:
        """Finish what was submitted (bounded by ``timeout``) and end the thread; whether it
        ended. Results it posts after the loop stopped are not run (their replies would have
        nowhere to go): the worker stops it only once nothing is in flight, or at its
        drain deadline."""
        self._jobs.put(_STOP)
        self._thread.join(timeout)
        return not self._thread.is_alive()
