"""Placement that follows the load: DeepSeek's EPLB algorithm for one layer (numpy, no I/O).

Terms: a *logical* expert is the model's; a *physical* expert is one copy of it on one
worker; a *placement* (``copies``) lists, per logical expert, the workers holding a copy;
*redundant* experts are the copies beyond one per logical expert. A worker is *live* when
it is alive and has at least one slot.

The rules :func:`rebalance` keeps:

1. Every logical expert has at least one copy, every copy is on a live worker, a worker
   holds at most ``slots[w]`` copies and at most one copy of a logical expert.
2. The placement has ``n_logical + min(redundant, free)`` copies, where ``free`` is
   ``sum(min(slots[w], n_logical)) - n_logical`` over the live workers (:func:`free_slots`:
   a worker cannot use more slots than there are logical experts). The one exception is
   rule 3's fallback, which returns ``current`` as it is.
3. With a ``current`` placement that is valid for the live workers (rule 1, within the
   copy budget), the busiest worker's load under the result never exceeds its load under
   ``current`` for the same ``load``; when the new placement would not lower it,
   ``current`` is returned unchanged (no moves for no gain).
4. Copies stay where ``current`` has them whenever that costs no balance: the packing
   prefers a current worker on ties, whole workers' contents are relabelled to match
   ``current``, then single copies are moved or swapped back onto current workers as
   long as the busiest worker's load does not rise (by more than ``slack``, 0 unless
   asked).
5. The same inputs give the same output (no randomness; ties break by index).

:func:`plan_moves` turns a target into bounded steps (see there); its rule: every
intermediate placement keeps each logical expert's copy count at or above
``min(current, target)`` (strict) or at least one (``strict=False``), and never puts more
copies on a worker than its slots.

Worker loads split each logical expert's load evenly over its copies; balancedness is
vLLM's: mean worker load / max worker load (1.0 is perfect).
"""
from __future__ import annotations

import heapq
from collections import deque
from typing import NamedTuple, Optional, Sequence

import numpy as np

Placement = list  # list[list[int]]: per logical expert, the sorted workers holding a copy

_TIE = 1e-9  # loads this close (relative to the total) are ties


class Move(NamedTuple):
    """One step of a move plan: ``op`` is "add" (load a copy of ``expert`` onto ``worker``)
    or "remove" (retire it)."""

    op: str
    expert: int
    worker: int


# ---------------------------------------------------------------- input checks

def _as_load(load) -> np.ndarray:
    arr = np.asarray(load, dtype=np.float64)
    if arr.ndim != 1 or arr.size == 0:
        raise ValueError(f"load must be a non-empty 1-D sequence, got shape {arr.shape}")
    if not np.all(np.isfinite(arr)) or np.any(arr < 0):
        raise ValueError("load must be finite and >= 0 for every logical expert")
    return arr


def _as_mask(values, n: int, what: str) -> np.ndarray:
    if values is None:
        return np.ones(n, dtype=bool)
    arr = np.asarray(values)
    if arr.shape != (n,):
        raise ValueError(f"{what} must have one entry per worker ({n}), got shape {arr.shape}")
    return arr.astype(bool)


def _as_slots(slots, alive) -> np.ndarray:
    """Slots per worker, 0 where the worker is dead."""
    arr = np.asarray(slots)
    if arr.ndim != 1 or arr.size == 0 or not np.issubdtype(arr.dtype, np.integer) or np.any(arr < 0):
        raise ValueError("slots must be a non-empty 1-D sequence of integers >= 0, one per worker")
    return np.where(_as_mask(alive, arr.size, "alive"), arr, 0).astype(np.int64)


def _as_copies(copies, n_logical: int, n_workers: int, what: str = "copies") -> Placement:
    if len(copies) != n_logical:
        raise ValueError(f"{what} must list workers for each of the {n_logical} logical experts, "
                         f"got {len(copies)}")
    out = []
    for e, ws in enumerate(copies):
        ws = [int(w) for w in ws]
        if any(w < 0 or w >= n_workers for w in ws):
            raise ValueError(f"{what}[{e}] names a worker outside 0..{n_workers - 1}: {ws}")
        if len(set(ws)) != len(ws):
            raise ValueError(f"{what}[{e}] holds two copies on one worker: {ws}")
        out.append(sorted(ws))
    return out


