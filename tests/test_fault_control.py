"""Issue 11, process level: who may connect and drive control operations, and the hot-update
state machine under refused commands, against real moe-worker and moe-gateway processes.

- a second local user (nobody) can neither drive an update through the gateway nor reach a
  worker directly: over tcp it cannot read the 0600 secret (so the handshake refuses it),
  over shm the listener refuses its uid (SO_PEERCRED);
- an update ``start`` with bad arguments is refused and leaves the state machine as it was;
- a rollback ends even when a worker never acknowledges (a SIGSTOPped one);
- a weights path outside the workers' --update-dir gets the same answer as a missing file.
"""
from __future__ import annotations

import json
import os
import re
import signal
import time

import numpy as np
import pytest

from gateway.client import GatewayClient
from gateway.reference import ReferenceMoE
from tests.helpers_fault import run_as_nobody
from tests.helpers_procs import BACKENDS, Services, backend_problem, wait_until
from workers import protocol as P

D, F, E, K, SEED = 16, 32, 8, 2, 5
TOL = dict(rtol=1e-4, atol=1e-5)
MAX_BATCH = 64
ROWS = MAX_BATCH * K
ACK_TIMEOUT = 3.0

pytestmark = pytest.mark.timeout(180)


def tokens(n, seed=0):
    return np.random.default_rng(seed).standard_normal((n, D)).astype(np.float32)


@pytest.fixture(scope="module")
def reference():
    return ReferenceMoE.from_seed(D, F, E, K, seed=SEED)


class Cluster:
    def __init__(self, services: Services, backend: str, update_dir: str):
        self.backend = backend
        self.update_dir = update_dir
        extra = ["--update-dir", update_dir]
        self.workers = [services.worker(backend, ex, d_model=D, d_ff=F, seed=SEED, max_tokens=ROWS, extra=extra)
                        for ex in ([0, 1, 2, 3], [4, 5, 6, 7])]
        self.gateway = services.gateway(backend, workers=[w.url for w in self.workers], d_model=D, d_ff=F,
                                        n_experts=E, top_k=K, seed=SEED, max_batch_tokens=MAX_BATCH,
                                        max_wait_ms=0, update_ack_timeout=ACK_TIMEOUT)

    def client(self) -> GatewayClient:
        return GatewayClient(self.gateway.url, timeout=20.0)


@pytest.fixture(scope="module", params=BACKENDS)
def cluster(request, tmp_path_factory):
    problem = backend_problem(request.param)
    if problem:
        pytest.fail(problem)
    with Services() as services:
        yield Cluster(services, request.param, str(tmp_path_factory.mktemp("updates")))


def _wait_state(c, states, timeout=20.0):
    end = time.monotonic() + timeout
    while True:
        st = c.update("status")
        if st["state"] in states or time.monotonic() > end:
            return st
        time.sleep(0.05)


# -- a second local user -------------------------------------------------------------------------
NOBODY_IMPORTS = """
import encodings.idna, shutil, argparse, gettext, json, transport, transport.tcp, transport.shm
from gateway import cli
from gateway.client import GatewayClient
from transport.service.secrets import SecretError
from workers import protocol as P
import workers.protocol, time
cli.build_parser()  # its lazy imports, while we can still read the venv
"""

NOBODY_CODE = """
out = {}
try:
    open(os.environ["MOE_SECRET_FILE"], "rb").read()
    out["read_secret"] = "yes"
except PermissionError:
    out["read_secret"] = "denied"
def attempt(url, secret, op):
    try:
        c = transport.connect(url, slot_size=1 << 16, nslots=2, timeout=5, secret=secret)
    except transport.AuthenticationError as e:
        return "auth: " + str(e)
    except transport.Refused as e:
        return "refused: " + str(e)
    except transport.TransportError as e:
        return "closed: " + str(e)
    c.send(op, timeout=5)   # connected: try the control operation itself
    with c.recv(timeout=5) as m:
        return "ANSWERED: " + str(m.header)
gw, wk = sys.argv[1], sys.argv[2]
for secret in (None, b"a-guessed-secret"):
    tag = "guess" if secret else "none"
    out["gateway_" + tag] = attempt(gw, secret, P.request(P.UPDATE, 1, action="start", experts=[0], version=9, seed=1))
    out["worker_" + tag] = attempt(wk, secret, P.request(P.LOAD, 1, expert=0, version=9, seed=1))
try:
    GatewayClient(gw, timeout=5)
    out["client"] = "connected"
except SecretError as e:
    out["client"] = "secret: " + str(e)
out["update_cli"] = cli.main(["update", "--gateway", gw, "--timeout", "5", "start", "--experts", "0",
                              "--new-version", "9", "--seed", "1"])
print(json.dumps(out))
"""


def test_another_local_user_can_neither_update_nor_reach_a_worker(cluster, reference):
    if os.getuid() != 0:
        pytest.skip("needs root to run a client as another user")
    before = _serve_refusals(cluster)
    code = NOBODY_CODE.replace("sys.argv[1], sys.argv[2]", f"{cluster.gateway.url!r}, {cluster.workers[0].url!r}")
    proc = run_as_nobody(code, NOBODY_IMPORTS)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["read_secret"] == "denied"  # the 0600 secret file
    for key in ("gateway_none", "gateway_guess", "worker_none", "worker_guess"):
        if cluster.backend == "shm":  # the uid is refused before any hello
            assert out[key].startswith("refused:") and "not this user" in out[key], (key, out[key])
        else:
            assert out[key].startswith("auth:"), (key, out[key])
    assert out["client"].startswith("secret:") and "Permission denied" in out["client"]
    assert out["update_cli"] == 2
    with cluster.client() as c:
        st = c.update("status")
        assert st["state"] in ("none", "rolled_back", "failed", "done")  # nothing was started by nobody
        assert not any(9 in [v[1] for v in w["versions"]] for w in c.ping()["workers"])
        x = tokens(8, seed=1)
        np.testing.assert_allclose(c.forward(x), reference.forward(x)[0], **TOL)
    assert _serve_refusals(cluster) >= before + 2  # counted (exported in /metrics)


