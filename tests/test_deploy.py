"""The deployment files: docker-compose.yml validates, and the very commands its worker and
gateway services run serve a forward pass when started as plain processes on loopback (the
compose secret's /run/secrets path replaced by a temporary 0600 file), where their compose
healthchecks pass; the shared secret is passed as a compose secret, never on a command line;
`make secret` creates it 0600; the Dockerfile is pinned, non-root, installs its dependencies
before copying the source, and its HEALTHCHECK works against a live service; Prometheus'
config passes promtool and scrapes the metrics port everything uses; the Grafana dashboard
picks its data source by variable and every expression passes promtool."""
from __future__ import annotations

import json
import os
import re
import shutil
import socket
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
DASHBOARD = GRAFANA / "dashboards" / "moe-transport.json"
DOCKERFILE = ROOT / "Dockerfile"
METRICS_PORT = 9632  # transport/service/metrics.py DEFAULT_PORT
PROMTOOL = "/usr/bin/promtool"
pytestmark = pytest.mark.timeout(120)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def promtool() -> str:
    if not shutil.which(PROMTOOL):
        pytest.fail(f"{PROMTOOL} is missing: install Debian's 'prometheus' package (make deps does, via apt)")
    return PROMTOOL


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


def _local(cmd: list[str], subst: dict[str, str], metrics_port: int = 0) -> list[str]:
    mods = {"moe-worker": "workers.cli", "moe-gateway": "gateway.cli"}
    out = [sys.executable, "-m", mods[cmd[0]]]
    args = list(cmd[1:])
    for i, a in enumerate(args):
        prev = args[i - 1] if i else ""
        if prev == "--listen":
            a = "tcp://127.0.0.1:0"
        elif prev == "--metrics-port":
            a = str(metrics_port)
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


def healthcheck(test: list[str], port: int) -> subprocess.CompletedProcess:
    """Run a compose/Dockerfile healthcheck (exec form, ["CMD", ...]) here, against ``port``
    instead of the metrics port, with this interpreter as the image's ``python``."""
    assert test[0] == "CMD" and test[1] == "python", test
    argv = [sys.executable] + [a.replace(str(METRICS_PORT), str(port)) for a in test[2:]]
    assert argv != [sys.executable] + test[2:], f"the check does not name port {METRICS_PORT}: {test}"
    return subprocess.run(argv, capture_output=True, text=True, timeout=30)


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
            assert _flag(cmd, "--metrics-port") == str(METRICS_PORT)
            port = _flag(cmd, "--listen").rsplit(":", 1)[1]
            mport = free_port()
            w = services.start(_local(cmd, subst, mport))
            assert w.url.startswith("tcp://127.0.0.1:")
            subst[f"tcp://{name}:{port}"] = w.url
            r = healthcheck(svc[name]["healthcheck"]["test"], mport)  # the compose check, on the live worker
            assert r.returncode == 0, (name, r.stderr)
        expected = _flag(gw_cmd, "--workers").split(",")
        assert set(expected) == set(subst) - {SECRET_IN_CONTAINER}, (expected, subst)
        gport = free_port()
        gw = services.start(_local(gw_cmd, subst, gport))
        r = healthcheck(svc["gateway"]["healthcheck"]["test"], gport)
        assert r.returncode == 0, r.stderr
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


def test_compose_health_gates_the_start_order():
    """Every moe service has a healthcheck on /readyz; the gateway starts once both workers
    are healthy, Prometheus once the gateway is, Grafana once Prometheus is."""
    svc = load_yaml(COMPOSE)["services"]
    for name in ("worker0", "worker1", "gateway"):
        test = svc[name]["healthcheck"]["test"]
        assert f"127.0.0.1:{METRICS_PORT}/readyz" in " ".join(test), (name, test)
        assert str(METRICS_PORT) in svc[name]["expose"]
    assert svc["gateway"]["depends_on"] == {"worker0": {"condition": "service_healthy"},
                                            "worker1": {"condition": "service_healthy"}}
    assert svc["prometheus"]["depends_on"] == {"gateway": {"condition": "service_healthy"}}
    assert "healthcheck" in svc["prometheus"]
    assert svc["grafana"]["depends_on"] == {"prometheus": {"condition": "service_healthy"}}
    # what docker-compose itself makes of it (it would drop or refuse a form it does not take)
    r = subprocess.run([compose_bin(), "-f", str(COMPOSE), "config"], capture_output=True, text=True, timeout=60,
                       cwd=ROOT)
    assert r.returncode == 0, r.stderr
    assert r.stdout.count("condition: service_healthy") == 4


