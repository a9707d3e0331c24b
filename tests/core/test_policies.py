from __future__ import annotations

import math
from dataclasses import replace

import pytest

from kvroute.core.load import PrefillMode, WorkerLoad, prefill_context
from kvroute.core.policies import KvrouteCost, LeastLoaded, RoundRobin, RouteQuery, make_policy


def q(matched: dict[str, int], loads: dict[str, WorkerLoad], prompt: int = 1024,
      affinity: int = 1) -> RouteQuery:
    return RouteQuery(prompt, 16, matched, loads, affinity, affinity)


IDLE = WorkerLoad()


def test_kvroute_prefers_longest_prefix_when_idle() -> None:
    pol = KvrouteCost()
    r = pol.rank(q({"a": 10, "b": 40}, {"a": IDLE, "b": IDLE, "c": IDLE}))
    assert [s.worker for s in r] == ["b", "a", "c"]
    n, c = 1024 - 640, 640  # the formula of the docstring, idle cluster: beta = miss_weight
    assert r[0].cost == pytest.approx(pol.miss_weight * n * (1 + pol.attn * (c + n / 2)))


def test_kvroute_grows_stickier_as_queues_grow() -> None:
    """The same choice flips from the idle worker to the cache holder when the cluster's
    queues grow: a miss then delays everyone queued behind it."""
    holder = WorkerLoad(pending_prefill_tokens=5000, queued=1)
    other = WorkerLoad(queued=1)
    calm = q({"a": 32}, {"a": holder, "b": other})
    pol = KvrouteCost(hold=0, affinity_weight=0)  # the miss term alone
    assert pol.rank(calm)[0].worker == "b"
    busy = {"a": holder, "b": other, **{f"x{i}": WorkerLoad(queued=8, pending_prefill_tokens=
                                                            10**6) for i in range(6)}}
    assert pol.rank(q({"a": 32}, busy))[0].worker == "a"


def test_kvroute_holds_a_long_prefix_against_balance_but_not_a_queue() -> None:
    """The hold rule: balance terms alone never take a request off its long cached prefix;
    queued prefill longer by ``hold`` x the prefill it would redo does, and so does a
    holder without a free batch slot."""
    def kv(held: int, **kw: int) -> WorkerLoad:  # caches full: the KV term at full strength
        return WorkerLoad(free_blocks=30000 - held, capacity_blocks=30000, cached_blocks=30000,
                          **kw)

    empty = kv(0)
    # 960 of 1024 tokens cached on a; at rest the redo costs ~1950, 3x of it ~5850.
    far = q({"a": 60}, {"a": kv(3000), "b": empty})  # a costs ~2850 more than b (KV held)
    assert KvrouteCost(hold=0).rank(far)[0].worker == "b"
    assert KvrouteCost().rank(far)[0].worker == "a"
    for pending, where in ((5000, "a"), (7000, "b")):
        queued = q({"a": 60}, {"a": kv(0, pending_prefill_tokens=pending), "b": empty})
        assert KvrouteCost().rank(queued)[0].worker == where, pending
    # The backlog counts its attention: 5000 tokens after 60k cached are ~3x their count in
    # work (5000 + attn x 3.1e8 ~ 15300 units), past 3x the redo: the request moves.
    deep = kv(0, pending_prefill_tokens=5000,
              pending_prefill_context=prefill_context(5000, 60000))
    assert KvrouteCost().rank(q({"a": 60}, {"a": deep, "b": empty}))[0].worker == "b"
    # Where the prefix can be fetched (kvroute_fetch), a move costs the fetch, not the redo:
    # 3 x 2 x 0.122 x 960 ~ 700, so a queue that could not move it above now does.
    fetched = q({"a": 60}, {"a": kv(0, pending_prefill_tokens=1500), "b": empty})
    assert KvrouteCost().rank(fetched)[0].worker == "a"
    assert make_policy("kvroute_fetch").rank(fetched)[0].worker == "b"
    full = q({"a": 60}, {"a": kv(3000, running=8, max_running=8), "b": empty})
    assert KvrouteCost().rank(full)[0].worker == "b"
    # 384 of 1024 tokens cached: under hold_min, so a gap the rule would forgive still moves it
    short = q({"a": 24}, {"a": kv(700), "b": empty})  # a costs ~350 more than b
    assert KvrouteCost().rank(short)[0].worker == "b"
    assert KvrouteCost(hold_min=0.3).rank(short)[0].worker == "a"