def _matrix(copies: Placement, n_workers: int) -> np.ndarray:
    """Boolean [n_logical, n_workers]: True where the worker holds a copy."""
    m = np.zeros((len(copies), n_workers), dtype=bool)
    for e, ws in enumerate(copies):
        m[e, ws] = True
    return m


# ---------------------------------------------------------------- loads

def worker_loads(load, copies: Sequence[Sequence[int]], n_workers: int) -> np.ndarray:
    """Each worker's load when each logical expert's ``load[e]`` is split evenly over its
    copies (``copies[e]``: the workers holding one)."""
    arr = _as_load(load)
    m = _matrix(_as_copies(copies, arr.size, n_workers), n_workers)
    k = m.sum(axis=1)
    per_copy = np.divide(arr, k, out=np.zeros_like(arr), where=k > 0)
    return per_copy @ m


def balancedness(load, copies: Sequence[Sequence[int]], n_workers: int, *, alive=None) -> float:
    """Mean worker load / max worker load (vLLM's definition); 1.0 when there is no load.
    The mean is over the ``alive`` workers (all by default)."""
    loads = worker_loads(load, copies, n_workers)[_as_mask(alive, n_workers, "alive")]
    top = float(loads.max()) if loads.size else 0.0
    return 1.0 if top <= 0.0 else float(loads.mean()) / top


def free_slots(slots, n_logical: int, *, alive=None) -> int:
    """Redundant copies the live workers can hold beyond one per logical expert (negative
    when they cannot hold every logical expert once)."""
    live = _as_slots(slots, alive)
    return int(np.minimum(live, n_logical).sum()) - n_logical


# ---------------------------------------------------------------- hierarchy

def node_of_experts(load, slots, nodes, *, groups: Optional[int] = None, alive=None) -> Optional[np.ndarray]:
    """DeepSeek's first hierarchical step: pack groups of logical experts onto nodes.

    ``groups`` splits the logical experts into that many contiguous, equal groups (the
    model's expert groups; by default each expert is its own group). Each node gets a quota
    of groups in proportion to its live slots, and the groups go heaviest first to the node
    with the least load per live worker that still has quota. Returns each logical expert's
    node, or None when the hierarchy does not apply (one live node, or a node cannot hold
    its quota once).
    """
    arr = _as_load(load)
    live = _as_slots(slots, alive)
    node = np.asarray(nodes)
    if node.shape != live.shape:
        raise ValueError(f"nodes must have one entry per worker ({live.size}), got shape {node.shape}")
    n_groups = arr.size if groups is None else int(groups)
    if n_groups < 1 or arr.size % n_groups:
        raise ValueError(f"groups ({groups}) must divide the {arr.size} logical experts")
    names = np.unique(node[live > 0])
    if names.size < 2:
        return None
    size = arr.size // n_groups
    cap = np.array([live[node == n].sum() for n in names])
    workers = np.array([np.count_nonzero((node == n) & (live > 0)) for n in names])
    share = n_groups * cap / cap.sum()
    quota = np.floor(share).astype(np.int64)
    for i in np.argsort(-(share - quota), kind="stable")[: n_groups - quota.sum()]:
        quota[i] += 1
    if np.any(quota * size > cap):
        return None
    weight = arr.reshape(n_groups, size).sum(axis=1)
    placed = np.zeros(names.size)
    out = np.empty(arr.size, dtype=node.dtype)
    for g in np.argsort(-weight, kind="stable"):
        score = np.where(quota > 0, (placed + weight[g]) / workers, np.inf)
        i = int(np.argmin(score))
        placed[i] += weight[g]
        quota[i] -= 1
        out[g * size:(g + 1) * size] = names[i]
    return out


# ---------------------------------------------------------------- replicate and pack

def _curve(slots: np.ndarray, m: int) -> np.ndarray:
    """F[k] = sum_w min(slots[w], k), k = 0..m: the most copies k logical experts can have."""
    return np.minimum(slots[None, :], np.arange(m + 1)[:, None]).sum(axis=1)


