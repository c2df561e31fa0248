"""Every answer of a load run checked against the reference layer, after the clock stops.

A client thread keeps each answer as it comes (its token-bank rows, the output, and the
expert versions the gateway says computed it); :meth:`AnswerLog.verify` then computes the
reference for all of them at once, outside the timed run, so checking costs the measured
system no CPU. An answer is *wrong* when any of its rows differs from the reference layer
at the versions it names (or it does not name every expert its rows use). Past
``max_bytes`` of kept outputs the rest are counted, not kept (said in the verdict).

Only the plain router is checked: noisy gating, a capacity factor or gate bias make the
gateway's routing something the reference does not redo.
"""
from __future__ import annotations

import threading
from typing import Any, Optional

import numpy as np

from bench.versioned import VersionedReference

MAX_BYTES = 1 << 30  # outputs kept for checking at most (1 GiB)
CHUNK_ROWS = 4096  # rows per reference forward when checking
TOL = dict(rtol=1e-4, atol=1e-5)


def why_unchecked(args) -> Optional[str]:
    """None when this run's answers can be checked, else why not."""
    if getattr(args, "gateway", None):
        return "a running --gateway: its weights are not known here"
    if getattr(args, "noisy", False) or getattr(args, "capacity_factor", None) or getattr(args, "gate_bias", None):
        return "noisy gating, a capacity factor or gate bias: the reference does not redo that routing"
    if getattr(args, "dtype", "float32") != "float32":
        return "only float32 answers are checked"
    return None


class AnswerLog:
    """The answers of one system's run; ``answer`` is called from the client threads."""

    def __init__(self, max_bytes: int = MAX_BYTES) -> None:
        self._lock = threading.Lock()
        self._kept: list = []  # (bank rows, output, versions)
        self._bytes = 0
        self.max_bytes = max_bytes
        self.unkept = 0

    def answer(self, idx: np.ndarray, y: np.ndarray, client: Any) -> None:
        versions = getattr(client, "last_expert_versions", None)
        with self._lock:
            if self._bytes + y.nbytes > self.max_bytes:
                self.unkept += 1
                return
            self._bytes += y.nbytes
            self._kept.append((np.array(idx, copy=True), y, None if versions is None else dict(versions)))

    def __len__(self) -> int:
        return len(self._kept)

    def verify(self, bank, d_ff: int, seed: int, router) -> dict:
        """{"checked", "wrong", "unnamed", "unkept", "examples"}: the kept answers against the
        reference layer (experts from ``seed`` at the versions each answer names); an answer
        naming no versions, or of the wrong shape, is wrong (and counted in ``unnamed``)."""
        ref = VersionedReference(router.d_model, d_ff, router.n_experts, router.top_k, seed=seed)
        ref.router = router  # the very router the gateway was started with
        groups: dict = {}
        unnamed, examples = 0, []
        for i, (idx, y, versions) in enumerate(self._kept):
            if versions is None:
                unnamed += 1
                examples.append({"answer": i, "why": "the reply named no expert versions"})
                continue
            if y.shape != (len(idx), router.d_model):
                unnamed += 1
                examples.append({"answer": i, "why": f"shape {y.shape} for {len(idx)} rows"})
                continue
            groups.setdefault(tuple(sorted(versions.items())), []).append(i)
        wrong = 0
        for key, members in groups.items():
            versions = dict(key)
            bad = self._check_group([self._kept[i] for i in members], ref, bank, versions)
            wrong += len(bad)
            examples += [{"answer": members[j], "why": why} for j, why in bad[:5]]
        return {"checked": len(self._kept), "wrong": wrong + unnamed, "unnamed": unnamed, "unkept": self.unkept,
                "examples": examples[:10]}

    @staticmethod
    def _check_group(answers: list, ref, bank, versions: dict) -> list:
        """[(position in ``answers``, why)] of the wrong ones, all sharing ``versions``."""
        rows = np.concatenate([a[0] for a in answers])
        got = np.concatenate([a[1] for a in answers])
        owner = np.repeat(np.arange(len(answers)), [len(a[0]) for a in answers])
        ok = np.ones(len(rows), dtype=bool)
        for s in range(0, len(rows), CHUNK_ROWS):
            x = bank.rows(rows[s:s + CHUNK_ROWS])
            missing = set(ref.used(x)) - set(versions)
            if missing:  # an expert the rows use that the reply did not name: each row on its own
                for j in range(len(x)):
                    if set(ref.used(x[j:j + 1])) - set(versions):
                        ok[s + j] = False
            want = ref.forward(x, versions)
            g = got[s:s + CHUNK_ROWS]
            close = np.isclose(g, want, **TOL).all(axis=1) if g.shape == want.shape else np.zeros(len(x), bool)
            ok[s:s + CHUNK_ROWS] &= close
        bad = sorted(set(owner[~ok].tolist()))
        return [(j, f"{int((~ok[owner == j]).sum())} of {int((owner == j).sum())} rows differ from the reference "
                    f"at versions {versions}") for j in bad]
