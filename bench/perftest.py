"""perftest (rdma-core's ib_send_lat, ib_send_bw, ib_write_bw) on the device rdma:// uses,
as rows of `moe-bench transport`'s JSON (``impl`` "perftest", ``backend`` "rdma").

Each tool runs its server and client on the same device and GID (``-d DEV -i PORT -x
GID_INDEX``), the client connecting to the device's own IPv4, exactly as two moe-transport
processes do. Conventions match ours: ib_send_lat reports half the round trip (its
``t_typical`` is the median); bandwidth is perftest's average over the run, converted from
its MB/s (2**20 bytes) to GB/s (10**9 bytes).

One row per size: latency from ib_send_lat, ``bw_gbps``/``msg_rate`` from ib_send_bw (the
same operation as our small-message path), and ``write_bw_gbps`` from ib_write_bw (the
one-sided WRITE our large messages use): the rdma bandwidth target compares with it.
"""
from __future__ import annotations

import re
import shutil
import subprocess
import time
from typing import Optional

from transport.rdma_device import DeviceChoice, pick_device

TOOLS = ("ib_send_lat", "ib_send_bw", "ib_write_bw")
# "#bytes #iterations t_min t_max t_typical t_avg t_stdev 99% 99.9%" (usec); t_stdev reads
# "-nan" where perftest's variance went negative in floating point (seen at 1 MiB)
_LAT = re.compile(r"^\s*(\d+)\s+(\d+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+(-?nan|[\d.]+)"
                  r"\s+([\d.]+)\s+([\d.]+)", re.M)
# "#bytes #iterations BW peak[MB/sec] BW average[MB/sec] MsgRate[Mpps]"
_BW = re.compile(r"^\s*(\d+)\s+(\d+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)", re.M)
MB = 1 << 20  # perftest's MB/sec
_port = 18515


class PerftestError(RuntimeError):
    pass


def available() -> bool:
    return all(shutil.which(t) for t in TOOLS)


def _args(tool: str, choice: DeviceChoice, size: int, iters: int) -> list:
    return [tool, "-d", choice.device, "-i", str(choice.port), "-x", str(choice.gid_index),
            "-s", str(size), "-n", str(iters), "-p", str(_port)]


def run_tool(tool: str, size: int, iters: int, choice: DeviceChoice, timeout: float = 300,
             server: Optional[DeviceChoice] = None) -> str:
    """Run ``tool`` as server (on ``server``, default ``choice``) and client (on ``choice``,
    connecting to the server's address); the client's output."""
    global _port
    _port += 1  # a fresh port: a server of a previous run may linger in TIME_WAIT
    server_choice = server or choice
    args = _args(tool, choice, size, iters)
    srv = subprocess.Popen(_args(tool, server_choice, size, iters), stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + timeout
        while True:  # the client fails at once while the server is not listening yet
            time.sleep(0.3)
            client = subprocess.run(args + [server_choice.ipv4], capture_output=True, text=True,
                                    timeout=max(1.0, deadline - time.monotonic()))
            if client.returncode == 0:
                break
            if time.monotonic() > deadline or srv.poll() is not None:
                raise PerftestError(f"{' '.join(args)}: exit {client.returncode}: "
                                    f"{(client.stdout + client.stderr)[-400:]}")
        srv.wait(max(1.0, deadline - time.monotonic()))
        return client.stdout
    finally:
        if srv.poll() is None:
            srv.kill()
            srv.wait()


def parse_lat(out: str) -> dict:
    m = _LAT.search(out)
    if not m:
        raise PerftestError(f"no latency line in {out[-400:]!r}")
    return {"min": float(m[3]), "p50": float(m[5]), "avg": float(m[6]), "p99": float(m[8]),
            "p999": float(m[9])}


def parse_bw(out: str) -> tuple[float, float, float]:
    """(average GB/s, peak GB/s, messages/s)."""
    m = _BW.search(out)
    if not m:
        raise PerftestError(f"no bandwidth line in {out[-400:]!r}")
    return float(m[4]) * MB / 1e9, float(m[3]) * MB / 1e9, float(m[5]) * 1e6


def measure(size: int, lat_iters: int, bw_iters: int, choice: Optional[DeviceChoice] = None,
            server: Optional[DeviceChoice] = None) -> dict:
    """One `moe-bench transport` row for ``size`` bytes (``server``: the server side's device
    when it is not the client's, e.g. across a link)."""
    choice = choice or pick_device()

    def run(tool: str, iters: int) -> str:
        # once more if the pair failed to meet: under a loaded TCG guest a server sometimes
        # gives up before its client connects (ib_send_bw at 1 MiB across the two-host link)
        try:
            return run_tool(tool, size, iters, choice, server=server)
        except PerftestError:
            return run_tool(tool, size, iters, choice, server=server)

    lat = parse_lat(run("ib_send_lat", lat_iters))
    bw, peak, rate = parse_bw(run("ib_send_bw", bw_iters))
    wbw, wpeak, _ = parse_bw(run("ib_write_bw", bw_iters))
    return {"impl": "perftest", "backend": "rdma", "size": size, "lat_us": lat, "bw_gbps": bw,
            "bw_peak_gbps": peak, "msg_rate": rate, "write_bw_gbps": wbw, "write_bw_peak_gbps": wpeak,
            "iters": lat_iters, "stream_count": bw_iters, "tools": list(TOOLS),
            "device": choice.device, "gid_index": choice.gid_index,
            "server_device": (server or choice).device}