def _fits(counts: np.ndarray, curve: np.ndarray) -> bool:
    """Gale-Ryser: copy counts can be placed, one copy per worker per logical expert,
    within the slots, iff the top-k counts never need more than F[k]."""
    top = np.cumsum(np.sort(counts)[::-1])
    return bool(np.all(top <= curve[1:top.size + 1]))


def _replicate(load: np.ndarray, extra: int, part: np.ndarray, curves: dict, prefer: np.ndarray) -> np.ndarray:
    """DeepSeek's step 1: give the redundant copies one at a time to the logical expert with
    the highest load per copy (ties: one that has more copies today, then the lowest id),
    skipping one whose extra copy could not be placed within its part's slots."""
    counts = np.ones(load.size, dtype=np.int64)
    members = {p: np.flatnonzero(part == p) for p in curves}
    heap = [(-load[e], prefer[e] <= 1, e) for e in range(load.size)]
    heapq.heapify(heap)
    while extra > 0 and heap:
        _, _, e = heapq.heappop(heap)
        counts[e] += 1
        ids = members[part[e]]
        if not _fits(counts[ids], curves[part[e]]):
            counts[e] -= 1  # never fits again: other experts' copies only tighten the bound
            continue
        extra -= 1
        heapq.heappush(heap, (-load[e] / counts[e], prefer[e] <= counts[e], e))
    return counts


def _augment(e: int, held: np.ndarray, free: np.ndarray, allowed: np.ndarray, loads: np.ndarray,
             per_copy: np.ndarray) -> None:
    """Place one more copy of ``e`` when every worker with a free slot already holds it:
    shift copies along the shortest chain of workers that ends at a free slot (an
    augmenting path; one exists whenever the counts pass :func:`_fits`)."""
    parent: dict = {}
    queue: deque = deque()
    for w in np.flatnonzero(allowed[e] & ~held[e]):
        parent[int(w)] = (e, -1)
        queue.append(int(w))
    while queue:
        w = queue.popleft()
        if free[w] > 0:
            free[w] -= 1
            while True:
                f, src = parent[w]
                held[f, w] = True
                loads[w] += per_copy[f]
                if src < 0:
                    return
                held[f, src] = False
                loads[src] -= per_copy[f]
                w = src
        for f in np.flatnonzero(held[:, w]):
            for u in np.flatnonzero(allowed[f] & ~held[f]):
                if int(u) not in parent:
                    parent[int(u)] = (int(f), w)
                    queue.append(int(u))
    raise RuntimeError(f"no room for another copy of logical expert {e} (counts were checked to fit)")


def _pack(counts: np.ndarray, per_copy: np.ndarray, slots: np.ndarray, allowed: np.ndarray,
          cur: np.ndarray, tie: float) -> tuple:
    """DeepSeek's step 2: physical copies, largest load first, each to the least-loaded
    worker with a free slot that does not hold that expert yet (ties: a worker holding it
    today, then the lowest index). Returns (held, worker loads)."""
    n_logical, n_workers = allowed.shape
    held = np.zeros((n_logical, n_workers), dtype=bool)
    loads = np.zeros(n_workers)
    free = slots.copy()
    for e in np.lexsort((np.arange(n_logical), -per_copy)):
        for _ in range(counts[e]):
            ok = (free > 0) & ~held[e] & allowed[e]
            if not ok.any():
                _augment(int(e), held, free, allowed, loads, per_copy)
                continue
            near = ok & (loads <= loads[ok].min() + tie)
            pick = near & cur[e]
            w = int(np.argmax(pick if pick.any() else near))
            held[e, w] = True
            loads[w] += per_copy[e]
            free[w] -= 1
    return held, loads


# ---------------------------------------------------------------- fewer moves

def _relabel(held: np.ndarray, cur: np.ndarray, classes: np.ndarray) -> np.ndarray:
    """Swap whole workers' contents between workers of one class (same slots, same node) so
    that more copies land where they are today; loads are only permuted."""
    overlap = held.T.astype(np.int64) @ cur.astype(np.int64)  # [column, worker]
    perm = np.arange(held.shape[1])
    for c in np.unique(classes[classes >= 0]):
        ws = np.flatnonzero(classes == c)
        sub = overlap[np.ix_(ws, ws)]
        taken_col = np.zeros(ws.size, dtype=bool)
        taken_w = np.zeros(ws.size, dtype=bool)
        choice = np.empty(ws.size, dtype=np.int64)
        for flat in np.argsort(-sub, axis=None, kind="stable"):
            b, w = divmod(int(flat), ws.size)
            if not taken_col[b] and not taken_w[w]:
                taken_col[b] = taken_w[w] = True
                choice[w] = b
        if sub[choice, np.arange(ws.size)].sum() > np.trace(sub):
            perm[ws] = ws[choice]
    return held[:, perm]


