"""Every command line of the project, side by side: each flag has help, every command has
--version, and a flag name means one thing wherever it appears (--workers is always the
gateway's URL list, counts of processes are --local-workers, --warmup is seconds, --version
prints the version, ...)."""
from __future__ import annotations

import argparse
import collections
import importlib
import subprocess
import sys

import pytest

ROOT = __import__("os").path.dirname(__import__("os").path.dirname(__import__("os").path.abspath(__file__)))


def commands() -> dict[str, argparse.ArgumentParser]:
    from gateway import cli as gcli
    from gateway.demo import build_parser as demo_parser
    from workers.cli import build_parser as worker_parser

    out = {"moe-worker": worker_parser()}
    gw = gcli.build_parser()
    update = gcli.add_update_parser(gw.add_subparsers(dest="command"))
    out["moe-gateway"] = gw
    out["moe-gateway update"] = update
    for action in update._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                out[f"moe-gateway update {name}"] = sub
    for name, module in (("transport", "bench.transport_bench"), ("moe", "bench.moe_bench"), ("load", "bench.load")):
        p = argparse.ArgumentParser(prog=f"moe-bench {name}")
        importlib.import_module(module).add_arguments(p)
        out[f"moe-bench {name}"] = p
    out["gateway.demo"] = demo_parser()
    return out


def options(p: argparse.ArgumentParser):
    for a in p._actions:
        for o in a.option_strings:
            if o.startswith("--") and o != "--help":
                yield o, a


def kind(a: argparse.Action) -> str:
    """What a flag takes: its action class and value type."""
    t = a.type
    tname = "str" if t is None else getattr(t, "__name__", type(t).__name__)
    tname = {"_positive": "float"}.get(tname, tname)  # a float checked > 0 is still seconds or a rate
    return f"{type(a).__name__.lstrip('_')}:{tname}"


# flags whose spelling of one meaning legitimately differs between commands
SAME_MEANING_OTHER_FORM = {
    "--backend": "one transport for a gateway's local workers; repeatable in the benchmarks",
    "--slot-size": "bytes in both; the transport benchmark also takes K/M suffixes",
    "--warmup": None,  # seconds wherever it appears
}


def test_every_flag_of_every_command_has_help():
    missing = [f"{cmd} {o}" for cmd, p in commands().items() for o, a in options(p)
               if not (a.help or "").strip() and a.help is not argparse.SUPPRESS]
    assert not missing, missing


def test_one_meaning_per_flag_name():
    uses = collections.defaultdict(dict)
    for cmd, p in commands().items():
        for o, a in options(p):
            uses[o][cmd] = a
    clashes = []
    for o, by_cmd in uses.items():
        kinds = {kind(a) for a in by_cmd.values()}
        if len(kinds) > 1 and SAME_MEANING_OTHER_FORM.get(o) is None:
            clashes.append((o, {c: kind(a) for c, a in by_cmd.items()}))
    assert not clashes, clashes
    # the ones the issue names
    assert set(uses["--workers"]) == {"moe-gateway"} and uses["--workers"]["moe-gateway"].type is None  # URLs
    assert all(a.type is int for a in uses["--local-workers"].values())
    assert all(type(a).__name__ == "_VersionAction" for a in uses["--version"].values()), \
        {c: type(a).__name__ for c, a in uses["--version"].items()}
    assert all(a.type is float for a in uses["--warmup"].values())  # seconds; a count is --warmup-iters
    assert "--clients" not in uses  # the demo's concurrency is --concurrency, as the load tool's


@pytest.mark.parametrize("argv", [
    ["-m", "workers.cli", "--version"], ["-m", "gateway.cli", "--version"], ["-m", "bench.cli", "--version"],
    ["-m", "bench.cli", "load", "--version"], ["-m", "gateway.demo", "--version"],
])
def test_every_command_has_version(argv):
    p = subprocess.run([sys.executable, *argv], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert p.returncode == 0, p.stderr
    out = p.stdout.strip()
    assert out.split()[-1][0].isdigit() or out.endswith("unknown"), out


def test_log_level_is_a_choice_not_free_text():
    p = subprocess.run([sys.executable, "-m", "workers.cli", "--log-level", "verbose"], capture_output=True,
                       text=True, timeout=60, cwd=ROOT)
    assert p.returncode == 2 and "invalid choice" in p.stderr
    assert commands()["moe-worker"].parse_args(["--log-level", "info"]).log_level == "INFO"


def test_worker_idle_timeout_zero_means_never():
    """--idle-timeout 0 is "never" for moe-worker as for moe-gateway: an idle connection
    stays open (0 seconds taken literally would close it at the loop's next sweep)."""
    import time

    import transport
    from tests.helpers_procs import Services, secret
    from workers import protocol as P

    with Services() as services:
        w = services.worker("tcp", [0], d_model=16, d_ff=32, extra=["--idle-timeout", "0"])
        conn = transport.connect(w.url, timeout=5, secret=secret())
        try:
            time.sleep(2.5)  # the serve loop sweeps idle connections every second
            conn.send(P.request(P.PING, 7), timeout=5)
            msg = conn.recv(timeout=5)
            assert msg.header.get("op") == P.PONG
            msg.release()
        finally:
            conn.close()
