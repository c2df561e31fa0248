"""``moe-gateway update``: drive a hot update of a running gateway (start, advance, finish,
rollback, status, served, settle) through its client port.

The running gateway's flags (--gateway, --timeout, --secret-file, --insecure) go before or
after the action. A refusal the gateway gives a bad request exits 2, a gateway that cannot
be reached or a failed update 1, each with one line on stderr.
"""
from __future__ import annotations

import argparse
import os
import sys

from gateway.config import parse_floats
from transport.service import options
from transport.service.options import UsageError

PROG = "moe-gateway"


UPDATE_TIMEOUT = 30.0


def gateway_flags(p: argparse.ArgumentParser) -> None:
    """The running gateway's flags, on `update` (`placement`, `workers`) and on each action:
    accepted before or after the action (SUPPRESS defaults, so one given before is not reset
    by the action's parser)."""
    g = p.add_argument_group("the running gateway (these flags go before or after the action)")
    g.add_argument("--gateway", type=options.url, default=argparse.SUPPRESS,
                   help="the gateway's client URL, e.g. tcp://127.0.0.1:7000 (required)")
    g.add_argument("--timeout", type=options.positive_seconds, default=argparse.SUPPRESS,
                   help=f"bound on every wait (default: {UPDATE_TIMEOUT:g})")
    options.add_security(g, service=False, secret_file=argparse.SUPPRESS, insecure=argparse.SUPPRESS)


def add_update_parser(sub) -> argparse.ArgumentParser:
    ex = "moe-gateway update"
    p = sub.add_parser("update", help="hot-update experts of a running gateway",
                       epilog=options.examples(
                           f"{ex} --gateway tcp://127.0.0.1:7000 start --experts 0-3 --new-version 1 --seed 7 --wait",
                           f"{ex} --gateway tcp://127.0.0.1:7000 advance",
                           f"{ex} status --gateway tcp://127.0.0.1:7000"),
                       description="Hot-update experts of a running moe-gateway: load a new version on its "
                                   "workers (they keep serving), shift traffic to it in steps, finish or roll back.")
    acts = p.add_subparsers(dest="action", required=True, metavar="ACTION")
    # set after add_subparsers, which names the actions' programs from the usage
    p.usage = f"{ex} --gateway URL [--timeout SECONDS] [--secret-file PATH | --insecure] ACTION [action flags]"
    st = acts.add_parser("start", help="load the new version everywhere; traffic starts at the first step",
                         description="Load a new version of some experts on every worker that hosts them; "
                                     "traffic moves to it at the first step.",
                         epilog=options.examples(
                             f"{ex} start --gateway tcp://127.0.0.1:7000 --experts 3 --new-version 1 --seed 7 --wait",
                             f"{ex} start --gateway tcp://127.0.0.1:7000 --experts 0-7 --new-version 2 \\\n"
                             "      --checkpoint /updates/mixtral-ft --layer 3 --auto-interval 60"))
    st.add_argument("--experts", required=True, type=options.int_list, help="e.g. 3 or 0-3 or 1,5")
    st.add_argument("--new-version", dest="version", type=options.count, required=True, metavar="N",
                    help="the new weights' version number (>= 0)")
    source = st.add_mutually_exclusive_group(required=True)
    source.add_argument("--weights", metavar="NPZ",
                        help=".npz of expert weights (as SwiGLUExpert.save_many writes) in the workers' --update-dir")
    source.add_argument("--seed", type=options.count, help="demo weights from this seed")
    source.add_argument("--checkpoint", metavar="DIR",
                        help="a checkpoint directory in the workers' --update-dir: the experts of --layer from "
                             "it (the gateway reads its router and fingerprint; workers check the fingerprint)")
    st.add_argument("--layer", type=options.count, default=None, help="the MoE layer to update (default: 0)")
    st.add_argument("--steps", default=None, type=options.floats,
                    help="increasing traffic fractions in (0, 1] (default: 0.01,0.05,0.25,0.5,1)")
    st.add_argument("--auto-interval", type=options.positive_seconds, default=None,
                    help="advance every this many seconds by itself, and finish after the last step")
    adv = acts.add_parser("advance", help="the next traffic step", description="Move traffic to the next step.",
                          epilog=options.examples(f"{ex} advance --gateway tcp://127.0.0.1:7000",
                                                  f"{ex} advance --fraction 0.5 --gateway tcp://127.0.0.1:7000"))
    adv.add_argument("--fraction", type=options.fraction, default=None, help="jump to the first step >= this")
    fin = acts.add_parser("finish", help="all traffic to the new version; retire the old one",
                          description="All traffic to the new version; the workers retire the old one.",
                          epilog=options.examples(f"{ex} finish --wait --gateway tcp://127.0.0.1:7000"))
    rb = acts.add_parser("rollback", help="all traffic back to the old version; retire the new one",
                         description="All traffic back to the old version; the workers retire the new one.",
                         epilog=options.examples(f"{ex} rollback --wait --gateway tcp://127.0.0.1:7000"))
    acts.add_parser("status", help="the update's state, fraction, served counts and timeline (JSON)",
                    description="Print the update's state, traffic fraction, served counts and timeline as JSON.",
                    epilog=options.examples(f"{ex} status --gateway tcp://127.0.0.1:7000"))
    acts.add_parser("served", help="what the gateway serves: each expert's version, fingerprint and source, "
                                   "blocked and adopted experts, workers being admitted (JSON)",
                    description="Print what the gateway serves: each expert's version, fingerprint and source, "
                                "blocked and adopted experts, and workers being admitted, as JSON.",
                    epilog=options.examples(f"{ex} served --gateway tcp://127.0.0.1:7000"))
    se = acts.add_parser("settle", help="serve this version of experts whose workers disagree (or any); every host "
                                        "is brought to it before it takes traffic again",
                         description="Serve this version of some experts (whose workers disagree, or any): every "
                                     "host is brought to it before it takes traffic again.",
                         epilog=options.examples(
                             f"{ex} settle --gateway tcp://127.0.0.1:7000 --experts 2 --serve-version 1",
                             f"{ex} settle --gateway tcp://127.0.0.1:7000 --experts 0-3 --serve-version 2 --seed 7"))
    se.add_argument("--experts", required=True, type=options.int_list, help="e.g. 3 or 0-3 or 1,5")
    se.add_argument("--serve-version", dest="version", type=options.count, required=True, metavar="N",
                    help="the version to serve (its source: as given, else as a worker holding it reports)")
    se_src = se.add_mutually_exclusive_group()
    se_src.add_argument("--weights", metavar="NPZ",
                        help=".npz of expert weights (as SwiGLUExpert.save_many writes) in the workers' --update-dir")
    se_src.add_argument("--seed", type=options.count, help="demo weights from this seed")
    se_src.add_argument("--checkpoint", metavar="DIR", help="a checkpoint directory in the workers' --update-dir")
    se.add_argument("--layer", type=options.count, default=None, help="the MoE layer (default: 0)")
    for q in (st, fin, rb):
        q.add_argument("--wait", action="store_true",
                       help="return once the workers acknowledged (loaded, or retired the other version)")
    gateway_flags(p)
    for q in acts.choices.values():
        gateway_flags(q)
    return p


