"""Real models end to end: transformers' own MoE blocks against a real moe-gateway and real
moe-worker processes loaded from the model's save_pretrained checkpoint, over tcp and shm.

Per family (Mixtral, Qwen2-MoE with its gated shared expert, DeepSeek-V3 with sigmoid
group-limited routing and shared experts, Qwen3-MoE): every MoE layer's distributed output
equals the transformers block's (fp32: max error <= 1e-5 of the output's largest
magnitude; bf16: <= 2e-2). fp32 runs on workers the test starts (--workers, numpy kernel);
bf16 on the gateway's own local workers (--local-workers), the torch kernel for two
families and the numpy kernel for the other two, each over both backends. A tiny Mixtral and a tiny DeepSeek-V3 generate the same
greedy tokens with every MoE block served by the gateway (replace_moe_blocks(model, url))
as locally. Also: a worker that read another checkpoint is refused (at connect and at
reconnect), and a hot update takes a checkpoint layer as its new version.
"""
from __future__ import annotations

import gc
import os
import shutil
import signal
import subprocess
import sys

import numpy as np
import pytest

from tests.torch_extra import require_torch_extra

torch, transformers = require_torch_extra()

import ml_dtypes  # noqa: E402

from gateway.client import GatewayClient  # noqa: E402
from gateway.supervisor import placement  # noqa: E402
from gateway.torch_block import RemoteMoEBlock, replace_moe_blocks  # noqa: E402
from tests import hf_models as hm  # noqa: E402
from tests.helpers_procs import BACKENDS, Services, backend_problem, listen_url, wait_until  # noqa: E402
from workers.checkpoint import Checkpoint, model_spec  # noqa: E402
from workers.flags import worker_argv  # noqa: E402

pytestmark = pytest.mark.timeout(300)
torch.set_num_threads(1)

FAMILIES = ("mixtral", "qwen2_moe", "deepseek_v3", "qwen3_moe")
TOL = {"float32": 1e-5, "bfloat16": 2e-2}
T = 48
PROMPT = torch.tensor([[1, 5, 7, 9, 11, 3, 40, 41]])


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """(model, checkpoint dir) per (family, dtype, seed), built once per module."""
    cache = {}

    def get(family: str, dtype: str = "float32", seed: int = 0, where=None):
        key = (family, dtype, seed, where)
        if key not in cache:
            m = hm.model(family, dtype=getattr(torch, dtype), seed=seed)
            d = str(where or tmp_path_factory.mktemp(f"{family}-{dtype}-{seed}"))
            m.save_pretrained(d)
            cache[key] = (m, d)
        return cache[key]
    return get


def as_numpy(x: "torch.Tensor") -> np.ndarray:
    """(T, d) of a (1, T, d) tensor: float32 as it is, bf16 as ml_dtypes.bfloat16 (a view)."""
    x = x[0]
    if x.dtype == torch.bfloat16:
        return x.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return x.numpy()


def tie_tokens(blk, x, k: int) -> np.ndarray:
    """Tokens whose k-th and (k+1)-th gate logits tie exactly (bf16): transformers' choice
    there is torch.topk's unspecified order, so they are not compared (as in
    tests/test_reference_hf.py)."""
    with torch.no_grad():
        logits = blk.gate(x[0])
        logits = (logits[0] if isinstance(logits, tuple) else logits).float().numpy()
    s = -np.sort(-logits, axis=1)
    return s[:, k - 1] == s[:, k] if k < s.shape[1] else np.zeros(len(s), bool)


def rel_error(m, forward, dtype: str, top_k: int) -> float:
    """The worst max|ours - transformers| / max|transformers| over the model's MoE layers."""
    tdt = getattr(torch, dtype)
    worst = 0.0
    for L, blk in hm.moe_blocks(m).items():
        x = hm.hidden(T, seed=20 + L, dtype=tdt)
        with torch.no_grad():
            want = blk(x)[0].float().numpy()
        got = forward(as_numpy(x), L)
        assert got.shape == want.shape and str(got.dtype) == dtype
        keep = ~tie_tokens(blk, x, top_k) if dtype == "bfloat16" else np.ones(T, bool)
        assert keep.mean() > 0.9
        worst = max(worst, float(np.abs(got.astype(np.float32)[keep] - want[keep]).max() / np.abs(want).max()))
    return worst


def spec_of(d: str):
    ms = model_spec(Checkpoint(d))
    return ms, ms.layer(ms.moe_layers[0])


