"""The conformance kit (transport/testing/conformance.py) on the in-host backends.

Every check runs on every backend. A backend whose module cannot be imported FAILS its
cases (it is part of the product), it is never skipped. The rdma backend runs the same
kit from tests/rdma/ inside the rxe VM.
"""
import importlib
import uuid

import pytest

from transport.testing import conformance

BACKENDS = {
    "tcp": dict(url_factory=lambda: "tcp://127.0.0.1:0"),
    "shm": dict(url_factory=lambda: f"shm://moe-test-{uuid.uuid4().hex[:12]}",
                shares_sender_memory=True, leak_dirs=("/dev/shm",)),
}


@pytest.fixture(params=list(BACKENDS))
def env(request):
    name = request.param
    importlib.import_module(f"transport.{name}")  # ImportError -> the case fails, loudly
    with conformance.PairEnv(name=name, **BACKENDS[name]) as env:
        yield env


@pytest.mark.timeout(60)
@pytest.mark.parametrize("check", conformance.CHECKS, ids=conformance.check_ids())
def test_conformance(env, check):
    check(env)


def test_kit_api_is_stable():
    """What tests/rdma and transport/shm's author rely on."""
    assert callable(conformance.run_check)
    assert len(conformance.CHECKS) == len(set(conformance.check_ids()))
    for c in conformance.CHECKS:
        assert c.__name__.startswith("check_") and c.__doc__
