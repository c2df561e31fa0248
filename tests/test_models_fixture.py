"""The rdma guest's real-model check (tests/models_fixture.py), run on the host over tcp:
the fixture transformers writes is complete and the guest's comparison passes on it, so a
failure in the guest is rdma's, not the fixture's or the check's."""
import json

import numpy as np
import pytest

from tests.torch_extra import require_torch_extra

require_torch_extra()

from tests import models_fixture as mf  # noqa: E402

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def fixture_root(tmp_path_factory):
    return mf.write(tmp_path_factory.mktemp("rdma-models") / "models")


def test_fixture_has_every_case_and_layer(fixture_root):
    for case, (family, dtype) in mf.CASES.items():
        meta = json.loads((fixture_root / case / "case.json").read_text())
        assert (meta["family"], meta["dtype"]) == (family, dtype) and meta["layers"]
        assert (fixture_root / case / "checkpoint" / "config.json").exists()
        for L in meta["layers"]:
            with np.load(fixture_root / case / f"layer{L}.npz") as z:
                assert z["x"].dtype == (np.uint16 if dtype == "bfloat16" else np.float32)
                assert z["y"].shape == (mf.TOKENS, z["x"].shape[1]) and np.abs(z["y"]).max() > 0


@pytest.mark.parametrize("case", list(mf.CASES))
def test_the_guest_check_passes_over_tcp(fixture_root, case):
    assert mf.check_case(fixture_root / case, "tcp") <= mf.TOL[mf.CASES[case][1]]


def test_the_guest_check_can_fail(fixture_root, tmp_path):
    """Outputs of another layer make the check fail."""
    import shutil
    case = tmp_path / "swapped"
    shutil.copytree(fixture_root / "deepseek_v3-float32", case)
    a, b = (case / f"layer{L}.npz" for L in json.loads((case / "case.json").read_text())["layers"][:2])
    a_bytes = a.read_bytes()
    a.write_bytes(b.read_bytes())
    b.write_bytes(a_bytes)
    with pytest.raises(AssertionError):
        mf.check_case(case, "tcp")
