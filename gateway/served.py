"""What the gateway serves, and what a worker must hold to serve it; no I/O.

The rules:

1. Every expert (layer, id) the gateway routes to is either *served* at one
   :class:`Weights` (a version number, the fingerprint of its weights, the source a
   worker can load it from) or *blocked* with a reason. A request that needs a blocked
   expert is answered ``unavailable`` with that reason; it is never computed.
2. At start the served set is what the workers agree on: an expert whose hosts hold the
   same active weights (equal fingerprints) is served at them; one whose hosts disagree is
   blocked until they agree or an operator settles it. Agreement on a version other than
   the start-up one (0) is served and reported (``adopted``), never silently.
3. A worker takes traffic only once, for every served expert it hosts, it holds exactly
   the versions a request may be pinned to (:meth:`ServedSet.wanted`: the served version,
   plus an update's new one while the update loads or shifts traffic), each with the
   served fingerprint. :func:`next_step` says what to load or retire to get there.
4. Every change of the served weights makes a new *generation*; each answer carries the
   versions that computed it, so a client can check them.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Mapping, Optional

Key = tuple  # (layer, expert id)


@dataclass(frozen=True)
class Weights:
    """One version of one expert: its number, its fingerprint (None: not known yet; the
    first worker that loads it says), and the load fields that re-create it."""

    version: int
    fingerprint: Optional[str]
    source: Optional[dict]

    def as_list(self) -> list:
        return [self.version, self.fingerprint, self.source]


#: what a worker holds of one expert: version -> (fingerprint, source)
Held = Mapping[int, tuple]


def show_source(source: Optional[dict]) -> str:
    if not source:
        return "an unknown source"
    kind = next(iter(k for k in source if k != "fingerprint"), "?")
    return f"{kind} {source[kind]}"


def key_name(key: Key) -> str:
    L, e = key
    return f"expert {e}" + (f" of layer {L}" if L else "")


@dataclass
class ServedSet:
    """Per (layer, expert): the served Weights, or why it is blocked.

    ``layers``: {layer: expert ids it has}. :meth:`versions` is a per-layer list the round
    code indexes for every group it pins (-1 for a blocked expert)."""

    layers: Mapping[int, int]
    active: dict = field(default_factory=dict)  # key -> Weights
    blocked: dict = field(default_factory=dict)  # key -> why
    adopted: dict = field(default_factory=dict)  # key -> Weights agreed at start on a version other than 0
    generation: int = 0

    def __post_init__(self) -> None:
        self._table = {L: [-1] * int(n) for L, n in self.layers.items()}

    # -- reading ---------------------------------------------------------------------------
    def versions(self, layer: int) -> list:
        """The served version of each expert id of ``layer`` (-1: blocked or not known)."""
        return self._table[layer]

    def get(self, key: Key) -> Optional[Weights]:
        return self.active.get(key)

    def why_blocked(self, key: Key) -> Optional[str]:
        return self.blocked.get(key)

    # -- changing --------------------------------------------------------------------------
    def serve(self, weights: Mapping[Key, Weights]) -> int:
        """Serve these experts at these weights (unblocking them); the new generation."""
        for key, w in weights.items():
            self.active[key] = w
            self.blocked.pop(key, None)
            self._table[key[0]][key[1]] = w.version
        self.generation += 1
        return self.generation

    def learn(self, key: Key, version: int, fingerprint: str) -> None:
        """The first fingerprint reported for a served version whose fingerprint was unknown."""
        w = self.active.get(key)
        if w is not None and w.version == version and w.fingerprint is None:
            self.active[key] = Weights(version, fingerprint, w.source)

    def block(self, key: Key, why: str) -> None:
        self.active.pop(key, None)
        self.blocked[key] = why
        self._table[key[0]][key[1]] = -1

    def agree(self, key: Key, reports: Mapping[str, Optional[tuple]]) -> Optional[str]:
        """Decide ``key`` from its hosts' active weights ({host: (version, fingerprint,
        source)}, None for a host that does not report it). Returns a note for the log when
        it is blocked or adopted, else None. Does not bump the generation (the caller
        does, once, with :meth:`serve`)."""
        got = {h: r for h, r in reports.items() if r is not None}
        kinds = {(r[0], r[1]) for r in got.values()}
        if not got or len(kinds) != 1 or len(got) != len(reports):
            why = (f"{key_name(key)}: its workers disagree on its weights ("
                   + ", ".join(f"{h}: " + (f"version {r[0]} [{r[1][:12]}]" if r else "nothing")
                               for h, r in sorted(reports.items()))
                   + "); settle it with `moe-gateway update settle`")
            self.block(key, why)
            return why
        version, fp = kinds.pop()
        source = next((r[2] for r in got.values() if r[2]), None)
        w = Weights(version, fp, source)
        self.active[key] = w
        self.blocked.pop(key, None)
        self._table[key[0]][key[1]] = version
        if version != 0:
            self.adopted[key] = w
            return (f"{key_name(key)}: the workers serve version {version} ({show_source(source)}), not the "
                    f"start-up version 0: serving version {version}")
        return None

    # -- what a worker must hold -------------------------------------------------------------
    def wanted(self, keys: Iterable[Key], update: Optional[object] = None) -> Optional[dict]:
        """{key: {version: Weights}} a worker hosting ``keys`` must hold (blocked experts
        left out), or None while ``update`` (gateway/update.py's) is finishing or rolling
        back an expert among them (the worker then waits until it has settled)."""
        out: dict = {}
        for key in keys:
            w = self.active.get(key)
            if w is None:
                continue
            want = {w.version: w}
            if update is not None and key[0] == update.layer and key[1] in update.experts:
                if update.state.value in ("finishing", "rolling_back"):
                    return None
                if update.state.value in ("loading", "shifting"):
                    want[update.new] = Weights(update.new, update.fingerprints.get(key[1]), update.source)
            out[key] = want
        return out

    # -- reporting -------------------------------------------------------------------------
    def status(self) -> dict:
        return {"generation": self.generation,
                "experts": [[L, e, *w.as_list()] for (L, e), w in sorted(self.active.items())],
                "blocked": [[L, e, why] for (L, e), why in sorted(self.blocked.items())],
                "adopted": [[L, e, w.version] for (L, e), w in sorted(self.adopted.items())]}


@dataclass
class Step:
    """What to do next to a worker: loads [(key, Weights)] and retires [(key, version)]
    (any number, sent together), or ``refuse`` (why it cannot serve), or ``done``."""

    loads: list = field(default_factory=list)
    retires: list = field(default_factory=list)
    refuse: Optional[str] = None

    @property
    def done(self) -> bool:
        return not self.loads and not self.retires and self.refuse is None


def next_step(held: Mapping[Key, Held], wanted: Mapping[Key, Mapping[int, Weights]],
              max_versions: int) -> Step:
    """The next loads and retires that bring ``held`` to ``wanted``, expert by expert.

    A held version with another fingerprint than the wanted one is *wrong*: retired (never
    a worker's last version) and loaded again. Loads go first while there is room
    (``max_versions`` per expert); versions nobody wants are retired once every wanted one
    is held, or earlier to make room. A wrong version that is an expert's only one cannot
    be replaced without loading another first: when none is wanted, the worker is
    refused."""
    step = Step()
    for key, want in sorted(wanted.items()):
        have = dict(held.get(key, {}))
        wrong = {v for v, (fp, _) in have.items()
                 if v in want and want[v].fingerprint is not None and fp != want[v].fingerprint}
        unwanted = (set(have) - set(want)) | wrong
        absent = [v for v in sorted(want) if v not in have]
        if wrong and len(have) > 1:
            keep = len(have) - 1
            step.retires += [(key, v) for v in sorted(wrong)][:keep]
        elif absent and len(have) < max_versions:
            for v in absent[:max_versions - len(have)]:
                if want[v].source is None:
                    step.refuse = (f"{key_name(key)}: the gateway does not know where version {v} comes "
                                   f"from, so it cannot load it here")
                    return step
                step.loads.append((key, want[v]))
        elif absent:
            step.retires += [(key, v) for v in sorted(unwanted)][:len(have) - 1]
            if not unwanted or len(have) <= 1:
                step.refuse = f"{key_name(key)}: holds {sorted(have)}, cannot make room for {absent}"
                return step
        elif wrong:
            v = next(iter(wrong))
            step.refuse = (f"{key_name(key)}: holds version {v} with other weights (fingerprint "
                           f"{have[v][0][:12]}, the gateway serves {want[v].fingerprint[:12]}): restart it "
                           f"with the weights the gateway serves, or settle the expert")
            return step
        elif unwanted:
            step.retires += [(key, v) for v in sorted(unwanted)]
    return step
