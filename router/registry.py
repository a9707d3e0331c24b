"""Which workers exist, where they are, and how loaded: heartbeats + static list + local counts.

Invariants:

* ``loads`` has exactly one entry per routable worker, rebuilt for a worker whenever its
  heartbeat or the router's own counters for it change, so the hot path only reads it. Its
  arrival and prefill rates (the larger of the heartbeat's, all routers' traffic, and our
  own) are read at each rebuild: at least once a heartbeat scan, a fraction of their 30 s
  window.
* A worker learned from heartbeats is forgotten when its heartbeat expires; a static worker
  is never forgotten, only marked down for ``down_s`` after a failed forward.
* ``inflight``, ``pending_prefill`` and ``pending_context`` never go negative (every begin
  has exactly one end).
* With a gate set (Kubernetes discovery), a heartbeat worker is routable only while the gate
  lists it (its pod exists and is Ready), at the address the gate gives; static workers are
  not gated. The heartbeat still says how loaded it is.
* ``_incompatible`` is exactly the known workers whose last heartbeat's block size or key
  scheme differs from ours (their index matches are dropped from decisions).
* A worker whose last heartbeat reports another vocabulary than ours is *excluded*: never
  in ``loads`` (no request goes to it), its reason in ``WorkerInfo.excluded``, logged once
  each time it changes. The rule (:func:`vocab_mismatch`): a router with a tokenizer needs
  the worker's tokenizer and vocabulary size to be its own; one without (token-id clients)
  only the size (its ``--vocab-size``). What a worker does not report is not compared: an
  older agent, the sim engine's tokenizer (it reports a size only), a static worker whose
  agent publishes no heartbeat to our Redis under the same id.
* A worker marked down keeps the error it failed with and when, so that a request finding
  no routable worker is told why (:meth:`WorkerRegistry.unroutable`).
* A *demoted* worker (its engine kept reporting far fewer cached tokens than its published
  blocks promised: ``router/trust.py``) stays routable, but until its ``demoted_until`` its
  index matches are dropped from decisions, as an incompatible worker's are.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass, field

from kvroute.core.load import EngineLoad, SentTraffic, WorkerLoad
from kvroute.core.load_table import LoadTable
from kvroute.core.redis_schema import KEY_SCHEME, Heartbeat

log = logging.getLogger("kvroute.router.registry")

REPRIEVE_CAP_S = 30.0
"""Longest a router keeps workers with no heartbeat after a Redis reconnect (max_ttl_s)."""

EXCLUSION_REASONS = ("tokenizer",)
"""Why a known worker can be excluded from routing (``kvroute_router_worker_excluded``)."""


@dataclass(frozen=True, slots=True)
class Vocabulary:
    """The token ids a router or worker speaks: a tokenizer name (``""``: none, or not
    reported) and the vocabulary size (ids are below it; 0: not reported)."""

    tokenizer: str = ""
    size: int = 0

    def __str__(self) -> str:
        return f"{self.tokenizer or 'token-ids'}/{self.size or '?'}"


def vocab_mismatch(ours: Vocabulary, theirs: Vocabulary) -> str:
    """Why a worker speaking ``theirs`` cannot serve a router speaking ``ours`` ("" if it can).

    The rule: a router with a tokenizer encodes and decodes text, so a worker must have the
    same tokenizer and vocabulary size, each compared when the worker reports it (a worker
    reporting a size but no tokenizer, as the sim engine does, is held to the size). A
    router without one (token-id clients) needs only the same vocabulary size. What either
    side does not report (0 or "") is not compared: an older agent is routed to as before.
    """
    clash = (bool(ours.tokenizer and theirs.tokenizer and ours.tokenizer != theirs.tokenizer)
             or bool(ours.size and theirs.size and ours.size != theirs.size))
    return f"tokenizer {theirs}, router {ours}" if clash else ""


@dataclass
class WorkerInfo:
    worker_id: str
    address: str
    static: bool = False
    heartbeat: Heartbeat | None = None
    down_until: float = 0.0
    down_since: float = 0.0  # monotonic time of the failure that marked it down
    down_error: str = ""  # what that failure said
    compatible: bool = True
    excluded: str = ""  # why no request may go to it: one of EXCLUSION_REASONS, "" = none
    excluded_why: str = ""  # ... in words, naming both sides (vocab_mismatch)
    inflight: int = 0
    pending_prefill: int = 0
    pending_context: int = 0  # prefill_context summed over our pending prefills
    cached_blocks: int = 0
    # Addresses its heartbeat left -> when: one coming back within OWNER_FLIP_S is a second
    # live agent under this id (counted, logged).
    left: dict[str, float] = field(default_factory=dict)
    id_conflicts: int = 0
    conflict_logged: float = -1e9
    first_seen: float = field(default_factory=time.monotonic)
    # Our requests, and the tokens they had to prefill there, by monotonic time, counted
    # from when we first saw the worker.
    sent: SentTraffic = field(init=False)

    def __post_init__(self) -> None:
        self.sent = SentTraffic(start=self.first_seen)


OWNER_FLIP_S = 30.0
"""A heartbeat back at an address it left this recently means two agents share a worker id
(one agent moving, as a restarted pod does, never comes back to its old address)."""


def _moved(info: WorkerInfo, address: str) -> None:
    """``info``'s heartbeat now names ``address``: note the address it left, and count (and
    log, at most every OWNER_FLIP_S) a return to one left within OWNER_FLIP_S."""
    now = time.monotonic()
    back = now - info.left.get(address, -1e9) <= OWNER_FLIP_S
    info.left = {a: t for a, t in info.left.items() if now - t <= OWNER_FLIP_S}
    info.left[info.address] = now
    if not back:
        return
    info.id_conflicts += 1
    if now - info.conflict_logged >= OWNER_FLIP_S:
        info.conflict_logged = now
        log.warning("two live agents beat under one worker id, each overwriting the other's "
                    "cache state: give each its own --worker-id",
                    extra={"kv": {"worker": info.worker_id,
                                  "addresses": sorted({info.address, address})}})


def seen_load(own: WorkerLoad, hb: EngineLoad | WorkerLoad) -> WorkerLoad:
    """A worker's load as one of several routers sees it: ``own``, its exact counts of the
    traffic it sent itself (inflight, pending prefill and its context, rates; and the blocks
    its mirror holds), and ``hb``, the load in the agent's last heartbeat, which counts every
    router's traffic but is up to a heartbeat interval old. The engine's state (running,
    queued, free blocks, limits) is the heartbeat's; of what both count, the larger. The
    replay simulator's multi-router mode (``--routers``) sees loads through this too."""
    return _seen_load(own.inflight, own.pending_prefill_tokens, own.cached_blocks,
                      own.arrival_rate, own.pending_prefill_context, own.prefill_rate, hb)


