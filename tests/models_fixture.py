"""The real-model fixture the rdma guest checks against: made on the host, read in the guest.

The rxe guest has Debian's packages only (numpy, no torch): it cannot run transformers. So
the host builds tiny random models with transformers, saves each as a checkpoint
(``save_pretrained``) and records, per MoE layer, an input and the transformers block's
output; the guest (tests/rdma/test_rdma_models.py) serves the checkpoint over rdma:// with
``--compute numpy`` and compares. The checkout is mounted in the guest, so the fixture is
written inside it, under ``build/rdma-models`` (ignored by git; ``make test`` and ``make
test-rdma`` write it before they boot the guest):

    python -m tests.models_fixture [DIR]

Layout: ``DIR/<case>/checkpoint/`` (config.json, model.safetensors), ``DIR/<case>/layer<L>.npz``
(x: the input, bf16 as uint16 bits; y: transformers' output in float32; keep: the tokens
compared, i.e. not those whose k-th and (k+1)-th gate logits tie exactly in bf16, where
transformers' choice is torch.topk's unspecified order), ``DIR/<case>/case.json``.

``check_case`` is the comparison itself, numpy only, run by the guest over rdma and by a
host test over tcp (tests/test_models_fixture.py), so both run the same code.
"""
from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Optional

import numpy as np

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_DIR = REPO_ROOT / "build" / "rdma-models"
# case -> (family, dtype): DeepSeek-V3's sigmoid, group-limited routing with shared experts
# in float32; Qwen2-MoE's softmax with a gated shared expert in bf16 (in the guest, bf16
# travels as uint16 bits: no ml_dtypes there)
CASES = {"deepseek_v3-float32": ("deepseek_v3", "float32"), "qwen2_moe-bfloat16": ("qwen2_moe", "bfloat16")}
TOL = {"float32": 1e-5, "bfloat16": 2e-2}
TOKENS = 32


def fixture_dir() -> Path:
    return Path(os.environ.get("MOE_MODELS_FIXTURE") or DEFAULT_DIR)


def write(root: Optional[Path] = None) -> Path:
    """Build every case with transformers (host only: needs the [torch] extra)."""
    import torch

    from tests import hf_models as hm

    root = Path(root or fixture_dir())
    root.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".rdma-models-", dir=root.parent))
    try:
        for case, (family, dtype) in CASES.items():
            tdt = getattr(torch, dtype)
            m = hm.model(family, dtype=tdt)
            d = tmp / case
            m.save_pretrained(str(d / "checkpoint"))
            layers = []
            for L, blk in hm.moe_blocks(m).items():
                x = hm.hidden(TOKENS, seed=40 + L, dtype=tdt)
                with torch.no_grad():
                    y = blk(x)[0].float().numpy()
                    logits = blk.gate(x[0])
                logits = (logits[0] if isinstance(logits, tuple) else logits).float().numpy()
                k = m.config.num_experts_per_tok
                s = -np.sort(-logits, axis=1)
                keep = ~(s[:, k - 1] == s[:, k]) if dtype == "bfloat16" else np.ones(TOKENS, bool)
                xs = x[0].view(torch.int16).numpy().view(np.uint16) if dtype == "bfloat16" else x[0].numpy()
                np.savez(d / f"layer{L}.npz", x=xs, y=y, keep=keep)
                layers.append(L)
            (d / "case.json").write_text(json.dumps({"family": family, "dtype": dtype, "layers": layers,
                                                     "transformers": __import__("transformers").__version__}))
        # readable by every user: the two-host tests' workers run as their hosts' users
        # (mkdtemp makes 0700, safetensors writes 0600)
        for dirpath, _, files in os.walk(tmp):
            os.chmod(dirpath, 0o755)
            for f in files:
                os.chmod(os.path.join(dirpath, f), 0o644)
        if root.exists():
            shutil.rmtree(root)
        os.replace(tmp, root)  # whole or not at all: a guest never reads a half-written fixture
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return root


def check_case(case_dir: Path, backend: str, timeout: float = 120.0) -> float:
    """Serve ``case_dir``'s checkpoint (2 moe-worker processes with the numpy kernel, placed
    as a gateway's local workers are, and a moe-gateway, over ``backend``) and return the
    worst error against transformers' outputs, relative to the output's largest magnitude,
    over every MoE layer (asserting each within tolerance). ``timeout`` bounds each start
    (seconds: a Python start costs seconds in the TCG guest) and each request."""
    from gateway.supervisor import placement
    from tests.helpers_procs import Services, listen_url
    from workers.checkpoint import Checkpoint, model_spec
    from workers.flags import worker_argv

    meta = json.loads((case_dir / "case.json").read_text())
    dtype = meta["dtype"]
    ckpt = str(case_dir / "checkpoint")
    spec = model_spec(Checkpoint(ckpt)).layer(meta["layers"][0])
    with Services() as services:
        urls = []
        for ids in placement(spec.n_experts, 2, 1, spec.n_shared):
            argv = worker_argv(listen_url(backend, "w"), ids, d_model=spec.d_model, d_ff=spec.d_ff, dtype=dtype,
                               max_tokens=64 * (spec.routing.top_k + spec.n_shared),
                               extra=["--checkpoint", ckpt, "--compute", "numpy"])
            urls.append(services.start(argv, timeout=timeout).url)
        gw = services.gateway(backend, workers=urls, checkpoint=ckpt, dtype=dtype, max_batch_tokens=64,
                              connect_timeout=timeout, timeout=timeout)
        worst, workers = compare_layers(gw.url, case_dir, timeout)
    urls = [w["url"] for w in workers]
    assert len(urls) == 2 and all(u.startswith(backend + "://") for u in urls), urls
    assert all(w["kernel"]["kernel"] == "numpy" and w["kernel"]["wire_dtype"] == dtype for w in workers)
    return worst


def compare_layers(url: str, case_dir: Path, timeout: float = 120.0) -> tuple[float, list]:
    """Every MoE layer of ``case_dir`` through the gateway at ``url`` against transformers'
    outputs (each asserted within tolerance): the worst relative error, and the gateway's
    workers as its ping lists them."""
    from gateway.client import GatewayClient
    from workers import bf16

    meta = json.loads((case_dir / "case.json").read_text())
    dtype = meta["dtype"]
    worst = 0.0
    with GatewayClient(url, timeout=timeout) as c:
        for L in meta["layers"]:
            with np.load(case_dir / f"layer{L}.npz") as z:
                x, want, keep = z["x"], z["y"], z["keep"]
            if dtype == "bfloat16":
                x = x.view(bf16.wire_dtype("bfloat16"))  # ml_dtypes where installed, else the bits
            got = c.forward(x, layer=L)
            assert got.shape == want.shape and bf16.dtype_name(got.dtype) == dtype
            got = bf16.to_float32(got) if dtype == "bfloat16" else got
            err = float(np.abs(got[keep] - want[keep]).max() / np.abs(want).max())
            assert keep.mean() > 0.9 and err <= TOL[dtype], (case_dir.name, L, err)
            worst = max(worst, err)
        workers = c.ping()["workers"]
    return worst, workers


if __name__ == "__main__":
    out = write(Path(sys.argv[1]) if len(sys.argv) > 1 else None)
    print(f"wrote {out}: {', '.join(CASES)}")
