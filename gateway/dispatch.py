"""Dispatch plan: which rows each worker gets, and the weighted combine back.

A worker receives one contiguous (rows, d_model) block, grouped by expert:
`groups(w)` lists (expert_id, start, count) with `start` relative to that
block, and within a group the rows are in token order. A "row" is one
(token, slot) assignment: a token routed to two experts that live on the same
worker occupies two rows of that worker's block.
"""

from __future__ import annotations

from typing import Mapping, NamedTuple, Optional, Sequence, Union

import numpy as np

from workers import bf16

try:  # gateway/_combine.c, built by `make` (setup.py): the float32 combine in one pass, and
    # the gather into send slots with non-temporal stores
    from gateway import _combine as _native
except ImportError:  # not built here: numpy does the same, in three passes, to the same bits
    _native = None

__all__ = ["ChunkSum", "DispatchPlan", "SumBuffers", "split_over_replicas", "NATIVE_COMBINE"]

#: whether the compiled combine is built here (float32 and bf16 replies use it; others use numpy)
NATIVE_COMBINE = _native is not None


def _native_ok(y: np.ndarray, out: np.ndarray) -> bool:
    """Whether the compiled combine takes these: float32 or bf16 replies into a float32 sum."""
    return (_native is not None and (y.dtype == np.float32 or bf16.is_bf16(y.dtype)) and out.dtype == np.float32
            and y.flags.c_contiguous and out.flags.c_contiguous)


def _native_src(y: np.ndarray) -> np.ndarray:
    """A reply as the compiled combine reads it: float32 as it is, bf16 as its uint16 bits."""
    return y if y.dtype == np.float32 else bf16.bits(y)


def _widened(a: np.ndarray) -> np.ndarray:
    """Narrow replies (bf16, float16) as float32, exactly: the numpy path's sums are float32."""
    return bf16.to_float32(a) if bf16.is_bf16(a.dtype) else a.astype(np.float32)


def _round_bf16(acc: np.ndarray, out: np.ndarray) -> None:
    """A float32 sum into a bf16 ``out``, rounded to nearest even: in one compiled pass where
    it is built (the same bits as bf16.from_float32's six)."""
    if _native is not None and acc.flags.c_contiguous and out.flags.c_contiguous:
        _native.to_bf16(bf16.bits(out), acc)
    else:
        bf16.from_float32(acc, out=out)


ExpertToWorker = Union[Mapping[int, int], Sequence[int], np.ndarray]


