"""rdma://'s device watch (transport/rdma_watch.py) without a device: a fake sysfs tree and a
directory of fake nodes, watched with the real inotify."""
from __future__ import annotations

import os
import select
import struct

from transport.rdma_watch import IN_DELETE, DeviceWatch, parse_events, uverbs_node


def _tree(tmp_path, devices=("rxa", "rxb")):
    sysfs, dev = tmp_path / "sysfs", tmp_path / "dev"
    dev.mkdir()
    for i, name in enumerate(devices):
        (sysfs / f"uverbs{i}").mkdir(parents=True)
        (sysfs / f"uverbs{i}" / "ibdev").write_text(name + "\n")
        (dev / f"uverbs{i}").write_text("")
    (sysfs / "abi_version").parent.mkdir(exist_ok=True)
    (sysfs / "abi_version").write_text("6\n")
    return str(sysfs), str(dev)


def test_the_verbs_node_of_a_device_is_found_by_its_ibdev(tmp_path):
    sysfs, _ = _tree(tmp_path)
    assert uverbs_node("rxb", sysfs) == "uverbs1"
    assert uverbs_node("rxa", sysfs) == "uverbs0"
    assert uverbs_node("mlx5_0", sysfs) is None
    assert uverbs_node("rxa", str(tmp_path / "missing")) is None


def test_events_are_parsed_with_their_padded_names():
    data = struct.pack("iIII", 1, IN_DELETE, 0, 16) + b"uverbs2".ljust(16, b"\0")
    data += struct.pack("iIII", 1, 0x100, 0, 0)
    assert parse_events(data) == [(IN_DELETE, "uverbs2"), (0x100, "")]


def test_the_watch_fires_for_its_own_node_only(tmp_path):
    sysfs, dev = _tree(tmp_path)
    w = DeviceWatch.open("rxb", dev_dir=dev, sysfs=sysfs)
    assert w is not None and w.node == "uverbs1"
    try:
        p = select.poll()
        p.register(w.fileno(), select.POLLIN)
        assert p.poll(0) == [] and not w.removed()
        os.unlink(os.path.join(dev, "uverbs0"))  # another device goes: readable, but not ours
        assert p.poll(1000) and not w.removed()
        assert p.poll(0) == []  # drained
        os.unlink(os.path.join(dev, "uverbs1"))
        assert p.poll(1000) and w.removed()
        assert w.removed()  # stays removed
    finally:
        w.close()
    assert w.fd == -1


def test_a_node_already_gone_is_removed_and_an_unknown_device_is_not_watched(tmp_path):
    sysfs, dev = _tree(tmp_path)
    os.unlink(os.path.join(dev, "uverbs1"))
    w = DeviceWatch.open("rxb", dev_dir=dev, sysfs=sysfs)
    try:
        assert w.removed()
    finally:
        w.close()
    assert DeviceWatch.open("nosuch", dev_dir=dev, sysfs=sysfs) is None
