"""The shared secret's file: where services and clients find it, and how one is made.

What the secret protects (see the README's threat model): who may connect to a service and
who may run its control operations (hot update; a worker's load and retire). It does not
encrypt the data plane.

Order of lookup: an explicit ``--secret-file``, else the ``MOE_SECRET_FILE`` environment
variable, else (where the caller allows it) the per-user default file, which a gateway
creates when it starts without a secret: ``$XDG_CONFIG_HOME/moe-transport/secret`` (else
``~/.config/moe-transport/secret``), mode 0600 in a 0700 directory, so a second local user
can read neither.
"""
from __future__ import annotations

import logging
import os
import secrets
import stat
from typing import Optional

log = logging.getLogger("moe.secret")

ENV = "MOE_SECRET_FILE"
SECRET_BYTES = 32


class _Find:
    def __repr__(self) -> str:
        return "FIND"


#: the default of a client's ``secret`` argument: find it as the services do (None: no secret)
FIND = _Find()


class SecretError(ValueError):
    """A secret file that cannot be used (missing, empty, unreadable)."""


def default_path() -> str:
    base = os.environ.get("XDG_CONFIG_HOME") or os.path.join(os.path.expanduser("~"), ".config")
    return os.path.join(base, "moe-transport", "secret")


def read(path: str) -> bytes:
    """The secret in ``path`` (surrounding whitespace stripped). Warns when others may read it."""
    try:
        with open(path, "rb") as f:
            st = os.fstat(f.fileno())
            data = f.read(4096).strip()
    except OSError as e:
        raise SecretError(f"cannot read the secret file {path}: {e.strerror or e}") from None
    if not data:
        raise SecretError(f"the secret file {path} is empty")
    if st.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        log.warning("secret file %s is readable by other users (mode %o): chmod 600 it",
                    path, stat.S_IMODE(st.st_mode))
    return data


def resolve(secret_file: Optional[str], *, use_default: bool = True) -> tuple[Optional[bytes], Optional[str]]:
    """(secret, path) from ``secret_file``, else $MOE_SECRET_FILE, else the default file if
    it exists and ``use_default``; (None, None) when there is none."""
    path = secret_file or os.environ.get(ENV) or None
    if path is None and use_default and os.path.exists(default_path()):
        path = default_path()
    if path is None:
        return None, None
    return read(path), path


def for_client(secret, secret_file: Optional[str] = None) -> Optional[bytes]:
    """A client's secret: ``secret`` as given (None: none), or FIND it."""
    if secret is FIND:
        return resolve(secret_file)[0]
    return secret


def for_service(secret_file: Optional[str] = None, *, insecure: bool = False
                ) -> tuple[Optional[bytes], Optional[str]]:
    """A service's secret and its file: ``secret_file``, else $MOE_SECRET_FILE, else the
    per-user default, created if none exists yet (so a gateway, its workers and its local
    clients share one). ``insecure`` (--insecure): never the default, so (None, None) when
    neither names a file. OSError when there is none and the default cannot be made (no
    writable home)."""
    secret, path = resolve(secret_file, use_default=False)
    if secret is None and not insecure:
        return create_default()
    return secret, path


def whence(secret_file: Optional[str], path: Optional[str]) -> str:
    """Where the secret file ``path`` came from, for a message: the flag, the environment
    variable, or the per-user default ("" when there is no file)."""
    if path is None:
        return ""
    if secret_file:
        return "from --secret-file"
    if os.environ.get(ENV) and os.path.abspath(os.environ[ENV]) == os.path.abspath(path):
        return f"from ${ENV}"
    return "the per-user default"


def advice(e: Exception, *, this: str, peer: str, path: Optional[str], source: str) -> str:
    """One line for an authentication failure between ``this`` side (which used the secret
    file ``path``, ``source`` saying whence) and ``peer``: which side has which secret, and
    how to match them."""
    from transport.errors import AuthenticationError as A

    mine = (f"{path} ({source})" if source else path) if path else "no secret file"
    why = getattr(e, "why", None)
    if why == A.MISMATCH:
        return (f"{peer} and {this} hold different shared secrets ({this} used {mine}): give both the same "
                f"file (--secret-file PATH or MOE_SECRET_FILE)")
    if why == A.PEER_HAS_NONE:
        return (f"{peer} has no shared secret (started with --insecure?) but {this} has one, {mine}: give "
                f"{peer} --secret-file {path}, or run every side with --insecure on a trusted network")
    if why == A.THIS_HAS_NONE:
        return (f"{peer} requires a shared secret and {this} has none: give {this} --secret-file PATH with "
                f"the file {peer} uses, or start {peer} with --insecure too")
    return f"{this} ({mine}) could not authenticate with {peer}: {e}"


def create_default() -> tuple[bytes, str]:
    """The default file's secret, creating the file (0600, random) if there is none yet."""
    path = default_path()
    directory = os.path.dirname(path)
    os.makedirs(directory, mode=0o700, exist_ok=True)
    if os.path.exists(path):
        return read(path), path
    # written whole under a private name, then linked into place: a process starting beside
    # us (two workers on a fresh machine) finds no file or a full one, never an empty one,
    # and link() fails if another got there first, whose secret we then take
    tmp = f"{path}.{os.getpid()}.{secrets.token_hex(4)}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(secrets.token_hex(SECRET_BYTES).encode() + b"\n")
            f.flush()
            os.fsync(f.fileno())
        try:
            os.link(tmp, path)
        except FileExistsError:
            return read(path), path
    finally:
        os.unlink(tmp)
    log.info("created a shared secret in %s (mode 0600)", path)
    return read(path), path


def is_loopback(url: str) -> bool:
    """Whether a tcp:// or rdma:// URL binds only the loopback interface (shm:// is local)."""
    scheme, _, rest = url.partition("://")
    if scheme not in ("tcp", "rdma"):
        return True
    host = rest.rsplit(":", 1)[0].strip("[]")
    return host in ("localhost", "::1") or host.startswith("127.")
