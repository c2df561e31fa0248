"""Where a gateway's workers come from: its fleet, behind one small protocol.

Three fleets, chosen by the serve command's flags:

- ``--workers URLS``: workers started by someone else; the gateway only connects (no fleet:
  ``workers add/remove`` still work, ``workers scale`` does not);
- ``--local-workers N``: child processes the gateway starts, supervises and respawns
  (:class:`gateway.supervisor.LocalWorkers`);
- ``--placement ray``: worker actors Ray places and restarts
  (:class:`gateway.placement_ray.RayWorkers`).

A fleet has the URLs of its workers, follows the pool once attached (it hands a worker's new
URL to the pool when it restarted elsewhere), starts and stops workers when asked
(``workers scale``), and stops them all at close. What a worker is started with (its
moe-worker flags) is built once here, for both fleets.
"""
from __future__ import annotations

import argparse
import os
from typing import TYPE_CHECKING, Callable, Optional, Protocol

if TYPE_CHECKING:
    from gateway.pool import WorkerPool

#: a fleet's workers, numbered like the pool's links: ``(index, experts) -> moe-worker flags``
WorkerFlags = Callable[[int, list], list]


class Fleet(Protocol):
    urls: list

    def attach(self, pool: "WorkerPool") -> None:
        """Follow ``pool``'s workers on its loop (reconnect a worker that moved)."""

    def start(self, n: int, done: Callable[[list], None]) -> None:
        """Start ``n`` more workers in the background; ``done(urls)`` runs on the pool's loop
        once they listen (an empty list if they could not start)."""

    def stop(self, index: int) -> None:
        """Stop worker ``index`` (already drained and removed from the pool), in the background."""

    def pids(self) -> list:
        """Each worker's process id (None where it has none now)."""

    def close(self) -> None:
        """Stop every worker."""


def worker_flags(args: argparse.Namespace, layers: Optional[dict] = None) -> WorkerFlags:
    """The moe-worker flags of worker ``i`` hosting ``experts``, for a fleet this gateway
    starts: the layer's shape and weights, the wire dtype, the rows a round may send, BLAS
    threads, the update directory, metrics. (Where it listens, its secret and its pinning
    are the fleet's.)"""
    from gateway.config import served_ids

    _, _, slots = served_ids(args, layers)
    base = ["--d-model", str(args.d_model), "--d-ff", str(args.d_ff), "--seed", str(args.seed), "--dtype", args.dtype,
            "--max-tokens", str(args.max_batch_tokens * slots), "--blas-threads", str(args.worker_blas_threads),
            "--log-level", args.log_level, "--compute", args.compute]
    if layers:
        base += ["--checkpoint", os.path.abspath(args.checkpoint), "--layers", ",".join(map(str, sorted(layers)))]
    if args.update_dir:
        base += ["--update-dir", args.update_dir]
    if args.worker_metrics:  # each on a free port (its METRICS line, or the Ray actor's where(), says which)
        base += ["--metrics-port", "0", "--metrics-addr", args.metrics_addr]

    def flags(i: int, experts: list) -> list:
        return ["--experts", ",".join(map(str, experts)), *base]
    return flags


def start_fleet(args: argparse.Namespace, secret: Optional[bytes], secret_path: Optional[str],
                layers: Optional[dict] = None) -> Optional[Fleet]:
    """The fleet the flags ask for (None with ``--workers``), its first workers listening."""
    if args.workers:
        return None
    if args.placement == "ray":
        from gateway.placement_ray import ray_workers

        return ray_workers(args, secret, layers, worker_flags(args, layers))
    from gateway.supervisor import local_workers

    return local_workers(args, secret_path, layers, worker_flags(args, layers))