def test_the_hold_rule_counts_only_the_chunks_ahead_where_an_engine_caps_them() -> None:
    """An engine that caps each prefill's chunk (vLLM's --long-prefill-token-threshold)
    lets a request queued behind a long prefill into its next iteration: the wait is the
    chunks ahead, not the whole backlog, so a backlog that moves a request off its prefix
    elsewhere keeps it where it is cached there. Not when the chunks ahead fill the
    iteration, nor where the engine admits prompts whole."""
    empty = WorkerLoad()
    # 960 of 1024 tokens cached on a: 3x the redo is ~5850 work units; 7000 queued moves it.
    def holder(**kw: object) -> dict[str, WorkerLoad]:
        return {"a": WorkerLoad(pending_prefill_tokens=7000, max_batched_tokens=8192, **kw),
                "b": empty}

    assert KvrouteCost().rank(q({"a": 60}, holder()))[0].worker == "b"
    capped = holder(prefill_mode=PrefillMode.CHUNKED, max_prefill_chunk=2048)
    assert KvrouteCost().rank(q({"a": 60}, capped))[0].worker == "a"  # 2048 ahead, not 7000
    assert KvrouteCost(chunk_caps=0).rank(q({"a": 60}, capped))[0].worker == "b"  # caps unread
    # Three more queued: their chunks and the running one's fill the 8192-token iteration.
    full = holder(prefill_mode=PrefillMode.CHUNKED, max_prefill_chunk=2048, queued=3)
    assert KvrouteCost().rank(q({"a": 60}, full))[0].worker == "b"
    # Two waiting: their chunks and the running one's, 6144 tokens, leave room for the
    # request, which joins the next iteration and stays. With 800 of its tokens cached on
    # b too, a move redoes 160, and weighed as a backlog (join_hold 0) the 6144 tokens
    # ahead are more than 3x that: it would move.
    joining = holder(prefill_mode=PrefillMode.CHUNKED, max_prefill_chunk=2048, queued=2)
    assert KvrouteCost().rank(q({"a": 60, "b": 50}, joining))[0].worker == "a"
    assert KvrouteCost(join_hold=0).rank(q({"a": 60, "b": 50}, joining))[0].worker == "b"
    # The router's own count of requests sent there but not running yet counts as waiting
    # (a heartbeat behind): three in transit fill the iteration.
    transit = holder(prefill_mode=PrefillMode.CHUNKED, max_prefill_chunk=2048, inflight=3)
    assert KvrouteCost().rank(q({"a": 60}, transit))[0].worker == "b"
    whole = holder(prefill_mode=PrefillMode.WHOLE, max_prefill_chunk=2048)
    assert KvrouteCost().rank(q({"a": 60}, whole))[0].worker == "b"
    # Unknown mode: as the policy assumes (chunked_prefill).
    unknown = holder(max_prefill_chunk=2048)
    assert KvrouteCost(chunked_prefill=1).rank(q({"a": 60}, unknown))[0].worker == "a"
    # The batch term charges the queue for the capped chunk, not the budget's room.
    waiting = {"a": WorkerLoad(queued=3, pending_prefill_tokens=300, max_batched_tokens=8192,
                               prefill_mode=PrefillMode.CHUNKED, max_prefill_chunk=512),
               "b": WorkerLoad(queued=3, pending_prefill_tokens=300)}

    def cost_a(pol: KvrouteCost) -> float:
        return next(s.cost for s in pol.rank(q({}, waiting, prompt=6000)) if s.worker == "a")

    pol = KvrouteCost(arrival_weight=0, churn_s=0, churn_full_s=0, affinity_weight=0)
    delay = cost_a(pol) - cost_a(replace(pol, batch_weight=0))
    assert delay == pytest.approx(pol.batch_weight * 3 * 512 * (1 + pol.attn * 256))
    # ... the room left in the iteration, 7892 tokens, where the caps are not read.
    uncapped = replace(pol, chunk_caps=0)
    delay = cost_a(uncapped) - cost_a(replace(uncapped, batch_weight=0))
    assert delay == pytest.approx(pol.batch_weight * 3 * 6000 * (1 + pol.attn * 3000))
    with pytest.raises(ValueError, match="chunk_caps is 1"):
        KvrouteCost(chunk_caps=0.5)
    with pytest.raises(ValueError, match="join_hold is 1"):
        KvrouteCost(join_hold=2)


