"""Every example in README.md runs as written, top to bottom, as a new user would: the
```sh and ```python blocks are extracted and run in a fresh directory with a fresh config
home (no secret yet). What is substituted, and only that:

- addresses: other hosts' (10.0.0.x, 0.0.0.0) become loopback, each host:port a free
  loopback port (fixed ports too, so parallel runs cannot collide), rdma:// becomes tcp://
  (this host has no RDMA device; the rdma suite runs in the rxe guest), shm names get a
  unique suffix, every --metrics-port a free port;
- the real-model examples' checkpoint (/models/qwen-moe) is a tiny random Qwen2-MoE built
  here with transformers (no download): 60 routed experts and a shared expert of four
  pieces, as the example's expert ranges assume;
- programs: moe-worker, moe-gateway, moe-bench and python3 run from this checkout with this
  interpreter.

Services (a line ending in ``&``) are started and waited for (``LISTENING``); later blocks
talk to them (the client, the hot update). Commands that take minutes or need the rxe guest
are checked, not run: ``make`` targets by ``make -n`` (the demo ``make run`` runs is then run
for real), benchmark lines by their own parser and validation. So are the other engines'
recipes, which must not touch the machine's network here: ``ray start`` lines by Ray's own
CLI parser, a ``moe-gateway --placement ray`` line by the gateway's, ``kubectl apply -f DIR``
by the manifests it names existing; tests/test_ray_cluster.py and tests/test_k8s.py run them
for real inside network namespaces. The compose deployment is tests/test_deploy.py's."""
from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import socket
import subprocess
import sys
import urllib.request
from pathlib import Path

import numpy as np
import pytest

from transport.service.launch import blas_env, spawn_service, stop_process

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
PROGRAMS = {"moe-worker": "workers.cli", "moe-gateway": "gateway.cli", "moe-bench": "bench.cli"}
pytestmark = pytest.mark.timeout(300)


CHECKPOINT = "/models/qwen-moe"
HIDDEN = 32  # the tiny checkpoint's hidden size


def tiny_qwen_moe(path: Path) -> Path:
    from tests.torch_extra import require_torch_extra
    require_torch_extra()
    import torch

    from tests import hf_models as hm
    assert hm.H == HIDDEN
    # moe_intermediate 16, shared 64: four pieces, ids 60-63 (Qwen1.5-MoE's shape, scaled down)
    m = hm.model("qwen2_moe", dtype=torch.bfloat16, num_experts=60, shared_expert_intermediate_size=64)
    m.save_pretrained(str(path))
    return path