def start_workers(services: Services, backend: str, d: str, *, n: int = 2, extra=()) -> list:
    """``n`` moe-worker processes serving every MoE layer of checkpoint ``d``, experts
    placed as the gateway's local workers would be (shared pieces included)."""
    _, s = spec_of(d)
    out = []
    for ids in placement(s.n_experts, n, 1, s.n_shared):
        argv = worker_argv(listen_url(backend, "w"), ids, d_model=s.d_model, d_ff=s.d_ff, max_tokens=1024,
                           extra=["--checkpoint", d, *extra])
        out.append(services.start(argv))
    return out


@pytest.fixture(scope="module", params=BACKENDS)
def backend(request):
    problem = backend_problem(request.param)
    if problem:
        pytest.fail(problem)
    return request.param


@pytest.mark.parametrize("family", FAMILIES)
def test_fp32_layers_equal_transformers(saved, backend, family):
    m, d = saved(family)
    with Services() as services:
        workers = start_workers(services, backend, d)
        gw = services.gateway(backend, workers=[w.url for w in workers], checkpoint=d, max_batch_tokens=128)
        with GatewayClient(gw.url) as c:
            top_k = m.config.num_experts_per_tok
            err = rel_error(m, lambda x, L: c.forward(x, layer=L), "float32", top_k)
            assert err <= TOL["float32"], err
            pong = c.ping()
    layers = sorted(hm.moe_blocks(m))
    assert [L for L, *_ in pong["config"]["layers"]] == layers
    assert all(w["kernel"]["kernel"] == "numpy" and w["kernel"]["wire_dtype"] == "float32" for w in pong["workers"])
    # every layer's rows went to the workers: each worker hosted its ids in every layer
    assert all(sorted(L for L, _ in w["layers"]) == layers for w in pong["workers"])


@pytest.mark.parametrize("family", FAMILIES)
def test_bf16_layers_equal_transformers(saved, backend, family):
    """bf16 activations on the wire, the gateway's local workers: the torch kernel for
    Mixtral and DeepSeek-V3, numpy for the Qwens, each over both backends (both kernels
    compute in float32 on a CPU without bf16 matrix units, converting at their edges)."""
    m, d = saved(family, "bfloat16")
    compute = "torch" if family in ("mixtral", "deepseek_v3") else "numpy"
    with Services() as services:
        gw = services.gateway(backend, checkpoint=d, local_workers=2, dtype="bfloat16", compute=compute,
                              max_batch_tokens=128)
        with GatewayClient(gw.url) as c:
            err = rel_error(m, lambda x, L: c.forward(x, layer=L), "bfloat16", m.config.num_experts_per_tok)
            assert err <= TOL["bfloat16"], err
            kernels = [w["kernel"] for w in c.ping()["workers"]]
    assert all(k["kernel"] == compute and k["wire_dtype"] == "bfloat16" for k in kernels), kernels


def test_the_equality_check_can_fail(saved):
    """Another checkpoint of the same family (other weights) is far from the model."""
    m, _ = saved("mixtral")
    _, other = saved("mixtral", seed=5)
    with Services() as services:
        gw = services.gateway("tcp", checkpoint=other, local_workers=1)
        with GatewayClient(gw.url) as c:
            assert rel_error(m, lambda x, L: c.forward(x, layer=L), "float32", 2) > 0.05


def test_send_is_zero_copy_on_the_reply_and_releases(saved):
    """GatewayClient.send (the LayerClient protocol): the reply array views the reply
    message; released, it goes back at the next call. Over tcp the request went from the
    caller's memory (counted as one unregistered buffer, the kernel's copy the only one)."""
    m, d = saved("qwen2_moe")
    blk = hm.moe_blocks(m)[0]
    x = hm.hidden(T, seed=3)
    with torch.no_grad():
        want = blk(x)[0].numpy()
    with Services() as services:
        gw = services.gateway("tcp", checkpoint=d, local_workers=2)
        with GatewayClient(gw.url) as c:
            copies = c.conn.stats.copies
            reply, release = c.send(0, as_numpy(x))
            assert c.conn.stats.copies == copies + 1  # x itself went to sendmsg, no staging slot
            assert not reply.flags.owndata and reply.base is not None  # a view, not a copy
            assert np.abs(reply - want).max() / np.abs(want).max() <= TOL["float32"]
            assert c.held_replies == 1
            release()
            release()  # idempotent
            c.send(0, as_numpy(x))[1]()
            assert c.held_replies == 1  # the first one was released by this call
            c.forward(as_numpy(x), layer=0)
            assert c.held_replies == 0