def _stick(held: np.ndarray, cur: np.ndarray, per_copy: np.ndarray, slots: np.ndarray,
           allowed: np.ndarray, bound: float) -> None:
    """Move single copies back onto a worker that holds them today, into a free slot or by
    swapping with a copy there that is new too, whenever no worker's load goes above
    ``bound``. Every change lowers the number of new copies, so this ends."""
    loads = per_copy @ held
    free = slots - held.sum(axis=0)
    for e, wa in np.argwhere(held & ~cur):
        if not held[e, wa]:
            continue  # an earlier swap moved this copy
        for wo in np.flatnonzero(cur[e] & ~held[e] & allowed[e]):
            x = per_copy[e]
            if free[wo] > 0 and loads[wo] + x <= bound:
                held[e, wa], held[e, wo] = False, True
                loads[wa] -= x
                loads[wo] += x
                free[wa] += 1
                free[wo] -= 1
                break
            gain = 1 + cur[:, wa].astype(np.int64) - cur[:, wo]
            ok = (held[:, wo] & ~held[:, wa] & allowed[:, wa] & (gain > 0)
                  & (loads[wo] + x - per_copy <= bound) & (loads[wa] - x + per_copy <= bound))
            if ok.any():
                f = int(np.argmax(np.where(ok, gain, -1)))
                held[e, wa], held[e, wo], held[f, wo], held[f, wa] = False, True, False, True
                loads[wo] += x - per_copy[f]
                loads[wa] += per_copy[f] - x
                break


# ---------------------------------------------------------------- rebalance

def _place(load: np.ndarray, extra: int, slots: np.ndarray, part: np.ndarray, worker_part: np.ndarray,
           cur: np.ndarray, slack: float) -> Optional[np.ndarray]:
    """Replicate, pack, relabel and stick within parts (nodes; one part when flat). None
    when the parts cannot hold ``extra`` redundant copies."""
    curves = {}
    for p in np.unique(part):
        ids = np.flatnonzero(part == p)
        curves[p] = _curve(np.where(worker_part == p, slots, 0), ids.size)
    if sum(int(c[-1]) for c in curves.values()) - load.size < extra:
        return None
    counts = _replicate(load, extra, part, curves, cur.sum(axis=1))
    per_copy = load / counts
    allowed = (part[:, None] == worker_part[None, :]) & (slots > 0)[None, :]
    tie = _TIE * max(float(load.sum()), 1e-300)
    held, loads = _pack(counts, per_copy, slots, allowed, cur, tie)
    kinds: dict = {}
    classes = np.array([kinds.setdefault((int(s), p), len(kinds)) if s > 0 else -1
                        for s, p in zip(slots, worker_part.tolist())])
    held = _relabel(held, cur, classes)
    _stick(held, cur, per_copy, slots, allowed, float(loads.max()) * (1.0 + slack) + tie)
    return held


def _fallback_ok(cur: Placement, slots: np.ndarray, budget: int) -> bool:
    """``current`` is valid for the live workers: rule 1 and within the copy budget."""
    m = _matrix(cur, slots.size)
    return (all(cur) and not np.any(m[:, slots == 0]) and bool(np.all(m.sum(axis=0) <= slots))
            and int(m.sum()) <= len(cur) + budget)


