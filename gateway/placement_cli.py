"""``moe-gateway placement ...`` and ``moe-gateway workers ...``: the expert placement and the
workers of a running gateway (authenticated control requests, like ``update``).

    moe-gateway placement --gateway tcp://127.0.0.1:7000 show            # a table; --json for scripts
    moe-gateway placement --gateway tcp://127.0.0.1:7000 save map.json   # record it (static EPLB)
    moe-gateway placement --gateway tcp://127.0.0.1:7000 load map.json   # move toward it, live
    moe-gateway workers --gateway tcp://127.0.0.1:7000 add tcp://10.0.0.4:5000
    moe-gateway workers --gateway tcp://127.0.0.1:7000 drain 2           # copies moved off it first
    moe-gateway workers --gateway tcp://127.0.0.1:7000 remove 2          # drained, then taken out
    moe-gateway workers --gateway tcp://127.0.0.1:7000 scale 3           # local or Ray workers
"""
from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from transport.service import options


def add_flags(p: argparse.ArgumentParser) -> None:
    """The serve command's placement flags."""
    g = p.add_argument_group("expert placement (EPLB: copies follow the load)")
    g.add_argument("--eplb", action="store_true",
                   help="move and replicate expert copies live from the measured load (DeepSeek's EPLB)")
    g.add_argument("--redundant-experts", type=options.count, default=0, metavar="N",
                   help="with --eplb: routed copies beyond one per logical expert, per layer, spread over the "
                        "workers' free slots (their --max-experts)")
    g.add_argument("--eplb-window", type=options.positive_seconds, default=60.0,
                   help="per-expert load is counted over this many seconds of routing")
    g.add_argument("--eplb-interval", type=options.positive_seconds, default=60.0,
                   help="with --eplb: how often the placement is recomputed")
    g.add_argument("--eplb-max-moves", type=options.positive, default=8, metavar="N",
                   help="copies loaded per move at most, so loading never starves serving")
    g.add_argument("--placement-file", default=None, type=options.file_path, metavar="FILE",
                   help="start from this placement (saved by 'moe-gateway placement save'): static EPLB")


def add_parsers(sub) -> None:
    from gateway.update_cli import gateway_flags

    g = "--gateway tcp://127.0.0.1:7000"
    pl = sub.add_parser("placement", help="show, save or load the expert placement of a running gateway",
                        description="The expert placement of a running moe-gateway: which workers hold a "
                                    "routed copy of each expert, per layer, and how balanced the load is.",
                        epilog=options.examples(f"moe-gateway placement show {g}",
                                                f"moe-gateway placement save map.json {g}",
                                                f"moe-gateway placement load map.json {g}"))
    acts = pl.add_subparsers(dest="action", required=True, metavar="ACTION")
    pl.usage = "moe-gateway placement --gateway URL [--timeout SECONDS] [--secret-file PATH | --insecure] ACTION ..."
    sh = acts.add_parser("show", help="per layer: version, balancedness, copies (expert -> workers)",
                         epilog=options.examples(f"moe-gateway placement show {g}",
                                                 f"moe-gateway placement show --json {g}"))
    sh.add_argument("--json", action="store_true", help="the whole document as JSON, for scripts")
    sv = acts.add_parser("save", help="write the placement to FILE (JSON)",
                         epilog=options.examples(f"moe-gateway placement save map.json {g}"))
    sv.add_argument("file", metavar="FILE")
    ld = acts.add_parser("load", help="move toward the placement in FILE, live, in bounded moves",
                         epilog=options.examples(f"moe-gateway placement load map.json {g}"))
    ld.add_argument("file", metavar="FILE")
    gateway_flags(pl)
    for q in acts.choices.values():
        gateway_flags(q)

    wk = sub.add_parser("workers", help="list, add, drain, remove or scale the workers of a running gateway",
                        description="Workers of a running moe-gateway: a new one gets copies by the placement "
                                    "algorithm before it takes traffic; a drained one hands its copies over first.",
                        epilog=options.examples(f"moe-gateway workers list {g}",
                                                f"moe-gateway workers add tcp://10.0.0.4:5000 {g}",
                                                f"moe-gateway workers drain 2 {g}"))
    acts = wk.add_subparsers(dest="action", required=True, metavar="ACTION")
    wk.usage = "moe-gateway workers --gateway URL [--timeout SECONDS] [--secret-file PATH | --insecure] ACTION ..."
    acts.add_parser("list", help="every worker: state, copies, share of the load (JSON)",
                    epilog=options.examples(f"moe-gateway workers list {g}"))
    add = acts.add_parser("add", help="connect and admit workers listening at these URLs",
                          epilog=options.examples(f"moe-gateway workers add tcp://10.0.0.4:5000 {g}"))
    add.add_argument("urls", nargs="+", metavar="URL", type=options.url)
    for name, what in (("drain", "move its copies to the others (it stays connected, idle)"),
                       ("remove", "drain it, then disconnect it (and stop it, if this gateway started it)")):
        a = acts.add_parser(name, help=what, epilog=options.examples(f"moe-gateway workers {name} 2 {g}"))
        a.add_argument("worker", type=options.count, metavar="ID", help="the worker's index (workers list)")
    sc = acts.add_parser("scale", help="start or stop workers to have N (--local-workers or --placement ray)",
                         epilog=options.examples(f"moe-gateway workers scale 3 {g}"))
    sc.add_argument("n", type=options.positive, metavar="N")
    gateway_flags(wk)
    for q in acts.choices.values():
        gateway_flags(q)


