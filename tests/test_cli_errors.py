"""Every mistake a user can make on the command line ends in ONE line saying what to do,
and the exit code tells a usage error (2) from a failure at run time (1); never a
traceback.

A property test (hypothesis) feeds every flag of moe-gateway (and `update` and its
actions), moe-worker and moe-bench's subcommands malformed values of its type, in process
(the same parse-and-check each command runs before it starts anything); the mistakes the
first users met run as real commands."""
from __future__ import annotations

import argparse
import contextlib
import io
import subprocess
import sys
from functools import lru_cache

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from transport.service import options as O

pytestmark = pytest.mark.timeout(600)

# -- the parsers, built once ------------------------------------------------------------------
GATEWAY_UPDATE = ["update", "--gateway", "tcp://127.0.0.1:1"]
START = ["start", "--experts", "1", "--new-version", "1", "--seed", "1"]
SETTLE = ["--experts", "1", "--serve-version", "1"]
ACTION_ARGS = {"update start": START[1:], "update settle": SETTLE, "placement save": ["map.json"],
               "placement load": ["map.json"], "workers add": ["tcp://127.0.0.1:5000"], "workers drain": ["1"],
               "workers remove": ["1"], "workers scale": ["2"]}


@lru_cache(maxsize=None)
def parsers():
    from bench import cli as bench_cli
    from gateway import cli as gateway_cli
    from workers import flags as worker_flags

    return gateway_cli.make_parser(), worker_flags.build_parser(), bench_cli.build_parser()


def subparsers(p: argparse.ArgumentParser) -> dict:
    for a in p._actions:
        if isinstance(a, argparse._SubParsersAction):
            return dict(a.choices)
    return {}


def commands() -> list[tuple[str, argparse.ArgumentParser, list[str], list[str]]]:
    """(name, parser, argv before the flag, argv after it): a valid command line around
    the flag under test."""
    (gw, update), worker, bench = parsers()
    out = [("moe-gateway", gw, [], []), ("moe-worker", worker, [], [])]
    for command, first in (("update", "status"), ("placement", "show"), ("workers", "list")):
        parent = subparsers(gw)[command]
        out.append((f"moe-gateway {command}", parent, [command], [first]))
        for name, sub in subparsers(parent).items():
            out.append((f"moe-gateway {command} {name}", sub, [command, *GATEWAY_UPDATE[1:], name],
                        ACTION_ARGS.get(f"{command} {name}", [])))
    for name, sub in subparsers(bench).items():
        out.append((f"moe-bench {name}", sub, [name], []))
    return out


def run_in_process(name: str, argv: list[str]) -> tuple[int, str]:
    """(exit code, stderr) of the command's parse-and-check of ``argv`` (0: it passed)."""
    from bench import cli as bench_cli
    from gateway import cli as gateway_cli
    from workers import cli as worker_cli

    (gw, update), worker, bench = parsers()
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            if name.startswith("moe-gateway"):
                gateway_cli.parse_args(argv, parsers=(gw, update))
            elif name == "moe-worker":
                worker_cli.parse_args(argv, parser=worker)
            else:
                bench_cli.parse(argv, parser=bench)
        except SystemExit as e:
            return int(e.code or 0), err.getvalue()
    return 0, err.getvalue()


# -- malformed values of every type ---------------------------------------------------------------
words = st.text(alphabet="abcxyz_!? ", min_size=1, max_size=8).filter(lambda s: s.strip() != "")
nan_inf = st.sampled_from(["nan", "inf", "-inf", "1e999"])
not_a_number = st.one_of(words, nan_inf, st.just(""))
negative = st.floats(max_value=-1e-6, min_value=-1e9, allow_nan=False).map(repr)
no_scheme = st.from_regex(r"\A[a-z0-9.]{1,12}(:[0-9]{1,5})?\Z").filter(lambda s: "://" not in s)
bad_urls = st.one_of(no_scheme, st.sampled_from(["ftp://h:1", "tcp://host", "tcp://h:99999", "tcp://", "shm://",
                                                  "rdma://10.0.0.1", "tcp://h:1/path", "tcp:/h:1"]))
reversed_range = st.tuples(st.integers(1, 500), st.integers(1, 500)).filter(lambda t: t[0] > t[1]) \
    .map(lambda t: f"{t[0]}-{t[1]}")
