"""The Kubernetes manifests (deploy/k8s): every one validates against the Kubernetes schemas
offline (``kubernetes-validate --strict``, the RDMA patches applied too); the settings that
matter are there and agree with each other (names, ports, probes, secret path, replicas);
and each container's command line runs as a process -- through ``/bin/sh -c`` as the
container runs it, after Kubernetes' own ``$(VAR)`` expansion, with the ConfigMap as its
environment -- and serves the layer.

How the stable names resolve in that run: each pod gets a network namespace of its own
(bench/netns_cluster.py NetnsLan: its own veth address on one bridge, so every pod binds the
same ports 5000 and 9632 as in the cluster); the gateway's and the client's namespaces get
an /etc/hosts (``ip netns exec`` bind-mounts /etc/netns/<ns>/hosts over /etc/hosts) mapping
``moe-worker-<i>.moe-workers`` and ``moe-gateway`` to those pods' addresses. Nothing in the
command lines is rewritten but the secret file's path (the mount is not there outside a
pod) and ``moe-worker``/``moe-gateway`` (shims running this checkout).
"""
from __future__ import annotations

import copy
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml

from gateway.supervisor import placement
from tests import helpers_procs as HP

ROOT = Path(__file__).resolve().parent.parent
K8S = ROOT / "deploy" / "k8s"
RDMA = K8S / "rdma"
CORE_KINDS = {"ConfigMap", "Secret", "Service", "StatefulSet", "Deployment"}
METRICS_PORT = 9632
pytestmark = pytest.mark.timeout(300)


def manifests() -> list[Path]:
    return sorted(K8S.rglob("*.yaml"))


def docs() -> dict:
    """(kind, name) -> the document, over every manifest."""
    out = {}
    for path in manifests():
        for d in yaml.safe_load_all(path.read_text()):
            if d:
                out[(d["kind"], d["metadata"]["name"])] = d
    return out


def validate(paths) -> subprocess.CompletedProcess:
    exe = Path(sys.executable).with_name("kubernetes-validate")
    if not exe.exists():
        pytest.fail("kubernetes-validate is not installed (it is in the [test] extra)")
    return subprocess.run([str(exe), "--strict", *map(str, paths)], capture_output=True, text=True, timeout=120)


# -- offline validation ------------------------------------------------------------------------
def test_every_manifest_validates_against_the_kubernetes_schemas():
    paths = manifests()
    assert {p.name for p in paths} >= {"configmap.yaml", "workers.yaml", "gateway.yaml", "moe-secret.yaml"}
    r = validate(paths)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.count("passed for resource") == len(docs()) == 6
    assert {k for k, _ in docs()} <= CORE_KINDS  # nothing the schemas do not know (no CRD)


def json_patch(doc: dict, ops: list) -> dict:
    """RFC 6902 add/replace, as ``kubectl patch --type json`` applies them."""
    doc = copy.deepcopy(doc)
    for op in ops:
        keys = [k.replace("~1", "/").replace("~0", "~") for k in op["path"].lstrip("/").split("/")]
        parent = doc
        for k in keys[:-1]:
            parent = parent[int(k)] if isinstance(parent, list) else parent[k]
        last = keys[-1]
        assert op["op"] in ("add", "replace"), op
        if op["op"] == "replace":
            assert last in parent, f"replace of a missing {op['path']}"
        parent[int(last) if isinstance(parent, list) else last] = op["value"]
    return doc


def rdma_docs() -> dict:
    d = docs()
    patched = {
        ("ConfigMap", "moe-layer"): json.loads((RDMA / "configmap-patch.json").read_text()),
        ("StatefulSet", "moe-worker"): json.loads((RDMA / "worker-patch.json").read_text()),
        ("Deployment", "moe-gateway"): json.loads((RDMA / "gateway-patch.json").read_text()),
    }
    return {key: json_patch(d[key], ops) for key, ops in patched.items()}


def test_the_rdma_patches_apply_and_validate(tmp_path):
    got = rdma_docs()
    paths = []
    for (kind, name), doc in got.items():
        paths.append(tmp_path / f"{kind}-{name}.yaml")
        paths[-1].write_text(yaml.safe_dump(doc))
    r = validate(paths)
    assert r.returncode == 0, r.stdout + r.stderr
    assert got[("ConfigMap", "moe-layer")]["data"]["MOE_TRANSPORT"] == "rdma"
    for key in (("StatefulSet", "moe-worker"), ("Deployment", "moe-gateway")):
        (c,) = got[key]["spec"]["template"]["spec"]["containers"]
        assert c["securityContext"]["capabilities"] == {"drop": ["ALL"], "add": ["IPC_LOCK"]}
        assert c["resources"]["limits"]["rdma/hca"] == c["resources"]["requests"]["rdma/hca"] == "1"