def test_the_tail_rule_lets_go_a_request_whose_first_token_would_be_in_the_tail() -> None:
    """With ``tail_hold``, a backlog the hold rule forgives still moves the request when its
    first token on the holder would come later than ``tail_hold`` x the traffic's tail and
    elsewhere would not. Off by default."""
    def query(tail: float, pending_b: int = 0) -> RouteQuery:
        # 960 of 1024 tokens cached on a, behind 5000 queued: held (3x the redo ~5850)
        loads = {"a": WorkerLoad(pending_prefill_tokens=5000),
                 "b": WorkerLoad(pending_prefill_tokens=pending_b)}
        return RouteQuery(1024, 16, {"a": 60}, loads, 1, 1, 0.0, tail)

    pol = KvrouteCost(tail_hold=1.0)
    assert pol.rank(query(math.inf))[0].worker == "a"  # no tail known yet
    # first_a = 5000 + work(64, 960) ~ 5066: past a tail of 4000, and b would give the first
    # token within it (work(1024, 0) ~ 1041)
    assert pol.rank(query(4000.0))[0].worker == "b"
    assert KvrouteCost().rank(query(4000.0))[0].worker == "a"  # off by default
    assert KvrouteCost(tail_hold=1.5).rank(query(4000.0))[0].worker == "a"  # 6000 > 5066
    assert pol.rank(query(6000.0))[0].worker == "a"  # within the tail: held
    # b's own backlog would put it in the tail too: held
    assert pol.rank(query(4000.0, pending_b=4100))[0].worker == "a"
    with pytest.raises(ValueError, match="tail_hold"):
        KvrouteCost(tail_hold=-1)


def test_a_hot_prefix_gets_a_second_copy_sooner() -> None:
    """The hold rule counts a holder's backlog once more per request the prefix's demand
    brings over ``demand_horizon_s``: a document read 0.5 times a second gets a second copy
    for a backlog that would not move a session (whose history is read once). With
    ``replicate`` (the default) the request stays on its holder and ``replica`` names where
    the copy goes; without, the request moves to make it."""
    def kv(pending: int = 0) -> WorkerLoad:
        return WorkerLoad(free_blocks=30000, capacity_blocks=30000,
                          pending_prefill_tokens=pending)

    # 960 of 1024 tokens cached on a: 3x the redo is ~5850 at rest.
    loads = {"a": kv(5000), "b": kv()}
    session = q({"a": 60}, loads)
    hot = RouteQuery(1024, 16, {"a": 60}, loads, 1, 1, prefix_rate=0.5)
    moving, copying = KvrouteCost(replicate=0), KvrouteCost()
    for pol in (moving, copying):
        assert pol.rank(session)[0].worker == "a"
        assert pol.replica(session, "a") is None  # no demand, no copy
    assert moving.rank(hot)[0].worker == "b"  # 5000 x (1 + 10 x 0.5) > 5850
    assert moving.replica(hot, "b") is None
    assert copying.rank(hot)[0].worker == "a"  # a hit on its holder ...
    assert copying.replica(hot, "a") == ("b", 960)  # ... and the 960 tokens copied to b
    assert copying.replica(hot, "b") is None  # sent elsewhere, it brings the prefix there
    assert KvrouteCost(demand_horizon_s=0).rank(hot)[0].worker == "a"
    assert KvrouteCost(demand_horizon_s=0).replica(hot, "a") is None
    for pol in (moving, copying):
        assert list(pol.rank(hot)) == list(pol.rank_python(hot))
    # b holds it too: nothing to copy.
    both = RouteQuery(1024, 16, {"a": 60, "b": 60}, loads, 1, 1, prefix_rate=0.5)
    assert copying.replica(both, copying.rank(both)[0].worker) is None
    # Demand never moves a request off a holder without a backlog.
    idle = RouteQuery(1024, 16, {"a": 60}, {"a": kv(), "b": kv()}, 1, 1, prefix_rate=50.0)
    for pol in (moving, copying):
        assert pol.rank(idle)[0].worker == "a"
    assert moving.replica(idle, "a") is None
    with pytest.raises(ValueError, match="demand_horizon_s"):
        KvrouteCost(demand_horizon_s=-1)
    with pytest.raises(ValueError, match="replicate"):
        KvrouteCost(replicate=0.5)