bad_ids = st.one_of(reversed_range, st.sampled_from(["-3", "a", "1,a", "", ",", "1-", "0x2", "1.5"]))
bad_floats = st.one_of(words, st.sampled_from(["", ",", "1,,x", "nan", "1,inf"]))
missing_path = st.from_regex(r"\A[a-z]{4,10}\Z").map(lambda s: f"/nonexistent-moe/{s}")


def ints_below(low: int):
    return st.one_of(not_a_number, st.integers(max_value=low - 1).map(str), st.sampled_from(["1.5", "2e3"]))


def floats_outside(low: float, high: float = float("inf"), low_open: bool = False):
    below = st.floats(max_value=low, min_value=low - 1e6, allow_nan=False, exclude_max=not low_open).map(repr)
    out = [not_a_number, below]
    if high != float("inf"):
        out.append(st.floats(min_value=high, max_value=high + 1e6, exclude_min=True, allow_nan=False).map(repr))
    return st.one_of(*out)


def strategy(a: argparse.Action):
    """Values a flag must refuse; None for free text (paths written, an address handed on)."""
    if a.choices is not None:
        return st.text(min_size=1, max_size=12).filter(lambda s: s not in a.choices and s.upper() not in a.choices
                                                       and not s.startswith("-"))
    name = getattr(a.type, "__name__", None)
    return {
        "count": ints_below(0), "positive_int": ints_below(1), "int": not_a_number,
        "port": st.one_of(ints_below(0), st.integers(65536, 10 ** 6).map(str)),
        "seconds": floats_outside(0.0), "nonnegative": floats_outside(0.0),
        "positive_seconds": floats_outside(0.0, low_open=True), "positive_number": floats_outside(0.0, low_open=True),
        "fraction": floats_outside(0.0, 1.0), "ms_as_seconds": floats_outside(0.0),
        "url": bad_urls, "url_list": st.one_of(bad_urls, bad_urls.map(lambda u: f"tcp://127.0.0.1:5,{u}")),
        "int_list": bad_ids, "floats": bad_floats, "host": st.sampled_from(["a b", "a/b", "-x", "x..y", "?", ""]),
        "directory": st.one_of(missing_path, st.just("")), "file_path": st.one_of(missing_path, st.just("")),
        "chunk_rows_flag": st.one_of(words.filter(lambda s: s.strip() not in ("auto", "off")), negative),
        "_sizes": st.one_of(words, st.sampled_from(["-1", "1Q", "4KK", ""])), "parse_size": words,
        "_figures": st.one_of(words, st.just("descriptor,what")),
        "seconds_pair": st.one_of(words, st.sampled_from(["2,1", "a,b", "-1,2", "1,nan"])),
        "scale_event": st.one_of(words, st.sampled_from(["10", "10:", ":2", "-1:2", "1:0", "a:b", "1:2.5"])),
    }.get(name)


# flags whose values are validated after parsing (a UsageError, exit 2): how to get one wrong
CHECKED_LATER = {
    "--systems": st.one_of(words, st.just("moe-transport,nope")),
    "--sweep": st.sampled_from(["nokey=1,2", "n_experts", "n_experts=", "d_model=a,b", "=1"]),
    "--compare": st.sampled_from(["nokey=1,2", "batching=", "batching=fifo,nonsense", "max_inflight_rounds=x"]),
    "--scenarios": st.sampled_from(["nope", "zipf,nope", "zipf,zipf", ",", "uniform,zipf"]),  # (and no --compare)
}
# free text by nature: a file this command writes, an address handed to Ray, a directory made
FREE_TEXT = {"--json", "--plot", "--markdown", "--log-dir", "--ray-address", "--weights", "--checkpoint",
             "--server-device"}


def flags() -> list[tuple[str, str]]:
    out = []
    for name, p, _, _ in commands():
        for a in p._actions:
            if a.nargs == 0 or not a.option_strings or a.help is argparse.SUPPRESS:
                continue
            out.append((name, max(a.option_strings, key=len)))
    return out


def action(name: str, flag: str) -> argparse.Action:
    p = next(p for n, p, _, _ in commands() if n == name)
    return next(a for a in p._actions if flag in a.option_strings)


