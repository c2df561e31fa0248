"""Command-line pieces every moe-transport command shares: one meaning per flag name, one
help style, one way to report a mistake.

- :class:`Parser` (an ``argparse.ArgumentParser``) formats help with :class:`HelpFormatter`
  and reports a usage error as one line saying what to do, exit code 2.
- The value types below (:func:`url`, :data:`seconds`, :data:`count`, :func:`int_list` ...)
  refuse a malformed value with a message naming what was expected, and give the help its
  metavar (``--worker-timeout SECONDS``).
- :func:`alias` keeps a renamed flag working without showing it.
- :func:`run_main` runs a command's body: :class:`UsageError` exits 2, any other failure 1,
  each as one line (the traceback only at ``--log-level DEBUG``).
"""
from __future__ import annotations

import argparse
import ipaddress
import logging
import math
import os
import re
import sys
from typing import Any, Callable, Optional, Sequence

from .secrets import is_loopback

LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
USAGE_ERROR, FAILURE = 2, 1  # exit codes: the user's mistake, or something that failed at run time
SCHEMES = ("tcp", "shm", "rdma")

log = logging.getLogger("moe.cli")


def version() -> str:
    try:
        from importlib.metadata import version as v

        return v("moe-transport")
    except Exception:  # running from a checkout that was never installed
        return "unknown"


class UsageError(ValueError):
    """A mistake on the command line that parsing alone cannot see (flags that contradict
    each other or what a file says): one line, exit code 2."""


# -- help ----------------------------------------------------------------------------------
def show_default(value: Any) -> str:
    """A default as a user would type it: 180 not 180.0, 0,1 not [0, 1]."""
    if isinstance(value, float):
        return f"{value:g}"
    if isinstance(value, (list, tuple)):
        return ",".join(show_default(v) for v in value)
    return str(value)


class HelpFormatter(argparse.HelpFormatter):
    """One help style for every command: each flag's default shown once (after its help,
    unless the help already says it; never for a required flag, a switch, or a flag whose
    absence means something the help describes), metavars from the value's type (SECONDS,
    URL, N ...), and descriptions and epilogs written with line breaks kept as written (the
    examples), others filled to the terminal's width."""

    def __init__(self, prog: str, indent_increment: int = 2, max_help_position: int = 30,
                 width: Optional[int] = None) -> None:
        super().__init__(prog, indent_increment, max_help_position, width)

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        if "\n" in text.strip("\n"):
            return "".join(indent + line for line in text.splitlines(keepends=True))
        return super()._fill_text(text, width, indent)

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        d = action.default
        if (action.required or action.nargs == 0 or d is None or d is argparse.SUPPRESS
                or (isinstance(d, (list, tuple)) and not d)
                or "%(default)" in text or re.search(r"\bdefault\b", text, re.I)):
            return text
        return f"{text} (default: {show_default(d).replace('%', '%%')})"

    def _get_default_metavar_for_optional(self, action: argparse.Action) -> str:
        named = getattr(action.type, "metavar", None)
        if named:
            return named
        if action.type is int:
            return "N"
        if action.type is float:
            return "NUMBER"
        return action.dest.upper()


