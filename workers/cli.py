"""``moe-worker``: host experts behind a transport listener.

    moe-worker --listen tcp://127.0.0.1:0 --experts 0,1,2,3 --d-model 256 --d-ff 512
    moe-worker --listen shm://w0 --checkpoint /models/mixtral --layers 0-31 --experts 0-3 \
               --compute torch --dtype bfloat16

The first stdout line is ``LISTENING <url>`` (the bound URL: a port of 0 replaced), so a
parent learns where to connect; logs go to stderr. SIGTERM drains and exits 0.
"""
from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from typing import TYPE_CHECKING, Optional, Sequence

from transport.service import options
from transport.service.launch import LISTENING

if TYPE_CHECKING:
    from workers.daemon import WorkerDaemon

log = logging.getLogger("moe.worker")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="moe-worker", description="Serve MoE experts over moe-transport.",
                                formatter_class=options.HelpFormatter)
    p.add_argument("--listen", default="tcp://127.0.0.1:0",
                   help="transport URL to listen on: tcp://host:port (port 0: any free one), shm://name, "
                        "rdma://ip:port")
    m = p.add_argument_group("experts")
    m.add_argument("--checkpoint", default=None, metavar="DIR",
                   help="serve experts of this Hugging Face checkpoint (config.json + *.safetensors); only "
                        "the listed experts of the listed layers are read")
    m.add_argument("--layers", default=None, type=options.int_list,
                   help="with --checkpoint: MoE layers to serve, e.g. 0-23 (default: every MoE layer)")
    m.add_argument("--experts", default=None, type=options.int_list,
                   help="expert ids to host, e.g. 0,1,2,3 or 0-3 (default: every expert in --weights or of "
                        "the checkpoint's layers, shared-expert pieces included, else 0); a checkpoint's "
                        "shared experts are ids n_experts.. like any other")
    m.add_argument("--compute", default="numpy", choices=["numpy", "torch"],
                   help="expert kernel: numpy (float32 BLAS) or torch (bf16 where the CPU has bf16 matrix "
                        "units, else float32; needs the [torch] extra)")
    m.add_argument("--weights", default=None, metavar="NPZ",
                   help=".npz written by SwiGLUExpert.save_many (default: demo weights from --seed)")
    m.add_argument("--d-model", type=int, default=256, help="model width (demo weights)")
    m.add_argument("--d-ff", type=int, default=512, help="expert hidden width (demo weights)")
    m.add_argument("--dtype", default="float32", choices=["float32", "float64", "float16", "bfloat16"],
                   help="activation dtype on the wire (bfloat16: 2 bytes a value; the kernel converts to its "
                        "compute dtype where they differ)")
    m.add_argument("--seed", type=int, default=0, help="seed of the demo weights (SwiGLUExpert.from_seed)")
    m.add_argument("--max-tokens", type=int, default=None,
                   help="largest batch accepted, in rows (token-expert assignments); scratch and slots are "
                        "sized for it at start (default 2048; with --checkpoint, what a gateway's default "
                        "1024-token batch may send: 1024 x (top-k + shared pieces))")
    m.add_argument("--max-experts", type=int, default=None, metavar="N",
                   help="physical expert copies this worker may host: a gateway that moves or replicates "
                        "experts (--eplb) adds copies up to this many (default: twice the experts it starts with)")
    m.add_argument("--update-dir", default=None, metavar="DIR",
                   help="hot update reads new weight files only from this directory (default: none, so "
                        "only seed updates)")
    t = p.add_argument_group("transport")
    t.add_argument("--slot-size", type=int, default=None, help="receive slot size in bytes (default: fits --max-tokens)")
    t.add_argument("--nslots", type=int, default=8, help="receive slots (credits) per connection")
    t.add_argument("--io-timeout", type=float, default=10.0, help="bound on every transport wait, seconds")
    t.add_argument("--max-connections", type=int, default=64, help="connections served at once (more are refused)")
    t.add_argument("--idle-timeout", type=float, default=0.0,
                   help="close a connection idle this long, seconds (0: never, as gateways ping)")
    options.add_security(t, service=True)
    r = p.add_argument_group("process")
    r.add_argument("--threads", type=int, default=1, help="BLAS threads (1: the stable choice on few cores)")
    r.add_argument("--cpu", default=None, type=options.int_list, help="pin to these CPUs, e.g. 0 or 0,1")
    r.add_argument("--compute-thread", default="auto", choices=["auto", "on", "off"],
                   help="compute on a thread of its own, so the transport keeps receiving and replying "
                        "meanwhile (auto: on where the transport copies on the caller's thread: tcp)")
    r.add_argument("--drain-timeout", type=float, default=10.0, help="longest SIGTERM drain, seconds")
    r.add_argument("--drain-idle", type=float, default=0.2,
                   help="while draining, exit once connections were quiet this long, seconds")
    r.add_argument("--exit-with-parent", action="store_true", help="drain and exit when the parent process dies")
    options.add_common(p, "moe-worker")
    from transport.service.metrics import add_flags

    add_flags(p)
    return p


