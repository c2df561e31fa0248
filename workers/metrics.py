"""Prometheus metrics of the worker: a scrape-time collector over its counters (per expert,
per error code, connections) plus the serve loop's refusals and the transport's counters.

It reads the daemon's objects through their public attributes and takes no lock (values
are plain ints/floats; containers are copied before iterating).
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry, ProcessCollector
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.utils import floatToGoString

from transport.service.health import Health, Heartbeat
from transport.service.metrics import FnCollector, build_info, serve_families, transport_families
from workers import protocol as P
from workers.daemon import COMPUTE_BUCKETS

_LE = [floatToGoString(b) for b in COMPUTE_BUCKETS] + ["+Inf"]  # as prometheus_client writes `le`


# -- worker ---------------------------------------------------------------------

def worker_families(daemon) -> list:
    st = daemon.stats
    experts = sorted(list(st.experts.items()))  # keyed by (layer, expert id)
    el = ["expert", "layer"]
    tok = CounterMetricFamily("moe_expert_tokens", "Tokens (rows) computed per expert", labels=el)
    bat = CounterMetricFamily("moe_expert_batches", "Expert groups computed per expert", labels=el)
    err = CounterMetricFamily("moe_expert_errors", "Compute failures per expert", labels=el)
    cs = HistogramMetricFamily("moe_expert_compute_seconds", "Compute time of one expert group (count = "
                               "batches); a histogram, so it aggregates across workers", labels=el)
    ver = GaugeMetricFamily("moe_expert_version", "Active weights version per expert", labels=el)
    held = GaugeMetricFamily("moe_expert_version_held", "1 per weights version held (hot update: two)",
                             labels=el + ["version"])
    for (L, e), c in experts:
        lv = [str(e), str(L)]
        tok.add_metric(lv, c.tokens)
        bat.add_metric(lv, c.batches)
        err.add_metric(lv, c.errors)
        cum, buckets = 0, []
        for le, n in zip(_LE, list(c.compute_buckets)):
            cum += n
            buckets.append((le, cum))
        cs.add_metric(lv, buckets, sum_value=c.compute_seconds)
        ex = daemon.experts.get((L, e))
        ver.add_metric(lv, getattr(ex, "version", 0) if ex is not None else 0)
        for v in sorted(list(getattr(daemon, "held", {}).get((L, e), {}))):
            held.add_metric(lv + [str(v)], 1)
    fams = [tok, bat, err, cs, ver, held]
    k = dict(getattr(daemon, "kernel", {}) or {})
    kl = ["kernel", "dtype", "wire_dtype", "threads"]
    kin = GaugeMetricFamily("moe_worker_kernel_info", "The experts' compute kernel: kind, compute dtype, "
                            "wire (activation) dtype, intra-op threads (value 1)", labels=kl)
    kin.add_metric([str(k.get(n, "")) for n in kl], 1)
    fams.append(kin)
    fams.append(GaugeMetricFamily("moe_worker_in_flight", "Batches received and not yet answered",
                                  value=daemon.in_flight))
    fams.append(GaugeMetricFamily("moe_worker_queue_depth", "Batches waiting in this worker (received, "
                                  "their compute not started)", value=daemon.queue_depth))
    fams.append(CounterMetricFamily("moe_worker_requests", "Requests handled", value=st.requests))
    fams.append(CounterMetricFamily("moe_worker_batches", "Forward batches answered", value=st.batches))
    ec = CounterMetricFamily("moe_worker_errors", "Error replies by code", labels=["code"])
    for code, n in sorted((dict.fromkeys(P.ERROR_CODES, 0) | dict(st.errors)).items()):  # every code from the start
        ec.add_metric([str(code)], n)
    fams.append(ec)
    fams.append(CounterMetricFamily("moe_worker_connections_accepted", "Connections accepted",
                                    value=st.connections_accepted))
    fams.append(GaugeMetricFamily("moe_worker_connections_open", "Connections open", value=st.connections_open))
    fams.append(GaugeMetricFamily("moe_worker_draining", "1 while draining", value=int(daemon.draining)))
    fams.extend(serve_families(daemon.loop.stats, "worker"))
    fams.extend(transport_families([daemon.conn_book]))
    fams.append(build_info("worker"))
    return fams


def worker_registry(daemon) -> CollectorRegistry:
    reg = CollectorRegistry(auto_describe=False)
    reg.register(FnCollector(lambda: worker_families(daemon)))
    ProcessCollector(registry=reg)  # process_cpu_seconds_total, resident memory, open fds
    return reg


def worker_health(daemon) -> Health:
    """/healthz: the daemon's serve loop turns (a heartbeat tick); /readyz: it is not
    draining (after SIGTERM it still answers what it was sent, but takes nothing new)."""
    beat = Heartbeat()
    daemon.loop.add_tick(beat.tick)

    def ready() -> tuple[bool, dict]:
        draining = bool(daemon.draining)
        return not draining, {"draining": draining, "experts": sorted(daemon.experts),
                              "connections": len(daemon.conn_book)}
    return Health(live=beat.check, ready=ready)
