"""Command-line pieces every moe-transport service shares: one meaning per flag name."""
from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import Optional

LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")


def version() -> str:
    try:
        from importlib.metadata import version as v

        return v("moe-transport")
    except Exception:  # running from a checkout that was never installed
        return "unknown"


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Every flag's help shows its default."""


def parse_int_list(text: str) -> list[int]:
    """'0,1,2' or '0-3' or '0-3,6' -> [0, 1, 2, 3, 6]."""
    out: list[int] = []
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        if "-" in part[1:]:
            lo, hi = part.split("-", 1) if not part.startswith("-") else ("-" + part[1:].split("-", 1)[0],
                                                                          part[1:].split("-", 1)[1])
            out.extend(range(int(lo), int(hi) + 1))
        else:
            out.append(int(part))
    return out


def int_list(text: str) -> list[int]:
    """argparse type for parse_int_list, with a clear error."""
    try:
        return parse_int_list(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected ids like 0,1,2 or 0-3, got {text!r}") from None


def add_common(p: argparse.ArgumentParser, prog: str) -> None:
    """--version and --log-level."""
    p.add_argument("--version", action="version", version=f"{prog} {version()}")
    p.add_argument("--log-level", default="WARNING", type=str.upper, choices=LOG_LEVELS,
                   help="log verbosity (logs go to stderr)")


def add_security(p: argparse.ArgumentParser, *, service: bool) -> None:
    """--secret-file (and, for services, --insecure)."""
    p.add_argument("--secret-file", default=None, metavar="PATH",
                   help="file holding the shared secret both ends prove at connect time (HMAC); "
                        "default: $MOE_SECRET_FILE, else the per-user default file "
                        "(~/.config/moe-transport/secret)")
    if service:
        p.add_argument("--insecure", action="store_true",
                       help="allow a tcp:// or rdma:// listener on a non-loopback address without a secret")


def setup_logging(level: str, prog: str) -> None:
    logging.basicConfig(level=level, stream=sys.stderr, format=f"{prog}[{os.getpid()}] %(levelname)s %(message)s")


def check_exposure(url: str, secret: Optional[bytes], insecure: bool, prog: str) -> None:
    """Refuse to listen where strangers can reach us without a secret (unless --insecure)."""
    from .secrets import is_loopback

    if secret is None and not insecure and not is_loopback(url):
        raise SystemExit(f"{prog}: refusing to listen on {url} without a shared secret: strangers could "
                         "reach it. Give --secret-file (or MOE_SECRET_FILE), or --insecure if the network "
                         "is trusted")


def raise_fd_limit() -> None:
    """A service holds a descriptor per connection: take the hard limit."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        except (ValueError, OSError):
            pass