def test_a_prefix_in_demand_spreads_to_the_cheapest_worker_without_it() -> None:
    """The spread rule: with no backlog to move a request, a prefix gets one more holder
    while each holder would get more than ``spread_demand`` of its requests over
    ``demand_horizon_s``; the copy goes to the cheapest worker without it, if its prefill
    is idle."""
    def kv(pending: int = 0, running: int = 0) -> WorkerLoad:
        return WorkerLoad(free_blocks=30000, capacity_blocks=30000,
                          pending_prefill_tokens=pending, running=running)

    loads = {"a": kv(), "b": kv(), "c": kv(500), "d": kv(running=1)}

    def hot(rate: float, holders: tuple[str, ...] = ("a",)) -> RouteQuery:
        return RouteQuery(1024, 16, dict.fromkeys(holders, 60), loads, 1, 1, prefix_rate=rate)

    pol = KvrouteCost()  # spread_demand 2 over 10 s: 0.2 per second per holder
    assert pol.rank(hot(0.3))[0].worker == "a"  # the request keeps its hit
    assert pol.replica(hot(0.3), "a") == ("b", 960)  # b: the cheapest without it
    assert pol.replica(hot(0.1), "a") is None  # 1 request per 10 s: one holder is enough
    assert pol.replica(hot(0.3, ("a", "b")), "a") is None  # 1.5 per holder
    assert pol.replica(hot(0.5, ("a", "b")), "a") == ("d", 960)  # 2.5 per holder
    assert pol.replica(hot(50.0, ("a", "b", "c", "d")), "a") is None  # everyone holds it
    # The only worker without it is prefilling: a copy there would delay its requests.
    assert pol.replica(hot(50.0, ("a", "b", "d")), "a") is None
    assert pol.replica(hot(0.3), "b") is None  # sent elsewhere, it brings the prefix there
    assert pol.replica(hot(0.0), "a") is None
    assert KvrouteCost(spread_demand=0).replica(hot(50.0), "a") is None
    assert KvrouteCost(replicate=0).replica(hot(50.0), "a") is None
    assert KvrouteCost(spread_demand=4).replica(hot(0.3), "a") is None
    # Queues: no spare prefill for a copy (a request or more queued per worker on average).
    queued = {w: WorkerLoad(free_blocks=30000, capacity_blocks=30000, queued=2,
                            pending_prefill_tokens=ld.pending_prefill_tokens)
              for w, ld in loads.items()}
    queued["b"] = kv()  # even with the cheapest worker without it idle
    busy = RouteQuery(1024, 16, {"a": 60}, queued, 1, 1, prefix_rate=0.3)
    assert pol.rank(busy)[0].worker == "a" and pol.replica(busy, "a") is None
    with pytest.raises(ValueError, match="spread_demand"):
        KvrouteCost(spread_demand=-1)