def update_fields(args) -> dict:
    fields: dict = {}
    if args.action == "start":
        fields = {"experts": args.experts, "version": args.version, "steps": parse_floats(args.steps),
                  "auto_interval": args.auto_interval, "layer": args.layer}
        if args.weights:
            fields["weights"] = os.path.abspath(args.weights)
        elif args.checkpoint:
            fields["checkpoint"] = os.path.abspath(args.checkpoint)
        else:
            fields["seed"] = args.seed
    elif args.action == "settle":
        fields = {"experts": args.experts, "version": args.version, "layer": args.layer, "seed": args.seed,
                  "weights": os.path.abspath(args.weights) if args.weights else None,
                  "checkpoint": os.path.abspath(args.checkpoint) if args.checkpoint else None}
    elif args.action == "advance" and args.fraction is not None:
        fields = {"fraction": args.fraction}
    return {k: v for k, v in fields.items() if v is not None}


def update_main(args) -> int:
    import json
    import time

    import transport
    from gateway.client import GatewayClient
    from transport.service import secrets
    from workers import protocol as P

    prog = f"{PROG} update"
    try:
        with GatewayClient(args.gateway, timeout=args.timeout, secret=None if args.insecure else secrets.FIND,
                           secret_file=args.secret_file) as c:
            status = c.update(args.action, **update_fields(args))
            deadline = time.monotonic() + args.timeout
            while getattr(args, "wait", False) and status["state"] in ("loading", "finishing", "rolling_back"):
                if time.monotonic() > deadline:
                    print(json.dumps(status))
                    print(f"{prog}: timed out after {args.timeout:g} s waiting for the workers (raise --timeout, "
                          f"or see '{prog} status')", file=sys.stderr)
                    return options.FAILURE
                time.sleep(0.1)
                status = c.update("status")
    except P.RemoteError as e:  # the gateway answered no: a bad request is the user's to fix
        print(f"{prog}: refused: {e.message}", file=sys.stderr)
        return refusal_code(e)
    except secrets.SecretError as e:
        raise UsageError(str(e)) from None
    except transport.AuthenticationError as e:
        print(f"{prog}: {e}", file=sys.stderr)
        return options.FAILURE
    except transport.TransportError as e:
        print(f"{prog}: cannot reach the gateway at {args.gateway}: {e}", file=sys.stderr)
        return options.FAILURE
    print(json.dumps(status))
    return 0 if status.get("state") != "failed" else options.FAILURE


def refusal_code(e) -> int:
    """The exit code of a control request the gateway refused: a bad request (no such
    expert, worker or version; a control operation without the secret) is the user's to fix
    (2), anything else failed at run time (1)."""
    from workers import protocol as P

    return options.USAGE_ERROR if e.code in (P.BAD_REQUEST, P.UNAUTHORIZED) else options.FAILURE
