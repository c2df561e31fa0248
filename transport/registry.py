"""Backends chosen by URL scheme through one registry (as pyzmq's backend/select.py).

A backend is a module with ``listen(address, **options) -> Listener`` and
``connect(address, **options) -> Connection``. Modules are imported on first use so that
a missing optional dependency (pyverbs for rdma) only matters to whoever asks for it.
"""
from __future__ import annotations

import importlib
from typing import Any
from urllib.parse import urlsplit

from .base import Connection, Listener
from .errors import TransportError

_BACKENDS: dict[str, str] = {
    "tcp": "transport.tcp",
    "shm": "transport.shm",
    "rdma": "transport.rdma",
    "inproc": "transport.testing.inproc",
}
#: backends that are test doubles, not transports (both ends in one process)
TEST_DOUBLES = frozenset({"inproc"})
_PUBLIC_API = ("listen", "connect")


def register_backend(scheme: str, module: str) -> None:
    _BACKENDS[scheme] = module


def backend(scheme: str):
    try:
        name = _BACKENDS[scheme]
    except KeyError:
        raise TransportError(f"unknown transport scheme {scheme!r}; known: {sorted(_BACKENDS)}") from None
    mod = importlib.import_module(name)
    missing = [f for f in _PUBLIC_API if not callable(getattr(mod, f, None))]
    if missing:
        raise TransportError(f"backend {name} lacks {missing}")
    return mod


def caller_moves_bytes(url: str) -> bool:
    """Whether this URL's backend moves a message's bytes on the thread that sends or
    receives it (a socket copy), rather than leaving them where they landed (shm, RDMA):
    a service computing on its I/O thread then stops its transport while it computes."""
    return bool(getattr(backend(split_url(url)[0]), "CALLER_MOVES_BYTES", False))


def split_url(url: str) -> tuple[str, str]:
    parts = urlsplit(url)
    if not parts.scheme or not parts.netloc:
        raise ValueError(f"transport URL must look like scheme://address, got {url!r}")
    return parts.scheme, parts.netloc


def listen(url: str, **options: Any) -> Listener:
    scheme, address = split_url(url)
    return backend(scheme).listen(address, **options)


def connect(url: str, **options: Any) -> Connection:
    scheme, address = split_url(url)
    return backend(scheme).connect(address, **options)


def available_backends(include_test_doubles: bool = False) -> list[str]:
    """Schemes whose module imports here (rdma needs pyverbs and a device to be useful);
    test doubles (inproc://) only when asked for."""
    ok = []
    for scheme in _BACKENDS:
        if scheme in TEST_DOUBLES and not include_test_doubles:
            continue
        try:
            backend(scheme)
            ok.append(scheme)
        except Exception:
            pass
    return ok