def test_kvroute_keeps_a_long_prefill_off_short_queued_requests() -> None:
    """The batch term: a 6000-token prompt sent where three short requests wait would be
    prefilled in their iteration and delay their first tokens by its own prefill; a worker
    with a busier decode batch but no queue takes it instead. A queue that does not fit one
    iteration with it (the worker's reported budget, else ``batch_tokens``) is admitted
    ahead of it, and the term is off."""
    waiting = WorkerLoad(queued=3, pending_prefill_tokens=300)
    decoding = WorkerLoad(running=20)  # 640 in decode terms, more than the 300 queued
    busy = WorkerLoad(running=100)  # a third worker keeps the mean queue at 1: no affinity

    def first(pol: KvrouteCost, a: WorkerLoad, prompt: int) -> str:
        return pol.rank(q({}, {"a": a, "b": decoding, "c": busy}, prompt=prompt))[0].worker

    assert first(KvrouteCost(batch_weight=0), waiting, 6000) == "a"
    assert first(KvrouteCost(), waiting, 6000) == "b"
    small_budget = WorkerLoad(queued=3, pending_prefill_tokens=300, max_batched_tokens=4096)
    assert first(KvrouteCost(), small_budget, 6000) == "a"
    assert first(KvrouteCost(batch_tokens=4096), waiting, 6000) == "a"
    # A short prompt adds little delay: the queue ahead is still the cheaper wait.
    assert first(KvrouteCost(), waiting, 64) == "a"
    # An engine that chunks prefills (vLLM V1) puts the prompt's first budget - pending
    # tokens in the queue's iteration whatever its length: a queue that would not fit it
    # whole is still delayed by that chunk (3796 tokens here).
    chunking = KvrouteCost(chunked_prefill=1)
    assert first(chunking, small_budget, 6000) == "b"
    assert first(chunking, waiting, 6000) == "b"
    full = WorkerLoad(queued=3, pending_prefill_tokens=300, max_batched_tokens=300)
    assert first(chunking, full, 6000) == "a"  # no room left in that iteration: no delay
    # A worker that reports how its engine admits long prompts is taken at its word,
    # whatever the policy assumes of the others.
    reports = replace(small_budget, prefill_mode=PrefillMode.CHUNKED)
    assert first(KvrouteCost(), reports, 6000) == "b"
    assert first(chunking, replace(small_budget, prefill_mode=PrefillMode.WHOLE), 6000) == "a"
    with pytest.raises(ValueError, match="chunked_prefill"):
        KvrouteCost(chunked_prefill=0.5)


def test_kvroute_keeps_a_long_prefill_off_a_worker_many_requests_reach() -> None:
    """The arrival term: a long prefill delays every request that reaches its worker while
    it runs (half of it each, on average), so it goes where fewer arrive, even past a small
    queue; a short one costs arrivals next to nothing and takes the shorter queue. Caches
    without room turn the term off: there a placement decides what is evicted."""
    def load(rate: float, fill: int = 0, **kw: int) -> WorkerLoad:
        return WorkerLoad(arrival_rate=rate, capacity_blocks=1000, free_blocks=1000,
                          cached_blocks=fill, **kw)

    def first(pol: KvrouteCost, a: WorkerLoad, b: WorkerLoad, prompt: int) -> str:
        return pol.rank(q({}, {"a": a, "b": b}, prompt=prompt))[0].worker

    # 8000 tokens: ~9k units of work, 0.78 s of prefill; the ~3 requests that reach a (4/s)
    # meanwhile wait ~0.39 s each: ~14k units, weighed 0.5, against b's 500-token queue.
    busy, calm = load(4.0), load(0.25, pending_prefill_tokens=500)
    assert first(KvrouteCost(arrival_weight=0), busy, calm, 8000) == "a"
    assert first(KvrouteCost(), busy, calm, 8000) == "b"
    assert first(KvrouteCost(), busy, calm, 200) == "a"
    cost = KvrouteCost().rank(q({}, {"a": busy, "b": load(0.0)}, prompt=8000))
    n = 8000 * (1 + KvrouteCost().attn * 4000)  # work(8000, 0)
    extra = {s.worker: s.cost for s in cost}
    assert extra["a"] - extra["b"] == pytest.approx(0.5 * 4.0 * 8.6e-5 * n * n / 2, rel=1e-9)
    # Half the caches full: half the weight; all full: none.
    half = {s.worker: s.cost for s in KvrouteCost().rank(
        q({}, {"a": load(4.0, 1000), "b": load(0.0)}, prompt=8000))}
    assert half["a"] - half["b"] == pytest.approx((extra["a"] - extra["b"]) / 2, rel=1e-9)
    full = KvrouteCost().rank(q({}, {"a": load(4.0, 1000), "b": load(0.25, 1000,
                                                                       pending_prefill_tokens=500)},
                                prompt=8000))
    assert full[0].worker == "a"