# -- what the manifests say, and that it agrees ----------------------------------------------------
def pod_spec(kind: str, name: str) -> dict:
    return docs()[(kind, name)]["spec"]["template"]["spec"]


def container(kind: str, name: str) -> dict:
    (c,) = pod_spec(kind, name)["containers"]
    return c


def test_names_ports_probes_and_the_secret_agree():
    d = docs()
    layer = d[("ConfigMap", "moe-layer")]["data"]
    sts, headless = d[("StatefulSet", "moe-worker")], d[("Service", "moe-workers")]
    assert headless["spec"]["clusterIP"] == "None" and sts["spec"]["serviceName"] == "moe-workers"
    assert sts["spec"]["replicas"] == int(layer["MOE_WORKERS"])
    assert int(layer["MOE_MAX_TOKENS"]) >= int(layer["MOE_MAX_BATCH_TOKENS"]) * int(layer["MOE_TOP_K"])
    gw_svc = d[("Service", "moe-gateway")]
    for svc, owner in ((headless, sts), (gw_svc, d[("Deployment", "moe-gateway")])):
        labels = owner["spec"]["template"]["metadata"]["labels"]
        assert svc["spec"]["selector"].items() <= labels.items() and owner["spec"]["selector"]["matchLabels"] == labels
    for kind, name in (("StatefulSet", "moe-worker"), ("Deployment", "moe-gateway")):
        spec, c = pod_spec(kind, name), container(kind, name)
        script = c["args"][0]
        ann = d[(kind, name)]["spec"]["template"]["metadata"]["annotations"]
        assert ann == {"prometheus.io/scrape": "true", "prometheus.io/port": str(METRICS_PORT),
                       "prometheus.io/path": "/metrics"}
        assert f"--metrics-port {METRICS_PORT} --metrics-addr 0.0.0.0" in script
        ports = {p["name"]: p["containerPort"] for p in c["ports"]}
        assert ports["metrics"] == METRICS_PORT
        assert c["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "metrics"}
        assert c["livenessProbe"]["httpGet"] == c["startupProbe"]["httpGet"] == {"path": "/healthz", "port": "metrics"}
        # the secret: a Secret volume, mounted read-only, the very path given to --secret-file
        (mount,) = [m for m in c["volumeMounts"] if m["name"] == "secret"]
        (vol,) = [v for v in spec["volumes"] if v["name"] == "secret"]
        assert vol["secret"]["secretName"] == "moe-secret" and mount["readOnly"]
        assert f"--secret-file {mount['mountPath']}/secret" in script
        assert "secret" in d[("Secret", "moe-secret")]["stringData"]
        # non-root, read-only root, no escalation, no capabilities; resources requested
        assert spec["securityContext"]["runAsNonRoot"] and spec["securityContext"]["runAsUser"] != 0
        assert spec["automountServiceAccountToken"] is False
        sc = c["securityContext"]
        assert sc["readOnlyRootFilesystem"] and sc["allowPrivilegeEscalation"] is False
        assert sc["capabilities"] == {"drop": ["ALL"]}
        assert {"cpu", "memory"} <= set(c["resources"]["requests"])
        assert c["envFrom"] == [{"configMapRef": {"name": "moe-layer"}}]


# -- the command lines, dry (a stand-in prints its argv) ---------------------------------------------
def k8s_expand(text: str, env: dict) -> str:
    """Kubernetes' expansion of command and args: $(NAME) of a defined variable becomes its
    value, $$ becomes $, anything else stays as written."""
    out, i = [], 0
    while i < len(text):
        if text.startswith("$$", i):
            out.append("$")
            i += 2
        elif text.startswith("$(", i) and text.find(")", i) != -1:
            j = text.find(")", i)
            name = text[i + 2:j]
            out.append(env[name] if name in env else text[i:j + 1])
            i = j + 1
        else:
            out.append(text[i])
            i += 1
    return "".join(out)


def container_env(kind: str, name: str, pod: str, layer: dict) -> dict:
    """What the container's process gets: the ConfigMap (envFrom), its env (POD_NAME from
    metadata.name) and HOSTNAME, as the kubelet sets them."""
    env = dict(layer)
    for e in container(kind, name).get("env", []):
        ref = e.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath")
        env[e["name"]] = pod if ref == "metadata.name" else e["value"]
    env["HOSTNAME"] = pod
    return env


def command_line(kind: str, name: str, env: dict, secret_file: str) -> list[str]:
    c = container(kind, name)
    argv = [k8s_expand(a, env) for a in c["command"] + c["args"]]
    (mount,) = [m for m in c["volumeMounts"] if m["name"] == "secret"]
    return [a.replace(f"{mount['mountPath']}/secret", secret_file) for a in argv]


@pytest.fixture
def shims(tmp_path):
    """moe-worker / moe-gateway on PATH: this checkout's, or a stand-in printing its argv."""

    def make(real: bool) -> dict:
        d = tmp_path / ("bin-real" if real else "bin-dry")
        d.mkdir(exist_ok=True)
        for exe, mod in (("moe-worker", "workers.cli"), ("moe-gateway", "gateway.cli")):
            body = (f'exec {sys.executable} -m {mod} "$@"\n' if real
                    else f'{sys.executable} -c "import json, sys; print(json.dumps(sys.argv[1:]))" "$@"\n')
            (d / exe).write_text("#!/bin/sh\n" + body)
            (d / exe).chmod(0o755)
        return {"PATH": f"{d}:{os.environ['PATH']}", "PYTHONPATH": str(ROOT)}

    return make


def dry(kind, name, pod, layer, path_env, secret_file) -> subprocess.CompletedProcess:
    env = container_env(kind, name, pod, layer)
    return subprocess.run(command_line(kind, name, env, secret_file), env={**env, **path_env},
                          capture_output=True, text=True, timeout=60, cwd=ROOT)


def flag(argv: list, name: str) -> str:
    return argv[argv.index(name) + 1]


@pytest.mark.parametrize("n_experts,n_workers", [(8, 2), (8, 3), (6, 4), (64, 5), (3, 3)])
def test_each_ordinal_takes_the_block_placement_gives_it(shims, n_experts, n_workers):
    layer = dict(docs()[("ConfigMap", "moe-layer")]["data"], MOE_N_EXPERTS=str(n_experts),
                 MOE_WORKERS=str(n_workers))
    secret = os.environ["MOE_SECRET_FILE"]
    blocks = placement(n_experts, n_workers)
    for i in range(n_workers):
        r = dry("StatefulSet", "moe-worker", f"moe-worker-{i}", layer, shims(False), secret)
        assert r.returncode == 0, r.stderr
        argv = json.loads(r.stdout)
        lo, hi = map(int, flag(argv, "--experts").split("-"))
        assert list(range(lo, hi + 1)) == blocks[i], (i, argv)
        assert flag(argv, "--listen") == "tcp://0.0.0.0:5000" and flag(argv, "--secret-file") == secret
    r = dry("Deployment", "moe-gateway", "moe-gateway-5d9c7-abcde", layer, shims(False), secret)
    argv = json.loads(r.stdout)
    assert flag(argv, "--workers").split(",") == [f"tcp://moe-worker-{i}.moe-workers:5000" for i in range(n_workers)]
    assert flag(argv, "--n-experts") == str(n_experts)


def test_more_workers_than_experts_and_the_placeholder_secret_are_refused(shims, tmp_path):
    layer = dict(docs()[("ConfigMap", "moe-layer")]["data"], MOE_N_EXPERTS="2", MOE_WORKERS="3")
    assert placement(2, 3)[2] == []
    r = dry("StatefulSet", "moe-worker", "moe-worker-2", layer, shims(False), os.environ["MOE_SECRET_FILE"])
    assert r.returncode == 1 and "no experts" in r.stderr and not r.stdout
    placeholder = tmp_path / "secret"
    placeholder.write_text(docs()[("Secret", "moe-secret")]["stringData"]["secret"] + "\n")
    layer = docs()[("ConfigMap", "moe-layer")]["data"]
    for kind, name, pod in (("StatefulSet", "moe-worker", "moe-worker-0"), ("Deployment", "moe-gateway", "gw")):
        r = dry(kind, name, pod, layer, shims(False), str(placeholder))
        assert r.returncode == 1 and "placeholder" in r.stderr and not r.stdout, (name, r.stderr)


def test_the_rdma_patch_makes_both_ends_speak_rdma(shims):
    got = rdma_docs()
    layer = got[("ConfigMap", "moe-layer")]["data"]
    secret = os.environ["MOE_SECRET_FILE"]
    r = dry("StatefulSet", "moe-worker", "moe-worker-0", layer, shims(False), secret)
    assert flag(json.loads(r.stdout), "--listen") == "rdma://0.0.0.0:5000"
    r = dry("Deployment", "moe-gateway", "gw", layer, shims(False), secret)
    assert all(u.startswith("rdma://moe-worker-") for u in flag(json.loads(r.stdout), "--workers").split(","))


# -- the command lines, for real: one network namespace per pod ------------------------------------
def http_get(lan, host: int, url: str) -> int:
    code = f"import urllib.request; print(urllib.request.urlopen({url!r}, timeout=10).status)"
    r = subprocess.run(lan.exec(host) + [sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    return int(r.stdout) if r.returncode == 0 else -1


def test_the_containers_commands_serve_the_layer_by_their_stable_names(shims):
    from bench.netns_cluster import NetnsError, NetnsLan

    d = docs()
    layer = d[("ConfigMap", "moe-layer")]["data"]
    n = d[("StatefulSet", "moe-worker")]["spec"]["replicas"]
    lan = NetnsLan(n + 2, tag=f"moek{os.getpid() % 100000}")
    try:
        lan.open()
    except NetnsError as e:
        pytest.skip(str(e))
    gw_host, client_host = n, n + 1
    etc = [Path("/etc/netns") / lan.names[h] for h in (gw_host, client_host)]
    path_env = shims(True)
    secret = os.environ["MOE_SECRET_FILE"]
    shm_before = HP.shm_entries()
    made_etc_netns = not Path("/etc/netns").exists()
    try:
        # the cluster DNS, for this run: the stable names -> those pods' namespaces' addresses
        names = [f"{lan.ips[i]} moe-worker-{i}.moe-workers moe-worker-{i}.moe-workers.default.svc.cluster.local"
                 for i in range(n)]
        names.append(f"{lan.ips[gw_host]} moe-gateway moe-gateway.default.svc.cluster.local")
        for e in etc:
            e.mkdir(parents=True, exist_ok=True)
            (e / "hosts").write_text("127.0.0.1 localhost\n" + "\n".join(names) + "\n")
        with HP.Services() as services:
            pods = []
            for i in range(n):
                env = container_env("StatefulSet", "moe-worker", f"moe-worker-{i}", layer)
                argv = lan.exec(i) + command_line("StatefulSet", "moe-worker", env, secret)
                pods.append((i, services_start(services, argv, {**env, **path_env})))
                assert pods[-1][1].url == "tcp://0.0.0.0:5000"
            env = container_env("Deployment", "moe-gateway", "moe-gateway-0", layer)
            argv = lan.exec(gw_host) + command_line("Deployment", "moe-gateway", env, secret)
            gw = services_start(services, argv, {**env, **path_env})
            assert gw.url == "tcp://0.0.0.0:7000"
            # the probes answer where the manifests point them, in every pod
            for kind, name, hosts in (("StatefulSet", "moe-worker", range(n)), ("Deployment", "moe-gateway", [gw_host])):
                c = container(kind, name)
                for h in hosts:
                    for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
                        url = f"http://{lan.ips[h]}:{METRICS_PORT}{c[probe]['httpGet']['path']}"
                        assert http_get(lan, h, url) == 200, url
            # a client reaches the gateway by its Service name; every answer is the reference's
            c = subprocess.run(lan.exec(client_host) + [
                sys.executable, "-m", "tests.layer_client", "tcp://moe-gateway:7000",
                "--d-model", layer["MOE_D_MODEL"], "--d-ff", layer["MOE_D_FF"], "--n-experts", layer["MOE_N_EXPERTS"],
                "--top-k", layer["MOE_TOP_K"], "--seed", layer["MOE_SEED"], "--max-requests", "12",
                "--concurrency", "2", "--max-tokens", "64"], capture_output=True, text=True, timeout=180,
                cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
            assert c.returncode == 0, c.stderr[-3000:]
            records = json.loads(c.stdout.strip().splitlines()[-1])["records"]
            assert len(records) >= 12 and {r["outcome"] for r in records} == {"ok"}
            got = {tuple(r["experts"]) for r in records}
            assert set().union(*got) == set(range(int(layer["MOE_N_EXPERTS"])))  # every worker served
    finally:
        for e in etc:
            shutil.rmtree(e, ignore_errors=True)
        if made_etc_netns:
            try:
                Path("/etc/netns").rmdir()
            except OSError:
                pass
        leaked = lan.close()
    assert not leaked, leaked
    assert HP.shm_entries() - shm_before == set()


def services_start(services: HP.Services, argv: list, env: dict) -> HP.Service:
    """Start one pod's command (its 'LISTENING <url>' line says it is up)."""
    from transport.service.launch import spawn_service

    proc, url = spawn_service(argv, timeout=60.0, env=env)
    s = HP.Service(proc, url, argv)
    services.services.append(s)
    return s