def _seen_load(inflight: int, pending_prefill: int, cached_blocks: int, arrival_rate: float,
               pending_context: int, prefill_rate: float, hb: EngineLoad | WorkerLoad
               ) -> WorkerLoad:
    """:func:`seen_load` from the router's own counts as numbers: the registry rebuilds
    every worker's load at each heartbeat scan, and a WorkerLoad built only to carry them
    cost a third of that rebuild (1,000 workers: ~5 of 15 ms a scan)."""
    return WorkerLoad(
        inflight=inflight,
        running=hb.running,
        queued=hb.queued,
        free_blocks=hb.free_blocks,
        capacity_blocks=hb.capacity_blocks,
        pending_prefill_tokens=max(hb.pending_prefill_tokens, pending_prefill),
        cached_blocks=cached_blocks,
        max_running=hb.max_running,
        max_batched_tokens=hb.max_batched_tokens,
        prefill_mode=hb.prefill_mode,
        max_prefill_chunk=hb.max_prefill_chunk,
        arrival_rate=max(hb.arrival_rate, arrival_rate),
        pending_prefill_context=pending_context,  # engines report tokens only
        prefill_rate=max(hb.prefill_rate, prefill_rate),  # as the arrival rate
        lower_tier_s_per_token=hb.lower_tier_s_per_token,
    )


def parse_static(spec: str) -> dict[str, str]:
    """``id=host:port,id2=host:port`` -> {id: address}; ValueError on a malformed item."""
    out: dict[str, str] = {}
    for item in filter(None, (s.strip() for s in spec.split(","))):
        wid, sep, addr = item.partition("=")
        if not sep or not wid or ":" not in addr:
            raise ValueError(f"--workers item {item!r} is not id=host:port")
        out[wid] = addr
    return out