def run(args: argparse.Namespace) -> int:
    """``placement`` or ``workers`` (args.command); exit 0; 2 for a bad file or a request the
    gateway refused as bad (no such worker), 1 when it could not be reached or failed."""
    import transport
    from gateway.client import GatewayClient
    from gateway.update_cli import refusal_code
    from transport.service import secrets
    from workers.protocol import RemoteError

    fields: dict = {}
    try:
        if args.command == "placement" and args.action == "load":
            with open(args.file) as f:
                fields = {"placement": json.load(f)}
        elif args.command == "workers":
            fields = {k: getattr(args, k) for k in ("urls", "worker", "n") if getattr(args, k, None) is not None}
    except (OSError, ValueError) as e:
        print(f"moe-gateway {args.command}: cannot read {args.file}: {e}", file=sys.stderr)
        return 2
    action = "show" if args.command == "placement" and args.action == "save" else args.action
    try:
        with GatewayClient(args.gateway, timeout=args.timeout, secret=None if args.insecure else secrets.FIND,
                           secret_file=args.secret_file) as c:
            call = c.placement if args.command == "placement" else c.workers
            status = call(action, timeout=args.timeout, **fields)
    except RemoteError as e:
        print(f"moe-gateway {args.command} {args.action}: refused: {e.message}", file=sys.stderr)
        return refusal_code(e)
    except secrets.SecretError as e:
        raise options.UsageError(str(e)) from None
    except transport.AuthenticationError as e:
        print(f"moe-gateway {args.command}: {e}", file=sys.stderr)
        return 1
    except transport.TransportError as e:
        print(f"moe-gateway {args.command}: cannot reach the gateway at {args.gateway}: {e}", file=sys.stderr)
        return 1
    if args.command == "placement" and args.action == "save":
        doc = {"version": status["version"],
               "layers": {L: {"copies": v["copies"]} for L, v in status["layers"].items()}}
        with open(args.file, "w") as f:
            json.dump(doc, f, indent=1)
        print(f"saved placement version {status['version']} to {args.file}")
    elif args.command == "placement" and args.action == "show" and not args.json:
        print(table(status))
    else:
        print(json.dumps(status))
    return 0


def table(doc: dict) -> str:
    """``placement show`` as a person reads it."""
    out = [f"placement version {doc['version']}: {doc['physical']} copies ({doc['redundant']} redundant)"]
    for L, v in doc["layers"].items():
        b = v["balancedness"]
        out.append(f"layer {L}: balancedness {'-' if b is None else f'{b:.3f}'}")
        for e, ws in v["copies"].items():
            load = v["load"][int(e)] if v.get("load") else 0
            out.append(f"  expert {e:>4}  rows {load:>10.0f}  on workers {', '.join(map(str, ws))}")
    out.append("workers:")
    for w in doc["workers"]:
        out.append(f"  {w['index']:>3} {w['state']:<10} {'parked ' if w['parked'] else ''}copies {w['copies']}/"
                   f"{w['slots']}  share {w['share']:.1%}  {w['url']}")
    mv = (doc.get("rebalancer") or {}).get("move")
    if mv:
        out.append(f"last move: {mv['state']} ({mv['reason']}), +{len(mv['adds'])} -{len(mv['removes'])} copies"
                   + (f": {mv['error']}" if mv.get("error") else ""))
    return "\n".join(out)


def pool_options(args: argparse.Namespace) -> dict[str, Any]:
    """The WorkerPool arguments of the serve command's placement flags."""
    return {"eplb": args.eplb, "redundant_experts": args.redundant_experts, "eplb_interval": args.eplb_interval,
            "load_window": args.eplb_window, "max_moves": args.eplb_max_moves}
