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
