"""Every example in README.md and in the docs site (docs/*.md) runs as written, top to bottom,
as a new user would: each page's ```sh and ```python blocks are extracted and run in a fresh
directory with a fresh config home (no secret yet), one page at a time (a page's later blocks
talk to the services its earlier ones started). What is substituted, and only that:

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
for real inside network namespaces. The compose deployment is tests/test_deploy.py's. Install
lines are checked, not run (they would change this machine): ``pip install`` names only
extras setup.cfg has, ``apt-get install`` only packages the Makefile installs.

Blocks in any other language (```text: output, wire layouts) are not run. Each page's count
of runnable blocks, services and engines is pinned below, so a new block is run or fails
this test, never skipped. README's links must point at files that exist; the docs' own links
are mkdocs build --strict's (``make test``); a docs page (and section) named in a code comment
must exist."""
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
DOCS = ROOT / "docs"
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


def pages() -> list[Path]:
    return [README, *sorted(DOCS.rglob("*.md"))]


def page_id(page: Path) -> str:
    return str(page.relative_to(ROOT))


def blocks(page: Path = README) -> list[tuple[str, str, str]]:
    """(language, code, the section heading above it) for every ```sh / ```python block;
    other fences (```text) are skipped whole, so nothing inside them counts."""
    out, heading = [], ""
    for m in re.finditer(r"^(#+ [^\n]*)$|^```(\w*)\n(.*?)^```", page.read_text(), re.M | re.S):
        if m.group(1):
            heading = m.group(1).lstrip("# ")
        elif m.group(2) in ("sh", "python"):
            out.append((m.group(2), m.group(3), heading))
    return out


def makefile_apt_packages() -> set[str]:
    text = (ROOT / "Makefile").read_text()
    return {p for m in re.finditer(r"^\w*APT_PKGS := (.*)$", text, re.M) for p in m.group(1).split()}


def setup_extras() -> set[str]:
    import configparser
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    return set(cfg["options.extras_require"])


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
        self._checkpoint: Path | None = None
        self.checked: list = []  # install lines checked, not run

    @property
    def checkpoint(self) -> Path:
        """The tiny checkpoint, made the first time a block names /models/qwen-moe."""
        if self._checkpoint is None:
            self._checkpoint = tiny_qwen_moe(self.tmp / "qwen-moe")
        return self._checkpoint

    # -- substitutions -----------------------------------------------------------------------
    def url(self, m: re.Match) -> str:
        scheme, host, port = m.group(1), m.group(2), m.group(3)
        if scheme == "shm":
            return f"shm://{host}-{self.suffix}"
        if port != "0":
            port = str(self.ports.setdefault((host, port), free_port()))
        return f"tcp://127.0.0.1:{port}"

    def text(self, s: str) -> str:
        if CHECKPOINT in s:
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
            if prog in ("pip", "apt-get"):
                self.install(words)
            elif prog == "make":
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

    def install(self, words: list[str]) -> None:
        """An install line names what this project installs: extras setup.cfg has, Debian
        packages the Makefile installs. Checked, not run (it would change this machine)."""
        assert words[1] == "install", words
        self.checked.append(words)
        if words[0] == "pip":
            targets = [w for w in words[2:] if not w.startswith("-")]
            assert targets, words
            for t in targets:
                m = re.fullmatch(r"\.(?:\[([\w,]+)\])?", t)
                assert m, f"pip install of {t!r}: only this checkout (., .[extra,...]) is documented"
                unknown = set((m.group(1) or "").split(",")) - {""} - setup_extras()
                assert not unknown, f"extras {unknown} are not in setup.cfg"
        else:
            pkgs = [w for w in words[2:] if not w.startswith("-")]
            assert pkgs and set(pkgs) <= makefile_apt_packages(), (pkgs, makefile_apt_packages())

    def make(self, words: list[str]) -> None:
        """A make target is dry-run (the commands it would run must exist); ``make run``'s
        demo then runs for real with this interpreter."""
        p = subprocess.run(["make", "-n", *words[1:]], cwd=ROOT, capture_output=True, text=True, timeout=60,
                           env=dict(MAKE_ENV, SUDO="true"))
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
        if hasattr(mod, "validate"):
            mod.validate(args)

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