DEFAULT_MAX_ROWS = 2048
GATEWAY_BATCH_TOKENS = 1024  # moe-gateway's default --max-batch-tokens


def checkpoint_max_rows(path: str, layers) -> int:
    """Rows a default gateway's largest batch may send one worker: every token to top-k
    routed experts and to each shared piece (a worker may host them all)."""
    from workers.checkpoint import Checkpoint, model_spec

    ms = model_spec(Checkpoint(path))
    specs = [ms.layer(L) for L in (ms.moe_layers if layers is None else layers)]
    return GATEWAY_BATCH_TOKENS * max((s.routing.top_k + s.n_shared for s in specs), default=2)


def load_experts(args):
    """workers.loading.Served: the experts these flags name, keyed by (layer, id)."""
    from workers.expert import npz_expert_ids
    from workers.loading import checkpoint_experts, demo_experts

    if args.checkpoint:
        if args.weights:
            raise ValueError("--checkpoint and --weights are exclusive")
        if args.max_tokens is None:
            args.max_tokens = checkpoint_max_rows(args.checkpoint, args.layers)
        return checkpoint_experts(args.checkpoint, args.layers, args.experts, kind=args.compute, wire=args.dtype,
                                  max_tokens=args.max_tokens, threads=args.threads)
    if args.layers:
        raise ValueError("--layers needs --checkpoint (demo weights are one layer)")
    args.max_tokens = args.max_tokens or DEFAULT_MAX_ROWS
    ids = args.experts or (npz_expert_ids(args.weights) if args.weights else [0])
    return demo_experts(ids, d_model=args.d_model, d_ff=args.d_ff, seed=args.seed, weights=args.weights,
                        kind=args.compute, wire=args.dtype, max_tokens=args.max_tokens, threads=args.threads)


def build_daemon(args: argparse.Namespace, listen: str, secret: Optional[bytes], *,
                 watch_parent: Optional[int] = None) -> "WorkerDaemon":
    """The worker these flags describe, listening on ``listen`` (moe-worker's own process,
    or a Ray actor hosting one): its experts loaded, not yet serving."""
    from workers.daemon import WorkerDaemon

    served = load_experts(args)
    return WorkerDaemon(served.experts, listen, fingerprints=served.fingerprints, checkpoint=served.checkpoint,
                        max_tokens=args.max_tokens, slot_size=args.slot_size, nslots=args.nslots,
                        io_timeout=args.io_timeout, drain_timeout=args.drain_timeout, drain_idle=args.drain_idle,
                        watch_parent=watch_parent, secret=secret, update_dir=args.update_dir,
                        max_connections=args.max_connections, idle_timeout=args.idle_timeout or None,
                        compute_thread={"auto": None, "on": True, "off": False}[args.compute_thread],
                        max_experts=args.max_experts)


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    options.setup_logging(args.log_level, "moe-worker")
    if args.cpu:
        os.sched_setaffinity(0, args.cpu)
    from threadpoolctl import threadpool_limits

    from transport.service import secrets

    limits = threadpool_limits(limits=args.threads)  # noqa: F841 (kept for the process's life)
    options.raise_fd_limit()
    try:
        # as the gateway: without a secret, the per-user default one (created, 0600, if none
        # exists yet), so a gateway and workers one user starts on a host find the same secret
        # and authenticate each other; --insecure (a trusted network, other hosts) keeps none
        secret = None
        if args.insecure:
            secret, _ = secrets.resolve(args.secret_file, use_default=False)
        else:
            try:
                secret, _ = secrets.for_service(args.secret_file)
            except OSError as e:  # no writable home (a container): no secret, loopback only
                log.warning("no shared secret: cannot create the per-user default (%s)", e)
        options.check_exposure(args.listen, secret, args.insecure, "moe-worker")
        daemon = build_daemon(args, args.listen, secret,
                              watch_parent=os.getppid() if args.exit_with_parent else None)
    except SystemExit:
        raise
    except Exception as e:
        print(f"moe-worker: {e}", file=sys.stderr)
        return 2
    try:
        from transport.service.metrics import maybe_serve
        from workers.metrics import worker_health, worker_registry

        maybe_serve(lambda: worker_registry(daemon), args, health=worker_health(daemon))
    except Exception as e:
        print(f"moe-worker: metrics: {e}", file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, lambda *_: daemon.request_stop())
    signal.signal(signal.SIGINT, lambda *_: daemon.request_stop())
    print(f"{LISTENING} {daemon.url}", flush=True)
    return daemon.serve()


def worker_argv(listen: str, experts: Sequence[int], *, d_model: int, d_ff: int, seed: int = 0,
                dtype: str = "float32", max_tokens: int = 2048, extra: Sequence[str] = (),
                python: str = sys.executable) -> list[str]:
    """The command line of a moe-worker process (tests and benchmarks start workers with it)."""
    return [python, "-m", "workers.cli", "--listen", listen, "--experts", ",".join(map(str, experts)),
            "--d-model", str(d_model), "--d-ff", str(d_ff), "--seed", str(seed), "--dtype", dtype,
            "--max-tokens", str(max_tokens), *extra]


if __name__ == "__main__":
    sys.exit(main())
