"""``moe-bench chaos``: a gateway and two workers under random SIGKILL and SIGSTOP, client
churn and a background of hostile connections; every answer checked against the reference.

    moe-bench chaos --backend tcp --backend shm --replicas 1 --replicas 2 --duration 180 \\
        --json bench-results/chaos.json --plot bench-results/chaos.png

Per configuration (backend x replicas x worker kind):

1. start two workers (external: this tool restarts a killed one on the same URL; local:
   the gateway spawns, reaps and respawns them) and a gateway;
2. the good client's p99 alone, then with ``--hostile-idle`` idle plus ``--hostile-half``
   half-open connections to the gateway, then alone again (stated: the gateway's connection
   cap and idle timeout, and the handshake deadline);
3. warm-up with steady clients, churn and the chaos-phase hostile background; baseline RSS,
   open fds per role and /dev/shm entries (with the background paused, as at the end);
4. ``--duration`` seconds of chaos: one worker at a time is SIGKILLed (restarted) or
   SIGSTOPped (then SIGCONTed); after its return, the time until the service is whole again
   (a request needing only its experts is answered; with replicas: the gateway reports it
   healthy again) is its recovery time. Only one worker is ever down, so with replicas an
   expert always has a live copy;
5. the end: chaos stops, every worker is back, the background is paused; resources again.

Every request carries a fresh id on its connection; a reply is matched by id, so a second
reply for one id is a duplicate; no reply within ``--deadline`` is lost. A failed request is
"expected" when an expert it needs had no live host at the time (the victim's down window,
from the signal to its recovery); any other failure is unexpected.

Progress goes to stderr, the report to stdout, ``--json`` holds everything with provenance.
"""
from __future__ import annotations

import collections
import os
import random
import signal
import statistics
import subprocess
import sys
import threading
import time
from typing import Optional

import numpy as np


from bench import chaos_eplb
from bench.chaos_clients import Client, Layer, Tally
from bench.chaos_eplb import ChaosEplb
from bench.chaos_hostile import Crowd
from bench.chaos_settings import (D_FF, D_MODEL, MAX_BATCH, N_EXPERTS, TOP_K, children, dev_shm, fds, log,
                                  rss_kb)
from bench.chaos_updates import UpdateDriver, VersionBook
from bench.versioned import VersionedReference
from workers.flags import worker_argv