def test_the_churn_term_sends_a_new_prompt_where_the_least_was_prefilled() -> None:
    """The churn term: a prompt no worker caches most of goes where the least was prefilled
    lately, past a small queue: ``churn_s`` (0.3 s) of each worker's prefill rate while the
    caches have room (what was prefilled there comes back there, and waits behind it),
    ``churn_full_s`` (3 s) once they are full (each prefilled token evicts a cached one),
    linear between. For a prompt cached somewhere the term does nothing."""
    def load(rate: float, fill: int, **kw: int) -> WorkerLoad:
        return WorkerLoad(prefill_rate=rate, capacity_blocks=1000, free_blocks=1000,
                          cached_blocks=fill, **kw)

    def extra(pol: KvrouteCost, fill: int) -> float:
        """What the term adds to a worker prefilling 4000 tokens/s at that fill."""
        loads = {"a": load(4000.0, fill), "b": load(0.0, fill)}
        got = {s.worker: s.cost for s in pol.rank(q({}, loads))}
        base = {s.worker: s.cost for s in off.rank(q({}, loads))}
        assert got["b"] == base["b"]
        return got["a"] - base["a"]

    off = KvrouteCost(churn_s=0.0, churn_full_s=0.0)
    on = KvrouteCost()
    assert (on.churn_s, on.churn_full_s) == (0.3, 3.0)  # the defaults
    churning, calm = load(4000.0, 1000), load(100.0, 1000, pending_prefill_tokens=500)
    assert off.rank(q({}, {"a": churning, "b": calm}))[0].worker == "a"
    assert on.rank(q({}, {"a": churning, "b": calm}))[0].worker == "b"
    assert extra(on, 1000) == pytest.approx(3.0 * 4000.0)  # full: churn_full_s x tokens/s
    assert extra(on, 300) == pytest.approx(0.3 * 4000.0)  # room (fill under 0.4): churn_s
    assert extra(on, 600) == pytest.approx(1.65 * 4000.0)  # half-way up the ramp
    assert extra(KvrouteCost(churn_s=0.0), 300) == 0.0
    # Room in the caches: the term alone still moves the new prompt off the busy prefiller.
    roomy = {"a": load(4000.0, 300), "b": load(100.0, 300, pending_prefill_tokens=500)}
    assert on.rank(q({}, roomy))[0].worker == "b"
    # Most of the prompt cached on a: the hit decides, the churn term is not added.
    assert list(on.rank(q({"a": 60}, {"a": churning, "b": calm}))) == list(
        off.rank(q({"a": 60}, {"a": churning, "b": calm})))
    with pytest.raises(ValueError, match="churn_s"):
        KvrouteCost(churn_s=-1.0)
    with pytest.raises(ValueError, match="churn_full_s"):
        KvrouteCost(churn_full_s=-1.0)


def test_kvroute_avoids_a_worker_whose_kv_is_full() -> None:
    full = WorkerLoad(free_blocks=0, capacity_blocks=30000, cached_blocks=30000)
    empty = WorkerLoad(free_blocks=30000, capacity_blocks=30000, cached_blocks=30000)
    assert KvrouteCost().rank(q({"a": 8}, {"a": full, "b": empty}))[0].worker == "b"


def test_kvroute_weighs_kv_only_as_the_caches_fill() -> None:
    """The KV term ramps in with the caches' mean fill: with room, a worker holding more KV
    but running fewer sequences is the cheaper; once the caches are full, its KV decides."""
    def load(held: int, running: int, fill: float) -> WorkerLoad:
        return WorkerLoad(free_blocks=30000 - held, capacity_blocks=30000, running=running,
                          cached_blocks=int(30000 * fill))

    def best(fill: float, **kw: float) -> str:
        loads = {"a": load(6000, 1, fill), "b": load(100, 3, fill)}
        return KvrouteCost(**kw).rank(q({}, loads))[0].worker

    assert best(0.3) == "a" and best(0.4) == "a"  # up to kv_fill_from: off
    assert best(0.9) == "b" and best(0.8) == "b"  # from kv_fill_full: whole
    # between, in proportion: a's 5900 blocks more x 16 tokens x 0.1 x ramp against b's
    # 2 running sequences more x 32
    pol = KvrouteCost()
    costs = {s.worker: s.cost for s in pol.rank(q({}, {"a": load(6000, 1, 0.5),
                                                       "b": load(100, 3, 0.5)}))}
    assert costs["a"] - costs["b"] == pytest.approx(5900 * 16 * 0.1 * 0.25 - 2 * 32)
    assert best(0.0, kv_fill_from=0.0, kv_fill_full=0.0) == "b"  # always on
    with pytest.raises(ValueError, match="kv_fill_from"):
        KvrouteCost(kv_fill_from=0.9, kv_fill_full=0.5)


