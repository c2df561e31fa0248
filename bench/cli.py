"""`moe-bench`: one entry point, one module per subcommand.

Each module exports ``add_arguments(parser)`` and ``run(args) -> int``; adding a
subcommand is one line in SUBCOMMANDS.
"""
from __future__ import annotations

import argparse
import importlib
import sys

SUBCOMMANDS = {
    "transport": ("bench.transport_bench", "transport microbenchmarks vs raw mechanisms"),
    "moe": ("bench.moe_bench", "the distributed MoE layer vs the in-process reference and a multiprocessing peer"),
    "load": ("bench.load", "open-loop load generator (fixed-rate, ramp, mixed) against a moe-gateway"),
    "chaos": ("bench.chaos", "workers killed and stopped under load, client churn, hostile connections; "
                             "every answer checked"),
}


def main(argv: list[str] | None = None) -> int:
    from transport.service.options import version

    parser = argparse.ArgumentParser(prog="moe-bench", description="moe-transport's benchmarks: each subcommand "
                                                                   "prints a report and can write JSON with provenance")
    parser.add_argument("--version", action="version", version=f"moe-bench {version()}")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (module, helptext) in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=helptext, description=helptext)
        p.add_argument("--version", action="version", version=f"moe-bench {name} {version()}")
        mod = importlib.import_module(module)
        mod.add_arguments(p)
        p.set_defaults(_module=mod)
    args = parser.parse_args(argv)
    return int(args._module.run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
