"""``moe-worker``: host experts behind a transport listener.

    moe-worker --listen tcp://127.0.0.1:0 --experts 0,1,2,3 --d-model 256 --d-ff 512
    moe-worker --listen shm://w0 --checkpoint /models/mixtral --layers 0-31 --experts 0-3 \
               --compute torch --dtype bfloat16

The first stdout line is ``LISTENING <url>`` (the bound URL: a port of 0 replaced), so a
parent learns where to connect; logs go to stderr. SIGTERM drains and exits 0. A usage
error exits 2, a failure at run time 1, each with one line on stderr.
"""
from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from typing import Optional, Sequence

from transport.service import options
from transport.service.launch import LISTENING
from workers.flags import PROG, build_daemon, parse_args

log = logging.getLogger("moe.worker")


def serve(args: argparse.Namespace) -> int:
    options.setup_logging(args.log_level, PROG)
    if args.cpus:
        os.sched_setaffinity(0, args.cpus)
    from threadpoolctl import threadpool_limits

    from transport.service import secrets

    limits = threadpool_limits(limits=args.blas_threads)  # noqa: F841 (kept for the process's life)
    options.raise_fd_limit()
    # as the gateway: without a secret, the per-user default one (created, 0600, if none
    # exists yet), so a gateway and workers one user starts on a host find the same secret
    # and authenticate each other; --insecure (a trusted network) uses only one named
    secret = None
    try:
        secret, _ = secrets.for_service(args.secret_file, insecure=args.insecure)
    except OSError as e:  # no writable home (a container): no secret, loopback only
        log.warning("no shared secret: cannot create the per-user default (%s)", e)
    options.check_exposure(args.listen, secret, args.insecure, PROG)
    daemon = build_daemon(args, args.listen, secret, watch_parent=os.getppid() if args.exit_with_parent else None)
    from transport.service.metrics import maybe_serve
    from workers.metrics import worker_health, worker_registry

    try:
        maybe_serve(lambda: worker_registry(daemon), args, health=worker_health(daemon))
    except OSError as e:
        raise RuntimeError(f"metrics: cannot serve on {args.metrics_addr}:{args.metrics_port}: "
                           f"{e.strerror or e}") from None
    signal.signal(signal.SIGTERM, lambda *_: daemon.request_stop())
    signal.signal(signal.SIGINT, lambda *_: daemon.request_stop())
    print(f"{LISTENING} {daemon.url}", flush=True)
    return daemon.serve()


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    return options.run_main(PROG, lambda: serve(args))


if __name__ == "__main__":
    sys.exit(main())