class Parser(argparse.ArgumentParser):
    """argparse in the project's style: :class:`HelpFormatter`, and a usage error printed
    as ONE line (what is wrong and where to look), exit code 2 -- not the whole usage."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(USAGE_ERROR, f"{self.prog}: error: {message} (see '{self.prog} --help')\n")


def examples(*lines: str) -> str:
    """An epilog of example command lines (kept as written by :class:`HelpFormatter`)."""
    return "examples:\n" + "".join(f"  {line}\n" for line in lines)


# -- value types -----------------------------------------------------------------------------
def _named(fn: Callable[[str], Any], name: str, metavar: str) -> Callable[[str], Any]:
    fn.__name__ = fn.__qualname__ = name
    fn.metavar = metavar  # type: ignore[attr-defined]
    return fn


named_type = _named  # a value type of one's own: its name (one meaning per flag) and metavar


def _number(text: str, kind: type, what: str) -> Any:
    try:
        v = kind(text.strip())
    except (ValueError, TypeError, OverflowError):
        raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
    if isinstance(v, float) and not math.isfinite(v):
        raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}")
    return v


def int_at_least(low: int, name: str, metavar: str = "N") -> Callable[[str], int]:
    """argparse type: a whole number >= ``low``."""
    what = f"a whole number >= {low}"

    def parse(text: str) -> int:
        v = _number(text, int, what)
        if v < low:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}")
        return v
    return _named(parse, name, metavar)


def float_in(low: float, high: float = math.inf, *, name: str, metavar: str, unit: str = "",
             low_open: bool = False) -> Callable[[str], float]:
    """argparse type: a finite number in [low, high] (or (low, high] with ``low_open``)."""
    rng = (f"> {low:g}" if low_open else f">= {low:g}") + (f" and <= {high:g}" if high != math.inf else "")
    what = f"a number{' of ' + unit if unit else ''} {rng}"

    def parse(text: str) -> float:
        v = _number(text, float, what)
        if v < low or (low_open and v == low) or v > high:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}")
        return v
    return _named(parse, name, metavar)


count = int_at_least(0, "count")  # a count or seed: 0, 1, 2 ...
positive = int_at_least(1, "positive_int")  # a size or a number of things that cannot be 0
_port_range = int_at_least(0, "port", "PORT")


def _port(text: str) -> int:
    v = _port_range(text)
    if v > 65535:
        raise argparse.ArgumentTypeError(f"expected a port 0-65535, got {text!r}")
    return v


port = _named(_port, "port", "PORT")
seconds = float_in(0.0, name="seconds", metavar="SECONDS", unit="seconds")
positive_seconds = float_in(0.0, name="positive_seconds", metavar="SECONDS", unit="seconds", low_open=True)
fraction = float_in(0.0, 1.0, name="fraction", metavar="FRACTION")
nonnegative = float_in(0.0, name="nonnegative", metavar="NUMBER")
positive_number = float_in(0.0, name="positive_number", metavar="NUMBER", low_open=True)


def _ms_to_seconds(text: str) -> float:
    return float_in(0.0, name="ms", metavar="MS", unit="milliseconds")(text) / 1e3


milliseconds_as_seconds = _named(_ms_to_seconds, "ms_as_seconds", "MS")


def parse_int_list(text: str) -> list[int]:
    """'0,1,2' or '0-3' or '0-3,6' -> [0, 1, 2, 3, 6]; ValueError on anything else (a
    negative id, a range whose end is below its start, a word)."""
    out: list[int] = []
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        m = re.fullmatch(r"(\d+)(?:\s*-\s*(\d+))?", part)
        if not m:
            raise ValueError(f"{part!r} is not an id (0, 1, ...) or a range like 0-3")
        lo = int(m.group(1))
        hi = int(m.group(2)) if m.group(2) is not None else lo
        if hi < lo:
            raise ValueError(f"the range {part} ends below its start: write {hi}-{lo}")
        if hi - lo > 1 << 20:
            raise ValueError(f"the range {part} is too long")
        out.extend(range(lo, hi + 1))
    if not out:
        raise ValueError("no ids given")
    return out


def _int_list(text: str) -> list[int]:
    try:
        return parse_int_list(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"expected ids like 0,1,2 or 0-3: {e}") from None


int_list = _named(_int_list, "int_list", "IDS")
cpu_list = _named(lambda text: _int_list(text), "int_list", "CPUS")


def _float_list(text: str) -> list[float]:
    out = []
    for part in text.split(","):
        if part.strip():
            out.append(_number(part, float, "comma-separated numbers like 0.1,0.5,1"))
    if not out:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers like 0.1,0.5,1, got {text!r}")
    return out


def _floats(text: str) -> str:
    _float_list(text)
    return text.strip()


floats = _named(_floats, "floats", "NUMBERS")  # comma-separated numbers, kept as the text given


def check_url(text: str, schemes: Sequence[str] = SCHEMES) -> str:
    """``text`` if it is a transport URL this project serves (tcp://HOST:PORT, shm://NAME,
    rdma://IP:PORT), else ValueError saying what it should look like."""
    shape = "tcp://HOST:PORT, shm://NAME or rdma://IP:PORT"
    text = text.strip()
    scheme, sep, rest = text.partition("://")
    if not sep:
        hint = f"; did you mean tcp://{text}?" if re.fullmatch(r"[\w.\-]+:\d+|\[[0-9a-fA-F:.]+\]:\d+", text) else ""
        raise ValueError(f"{text!r} has no scheme: expected a URL like {shape}{hint}")
    if scheme not in schemes:
        raise ValueError(f"{text!r}: unknown scheme {scheme}://; use {', '.join(s + '://' for s in schemes)}")
    if not rest or "/" in rest or any(c.isspace() for c in rest):
        raise ValueError(f"{text!r}: expected a URL like {shape}")
    if scheme in ("tcp", "rdma"):
        host, _, p = rest.rpartition(":")
        if not host or not p.isdigit() or int(p) > 65535:
            raise ValueError(f"{text!r}: expected {scheme}://HOST:PORT with a port 0-65535")
    return text


def _url(text: str) -> str:
    try:
        return check_url(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _url_list(text: str) -> str:
    urls = [u.strip() for u in text.split(",") if u.strip()]
    if not urls:
        raise argparse.ArgumentTypeError("expected comma-separated URLs like tcp://10.0.0.2:5000,shm://w1")
    for u in urls:
        _url(u)
    return ",".join(urls)


url = _named(_url, "url", "URL")
url_list = _named(_url_list, "url_list", "URLS")


def _host(text: str) -> str:
    t = text.strip()
    try:
        ipaddress.ip_address(t.strip("[]"))
        return t
    except ValueError:
        pass
    if re.fullmatch(r"(?=.{1,253}$)[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?(?:\.[A-Za-z0-9]"
                    r"(?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*", t):
        return t
    raise argparse.ArgumentTypeError(f"expected an IP address or host name, got {text!r}")


host = _named(_host, "host", "HOST")


def _path(text: str) -> str:
    if not text.strip():
        raise argparse.ArgumentTypeError("expected a path, got ''")
    return text


# a directory or a file this command reads: parsing takes any path (a recipe for another
# host parses here); check_paths() refuses a missing one before the command starts
directory = _named(lambda text: _path(text), "directory", "DIR")
file_path = _named(lambda text: _path(text), "file_path", "PATH")


def check_paths(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """UsageError for a directory or file flag (types :data:`directory`, :data:`file_path`)
    given a path that is not one."""
    for a in parser._actions:
        kind = {"directory": "directory", "file_path": "file"}.get(getattr(a.type, "__name__", ""))
        value = getattr(args, a.dest, None)
        if kind is None or not isinstance(value, str):
            continue
        ok = os.path.isdir(value) if kind == "directory" else os.path.isfile(value)
        if not ok:
            why = "does not exist" if not os.path.exists(value) else f"is not a {kind}"
            raise UsageError(f"{max(a.option_strings, key=len)} {value}: {why}")


def alias(p: argparse._ActionsContainer, old: str, new: str, **kwargs: Any) -> None:
    """Keep the renamed flag ``old`` working as ``new`` (same dest), hidden from the help."""
    kwargs.setdefault("dest", new.lstrip("-").replace("-", "_"))
    p.add_argument(old, help=argparse.SUPPRESS, default=argparse.SUPPRESS, **kwargs)


# -- flags every service has -----------------------------------------------------------------
def add_common(p: argparse.ArgumentParser, prog: str) -> None:
    """--version and --log-level."""
    p.add_argument("--version", action="version", version=f"{prog} {version()}")
    p.add_argument("--log-level", default="WARNING", type=str.upper, choices=LOG_LEVELS,
                   help="log verbosity (logs go to stderr)")


def add_security(p: argparse._ActionsContainer, *, service: bool, **defaults: Any) -> None:
    """--secret-file and --insecure (a service: serve without a secret; a client: connect
    without one). ``defaults`` override the flags' defaults (argparse.SUPPRESS on a
    subcommand whose parent has them too)."""
    p.add_argument("--secret-file", default=defaults.get("secret_file"), type=file_path,
                   help="file holding the shared secret both ends prove at connect time (HMAC); "
                        "default: $MOE_SECRET_FILE, else the per-user default file "
                        "(~/.config/moe-transport/secret)")
    if service:
        p.add_argument("--insecure", action="store_true", default=defaults.get("insecure", False),
                       help="no shared secret unless --secret-file or $MOE_SECRET_FILE names one (the per-user "
                            "default is not used), and allow a tcp:// or rdma:// listener on a non-loopback "
                            "address without one: for a trusted network, where every service and client "
                            "runs with --insecure")
    else:
        p.add_argument("--insecure", action="store_true", default=defaults.get("insecure", False),
                       help="connect without a shared secret, to a service started with --insecure")


def setup_logging(level: str, prog: str) -> None:
    logging.basicConfig(level=level, stream=sys.stderr, format=f"{prog}[{os.getpid()}] %(levelname)s %(message)s")


def check_exposure(url: str, secret: Optional[bytes], insecure: bool, prog: str) -> None:
    """Refuse to listen where strangers can reach us without a secret (unless --insecure)."""
    if secret is None and not insecure and not is_loopback(url):
        raise UsageError(f"refusing to listen on {url} without a shared secret: strangers could reach it. "
                         "Give --secret-file (or MOE_SECRET_FILE), or --insecure if the network is trusted")


def raise_fd_limit() -> None:
    """A service holds a descriptor per connection: take the hard limit."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        except (ValueError, OSError):
            pass


# -- running a command -----------------------------------------------------------------------
def one_line(e: BaseException) -> str:
    text = str(e).strip()
    return text if text else type(e).__name__


def run_main(prog: str, body: Callable[[], Optional[int]]) -> int:
    """Run a command's body and return its exit code: UsageError -> 2, any other exception
    -> 1, each printed as ``prog: ...`` on stderr without a traceback (logged at DEBUG);
    Ctrl-C -> 130."""
    try:
        return int(body() or 0)
    except UsageError as e:
        print(f"{prog}: error: {one_line(e)}", file=sys.stderr)
        return USAGE_ERROR
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130
    except SystemExit:
        raise
    except Exception as e:
        log.debug("%s failed", prog, exc_info=True)
        print(f"{prog}: {one_line(e)}", file=sys.stderr)
        return FAILURE
