"""Packaging of the benchmarks: the ``bench`` extra pulls only what `moe-bench` needs (no
Ray: the Ray peer has its own extra and imports Ray lazily, with an install hint), and the
LICENSE file is the Apache License 2.0 that setup.cfg names."""
from __future__ import annotations

import configparser
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _extras() -> dict:
    p = configparser.ConfigParser()
    p.read(os.path.join(ROOT, "setup.cfg"))
    raw = p["options.extras_require"]
    return {k: [x.strip() for x in v.strip().splitlines() if x.strip()] for k, v in raw.items()}


def _names(reqs: list) -> set:
    import re
    return {re.split(r"[<>=!~\[; ]", r, maxsplit=1)[0].lower() for r in reqs}


def test_bench_extra_does_not_drag_ray_in():
    ex = _extras()
    assert _names(ex["bench"]) == {"pyzmq", "hdrhistogram", "rich", "matplotlib", "psutil"}
    assert _names(ex["ray"]) == {"ray"}


BLOCK_RAY = r"""
import importlib.abc, sys
class NoRay(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "ray" or name.startswith("ray."):
            raise ImportError("No module named 'ray' (blocked by the test)")
sys.meta_path.insert(0, NoRay())
import bench.cli
for m in ("cli", "load", "load_report", "schedule", "scenarios", "models", "systems", "moe_bench",
          "transport_bench", "report", "peers", "perftest", "payload", "provenance", "stats"):
    __import__(f"bench.{m}")
for sub in ("transport", "moe", "load"):
    try:
        bench.cli.main([sub, "--help"])
    except SystemExit:
        pass
assert not any(k == "ray" or k.startswith("ray.") for k in sys.modules), "ray was imported"
from gateway.router import Router
from bench.systems import RayActors
try:
    RayActors(Router(16, 4, 2), 32, 0)
except RuntimeError as e:
    print("HINT:", e)
"""


def test_nothing_in_bench_imports_ray_at_import_time_and_the_peer_says_how_to_get_it():
    p = subprocess.run([sys.executable, "-c", BLOCK_RAY], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "HINT: ray is not installed (pip install 'moe-transport[ray]')" in p.stdout


def test_license_is_the_apache_license_2_0():
    p = configparser.ConfigParser()
    p.read(os.path.join(ROOT, "setup.cfg"))
    assert p["metadata"]["license"] == "Apache-2.0"
    text = open(os.path.join(ROOT, "LICENSE")).read()
    assert "Apache License" in text and "Version 2.0, January 2004" in text
    assert "http://www.apache.org/licenses/" in text
    for part in ("TERMS AND CONDITIONS FOR USE, REPRODUCTION, AND DISTRIBUTION", "1. Definitions.",
                 "2. Grant of Copyright License.", "3. Grant of Patent License.", "9. Accepting Warranty or Additional "
                 "Liability.", "END OF TERMS AND CONDITIONS", "APPENDIX: How to apply the Apache License to your work."):
        assert part in text, part
