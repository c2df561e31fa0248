"""The per-user default secret: made once, private, and the same for every process that
races to make it (workers started together on a fresh machine)."""
from __future__ import annotations

import multiprocessing as mp
import os
import stat

import pytest

from transport.service import secrets


def _make(config: str, barrier, out) -> None:
    os.environ["XDG_CONFIG_HOME"] = config
    barrier.wait(10)
    try:
        out.put(secrets.create_default()[0])
    except Exception as e:  # reported, not raised: the parent asserts
        out.put(repr(e))


def test_default_secret_is_private_and_kept(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))
    first, path = secrets.create_default()
    assert path == str(tmp_path / "moe-transport" / "secret")
    assert len(first) == 2 * secrets.SECRET_BYTES
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(os.path.dirname(path)).st_mode) == 0o700
    assert secrets.create_default() == (first, path)
    assert os.listdir(os.path.dirname(path)) == ["secret"]


def test_processes_racing_to_make_it_all_get_one_secret(tmp_path):
    ctx = mp.get_context("fork")
    n = 6
    for attempt in range(15):
        config = str(tmp_path / f"c{attempt}")
        barrier, out = ctx.Barrier(n), ctx.Queue()
        procs = [ctx.Process(target=_make, args=(config, barrier, out)) for _ in range(n)]
        for p in procs:
            p.start()
        got = [out.get(timeout=30) for _ in procs]
        for p in procs:
            p.join(10)
        assert all(isinstance(g, bytes) for g in got), got
        assert len(set(got)) == 1, got
        assert os.listdir(os.path.join(config, "moe-transport")) == ["secret"]


def test_an_empty_secret_file_is_refused(tmp_path):
    p = tmp_path / "s"
    p.write_text("\n")
    with pytest.raises(secrets.SecretError, match="empty"):
        secrets.read(str(p))


def test_whence_and_advice_name_the_file_and_the_fix(tmp_path, monkeypatch):
    from transport.errors import AuthenticationError as A

    path = str(tmp_path / "s")
    monkeypatch.setenv(secrets.ENV, path)
    assert secrets.whence(None, path) == "from $MOE_SECRET_FILE"
    assert secrets.whence(path, path) == "from --secret-file"
    assert secrets.whence(None, secrets.default_path()) == "the per-user default"
    assert secrets.whence(None, None) == ""
    kw = dict(this="this client", peer="the gateway at tcp://h:1", path=path, source="from --secret-file")
    mismatch = secrets.advice(A("x", A.MISMATCH), **kw)
    assert "hold different shared secrets" in mismatch and f"{path} (from --secret-file)" in mismatch
    mine = secrets.advice(A("x", A.PEER_HAS_NONE), **kw)
    assert "the gateway at tcp://h:1 has no shared secret" in mine and "--insecure" in mine
    theirs = secrets.advice(A("x", A.THIS_HAS_NONE), **dict(kw, path=None, source=""))
    assert "requires a shared secret and this client has none" in theirs
    assert "could not authenticate" in secrets.advice(A("odd"), **kw)


def test_insecure_service_uses_only_a_named_secret(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    monkeypatch.delenv(secrets.ENV, raising=False)
    assert secrets.for_service(None, insecure=True) == (None, None)
    assert not os.path.exists(secrets.default_path())  # --insecure makes no default
    named = tmp_path / "named"
    named.write_text("abc\n")
    named.chmod(0o600)
    assert secrets.for_service(str(named), insecure=True) == (b"abc", str(named))
    secret, path = secrets.for_service(None)  # without --insecure: the default, created
    assert path == secrets.default_path() and secret
