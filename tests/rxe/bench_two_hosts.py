"""rdma:// across the two-host link beside the one-device loopback, in one guest run
(``make bench-rdma-two-hosts``; in the rxe guest, as root):

    python3 -m tests.rxe.bench_two_hosts --json OUT.json [--sizes 64,4K,1M] [--iters N]

First the loopback rows (client and echo side on the guest's rxe0), then the link rows: the
timed side on host A's device, the echo side on host B's, every packet through both veths
and the bridge (tests/rxe/hosts.py). Each set holds ours (compiled and Python path), the
bare pyverbs loop and perftest (ib_send_lat, ib_send_bw, ib_write_bw), same sizes, same run
(`moe-bench transport --backend rdma [--server-device DEV]`). The summary gives the issue's
ratios: across the link ours/bare-loop p50 at 64 B and 4 KiB (target <= 2), and ours/ib_write_bw
at 1 MiB (target >= 0.9), with the loopback's beside them.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Optional

from bench import transport_bench
from tests.rxe.hosts import Link

TARGETS = {"p50_vs_bare_loop_max": 2.0, "bw_1mib_vs_ib_write_bw_min": 0.9}


def _bench(json_path: str, sizes: str, iters: int, server_device: Optional[str]) -> dict:
    p = argparse.ArgumentParser()
    transport_bench.add_arguments(p)
    argv = ["--backend", "rdma", "--sizes", sizes, "--iters", str(iters), "--figures", "descriptor",
            "--json", json_path]
    if server_device:
        argv += ["--server-device", server_device]
    transport_bench.run(p.parse_args(argv))
    with open(json_path) as f:
        return json.load(f)


def _row(doc: dict, impl: str, size: int) -> Optional[dict]:
    for r in doc["results"]:
        if r.get("impl") == impl and r.get("size") == size and r.get("figure", "descriptor") == "descriptor" \
                and r.get("carried", True) and "error" not in r:
            return r
    return None


def ratios(doc: dict) -> dict:
    """ours / bare pyverbs loop (p50 one-way latency) by size, ours / ib_write_bw at 1 MiB."""
    out: dict = {}
    for size in (64, 4096):
        ours, bare = _row(doc, "moe-transport", size), _row(doc, "raw", size)
        if ours and bare:
            out[f"p50_{size}B_us"] = {"ours": ours["lat_us"]["p50"], "bare_loop": bare["lat_us"]["p50"],
                                      "ratio": round(ours["lat_us"]["p50"] / bare["lat_us"]["p50"], 3)}
    ours, pt = _row(doc, "moe-transport", 1 << 20), _row(doc, "perftest", 1 << 20)
    if ours and pt:
        out["bw_1MiB_gbps"] = {"ours": ours["bw_gbps"], "ib_write_bw": pt["write_bw_gbps"],
                               "ratio": round(ours["bw_gbps"] / pt["write_bw_gbps"], 3)}
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python3 -m tests.rxe.bench_two_hosts", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", required=True)
    ap.add_argument("--sizes", default="64,4K,1M")
    ap.add_argument("--iters", type=int, default=1000)
    args = ap.parse_args(argv)
    base = os.path.splitext(args.json)[0]
    # loopback first, on the guest's own device, before the hosts' devices exist
    os.environ.setdefault("MOE_RDMA_DEVICE", os.environ.get("MOE_RXE_DEVICE", "rxe0"))
    loop = _bench(base + "-loopback.json", args.sizes, args.iters, None)
    with Link(("a", "b")) as link:
        a, b = link["a"], link["b"]
        os.environ["MOE_RDMA_DEVICE"] = a.device
        os.environ.pop("MOE_RDMA_IP", None)
        before = link.counters(a)
        across = _bench(base + "-link.json", args.sizes, args.iters, b.device)
        crossed = link.counters(a)["tx_bytes"] - before["tx_bytes"]
    summary = {"targets": TARGETS, "loopback": ratios(loop), "link": ratios(across),
               "link_bytes_sent_by_host_a": crossed,
               "runs": {"loopback": base + "-loopback.json", "link": base + "-link.json"},
               "provenance": across.get("provenance")}
    with open(args.json, "w") as f:
        json.dump(summary, f, indent=1)
    print(json.dumps({k: summary[k] for k in ("loopback", "link", "link_bytes_sent_by_host_a")}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
