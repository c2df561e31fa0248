"""A live move of an expert copy over rdma://: real moe-worker processes and a real
moe-gateway on the rxe device. Expert 3 moves from worker 0 to worker 1 (loaded there from
the served seed, switched at a round boundary, dropped from worker 0), and answers before,
during and after equal the in-process reference."""
from __future__ import annotations

import os
import time

import numpy as np
import pytest

from gateway.client import GatewayClient
from gateway.reference import ReferenceMoE
from tests.helpers_procs import Services, wait_until

pytestmark = [pytest.mark.rdma, pytest.mark.timeout(600)]

D, F, E, K, SEED = 16, 32, 8, 2, 9


def test_a_copy_moves_between_rdma_workers_while_answers_stay_right(rdma_device):
    from transport.rdma_device import pick_device

    os.environ.setdefault("MOE_RDMA_IP", pick_device().ipv4)
    ref = ReferenceMoE.from_seed(D, F, E, K, seed=SEED)
    rng = np.random.default_rng(0)
    with Services() as s:
        workers = [s.worker("rdma", ex, d_model=D, d_ff=F, seed=SEED, max_tokens=128, extra=["--max-experts", "6"])
                   for ex in ([0, 1, 2, 3], [4, 5, 6, 7])]
        assert all(w.url.startswith("rdma://") for w in workers)
        gw = s.gateway("rdma", workers=[w.url for w in workers], d_model=D, d_ff=F, n_experts=E, top_k=K, seed=SEED,
                       max_batch_tokens=64, max_wait_ms=0, timeout=120)
        with GatewayClient(gw.url, timeout=60.0) as c:
            def check(n):
                x = rng.standard_normal((n, D)).astype(np.float32)
                np.testing.assert_allclose(c.forward(x), ref.forward(x)[0], rtol=1e-4, atol=1e-5)

            check(24)
            doc = c.placement("show")
            copies = doc["layers"]["0"]["copies"]
            copies["3"] = [1]
            st = c.placement("load", placement={"layers": {"0": {"copies": copies}}})
            assert st["adds"] == [[0, 3, 1]] and st["removes"] == [[0, 3, 0]], st
            deadline = time.monotonic() + 120
            while c.placement("show")["rebalancer"]["move"]["state"] != "done" and time.monotonic() < deadline:
                check(8)
            after = c.placement("show")
            assert after["version"] == 2 and after["layers"]["0"]["copies"]["3"] == [1], after
            assert wait_until(lambda: c.ping()["workers"][0]["experts"] == [0, 1, 2], timeout=60)
            assert c.ping()["workers"][1]["experts"] == [3, 4, 5, 6, 7]
            for n in (1, 17, 64):
                check(n)
            assert c.ping()["gateway"]["failed_requests"] == 0
