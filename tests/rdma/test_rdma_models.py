"""Real models over rdma://: a moe-gateway and its moe-workers (numpy kernel) serve checkpoints
transformers saved, on the rxe device, and every MoE layer equals transformers' own block.

The guest has no torch: the host wrote the checkpoints and transformers' outputs under
build/rdma-models in the checkout (``python -m tests.models_fixture``; ``make test`` and
``make test-rdma`` do it before booting the guest), which the guest sees mounted. The
comparison is tests/models_fixture.check_case, the same code a host test runs over tcp.
"""
from __future__ import annotations

import os

import pytest

from tests import models_fixture as mf

pytestmark = [pytest.mark.rdma, pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def rdma_ip(rdma_device):
    from transport.rdma_device import pick_device
    ip = pick_device().ipv4
    os.environ.setdefault("MOE_RDMA_IP", ip)  # test URLs and the gateway's local workers bind here
    return ip


@pytest.mark.parametrize("case", list(mf.CASES))
def test_checkpoint_layers_over_rdma_equal_transformers(rdma_ip, case):
    d = mf.fixture_dir() / case
    if not (d / "case.json").exists():
        pytest.fail(f"no fixture at {d}: run `python -m tests.models_fixture` on the host first "
                    f"(make test and make test-rdma do)", pytrace=False)
    # every Python start costs seconds under TCG
    assert mf.check_case(d, "rdma", timeout=300) <= mf.TOL[mf.CASES[case][1]]
