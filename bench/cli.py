"""`moe-bench`: one entry point, one module per subcommand.

Each module exports ``add_arguments(parser)`` and ``run(args) -> int``, and may export
``validate(args)``, run before anything is measured (a contradiction in the flags raises
options.UsageError: one line, exit 2); adding a subcommand is one line in SUBCOMMANDS.
A failure while measuring exits 1 with one line on stderr.
"""
from __future__ import annotations

import argparse
import importlib
import sys
from typing import Optional, Sequence

SUBCOMMANDS = {
    "transport": ("bench.transport_bench", "transport microbenchmarks vs raw mechanisms",
                  ("moe-bench transport --backend shm --quick",
                   "moe-bench transport --backend tcp --sizes 64,4K,1M --repeat 5 --json tcp.json --plot tcp.png",
                   "moe-bench transport --backend shm --cpus 0,1 --figures descriptor")),
    "moe": ("bench.moe_bench", "the distributed MoE layer vs the in-process reference and a multiprocessing peer",
            ("moe-bench moe --quick",
             "moe-bench moe --backend shm --batch 64 --batch 256 --repeat 3 --plot chunks.png",
             "moe-bench moe --compute torch --dtype bfloat16 --quick")),
    "load": ("bench.load_cli", "open-loop load generator (fixed-rate, ramp, mixed) against a moe-gateway",
             ("moe-bench load --rate 5 --duration 10 --backend shm",
              "moe-bench load --mode ramp --rate 40 --ramp-steps 5 --gateway tcp://127.0.0.1:7000",
              "moe-bench load --compare batching=fifo,expert-aware --rate 40 --repeat 3 --json cmp.json")),
    "chaos": ("bench.chaos_cli", "workers killed and stopped under load, client churn, hostile connections; "
                             "every answer checked",
              ("moe-bench chaos --backend tcp --replicas 2 --duration 60",
               "moe-bench chaos --placement local --duration 120 --json chaos.json --plot chaos.png",
               "moe-bench chaos --backend shm --replicas 1 --duration 30 --hostile-idle 200")),
}


def build_parser() -> argparse.ArgumentParser:
    from transport.service import options

    parser = options.Parser(prog="moe-bench", epilog=options.examples(*(ex[0] for _, _, ex in SUBCOMMANDS.values())),
                            description="moe-transport's benchmarks: each subcommand prints a report and can write "
                                        "JSON with provenance")
    parser.add_argument("--version", action="version", version=f"moe-bench {options.version()}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND", title="commands")
    for name, (module, helptext, examples) in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=helptext, description=helptext, epilog=options.examples(*examples))
        p.add_argument("--version", action="version", version=f"moe-bench {name} {options.version()}")
        mod = importlib.import_module(module)
        mod.add_arguments(p)
        p.set_defaults(_module=mod, _parser=p)
    return parser


def parse(argv: Optional[Sequence[str]] = None, parser: Optional[argparse.ArgumentParser] = None
          ) -> argparse.Namespace:
    """The command line parsed and validated (exit 2 with one line on a mistake);
    ``parser``: build_parser()'s, to reuse it."""
    from transport.service.options import UsageError

    from transport.service.options import check_paths

    args = (parser or build_parser()).parse_args(argv)
    validate = getattr(args._module, "validate", None)
    try:
        check_paths(args, args._parser)
        if validate is not None:
            validate(args)
    except UsageError as e:
        args._parser.error(str(e))
    return args


def main(argv: Optional[Sequence[str]] = None) -> int:
    from transport.service import options

    args = parse(argv)
    return options.run_main(f"moe-bench {args.command}", lambda: int(args._module.run(args) or 0))


if __name__ == "__main__":
    sys.exit(main())
