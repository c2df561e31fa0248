"""Session-wide test set-up: one shared secret for every service and client a test starts.

Services are authenticated by default (a worker or gateway given a secret refuses peers that
cannot prove it), so the tests run the way users do: with a secret file, found by every
process through MOE_SECRET_FILE. Tests that check the unauthenticated paths clear it.
"""
from __future__ import annotations

import os

import pytest


@pytest.fixture(scope="session", autouse=True)
def shared_secret(tmp_path_factory):
    path = tmp_path_factory.mktemp("secret") / "secret"
    path.write_text("test-secret-" + os.urandom(8).hex() + "\n")
    path.chmod(0o600)
    old = os.environ.get("MOE_SECRET_FILE")
    os.environ["MOE_SECRET_FILE"] = str(path)
    yield path.read_bytes().strip()
    if old is None:
        os.environ.pop("MOE_SECRET_FILE", None)
    else:
        os.environ["MOE_SECRET_FILE"] = old
