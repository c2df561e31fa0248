"""Authentication as a user meets it, with real processes: `--insecure` means the same on
every service (a gateway and workers all started with it serve, and none of them makes or
uses the per-user default secret); mixed settings fail at start with one line saying which
side has a secret and how to match them; a client with the wrong secret is told which file
it used and whence, and the service logs the refusal (at its default level) with the
peer's address."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from transport.service.launch import blas_env, spawn_service, stop_process

pytestmark = pytest.mark.timeout(120)
D = 16


@pytest.fixture
def env(tmp_path) -> dict:
    """A user with no secret anywhere yet: a fresh config home, no MOE_SECRET_FILE."""
    e = blas_env(1)
    e.pop("MOE_SECRET_FILE", None)
    e["XDG_CONFIG_HOME"] = str(tmp_path / "config")
    return e


def secret_file(path: Path, text: str) -> str:
    path.write_text(text + "\n")
    path.chmod(0o600)
    return str(path)


def worker(env: dict, *flags: str, stderr=None):
    return spawn_service([sys.executable, "-m", "workers.cli", "--listen", "tcp://127.0.0.1:0", "--experts", "0-7",
                          "--d-model", str(D), "--d-ff", "32", *flags], env=env, stderr=stderr)


def gateway_argv(*flags: str) -> list[str]:
    return [sys.executable, "-m", "gateway.cli", "--listen", "tcp://127.0.0.1:0", "--connect-timeout", "5", *flags]


def client_forward(url: str, env: dict, secret: str = "FIND") -> subprocess.CompletedProcess:
    code = ("import sys, numpy as np\nfrom gateway.client import GatewayClient\nfrom transport.service import secrets\n"
            f"s = secrets.FIND if {secret!r} == 'FIND' else None\n"
            "with GatewayClient(sys.argv[1], timeout=10, secret=s) as c:\n"
            f"    print(c.forward(np.ones((3, {D}), np.float32)).shape)\n")
    return subprocess.run([sys.executable, "-c", code, url], env=env, capture_output=True, text=True, timeout=60)


def test_gateway_and_workers_all_insecure_serve_and_make_no_secret(env, tmp_path):
    w, wurl = worker(env, "--insecure")
    procs = [w]
    try:
        g, gurl = spawn_service(gateway_argv("--insecure", "--workers", wurl), env=env)
        procs.append(g)
        r = client_forward(gurl, env, secret=None)
        assert r.returncode == 0 and r.stdout.strip() == f"(3, {D})", r.stderr
        # and a gateway that starts its own workers, --insecure: they are started with it too
        g2, gurl2 = spawn_service(gateway_argv("--insecure", "--local-workers", "1", "--backend", "tcp",
                                               "--d-model", str(D), "--d-ff", "32"), env=env)
        procs.append(g2)
        r = client_forward(gurl2, env, secret=None)
        assert r.returncode == 0 and r.stdout.strip() == f"(3, {D})", r.stderr
    finally:
        for p in reversed(procs):
            stop_process(p, timeout=10)
    assert not (tmp_path / "config" / "moe-transport" / "secret").exists()  # nobody made the default


def test_a_secure_gateway_and_an_insecure_worker_say_which_side_has_the_secret(env, tmp_path):
    w, wurl = worker(env, "--insecure")
    try:
        r = subprocess.run(gateway_argv("--workers", wurl), env=env, capture_output=True, text=True, timeout=60)
    finally:
        stop_process(w, timeout=10)
    default = tmp_path / "config" / "moe-transport" / "secret"
    assert r.returncode == 1, r.stderr
    line = r.stderr.strip().splitlines()[-1]
    assert "Traceback" not in r.stderr
    assert f"the worker at {wurl} has no shared secret" in line and "this gateway has one" in line, line
    assert str(default) in line and "per-user default" in line and "--insecure" in line, line


def test_an_insecure_gateway_and_a_worker_with_a_secret(env, tmp_path):
    a = secret_file(tmp_path / "a", "aaaa")
    w, wurl = worker(env, "--secret-file", a)
    try:
        r = subprocess.run(gateway_argv("--insecure", "--workers", wurl), env=env, capture_output=True, text=True,
                           timeout=60)
    finally:
        stop_process(w, timeout=10)
    assert r.returncode == 1, r.stderr
    line = r.stderr.strip().splitlines()[-1]
    assert f"the worker at {wurl} requires a shared secret and this gateway has none" in line, line
    assert "--secret-file" in line and "--insecure" in line, line


def test_a_client_with_another_secret_is_told_which_file_and_the_gateway_logs_it(env, tmp_path):
    a, b = secret_file(tmp_path / "a", "aaaa"), secret_file(tmp_path / "b", "bbbb")
    err = tmp_path / "gateway.stderr"
    with open(err, "w") as f:
        g, gurl = spawn_service(gateway_argv("--secret-file", a, "--local-workers", "1", "--backend", "tcp",
                                             "--d-model", str(D), "--d-ff", "32"), env=env, stderr=f)
    try:
        r = client_forward(gurl, dict(env, MOE_SECRET_FILE=b))
        assert r.returncode != 0
        last = r.stderr.strip().splitlines()[-1]
        assert f"the gateway at {gurl} and this client hold different shared secrets" in last, last
        assert f"{b} (from $MOE_SECRET_FILE)" in last, last
        u = subprocess.run([sys.executable, "-m", "gateway.cli", "update", "status", "--gateway", gurl,
                            "--secret-file", b], env=env, capture_output=True, text=True, timeout=60)
        assert u.returncode == 1 and "Traceback" not in u.stderr, u.stderr
        assert u.stderr.count("\n") == 1 and f"{b} (from --secret-file)" in u.stderr, u.stderr
        ok = subprocess.run([sys.executable, "-m", "gateway.cli", "update", "status", "--gateway", gurl,
                             "--secret-file", a], env=env, capture_output=True, text=True, timeout=60)
        assert ok.returncode == 0 and '"state"' in ok.stdout, ok.stderr
    finally:
        stop_process(g, timeout=10)
    log = err.read_text()
    refused = [line for line in log.splitlines() if "WARNING" in line and "clients: refused the handshake of tcp://127.0.0.1:" in line]
    assert len(refused) == 2 and all("different shared secret" in line for line in refused), log


def test_refusals_are_logged_at_most_a_burst_per_interval(env, tmp_path):
    """A client hammering with the wrong secret: the gateway's log says so a few times and
    then how many more, instead of a line per attempt."""
    import transport
    from transport.service import accepting as L

    a, b = secret_file(tmp_path / "a", "aaaa"), secret_file(tmp_path / "b", "bbbb")
    err = tmp_path / "gateway.stderr"
    with open(err, "w") as f:
        g, gurl = spawn_service(gateway_argv("--secret-file", a, "--local-workers", "1", "--backend", "tcp",
                                             "--d-model", str(D), "--d-ff", "32"), env=env, stderr=f)
    try:
        for _ in range(3 * L.REFUSAL_LOG_BURST):
            with pytest.raises(transport.AuthenticationError):
                transport.connect(gurl, timeout=5, secret=Path(b).read_bytes().strip())
    finally:
        stop_process(g, timeout=10)
    refused = [line for line in err.read_text().splitlines() if "refused the handshake" in line]
    assert len(refused) == L.REFUSAL_LOG_BURST, refused  # all within one interval: the rest counted


def test_a_one_layer_checkpoint_gateway_answers_a_plain_forward(env, tmp_path):
    """--checkpoint DIR --layers 1: a request that names no layer goes to layer 1 (the one
    served); one that names layer 0 is refused, saying which layers are served."""
    from gateway.client import GatewayClient
    from tests.ckpt_helpers import tiny_checkpoint
    from workers.protocol import RemoteError

    ck, cfg, _ = tiny_checkpoint(str(tmp_path / "ckpt"), "mixtral")
    a = secret_file(tmp_path / "a", "aaaa")
    g, gurl = spawn_service(gateway_argv("--secret-file", a, "--checkpoint", ck, "--layers", "1",
                                         "--local-workers", "1", "--backend", "tcp"), env=env)
    try:
        x = np.random.default_rng(0).standard_normal((3, cfg["hidden_size"])).astype(np.float32)
        with GatewayClient(gurl, timeout=20, secret_file=a) as c:
            np.testing.assert_array_equal(c.forward(x), c.forward(x, layer=1))
            with pytest.raises(RemoteError, match=r"layer 0 is not served here \(layers: \[1\]\)"):
                c.forward(x, layer=0)
    finally:
        stop_process(g, timeout=10)
    assert os.environ.get("MOE_SECRET_FILE")  # the session's, untouched by these tests' env
