"""Prometheus metrics of the gateway: a scrape-time collector over its counters (requests,
rounds, workers, hot update, transport connections) plus per-round stage histograms and
the per-request latency histogram; and its /healthz and /readyz.

The serve loop pays one ``observe`` per stage per round and one per request; everything
else is read when ``/metrics`` is scraped, through public attributes, without a lock.
Labels are bounded: workers by index (their URL is in ``moe_gateway_worker_info``, as it
may change when a supervisor respawns one), connections by a stable slot (connbook.py).
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, ProcessCollector
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from gateway.update import State
from gateway.worker_link import Health as WorkerHealth
from transport.service.connbook import ConnectionBook
from transport.service.health import Health, Heartbeat
from transport.service.metrics import FnCollector, build_info, serve_families, transport_families
from workers import protocol as P

STAGES = ("queue", "route", "dispatch", "compute", "wait", "combine", "total")
STAGE_BUCKETS = (5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 0.5, 1.0,
                 2.5, 5.0, 10.0)


class GatewayMetrics:
    """The gateway's registry: a scrape-time collector plus per-round histograms fed by
    ``server.on_round`` (set by :meth:`attach`)."""

    def __init__(self, server) -> None:
        self.server = server
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(FnCollector(self._collect))
        ProcessCollector(registry=self.registry)
        self.stage = Histogram("moe_gateway_stage_seconds", "Per-round time per stage", ["stage"],
                               registry=self.registry, buckets=STAGE_BUCKETS)
        self._stage = {s: self.stage.labels(stage=s) for s in STAGES}
        self.round_requests = Histogram("moe_gateway_round_requests", "Requests batched per round",
                                        registry=self.registry, buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256))
        self.dropped = Counter("moe_gateway_dropped_tokens", "Token-expert assignments dropped by capacity",
                               registry=self.registry)
        self.overflow = Counter("moe_gateway_overflow_tokens", "Token-expert assignments over capacity",
                                registry=self.registry)
        self.rows = Counter("moe_gateway_rows", "Rows (token-expert assignments) sent to workers",
                            registry=self.registry)
        self.request_seconds = Histogram("moe_gateway_request_seconds", "Per-request latency at the gateway, "
                                         "from arrival to reply, by outcome", ["outcome"],
                                         registry=self.registry, buckets=STAGE_BUCKETS)
        self._outcome = {True: self.request_seconds.labels(outcome="ok"),
                         False: self.request_seconds.labels(outcome="error")}
        self.worker_book = ConnectionBook("worker")
        self.heartbeat: Heartbeat | None = None  # set by attach()

    def attach(self) -> "GatewayMetrics":
        """Feed the histograms, name the worker connections, and beat with the serve loop."""
        srv = self.server
        srv.on_round = self.on_round
        srv.on_request = self.on_request
        for w in srv.pool.workers:
            if w.conn is not None:
                self.worker_book.opened(w.conn, slot=w.index)
        srv.pool.workers.on_up.append(lambda w: self.worker_book.opened(w.conn, slot=w.index))
        srv.pool.workers.on_down.append(lambda w, why: self.worker_book.closed(w.conn))
        self.heartbeat = Heartbeat()
        srv.loop.add_tick(self.heartbeat.tick)
        return self

    def health(self) -> Health:
        return Health(live=self.heartbeat.check if self.heartbeat is not None else None, ready=self.ready)

    def ready(self) -> tuple[bool, dict]:
        """Ready: not draining, and every expert has a healthy worker (else some requests
        could only fail with ``unavailable``)."""
        srv, pool = self.server, self.server.pool
        workers = list(pool.workers)
        missing = [e for e in range(pool.n_experts) if not any(w.usable and e in w.experts for w in workers)]
        draining = bool(srv.draining)
        detail = {"draining": draining, "experts_without_healthy_worker": missing,
                  "workers": {str(w.index): w.state.value for w in workers}}
        return not missing and not draining, detail

    @staticmethod
    def _update_families(up) -> list:
        """The hot update's split, state and counts; with no update yet, the split and the
        counts at 0 with empty labels (so a panel charts 0, not "No data")."""
        ul = ["experts", "old", "new"]
        frac = GaugeMetricFamily("moe_gateway_update_fraction", "Share of requests decided for the new "
                                 "version by the current hot update", labels=ul)
        served = CounterMetricFamily("moe_gateway_update_requests", "Requests decided by the current hot "
                                     "update, by side", labels=ul + ["side"])
        if up is None:
            frac.add_metric(["", "", ""], 0.0)
            for side in ("old", "new"):
                served.add_metric(["", "", "", side], 0)
            return [frac, served]
        lv = [",".join(map(str, up.experts)), ",".join(str(up.old[e]) for e in up.experts), str(up.new)]
        frac.add_metric(lv, up.fraction)
        ust = GaugeMetricFamily("moe_gateway_update_state", "Hot update state (1 on the current one)",
                                labels=ul + ["state"])
        for s_ in State:
            ust.add_metric(lv + [s_.value], int(up.state == s_))
        for side in ("old", "new"):
            served.add_metric(lv + [side], up.served[side])
        return [frac, ust, served]

    def on_request(self, seconds: float, ok: bool) -> None:
        self._outcome[ok].observe(seconds)

    def on_round(self, st, queue_s: float) -> None:
        s = self._stage
        s["queue"].observe(queue_s)
        s["route"].observe(st.route_s)
        s["dispatch"].observe(st.dispatch_s)
        s["compute"].observe(st.compute_s)
        s["wait"].observe(st.wait_s)
        s["combine"].observe(st.combine_s)
        s["total"].observe(st.total_s)
        self.round_requests.observe(st.requests)
        if st.dropped:
            self.dropped.inc(st.dropped)
        if st.overflow:
            self.overflow.inc(st.overflow)
        if st.rows:
            self.rows.inc(st.rows)

    @staticmethod
    def _served(pool) -> list:
        """What the gateway serves (gateway/served.py) and how workers were admitted to it."""
        served, adm = pool.served, pool.admission.stats
        gen = GaugeMetricFamily("moe_gateway_served_generation", "Generation of the served weights (one more at "
                                "every finished update or settle)", value=served.generation)
        ver = GaugeMetricFamily("moe_gateway_served_version", "The served version of each expert (-1: blocked, "
                                "its workers disagree)", labels=["expert", "layer"])
        for L in sorted(served.layers):
            for e, v in enumerate(served.versions(L)):
                ver.add_metric([str(e), str(L)], v)
        blocked = GaugeMetricFamily("moe_gateway_blocked_experts", "Experts not served because their workers "
                                    "disagree on their weights", value=len(served.blocked))
        adopted = GaugeMetricFamily("moe_gateway_adopted_experts", "Experts served at a version other than the "
                                    "start-up one because the workers agreed on it at start", value=len(served.adopted))
        adm_c = CounterMetricFamily("moe_gateway_worker_admissions", "Worker connections admitted as they were "
                                    "(admitted), after loads and retires (synced), or refused", labels=["outcome"])
        for outcome in ("admitted", "synced", "refused"):
            adm_c.add_metric([outcome], getattr(adm, outcome))
        sync_s = CounterMetricFamily("moe_gateway_worker_sync_seconds", "Seconds workers spent being brought to "
                                     "the served weights before admission (count: the synced outcome)",
                                     value=adm.seconds_total)
        return [gen, ver, blocked, adopted, adm_c, sync_s] + GatewayMetrics._placement(pool)

    @staticmethod
    def _placement(pool) -> list:
        """The expert placement (gateway/expert_placement.py) and its moves (vLLM's names where
        they exist: balancedness = mean / max worker load over the window)."""
        live, reb = pool.live, pool.rebalancer
        p = pool.rounds.planner.placement
        version = GaugeMetricFamily("moe_gateway_placement_version", "Version of the expert placement routing now",
                                    value=p.version if p is not None else 0)
        bal = GaugeMetricFamily("moe_gateway_placement_balancedness", "Mean worker load / max worker load over the "
                                "load window, per layer (1 is perfect; NaN before any load)", labels=["layer"])
        copies = GaugeMetricFamily("moe_gateway_placement_copies", "Workers holding a routed copy of each logical "
                                   "expert", labels=["expert", "layer"])
        red = GaugeMetricFamily("moe_gateway_placement_redundant_experts", "Routed copies beyond one per logical "
                                "expert", value=p.redundant() if p is not None else 0)
        share = GaugeMetricFamily("moe_gateway_worker_load_share", "Each worker's share of the window's load under "
                                  "the current placement", labels=["worker"])
        if p is not None:
            for L in sorted(p.copies):
                b = live.balancedness(L)
                bal.add_metric([str(L)], float("nan") if b is None else b)
                for e, ws in enumerate(p.copies[L]):
                    copies.add_metric([str(e), str(L)], len(ws))
            for i, sh in enumerate(live.shares()):
                share.add_metric([str(i)], sh)
        s = reb.stats
        moves = CounterMetricFamily("moe_gateway_placement_moves", "Moves of expert copies by outcome",
                                    labels=["outcome"])
        moves.add_metric(["done"], s.done)
        moves.add_metric(["abandoned"], s.abandoned)
        cps = CounterMetricFamily("moe_gateway_placement_copies_moved", "Copies added to and removed from workers "
                                  "by moves", labels=["change"])
        cps.add_metric(["added"], s.copies_added)
        cps.add_metric(["removed"], s.copies_removed)
        loaded = CounterMetricFamily("moe_gateway_placement_loaded_bytes", "Bytes of expert weights workers loaded "
                                     "for moves", value=s.bytes_loaded)
        return [version, bal, copies, red, share, moves, cps, loaded]

    @staticmethod
    def _workers(pool) -> list:
        """Per worker: URL, health and state, rows and batches sent, failures, compute, rows per
        expert, kernel, and the active version of each expert it hosts."""
        wl = ["worker"]
        info = GaugeMetricFamily("moe_gateway_worker_info", "The worker's URL (always 1)", labels=["worker", "url"])
        healthy = GaugeMetricFamily("moe_gateway_worker_healthy", "1 if the worker is usable", labels=wl)
        state = GaugeMetricFamily("moe_gateway_worker_state", "Worker state (1 on the current one)",
                                  labels=wl + ["state"])
        out = GaugeMetricFamily("moe_gateway_worker_outstanding_tokens", "Rows sent and not yet answered",
                                labels=wl)
        sent = CounterMetricFamily("moe_gateway_worker_rows_sent", "Rows sent to the worker", labels=wl)
        bsent = CounterMetricFamily("moe_gateway_worker_batches_sent", "Batches sent to the worker", labels=wl)
        fail = CounterMetricFamily("moe_gateway_worker_failures", "Failures seen on the worker", labels=wl)
        comp = CounterMetricFamily("moe_gateway_worker_compute_seconds", "Compute time the worker reported",
                                   labels=wl)
        erows = CounterMetricFamily("moe_gateway_worker_expert_rows", "Rows sent per worker and expert",
                                    labels=wl + ["expert", "layer"])
        kl = ["kernel", "dtype", "wire_dtype", "threads"]
        kin = GaugeMetricFamily("moe_gateway_worker_kernel_info", "Each worker's compute kernel as its info "
                                "said: kind, compute dtype, wire dtype, threads (value 1)", labels=wl + kl)
        for w in list(pool.workers):
            lv = [str(w.index)]
            info.add_metric([str(w.index), w.url], 1)
            healthy.add_metric(lv, int(w.usable))
            for h in WorkerHealth:
                state.add_metric(lv + [h.value], int(w.state == h))
            out.add_metric(lv, w.outstanding_rows)
            sent.add_metric(lv, w.rows_sent)
            bsent.add_metric(lv, w.batches_sent)
            fail.add_metric(lv, w.failures)
            comp.add_metric(lv, w.compute_seconds)
            for (L, e), n in sorted(list(w.expert_rows.items())):
                erows.add_metric(lv + [str(e), str(L)], n)
            if w.kernel:
                kin.add_metric(lv + [str(w.kernel.get(n, "")) for n in kl], 1)
        wver = GaugeMetricFamily("moe_gateway_worker_expert_version", "Active weights version per worker and "
                                 "expert, as the worker last said", labels=wl + ["expert", "layer"])
        for w in list(pool.workers):
            for (L, e), v in sorted(list(w.versions.items())):
                wver.add_metric([str(w.index), str(e), str(L)], v)
        return [info, healthy, state, out, sent, bsent, fail, comp, erows, kin, wver]

    def _collect(self) -> list:
        srv = self.server
        st = srv.stats
        pool = srv.pool
        fams = [
            CounterMetricFamily("moe_gateway_requests", "Forward requests received", value=st.requests),
            CounterMetricFamily("moe_gateway_replies", "Results sent", value=st.replies),
            CounterMetricFamily("moe_gateway_tokens", "Tokens received in forward requests", value=st.tokens),
            CounterMetricFamily("moe_gateway_rounds", "Dispatch rounds finished", value=st.rounds),
            CounterMetricFamily("moe_gateway_failed_requests", "Requests answered with an error",
                                value=st.failed_requests),
            CounterMetricFamily("moe_gateway_retried_requests", "Requests retried on a replica after a worker "
                                "failed", value=st.retried),
            CounterMetricFamily("moe_gateway_clients_accepted", "Client connections accepted",
                                value=st.clients_accepted),
            GaugeMetricFamily("moe_gateway_clients_open", "Client connections open", value=st.clients_open),
            GaugeMetricFamily("moe_gateway_queued_requests", "Requests waiting for a round",
                              value=srv.queued_requests),
            GaugeMetricFamily("moe_gateway_queued_tokens", "Tokens waiting for a round", value=srv.queued_tokens),
            GaugeMetricFamily("moe_gateway_rounds_in_flight", "Rounds out at the workers",
                              value=srv.rounds_in_flight),
        ]
        spin = pool.reply_spin()
        rw = CounterMetricFamily("moe_gateway_reply_windows", "Workers' last replies the loop spun for, by when "
                                 "each landed: inside its predicted window, before it, after it (or never)",
                                 labels=["outcome"])
        for outcome in ("hits", "early", "late"):
            rw.add_metric([outcome.rstrip("s")], spin[outcome])
        fams.append(rw)
        ec = CounterMetricFamily("moe_gateway_errors", "Error replies by code", labels=["code"])
        for code, n in sorted((dict.fromkeys(P.ERROR_CODES, 0) | dict(st.errors)).items()):  # each from the start
            ec.add_metric([str(code)], n)
        fams.append(ec)
        fams += self._workers(pool)
        fams += self._served(pool)
        fams += self._update_families(pool.update)
        fams.extend(transport_families([self.worker_book, srv.conn_book]))
        fams.extend(serve_families(srv.loop.stats, "gateway"))
        fams.append(build_info("gateway"))
        return fams