#: per page: python blocks, sh blocks, services started (gateways among them), engines' commands
#: checked, install lines checked. A page not listed here, or a block more or less, fails.
EXPECTED = {
    "README.md": (2, 3, 1, 1, [], 2),
    "docs/benchmarks.md": (0, 5, 0, 0, [], 0),
    "docs/getting-started/install.md": (0, 2, 0, 0, [], 7),
    "docs/getting-started/quick-start.md": (2, 2, 2, 4, [], 0),
    "docs/layer/batching.md": (0, 1, 1, 1, [], 0),
    "docs/layer/chunked-rounds.md": (0, 1, 1, 1, [], 0),
    "docs/layer/gateway.md": (0, 1, 1, 1, [], 0),
    "docs/layer/placement.md": (0, 1, 1, 1, [], 0),
    "docs/layer/workers.md": (0, 1, 0, 1, [], 0),
    "docs/multi-host.md": (0, 3, 1, 3, ["kubectl", "kubectl", "moe-gateway", "ray", "ray"], 0),
    "docs/operations/hot-update.md": (0, 1, 1, 1, [], 0),
    "docs/operations/metrics.md": (0, 1, 1, 1, [], 0),
    "docs/operations/security.md": (0, 1, 1, 2, [], 0),
    "docs/real-models.md": (1, 1, 2, 4, [], 0),
    "docs/transport/index.md": (1, 0, 0, 0, [], 0),
}
RUNNABLE = [p for p in pages() if blocks(p)]


def test_every_page_with_examples_is_known():
    """A new block is either run by this test or fails it: no silent skip."""
    assert sorted(page_id(p) for p in RUNNABLE) == sorted(EXPECTED)
    for page in RUNNABLE:
        langs = [lang for lang, _, _ in blocks(page)]
        assert (langs.count("python"), langs.count("sh")) == EXPECTED[page_id(page)][:2], page_id(page)


def test_readme_is_short_and_its_links_resolve():
    text = README.read_text()
    assert len(text.splitlines()) <= 200
    links = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text)
    local = [ln for ln in links if "://" not in ln]
    assert local and all((ROOT / ln).is_file() for ln in local), [ln for ln in local if not (ROOT / ln).is_file()]


def _forward_through_every_gateway(r: Runner, tmp_path: Path) -> None:
    """What a page started is up and serves: every service's health, every gateway a pass
    with rows of the width and dtype it reports."""
    from gateway.client import GatewayClient

    for words, url, metrics in r.services:
        if metrics is not None:
            base = f"http://127.0.0.1:{metrics}"
            with urllib.request.urlopen(base + "/readyz", timeout=5) as resp:
                assert resp.status == 200 and json.loads(resp.read())["status"] == "ok"
        if words[0] == "moe-gateway":
            # the example's secret file, else the per-user default the services created
            secret = tmp_path / words[words.index("--secret-file") + 1] if "--secret-file" in words else \
                tmp_path / "config" / "moe-transport" / "secret"
            with GatewayClient(url, timeout=30.0, secret_file=str(secret)) as c:
                x = np.ones((4, c.d_model), c.dtype)
                y = c.forward(x, layer=0 if CHECKPOINT in words else None)
            assert y.shape == x.shape and np.isfinite(y.astype(np.float32)).all()


@pytest.mark.parametrize("page", RUNNABLE, ids=page_id)
def test_every_example_runs_as_written(page, tmp_path):
    r = Runner(tmp_path)
    try:
        for lang, code, heading in blocks(page):
            if lang == "python":
                r.run_python(code)
            else:
                r.run_sh(code)
        _forward_through_every_gateway(r, tmp_path)
        gateways = [w for w, _, _ in r.services if w[0] == "moe-gateway"]
        expected = EXPECTED[page_id(page)]
        assert (len(gateways), len(r.services)) == expected[2:4]
        assert sorted(w[0] for w in r.engines) == expected[4]
        assert len(r.checked) == expected[5]
    finally:
        r.close()