def test_prometheus_scrapes_every_service_and_promtool_accepts_it():
    path = ROOT / "deploy" / "prometheus" / "prometheus.yml"
    cfg = load_yaml(path)
    targets = {t for job in cfg["scrape_configs"] for sc in job["static_configs"] for t in sc["targets"]}
    assert targets == {f"worker0:{METRICS_PORT}", f"worker1:{METRICS_PORT}", f"gateway:{METRICS_PORT}"}
    r = subprocess.run([promtool(), "check", "config", str(path)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr


def test_nothing_uses_node_exporters_port():
    from transport.service.metrics import DEFAULT_PORT
    assert DEFAULT_PORT == METRICS_PORT
    for path in [COMPOSE, DOCKERFILE, ROOT / "README.md", ROOT / "deploy" / "prometheus" / "prometheus.yml"]:
        used = re.search(r'--metrics-port[ "=,]*9100|:9100\b|"9100"|EXPOSE .*\b9100\b', path.read_text())
        assert not used, f"{path} still uses port 9100 (node_exporter's): {used.group(0)}"


def dashboard_exprs() -> list[tuple[str, str]]:
    dash = json.loads(DASHBOARD.read_text())
    return [(p["title"], t["expr"]) for p in dash["panels"] for t in p.get("targets", [])]


def test_grafana_provisioning_and_dashboard_datasource_variable():
    ds = load_yaml(GRAFANA / "provisioning" / "datasources" / "prometheus.yml")
    assert ds["datasources"][0]["type"] == "prometheus"
    prov = load_yaml(GRAFANA / "provisioning" / "dashboards" / "moe.yml")
    assert prov["providers"][0]["options"]["path"]
    dash = json.loads(DASHBOARD.read_text())
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    for p in dash["panels"]:  # no panel or query pins a data source uid: all go through the variable
        for obj in [p] + p.get("targets", []):
            if p["type"] == "row":
                continue
            assert obj["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, (p["title"], obj)
    exprs = " ".join(e for _, e in dashboard_exprs())
    for metric in ("moe_gateway_request_seconds_bucket", "moe_gateway_stage_seconds_sum", "moe_gateway_worker_healthy",
                   "moe_gateway_errors_total", "moe_gateway_failed_requests_total", "moe_transport_bytes_sent_total",
                   "moe_expert_tokens_total", "moe_expert_compute_seconds_bucket", "moe_worker_in_flight",
                   "moe_build_info"):
        assert metric in exprs, metric


def test_every_dashboard_expression_passes_promtool(tmp_path):
    """Each query, as a recording rule: promtool parses the PromQL (Grafana's $__rate_interval
    set to what it resolves to at a 5 s scrape interval)."""
    rules = {"groups": [{"name": "dashboard", "rules": [
        {"record": f"dashboard:query_{i}", "expr": e.replace("$__rate_interval", "20s")}
        for i, (_, e) in enumerate(dashboard_exprs())]}]}
    path = tmp_path / "rules.yml"
    path.write_text(json.dumps(rules))  # JSON is YAML
    r = subprocess.run([promtool(), "check", "rules", str(path)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"SUCCESS: {len(dashboard_exprs())} rules found" in r.stdout, r.stdout


# -- the Dockerfile (no Docker daemon here: what can be checked without building) ---------------
def dockerfile() -> list[tuple[str, str]]:
    """(instruction, arguments) in order, continuation lines joined, comments dropped."""
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            op, _, rest = line.partition(" ")
            out.append((op.upper(), rest.strip()))
    return out


def test_dockerfile_is_pinned_non_root_and_layers_dependencies_first():
    ins = dockerfile()
    base = [a for op, a in ins if op == "FROM"]
    assert len(base) == 1
    assert re.fullmatch(r"python:\d+\.\d+\.\d+-slim-[a-z]+(@sha256:[0-9a-f]{64})?", base[0]) or \
        re.fullmatch(r"[\w./-]+@sha256:[0-9a-f]{64}", base[0]), f"base image not pinned: {base[0]}"
    ops = [op for op, _ in ins]
    users = [a for op, a in ins if op == "USER"]
    assert users and users[-1].split(":")[0] not in ("root", "0"), users
    assert ops.index("USER") > max(i for i, (op, a) in enumerate(ins) if op == "RUN"), "USER before a RUN"
    copies = [(i, a) for i, (op, a) in enumerate(ins) if op == "COPY"]
    meta = next(i for i, a in copies if "setup.cfg" in a)
    src = min(i for i, a in copies if re.search(r"\b(transport|workers|gateway|bench)\b", a))
    deps = [i for i, (op, a) in enumerate(ins) if op == "RUN" and "pip install -r" in a]
    assert deps and meta < deps[0] < src, "dependencies are not installed before the source is copied"
    final = [a for i, (op, a) in enumerate(ins) if op == "RUN" and i > src and "pip install" in a]
    assert final and "--no-deps" in final[0]
    # the image has shm://'s and tcp://'s compiled fast paths: setup.py is copied, and the
    # build fails without them
    assert any("setup.py" in a for _, a in copies)
    assert "import transport._shmfast, transport._tcpfast" in final[0]
    assert str(METRICS_PORT) in next(a for op, a in ins if op == "EXPOSE").split()


def test_dockerfile_dependency_layer_reads_setup_cfg(tmp_path):
    """The dependency step's python snippet, run on this setup.cfg, lists install_requires."""
    import configparser

    run = next(a for op, a in dockerfile() if op == "RUN" and "pip install -r" in a)
    snippet = re.search(r'python -c "([^"]+)"', run).group(1)
    r = subprocess.run([sys.executable, "-c", snippet], capture_output=True, text=True, cwd=ROOT, timeout=30)
    assert r.returncode == 0, r.stderr
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    want = [x.strip() for x in cfg["options"]["install_requires"].splitlines() if x.strip()]
    assert [x.strip() for x in r.stdout.splitlines() if x.strip()] == want


def test_dockerfile_healthcheck_against_a_live_worker():
    hc = next(a for op, a in dockerfile() if op == "HEALTHCHECK")
    test = json.loads(hc[hc.index("CMD") + 3:].strip())
    assert "/healthz" in " ".join(test)
    port = free_port()
    with Services() as services:
        w = services.start([sys.executable, "-m", "workers.cli", "--listen", "tcp://127.0.0.1:0", "--experts", "0",
                            "--d-model", "16", "--d-ff", "32", "--metrics-port", str(port)])
        r = healthcheck(["CMD"] + test, port)
        assert r.returncode == 0, r.stderr
        w.kill()
    r = healthcheck(["CMD"] + test, port)  # nobody answers: unhealthy
    assert r.returncode != 0