@pytest.mark.parametrize("family,backend", [("mixtral", "shm"), ("deepseek_v3", "tcp")])
def test_greedy_tokens_equal_with_every_block_behind_the_gateway(saved, family, backend):
    m, d = saved(family)
    with torch.no_grad():
        local = m.generate(PROMPT, max_new_tokens=10, do_sample=False, min_new_tokens=10)
    remote_model = hm.model(family)  # the same weights (seed 0), its blocks replaced
    with Services() as services:
        gw = services.gateway(backend, checkpoint=d, local_workers=2)
        replaced = replace_moe_blocks(remote_model, gw.url)
        try:
            assert sorted(replaced) == sorted(hm.moe_blocks(m)) and not hm.moe_blocks(remote_model)
            assert all(isinstance(b, RemoteMoEBlock) for b in replaced.values())
            with torch.no_grad():
                remote = remote_model.generate(PROMPT, max_new_tokens=10, do_sample=False, min_new_tokens=10)
            assert torch.equal(remote, local), (remote.tolist(), local.tolist())
            sent = remote_model.moe_client.ping()["gateway"]["requests"]
            assert sent == len(replaced) * 10  # one request per MoE layer per forward (prefill + 9 steps)
            gc.collect()
        finally:
            remote_model.moe_client.close()


def test_a_worker_of_another_checkpoint_is_refused(saved):
    """At the first connect: the gateway does not start, and says why."""
    _, a = saved("mixtral")
    _, b = saved("mixtral", seed=5)
    with Services() as services:
        workers = start_workers(services, "tcp", a, n=1)
        argv = [sys.executable, "-m", "gateway.cli", "--listen", "tcp://127.0.0.1:0", "--workers", workers[0].url,
                "--checkpoint", b, "--connect-timeout", "5"]
        r = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    assert r.returncode == 1  # the flags are fine; the workers met at run time disagree
    assert "do not read the same checkpoint" in r.stderr and "layer 0" in r.stderr, r.stderr


def test_a_worker_back_with_another_checkpoint_is_refused(saved):
    """At a reconnect (a worker moved to a new URL): refused, reported, never served."""
    from gateway.layer import load_gateway_layers
    from gateway.pool import WorkerPool
    from gateway.worker_link import Health
    from tests.helpers_procs import secret

    _, a = saved("mixtral")
    _, b = saved("mixtral", seed=5)
    layers = load_gateway_layers(a)
    with Services() as services:
        good = start_workers(services, "tcp", a, n=1)[0]
        bad = start_workers(services, "tcp", b, n=1)[0]
        with WorkerPool([good.url], {L: g.router for L, g in layers.items()}, secret=secret(), max_batch_tokens=64,
                        fingerprints={L: g.fingerprint for L, g in layers.items()}) as pool:
            x = np.random.default_rng(0).standard_normal((8, hm.H)).astype(np.float32)
            pool.forward(x, layer=1)
            pool.workers.set_url(0, bad.url)
            w = pool.workers[0]
            assert wait_until(lambda: (pool.loop.run_once(0.05), w.state == Health.REFUSED)[1], timeout=20)
            assert "do not read the same checkpoint" in w.why
            with pytest.raises(Exception, match="no healthy worker"):
                pool.forward(x, layer=1)


