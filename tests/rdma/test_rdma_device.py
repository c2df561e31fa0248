"""Device and GID selection (transport/rdma_device.py) on a fake sysfs tree: needs no device."""
from __future__ import annotations

import pytest

from transport.errors import TransportError
from transport.rdma_device import gid_ipv4, pick_device

V4 = "0000:0000:0000:0000:0000:ffff:"


def v4gid(ip: str) -> str:
    a, b, c, d = (int(x) for x in ip.split("."))
    return V4 + f"{a:02x}{b:02x}:{c:02x}{d:02x}"


def make_dev(root, name, ports):
    """ports: {port: (state, [(gid, type) or None, ...])}"""
    for port, (state, gids) in ports.items():
        pdir = root / name / "ports" / str(port)
        (pdir / "gids").mkdir(parents=True)
        (pdir / "gid_attrs" / "types").mkdir(parents=True)
        (pdir / "state").write_text(state + "\n")
        for i, g in enumerate(gids):
            (pdir / "gids" / str(i)).write_text((g[0] if g else "0000:" * 7 + "0000") + "\n")
            if g:
                (pdir / "gid_attrs" / "types" / str(i)).write_text(g[1] + "\n")


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    monkeypatch.delenv("MOE_RDMA_DEVICE", raising=False)
    monkeypatch.delenv("MOE_RDMA_GID_INDEX", raising=False)


def test_gid_ipv4():
    assert gid_ipv4(v4gid("10.0.2.15")) == "10.0.2.15"
    assert gid_ipv4("fe80:0000:0000:0000:5054:00ff:fe12:3456") is None


def test_first_roce_v2_ipv4_gid_of_an_active_port(tmp_path):
    link_local = ("fe80:0000:0000:0000:5054:00ff:fe12:3456", "RoCE v2")
    make_dev(tmp_path, "mlx0", {1: ("1: DOWN", [(v4gid("10.9.9.9"), "RoCE v2")])})
    make_dev(tmp_path, "rxe0", {1: ("4: ACTIVE", [link_local, (v4gid("10.0.2.15"), "IB/RoCE v1"),
                                                  None, (v4gid("10.0.2.15"), "RoCE v2")])})
    c = pick_device(sysfs=str(tmp_path))
    assert (c.device, c.port, c.gid_index, c.ipv4, c.roce_v2) == ("rxe0", 1, 3, "10.0.2.15", True)


def test_prefers_the_gid_of_the_endpoint_ip(tmp_path):
    make_dev(tmp_path, "rxe0", {1: ("4: ACTIVE", [(v4gid("10.0.2.15"), "RoCE v2"),
                                                  (v4gid("192.168.7.2"), "RoCE v2")])})
    make_dev(tmp_path, "rxe1", {1: ("4: ACTIVE", [(v4gid("172.16.0.1"), "RoCE v2")])})
    assert pick_device("192.168.7.2", sysfs=str(tmp_path)).gid_index == 1
    assert pick_device("172.16.0.1", sysfs=str(tmp_path)).device == "rxe1"
    assert pick_device("8.8.8.8", sysfs=str(tmp_path)).gid_index == 0  # no match: the first


def test_overrides_by_option_and_environment(tmp_path, monkeypatch):
    make_dev(tmp_path, "rxe0", {1: ("4: ACTIVE", [(v4gid("10.0.2.15"), "RoCE v2")])})
    make_dev(tmp_path, "rxe1", {1: ("4: ACTIVE", [("fe80:0000:0000:0000:0000:0000:0000:0001", "RoCE v2"),
                                                  (v4gid("10.0.3.1"), "RoCE v2")])})
    assert pick_device(device="rxe1", sysfs=str(tmp_path)).gid_index == 1
    monkeypatch.setenv("MOE_RDMA_DEVICE", "rxe1")
    assert pick_device(sysfs=str(tmp_path)).device == "rxe1"
    monkeypatch.setenv("MOE_RDMA_GID_INDEX", "0")
    c = pick_device(sysfs=str(tmp_path))
    assert (c.device, c.gid_index, c.ipv4) == ("rxe1", 0, None)  # an explicit index is obeyed
    assert pick_device(device="rxe0", gid_index=0, sysfs=str(tmp_path)).device == "rxe0"  # options win


@pytest.mark.parametrize("case", ["no devices", "unknown device", "inactive", "no roce v2",
                                  "empty index", "bad env"])
def test_clear_errors(tmp_path, monkeypatch, case):
    if case != "no devices":
        make_dev(tmp_path, "rxe0", {1: ("1: DOWN" if case == "inactive" else "4: ACTIVE",
                                        [(v4gid("10.0.2.15"), "IB/RoCE v1" if case == "no roce v2" else "RoCE v2"),
                                         None])})
    kwargs = {}
    if case == "unknown device":
        kwargs["device"] = "nosuch0"
    if case == "empty index":
        kwargs["gid_index"] = 1
    if case == "bad env":
        monkeypatch.setenv("MOE_RDMA_GID_INDEX", "one")
    with pytest.raises(TransportError) as err:
        pick_device(sysfs=str(tmp_path), **kwargs)
    want = {"no devices": "no RDMA device", "unknown device": "nosuch0", "inactive": "inactive ports: rxe0/1",
            "no roce v2": "RoCE v2", "empty index": "GID index 1", "bad env": "MOE_RDMA_GID_INDEX"}[case]
    assert want in str(err.value)


def test_no_device_is_a_clear_transport_error(tmp_path, monkeypatch):
    """Without an RDMA device (the host), listen and connect say so, before any socket."""
    import transport
    from transport import rdma_device
    monkeypatch.setattr(rdma_device, "IB_SYSFS", str(tmp_path / "none"))
    for url in ("rdma://127.0.0.1:0", "rdma://127.0.0.1:9"):
        fn = transport.listen if url.endswith(":0") else transport.connect
        with pytest.raises(TransportError, match="no RDMA device|pyverbs"):
            fn(url)