# -- the cluster ---------------------------------------------------------------------------------
class Cluster:
    """Two workers and a gateway; ``workers`` is external (this tool restarts a killed worker
    on its URL) or local (the gateway's own, respawned by it)."""

    def __init__(self, args, backend: str, replicas: int, kind: str, secret_file: str) -> None:
        from gateway.supervisor import placement
        from transport.service.launch import blas_env, spawn_service

        self.backend, self.replicas, self.kind = backend, replicas, kind
        self.args = args
        self.env = blas_env(1, {**os.environ, "MOE_SECRET_FILE": secret_file})
        self.spawn = spawn_service
        self.placement = placement(N_EXPERTS, 2, replicas)
        self.procs: list = [None, None]
        self.urls: list = ["", ""]
        self.gateway = None
        tag = f"{os.getpid()}-{backend}-{replicas}-{kind}"
        gw_flags = ["--d-model", str(D_MODEL), "--d-ff", str(D_FF), "--n-experts", str(N_EXPERTS),
                    "--top-k", str(TOP_K), "--seed", str(args.seed), "--max-batch-tokens", str(MAX_BATCH),
                    "--max-wait", "0.001", "--worker-timeout", str(args.worker_timeout),
                    "--max-connections", str(args.max_connections), "--idle-timeout", str(args.idle_timeout),
                    "--connect-timeout", "30"]
        gw_flags += chaos_eplb.gateway_flags(args)
        gw_listen = "tcp://127.0.0.1:0" if backend == "tcp" else f"shm://moe-chaos-{tag}-gw"
        gw_flags += ["--exit-with-parent"]  # a chaos run killed mid-way leaves no gateway behind
        try:
            if kind == "external":
                for i in range(2):
                    listen = "tcp://127.0.0.1:0" if backend == "tcp" else f"shm://moe-chaos-{tag}-w{i}"
                    self.procs[i], self.urls[i] = self._spawn_worker(i, listen)
                argv = [sys.executable, "-m", "gateway.cli", "--listen", gw_listen, "--workers",
                        ",".join(self.urls), *gw_flags]
            else:
                argv = [sys.executable, "-m", "gateway.cli", "--listen", gw_listen, "--local-workers", "2",
                        "--backend", backend, "--replicas", str(replicas), *gw_flags]
            self.gateway, self.url = spawn_service(argv, timeout=90, env=self.env, stderr=self._log("gateway"))
        except BaseException:
            self.close()
            raise

    def _log(self, role: str):
        path = self.args.log_dir and os.path.join(self.args.log_dir, f"{self.backend}-r{self.replicas}-"
                                                                     f"{self.kind}-{role}.log")
        return open(path, "ab") if path else subprocess.DEVNULL

    def _spawn_worker(self, i: int, listen: str):

        argv = worker_argv(listen, self.placement[i], d_model=D_MODEL, d_ff=D_FF, seed=self.args.seed,
                           max_tokens=MAX_BATCH * TOP_K)
        return self.spawn(argv, timeout=60, env=self.env, stderr=self._log(f"worker{i}"))

    def worker_pids(self, pong: Optional[dict] = None) -> list:
        if self.kind == "external":
            return [p.pid if p is not None else None for p in self.procs]
        return [w.get("pid") for w in pong["workers"]] if pong else [None, None]

    def restart(self, i: int) -> None:
        """External worker ``i`` again on its URL (the same tcp port or shm name)."""
        proc = self.procs[i]
        if proc is not None and proc.poll() is None:
            raise RuntimeError(f"worker {i} still runs")
        for attempt in range(50):  # a tcp port may take a moment to be free again
            try:
                self.procs[i], url = self._spawn_worker(i, self.urls[i])
                assert url == self.urls[i], (url, self.urls[i])
                return
            except Exception as e:
                if attempt == 49:
                    raise
                log(f"restarting worker {i} failed ({e}); again")
                time.sleep(0.1)

    def close(self) -> None:
        from transport.service.launch import stop_process

        if self.gateway is not None:
            stop_process(self.gateway, timeout=20)
        for p in self.procs:
            if p is not None:
                try:
                    os.kill(p.pid, signal.SIGCONT)
                except ProcessLookupError:
                    pass
                stop_process(p, timeout=10)


# -- one configuration ---------------------------------------------------------------------------
def _percentile(xs: list, q: float) -> Optional[float]:
    if not xs:
        return None
    return float(np.percentile(np.asarray(xs), q))