def _check_topk(topk_idx: np.ndarray, topk_weights: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    idx = np.asarray(topk_idx)
    wts = np.asarray(topk_weights)
    if idx.ndim != 2:
        raise ValueError(f"topk_idx must be 2-D (T, k), got shape {idx.shape}")
    if not np.issubdtype(idx.dtype, np.integer):
        raise ValueError(f"topk_idx must be integer, got {idx.dtype}")
    if wts.shape != idx.shape:
        raise ValueError(f"topk_weights shape {wts.shape} != topk_idx shape {idx.shape}")
    if idx.size and idx.min() < -1:
        raise ValueError("topk_idx values must be expert ids >= 0, or -1 for dropped")
    return idx, wts


class DispatchPlan:
    """Immutable per-batch plan; build it once per routed batch."""

    def __init__(self, *, num_tokens: int, top_k: int, n_workers: int, n_experts: int,
                 tokens: np.ndarray, slots: np.ndarray, weights: np.ndarray, counts: np.ndarray) -> None:
        # Private: use build() / from_assignment(). Arrays are sorted by (worker, expert,
        # token) and hold only the non-dropped assignments; counts (n_workers, n_experts) is
        # their number per cell, from which the offsets and groups follow.
        self.num_tokens, self.top_k = num_tokens, top_k
        self.n_workers, self.n_experts = n_workers, n_experts
        self._tokens = tokens
        self._slots, self._weights = slots, weights  # for the combine tables, made when first used
        self._tables: Optional[tuple[list, np.ndarray, np.ndarray]] = None
        self._awaits: Optional[np.ndarray] = None  # contributions per token, made when first used
        self._offsets = np.zeros(n_workers + 1, dtype=np.int64)
        np.cumsum(counts.sum(axis=1), out=self._offsets[1:])
        self.expert_counts: np.ndarray = counts.sum(axis=0)
        self._groups: list[list[tuple[int, int, int]]] = []
        for row in counts.tolist():
            groups, start = [], 0
            for e, c in enumerate(row):
                if c:
                    groups.append((e, start, c))
                    start += c
            self._groups.append(groups)

    # -- construction -------------------------------------------------------

    @classmethod
    def build(cls, topk_idx: np.ndarray, topk_weights: np.ndarray,
              expert_to_worker: ExpertToWorker, n_workers: int) -> "DispatchPlan":
        """Plan for a static placement: expert e lives on worker expert_to_worker[e]
        (a dict or a sequence indexed by expert id). Dropped slots (-1) are skipped."""
        idx, wts = _check_topk(topk_idx, topk_weights)
        if isinstance(expert_to_worker, Mapping):
            n_experts = max(expert_to_worker, default=-1) + 1
            table = np.full(n_experts, -1, dtype=np.int64)
            for e, w in expert_to_worker.items():
                if e < 0:
                    raise ValueError(f"expert id must be >= 0, got {e}")
                table[e] = w
        else:
            table = np.asarray(expert_to_worker, dtype=np.int64).reshape(-1)
            n_experts = table.size
        valid = idx >= 0
        if idx.size and idx.max() >= n_experts:
            raise ValueError(f"expert {int(idx.max())} has no worker (mapping covers {n_experts} experts)")
        assign = np.where(valid, table[np.where(valid, idx, 0)] if n_experts else -1, -1)
        if np.any(valid & (assign < 0)):
            missing = sorted(set(idx[valid & (assign < 0)].tolist()))
            raise ValueError(f"experts {missing} have no worker in expert_to_worker")
        return cls.from_assignment(idx, wts, assign, n_workers, n_experts=n_experts)

    @classmethod
    def from_assignment(cls, topk_idx: np.ndarray, topk_weights: np.ndarray,
                        worker_of_assignment: np.ndarray, n_workers: int,
                        *, n_experts: int | None = None) -> "DispatchPlan":
        """Plan where each (token, slot) names its worker, so one expert's
        tokens may be split over replicas. Entries of dropped slots are ignored."""
        idx, wts = _check_topk(topk_idx, topk_weights)
        assign = np.asarray(worker_of_assignment)
        if assign.shape != idx.shape:
            raise ValueError(f"worker_of_assignment shape {assign.shape} != topk_idx shape {idx.shape}")
        if not np.issubdtype(assign.dtype, np.integer):
            raise ValueError(f"worker_of_assignment must be integer, got {assign.dtype}")
        if n_workers < 1:
            raise ValueError(f"n_workers must be >= 1, got {n_workers}")
        T, k = idx.shape
        if _native is not None and n_experts is not None:  # one counting sort in C, same arrays
            return cls._sorted_natively(idx, wts, assign, n_workers, n_experts)
        valid = idx >= 0
        if n_experts is None:
            n_experts = int(idx.max()) + 1 if valid.any() else 0
        elif valid.any() and idx.max() >= n_experts:
            raise ValueError(f"expert id {int(idx.max())} >= n_experts={n_experts}")
        # flat positions (token * k + slot): 1-D gathers, and none at all for the common batch
        # that dropped nothing
        flat_idx, flat_assign = idx.reshape(-1), assign.reshape(-1)
        if valid.all():
            pos = np.arange(T * k, dtype=np.intp)
            wk, ex = flat_assign.astype(np.int64), flat_idx.astype(np.int64)
        else:
            pos = np.flatnonzero(valid)
            wk, ex = flat_assign[pos].astype(np.int64), flat_idx[pos].astype(np.int64)
        if wk.size and (wk.min() < 0 or wk.max() >= n_workers):
            raise ValueError(f"worker index out of range [0, {n_workers}) in worker_of_assignment")
        # by worker, then expert, then token: positions ascend, tokens with them, so a
        # stable sort on (worker, expert) keeps them so (a radix sort on 16-bit keys)
        key = wk * n_experts + ex
        if n_workers * max(n_experts, 1) < np.iinfo(np.int16).max:
            key = key.astype(np.int16)
        order = np.argsort(key, kind="stable")
        at = pos[order]
        tokens, slots = np.divmod(at, k) if k > 1 else (at, np.zeros_like(at))
        counts = np.bincount(key, minlength=n_workers * n_experts).reshape(n_workers, n_experts)
        return cls(num_tokens=T, top_k=k, n_workers=int(n_workers), n_experts=int(n_experts),
                   tokens=tokens.astype(np.intp), slots=slots, weights=wts.reshape(-1)[at].astype(np.float32),
                   counts=counts.astype(np.int64))

    @classmethod
    def _sorted_natively(cls, idx: np.ndarray, wts: np.ndarray, assign: np.ndarray, n_workers: int,
                         n_experts: int) -> "DispatchPlan":
        T, k = idx.shape
        flat = lambda a, dtype: np.ascontiguousarray(a, dtype=dtype).reshape(-1)  # noqa: E731
        sorted_ = np.empty((2, T * k), dtype=np.int64)  # tokens, slots
        weights = np.empty(T * k, dtype=np.float32)
        counts = np.empty((n_workers, n_experts), dtype=np.int64)
        n = _native.sort_plan(flat(idx, np.int64), flat(assign, np.int64), flat(wts, np.float32), k,
                              n_workers, n_experts, sorted_[0], sorted_[1], weights, counts)
        return cls(num_tokens=T, top_k=k, n_workers=int(n_workers), n_experts=int(n_experts),
                   tokens=sorted_[0, :n], slots=sorted_[1, :n], weights=weights[:n], counts=counts)

    # -- per worker ---------------------------------------------------------

    def worker_tokens(self, w: int) -> int:
        """Rows in worker w's block (0 is valid: nothing to send)."""
        return int(self._offsets[w + 1] - self._offsets[w])

    def groups(self, w: int) -> list[tuple[int, int, int]]:
        """(expert_id, start, count) of worker w's block, in row order."""
        return list(self._groups[w])

    def token_indices(self, w: int) -> np.ndarray:
        """Token index of each row of worker w's block (read-only view)."""
        v = self._tokens[self._offsets[w]:self._offsets[w + 1]]
        v.flags.writeable = False
        return v

    def gather_into(self, x: np.ndarray, w: int, out: np.ndarray,
                    rows: tuple[int, int] | None = None) -> np.ndarray:
        """Copy worker w's rows of x (T, d) into `out` (rows, d), e.g. a send
        slot viewed as an array. This is the one copy dispatch needs. `rows`:
        only rows [lo, hi) of worker w's block (one chunk of it)."""
        if x.ndim != 2 or x.shape[0] != self.num_tokens:
            raise ValueError(f"x must have shape ({self.num_tokens}, d), got {x.shape}")
        n = self.worker_tokens(w)
        lo, hi = (0, n) if rows is None else rows
        if not 0 <= lo <= hi <= n:
            raise ValueError(f"rows {rows} outside worker {w}'s {n} rows")
        n = hi - lo
        if out.shape != (n, x.shape[1]):
            raise ValueError(f"out must have shape {(n, x.shape[1])} for worker {w}, got {out.shape}")
        if out.dtype != x.dtype:
            raise ValueError(f"out dtype {out.dtype} != x dtype {x.dtype}")
        first = int(self._offsets[w])
        idx = self._tokens[first + lo:first + hi]
        if (_native is not None and idx.dtype == np.int64 and x.dtype.isbuiltin == 1 and x.flags.c_contiguous
                and out.flags.c_contiguous):
            _native.gather(out, x, idx)  # non-temporal stores for large gathers (gateway/_combine.c)
            return out
        # Indices were checked at build time; mode="clip" skips np.take's
        # hidden buffering of `out` under the default mode="raise".
        np.take(x, idx, axis=0, out=out, mode="clip")
        return out

    def gather(self, x: np.ndarray, w: int) -> np.ndarray:
        """Allocating gather, for tests and in-process use."""
        out = np.empty((self.worker_tokens(w), x.shape[1]), dtype=x.dtype)
        return self.gather_into(x, w, out)

    # -- combine ------------------------------------------------------------

    def _combine_tables(self) -> tuple[list, np.ndarray, np.ndarray]:
        """(segments, untouched, unset): what combining needs and sending does not, made on
        first use, so a chunked round's first message goes out without waiting for them.

        Combine segments, one per (slot, worker): within one, token ids are unique, so
        fancy-indexed writes are correct without np.add.at (slow before numpy 1.25). Slot 0
        comes first and, a token having one slot 0, is written with `=`: only tokens whose
        slot 0 was dropped (unset) need zeroing. Untouched: tokens no worker computes."""
        if self._tables is not None:
            return self._tables
        tokens, slots, weights = self._tokens, self._slots, self._weights
        segments: list[tuple[int, np.ndarray, np.ndarray, np.ndarray, bool]] = []
        for j in range(self.top_k):
            for w in range(self.n_workers):
                lo, hi = int(self._offsets[w]), int(self._offsets[w + 1])
                rows = np.flatnonzero(slots[lo:hi] == j)
                if rows.size:
                    segments.append((w, rows, tokens[lo:hi][rows], weights[lo:hi][rows, None], j == 0))
        touched = np.zeros(self.num_tokens, dtype=bool)
        touched[tokens] = True
        has_first = np.zeros(self.num_tokens, dtype=bool)
        has_first[tokens[slots == 0]] = True
        self._tables = segments, np.flatnonzero(~touched), np.flatnonzero(~has_first)
        return self._tables

    def combine(self, outputs: Sequence[np.ndarray | None], out: np.ndarray,
                sums: Optional["SumBuffers"] = None) -> np.ndarray:
        """out[t] = sum over t's assignments of weight * expert output.

        `outputs[w]` holds worker w's rows in the order they were gathered
        (None or a (0, d) array for an empty worker). `out` (T, d) is zeroed
        first, so tokens whose every slot was dropped come out as 0.

        Narrow dtypes (bf16, float16) are combined in float32: each output row is
        widened as it is taken, summed in a float32 buffer, and `out` is written
        once, rounded (bf16: to nearest even), so a token's sum is rounded once. ``sums``:
        where that float32 sum's memory is taken from and given back to."""
        if len(outputs) != self.n_workers:
            raise ValueError(f"expected {self.n_workers} outputs, got {len(outputs)}")
        if out.ndim != 2 or out.shape[0] != self.num_tokens:
            raise ValueError(f"out must have shape ({self.num_tokens}, d), got {out.shape}")
        d = out.shape[1]
        for w, y in enumerate(outputs):
            n = self.worker_tokens(w)
            if y is None and n == 0:
                continue
            if y is None or y.shape != (n, d):
                got = None if y is None else y.shape
                raise ValueError(f"output of worker {w} must have shape {(n, d)}, got {got}")
        if out.dtype.itemsize < 4:
            acc = sums.take(out.shape) if sums is not None else np.empty(out.shape, np.float32)
            try:
                fin = self._finisher(out)
                self._combine(outputs, acc, fin)
                if fin is None:
                    if bf16.is_bf16(out.dtype):
                        _round_bf16(acc, out)
                    else:
                        np.copyto(out, acc, casting="same_kind")
            finally:
                if sums is not None:
                    sums.give(acc)
            return out
        return self._combine(outputs, out)

    def _combine(self, outputs: Sequence[np.ndarray | None], out: np.ndarray,
                 fin: Optional["_Finisher"] = None) -> np.ndarray:
        segments, untouched, unset = self._combine_tables()
        if unset.size == self.num_tokens:
            out[...] = 0
        elif unset.size:
            out[unset] = 0
        if fin is not None and untouched.size:
            fin.bits[untouched] = 0  # bf16 +0.0, as rounding the zeroed sum gives
        for w, rows, toks, wts, first in segments:
            self._add(outputs[w], rows, toks, wts, 0, first, out, fin)
        return out

    def _add(self, y: np.ndarray, rows: np.ndarray, toks: np.ndarray, wts: np.ndarray, row0: int,
             first: Union[bool, np.ndarray], out: np.ndarray, fin: Optional["_Finisher"]) -> None:
        """out[toks[i]] = (first) or += wts[i] * y[rows[i] - row0]; ``first`` a flag for all
        or each token's (a ChunkSum's seen). With ``fin``, a token's last contribution makes
        its sum, rounded to bf16, in fin.bits instead (one pass over the sum, not two)."""
        if _native_ok(y, out):  # float32, or bf16 widened as it is read
            extra = () if fin is None else (fin.left, fin.bits)
            _native.scatter(out, _native_src(y), rows, toks, wts, row0, first, *extra)
            return
        contrib = np.take(y, rows - row0, axis=0)
        if out.dtype == np.float32 and contrib.dtype != np.float32:  # narrow replies, widened exactly
            contrib = _widened(contrib)
        contrib *= wts
        if isinstance(first, np.ndarray):
            old = first[toks].view(bool)  # token ids are unique within a segment
            out[toks[~old]] = contrib[~old]
            out[toks[old]] += contrib[old]
            first[toks] = 1
        elif first:
            out[toks] = contrib
        else:
            out[toks] += contrib
        if fin is not None:
            fin.left[toks] -= 1
            done = toks[fin.left[toks] == 0]
            fin.bits[done] = bf16.from_float32(out[done])

    def _finisher(self, out: np.ndarray) -> Optional["_Finisher"]:
        """Rounding as each token's last contribution lands, for a bf16 ``out`` whose bits the
        compiled combine can write (else None: the sum is rounded in a pass of its own)."""
        if not bf16.is_bf16(out.dtype) or not out.flags.c_contiguous or _native is None or self.top_k > 127:
            return None
        if self._awaits is None:  # each token's contributions: its slots not dropped
            self._awaits = np.bincount(self._tokens, minlength=self.num_tokens).astype(np.uint8)
        return _Finisher(self._awaits.copy(), bf16.bits(out))

    # -- combine as chunks land --------------------------------------------

    def accumulator(self, d: int, into: Optional[np.ndarray] = None,
                    sums: Optional["SumBuffers"] = None) -> "ChunkSum":
        """A float32 (T, d) sum for :meth:`accumulate`: ``into`` itself when it is a float32
        (T, d) array (the output, summed in place), else one taken from ``sums`` (given back
        by :meth:`ChunkSum.release`) or a new one. Nothing is zeroed but
        the tokens whose every slot was dropped (0, as :meth:`combine` makes them): each
        other token's row is written by its first contribution (see :class:`ChunkSum`)."""
        fin = None
        if into is not None and into.dtype == np.float32 and into.shape == (self.num_tokens, d):
            array, sums = into, None  # the caller's: never given to sums
        else:
            if sums is not None:
                array = sums.take((self.num_tokens, d))
            else:
                array, sums = np.empty((self.num_tokens, d), np.float32), None
            if into is not None and into.shape == (self.num_tokens, d):
                fin = self._finisher(into)
        untouched = self._combine_tables()[1]
        if untouched.size:
            array[untouched] = 0
            if fin is not None:
                fin.bits[untouched] = 0
        return ChunkSum(array, fin, into if fin is not None else None, sums)

    def accumulate(self, w: int, lo: int, hi: int, y: np.ndarray, acc: "ChunkSum") -> None:
        """Add the weighted outputs of rows [lo, hi) of worker w's block (``y``, (hi - lo, d),
        read where it landed) into ``acc``: a worker's rows may come back in several messages,
        each added as it lands and then given back."""
        for sw, rows, toks, wts, _ in self._combine_tables()[0]:
            if sw != w:
                continue
            a, b = np.searchsorted(rows, (lo, hi))  # a segment's rows are ascending
            if a < b:
                self._add(y, rows[a:b], toks[a:b], wts[a:b], lo, acc.seen, acc.array, acc.fin)

    @staticmethod
    def finish(acc: "ChunkSum", out: np.ndarray) -> np.ndarray:
        """Write an accumulated sum into ``out`` in its dtype (bf16 rounded to nearest even);
        nothing to do when it was summed in ``out`` itself, or rounded into it token by token
        as each one's last contribution landed."""
        if acc.array is out:
            return out
        if acc.fin is not None:
            if acc.fin.left.any():
                raise RuntimeError(f"{int(np.count_nonzero(acc.fin.left))} token(s) still await a contribution")
            if acc.target is not out:  # another output than the one it was rounded into
                if bf16.is_bf16(out.dtype):
                    np.copyto(bf16.bits(out), acc.fin.bits)
                else:
                    np.copyto(out, bf16.to_float32(acc.target), casting="same_kind")
            return out
        if bf16.is_bf16(out.dtype):
            _round_bf16(acc.array, out)
        else:
            np.copyto(out, acc.array, casting="same_kind")
        return out

    def __repr__(self) -> str:
        per = [self.worker_tokens(w) for w in range(self.n_workers)]
        return f"DispatchPlan(T={self.num_tokens}, k={self.top_k}, rows_per_worker={per})"


class ChunkSum:
    """One request's float32 (T, d) sum as its chunks land (:meth:`DispatchPlan.accumulate`),
    and which tokens have a contribution in it yet. A token's first contribution is written,
    the others added, so the sum is never zeroed up front: zeroing a large output takes the
    gateway's thread just as the first chunks go out, and the chunks behind them wait. The
    same bits as adding to zeros, except that a first
    contribution of -0.0 stays -0.0 (as :meth:`DispatchPlan.combine` writes it too)."""

    __slots__ = ("array", "seen", "fin", "target", "_sums")

    def __init__(self, array: np.ndarray, fin: Optional["_Finisher"] = None, target: Optional[np.ndarray] = None,
                 sums: Optional["SumBuffers"] = None):
        self.array = array
        self.seen = np.zeros(array.shape[0], np.uint8)  # 1: the token's row holds a contribution
        # a bf16 output (target) rounded into token by token as each one's sum completes:
        # what is left after the last chunk is its own rows, not a pass over the whole sum
        self.fin, self.target = fin, target
        self._sums = sums  # where the array came from, and goes back to

    def release(self) -> None:
        """Done with the sum (finished, or its round given up): its memory goes back to the
        SumBuffers it came from. Nothing may read it after."""
        sums, self._sums = self._sums, None
        if sums is not None:
            sums.give(self.array)


class SumBuffers:
    """float32 sums kept from one request to the next. A new (T, d) array is fresh pages, and
    its first writes fault them in, on the gateway's thread in the middle of its round (see
    docs/design.md#one-reply-slot-per-request-taken-at-dispatch). At most ``keep`` arrays
    are kept (the largest); a request that finds none free gets a new one."""

    def __init__(self, keep: int = 2) -> None:
        self.keep = keep
        self._free: list[np.ndarray] = []  # 1-D float32 arrays, whole

    def take(self, shape: tuple[int, int]) -> np.ndarray:
        """A float32 array of ``shape``, its contents whatever they were."""
        n = int(shape[0]) * int(shape[1])
        for i, b in enumerate(self._free):
            if b.size >= n:
                del self._free[i]
                return b[:n].reshape(shape)
        return np.empty(n, np.float32).reshape(shape)

    def give(self, a: np.ndarray) -> None:
        """``a`` (from :meth:`take`) is no longer read: its memory may be taken again."""
        root = a if a.base is None else a.base
        if not isinstance(root, np.ndarray) or root.dtype != np.float32 or root.ndim != 1:
            return  # not one of ours
        if any(root is b for b in self._free):
            raise RuntimeError("a sum buffer was given back twice")
        if len(self._free) < self.keep:
            self._free.append(root)
        else:  # full: keep the larger
            i = min(range(len(self._free)), key=lambda j: self._free[j].size)
            if root.size > self._free[i].size:
                self._free[i] = root

    def __len__(self) -> int:
        return len(self._free)


class _Finisher(NamedTuple):
    """The contributions each token still awaits, and the bf16 bits its sum is rounded into
    when the last one lands."""

    left: np.ndarray  # uint8 per token
    bits: np.ndarray  # uint16 (T, d): the output's bits


def split_over_replicas(topk_idx: np.ndarray, replicas: Mapping[int, Sequence[int]] | Sequence[Sequence[int]],
                        shares: Mapping[int, Sequence[float]] | None = None) -> np.ndarray:
    """A (T, k) worker_of_assignment for `DispatchPlan.from_assignment`.

    Each expert's assignments, in token order, are cut into contiguous runs,
    one per replica worker in `replicas[e]`, sized in proportion to
    `shares[e]` (equal by default; a load-aware pool passes its own).
    Dropped slots get -1."""
    idx = np.asarray(topk_idx)
    reps = dict(replicas) if isinstance(replicas, Mapping) else dict(enumerate(replicas))
    assign = np.full(idx.shape, -1, dtype=np.int64)
    tok, slot = np.nonzero(idx >= 0)
    ex = idx[tok, slot]
    for e in np.unique(ex).tolist():
        ws = list(reps.get(e, ()))
        if not ws:
            raise ValueError(f"expert {e} has no replica")
        share = np.ones(len(ws)) if shares is None or e not in shares else np.asarray(shares[e], float)
        if share.shape != (len(ws),) or np.any(share < 0) or share.sum() <= 0:
            raise ValueError(f"shares for expert {e} must be {len(ws)} non-negative numbers, not all 0")
        sel = np.flatnonzero(ex == e)  # token order (np.nonzero is row-major)
        bounds = np.round(np.cumsum(share) / share.sum() * sel.size).astype(np.int64)
        which = np.searchsorted(bounds, np.arange(sel.size), side="right")
        assign[tok[sel], slot[sel]] = np.asarray(ws, dtype=np.int64)[which]
    return assign