def _serve_refusals(cluster) -> int:
    with cluster.client() as c:
        s = c.ping()["serve"]
    return s["refused_auth"] + s["refused_other"]


# -- the update state machine --------------------------------------------------------------------
BAD_STARTS = [
    dict(experts=[99], version=1, seed=1),
    dict(experts=[], version=1, seed=1),
    dict(experts="1", version=1, seed=1),
    dict(experts=[1], version=-1, seed=1),
    dict(experts=[1], version="2", seed=1),
    dict(experts=[1], version=1),  # neither weights nor seed
    dict(experts=[1], version=1, seed=1, weights="w.npz"),  # both
    dict(experts=[1], version=1, seed="x"),
    dict(experts=[1], version=1, weights=""),
    dict(experts=[1], version=1, seed=1, steps=[0.5, 0.1]),
    dict(experts=[1], version=1, seed=1, steps=[2.0]),
    dict(experts=[1], version=1, seed=1, auto_interval=0),
    dict(experts=[1], version=1, seed=1, auto_interval="soon"),
]


def test_a_refused_update_start_leaves_the_state_machine_as_it_was(cluster, reference):
    """Was: a start with a bad argument left the update wedged for good. Now every refused
    start answers bad_request and changes nothing; a good one then runs and rolls back."""
    x = tokens(8, seed=2)
    y_ref = reference.forward(x)[0]
    with cluster.client() as c:
        before = c.update("status")
        assert before["state"] not in ("loading", "shifting", "finishing", "rolling_back")
        for bad in BAD_STARTS:
            with pytest.raises(P.RemoteError) as info:
                c.update("start", **bad)
            assert info.value.code == P.BAD_REQUEST, bad
            assert c.update("status") == before, bad
        for action in ("advance", "finish", "bogus"):  # nothing to act on, or no such action
            with pytest.raises(P.RemoteError):
                c.update(action)
            assert c.update("status") == before
        st = c.update("start", experts=[1, 5], version=3, seed=7)
        assert st["state"] == "loading"
        with pytest.raises(P.RemoteError):  # one at a time, and the refusal changes nothing
            c.update("start", experts=[2], version=4, seed=7)
        assert _wait_state(c, ("shifting",))["state"] == "shifting"
        assert c.update("rollback")["state"] in ("rolling_back", "rolled_back")
        assert _wait_state(c, ("rolled_back",))["state"] == "rolled_back"
        np.testing.assert_allclose(c.forward(x), y_ref, **TOL)  # the old version serves, whole


def test_rollback_ends_even_when_a_worker_never_answers(cluster, reference):
    """A worker stopped while it should load: the rollback gives up on it after the
    acknowledgement timeout and ends; once resumed, the old version serves everything."""
    w1 = cluster.workers[1]
    x = tokens(8, seed=3)
    y_ref = reference.forward(x)[0]
    with cluster.client() as c:
        os.kill(w1.pid, signal.SIGSTOP)
        try:
            st = c.update("start", experts=[2, 6], version=5, seed=8)  # 6 is on the stopped worker
            assert st["state"] == "loading"
            assert _wait_state(c, ("shifting",), timeout=1.0)["state"] == "loading"  # waits for w1
            t = time.monotonic()
            c.update("rollback")
            st = _wait_state(c, ("rolled_back", "failed"), timeout=ACK_TIMEOUT + 10)
            assert st["state"] in ("rolled_back", "failed"), st
            assert time.monotonic() - t < ACK_TIMEOUT + 10
        finally:
            os.kill(w1.pid, signal.SIGCONT)

        def served():
            try:
                return np.allclose(c.forward(x), y_ref, **TOL)
            except P.RemoteError:
                return False
        assert wait_until(served, timeout=15.0, interval=0.1)


def test_weights_outside_the_update_dir_get_the_answer_of_a_missing_file(cluster, tmp_path):
    """Was: the answer told which files exist on the worker. Now a path outside --update-dir
    (absolute, ../, or a symlink out) fails exactly like a file that is not there."""
    link = os.path.join(cluster.update_dir, "link.npz")
    if not os.path.lexists(link):
        os.symlink("/etc/hostname", link)
    names = {
        "missing": os.path.join(cluster.update_dir, "missing.npz"),
        "missing-relative": "nope.npz",
        "outside-absolute": "/etc/hostname",
        "outside-dotdot": "../../../../../../etc/hostname",
        "symlink-out": "link.npz",
        "outside-missing": "/nonexistent/x.npz",
    }
    answers = {}
    with cluster.client() as c:
        for i, (kind, name) in enumerate(names.items()):
            st = c.update("start", experts=[0], version=20 + i, weights=name)
            assert st["state"] == "loading"
            st = _wait_state(c, ("failed", "rolled_back", "shifting"))
            assert st["state"] == "failed", (kind, st)
            answers[kind] = st["error"].replace(repr(name), "<name>").replace(f"version {20 + i}", "version <v>")
    assert len(set(answers.values())) == 1, answers
    assert "update directory" in answers["missing"]
    assert not any(s in answers["outside-absolute"] for s in ("No such file", "Errno", "hostname", "etc"))