def rebalance(load, slots, *, redundant: int, nodes=None, current=None, alive=None,
              groups: Optional[int] = None, slack: float = 0.0) -> Placement:
    """The target placement for one layer (the rules are at the top of this module).

    ``load[e]``: load of logical expert e over the window (>= 0); ``slots[w]``: physical
    copies worker w can hold (0, or ``alive[w]`` False: it gets nothing); ``redundant``:
    copies wanted beyond one per logical expert (capped by :func:`free_slots`); ``nodes[w]``:
    worker w's node, for DeepSeek's hierarchical variant (groups of experts packed onto
    nodes by :func:`node_of_experts`, then replicated and packed within each node), used
    where it applies and can hold the same copies, else the flat one; ``current``: today's
    placement, kept where that costs no balance and the fallback; ``slack``: how far (a
    fraction) the busiest worker may go above the best placement found to keep more copies
    where ``current`` has them (0: none; 0.01 keeps most copies under small load changes).
    Raises ValueError on bad input or when the live workers cannot hold every logical
    expert once.
    """
    arr = _as_load(load)
    live = _as_slots(slots, alive)
    if isinstance(redundant, bool) or int(redundant) != redundant or redundant < 0:
        raise ValueError(f"redundant must be an integer >= 0, got {redundant!r}")
    slack = float(slack)
    if not 0.0 <= slack < 1.0:
        raise ValueError(f"slack must be a fraction in [0, 1), got {slack!r}")
    n_logical, n_workers = arr.size, live.size
    free = free_slots(live, n_logical)
    if free < 0:
        raise ValueError(f"the live workers have {int(np.minimum(live, n_logical).sum())} usable slots "
                         f"for {n_logical} logical experts")
    extra = min(int(redundant), free)
    cur = None if current is None else _as_copies(current, n_logical, n_workers, "current")
    cur_m = np.zeros((n_logical, n_workers), dtype=bool) if cur is None else _matrix(cur, n_workers) & (live > 0)
    held = None
    if nodes is not None:
        part = node_of_experts(arr, live, nodes, groups=groups)
        if part is not None:
            held = _place(arr, extra, live, part, np.asarray(nodes), cur_m, slack)
    if held is None:
        held = _place(arr, extra, live, np.zeros(n_logical, np.int64), np.zeros(n_workers, np.int64), cur_m,
                      slack)
    target = [np.flatnonzero(row).tolist() for row in held]
    if cur is not None and _fallback_ok(cur, live, extra):
        new_top = worker_loads(arr, target, n_workers).max()
        old_top = worker_loads(arr, cur, n_workers).max()
        if new_top >= old_top - _TIE * max(float(arr.sum()), 1e-300):
            return cur
    return target


# ---------------------------------------------------------------- moves

class _Planner:
    """The placement while a plan is built, and the steps so far."""

    def __init__(self, cur: Placement, tgt: Placement, live: np.ndarray, limit: np.ndarray, strict: bool):
        self.state = [set(ws) for ws in cur]
        self.tgt = [set(ws) for ws in tgt]
        self.live, self.limit, self.strict = live, limit, strict
        self.count = np.bincount([w for ws in cur for w in ws], minlength=live.size)
        self.lives = [sum(bool(live[w]) for w in ws) for ws in cur]
        self.floor = [min(n, len(t)) for n, t in zip(self.lives, tgt)]  # the strict rule
        self.steps: list = []

    def add(self, e: int, w: int) -> None:
        self.state[e].add(w)
        self.count[w] += 1
        self.lives[e] += bool(self.live[w])
        self.steps.append(Move("add", e, w))

    def remove(self, e: int, w: int) -> None:
        self.state[e].discard(w)
        self.count[w] -= 1
        self.lives[e] -= bool(self.live[w])
        self.steps.append(Move("remove", e, w))

    def removable(self, e: int, w: int, early: bool = False) -> bool:
        """A copy the target drops whose removal keeps the rule (``early``: keeps one copy)."""
        if w not in self.state[e] or w in self.tgt[e]:
            return False
        return not self.live[w] or self.lives[e] - 1 >= (min(1, self.floor[e]) if early else self.floor[e])

    def make_room(self, w: int) -> bool:
        """A free slot on ``w``, removing a copy there that may go if needed."""
        if self.count[w] < self.limit[w]:
            return True
        for early in (False, True) if not self.strict else (False,):
            for f in range(len(self.state)):
                if self.removable(f, w, early):
                    self.remove(f, w)
                    return True
        return False

    def retire_replaced(self, e: int) -> None:
        """After an add of ``e``: remove the copy it replaces, if any."""
        for v in sorted(self.state[e] - self.tgt[e]):
            if self.removable(e, v):
                self.remove(e, v)
                return

    def retire_one(self) -> bool:
        """Remove one copy the target drops anywhere (frees a slot when adds are stuck)."""
        for e in range(len(self.state)):
            for w in sorted(self.state[e] - self.tgt[e]):
                if self.removable(e, w):
                    self.remove(e, w)
                    return True
        return False


