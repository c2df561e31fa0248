"""The deployment files: docker-compose.yml validates, and the very commands its worker and
gateway services run serve a forward pass when started as plain processes on loopback (the
compose secret's /run/secrets path replaced by a temporary 0600 file); the shared secret is
passed as a compose secret, never on a command line; `make secret` creates it 0600."""
from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from gateway.client import GatewayClient
from tests.helpers_procs import Services

ROOT = Path(__file__).resolve().parent.parent
COMPOSE = ROOT / "docker-compose.yml"
GRAFANA = ROOT / "deploy" / "grafana"
pytestmark = pytest.mark.timeout(120)


def load_yaml(path: Path):
    """PyYAML if the venv has it, else docker-compose's own interpreter (python3-yaml)."""
    try:
        import yaml

        return yaml.safe_load(path.read_text())
    except ImportError:
        pass
    code = "import json, sys, yaml; print(json.dumps(yaml.safe_load(open(sys.argv[1]))))"
    out = subprocess.run(["/usr/bin/python3", "-c", code, str(path)], capture_output=True, text=True,
                         timeout=30)
    if out.returncode:
        pytest.fail(f"cannot parse {path}: no PyYAML in the venv nor in /usr/bin/python3: {out.stderr}")
    return json.loads(out.stdout)


def compose_bin() -> str:
    exe = shutil.which("docker-compose")
    if not exe:
        pytest.fail("docker-compose is not installed (the Makefile installs it: apt-get install docker-compose)")
    return exe


def test_compose_config_validates():
    r = subprocess.run([compose_bin(), "-f", str(COMPOSE), "config", "-q"], capture_output=True, text=True,
                       timeout=60, cwd=ROOT)
    assert r.returncode == 0, r.stderr


SECRET_IN_CONTAINER = "/run/secrets/moe_secret"


def test_the_secret_is_a_compose_secret_never_a_command_line():
    doc = load_yaml(COMPOSE)
    assert doc["secrets"]["moe_secret"]["file"] == "./deploy/secret"
    assert "deploy/secret" in (ROOT / ".gitignore").read_text().split()
    moe = {n: s for n, s in doc["services"].items() if s.get("command", [""])[0] in ("moe-worker", "moe-gateway")}
    assert len(moe) == 3
    for name, svc in moe.items():
        assert "moe_secret" in svc["secrets"], name
        cmd = svc["command"]
        assert _flag(cmd, "--secret-file") == SECRET_IN_CONTAINER, name
        assert "--insecure" not in cmd, name
        assert not any(k.startswith("MOE_SECRET") and k != "MOE_SECRET_FILE" for k in svc.get("environment", {}))


def test_make_secret_creates_a_private_file_once(tmp_path):
    if not shutil.which("make"):
        pytest.fail("make is not installed")
    shutil.copy(ROOT / "Makefile", tmp_path / "Makefile")
    (tmp_path / "deploy").mkdir()
    r = subprocess.run(["make", "-s", "-C", str(tmp_path), "secret"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    path = tmp_path / "deploy" / "secret"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    first = path.read_text().strip()
    assert len(first) == 64 and int(first, 16) >= 0
    r = subprocess.run(["make", "-s", "-C", str(tmp_path), "secret"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and path.read_text().strip() == first  # made if missing, never replaced


def _local(cmd: list[str], subst: dict[str, str]) -> list[str]:
    mods = {"moe-worker": "workers.cli", "moe-gateway": "gateway.cli"}
    out = [sys.executable, "-m", mods[cmd[0]]]
    args = list(cmd[1:])
    for i, a in enumerate(args):
        prev = args[i - 1] if i else ""
        if prev == "--listen":
            a = "tcp://127.0.0.1:0"
        elif prev == "--metrics-port":
            a = "0"
        elif prev == "--metrics-addr":
            a = "127.0.0.1"
        elif prev == "--workers":
            a = ",".join(subst.get(u, u) for u in a.split(","))
        elif prev == "--secret-file":
            a = subst.get(a, a)
        out.append(a)
    return out


def _flag(cmd, name):
    return cmd[cmd.index(name) + 1]


def test_compose_services_run_as_plain_processes(tmp_path):
    from gateway.reference import ReferenceMoE

    # a secret of its own (not the test session's): the services must take it from --secret-file
    secret_file = tmp_path / "secret"
    secret_file.write_text(os.urandom(16).hex() + "\n")
    secret_file.chmod(0o600)
    svc = load_yaml(COMPOSE)["services"]
    workers = sorted(n for n, s in svc.items() if s.get("command", [""])[0] == "moe-worker")
    assert len(workers) == 2
    gw_cmd = svc["gateway"]["command"]
    assert gw_cmd[0] == "moe-gateway"
    with Services() as services:
        subst = {SECRET_IN_CONTAINER: str(secret_file)}
        for name in workers:
            cmd = svc[name]["command"]
            port = _flag(cmd, "--listen").rsplit(":", 1)[1]
            w = services.start(_local(cmd, subst))
            assert w.url.startswith("tcp://127.0.0.1:")
            subst[f"tcp://{name}:{port}"] = w.url
        expected = _flag(gw_cmd, "--workers").split(",")
        assert set(expected) == set(subst) - {SECRET_IN_CONTAINER}, (expected, subst)
        gw = services.start(_local(gw_cmd, subst))
        d = int(_flag(gw_cmd, "--d-model"))
        x = np.random.default_rng(0).standard_normal((16, d)).astype(np.float32)
        with pytest.raises(Exception):  # the session's secret is not this deployment's
            GatewayClient(gw.url, timeout=10.0).forward(x)
        with GatewayClient(gw.url, timeout=30.0, secret_file=str(secret_file)) as cl:
            y = cl.forward(x, timeout=30.0)
        assert y.shape == x.shape and np.isfinite(y).all()
        ref = ReferenceMoE.from_seed(d, int(_flag(gw_cmd, "--d-ff")), int(_flag(gw_cmd, "--n-experts")),
                                     int(_flag(gw_cmd, "--top-k")), seed=int(_flag(gw_cmd, "--seed")))
        np.testing.assert_allclose(y, ref.forward(x)[0], rtol=1e-4, atol=1e-4)


def test_prometheus_scrapes_every_service():
    cfg = load_yaml(ROOT / "deploy" / "prometheus" / "prometheus.yml")
    targets = {t for job in cfg["scrape_configs"] for sc in job["static_configs"] for t in sc["targets"]}
    assert targets == {"worker0:9100", "worker1:9100", "gateway:9100"}


def test_grafana_provisioning_and_dashboard_parse():
    ds = load_yaml(GRAFANA / "provisioning" / "datasources" / "prometheus.yml")
    assert ds["datasources"][0]["type"] == "prometheus"
    prov = load_yaml(GRAFANA / "provisioning" / "dashboards" / "moe.yml")
    assert prov["providers"][0]["options"]["path"]
    dash = json.loads((GRAFANA / "dashboards" / "moe-experts.json").read_text())
    exprs = " ".join(t["expr"] for p in dash["panels"] for t in p["targets"])
    for metric in ("moe_expert_tokens_total", "moe_expert_batches_total", "moe_expert_compute_seconds",
                   "moe_expert_version", "moe_worker_in_flight"):
        assert metric in exprs, metric
