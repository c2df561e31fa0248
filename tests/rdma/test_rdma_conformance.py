"""The conformance kit (transport/testing/conformance.py) on rdma:// over the rxe device.

Runs in the soft-RoCE guest (`python -m tests.rxe.vm test -- tests/rdma`); on a host without
an RDMA device the `rdma_device` fixture skips it.
"""
import pytest

from transport.testing import conformance


# "rdma" takes the compiled fast path (transport/_rdmafast.c) where it is built (`make test`
# requires it), "rdma-python" the Python path on both ends
PATHS = {"rdma": {}, "rdma-python": {"native": False}}


@pytest.fixture(params=list(PATHS))
def env(rdma_device, request):
    from transport.rdma_device import pick_device
    ip = pick_device().ipv4
    # TCG guest: every time bound gets more slack than on a host
    with conformance.PairEnv(lambda: f"rdma://{ip}:0", name=request.param, options=PATHS[request.param],
                             slack=2.0) as env:
        yield env


@pytest.mark.rdma
@pytest.mark.timeout(240)
@pytest.mark.parametrize("check", conformance.CHECKS, ids=conformance.check_ids())
def test_conformance(env, check):
    check(env)
