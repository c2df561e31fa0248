"""Every command line of the project, side by side: each flag has help, every command has
--version, and a flag name means one thing wherever it appears (--workers is always the
gateway's URL list, counts of processes are --local-workers, --warmup is seconds, --version
prints the version, ...)."""
from __future__ import annotations

import argparse
import collections
import subprocess
import sys

import pytest

from transport.service import options as opts

ROOT = __import__("os").path.dirname(__import__("os").path.dirname(__import__("os").path.abspath(__file__)))


def commands() -> dict[str, argparse.ArgumentParser]:
    from gateway import cli as gcli
    from gateway.demo import build_parser as demo_parser
    from workers.flags import build_parser as worker_parser

    out = {"moe-worker": worker_parser()}
    gw, _ = gcli.make_parser()
    out["moe-gateway"] = gw
    for command, parent in gcli.subparsers(gw).items():  # update, placement, workers
        out[f"moe-gateway {command}"] = parent
        for name, sub in gcli.subparsers(parent).items():
            out[f"moe-gateway {command} {name}"] = sub
    from bench.cli import build_parser as bench_parser

    bench = bench_parser()
    out["moe-bench"] = bench
    for action in bench._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                out[f"moe-bench {name}"] = sub
    out["gateway.demo"] = demo_parser()
    return out


def options(p: argparse.ArgumentParser, hidden: bool = True):
    """(flag, action) of every long flag; ``hidden``: with the renamed flags kept as hidden
    aliases (they keep their old meaning, which the new name carries)."""
    for a in p._actions:
        for o in a.option_strings:
            if o.startswith("--") and o != "--help" and (hidden or a.help is not argparse.SUPPRESS):
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
    "--replicas": "copies of each expert; repeatable in the chaos benchmark (a configuration per value)",
    "--placement": "who starts the workers; repeatable in the chaos benchmark (a configuration per value)",
    "--json": "the output as JSON: into PATH for the benchmarks, on stdout (a switch) for `placement show`",
    # a directory or file this host reads where the command reads it; `update start` names one
    # the gateway and its workers read, which need not exist where the command runs
    "--checkpoint": "a directory: checked here where this host reads it",
    "--weights": "an .npz file: checked here where this host reads it",
}


def test_every_flag_of_every_command_has_help():
    missing = [f"{cmd} {o}" for cmd, p in commands().items() for o, a in options(p)
               if not (a.help or "").strip() and a.help is not argparse.SUPPRESS]
    assert not missing, missing


def test_one_meaning_per_flag_name():
    uses = collections.defaultdict(dict)
    for cmd, p in commands().items():
        for o, a in options(p, hidden=False):
            uses[o][cmd] = a
    clashes = []
    for o, by_cmd in uses.items():
        kinds = {kind(a) for a in by_cmd.values()}
        if len(kinds) > 1 and SAME_MEANING_OTHER_FORM.get(o) is None:
            clashes.append((o, {c: kind(a) for c, a in by_cmd.items()}))
    assert not clashes, clashes
    # the ones the issue names
    assert set(uses["--workers"]) == {"moe-gateway"} and uses["--workers"]["moe-gateway"].type.__name__ == "url_list"
    assert all(a.type is opts.positive for a in uses["--local-workers"].values())
    assert all(type(a).__name__ == "_VersionAction" for a in uses["--version"].values()), \
        {c: type(a).__name__ for c, a in uses["--version"].items()}
    assert all(a.type is opts.seconds for a in uses["--warmup"].values())  # seconds; a count is --warmup-iters
    assert "--clients" not in uses  # the demo's concurrency is --concurrency, as the load tool's
    # CPU pinning is --cpus (a gateway's local workers': --worker-cpus, also the load tool's for the
    # gateway it starts), BLAS threads --blas-threads
    assert set(uses["--cpus"]) == {"moe-worker", "moe-bench transport"}
    assert set(uses["--worker-cpus"]) == {"moe-gateway", "moe-bench load"}
    assert all(a.type is opts.cpu_list for a in uses["--worker-cpus"].values())
    assert set(uses["--blas-threads"]) == {"moe-worker", "moe-gateway"}
    assert {"--threads", "--cpu", "--pin", "--max-wait-ms", "--worker-threads"}.isdisjoint(uses)  # hidden now
    # every time is in seconds (SECONDS in the help); the old milliseconds flag stays, hidden
    for flag in ("--max-wait", "--worker-timeout", "--idle-timeout", "--io-timeout", "--timeout", "--duration"):
        assert all(getattr(a.type, "metavar", None) == "SECONDS" for a in uses[flag].values()), flag
    assert not [f for f in uses if f.endswith("-ms")]


def test_renamed_flags_still_work_as_hidden_aliases():
    cmds = commands()
    w = cmds["moe-worker"].parse_args(["--threads", "2", "--cpu", "0"])
    assert (w.blas_threads, w.cpus) == (2, [0])
    g = cmds["moe-gateway"].parse_args(["--threads", "3", "--worker-threads", "2", "--max-wait-ms", "5"])
    assert (g.blas_threads, g.worker_blas_threads, g.max_wait) == (3, 2, 0.005)
    assert cmds["moe-gateway"].parse_args(["--max-wait", "0.005"]).max_wait == 0.005
    assert cmds["moe-bench transport"].parse_args(["--pin", "0,1"]).cpus == [0, 1]
    assert cmds["moe-bench chaos"].parse_args(["--workers", "local"]).workers == ["local"]
    for cmd, p in cmds.items():
        text = p.format_help()
        for old in ("--threads ", "--cpu ", "--pin ", "--max-wait-ms", "--worker-threads"):
            assert old not in text, (cmd, old)


def test_help_shows_each_default_once_and_no_internal_reference():
    import re

    for cmd, p in commands().items():
        text = p.format_help()
        assert "(default: None)" not in text and "(default: False)" not in text, cmd
        for a in p._actions:
            h = p._get_formatter()._expand_help(a) if a.help and a.help is not argparse.SUPPRESS else ""
            assert len(re.findall(r"\(default\b|\bdefault:|; default\b", h)) <= 1, (cmd, a.option_strings, h)
            if a.required:
                assert "default" not in h, (cmd, a.option_strings, h)
        assert not re.search(r"\bissue\b|\w+/\w+\.py\b", text), (cmd, re.findall(r".*(?:issue|\.py).*", text))
        examples = text.count("\n  moe-") + text.count("\n  python -m")
        # two or three a command; an action of a gateway command, whose flags are few, may show one
        assert examples >= (1 if cmd.count(" ") == 2 and cmd.startswith("moe-gateway") else 2), (cmd, examples)


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