def test_kvroute_leaves_a_hot_worker_when_its_queue_outweighs_the_hit() -> None:
    busy = WorkerLoad(pending_prefill_tokens=8000, running=4)
    r = KvrouteCost().rank(q({"a": 60}, {"a": busy, "b": IDLE}))
    assert r[0].worker == "b"
    light = WorkerLoad(pending_prefill_tokens=100)
    assert KvrouteCost().rank(q({"a": 60}, {"a": light, "b": IDLE}))[0].worker == "a"


def test_kvroute_counts_inflight_before_heartbeats_report_it() -> None:
    r = KvrouteCost().rank(q({}, {"a": WorkerLoad(inflight=3), "b": IDLE}))
    assert r[0].worker == "b"


def test_cached_tokens_never_exceed_the_prompt() -> None:
    query = q({"a": 100}, {"a": IDLE}, prompt=50)
    assert query.cached_tokens("a") == 50
    assert KvrouteCost().rank(query)[0].cost == 0  # fully cached, idle: nothing to pay


def test_ties_follow_affinity_stably() -> None:
    loads = {f"w{i}": IDLE for i in range(8)}
    first = {KvrouteCost().rank(q({}, loads, affinity=a))[0].worker for a in range(64)}
    assert len(first) > 4  # different prefixes spread over workers
    same = {KvrouteCost().rank(q({}, loads, affinity=99))[0].worker for _ in range(5)}
    assert len(same) == 1  # the same prefix sticks


def test_round_robin_cycles_and_ranks_everyone() -> None:
    rr = RoundRobin()
    loads = {"a": IDLE, "b": IDLE, "c": IDLE}
    firsts = [rr.rank(q({"c": 64}, loads))[0].worker for _ in range(6)]
    assert firsts == ["a", "b", "c", "a", "b", "c"]
    assert sorted(s.worker for s in rr.rank(q({}, loads))) == ["a", "b", "c"]


def test_least_loaded() -> None:
    loads = {"a": WorkerLoad(running=3), "b": WorkerLoad(queued=1), "c": WorkerLoad(inflight=2)}
    assert [s.worker for s in LeastLoaded().rank(q({"a": 64}, loads))] == ["b", "c", "a"]


def test_registry() -> None:
    assert make_policy("kvroute").name == "kvroute"
    with pytest.raises(ValueError, match="round_robin"):
        make_policy("nope")


def test_every_policy_ranks_every_worker() -> None:
    from kvroute.core.policies import REGISTRY

    loads = {f"w{i}": WorkerLoad(running=i) for i in range(5)}
    for name in REGISTRY:
        ranked = make_policy(name).rank(q({"w3": 8}, loads))
        assert sorted(s.worker for s in ranked) == sorted(loads), name


def test_kvroute_keeps_prefix_families_apart_under_overload() -> None:
    """Calm: load decides among uncached workers. Overloaded: the request's rendezvous
    order does, even against a little extra queue."""
    from kvroute.core.policies import tie_break

    names = [f"w{i}" for i in range(4)]
    aff = 12345
    preferred = min(names, key=lambda w: tie_break(aff, w))
    last = max(names, key=lambda w: tie_break(aff, w))

    def loads(queued: int) -> dict[str, WorkerLoad]:
        return {w: WorkerLoad(queued=queued, pending_prefill_tokens=0 if w == last else 200)
                for w in names}

    assert KvrouteCost().rank(q({}, loads(0), affinity=aff))[0].worker == last
    assert KvrouteCost().rank(q({}, loads(6), affinity=aff))[0].worker == preferred
    # Only the part no worker caches is placed by family: a prompt cached whole on one
    # worker ranks as if there were no affinity term at all.
    cached = q({"w1": 64}, loads(6), affinity=aff)
    assert list(KvrouteCost().rank(cached)) == list(KvrouteCost(affinity_weight=0).rank(cached))