class Run:
    def __init__(self, args, backend: str, replicas: int, kind: str, secret: bytes, secret_file: str,
                 layer: Layer) -> None:
        self.args, self.backend, self.replicas, self.kind = args, backend, replicas, kind
        self.secret, self.secret_file, self.layer = secret, secret_file, layer
        self.tally = Tally()
        self.stop = threading.Event()
        self.events: list[dict] = []  # the chaos timeline
        self.threads: list[threading.Thread] = []
        self.t0 = time.monotonic()
        self.churn_pause, self.churn_idle = threading.Event(), threading.Event()
        self.book = self.versions = self.driver = None
        self.eplb = None
        if getattr(args, "eplb", False):

            self.eplb = ChaosEplb(args, layer)
        if args.updates:

            self.book = VersionBook(N_EXPERTS)
            self.versions = VersionedReference(D_MODEL, D_FF, N_EXPERTS, TOP_K, seed=args.seed)

    def client(self, tally: Optional[Tally] = None) -> "Client":
        return Client(self.cluster.url, self.secret, tally or self.tally, self.args.deadline,
                      checker=self._check if self.book is not None else None)

    def _check(self, x, y, versions: dict, t0: float, t1: float) -> str:
        """With hot updates: right at the versions it names, each served during its life."""
        if not self.versions.matches(x, y, versions):
            return "wrong"
        if not all(self.book.allowed(e, v, t0, t1) for e, v in versions.items()):
            return "stale"
        return "mixed" if self.book.mixed(versions, t0, t1) else "ok"

    def _settled_resources(self) -> dict:
        """Resources with the churn paused (its clients come and go: a descriptor or two)."""
        self.churn_pause.set()
        self.churn_idle.wait(self.args.deadline + 5)
        time.sleep(0.5)
        try:
            return self.resources()
        finally:
            self.churn_pause.clear()

    # -- clients ---------------------------------------------------------------------------
    def _steady(self, idx: int) -> None:
        rng = random.Random(100 + idx)
        client = None
        while not self.stop.is_set():
            try:
                if client is None:
                    client = self.client()
                x, y, ex = self._pick(rng)
                client.request(x, y, ex, "steady")
                time.sleep(self.args.pace)
            except Exception as e:
                log(f"steady client {idx}: {type(e).__name__}: {e}; reconnecting")
                if client is not None:
                    client.close()
                client = None
                time.sleep(0.2)
        if client is not None:
            client.drain_duplicates()
            client.close()

    def _pick(self, rng) -> tuple:
        """A batch and its reference: skewed and shifting under --eplb, else any."""
        return self.eplb.pick(rng) if self.eplb is not None else rng.choice(self.layer.pairs)

    def _churn(self) -> None:
        rng = random.Random(5)
        while not self.stop.is_set():
            if self.churn_pause.is_set():  # resources are being measured: no client coming or going
                self.churn_idle.set()
                time.sleep(0.05)
                continue
            self.churn_idle.clear()
            try:
                c = self.client()
            except Exception as e:
                log(f"churn client could not connect: {e}")
                time.sleep(0.5)
                continue
            try:
                for _ in range(rng.randint(1, 5)):
                    x, y, ex = self._pick(rng)
                    c.request(x, y, ex, "churn")
                c.drain_duplicates()
            except Exception as e:
                log(f"churn client: {type(e).__name__}: {e}")
            finally:
                c.close()
            time.sleep(rng.uniform(0.05, 0.3))

    # -- p99 with and without a hostile crowd ------------------------------------------------------
    def _p99_window(self, seconds: float) -> list:
        lat = []
        tally = Tally()
        c = self.client(tally)
        try:
            end = time.monotonic() + seconds
            i = 0
            while time.monotonic() < end:
                x, y, ex = self.layer.pairs[i % len(self.layer.pairs)]
                i += 1
                t = time.monotonic()
                if c.request(x, y, ex, "p99") == "ok":
                    lat.append(time.monotonic() - t)
                time.sleep(self.args.pace)
        finally:
            c.close()
        bad = [o.result for o in tally.outcomes if o.result != "ok"]
        if bad:
            log(f"p99 window: {len(bad)} bad answers {collections.Counter(bad)}")
        return lat

    def p99_phase(self) -> dict:
        a = self.args
        log(f"p99 alone for {a.p99_seconds:.0f} s")
        alone = self._p99_window(a.p99_seconds)
        t = time.monotonic()
        crowd = Crowd(self.cluster.url, self.backend, self.secret_file, {"idle": a.hostile_idle, "half": a.hostile_half})
        log(f"hostile crowd open in {time.monotonic() - t:.1f} s: {crowd.ready['open']}; p99 with it")
        try:
            crowded = self._p99_window(a.p99_seconds)
        finally:
            res = crowd.close()
        held = res.get("held")
        time.sleep(1.0)
        log("p99 alone again")
        alone += self._p99_window(a.p99_seconds)
        p_alone, p_crowd = _percentile(alone, 99), _percentile(crowded, 99)
        return {"alone_p99_ms": p_alone and p_alone * 1e3, "crowded_p99_ms": p_crowd and p_crowd * 1e3,
                "alone_p50_ms": _percentile(alone, 50) * 1e3 if alone else None,
                "crowded_p50_ms": _percentile(crowded, 50) * 1e3 if crowded else None,
                "alone_n": len(alone), "crowded_n": len(crowded),
                "ratio": (p_crowd / p_alone) if p_alone and p_crowd else None,
                "crowd_requested": {"idle": a.hostile_idle, "half_open": a.hostile_half},
                "crowd_open_at_start": crowd.ready["open"], "crowd_held_at_end": held,
                "crowd_reconnects": res.get("reconnects"), "crowd_open_failures": res.get("failures"),
                "gateway_max_connections": a.max_connections, "gateway_idle_timeout_s": a.idle_timeout,
                "handshake_timeout_s": 5.0}

    # -- resources -------------------------------------------------------------------------------
    def _ping(self) -> Optional[dict]:
        from gateway.client import GatewayClient

        try:
            with GatewayClient(self.cluster.url, timeout=5.0, secret=self.secret) as c:
                return c.ping(timeout=5.0)
        except Exception:
            return None

    def resources(self) -> dict:
        pong = self._ping()
        roles = {"gateway": self.cluster.gateway.pid}
        for i, pid in enumerate(self.cluster.worker_pids(pong)):
            roles[f"worker{i}"] = pid
        return {"processes": {r: {"pid": p, "rss_kb": p and rss_kb(p), "fds": p and fds(p)}
                              for r, p in roles.items()},
                "dev_shm": dev_shm()}

    # -- chaos -----------------------------------------------------------------------------------
    def _healthy(self, i: int, pid: Optional[int]) -> bool:
        pong = self._ping()
        if pong is None:
            return False
        w = pong["workers"][i]
        return bool(w.get("healthy")) and not w.get("draining") and (pid is None or w.get("pid") == pid)

    def _wait_whole(self, i: int, pid: Optional[int], probe, limit: float = 30.0) -> Optional[float]:
        """Seconds until worker ``i`` serves again (None: not within ``limit``)."""
        t0 = time.monotonic()
        c = None
        while time.monotonic() - t0 < limit and not self.stop.is_set():
            if self.replicas > 1 or probe is None:
                if self._healthy(i, pid):
                    return time.monotonic() - t0
            else:
                try:
                    if c is None:
                        c = self.client()
                    if c.request(*probe, "probe") == "ok":
                        c.close()
                        return time.monotonic() - t0
                except Exception:
                    if c is not None:
                        c.close()
                    c = None
            time.sleep(0.01)
        if c is not None:
            c.close()
        return None

    def _chaos(self, end: float) -> None:
        rng = random.Random(self.args.seed + 1000 * self.replicas + (0 if self.backend == "tcp" else 1))
        probes = [self.layer.steered(set(self.cluster.placement[i]) - set(self.cluster.placement[1 - i]) or
                                     set(self.cluster.placement[i]), seed=i) for i in range(2)]
        while time.monotonic() < end and not self.stop.is_set():
            time.sleep(max(0.0, min(rng.uniform(*self.args.gap), end - time.monotonic())))
            if time.monotonic() >= end:
                break
            i = rng.randrange(2)
            action = "stop" if rng.random() < self.args.stop_fraction else "kill"
            down = rng.uniform(*self.args.down)
            move = None
            if self.eplb is not None:  # aimed at a move in progress, if one comes before the next gap
                i, move = self.eplb.aim(i, wait=max(0.0, min(self.args.gap[1], end - time.monotonic())))
            pong = self._ping()
            pids = self.cluster.worker_pids(pong)
            pid = pids[i]
            if pid is None:
                log(f"worker {i} has no pid now; skipping")
                continue
            ev = {"worker": i, "action": action, "pid": pid, "t_signal": time.monotonic() - self.t0,
                  "experts": self.cluster.placement[i]}
            if self.eplb is not None:
                ev["experts"] = self.eplb.watch.experts_on(i, time.monotonic())
                self.eplb.note_action(ev, move)
            if action == "kill":
                os.kill(pid, signal.SIGKILL)
                if self.cluster.kind == "external":
                    self.cluster.procs[i].wait(timeout=10)
                    time.sleep(down)
                    self.cluster.restart(i)
                    new_pid = self.cluster.procs[i].pid
                else:
                    new_pid = None
                    t = time.monotonic()
                    while time.monotonic() - t < 60:
                        kids = [k for k in children(self.cluster.gateway.pid) if k not in pids]
                        if kids:
                            new_pid = kids[0]
                            break
                        time.sleep(0.01)
            else:
                os.kill(pid, signal.SIGSTOP)
                time.sleep(down)
                os.kill(pid, signal.SIGCONT)
                new_pid = pid
            t_return = time.monotonic()
            ev["t_return"] = t_return - self.t0
            ev["new_pid"] = new_pid
            probe = None if self.replicas > 1 or self.eplb is not None else probes[i]
            rec = self._wait_whole(i, new_pid, probe)
            ev["recovery_s"] = rec
            ev["t_whole"] = (t_return + rec - self.t0) if rec is not None else None
            self.events.append(ev)
            log(f"{action} worker {i} (pid {pid}), back after {ev['t_return'] - ev['t_signal']:.2f} s"
                f" (pid {new_pid}), whole again {'never' if rec is None else f'{rec * 1e3:.0f} ms'} later")

    # -- the whole configuration ------------------------------------------------------------------
    def execute(self) -> dict:
        a = self.args
        name = f"{self.backend} replicas={self.replicas} workers={self.kind}"
        log(f"== {name}: starting")
        shm_before = dev_shm()
        self.cluster = Cluster(a, self.backend, self.replicas, self.kind, self.secret_file)
        report: dict = {"backend": self.backend, "replicas": self.replicas, "workers": self.kind,
                        "placement": self.cluster.placement, "duration_s": a.duration}
        hostile = []
        try:
            if self.eplb is not None:
                self.eplb.start(self.cluster.url, self.secret)
            report["p99"] = self.p99_phase()
            log(f"warm-up {a.warmup:.0f} s (steady clients, churn, hostile background)")
            for i in range(a.clients):
                self.threads.append(threading.Thread(target=self._steady, args=(i,), daemon=True))
            self.threads.append(threading.Thread(target=self._churn, daemon=True))
            for t in self.threads:
                t.start()
            bg = {"idle": a.bg_idle, "half": a.bg_half, "nonreader": a.bg_nonreaders, "garbage": a.bg_garbage}
            targets_bg = [(self.cluster.url, bg)]
            if self.kind == "external":  # the workers get garbage and half-open handshakes too
                targets_bg += [(url, {"half": 2, "garbage": 1}) for url in self.cluster.urls]
            hostile = [Crowd(url, self.backend, self.secret_file, counts) for url, counts in targets_bg]
            time.sleep(a.warmup)
            for h in hostile:  # resources are compared with the background paused at both ends
                h.close()
            time.sleep(1.0)
            report["baseline"] = self._settled_resources()
            hostile = [Crowd(url, self.backend, self.secret_file, counts) for url, counts in targets_bg]
            n_before = len(self.tally.outcomes)
            self.t0 = time.monotonic()
            log(f"chaos for {a.duration:.0f} s" + (" with hot updates" if self.book is not None else ""))
            if self.book is not None:

                self.driver = UpdateDriver(self.cluster.url, self.secret, self.book, self.versions,
                                           gap=a.update_gap, seed=a.seed + self.replicas, log=log).start()
            self._chaos(self.t0 + a.duration)
            chaos_s = time.monotonic() - self.t0
            if self.driver is not None:
                report["updates"] = self._end_updates()
            log("chaos over; letting the last requests finish")
            t = time.monotonic()
            while time.monotonic() - t < 30 and not all(self._healthy(i, None) for i in range(2)):
                time.sleep(0.1)
            time.sleep(2.0)
            bg_results = [h.close() for h in hostile]
            time.sleep(1.0)
            report["end"] = self._settled_resources()  # as at the baseline: clients on, background paused
            self.stop.set()
            for t in self.threads:
                t.join(a.deadline + 10)
            report["chaos_s"] = chaos_s
            report["hostile_background"] = {"requested": [c for _, c in targets_bg], "results": bg_results}
            pong = self._ping()
            report["gateway_serve_stats"] = pong and pong.get("serve")
            report["gateway_stats"] = pong and {k: pong["gateway"][k] for k in ("requests", "replies", "retried",
                                                                             "failed_requests", "errors")}
            report.update(self.summarize(n_before))
            if self.eplb is not None:
                report["eplb"] = self.eplb.report()
        finally:
            self.stop.set()
            if self.eplb is not None:
                self.eplb.close()
            for h in hostile:
                h.close()
            self.cluster.close()
        report["dev_shm_left_after_stop"] = sorted(set(dev_shm()) - set(shm_before))
        report["targets"] = targets(report)
        log(f"== {name}: done")
        return report

    def _end_updates(self) -> dict:
        """Stop the update driver (a running update is rolled back) and say what it did."""
        from gateway.client import GatewayClient

        counts = self.driver.close()
        try:
            with GatewayClient(self.cluster.url, timeout=10.0, secret=self.secret) as c:
                self.driver.finish(c)
        except Exception as e:
            log(f"could not end the last update: {e}")
        pong = self._ping() or {}
        return {"commands": counts, "spans": len(self.book.spans), "admission": pong.get("admission"),
                "served_generation": (pong.get("served") or {}).get("generation")}

    def summarize(self, n_before: int) -> dict:
        outs = self.tally.outcomes
        warm = outs[:n_before]
        chaos = outs[n_before:]
        counts = collections.Counter(o.result for o in chaos)
        errors = {k.split(":", 1)[1]: v for k, v in counts.items() if k.startswith("error:")}
        # a failure is expected if an expert it needs had no live host during its life
        windows = []
        for ev in self.events:
            end = ev["t_whole"] if ev["t_whole"] is not None else float("inf")
            only = (self.eplb.only(ev, self.t0) if self.eplb is not None else
                    set(ev["experts"]) - set(self.cluster.placement[1 - ev["worker"]]))
            windows.append((ev["t_signal"] + self.t0 - 0.05, end + self.t0 + 0.5, only))
        unexpected, fail_lat = [], []
        lost = [{"t": o.t_sent - self.t0, "waited_s": o.t_done - o.t_sent, "experts": list(o.experts),
                 "source": o.source} for o in chaos if o.result == "lost"]
        for o in chaos:
            if not o.result.startswith("error:"):
                continue
            fail_lat.append(o.t_done - o.t_sent)
            if not any(lo <= o.t_done and o.t_sent <= hi and set(o.experts) & only for lo, hi, only in windows):
                unexpected.append({"t": o.t_sent - self.t0, "result": o.result, "experts": list(o.experts),
                                   "source": o.source})
        kills = [e["recovery_s"] for e in self.events if e["action"] == "kill" and e["recovery_s"] is not None]
        stops = [e["recovery_s"] for e in self.events if e["action"] == "stop" and e["recovery_s"] is not None]
        sent = len(chaos)
        per_s = collections.defaultdict(collections.Counter)
        for o in chaos:
            per_s[int(o.t_done - self.t0)][o.result.split(":")[0]] += 1
        return {
            "requests": {"sent": sent, "ok": counts.get("ok", 0), "failed": sum(errors.values()),
                         "failed_by_code": errors, "wrong": counts.get("wrong", 0), "lost": counts.get("lost", 0),
                         "stale": counts.get("stale", 0), "mixed": counts.get("mixed", 0),
                         "duplicated": self.tally.duplicated, "late": self.tally.late,
                         "send_failed": self.tally.send_failed, "unexpected_failures": len(unexpected),
                         "unexpected_examples": unexpected[:10], "lost_examples": lost[:10],
                         "by_source": dict(collections.Counter(o.source for o in chaos))},
            "warmup_requests": {"sent": len(warm), "ok": sum(o.result == "ok" for o in warm)},
            "failure_latency_s": {"max": max(fail_lat) if fail_lat else None,
                                  "p50": _percentile(fail_lat, 50)},
            "deadline_s": self.args.deadline, "worker_timeout_s": self.args.worker_timeout,
            "events": self.events,
            "recovery_s": {"kills": len([e for e in self.events if e["action"] == "kill"]),
                           "stops": len([e for e in self.events if e["action"] == "stop"]),
                           "kill_median": statistics.median(kills) if kills else None,
                           "kill_max": max(kills) if kills else None,
                           "stop_median": statistics.median(stops) if stops else None,
                           "stop_max": max(stops) if stops else None,
                           "never": sum(1 for e in self.events if e["recovery_s"] is None)},
            "timeline": [{"t": s, **dict(c)} for s, c in sorted(per_s.items())],
        }


