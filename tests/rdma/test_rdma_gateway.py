"""End to end over rdma://: real moe-worker processes and a real moe-gateway process, all
connected by RC queue pairs on the rxe device, equal the in-process reference.

The cases are tests/test_distributed_equality.py's own (imported, so one definition), with
its `backend` fixture replaced by an rdma one. Every Python start costs seconds under the
guest's TCG emulation, so this runs a representative subset: uniform top-2, skewed routing
onto a replicated hot expert, capacity overflow with spill, requests sharing a round, the
split of a hot expert over replicas, and the pool driven in-process; whole parts and chunked
(pipelined) rounds.
"""
from __future__ import annotations

import pytest

from tests import test_distributed_equality as eq
from tests.helpers_procs import Services
from tests.test_distributed_equality import (  # noqa: F401  (collected here, on rdma)
    test_a_hot_replicated_expert_is_split_over_its_replicas,
    test_pool_in_process_equals_reference,
    test_requests_batched_together_each_equal_the_reference,
)

pytestmark = [pytest.mark.rdma, pytest.mark.timeout(600)]

SUBSET = ["top2", "top2-zipf-replicated-hot", "top4-skewed-capacity-spill"]


@pytest.fixture(scope="module")
def backend(rdma_device):
    import os

    from transport.rdma_device import pick_device
    os.environ.setdefault("MOE_RDMA_IP", pick_device().ipv4)
    with Services() as services:
        b = eq.Backend(services, "rdma")
        assert all(url.startswith("rdma://") for url in b.urls)
        yield b


@pytest.mark.parametrize("name, chunk_rows", [(n, "auto") for n in SUBSET] + [("top2-zipf-replicated-hot", "7")])
def test_gateway_equals_reference_over_rdma(backend, name, chunk_rows):
    eq.test_gateway_equals_reference(backend, name, chunk_rows)
