"""Where a benchmark figure came from: the ``provenance`` block of every `moe-bench` JSON.

A figure without its command, commit, machine and date cannot be reproduced or compared,
so every report records them: the package version, the git commit of the checkout the
code ran from (and whether it had local changes), the exact command line, host, kernel,
CPU model and count, the load average when the run began, the date (UTC, ISO 8601), and
the Python and numpy versions.
"""
from __future__ import annotations

import configparser
import datetime
import os
import platform
import shlex
import subprocess
import sys
from typing import Optional

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the checkout bench/ lives in


def package_version() -> Optional[str]:
    """The version of the code that runs: the checkout's setup.cfg when bench/ sits in one
    (an installed distribution may be another checkout's), else the installed package's."""
    cfg = os.path.join(ROOT, "setup.cfg")
    if os.path.exists(cfg):
        p = configparser.ConfigParser()
        try:
            p.read(cfg)
            if p.get("metadata", "name", fallback=None) == "moe-transport":
                return p.get("metadata", "version", fallback=None)
        except configparser.Error:
            pass
    try:
        from importlib.metadata import version
        return version("moe-transport")
    except Exception:
        return None


def git_commit(path: str = ROOT) -> dict:
    """``{"commit": sha, "dirty": bool}`` when ``path`` is in a git checkout, else commit None."""
    def git(*args: str) -> Optional[str]:
        try:
            p = subprocess.run(["git", "-C", path, *args], capture_output=True, text=True, timeout=10)
        except (OSError, subprocess.SubprocessError):
            return None
        return p.stdout.strip() if p.returncode == 0 else None

    sha = git("rev-parse", "HEAD")
    if not sha:
        return {"commit": None, "dirty": None}
    status = git("status", "--porcelain", "--untracked-files=no")
    return {"commit": sha, "dirty": bool(status) if status is not None else None}


def cpu_model() -> Optional[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.lower().startswith(("model name", "hardware", "cpu model")):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or None


def command_line() -> str:
    """The command exactly as it was typed (``python -m bench.cli ...`` or ``moe-bench ...``)."""
    argv = getattr(sys, "orig_argv", None) or [sys.executable, *sys.argv]
    return shlex.join(argv)


def now_utc() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def provenance() -> dict:
    import numpy as np
    try:
        load = [round(x, 2) for x in os.getloadavg()]
    except OSError:
        load = None
    return {"package": "moe-transport", "version": package_version(), **git_commit(),
            "command": command_line(), "host": platform.node(), "kernel": platform.release(),
            "os": platform.platform(), "cpu_model": cpu_model(), "cpus": os.cpu_count(),
            "loadavg_at_start": load, "date_utc": now_utc(),
            "python": f"{platform.python_implementation()} {platform.python_version()}",
            "numpy": np.__version__}


def emit_report(md: str, path: Optional[str]) -> None:
    """Print a report to stdout, and write it to ``path`` too when one is given."""
    print(md, flush=True)
    if path:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w") as f:
            f.write(md + "\n")


def write_json_atomic(path: str, doc: dict) -> None:
    """Write ``doc`` to ``path`` through a temporary file and a rename, so a reader (or a run
    interrupted half-way through a write) never sees a partial file."""
    import json
    os.makedirs(os.path.dirname(os.path.abspath(path)) or ".", exist_ok=True)
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(doc, f, indent=1, allow_nan=False)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