class WorkerRegistry:
    """``vocabulary``: the ids this router speaks; the default (nothing reported) excludes
    no worker."""

    def __init__(self, static: Mapping[str, str], block_size: int,
                 vocabulary: Vocabulary = Vocabulary()) -> None:
        self._block_size = block_size
        self.vocabulary = vocabulary
        self._workers: dict[str, WorkerInfo] = {
            w: WorkerInfo(w, a, static=True) for w, a in static.items()
        }
        self.loads = LoadTable()
        self._down: set[str] = set()  # marked down after a failed forward
        self._gate: dict[str, str] | None = None  # worker id -> address; None = no gate
        self._gate_known: frozenset[str] = frozenset()
        self._gate_warned: set[str] = set()
        self._gate_listed = False
        self._gate_seen: set[str] = set()  # ids the gate ever knew: a deleted pod is no news
        self._incompatible: set[str] = set()  # known workers whose keys cannot match ours
        self._demoted: dict[str, float] = {}  # worker -> until when its claims are ignored
        for w in self._workers:
            self._refresh(w)

    def __contains__(self, worker: str) -> bool:
        return worker in self._workers

    def get(self, worker: str) -> WorkerInfo | None:
        return self._workers.get(worker)

    def all(self) -> list[WorkerInfo]:
        return list(self._workers.values())

    def compatible(self, worker: str) -> bool:
        info = self._workers.get(worker)
        return info is not None and info.compatible

    def believed(self, worker: str) -> bool:
        """Whether ``worker``'s index matches count: compatible and not demoted."""
        until = self._demoted.get(worker)
        if until is not None:
            if time.monotonic() < until:
                return False
            del self._demoted[worker]
        return self.compatible(worker)

    def demote(self, worker: str, for_s: float) -> None:
        """Ignore ``worker``'s index matches for ``for_s`` seconds (``router/trust.py``)."""
        if worker in self._workers:
            self._demoted[worker] = time.monotonic() + for_s

    def demoted(self) -> list[str]:
        now = time.monotonic()
        return [w for w, until in self._demoted.items() if until > now]

    @property
    def match_filter(self) -> Callable[[str], bool] | None:
        """What a decision filters index matches by: :meth:`believed`, or None while every
        known worker's matches count (the common case: no call per matched worker)."""
        return self.believed if self._incompatible or self._demoted else None

    # -- heartbeats ------------------------------------------------------------------------

    def max_ttl_s(self, default: float = 3.0) -> float:
        """The longest heartbeat TTL of the known workers, at most :data:`REPRIEVE_CAP_S`:
        how long workers whose heartbeats vanished (a Redis that lost its data) are kept
        after a reconnect. Capped, so that one record claiming an hour (a bug, or anyone
        who can write to Redis) cannot keep dead or fake workers routable that long; a live
        worker with a longer TTL is simply learned again at its next heartbeat."""
        ttls = [i.heartbeat.ttl_s for i in self._workers.values() if i.heartbeat is not None]
        return min(max(ttls, default=default), REPRIEVE_CAP_S)

    def apply_heartbeats(self, beats: Mapping[str, Heartbeat], *, expire: bool = True
                         ) -> tuple[list[str], list[str]]:
        """Update from one scan of live heartbeats. Returns (added, expired) worker ids.

        ``expire=False`` keeps workers whose heartbeat is missing (just after a reconnect to
        a Redis that lost its data, before the agents' next heartbeat). The same as
        :meth:`update_heartbeats` for every part of the scan, then :meth:`expire_missing`."""
        added = self.update_heartbeats(beats)
        return added, self.expire_missing(beats.keys(), expire=expire)

    def update_heartbeats(self, beats: Mapping[str, Heartbeat]) -> list[str]:
        """Apply some of one scan's live heartbeats (a scan may come in parts); returns the
        workers added. A heartbeat that is the very object already applied (the mirror
        parses an unchanged record once) is not judged again: compatibility and
        vocabulary depend on it and on this router alone. Its load is still rebuilt."""
        added: list[str] = []
        for w, hb in beats.items():
            info = self._workers.get(w)
            if info is None:
                info = self._workers[w] = WorkerInfo(w, hb.address)
                added.append(w)
            elif info.heartbeat is hb:
                self._refresh(w)  # its own traffic's rates decay: read them again
                continue
            if info.heartbeat is not None and hb.address != info.address:
                _moved(info, hb.address)
            info.address = hb.address
            info.heartbeat = hb
            ok = hb.block_size == self._block_size and hb.key_scheme == KEY_SCHEME
            if not ok and info.compatible:
                log.error(
                    "worker's block keys cannot match ours; routing to it by load only",
                    extra={"kv": {"worker": w, "its_block_size": hb.block_size,
                                  "our_block_size": self._block_size,
                                  "its_scheme": hb.key_scheme, "our_scheme": KEY_SCHEME}})
            info.compatible = ok
            if ok:
                self._incompatible.discard(w)
            else:
                self._incompatible.add(w)
            self._judge_vocabulary(info, hb)
            self._refresh(w)
        return added

    def expire_missing(self, live: Collection[str], *, expire: bool = True) -> list[str]:
        """End one scan whose live heartbeats were ``live`` (all applied by
        :meth:`update_heartbeats`): forget heartbeat workers not among them (unless
        ``expire`` is False) and refresh static ones. Returns the workers forgotten."""
        for w, i in self._workers.items():
            if i.static and w not in live and w not in self._down:
                self._refresh(w)  # no heartbeat to refresh it: its arrival rate decays here
        expired = [w for w, i in self._workers.items()
                   if expire and not i.static and w not in live]
        for w in expired:
            del self._workers[w]
            self._incompatible.discard(w)
            self._demoted.pop(w, None)
            self.loads.pop(w, None)
        return expired

    def _judge_vocabulary(self, info: WorkerInfo, hb: Heartbeat) -> None:
        theirs = Vocabulary(hb.tokenizer, hb.vocab_size)
        why = vocab_mismatch(self.vocabulary, theirs)
        if why == info.excluded_why:
            return
        if why:
            log.warning("worker speaks another vocabulary than this router; sending it no "
                        "traffic (give each agent the router's model SOURCE as "
                        "--model-source, or both the same --tokenizer and --vocab-size)",
                        extra={"kv": {"worker": info.worker_id, "its_vocabulary": str(theirs),
                                      "our_vocabulary": str(self.vocabulary)}})
        else:
            log.info("worker's vocabulary matches this router's now; routing to it",
                     extra={"kv": {"worker": info.worker_id, "vocabulary": str(theirs)}})
        info.excluded = "tokenizer" if why else ""
        info.excluded_why = why

    def unroutable(self) -> str:
        """Why no request can be routed while ``loads`` is empty: each known worker and what
        keeps it out (the message of the UNAVAILABLE a client then gets)."""
        if not self._workers:
            return ("no routable workers: none registered (no live heartbeat for this model "
                    "in Redis, and no --workers)")
        now = time.monotonic()
        why: list[str] = []
        for w, info in self._workers.items():
            if w in self.loads:
                continue
            if info.excluded:
                why.append(f"{w} excluded ({info.excluded_why})")
            elif info.down_until > now:
                why.append(f"{w} down since {now - info.down_since:.1f} s ago after: "
                           f"{info.down_error or 'a failed call'}")
            elif self._gate is not None and not info.static and w not in self._gate:
                why.append(f"{w} has no Ready pod (discovery)")
            else:
                why.append(f"{w} not routable")
        return "no routable workers: " + "; ".join(why)

    # -- gate (Kubernetes discovery) ------------------------------------------------------

    def set_gate(self, ready: Mapping[str, str] | None, known: Iterable[str] = (), *,
                 listed: bool = True) -> None:
        """Route heartbeat workers only if ``ready`` lists them (id -> address to use).

        ``known`` names every worker the gate knows of, ready or not, so that a heartbeat
        from an id it has never heard of (an agent started without ``--worker-id`` = pod
        name) is reported once instead of silently getting no traffic; ``listed=False``
        means the gate is closed only because nothing has been listed yet (no report).
        ``None`` lifts the gate."""
        self._gate = dict(ready) if ready is not None else None
        self._gate_known = frozenset(known) | frozenset(self._gate or ())
        self._gate_listed = listed
        if len(self._gate_seen) > 65536:
            self._gate_seen.clear()
        self._gate_seen |= self._gate_known
        for w in list(self._workers):
            self._refresh(w)

    def gated_out(self, info: WorkerInfo) -> bool:
        """True if the gate keeps this worker from traffic; applies the gate's address."""
        gate = self._gate
        if gate is None or info.static:
            return False
        address = gate.get(info.worker_id)
        if address is None:
            wid = info.worker_id
            if self._gate_listed and wid not in self._gate_seen and wid not in self._gate_warned:
                self._gate_warned.add(wid)
                log.warning("worker has a heartbeat but no pod of that name matches the "
                            "discovery selector; sending it no traffic",
                            extra={"kv": {"worker": wid,
                                          "heartbeat_address": info.address}})
            return True
        self._gate_warned.discard(info.worker_id)
        hb = info.heartbeat
        if hb is not None and hb.address != address:
            # A stale heartbeat of the pod's previous incarnation, or an agent listening on
            # another port than --k8s-port: the pod's address wins; say so once.
            note = f"{info.worker_id} {hb.address} {address}"
            if note not in self._gate_warned:
                if len(self._gate_warned) > 4096:
                    self._gate_warned.clear()
                self._gate_warned.add(note)
                log.warning("heartbeat address differs from the pod's; using the pod's",
                            extra={"kv": {"worker": info.worker_id,
                                          "heartbeat_address": hb.address,
                                          "pod_address": address}})
        info.address = address
        return False

    # -- local accounting ------------------------------------------------------------------

    def begin(self, worker: str, uncached_tokens: int, sequences: int = 1,
              arrival: bool = True, context: int = 0) -> None:
        """A request was sent to ``worker``; a controller program counts as the number of
        sequences it can run at once (its fan-out). ``arrival``: False for a request held
        for ``worker`` but not sent yet (it counts as an arrival when it is). ``context``:
        what its uncached tokens attend to (:func:`~kvroute.core.load.prefill_context`)."""
        info = self._workers.get(worker)
        if info is not None:
            info.inflight += sequences
            info.pending_prefill += uncached_tokens
            info.pending_context += context
            if arrival:
                info.sent.add(time.monotonic(), uncached_tokens)
            self._refresh(worker)

    def first_token(self, worker: str, uncached_tokens: int, context: int = 0) -> None:
        """The prefill :meth:`begin` counted (the same tokens and context) is done."""
        info = self._workers.get(worker)
        if info is not None:
            info.pending_prefill = max(0, info.pending_prefill - uncached_tokens)
            info.pending_context = max(0, info.pending_context - context)
            self._refresh(worker)

    def end(self, worker: str, sequences: int = 1) -> None:
        info = self._workers.get(worker)
        if info is not None:
            info.inflight = max(0, info.inflight - sequences)
            self._refresh(worker)

    def set_cached_blocks(self, worker: str, n: int) -> None:
        info = self._workers.get(worker)
        if info is not None and info.cached_blocks != n:
            info.cached_blocks = n
            self._refresh(worker)

    def mark_down(self, worker: str, down_s: float, error: str = "") -> None:
        """Skip ``worker`` for ``down_s`` seconds; ``error``: the failure that made it so."""
        info = self._workers.get(worker)
        if info is not None:
            info.down_since = time.monotonic()
            info.down_until = info.down_since + down_s
            info.down_error = error
            self.loads.pop(worker, None)
            self._down.add(worker)

    def revive_due(self) -> None:
        """Put workers whose down period ended back into ``loads``. Called per routing
        decision, so it looks only at the workers marked down (usually none)."""
        if not self._down:
            return
        now = time.monotonic()
        for w in list(self._down):
            info = self._workers.get(w)
            if info is None:
                self._down.discard(w)
            elif info.down_until <= now:
                self._down.discard(w)
                self._refresh(w)

    def _refresh(self, worker: str) -> None:
        info = self._workers[worker]
        if info.excluded or self.gated_out(info):
            self.loads.pop(worker, None)
            return
        now = time.monotonic()
        if info.down_until > now:
            return
        hb = info.heartbeat
        rate = info.sent.arrivals.at(now)
        prefill_rate = info.sent.prefills.at(now)
        if hb is None:
            self.loads[worker] = WorkerLoad(inflight=info.inflight,
                                            pending_prefill_tokens=info.pending_prefill,
                                            cached_blocks=info.cached_blocks,
                                            arrival_rate=rate,
                                            pending_prefill_context=info.pending_context,
                                            prefill_rate=prefill_rate)
            return
        self.loads[worker] = _seen_load(info.inflight, info.pending_prefill, info.cached_blocks,
                                        rate, info.pending_context, prefill_rate, hb.load)
