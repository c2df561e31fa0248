"""moe-worker's flags: the parser and the checks made before anything loads, the worker
those flags describe (:func:`build_daemon`: moe-worker's own process and a Ray actor build
theirs the same way), and the command line that starts one (:func:`worker_argv`)."""
from __future__ import annotations

import argparse
import os
import sys
from typing import TYPE_CHECKING, Optional, Sequence

from transport.service import options
from transport.service.options import UsageError

if TYPE_CHECKING:
    from workers.daemon import WorkerDaemon


PROG = "moe-worker"
EXAMPLES = options.examples(
    "moe-worker --listen tcp://127.0.0.1:5000 --experts 0-3 --d-model 256 --d-ff 512",
    "moe-worker --listen tcp://10.0.0.2:5000 --experts 4-7 --secret-file /etc/moe/secret --cpus 1",
    "moe-worker --listen shm://w0 --checkpoint /models/mixtral --layers 0-31 --experts 0-3 --compute torch")


def build_parser() -> argparse.ArgumentParser:
    p = options.Parser(prog=PROG, epilog=EXAMPLES,
                       description="Serve MoE experts over moe-transport to a moe-gateway. Prints 'LISTENING <url>' "
                                   "first; SIGTERM drains and exits 0.")
    p.add_argument("--listen", default="tcp://127.0.0.1:0", type=options.url,
                   help="transport URL to listen on: tcp://HOST:PORT (port 0: any free one), shm://NAME, "
                        "rdma://IP:PORT")
    m = p.add_argument_group("experts")
    m.add_argument("--checkpoint", default=None, type=options.directory,
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
    m.add_argument("--weights", default=None, metavar="NPZ", type=options.file_path,
                   help=".npz of expert weights, as SwiGLUExpert.save_many writes (default: demo weights "
                        "from --seed)")
    m.add_argument("--d-model", type=options.positive, default=256, help="model width (demo weights)")
    m.add_argument("--d-ff", type=options.positive, default=512, help="expert hidden width (demo weights)")
    m.add_argument("--dtype", default="float32", choices=["float32", "float64", "float16", "bfloat16"],
                   help="activation dtype on the wire (bfloat16: 2 bytes a value; the kernel converts to its "
                        "compute dtype where they differ)")
    m.add_argument("--seed", type=options.count, default=0, help="seed of the demo weights")
    m.add_argument("--max-tokens", type=options.positive, default=None, metavar="ROWS",
                   help="largest batch accepted, in rows (token-expert assignments); scratch and slots are "
                        "sized for it at start (default 2048; with --checkpoint, what a gateway's default "
                        "1024-token batch may send: 1024 x (top-k + shared pieces))")
    m.add_argument("--max-experts", type=options.positive, default=None, metavar="N",
                   help="physical expert copies this worker may host: a gateway that moves or replicates "
                        "experts (--eplb) adds copies up to this many (default: twice the experts it starts with)")
    m.add_argument("--update-dir", default=None, type=options.directory,
                   help="hot update reads new weight files only from this directory (default: none, so "
                        "only seed updates)")
    t = p.add_argument_group("transport")
    t.add_argument("--slot-size", type=options.positive, default=None, metavar="BYTES",
                   help="receive slot size (default: fits --max-tokens)")
    t.add_argument("--nslots", type=options.positive, default=8, help="receive slots (credits) per connection")
    t.add_argument("--io-timeout", type=options.positive_seconds, default=10.0, help="bound on every transport wait")
    t.add_argument("--max-connections", type=options.positive, default=64,
                   help="connections served at once (more are refused)")
    t.add_argument("--idle-timeout", type=options.seconds, default=0.0,
                   help="close a connection idle this long (0: never, as gateways ping)")
    options.add_security(t, service=True)
    r = p.add_argument_group("process")
    r.add_argument("--blas-threads", type=options.positive, default=1,
                   help="BLAS threads (1: the stable choice on few cores)")
    options.alias(r, "--threads", "--blas-threads", type=options.positive)
    r.add_argument("--cpus", default=None, type=options.cpu_list, help="pin to these CPUs, e.g. 0 or 0,1")
    options.alias(r, "--cpu", "--cpus", type=options.cpu_list)
    r.add_argument("--compute-thread", default="auto", choices=["auto", "on", "off"],
                   help="compute on a thread of its own, so the transport keeps receiving and replying "
                        "meanwhile (auto: on where the transport copies on the caller's thread: tcp)")
    r.add_argument("--drain-timeout", type=options.seconds, default=10.0, help="longest SIGTERM drain")
    r.add_argument("--drain-idle", type=options.seconds, default=0.2,
                   help="while draining, exit once connections were quiet this long")
    r.add_argument("--exit-with-parent", action="store_true", help="drain and exit when the parent process dies")
    options.add_common(p, PROG)
    from transport.service.metrics import add_flags

    add_flags(p)
    return p


def validate(args: argparse.Namespace) -> None:
    """Flags that contradict each other or the checkpoint: UsageError before anything loads."""
    if args.checkpoint and args.weights:
        raise UsageError("--checkpoint and --weights are exclusive: give one")
    if args.layers and not args.checkpoint:
        raise UsageError("--layers needs --checkpoint (demo weights are one layer)")
    if args.cpus:
        have = sorted(os.sched_getaffinity(0))
        bad = [c for c in args.cpus if c not in have]
        if bad:
            raise UsageError(f"--cpus {','.join(map(str, bad))}: this process may run on CPUs "
                             f"{','.join(map(str, have))} only")
    if args.checkpoint:
        check_selection(args.checkpoint, args.layers, args.experts)
    elif args.weights and args.experts:
        from workers.expert import npz_expert_ids

        try:
            have = npz_expert_ids(args.weights)
        except (OSError, ValueError) as e:
            raise UsageError(f"--weights {args.weights}: not an .npz of experts ({e})") from None
        bad = [e for e in args.experts if e not in have]
        if bad:
            raise UsageError(f"--experts {','.join(map(str, bad))}: {args.weights} has experts "
                             f"{','.join(map(str, have))}")


def check_selection(path: str, layers: Optional[Sequence[int]], experts: Optional[Sequence[int]]) -> None:
    """--layers and --experts exist in the checkpoint at ``path``, else UsageError naming
    what it has."""
    from workers.checkpoint import Checkpoint, model_spec

    ms = model_spec(Checkpoint(path))
    bad = [L for L in (layers or []) if L not in ms.moe_layers]
    if bad:
        raise UsageError(f"--layers {','.join(map(str, bad))}: {path} has MoE layers "
                         f"{','.join(map(str, ms.moe_layers))}")
    for L in layers or ms.moe_layers:
        n = ms.layer(L).n_ids
        bad = [e for e in (experts or []) if e >= n]
        if bad:
            raise UsageError(f"--experts {','.join(map(str, bad))}: layer {L} of {path} has expert ids 0-{n - 1}")


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
            raise UsageError("--checkpoint and --weights are exclusive: give one")
        if args.max_tokens is None:
            args.max_tokens = checkpoint_max_rows(args.checkpoint, args.layers)
        return checkpoint_experts(args.checkpoint, args.layers, args.experts, kind=args.compute, wire=args.dtype,
                                  max_tokens=args.max_tokens, threads=args.blas_threads)
    if args.layers:
        raise UsageError("--layers needs --checkpoint (demo weights are one layer)")
    args.max_tokens = args.max_tokens or DEFAULT_MAX_ROWS
    ids = args.experts or (npz_expert_ids(args.weights) if args.weights else [0])
    return demo_experts(ids, d_model=args.d_model, d_ff=args.d_ff, seed=args.seed, weights=args.weights,
                        kind=args.compute, wire=args.dtype, max_tokens=args.max_tokens, threads=args.blas_threads)


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


def parse_args(argv: Optional[Sequence[str]] = None, parser: Optional[argparse.ArgumentParser] = None
               ) -> argparse.Namespace:
    """The command line parsed and checked before anything loads (exit 2 with one line on
    a mistake); ``parser``: build_parser()'s, to reuse it."""
    p = parser or build_parser()
    args = p.parse_args(argv)
    try:
        options.check_paths(args, p)
        validate(args)
    except UsageError as e:
        p.error(str(e))
    return args


def worker_argv(listen: str, experts: Sequence[int], *, d_model: int, d_ff: int, seed: int = 0,
                dtype: str = "float32", max_tokens: int = 2048, extra: Sequence[str] = (),
                python: str = sys.executable) -> list[str]:
    """The command line of a moe-worker process (tests and benchmarks start workers with it)."""
    return [python, "-m", "workers.cli", "--listen", listen, "--experts", ",".join(map(str, experts)),
            "--d-model", str(d_model), "--d-ff", str(d_ff), "--seed", str(seed), "--dtype", dtype,
            "--max-tokens", str(max_tokens), *extra]
