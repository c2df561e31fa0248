"""RDMA test fixtures. These tests need a real RDMA device: on a host without one
they skip; `python -m tests.rxe.vm test -- tests/rdma` runs them in a qemu guest
with a soft-RoCE (rxe) device, where skips count as failures."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

IB_SYSFS = Path("/sys/class/infiniband")
# ::ffff:a.b.c.d as the kernel prints it in gids/<idx>
IPV4_MAPPED_PREFIX = "0000:0000:0000:0000:0000:ffff:"


def _devices() -> list[str]:
    try:
        return sorted(os.listdir(IB_SYSFS))
    except OSError:
        return []


def rdma_device_available() -> bool:
    """True when an RDMA device exists and pyverbs can open it."""
    devs = _devices()
    if not devs:
        return False
    try:
        from pyverbs.device import Context
        with Context(name=devs[0]) as ctx:
            ctx.query_device()
    except Exception:
        return False
    return True


def roce_v2_ipv4_gid_index(dev: str, port: int = 1) -> int | None:
    """Index of the RoCE v2 GID that maps an IPv4 address, or None."""
    pdir = IB_SYSFS / dev / "ports" / str(port)
    try:
        names = sorted(os.listdir(pdir / "gids"), key=int)
    except OSError:
        return None
    for name in names:
        try:
            gid = (pdir / "gids" / name).read_text().strip()
            typ = (pdir / "gid_attrs" / "types" / name).read_text().strip()
        except OSError:  # unpopulated entries raise EINVAL on read
            continue
        if gid.startswith(IPV4_MAPPED_PREFIX) and typ == "RoCE v2":
            return int(name)
    return None


@pytest.fixture(scope="session")
def rdma_device() -> tuple[str, int, int]:
    """(device name, port number, RoCE v2 IPv4 GID index)."""
    devs = _devices()
    if not devs:
        pytest.skip("no RDMA device (/sys/class/infiniband is empty or missing); "
                    "run `python -m tests.rxe.vm test -- tests/rdma` to use a soft-RoCE guest")
    if not rdma_device_available():
        pytest.skip(f"RDMA device {devs[0]} exists but pyverbs cannot open it")
    dev = os.environ.get("MOE_RXE_DEVICE") or devs[0]
    port = int(os.environ.get("MOE_RXE_PORT", "1"))
    idx = roce_v2_ipv4_gid_index(dev, port)
    if idx is None:
        pytest.skip(f"{dev} port {port} has no RoCE v2 IPv4 GID")
    return dev, port, idx


@pytest.fixture
def ip(rdma_device) -> str:
    """The IPv4 address of the device's RoCE v2 GID: where rdma:// endpoints listen."""
    from transport.rdma_device import pick_device
    return pick_device().ipv4


@pytest.fixture
def make_pair(ip):
    """make_pair(listener=None, native=None, server_native=None, **options) -> (client,
    server): ``native`` is the client's, ``server_native`` the listener's (when it makes
    one). Everything is closed at the end, and then nothing this process registered may be
    left."""
    import threading

    import transport
    from transport.rdma import live_resources
    made = []

    def make(listener=None, native=None, server_native=None, **opts):
        opts.setdefault("timeout", 20)
        lst = listener or transport.listen(f"rdma://{ip}:0", native=server_native, **opts)
        if listener is None:
            made.append(lst)
        box = {}
        t = threading.Thread(target=lambda: box.setdefault("c", transport.connect(lst.url, native=native, **opts)))
        t.start()
        try:
            s = lst.accept(timeout=60)
        finally:
            t.join(60)
        made.extend([box["c"], s])
        return box["c"], s

    yield make
    for x in reversed(made):
        x.close()
    assert live_resources() == {}