#: modules the demo must not need: `make run` installs the package without extras
NOT_INSTALLED_BY_MAKE_RUN = ("torch", "ray", "zmq", "rich", "matplotlib", "hdrhistogram", "pyverbs", "ml_dtypes",
                             "safetensors", "transformers", "psutil", "yaml", "mkdocs", "pytest")
BLOCKER = """
import importlib.abc, sys
class _NotInstalled(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in %r:
            raise ImportError(f"No module named {name!r} (not installed by make run)")
sys.meta_path.insert(0, _NotInstalled())
"""


#: a make of its own, not a sub-make of the `make test` running this file (which would print
#: "Entering directory" lines and pass its flags down)
MAKE_ENV = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MAKELEVEL", "MFLAGS", "MAKEOVERRIDES")}


def test_make_run_installs_only_what_the_demo_needs(tmp_path):
    """From a fresh clone (no venv yet) `make run` installs gcc, python3-dev and the package
    without extras; the demo then runs, in every process it starts, with the extras' modules
    made unimportable."""
    venv = tmp_path / "venv"
    p = subprocess.run(["make", "-n", "--no-print-directory", "run", f"VENV={venv}", "SUDO=sudo", "-W",
                        "transport/_shmfast.c"], cwd=ROOT, capture_output=True, text=True, timeout=60,
                       env=MAKE_ENV)
    assert p.returncode == 0, p.stderr
    out = p.stdout
    assert "pip install -q -e .\n" in out and ".[" not in out and "torch" not in out
    for pkg in ("docker-compose", "prometheus", "rdma-core", "pyverbs", "libibverbs-dev"):
        assert pkg not in out, pkg
    assert "build_ext --inplace" in out and out.rstrip().endswith("-m gateway.demo --backend shm")
    full = subprocess.run(["make", "-n", "--no-print-directory", "test", f"VENV={venv}", "SUDO=sudo"], cwd=ROOT,
                          capture_output=True, text=True, timeout=60, env=MAKE_ENV).stdout
    assert "'.[test,bench,torch,ray,docs]'" in full and "mkdocs build --strict" in full

    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(BLOCKER % (NOT_INSTALLED_BY_MAKE_RUN,))
    env = blas_env(1, dict(os.environ, PYTHONPATH=f"{site}{os.pathsep}{ROOT}", XDG_CONFIG_HOME=str(tmp_path / "cfg")))
    env.pop("MOE_SECRET_FILE", None)
    probe = subprocess.run([sys.executable, "-c", "import torch"], env=env, capture_output=True, text=True, timeout=60)
    assert probe.returncode != 0 and "not installed by make run" in probe.stderr  # the blocker is in force
    r = subprocess.run([sys.executable, "-m", "gateway.demo", "--duration", "1"], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=180)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert "verify:" in r.stdout and "OK" in r.stdout and "tokens/s" in r.stdout


def _anchors(page: Path) -> set[str]:
    """The heading anchors mkdocs makes for ``page`` (toc's slugify, code spans as text)."""
    from markdown.extensions.toc import slugify
    text = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.M | re.S)
    return {slugify(m.group(1).replace("`", ""), "-") for m in re.finditer(r"^#+ (.*)$", text, re.M)}


def test_docs_pages_named_in_code_exist_with_their_sections():
    """A comment that names the docs page (and section) giving a measurement names one that is there."""
    refs = set()
    for folder in ("gateway", "transport", "workers", "bench"):
        for path in (ROOT / folder).rglob("*"):
            if path.suffix in (".py", ".c", ".h"):
                refs.update(re.findall(r"\b(docs/[\w/-]+\.md)(?:#([\w-]+))?", path.read_text()))
    assert refs
    for page, anchor in sorted(refs):
        assert (ROOT / page).is_file(), page
        assert not anchor or anchor in _anchors(ROOT / page), (page, anchor)
