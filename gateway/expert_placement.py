"""Which workers route each expert: the gateway's placement, versioned; no I/O.

Terms: a *logical* expert is the model's (a layer's expert id); a *physical* expert is one
copy of it on one worker; the *placement* maps each logical expert to the workers holding
a routed copy; *redundant* experts are copies beyond one per logical expert.

The rules:

1. Every logical expert of every layer has at least one copy, and a worker holds at most
   one copy of a logical expert (:meth:`ExpertPlacement.check`).
2. Routing and replica choice read one placement; every change makes a new one with the
   next version (:meth:`ExpertPlacement.changed`); a round is planned under one version
   and keeps it (no request is answered by a mix of placements).
3. A copy is added to the placement only once its worker holds the served weights (loaded
   and acknowledged); a copy is dropped from its worker only after every round planned
   under a version that routed to it has settled (gateway/rebalancer.py).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Mapping, Optional

__all__ = ["ExpertPlacement", "PlacementError"]


class PlacementError(ValueError):
    """A placement that breaks a rule, or a change that cannot apply."""


@dataclass(frozen=True)
class ExpertPlacement:
    """``copies``: {layer: (worker indices of expert 0, of expert 1, ...)}, each sorted."""

    version: int
    copies: Mapping[int, tuple] = field(default_factory=dict)

    # -- building ------------------------------------------------------------------------------
    @classmethod
    def from_hosting(cls, hosting: Mapping[int, Mapping[int, Iterable[int]]], n_ids: Mapping[int, int],
                     version: int = 1) -> "ExpertPlacement":
        """Every copy the workers host: ``hosting`` is {worker: {layer: expert ids}}."""
        copies = {L: [[] for _ in range(n)] for L, n in n_ids.items()}
        for w, layers in sorted(hosting.items()):
            for L, ids in layers.items():
                for e in ids:
                    if L in copies and 0 <= e < len(copies[L]):
                        copies[L][e].append(int(w))
        return cls(version, {L: tuple(tuple(sorted(ws)) for ws in per) for L, per in copies.items()})

    @classmethod
    def from_lists(cls, copies: Mapping[int, Iterable[Iterable[int]]], version: int) -> "ExpertPlacement":
        return cls(version, {int(L): tuple(tuple(sorted(int(w) for w in ws)) for ws in per)
                             for L, per in copies.items()})

    # -- reading -------------------------------------------------------------------------------
    def of(self, layer: int, expert: int) -> tuple:
        """The workers holding a routed copy of ``expert`` of ``layer``."""
        per = self.copies.get(layer)
        return per[expert] if per is not None and 0 <= expert < len(per) else ()

    def on(self, worker: int) -> list:
        """[(layer, expert)] of every copy routed to ``worker``."""
        return [(L, e) for L, per in sorted(self.copies.items()) for e, ws in enumerate(per) if worker in ws]

    def lists(self, layer: int) -> list:
        return [list(ws) for ws in self.copies[layer]]

    def physical(self) -> int:
        return sum(len(ws) for per in self.copies.values() for ws in per)

    def redundant(self) -> int:
        return self.physical() - sum(len(per) for per in self.copies.values())

    # -- checking and changing -------------------------------------------------------------------
    def check(self, n_workers: Optional[int] = None, slots: Optional[Mapping[int, int]] = None) -> None:
        """PlacementError naming the first rule this placement breaks."""
        per_worker: dict = {}
        for L, per in self.copies.items():
            for e, ws in enumerate(per):
                if not ws:
                    raise PlacementError(f"expert {e} of layer {L} has no copy")
                if len(set(ws)) != len(ws):
                    raise PlacementError(f"expert {e} of layer {L} has two copies on one worker {list(ws)}")
                for w in ws:
                    if w < 0 or (n_workers is not None and w >= n_workers):
                        raise PlacementError(f"expert {e} of layer {L} is placed on worker {w}, which does not exist")
                    per_worker[w] = per_worker.get(w, 0) + 1
        for w, n in sorted(per_worker.items()):
            if slots is not None and n > slots.get(w, 0):
                raise PlacementError(f"worker {w} would hold {n} copies, more than its {slots.get(w, 0)} slots")

    def changed(self, adds: Iterable[tuple] = (), removes: Iterable[tuple] = ()) -> "ExpertPlacement":
        """The next version with copies ``adds`` [(layer, expert, worker)] added and
        ``removes`` taken away; PlacementError if that breaks a rule."""
        copies = {L: [set(ws) for ws in per] for L, per in self.copies.items()}
        for L, e, w in adds:
            if L not in copies or not 0 <= e < len(copies[L]):
                raise PlacementError(f"no expert {e} of layer {L}")
            copies[L][e].add(int(w))
        for L, e, w in removes:
            if L not in copies or not 0 <= e < len(copies[L]) or w not in copies[L][e]:
                raise PlacementError(f"expert {e} of layer {L} has no copy on worker {w} to remove")
            copies[L][e].discard(int(w))
        nxt = ExpertPlacement.from_lists({L: per for L, per in copies.items()}, self.version + 1)
        nxt.check()
        return nxt

    def diff(self, other: "ExpertPlacement") -> tuple[list, list]:
        """(adds, removes) [(layer, expert, worker)] that take this placement to ``other``."""
        adds, removes = [], []
        for L, per in other.copies.items():
            mine = self.copies.get(L, ())
            for e, ws in enumerate(per):
                have = set(mine[e]) if e < len(mine) else set()
                adds += [(L, e, w) for w in sorted(set(ws) - have)]
                removes += [(L, e, w) for w in sorted(have - set(ws))]
        return adds, removes

    # -- as JSON ---------------------------------------------------------------------------------
    def as_dict(self) -> dict:
        """{"version", "layers": {layer: {"copies": {expert: [workers]}}}} (keys as strings)."""
        return {"version": self.version,
                "layers": {str(L): {"copies": {str(e): list(ws) for e, ws in enumerate(per)}}
                           for L, per in sorted(self.copies.items())}}

    @classmethod
    def from_dict(cls, doc: Mapping, n_ids: Mapping[int, int]) -> "ExpertPlacement":
        """A placement saved by :meth:`as_dict` (or ``placement show --json``), for a gateway
        whose layers have ``n_ids`` expert ids; PlacementError if it does not fit them."""
        try:
            layers = {int(L): {int(e): [int(w) for w in ws] for e, ws in v["copies"].items()}
                      for L, v in doc["layers"].items()}
        except (KeyError, TypeError, ValueError, AttributeError) as err:
            raise PlacementError(f"not a placement document: {err}") from None
        if set(layers) != set(n_ids):
            raise PlacementError(f"the file places layers {sorted(layers)}, this gateway serves {sorted(n_ids)}")
        per = {}
        for L, experts in layers.items():
            if set(experts) != set(range(n_ids[L])):
                raise PlacementError(f"layer {L} of the file places experts {sorted(experts)[:8]}..., the layer has "
                                     f"ids 0-{n_ids[L] - 1}")
            per[L] = [experts[e] for e in range(n_ids[L])]
        p = cls.from_lists(per, int(doc.get("version", 1)))
        p.check()
        return p