def test_hot_update_to_a_checkpoint_layer(saved, tmp_path):
    """`update start --checkpoint DIR2 --layer 1`: layer 1 moves to DIR2's experts and router
    (a fine-tune), checked by fingerprint on every worker; layer 0 is untouched; a partial
    update to a layer with another router is refused."""
    m, d = saved("mixtral")
    upd = tmp_path / "updates"
    upd.mkdir()
    m2, d2 = saved("mixtral", seed=9, where=upd / "mixtral-ft")
    x = {L: hm.hidden(T, seed=30 + L) for L in (0, 1)}
    with torch.no_grad():
        want_old = {L: hm.moe_blocks(m)[L](x[L])[0].numpy() for L in (0, 1)}
        want_new = hm.moe_blocks(m2)[1](x[1])[0].numpy()

    def err(got, want):
        return np.abs(got - want).max() / np.abs(want).max()

    def update(*args):
        argv = [sys.executable, "-m", "gateway.cli", "update", "--gateway", gw.url, *args]
        return subprocess.run(argv, capture_output=True, text=True, timeout=60)

    with Services() as services:
        gw = services.gateway("tcp", checkpoint=d, local_workers=2, update_dir=str(upd))
        with GatewayClient(gw.url) as c:
            r = update("start", "--experts", "2", "--new-version", "1", "--checkpoint", d2, "--layer", "1")
            assert r.returncode == 2 and "another router" in r.stderr, r.stderr
            r = update("start", "--experts", "0-3", "--new-version", "1", "--checkpoint", d2, "--layer", "1", "--wait")
            assert r.returncode == 0, r.stderr
            assert err(c.forward(as_numpy(x[1]), layer=1), want_old[1]) <= TOL["float32"]  # 1% step: old
            assert update("advance", "--fraction", "1").returncode == 0
            assert update("finish", "--wait").returncode == 0
            assert err(c.forward(as_numpy(x[1]), layer=1), want_new) <= TOL["float32"]
            assert err(c.forward(as_numpy(x[0]), layer=0), want_old[0]) <= TOL["float32"]
            st = c.update("status")
            assert st["state"] == "done" and st["layer"] == 1 and st["new_router"] is True
            versions = {(v[3] if len(v) > 3 else 0, v[0]): v[1] for w in c.ping()["workers"] for v in w["versions"]}
            assert {k: v for k, v in versions.items() if k[0] == 1} == {(1, e): 1 for e in range(4)}
            assert {k: v for k, v in versions.items() if k[0] == 0} == {(0, e): 0 for e in range(4)}
            # a local worker respawned from its start-up checkpoint is brought to layer 1's version 1
            # (loaded from DIR2, its fingerprint checked) before it answers again
            pid = c.ping()["workers"][0]["pid"]
            os.kill(pid, signal.SIGKILL)
            assert wait_until(lambda: (lambda w: w["state"] == "healthy" and w["pid"] != pid)(
                c.ping()["workers"][0]), timeout=60, interval=0.1)
            assert err(c.forward(as_numpy(x[1]), layer=1), want_new) <= TOL["float32"]
            assert err(c.forward(as_numpy(x[0]), layer=0), want_old[0]) <= TOL["float32"]
            assert set(c.last_expert_versions.values()) == {0}
            pong = c.ping()
            assert pong["admission"]["synced"] >= 1
            assert [e for e, v, held, *L in pong["workers"][0]["versions"] if L == [1] and (v, held) == (1, [1])]
    shutil.rmtree(upd, ignore_errors=True)


def test_a_worker_refuses_a_checkpoint_version_of_another_fingerprint(saved, tmp_path):
    """The worker's own check: a load whose fingerprint is not the checkpoint layer's fails."""
    import transport
    from tests.helpers_procs import secret
    from workers import protocol as P

    _, d = saved("mixtral")
    upd = tmp_path / "u"
    shutil.copytree(d, upd / "ck")
    with Services() as services:
        w = start_workers(services, "tcp", d, n=1, extra=["--update-dir", str(upd), "--layers", "1"])[0]
        with transport.connect(w.url, timeout=10, secret=secret()) as conn:
            conn.send(P.request(P.LOAD, 7, expert=1, layer=1, version=1, checkpoint=str(upd / "ck"),
                                fingerprint="0" * 64))
            with conn.recv(timeout=30) as msg:
                h = msg.header
    assert h["op"] == P.ERROR and h["code"] == P.LOAD_FAILED and "not read the same checkpoint" in h["message"]


def test_info_and_metrics_report_the_kernel(saved):
    """A worker's info and /metrics (its collector) name its kernel and dtypes."""
    from workers.daemon import WorkerDaemon
    from workers.loading import checkpoint_experts
    from workers.metrics import worker_families

    _, d = saved("deepseek_v3", "bfloat16")
    served = checkpoint_experts(d, None, [0, 8], kind="numpy", wire="bfloat16", max_tokens=16)
    daemon = WorkerDaemon(served.experts, "tcp://127.0.0.1:0", fingerprints=served.fingerprints,
                          checkpoint=served.checkpoint)
    try:
        info = daemon.info(1)
        assert info["dtype"] == "bfloat16" and info["kernel"]["wire_dtype"] == "bfloat16"
        assert info["kernel"]["kernel"] == "numpy" and info["kernel"]["dtype"] == "float32"
        assert [(L, ids) for L, ids, _ in info["layers"]] == [(1, [0, 8]), (2, [0, 8])]
        assert all(isinstance(fp, str) and len(fp) == 64 for *_, fp in info["layers"])
        fams = {f.name: f for f in worker_families(daemon)}
        (sample,) = fams["moe_worker_kernel_info"].samples
        assert sample.labels["kernel"] == "numpy" and sample.labels["wire_dtype"] == "bfloat16"
        assert {(s.labels["layer"], s.labels["expert"]) for s in fams["moe_expert_tokens"].samples} == \
            {("1", "0"), ("1", "8"), ("2", "0"), ("2", "8")}
    finally:
        daemon.loop.close()
