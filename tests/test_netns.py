"""Gateway and worker in separate network namespaces joined by a veth pair, over tcp, as if
on separate machines. Needs root and `ip netns`; otherwise skipped."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from gateway.reference import ReferenceMoE
from transport.service.launch import blas_env, spawn_service, stop_process
from workers.flags import worker_argv

D, F, E, K, SEED = 16, 32, 4, 2, 3
pytestmark = pytest.mark.timeout(120)


def _ip(*args, check=True):
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30, check=check)


@pytest.fixture
def netns():
    if os.geteuid() != 0:
        pytest.skip("needs root to create network namespaces")
    tag = f"moe-t-{os.getpid()}"
    gw, wk = f"{tag}-g", f"{tag}-w"
    x = os.getpid() % 250
    made = []
    try:
        try:
            _ip("netns", "add", gw); made.append(gw)
            _ip("netns", "add", wk); made.append(wk)
        except (subprocess.CalledProcessError, FileNotFoundError) as e:
            pytest.skip(f"`ip netns add` is not permitted here: {getattr(e, 'stderr', e)}")
        va, vb = f"mg{os.getpid() % 100000}", f"mw{os.getpid() % 100000}"
        _ip("link", "add", va, "netns", gw, "type", "veth", "peer", "name", vb, "netns", wk)
        for ns, dev, addr in ((gw, va, f"10.250.{x}.1/24"), (wk, vb, f"10.250.{x}.2/24")):
            _ip("-n", ns, "addr", "add", addr, "dev", dev)
            _ip("-n", ns, "link", "set", dev, "up")
            _ip("-n", ns, "link", "set", "lo", "up")
        yield gw, wk, f"10.250.{x}.1", f"10.250.{x}.2"
    finally:
        for ns in made:
            _ip("netns", "del", ns, check=False)


def test_gateway_and_worker_in_separate_namespaces(netns):
    gw_ns, wk_ns, gw_ip, wk_ip = netns
    env = blas_env(1)
    env["PYTHONPATH"] = os.pathsep.join([os.getcwd(), env.get("PYTHONPATH", "")])
    worker, wurl = spawn_service(["ip", "netns", "exec", wk_ns, *worker_argv(
        f"tcp://{wk_ip}:0", list(range(E)), d_model=D, d_ff=F, seed=SEED, max_tokens=256)], env=env)
    gateway = None
    try:
        assert wurl.startswith(f"tcp://{wk_ip}:")
        gateway, gurl = spawn_service(["ip", "netns", "exec", gw_ns, sys.executable, "-m", "gateway.cli",
                                       "--listen", f"tcp://{gw_ip}:0", "--workers", wurl,
                                       "--n-experts", str(E), "--top-k", str(K), "--d-model", str(D),
                                       "--d-ff", str(F), "--seed", str(SEED), "--max-wait-ms", "0", "--max-batch-tokens", "64"], env=env)
        x = np.random.default_rng(1).standard_normal((12, D)).astype(np.float32)
        script = textwrap.dedent(f"""
            import sys, numpy as np
            from gateway.client import GatewayClient
            x = np.frombuffer(sys.stdin.buffer.read(), np.float32).reshape(-1, {D})
            with GatewayClient({gurl!r}, timeout=20.0) as c:
                y = c.forward(x, timeout=20.0)
            sys.stdout.buffer.write(np.ascontiguousarray(y, np.float32).tobytes())
        """)
        r = subprocess.run(["ip", "netns", "exec", gw_ns, sys.executable, "-c", script], input=x.tobytes(),
                           capture_output=True, timeout=60, env=env)
        assert r.returncode == 0, r.stderr.decode()
        y = np.frombuffer(r.stdout, np.float32).reshape(x.shape)
        ref = ReferenceMoE.from_seed(D, F, E, K, seed=SEED)
        np.testing.assert_allclose(y, ref.forward(x)[0], rtol=1e-4, atol=1e-5)
    finally:
        if gateway is not None:
            stop_process(gateway, timeout=10.0)
        stop_process(worker, timeout=10.0)
