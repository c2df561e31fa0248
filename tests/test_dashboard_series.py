"""Every series a dashboard panel or an alert rule queries exists from the start: a fresh
gateway and a fresh worker (no request served yet, no error, no hot update) are scraped
over HTTP, and each selector of every expression in deploy/grafana and deploy/prometheus
must match at least one sample, its label matchers included -- so a panel shows 0 where a
user expects 0, never "No data"."""
from __future__ import annotations

import json
import re
import sys
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from transport.service.launch import blas_env, spawn_service, stop_process

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.timeout(120)
SELECTOR = re.compile(r"\b((?:moe|process)_[a-z_]+)\b\s*(\{[^}]*\})?")
MATCHER = re.compile(r"(\w+)\s*(=~|!~|!=|=)\s*\"([^\"]*)\"")


def queries() -> list[tuple[str, str]]:
    """(where, expression) of every Grafana panel target and every Prometheus rule."""
    import yaml

    out = []
    for path in sorted((ROOT / "deploy" / "grafana").rglob("*.json")):
        doc = json.loads(path.read_text())
        panels = list(doc.get("panels", []))
        while panels:
            p = panels.pop()
            panels.extend(p.get("panels", []))
            out += [(f"{path.name}: {p.get('title')}", t["expr"]) for t in p.get("targets", []) if t.get("expr")]
    for path in sorted((ROOT / "deploy" / "prometheus").rglob("*.y*ml")):
        doc = yaml.safe_load(path.read_text()) or {}
        for group in doc.get("groups", []) or []:
            for rule in group.get("rules", []):
                out.append((f"{path.name}: {rule.get('alert') or rule.get('record')}", rule["expr"]))
    return out


def selectors(expr: str) -> list[tuple[str, list[tuple[str, str, str]]]]:
    """(metric name, [(label, op, value)]) of every series selector in a PromQL expression
    (the grouping clauses' label lists, "by (code)", are not selectors)."""
    out = []
    for m in SELECTOR.finditer(expr):
        out.append((m.group(1), MATCHER.findall(m.group(2) or "")))
    return out


def matches(labels: dict, matchers: list[tuple[str, str, str]]) -> bool:
    for key, op, value in matchers:
        have = labels.get(key, "")
        ok = {"=": have == value, "!=": have != value, "=~": re.fullmatch(value, have) is not None,
              "!~": re.fullmatch(value, have) is None}[op]
        if not ok:
            return False
    return True


def scrape(url: str) -> list[tuple[str, dict]]:
    with urllib.request.urlopen(url, timeout=5) as r:
        text = r.read().decode()
    return [(s.name, s.labels) for fam in text_string_to_metric_families(text) for s in fam.samples]


def metrics_url(stderr_path: Path) -> str:
    urls = re.findall(r"^METRICS (\S+)$", stderr_path.read_text(), re.M)
    assert urls, stderr_path.read_text()
    return urls[-1]


def test_selector_parsing_sees_names_and_label_matchers():
    sel = selectors('sum by (code) (rate(moe_gateway_errors_total[5m])) / '
                    'rate(moe_gateway_request_seconds_bucket{outcome="ok", stage!="total"}[1m])')
    assert sel == [("moe_gateway_errors_total", []),
                   ("moe_gateway_request_seconds_bucket", [("outcome", "=", "ok"), ("stage", "!=", "total")])]
    assert not matches({"outcome": "error"}, sel[1][1]) and matches({"outcome": "ok", "stage": "x"}, sel[1][1])


def test_every_queried_series_exists_on_a_fresh_gateway_and_worker(tmp_path):
    exprs = queries()
    assert len(exprs) >= 20, exprs  # the dashboard's panels, at least
    werr, gerr = tmp_path / "worker.stderr", tmp_path / "gateway.stderr"
    procs = []
    try:
        with open(werr, "w") as f:
            w, wurl = spawn_service([sys.executable, "-m", "workers.cli", "--listen", "tcp://127.0.0.1:0",
                                     "--experts", "0-3", "--d-model", "16", "--d-ff", "32", "--metrics-port", "0"],
                                    env=blas_env(1), stderr=f)
        procs.append(w)
        with open(gerr, "w") as f:
            g, _ = spawn_service([sys.executable, "-m", "gateway.cli", "--listen", "tcp://127.0.0.1:0",
                                  "--workers", wurl, "--n-experts", "4", "--metrics-port", "0"],
                                 env=blas_env(1), stderr=f)
        procs.append(g)
        samples = scrape(metrics_url(gerr)) + scrape(metrics_url(werr))
    finally:
        for p in reversed(procs):
            stop_process(p, timeout=10)
    missing = []
    for where, expr in exprs:
        for name, matchers in selectors(expr):
            if not any(n == name and matches(labels, matchers) for n, labels in samples):
                missing.append(f"{where}: {name}{{{', '.join(''.join(m) for m in matchers)}}}")
    assert not missing, "series queried but not exported before the first request/error/update:\n" + \
        "\n".join(missing)
    # the error counters have a series per known code, at 0
    from workers import protocol as P
    codes = {labels.get("code") for n, labels in samples if n == "moe_gateway_errors_total"}
    assert set(P.ERROR_CODES) <= codes