def test_every_flag_has_a_malformed_value_strategy_or_is_known_free_text():
    """A new flag with a type of its own gets a strategy here, or this test fails."""
    loose = []
    for name, flag in flags():
        a = action(name, flag)
        if strategy(a) is None and flag not in CHECKED_LATER:
            if flag not in FREE_TEXT or (a.type is not None and flag not in ("--checkpoint", "--weights")):
                loose.append((name, flag, getattr(a.type, "__name__", a.type)))
    assert not loose, loose


@pytest.mark.parametrize("name,flag", [f for f in flags()
                                       if strategy(action(*f)) is not None or f[1] in CHECKED_LATER],
                         ids=lambda v: v.replace(" ", "_") if isinstance(v, str) else v)
@settings(max_examples=12, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(data=st.data())
def test_a_malformed_value_is_a_one_line_usage_error(name, flag, data):
    a = action(name, flag)
    malformed = strategy(a)
    value = data.draw(CHECKED_LATER[flag] if malformed is None else malformed, label=flag)
    _, _, before, after = next(c for c in commands() if c[0] == name)
    code, err = run_in_process(name, [*before, f"{flag}={value}", *after])
    assert code == O.USAGE_ERROR, (name, flag, value, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith(name.split()[0]) and "error:" in lines[0], err
    assert flag in lines[0] or "--" in lines[0], err  # names the flag (or, checked later, the flags at fault)


def test_valid_values_pass_the_same_checks():
    """The property above is not vacuous: the baseline command lines parse."""
    for name, _, before, after in commands():
        if name in ("moe-gateway update", "moe-gateway placement", "moe-gateway workers"):
            before = [before[0], *GATEWAY_UPDATE[1:]]  # the flags under test there include --gateway itself
        code, err = run_in_process(name, [*before, *after])
        assert code == 0, (name, err)


# -- the mistakes the first users met, as real commands ---------------------------------------------
def run(*argv: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", *argv], capture_output=True, text=True, timeout=timeout)


def one_line(p: subprocess.CompletedProcess) -> str:
    assert "Traceback" not in p.stderr, p.stderr
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1, p.stderr
    return lines[0]


def test_a_url_without_a_scheme_says_what_it_should_look_like():
    p = run("gateway.cli", "update", "--gateway", "127.0.0.1:7000", "status")
    assert p.returncode == 2
    line = one_line(p)
    assert "'127.0.0.1:7000' has no scheme" in line and "did you mean tcp://127.0.0.1:7000?" in line, line


def test_the_update_flags_go_after_the_action_too_and_a_runtime_failure_exits_1():
    p = run("gateway.cli", "update", "status", "--gateway", "tcp://127.0.0.1:1", "--timeout", "2")
    assert p.returncode == 1  # parsed; the gateway is not there: a failure at run time
    assert "cannot reach the gateway at tcp://127.0.0.1:1" in one_line(p)
    p = run("gateway.cli", "update", "status")
    assert p.returncode == 2 and "--gateway URL is required" in one_line(p)


def test_a_reversed_range_is_refused():
    p = run("workers.cli", "--experts", "5-2")
    assert p.returncode == 2 and "the range 5-2 ends below its start: write 2-5" in one_line(p)


def test_workers_that_cannot_be_reached_are_a_runtime_failure():
    p = run("gateway.cli", "--workers", "tcp://127.0.0.1:1", "--connect-timeout", "1", "--d-model", "16")
    assert p.returncode == 1 and "worker tcp://127.0.0.1:1 did not answer within 1 s" in one_line(p)


def test_contradicting_flags_are_usage_errors_in_each_tool():
    p = run("gateway.cli", "--layers", "1")
    assert p.returncode == 2 and "--layers needs --checkpoint" in one_line(p)
    p = run("gateway.cli", "--n-experts", "4", "--gate-bias", "1,2")
    assert p.returncode == 2 and "--gate-bias needs 4 values" in one_line(p)
    p = run("bench.cli", "transport", "--cpus", "0")
    assert p.returncode == 2 and "--cpus takes two CPUs" in one_line(p)
    p = run("bench.cli", "chaos", "--deadline", "2", "--worker-timeout", "3")
    assert p.returncode == 2 and "--deadline 2 must exceed --worker-timeout 3" in one_line(p)
    p = run("bench.cli", "load", "--sweep", "n_experts=4,8", "--gateway", "tcp://127.0.0.1:1")
    assert p.returncode == 2 and "cannot change a running --gateway" in one_line(p)