def _n_workers(copies: Sequence[Sequence[Sequence[int]]], slots, alive) -> int:
    if slots is not None:
        return len(slots)
    if alive is not None:
        return len(alive)
    return 1 + max((int(w) for c in copies for ws in c for w in ws), default=0)


def plan_moves(current, target, max_moves: int, *, slots=None, alive=None, load=None,
               strict: bool = True) -> list:
    """Steps (:class:`Move`) that take ``current`` toward ``target``: adds and removes.

    At most ``max_moves`` adds, the most needed first (logical experts with no live copy,
    then by ``load`` per target copy when given, then by id); each add is followed by the
    remove of the copy it replaces, if any. Every intermediate placement keeps each logical
    expert at ``min(current, target)`` live copies or more (``strict``; with
    ``strict=False`` a copy the target drops may go before its replacement is added when
    that is the only way to free a slot, keeping at least one live copy) and no worker
    above ``slots[w]`` copies (default: the larger of its current and target counts).
    Copies on dead workers (``alive``) are removed first.

    When the target cannot be reached within the bound, the plan is the valid prefix: the
    adds that fit the bound, and those the slots allow (a cycle of moves between full
    workers, where no copy may go before its replacement arrives, is left out: a spare slot
    per worker or ``strict=False`` resolves it). Apply it (:func:`apply_moves`) and plan
    again from the result; ``apply_moves(current, plan) == target`` says the plan is whole.
    """
    n_logical = len(current)
    n_workers = _n_workers([current, target], slots, alive)
    cur = _as_copies(current, n_logical, n_workers, "current")
    tgt = _as_copies(target, n_logical, n_workers, "target")
    live = _as_mask(alive, n_workers, "alive")
    if any(not live[w] for ws in tgt for w in ws):
        raise ValueError("target puts a copy on a dead worker")
    if isinstance(max_moves, bool) or int(max_moves) != max_moves or max_moves < 0:
        raise ValueError(f"max_moves must be an integer >= 0, got {max_moves!r}")
    counts = (np.bincount([w for ws in c for w in ws], minlength=n_workers) for c in (cur, tgt))
    limit = np.maximum(*counts) if slots is None else _as_slots(slots, None)
    weight = np.zeros(n_logical) if load is None else _as_load(load)
    if weight.size != n_logical:
        raise ValueError(f"load must have one entry per logical expert ({n_logical})")
    plan = _Planner(cur, tgt, live, limit, strict)
    for e in range(n_logical):
        for w in sorted(plan.state[e] - plan.tgt[e]):
            if not live[w]:
                plan.remove(e, w)
    pending = sorted(((e, w) for e in range(n_logical) for w in tgt[e] if w not in plan.state[e]),
                     key=lambda ew: (plan.lives[ew[0]] > 0, -weight[ew[0]] / len(tgt[ew[0]]), ew))
    adds = 0
    while pending and adds < max_moves:
        stuck = True
        for e, w in list(pending):
            if adds < max_moves and plan.make_room(w):
                plan.add(e, w)
                adds += 1
                pending.remove((e, w))
                plan.retire_replaced(e)
                stuck = False
        if stuck and not plan.retire_one():
            break
    while plan.retire_one():
        pass
    return plan.steps


def apply_moves(copies: Sequence[Sequence[int]], steps: Sequence) -> Placement:
    """The placement after ``steps`` (:class:`Move` or (op, expert, worker) tuples);
    ValueError on a step that adds a copy already there or removes one that is not."""
    state = [set(int(w) for w in ws) for ws in copies]
    for op, e, w in steps:
        if op == "add" and w not in state[e]:
            state[e].add(w)
        elif op == "remove" and w in state[e]:
            state[e].discard(w)
        else:
            raise ValueError(f"cannot {op} a copy of logical expert {e} on worker {w}")
    return [sorted(ws) for ws in state]
