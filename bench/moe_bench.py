"""`moe-bench moe`: its flags and its runs. One run at one batch size is
:func:`bench.moe_layer.measure` (the systems it times are described there); ``--batch``
repeated (with ``--repeat N``) runs each size in turn, each run on fresh processes, and
ends with the chunked rounds' figures by size (bench/moe_sweep.py); ``--compute`` runs the
expert-kernel benchmark (bench/moe_kernels.py) instead."""
from __future__ import annotations

import argparse
import json
import os

from bench import moe_kernels
from bench.moe_layer import FULL, QUICK, measure
from bench.moe_sweep import plot, report, summarize
from bench.output import write_plot
from gateway.chunking import chunk_rows_flag


def add_arguments(p: argparse.ArgumentParser) -> None:
    from transport.service import options

    p.add_argument("--backend", action="append", choices=["shm", "tcp", "rdma"], help="repeatable; default shm and tcp")
    p.add_argument("--rounds", type=options.positive, default=3,
                   help="interleaved rounds: each times every system's --batches once, in turn")
    p.add_argument("--batches", type=options.positive, default=6,
                   help="batches each system forwards per round (the timed forwards: rounds x batches)")
    p.add_argument("--n-experts", type=options.positive, default=8, help="routed experts in the layer")
    p.add_argument("--top-k", type=options.positive, default=2, help="experts per token")
    p.add_argument("--local-workers", type=options.positive, default=2,
                   help="worker processes it starts for ours and for the multiprocessing peer")
    p.add_argument("--d-model", type=options.positive, help="model width (default 1024; --quick 256)")
    p.add_argument("--d-ff", type=options.positive, help="expert hidden width (default 2048; --quick 512)")
    p.add_argument("--batch", type=options.positive, action="append", metavar="TOKENS",
                   help="tokens per batch (default 256; --quick 128); repeat it to run each size in turn, on "
                        "fresh processes, and end with the chunked rounds' figures by size")
    p.add_argument("--repeat", type=options.positive, default=1, metavar="N",
                   help="run each batch size N times, each on fresh worker processes; the summary gives the "
                        "medians and ranges")
    p.add_argument("--plot", metavar="PATH", help="PNG: the chunked rounds' gain, its bound and the share of it "
                                                  "realized, by batch size")
    p.add_argument("--seed", type=options.count, default=0, help="router and expert weights")
    p.add_argument("--quick", action="store_true", help="small dims for a smoke run")
    p.add_argument("--json", metavar="PATH", help="write the results as JSON")
    p.add_argument("--chunk-rows", default="auto", type=chunk_rows_flag, metavar="auto|off|ROWS",
                   help="moe-transport+chunks: at most this many rows per message (default auto, as moe-gateway); "
                        "off leaves only the whole-part system")
    p.add_argument("--control", action="store_true",
                   help="also time whole parts against themselves (moe-transport+control: the whole-part "
                        "system's twin, parts whole too): the share of the bound that timing alone gives, "
                        "the noise under the chunked figure")
    p.add_argument("--warmup-forwards", type=options.count, default=None, metavar="N",
                   help="untimed forwards per system before the timed rounds (default: as many as auto's "
                        "chunk choice takes to measure both ways)")
    p.add_argument("--compute", choices=["numpy", "torch"], default=None,
                   help="torch: the expert-kernel benchmark: ours with this kernel beside the kernel called "
                        "directly, the in-process torch layer, multiprocessing with the same kernel and ours "
                        "with numpy fp32")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default=None,
                   help="activation dtype on the wire for --compute (default bfloat16)")


def validate(args: argparse.Namespace) -> None:
    from transport.service.options import UsageError

    if (args.compute is not None or args.dtype is not None) and (args.repeat != 1 or args.plot):
        raise UsageError("--repeat and --plot are for the numpy layer, not --compute")
    if args.top_k > args.n_experts:
        raise UsageError(f"--top-k {args.top_k} is more than --n-experts {args.n_experts}")


def run(args: argparse.Namespace) -> int:
    validate(args)
    if args.compute is not None or args.dtype is not None:
        return moe_kernels.run(args)

    dims = dict(QUICK if args.quick else FULL)
    for k in ("d_model", "d_ff"):
        if getattr(args, k) is not None:
            dims[k] = getattr(args, k)
    default_batch = dims.pop("batch")
    sizes = args.batch or [default_batch]
    n = len(sizes) * args.repeat
    docs = []
    for batch in sizes:
        for _ in range(args.repeat):
            if n > 1:
                print(f"\n== run {len(docs) + 1}/{n}: {batch}-token batches ==", flush=True)
            docs.append(measure(args, dims | {"batch": batch}))
    rows = summarize(docs)
    if n > 1:
        print("\n" + report(rows))
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        cfg = dims | {"n_experts": args.n_experts, "top_k": args.top_k, "local_workers": args.local_workers,
                      "rounds": args.rounds, "batches": sizes, "repeat": args.repeat}
        out = docs[0] if n == 1 else {"meta": {"config": cfg, "runs": n}, "runs": docs, "sweep": rows}
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
        print(f"wrote {args.json}")
    if args.plot:
        title = (f"{args.n_experts} experts, top-{args.top_k}, d_model {dims['d_model']}, d_ff {dims['d_ff']}, "
                 f"{args.local_workers} worker process(es); {args.rounds} rounds x {args.batches} batches per run")
        write_plot(lambda: plot(rows, args.plot, title), args.plot, anything=bool(rows))
    return 0
