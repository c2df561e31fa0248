"""A missing optional part is an install hint, never an ImportError from our own modules:
pyverbs (Debian's python3-pyverbs, not on PyPI) hidden from a fresh interpreter, then
rdma:// asked for through every door a user has (the API, moe-worker, the bench floor);
matplotlib hidden from `moe-bench load --plot`'s plotting."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def hide(*modules: str) -> str:
    """Source that makes ``modules`` (and their submodules) fail to import, as if absent."""
    return textwrap.dedent(f"""
        import importlib.abc, sys
        HIDDEN = {modules!r}
        class Hide(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] in HIDDEN:
                    raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
        sys.meta_path.insert(0, Hide())
        for m in list(sys.modules):
            if m.split(".")[0] in HIDDEN:
                del sys.modules[m]
    """)


def run(code: str, timeout: float = 120) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=ROOT)
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout, env=env)


HINT = "apt-get install python3-pyverbs"

RDMA_WITHOUT_PYVERBS = hide("pyverbs") + textwrap.dedent("""
    import transport
    from transport.errors import TransportError
    for what, fn in (("listen", lambda: transport.listen("rdma://127.0.0.1:0")),
                     ("connect", lambda: transport.connect("rdma://127.0.0.1:1", timeout=1))):
        try:
            fn()
            print(what, "NO ERROR")
        except TransportError as e:
            print(what, "TransportError:", e)
    from bench.floors import RdmaFloorPeer
    try:
        RdmaFloorPeer(4096)._open()
    except TransportError as e:
        print("floor TransportError:", e)
    from workers.cli import main
    print("worker exit", main(["--listen", "rdma://127.0.0.1:0"]))
""")


def test_rdma_without_pyverbs_says_how_to_install_it():
    p = run(RDMA_WITHOUT_PYVERBS)
    out = p.stdout + p.stderr
    assert p.returncode == 0, out[-3000:]
    assert "cannot import name" not in out, out
    for what in ("listen", "connect", "floor"):
        line = next(ln for ln in p.stdout.splitlines() if ln.startswith(what + " "))
        assert "TransportError:" in line and HINT in line, line
    assert "worker exit 1" in p.stdout  # a failure at run time (a missing dependency), not a usage error
    assert f"moe-worker: rdma:// needs pyverbs" in p.stderr and HINT in p.stderr, p.stderr


def test_the_rdma_modules_import_without_pyverbs():
    p = run(hide("pyverbs") + "import transport.rdma, transport.rdma_conn, transport.rdma_verbs as v\n"
                              "print('missing:', v.IMPORT_ERROR is not None)")
    assert p.returncode == 0, p.stderr
    assert "missing: True" in p.stdout


def test_load_plot_without_matplotlib_gives_the_extra_to_install():
    code = hide("matplotlib") + textwrap.dedent("""
        from bench import load_report, output
        msgs = []
        output.note = msgs.append
        ok = output.write_plot(lambda: load_report.plot([], {}, "/nonexistent/x.png", "ramp", 100.0), "x.png")
        print(ok, msgs)
    """)
    p = run(code)
    assert p.returncode == 0, p.stderr
    assert p.stdout.startswith("False"), p.stdout
    assert "pip install 'moe-transport[bench]'" in p.stdout and "matplotlib" in p.stdout, p.stdout
