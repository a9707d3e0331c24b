"""The replay simulator on the shared Mooncake trace and on small hand-made traces."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import pytest

from kvroute.simulations.cluster import SimRequest
from kvroute.simulations.generators import generate
from kvroute.simulations.metrics import (
    global_lru_hits,
    hit_ratio,
    infinite_cache_hits,
    measure,
    ttft_floor,
)
from kvroute.simulations.policies import REPLAY_REGISTRY as REGISTRY
from kvroute.simulations.policies import make_replay_policy as make_policy
from kvroute.simulations.replay import ClusterSpec, Replayer
from kvroute.simulations.trace import Trace, TraceError, TraceRequest, load, parse
from tests.support import MOONCAKE_TRACE


@pytest.fixture(scope="module")
def mooncake() -> Trace:
    return load(MOONCAKE_TRACE)


def test_shared_trace_known_figures(mooncake: Trace) -> None:
    assert len(mooncake.requests) == 3993
    assert mooncake.block_size == 512
    assert not mooncake.skipped
    # README of the trace: 65% of prompt tokens are prefix hits with an infinite cache.
    assert hit_ratio(mooncake, infinite_cache_hits(mooncake)) == pytest.approx(0.65, abs=0.005)
    assert sum(r.prompt_tokens for r in mooncake.requests) / 3993 == pytest.approx(15325, abs=1)


def test_malformed_lines_are_reported_with_their_line_numbers() -> None:
    good = json.dumps({"timestamp": 0, "input_length": 600, "output_length": 2,
                       "hash_ids": [1, 2]})
    lines = [good, "{nope", json.dumps({"timestamp": 5, "input_length": 600,
                                        "output_length": 1, "hash_ids": [1]}), "",
             json.dumps({"timestamp": -1, "token_ids": [1]})]
    tr = parse(lines, source="t.jsonl")
    assert len(tr.requests) == 1
    assert [s.split(":")[1] for s in tr.skipped] == ["2", "3", "5"]
    assert "expected 2" in tr.skipped[1]
    with pytest.raises(TraceError, match=r"t.jsonl:2:"):
        parse(lines, source="t.jsonl", strict=True)


def test_token_traces_use_the_router_block_keys() -> None:
    from kvroute.core.blocks import BlockHasher

    toks = list(range(40))
    tr = parse([json.dumps({"timestamp": 0, "token_ids": toks, "output_length": 3})])
    assert tr.block_size == 16
    assert list(tr.requests[0].keys) == BlockHasher(16, "default").keys(toks)


def head(trace: Trace, n: int, scale: float) -> Trace:
    return Trace(trace.requests[:n], trace.block_size, trace.source).scaled(scale)


def run(trace: Trace, policy: str, **spec: object):
    return Replayer(trace, make_policy(policy), ClusterSpec(**spec)).run()  # type: ignore[arg-type]


def test_deterministic_for_a_seed(mooncake: Trace) -> None:
    tr = head(mooncake, 600, 2.0)
    from kvroute.simulations.cli import make_policies

    for name in ("kvroute", "random"):
        a = [Replayer(tr, make_policies(name, 7)[0](), ClusterSpec(workers=4)).run()
             for _ in range(2)]
        assert [(r.worker, r.first_token_s, r.finished_s) for r in a[0].requests] == \
               [(r.worker, r.first_token_s, r.finished_s) for r in a[1].requests]


@pytest.mark.parametrize(("chunked", "threshold"), [(False, 0), (True, 0), (True, 512)])
def test_conservation(mooncake: Trace, chunked: bool, threshold: int) -> None:
    tr = head(mooncake, 800, 2.0)
    res = run(tr, "kvroute", workers=4, capacity_blocks=600, chunked_prefill=chunked,
              prefill_budget=4096 if chunked else 16384, long_prefill_threshold=threshold)
    # Every request once, and each background copy of a hot prefix (kvroute's replicate).
    every = [*res.requests, *res.copies]
    assert sum(len(w.finished) for w in res.workers) == len(every)
    assert {id(r) for w in res.workers for r in w.finished} == {id(r) for r in every}
    for r in every:
        assert r.arrival_s <= r.first_token_s <= r.finished_s
    prompt = sum(r.prompt_tokens for r in every)
    assert sum(w.prefill_tokens for w in res.workers) + sum(
        r.cached_tokens for r in every) == prompt
    for w in res.workers:  # every block back in the pool: nothing leaked
        assert w.pool.free_blocks == w.pool.capacity_blocks


def test_a_reply_is_read_from_the_request_that_carries_it() -> None:
    """A reply's blocks are those of the first later prompt that holds this prompt and its
    reply; a prompt that only shares this one's full blocks is not its continuation."""
    def rec(ms: int, ids: list[int], n: int, out: int, **more: object) -> str:
        return json.dumps({"timestamp": ms, "input_length": n, "output_length": out,
                           "hash_ids": ids, "block_size": 16, **more})

    first = list(range(1, 11))
    turns = [rec(0, first, 160, 40),  # 199 tokens computed: blocks 10 and 11 fill
             rec(5, [*first, 99], 170, 8),  # same documents, its own question
             rec(9, [*first, 11, 12, 13, 14], 216, 8)]  # + the reply + a new message
    tr = parse(turns)
    assert tr.reply_keys() == [tr.requests[2].keys[10:12], (), ()]
    assert tr.scaled(2.0).reply_keys() == tr.reply_keys()
    # With sessions, only a request of the same session continues one.
    tr = parse([rec(0, first, 160, 40, session=1), rec(9, [*first, 11, 12, 13], 200, 8,
                                                         session=2)])
    assert tr.reply_keys() == [(), ()]
    tr = parse([rec(0, first, 160, 40, session=1), rec(9, [*first, 11, 12, 13], 200, 8,
                                                         session=1)])
    assert tr.reply_keys()[0] == tr.requests[1].keys[10:12]
    with pytest.raises(TraceError, match="session must be"):
        parse([rec(0, first, 160, 40, session=[1])], strict=True)