def _within(base: Optional[int], end: Optional[int], frac: float = 0.10) -> Optional[bool]:
    if not base or end is None:
        return None
    return end <= base * (1 + frac)


def targets(r: dict) -> list[dict]:
    """The fault-tolerance targets, each met or missed (None: not measured)."""
    out = []

    def add(name, met, value):
        out.append({"target": name, "met": met, "value": value})

    if "requests" not in r:
        return out
    q = r["requests"]
    add("wrong 0", q["wrong"] == 0, q["wrong"])
    add("lost 0", q["lost"] == 0, q["lost"])
    add("duplicated 0", q["duplicated"] == 0, q["duplicated"])
    if "updates" in r:
        add("answers from versions not served at that moment 0", q.get("stale", 0) == 0, q.get("stale", 0))
        add("answers mixing an update's sides 0", q.get("mixed", 0) == 0, q.get("mixed", 0))
    if r["replicas"] > 1:
        add("replicated: 0 failed requests", q["failed"] == 0, q["failed"])
    else:
        add("unreplicated: only requests needing the dead worker fail", q["unexpected_failures"] == 0,
            q["unexpected_failures"])
        fl = r["failure_latency_s"]["max"]
        add(f"failures within their deadline ({r['deadline_s']:.0f} s)", fl is None or fl < r["deadline_s"], fl)
        km = r["recovery_s"]["kill_max"]
        add("whole again within 2 s of a killed worker's return (max)", km is not None and km <= 2.0, km)
    add("every worker came back", r["recovery_s"]["never"] == 0, r["recovery_s"]["never"])
    base, end = r["baseline"]["processes"], r["end"]["processes"]
    for role in base:
        for k in ("rss_kb", "fds"):
            add(f"{role} {k} at end within 10% of baseline", _within(base[role][k], end[role][k]),
                f"{base[role][k]} -> {end[role][k]}")
    ratio = r["p99"]["ratio"]
    add("good client's p99 with the hostile crowd <= 2x without", ratio is not None and ratio <= 2.0, ratio)
    add("nothing left in /dev/shm after stop", not r["dev_shm_left_after_stop"], r["dev_shm_left_after_stop"])
    return out + chaos_eplb.targets(r)