def blocks() -> list[tuple[str, str, str]]:
    """(language, code, the section heading above it) for every ```sh / ```python block."""
    out, heading = [], ""
    for m in re.finditer(r"^(#+ [^\n]*)$|^```(sh|python)\n(.*?)^```", README.read_text(), re.M | re.S):
        if m.group(1):
            heading = m.group(1).lstrip("# ")
        else:
            out.append((m.group(2), m.group(3), heading))
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Runner:
    def __init__(self, tmp: Path):
        self.tmp = tmp
        self.ports: dict = {}  # (host, port) as written -> a free loopback port
        self.procs: list = []
        self.engines: list = []  # other engines' commands, checked (see engine())
        self.services: list = []  # (argv as written, url, metrics port or None)
        self.env = blas_env(1, {k: v for k, v in os.environ.items() if k != "MOE_SECRET_FILE"})
        self.env.update(XDG_CONFIG_HOME=str(tmp / "config"), PYTHONPATH=str(ROOT))
        self.suffix = f"readme{os.getpid()}"
        self.checkpoint = tiny_qwen_moe(tmp / "qwen-moe")

    # -- substitutions -----------------------------------------------------------------------
    def url(self, m: re.Match) -> str:
        scheme, host, port = m.group(1), m.group(2), m.group(3)
        if scheme == "shm":
            return f"shm://{host}-{self.suffix}"
        if port != "0":
            port = str(self.ports.setdefault((host, port), free_port()))
        return f"tcp://127.0.0.1:{port}"

    def text(self, s: str) -> str:
        s = s.replace(CHECKPOINT, str(self.checkpoint))
        s = re.sub(r"\b(tcp|rdma)://([\w.]+):(\d+)", self.url, s)
        return re.sub(r"\b(shm)://([\w-]+)()", self.url, s)

    def argv(self, words: list[str]) -> tuple[list[str], int | None]:
        out, metrics = [], None
        for i, w in enumerate(words):
            prev = words[i - 1] if i else ""
            if prev == "--metrics-port":
                metrics = free_port()
                w = str(metrics)
            elif prev == "--metrics-addr":
                w = "127.0.0.1"
            elif prev == "--secret-file" and not os.path.isabs(w):
                w = str(self.tmp / w)  # services start from this test's directory, not the example's
            else:
                w = self.text(w)
            out.append(w)
        prog = out[0]
        if prog in PROGRAMS:
            out = [sys.executable, "-m", PROGRAMS[prog], *out[1:]]
        return out, metrics

    # -- running -------------------------------------------------------------------------------
    def run_sh(self, code: str) -> None:
        for raw in code.replace("\\\n", " ").splitlines():  # continued lines joined
            line = raw.strip()
            if not line or line.startswith("#"):
                continue
            background = re.search(r"&\s*(#.*)?$", line) is not None
            words = shlex.split(line, comments=True)
            if words and words[-1] == "&":
                words = words[:-1]
            prog = words[0]
            if prog == "make":
                self.make(words)
            elif prog in ("ray", "kubectl") or "--placement" in words:
                self.engine(words)
            elif prog == "moe-bench":
                self.bench(words[1:])
            elif prog in PROGRAMS:
                argv, metrics = self.argv(words)
                if background:
                    proc, url = spawn_service(argv, timeout=60, env=self.env)
                    self.procs.append(proc)
                    self.services.append((words, url, metrics))
                else:
                    p = subprocess.run(argv, cwd=self.tmp, env=self.env, capture_output=True, text=True, timeout=120)
                    assert p.returncode == 0, (line, p.stdout[-2000:], p.stderr[-2000:])
            else:  # plain shell (creating the secret file)
                p = subprocess.run(["bash", "-c", self.text(line)], cwd=self.tmp, env=self.env, capture_output=True,
                                   text=True, timeout=60)
                assert p.returncode == 0, (line, p.stderr)

    def run_python(self, code: str) -> None:
        p = subprocess.run([sys.executable, "-c", self.text(code)], cwd=self.tmp, env=self.env, capture_output=True,
                           text=True, timeout=120)
        assert p.returncode == 0, (code, p.stdout[-2000:], p.stderr[-3000:])

    def make(self, words: list[str]) -> None:
        """A make target is dry-run (the commands it would run must exist); ``make run``'s
        demo then runs for real with this interpreter."""
        p = subprocess.run(["make", "-n", *words[1:]], cwd=ROOT, capture_output=True, text=True, timeout=60,
                           env=dict(os.environ, SUDO="true"))
        assert p.returncode == 0, (words, p.stderr)
        if words[1:] == ["run"]:
            demo = next(ln for ln in p.stdout.splitlines() if "-m gateway.demo" in ln)
            args = shlex.split(demo)
            args = [sys.executable, *args[args.index("-m"):]]
            r = subprocess.run(args, cwd=ROOT, env=self.env, capture_output=True, text=True, timeout=180)
            assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
            assert "tokens/s" in r.stdout
        elif words[1:] == ["test"]:  # the suite this test is part of: not run again from inside
            assert "pytest" in p.stdout and "tests.rxe.vm test" in p.stdout

    def bench(self, words: list[str]) -> None:
        """Benchmarks take minutes: their flags are parsed and validated as the tool does
        before measuring (tests/test_load_*.py and test_bench_report.py run them)."""
        import importlib

        from bench.cli import SUBCOMMANDS
        p = argparse.ArgumentParser(prog=f"moe-bench {words[0]}")
        mod = importlib.import_module(SUBCOMMANDS[words[0]][0])
        mod.add_arguments(p)
        args = p.parse_args(words[1:])
        if words[0] == "load":
            mod._resolve(args)

    def engine(self, words: list[str]) -> None:
        """Another engine's recipe, checked without starting it (see the module docstring)."""
        self.engines.append(words)
        if words[0] == "ray":
            assert words[1] == "start", words
            from ray.scripts.scripts import start
            start.make_context("ray start", words[2:])  # click: raises on an unknown flag
        elif words[0] == "kubectl":
            assert words[1] == "create" or words[1:3] == ["apply", "-f"], words
            if words[1] == "apply":
                assert list((ROOT / words[3]).glob("*.yaml")), words
        else:
            from gateway.cli import build_parser
            args = build_parser().parse_args(words[1:])
            assert args.placement == "ray" and args.ray_address, words

    def close(self) -> None:
        for proc in self.procs:
            stop_process(proc, timeout=15.0)


def test_readme_blocks_are_the_ones_this_test_knows():
    """A new block is either run by this test or fails it: no silent skip."""
    langs = [lang for lang, _, _ in blocks()]
    assert langs.count("python") == 3 and langs.count("sh") >= 6


def test_every_readme_example_runs_as_written(tmp_path):
    from gateway.client import GatewayClient

    r = Runner(tmp_path)
    try:
        for lang, code, heading in blocks():
            if lang == "python":
                r.run_python(code)
            else:
                r.run_sh(code)
        # what the examples started is up and serves: every service's health, every gateway a pass
        for words, url, metrics in r.services:
            if metrics is not None:
                base = f"http://127.0.0.1:{metrics}"
                with urllib.request.urlopen(base + "/readyz", timeout=5) as resp:
                    assert resp.status == 200 and json.loads(resp.read())["status"] == "ok"
            if words[0] == "moe-gateway":
                # the example's secret file, else the per-user default the services created
                secret = tmp_path / words[words.index("--secret-file") + 1] if "--secret-file" in words else \
                    tmp_path / "config" / "moe-transport" / "secret"
                if CHECKPOINT in words:  # the real model's: bf16 on the wire (its workers' dtype)
                    import ml_dtypes
                    x, layer = np.ones((4, HIDDEN), ml_dtypes.bfloat16), 0
                else:
                    d = 1024 if "tcp://127.0.0.1:5000" in " ".join(words) else 256
                    x, layer = np.ones((4, d), np.float32), None
                with GatewayClient(url, timeout=30.0, secret_file=str(secret)) as c:
                    y = c.forward(x, layer=layer)
                assert y.shape == x.shape and np.isfinite(y.astype(np.float32)).all()
        gateways = [w for w, _, _ in r.services if w[0] == "moe-gateway"]
        assert len(gateways) == 5 and len(r.services) == 11
        assert sorted(w[0] for w in r.engines) == ["kubectl", "kubectl", "moe-gateway", "ray", "ray"]
    finally:
        r.close()