def test_replies_are_hits_within_the_bound() -> None:
    """On chat traffic the next turns hit the replies they carry, and the infinite cache,
    which holds every reply too, still bounds the hit ratio."""
    tr = parse([json.dumps(r) for r in generate("chat", 300, 10.0, seed=5, block_size=16)])
    replies = tr.reply_keys()
    assert sum(map(len, replies)) > 100
    bound = hit_ratio(tr, infinite_cache_hits(tr))
    res = run(tr, "kvroute", workers=2, capacity_blocks=20000)
    assert measure(res).hit_ratio <= bound + 1e-12
    reply_keys = {k for keys in replies for k in keys}
    hit_replies = sum(k in reply_keys for r in res.requests
                      for k in r.keys[:r.cached_tokens // 16])
    assert hit_replies > 100


def test_a_continuation_is_sent_when_the_reply_it_carries_ends() -> None:
    """A chat turn cannot be sent before the reply it carries has ended: closed loop, the
    replay sends it then (its TTFT counts from then) and it hits that reply; open loop (the
    default), it goes at its trace time and misses the reply, still being generated. Other
    requests keep their times."""
    first = tuple(range(1, 11))
    tr = Trace([TraceRequest(0.0, 160, 40, first, session="a"),  # 199 computed: 12 blocks
                TraceRequest(0.05, 216, 8, (*first, 11, 12, 13), session="a"),
                TraceRequest(0.1, 64, 4, (50, 51, 52, 53), session="b")], 16)
    assert tr.continuations() == [1, -1, -1]
    assert tr.reply_keys()[0] == (11, 12)
    res = run(tr, "kvroute", workers=2, predict_ttl_s=0.0, propagation_s=0.0, closed_loop=True)
    a, b, c = res.requests
    assert a.finished_s > 0.5  # 39 decode steps after its first token
    assert b.arrival_s == a.finished_s and b.waited_s == pytest.approx(a.finished_s - 0.05)
    assert b.worker == a.worker and b.cached_tokens == 12 * 16  # its prompt and reply
    assert b.first_token_s - b.arrival_s < 0.05  # from when it was sent
    assert (c.arrival_s, c.waited_s) == (0.1, 0.0)
    m = measure(res)
    assert m.waited_ratio == pytest.approx(1 / 3)
    assert m.waited_mean_s == pytest.approx(b.waited_s)
    opened = run(tr, "kvroute", workers=2, predict_ttl_s=0.0, propagation_s=0.0)
    a, b, _ = opened.requests
    assert b.arrival_s == 0.05 and b.arrival_s < a.finished_s and b.waited_s == 0
    assert b.cached_tokens == 10 * 16  # the prompt only: the reply was not stored yet
    assert measure(opened).waited_ratio == 0


def test_a_continuation_sent_elsewhere_joins_that_worker_when_it_is_sent() -> None:
    """Closed loop, the replay runs workers ahead only as far as no released continuation
    could reach them: a worker whose watched request ends later (behind a long prefill) is
    not run past the time another's reply ends, so the continuation routed to it from there
    joins its queue when it is sent."""
    a, b = (1, 2, 3, 4), (21, 22, 23, 24)
    tr = Trace([TraceRequest(0.0, 64, 40, a, session="a"),  # -> w00, behind the long one
                TraceRequest(0.001, 64, 45, b, session="b"),  # -> w01, ends ~0.6 s
                TraceRequest(0.002, 4000, 2, tuple(range(100, 350)), session="c"),  # -> w00
                TraceRequest(0.003, 64, 2, (40, 41, 42, 43), session="d"),  # -> w01
                TraceRequest(0.004, 128, 2, (*b, 25, 26, 27, 28), session="b"),  # -> w00
                TraceRequest(0.005, 128, 2, (*a, 5, 6, 7, 8), session="a"),
                TraceRequest(10.0, 64, 2, (90, 91, 92, 93), session="e")], 16)
    assert tr.continuations()[:2] == [5, 4]
    res = run(tr, "round_robin", workers=2, predict_ttl_s=0.0, closed_loop=True)
    ra, rb, _, _, cb, _, _ = res.requests
    assert (ra.worker, rb.worker, cb.worker) == ("w00", "w01", "w00")
    assert cb.arrival_s == rb.finished_s < ra.finished_s
    assert cb.first_token_s - cb.arrival_s < 0.05  # a decode step and its own prefill


@pytest.mark.parametrize("policy", ["kvroute", "round_robin"])
def test_every_continuation_waits_for_its_reply_and_no_longer(policy: str) -> None:
    """On generated chat and agent traffic faster than the cluster answers, each
    continuation is sent exactly when the reply it carries ends, or at its trace time if
    later, wherever the policy sends it; every request is routed once."""
    for kind in ("chat", "agent"):
        tr = parse([json.dumps(r) for r in generate(kind, 400, 40.0, seed=2, block_size=16)])
        res = run(tr, policy, workers=3, capacity_blocks=30000, closed_loop=True)
        reqs = res.requests
        late = 0
        for i, j in enumerate(tr.continuations()):
            if j >= 0:
                sent = max(tr.requests[j].arrival_s, reqs[i].finished_s)
                assert reqs[j].arrival_s == sent
                assert reqs[j].waited_s == pytest.approx(sent - tr.requests[j].arrival_s)
                late += reqs[j].waited_s > 0
        assert late > 20
        assert sorted(r.idx for r in reqs) == list(range(len(tr.requests)))
        assert all(r.first_token_s >= r.arrival_s for r in reqs)
        opened = run(tr, policy, workers=3, capacity_blocks=30000)
        assert [r.arrival_s for r in opened.requests] == [r.arrival_s for r in tr.requests]


def test_hit_ratio_never_exceeds_the_infinite_cache_bound(mooncake: Trace) -> None:
    tr = head(mooncake, 800, 1.0)
    bound = hit_ratio(tr, infinite_cache_hits(tr))
    for name in sorted(REGISTRY):
        assert measure(run(tr, name, workers=4)).hit_ratio <= bound + 1e-12, name


@pytest.mark.parametrize("mode", ["plain", "chunked", "programs"])
def test_no_request_beats_the_ttft_floor(mooncake: Trace, mode: str) -> None:
    """The floor (own prefill after the infinite cache's hits, nothing queued) bounds every
    request's TTFT under every policy: with whole and chunked prefills, KV fetches
    (mooncake), and forks run as programs; and the floor is met when nothing queues."""
    from kvroute.simulations.generators import generate

    if mode == "programs":
        recs = generate("fork", 300, rate_per_s=20.0, seed=5, block_size=64)
        tr = parse([json.dumps(r) for r in recs])
    else:
        tr = head(mooncake, 500, 2.0)
    spec = ClusterSpec(workers=4, chunked_prefill=mode == "chunked", programs=mode == "programs",
                       prefill_budget=2048 if mode == "chunked" else 16384)
    floor = ttft_floor(tr, spec.cost)
    assert len(floor) == len(tr.requests) and (floor > 0).all()
    for name in sorted(REGISTRY):
        res = Replayer(tr, make_policy(name), spec).run()
        ttft = [r.first_token_s - r.arrival_s for r in res.requests]
        low = [(r.idx, t, f) for r, t, f in zip(res.requests, ttft, floor, strict=True)
               if t < f - 1e-9]
        assert not low, (name, low[:3])
    # Spread far apart on one worker, each request waits for nothing and finds every prefix
    # an earlier one brought: its TTFT is the floor's.
    apart = Trace([replace(r, arrival_s=i * 1000.0) for i, r in enumerate(tr.requests[:50])],
                  tr.block_size, tr.source)
    res = Replayer(apart, make_policy("round_robin"), ClusterSpec(workers=1)).run()
    assert [r.first_token_s - r.arrival_s for r in res.requests] == pytest.approx(
        list(ttft_floor(apart, spec.cost)), rel=1e-9, abs=1e-9)


def test_single_worker_every_policy_agrees(mooncake: Trace) -> None:
    tr = head(mooncake, 400, 1.0)
    results = {name: measure(run(tr, name, workers=1)) for name in sorted(REGISTRY)}
    first = next(iter(results.values()))
    for name, m in results.items():
        assert (m.hit_ratio, m.ttft_mean_s, m.e2e_p99_s) == (
            first.hit_ratio, first.ttft_mean_s, first.e2e_p99_s), name
        assert m.moved_ratio == 0, name  # no other worker to hold a prefix
    # One worker with the cluster's whole capacity is the global-LRU reference exactly.
    assert first.hit_ratio == pytest.approx(hit_ratio(tr, global_lru_hits(tr, 937)), abs=0.02)


def test_moves_off_a_cached_prefix_are_counted(mooncake: Trace) -> None:
    tr = head(mooncake, 600, 1.0)
    moved = {name: measure(run(tr, name, workers=8)).moved_ratio
             for name in ("round_robin", "llmd", "kvroute")}
    # Round robin ignores caches, so it walks away from most cached prefixes; the cache-aware
    # policies rarely do. Each move is a hit given up, so hit + moved stays within the bound.
    assert moved["round_robin"] > 0.03 > 0.01 > max(moved["llmd"], moved["kvroute"]), moved
    bound = hit_ratio(tr, infinite_cache_hits(tr))
    rr = measure(run(tr, "round_robin", workers=8))
    assert rr.hit_ratio + rr.moved_ratio <= bound + 1e-9


def test_a_prefix_the_router_cannot_see_yet_is_counted_in_flight_or_stale() -> None:
    from kvroute.simulations.metrics import missed_hits


    prefix = tuple(range(100, 164))  # 64 blocks of 16 tokens, ~90 ms of prefill
    first_ends = 0.0915  # its prefill (1040 tokens), then one decode step
    tr = Trace([TraceRequest(0.0, 1040, 2, (*prefix, 1)),  # its own last block
                TraceRequest(0.001, 1040, 2, (*prefix, 2)),  # while the first prefills
                TraceRequest(5.0, 1040, 2, (*prefix, 3))], 16)  # long after: cached
    # Round robin sends the second elsewhere while the first computes the prefix: its 1024
    # prefix tokens are lost in flight, not moved (nothing cached yet); the third hits.
    res = run(tr, "round_robin", workers=2, predict_ttl_s=0.0)
    assert res.requests[0].first_token_s == pytest.approx(first_ends, abs=0.002)
    assert [r.cached_tokens for r in res.requests] == [0, 0, 1024]
    assert missed_hits(res) == [(0, 0, 0), (1024, 0, 0), (0, 0, 0)]
    m = measure(res)
    assert m.inflight_ratio == pytest.approx(1024 / 3120) and m.moved_ratio == 0
    # The router's coalescing holds the second for the first's prefill: a hit, none lost.
    res = run(tr, "kvroute", workers=2, predict_ttl_s=0.01)
    assert [r.cached_tokens for r in res.requests] == [0, 1024, 1024]
    assert missed_hits(res) == [(0, 0, 0)] * 3
    # 20 ms after the first's prefill ended, round robin sends a sharer to a third worker:
    # the prefix is cached on the first's, but its event (50 ms) has not reached the
    # router, so the miss is stale; delivered at once, the router saw it: moved.
    tr = Trace([TraceRequest(0.0, 1040, 2, (*prefix, 1)),
                TraceRequest(0.001, 64, 2, (7, 8, 9, 10)),  # unrelated, to the second
                TraceRequest(first_ends + 0.02, 1040, 2, (*prefix, 3))], 16)
    late = run(tr, "round_robin", workers=3, predict_ttl_s=0.0)
    assert [r.worker for r in late.requests] == ["w00", "w01", "w02"]
    assert late.requests[2].cached_tokens == 0 and late.requests[2].moved_tokens == 0
    assert missed_hits(late) == [(0, 0, 0), (0, 0, 0), (0, 1024, 0)]
    # One figure per request in the result's order, whatever that is (a closed-loop replay
    # sends requests out of trace order): requests.csv pairs them up.
    late.requests.reverse()
    assert missed_hits(late) == [(0, 1024, 0), (0, 0, 0), (0, 0, 0)]
    assert measure(late).stale_ratio == pytest.approx(1024 / 2144)
    now = run(tr, "round_robin", workers=3, predict_ttl_s=0.0, propagation_s=0.0)
    assert now.requests[2].moved_tokens == 1024 and missed_hits(now)[2] == (0, 0, 0)


def test_a_prefix_no_worker_holds_any_more_is_counted_evicted() -> None:
    from kvroute.simulations.metrics import missed_hits

    prefix = tuple(range(100, 132))  # 32 blocks of 16 tokens
    other = tuple(range(500, 560))  # 60 blocks: more than the cache has beside the prefix
    tr = Trace([TraceRequest(0.0, 528, 2, (*prefix, 1)),
                TraceRequest(1.0, 976, 2, (*other, 2)),  # evicts most of the prefix
                TraceRequest(2.0, 528, 2, (*prefix, 3))], 16)
    res = run(tr, "kvroute", workers=1, capacity_blocks=70)
    third = res.requests[2]
    assert third.cached_tokens < 512 and third.moved_tokens == 0
    assert missed_hits(res)[2] == (0, 0, 512 - third.cached_tokens)
    assert measure(res).evicted_ratio == pytest.approx((512 - third.cached_tokens) / 2032)
    # With room for both, nothing is evicted.
    roomy = run(tr, "kvroute", workers=1, capacity_blocks=200)
    assert roomy.requests[2].cached_tokens == 512
    assert missed_hits(roomy) == [(0, 0, 0)] * 3


@pytest.mark.parametrize("policy", ["kvroute", "round_robin", "mooncake_local"])
def test_every_token_the_infinite_cache_hits_is_got_or_missed_for_one_reason(
        mooncake: Trace, policy: str) -> None:
    """Per request: hits + moved + in flight + stale + evicted = the infinite cache's hits
    (a small cache, so all of them occur)."""
    from kvroute.simulations.metrics import missed_hits

    tr = head(mooncake, 600, 2.0)
    res = run(tr, policy, workers=4, capacity_blocks=300)
    inf = infinite_cache_hits(tr)
    missed = missed_hits(res)
    for r, m in zip(res.requests, missed, strict=True):
        assert r.cached_tokens + r.moved_tokens + sum(m) == inf[r.idx], r.idx
    assert sum(m.evicted for m in missed) > 0
    got = measure(res)
    assert (got.hit_ratio + got.moved_ratio + got.inflight_ratio
            + got.stale_ratio + got.evicted_ratio) == pytest.approx(hit_ratio(tr, inf))


def test_a_request_waits_for_an_in_flight_prefill_only_when_it_gets_most_of_it() -> None:
    shared = tuple(range(100, 164))  # 64 blocks of 16 tokens
    # A fork: the second branch gets 1024 of the 1040 tokens the first prefills: it waits
    # for them (on one worker the policy has no other choice to make).
    fork = Trace([TraceRequest(0.0, 1040, 2, (*shared, 1)),
                  TraceRequest(0.001, 1040, 2, (*shared, 2))], 16)
    res = run(fork, "kvroute", workers=1)
    assert res.requests[1].after is res.requests[0]
    assert res.requests[1].cached_tokens == 1024
    # Parallel agent calls: 4 shared blocks, 60 of their own. The second is not held for
    # the first's 1024-token prefill; with share 0 (always wait) it is.
    agent = Trace([TraceRequest(0.0, 1024, 2, (*shared[:4], *range(200, 260))),
                   TraceRequest(0.001, 1024, 2, (*shared[:4], *range(300, 360)))], 16)
    res = run(agent, "kvroute", workers=1)
    assert res.requests[1].after is None
    always = run(agent, "kvroute", workers=1, coalesce_share=0.0)
    assert always.requests[1].after is always.requests[0]


def test_a_prediction_stands_until_its_prefill_is_stored() -> None:
    """Under load a prefill may finish seconds after it was routed: the prediction lasts
    until its store event (within the TTL), so a request sharing the prefix half a second
    later still finds it in flight and waits for it."""
    shared = tuple(range(100, 164))
    busy = [TraceRequest(0.0, 12288, 2, tuple(range(1000 * i, 1000 * i + 768)))
            for i in range(1, 3)]  # a second or more of prefill on each of the 2 workers
    tr = Trace([*busy, TraceRequest(0.0, 1040, 2, (*shared, 1)),
                TraceRequest(0.5, 1040, 2, (*shared, 2))], 16)
    res = run(tr, "kvroute", workers=2)
    assert res.requests[2].first_token_s > 1.0  # still in flight at 0.5 s
    assert res.requests[3].after is res.requests[2]
    assert res.requests[3].cached_tokens == 1024
    # A 10 ms prediction is gone by then: nothing to wait for.
    assert run(tr, "kvroute", workers=2, predict_ttl_s=0.01).requests[3].after is None


def test_hits_moves_and_bursts_stay_within_the_bound(mooncake: Trace) -> None:
    tr = head(mooncake, 600, 2.0)
    bound = hit_ratio(tr, infinite_cache_hits(tr))
    for name in ("round_robin", "llmd", "kvroute", "mooncake_local"):
        m = measure(run(tr, name, workers=8, predict_ttl_s=0.0))
        assert m.hit_ratio + m.moved_ratio + m.inflight_ratio + m.stale_ratio \
            <= bound + 1e-9, name


def test_mooncake_ordering_holds_at_high_load(mooncake: Trace) -> None:
    """FAST'25 (conversation trace): random >> load balancing > cache-aware, in mean TTFT."""
    tr = head(mooncake, 1500, 2.0)
    ttft = {name: measure(run(tr, name)).ttft_mean_s
            for name in ("random", "least_loaded", "kvroute")}
    assert ttft["random"] > 1.5 * ttft["least_loaded"] > 1.5 * ttft["kvroute"], ttft


def test_propagation_delay_is_modelled(mooncake: Trace) -> None:
    tr = head(mooncake, 600, 1.5)
    # Without the router's predictions, which stand for its own requests until their events
    # arrive (however late), staleness shows in full.
    fresh = measure(run(tr, "kvroute", workers=8, propagation_s=0.0, predict_ttl_s=0)).hit_ratio
    stale = measure(run(tr, "kvroute", workers=8, propagation_s=30.0, predict_ttl_s=0)).hit_ratio
    assert stale < fresh


def test_forks_run_as_programs_prefill_the_shared_prefix_once() -> None:
    """Controller-program forks (placed once, prefix prefilled once, branches beside it)
    against the same branches routed as independent requests, as peer routers do."""
    from kvroute.simulations.generators import generate

    recs = generate("fork", 240, rate_per_s=20.0, seed=3, block_size=64)
    tr = parse([json.dumps(r) for r in recs])
    assert all(r.program for r in tr.requests)
    # Independent requests, no coalescing: what a peer router does.
    indep = Replayer(tr, make_policy("kvroute"), ClusterSpec(workers=4, predict_ttl_s=0)).run()
    progs = Replayer(tr, make_policy("kvroute"),
                     ClusterSpec(workers=4, programs=True, overflow=False)).run()
    prefill = {name: sum(w.prefill_tokens for w in res.workers)
               for name, res in (("indep", indep), ("progs", progs))}
    assert prefill["progs"] < 0.5 * prefill["indep"], prefill
    # Every branch of a program ran on one worker; the first led (prefilling the shared
    # prefix with its suffix, unless the worker held it) and the others found it cached.
    by_prog: dict[str, list[int]] = {}
    for r, t in zip(progs.requests, tr.requests, strict=True):
        by_prog.setdefault(t.program, []).append(r.idx)
    followed = 0
    for members in by_prog.values():
        assert len({progs.requests[i].worker for i in members}) == 1
        for i in members:
            r = progs.requests[i]
            if r is not progs.requests[members[0]]:
                assert shares_prefix(tr, members, r)
            if r.after is not None:
                followed += 1
                assert r.after is progs.requests[members[0]]
                assert r.first_token_s > r.after.first_token_s
    assert followed > len(progs.requests) / 2  # most programs' prefixes were cold
    assert all(math.isfinite(r.finished_s) for r in progs.requests)


def shares_prefix(tr: Trace, members: list[int], r: SimRequest) -> bool:
    """Whether ``r`` found the full blocks its program's branches share cached (64-token
    blocks)."""
    keysets = [tr.requests[i].keys for i in members]
    lcp = 0
    while all(len(k) > lcp and k[lcp] == keysets[0][lcp] for k in keysets):
        lcp += 1
    return r.cached_tokens >= 64 * min(lcp, (r.prompt_tokens - 1) // 64)


def test_siblings_routed_on_predictions_wait_for_the_first_prefill() -> None:
    """Coalescing: with predicted entries, a fork's siblings (arriving together, as plain
    requests) go where the first went and are admitted after its prefill, so each hits the
    shared prefix; without predictions they spread and each prefills it."""
    from kvroute.simulations.generators import generate

    recs = generate("fork", 240, rate_per_s=20.0, seed=3, block_size=64)
    tr = parse([json.dumps(r) for r in recs])
    plain = Replayer(tr, make_policy("kvroute"), ClusterSpec(workers=4, predict_ttl_s=0)).run()
    co = Replayer(tr, make_policy("kvroute"), ClusterSpec(workers=4)).run()  # the default
    hits = measure(co).hit_ratio, measure(plain).hit_ratio
    assert hits[0] > hits[1] + 0.3, hits
    by_prog: dict[str, list[int]] = {}
    for t, r in zip(tr.requests, co.requests, strict=True):
        by_prog.setdefault(t.program, []).append(r.idx)
    held = [co.requests[i] for m in by_prog.values() for i in m if co.requests[i].after]
    assert len(held) > len(by_prog)  # most siblings waited for one of theirs
    for r in held:
        assert r.worker == r.after.worker and r.first_token_s > r.after.first_token_s
        lcp = 0
        while lcp < min(len(r.keys), len(r.after.keys)) and r.keys[lcp] == r.after.keys[lcp]:
            lcp += 1
        assert r.cached_tokens >= 64 * min(lcp, (r.prompt_tokens - 1) // 64)  # shared: a hit
    assert all(math.isfinite(r.finished_s) for r in co.requests)


def test_programs_that_do_not_fit_their_worker_overflow_to_the_next_longest_prefix() -> None:
    """The router's placement rule in the simulator: with small batches under load, some
    branches leave their program's worker; each still finds the shared prefix cached there
    (that worker prefilled it once), and nothing is lost."""
    from kvroute.simulations.generators import generate

    recs = generate("fork", 240, rate_per_s=60.0, seed=3, block_size=64)
    tr = parse([json.dumps(r) for r in recs])
    runs = {}
    for overflow in (False, True):
        rep = Replayer(tr, make_policy("kvroute"),
                       ClusterSpec(workers=4, programs=True, overflow=overflow, max_batch=6))
        runs[overflow] = (rep, rep.run())
    assert runs[False][0].overflowed == 0
    rep, res = runs[True]
    assert rep.overflowed > 0
    by_prog: dict[str, list[int]] = {}
    for r, t in zip(res.requests, tr.requests, strict=True):
        by_prog.setdefault(t.program, []).append(r.idx)
    split = [m for m in by_prog.values() if len({res.requests[i].worker for i in m}) > 1]
    assert split
    for members in split:
        first: dict[str, SimRequest] = {}
        for i in members:  # wherever it ran, its worker's first branch left the prefix there
            r = res.requests[i]
            lead = first.setdefault(r.worker, r)
            if r is not lead:
                assert r.after in (None, lead) and shares_prefix(tr, members, r), r
    assert all(math.isfinite(r.finished_s) for r in res.requests)
    assert sum(r.output_tokens for r in res.requests) == sum(t.output_tokens
                                                             for t in tr.requests)


def test_a_warm_up_is_kept_through_scaling_and_must_leave_requests_to_measure() -> None:
    tr = parse([json.dumps(r) for r in generate("chat", 50, 20.0, seed=2)])
    warm = tr.with_warmup(10).scaled(2.0)
    assert warm.warmup == 10 and warm.measured == warm.requests[10:]
    assert warm.continuations() == tr.continuations()
    res = Replayer(warm, make_policy("kvroute"), ClusterSpec(workers=2)).run()
    assert res.warmup == 10 and [r.idx for r in res.measured] == list(range(10, 50))
    assert measure(res).requests == 40
    for n in (-1, 50):
        with pytest.raises(ValueError, match="warm-up must leave a request to measure"):
            tr.with_warmup(n)


def test_hash_ids_expand_to_tokens_that_share_exactly_the_shared_ids() -> None:
    from kvroute.simulations.trace import expand_tokens

    a = expand_tokens([1, 2, 3], 1400, block_size=512)
    b = expand_tokens([1, 2, 9], 1536, block_size=512)
    assert len(a) == 1400 and len(b) == 1536
    assert a[:1024] == b[:1024] and a[1024:1400] != b[1024:1400]
    assert expand_tokens([1, 2, 3], 1400, block_size=512) == a  # deterministic
    assert max(a) < 50257


@pytest.mark.parametrize("load", [0.6, 0.9])
def test_hot_prefixes_are_copied_while_their_requests_stay(load: float) -> None:
    """kvroute's replicas: where a prefix's demand would have moved a request off its busy
    holder, the request stays and the router copies the prefix to the worker it would have
    moved to; the copy is a one-token request of the prefix's whole blocks, measured apart."""
    from kvroute.core.policies import Kvroute
    from kvroute.simulations.metrics import capacity_rps

    class NoCopies(Kvroute):
        places_replicas = False

    tr = parse([json.dumps(r) for r in generate("rag", 600, 20.0, seed=1, block_size=64)])
    spec = ClusterSpec(workers=4)
    tr = tr.scaled(load * capacity_rps(tr, 4, spec.capacity_blocks, spec.cost)
                   / (len(tr.requests) / tr.duration_s))
    copying = Replayer(tr, make_policy("kvroute"), spec).run()
    moving = Replayer(tr, NoCopies(), spec).run()
    assert copying.copies and not moving.copies
    for c in copying.copies:
        made_by = copying.requests[c.copy_of]
        assert c.keys == made_by.keys[: len(c.keys)] and c.output_tokens == 1
        assert c.prompt_tokens == len(c.keys) * tr.block_size <= made_by.prompt_tokens
        assert c.worker != made_by.worker  # the copy goes where the request did not
        assert c.arrival_s == made_by.arrival_s and c.first_token_s >= c.arrival_s
    # No two copies of one prefix to one worker at once.
    live = {}
    for c in copying.copies:
        key = (c.worker, c.keys[-1])
        assert not live.get(key, -1.0) > c.arrival_s
        live[key] = c.first_token_s
    m_copy, m_move = measure(copying), measure(moving)
    assert m_copy.copies == len(copying.copies) and m_move.copies == 0
    copied = sum(c.prompt_tokens - c.cached_tokens for c in copying.copies)
    assert m_copy.copied_ratio == pytest.approx(
        copied / sum(r.prompt_tokens for r in copying.requests))
    assert m_move.copied_ratio == 0 and m_copy.moved_ratio < m_move.moved_ratio


def test_the_router_sees_each_workers_arrival_rate() -> None:
    """The replay counts what it routes to each worker as the router does (ArrivalRate, 30 s
    window, counted from the first arrival), and a policy reads that rate in the load view
    at every decision; and so the tokens they had to prefill (``prefill_rate``)."""
    from kvroute.core.load import ARRIVAL_MIN_WINDOW_S, ARRIVAL_TAU_S
    from kvroute.core.policies import RoundRobin

    seen: list[dict[str, float]] = []

    class Recording(RoundRobin):
        def rank(self, query):  # type: ignore[no-untyped-def]
            seen.append({w: ld.arrival_rate for w, ld in query.loads.items()})
            # each prompt is 100 new tokens: 100 tokens per request
            for ld in query.loads.values():
                assert ld.prefill_rate == pytest.approx(100 * ld.arrival_rate, rel=1e-9)
            return super().rank(query)

    tr = parse([json.dumps({"timestamp": 1000 * i, "input_length": 100, "output_length": 2,
                            "hash_ids": [i]}) for i in range(40)])
    res = Replayer(tr, Recording(), ClusterSpec(workers=2)).run()
    for i, rates in enumerate(seen):
        for w in rates:
            want = sum(math.exp(-(i - j) / ARRIVAL_TAU_S) / ARRIVAL_TAU_S
                       for j in range(i) if res.requests[j].worker == w)
            # ... over the 1 - e^(-t / tau) of a steady rate that i seconds of counting hold
            want /= -math.expm1(-max(i, ARRIVAL_MIN_WINDOW_S) / ARRIVAL_TAU_S)
            assert rates[w] == pytest.approx(want, rel=1e-9, abs=1e-12), (i, w)
    # A request every 2 s on each worker for 39 s: 0.5/s, not the 0.36 of an uncorrected
    # sum (0.5/s x (1 - e^(-39/30))), less a little for the count's steps.
    assert 0.45 < min(seen[-1].values()) <= max(seen[-1].values()) < 0.55


def test_a_host_tier_behind_each_worker_is_a_hit_the_router_weighs(mooncake: Trace) -> None:
    """Workers with a host tier load evicted prefixes back instead of computing them; a
    router that follows the tier's events (weighted, or as GPU hits) finds them, one that
    drops them (ignore) only by chance."""
    tr = head(mooncake, 800, 2.0)
    spec = dict(workers=4, capacity_blocks=600)
    none = measure(run(tr, "kvroute", **spec))
    runs = {view: run(tr, "kvroute", **spec, host_blocks=2400, lower_tier=view)
            for view in ("weighted", "gpu", "ignore")}
    hits = {view: measure(res).hit_ratio for view, res in runs.items()}
    assert hits["weighted"] > none.hit_ratio + 0.05  # the tier holds what the GPU evicted
    assert hits["ignore"] < hits["weighted"] - 0.02  # unseen, it is hit by chance only
    for res in runs.values():
        every = [*res.requests, *res.copies]
        loaded = sum(r.loaded_tokens for r in every)
        assert 0 < loaded <= sum(r.cached_tokens for r in every)
        assert sum(w.prefill_tokens for w in res.workers) + sum(
            r.cached_tokens for r in every) == sum(r.prompt_tokens for r in every)
    with pytest.raises(ValueError, match="lower_tier must be one of"):
        ClusterSpec(lower_tier="cpu")
